"""The example models (models/mlp.py, models/transformer.py) on the simulated mesh
give the dense program's loss and every gradient under the standard layouts:
data parallel, Megatron tensor parallel, both, FSDP (``params.d_model:data``),
sequence parallel (``seq:model``) and a vocab-parallel LM head.

Models are built at their ``Config.tiny()`` sizes (and transformer variants with
RMSNorm, a tied head and dropout), so the whole file runs in seconds.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from meshdsl.train.model import Model, load_model, load_module, find_model_file
from meshdsl.train.step import training_outputs

# fp32: a split contraction or reduction adds its partial results in another
# order than the dense program, so outputs differ by rounding only -- at most
# ~n * 2**-24 of the output's magnitude for the n <= 64 terms summed here
# (~4e-6; measured <= 1e-6).  1e-5 of each output's largest magnitude keeps a
# margin while any wrong slice, dropped shard or doubled partial sum is O(1).
REL = 1e-5

MLP_LAYOUTS = {
    "dp": ("data:2", "batch:data"),
    "tp": ("model:2", "d_ff:model"),
    "dp+tp": ("data:2; model:2", "batch:data; d_ff:model"),
    "fsdp": ("data:2", "batch:data; params.d_model:data"),
    "fsdp+tp": ("data:2; model:2", "batch:data; d_ff:model; params.d_model:data"),
}
GPT_LAYOUTS = {
    "dp": ("data:2", "batch:data"),
    "tp": ("model:2", "heads:model; d_ff:model"),
    "dp+tp": ("data:2; model:2", "batch:data; heads:model; d_ff:model"),
    "fsdp": ("data:2", "batch:data; params.d_model:data"),
    "sp": ("model:2", "seq:model"),
    "dp+sp": ("data:2; model:2", "batch:data; seq:model"),
    "vocab": ("model:2", "vocab:model"),
    "tp4": ("model:4", "heads:model; d_ff:model; vocab:model"),
}
GPT_VARIANTS = {
    "base": {},
    "rms+tied+dropout": {"norm": "rms", "tied": True, "dropout": 0.1},
}

_BUILT: dict = {}


def _reference(name: str, **overrides):
    """The model, its loss+grads outputs, feeds and dense results (built once per variant)."""
    key = (name, tuple(sorted(overrides.items())))
    if key not in _BUILT:
        model = load_model(name, tiny=True, **overrides)
        outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}
        feeds = model.feeds(0)
        _BUILT[key] = (model, outs, feeds, md.run_dense(outs, feeds))
    return _BUILT[key]


def _assert_matches(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want)
    for k, ref in want.items():
        scale = ref.abs().max().item()
        torch.testing.assert_close(got[k], ref, rtol=REL, atol=REL * scale,
                                   msg=lambda m, k=k: f"{what}: output '{k}': {m}")


@pytest.mark.parametrize("layout", list(MLP_LAYOUTS))
def test_mlp_matches_dense(layout):
    mesh, lay = MLP_LAYOUTS[layout]
    _, outs, feeds, want = _reference("mlp")
    got = md.run_simulated(md.compile(outs, mesh, lay), feeds)
    _assert_matches(got, want, f"mlp mesh='{mesh}' layout='{lay}'")


@pytest.mark.parametrize("variant", list(GPT_VARIANTS))
@pytest.mark.parametrize("layout", list(GPT_LAYOUTS))
def test_transformer_matches_dense(layout, variant):
    mesh, lay = GPT_LAYOUTS[layout]
    _, outs, feeds, want = _reference("transformer", **GPT_VARIANTS[variant])
    got = md.run_simulated(md.compile(outs, mesh, lay), feeds)
    _assert_matches(got, want, f"transformer[{variant}] mesh='{mesh}' layout='{lay}'")


def test_sgd_step_matches_dense():
    """The update phase too: new params after one SGD step, FSDP-sharded."""
    model = load_model("transformer", tiny=True)
    outs = training_outputs(model.loss, model.params, 0.1)
    feeds = model.feeds(1)
    want = md.run_dense(outs, feeds)
    got = md.run_simulated(md.compile(outs, "data:2; model:2", "batch:data; heads:model; params.d_model:data"), feeds)
    _assert_matches(got, want, "sgd step")


def test_megatron_tp_communicates_activations_only():
    """heads:model + d_ff:model: forward allreduces once after attention and once after the MLP."""
    model, outs, _, _ = _reference("transformer")
    plan = md.compile({"loss": model.loss}, "model:2", "heads:model; d_ff:model")
    (rep,) = [s for s in plan.steps if s.kind == "repeat"]
    sub = [s for s in rep.subplans[0].steps if s.is_collective]
    assert [s.kind for s in sub] == ["allreduce", "allreduce"]
    sub_bytes = sub[0].bytes  # one [batch, seq, d_model] fp32 activation
    assert sub_bytes == model.config.batch * model.config.seq * model.config.d_model * 4
    n = 2 * model.config.layers
    assert plan.totals() == {"allreduce": {"count": n, "bytes": n * sub_bytes}}


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_model_protocol(name):
    module = load_module(find_model_file(name))
    model = module.build(module.Config.tiny())
    assert isinstance(model, Model)
    assert model.loss.shape == md.Shape([])
    assert set(model.params) == set(model.graph.params)
    feeds = model.feeds(0)
    assert set(feeds) == set(model.graph.inputs)
    for k, v in feeds.items():
        t = model.graph.inputs[k]
        assert tuple(v.shape) == t.shape.sizes and v.dtype == t.dtype
    assert torch.equal(feeds[next(iter(feeds))], model.feeds(0)[next(iter(feeds))])  # deterministic


def test_transformer_defaults_are_the_small_gpt():
    cfg = load_module(find_model_file("transformer")).Config()
    assert dataclasses.astuple(cfg)[:8] == (256, 256, 8, 32, 1024, 4, 64, 16)


def test_transformer_labels_are_next_tokens():
    model, *_ = _reference("transformer")
    f = model.feeds(3)
    assert torch.equal(f["ids"][:, 1:], f["labels"][:, :-1])
