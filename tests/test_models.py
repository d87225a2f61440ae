"""The example models (models/mlp.py, models/transformer.py, models/llama.py, models/vit.py)
on the simulated mesh give the dense program's loss and every gradient under the standard
layouts: data parallel, Megatron tensor parallel, both, FSDP (``params.d_model:data``),
sequence parallel (``seq:model``), a vocab-parallel LM head, for the llama and the ViT
pipelines (``layer:stage``) with each schedule, and the ViT's spatial split (``height:data``).

Models are built at their ``Config.tiny()`` sizes (and transformer variants with
RMSNorm, a tied head and dropout), so the whole file runs in seconds.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import re
from pathlib import Path

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
# mesh, layout, micro-batches, schedule: what `meshdsl check llama --tiny` is run on
LLAMA_LAYOUTS = {
    "dp": ("data:2", "batch:data", 1, "gpipe"),
    "megatron": ("model:2", "kv_heads:model; d_ff:model", 1, "gpipe"),
    "dp+megatron": ("data:2; model:2", "batch:data; kv_heads:model; d_ff:model", 1, "gpipe"),
    "dp+megatron+fsdp": ("data:2; model:2", "batch:data; kv_heads:model; d_ff:model; params.d_model:data", 1,
                         "gpipe"),
    **{f"pipe-{sched}-m{m}": ("stage:2", "layer:stage", m, sched) for sched in ("gpipe", "1f1b", "zbh1")
       for m in (2, 4)},
    "pipe+dp": ("stage:2; data:2", "layer:stage; batch:data", 2, "1f1b"),
}
# mesh, layout, micro-batches, schedule: what `meshdsl check vit --tiny` is run on; "spatial" splits
# the images' height (the patches inherit it: see test_vit_spatial_split_moves_no_image_data)
VIT_LAYOUTS = {
    "dp": ("data:2", "batch:data", 1, "gpipe"),
    "megatron": ("model:2", "heads:model; d_ff:model", 1, "gpipe"),
    "dp+megatron": ("data:2; model:2", "batch:data; heads:model; d_ff:model", 1, "gpipe"),
    "dp+megatron+fsdp": ("data:2; model:2", "batch:data; heads:model; d_ff:model; params.d_model:data", 1,
                         "gpipe"),
    **{f"pipe-{sched}-m{m}": ("stage:2", "layer:stage", m, sched) for sched in ("gpipe", "1f1b", "zbh1")
       for m in (2, 4)},
    "pipe+dp": ("stage:2; data:2", "layer:stage; batch:data", 2, "1f1b"),
    "spatial": ("data:2", "height:data", 1, "gpipe"),
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


@pytest.mark.parametrize("layout", list(LLAMA_LAYOUTS))
def test_llama_matches_dense(layout):
    mesh, lay, microbatches, schedule = LLAMA_LAYOUTS[layout]
    _, outs, feeds, want = _reference("llama")
    plan = md.compile(outs, mesh, lay, microbatches=microbatches, schedule=schedule)
    # a pipelined layout really runs as one (the rotary tables, read by every layer, reach each stage)
    assert any(s.kind == "pipeline" for s in plan.steps) == ("stage" in mesh)
    got = md.run_simulated(plan, feeds)
    _assert_matches(got, want, f"llama mesh='{mesh}' layout='{lay}' m={microbatches} {schedule}")


def test_llama_megatron_communicates_activations_only():
    """kv_heads:model; d_ff:model: per layer, one allreduce after attention and one after the
    MLP in the forward; the rotary tables are sliced on each rank, never moved."""
    model, *_ = _reference("llama")
    plan = md.compile({"loss": model.loss}, "model:2", "kv_heads:model; d_ff:model")
    cfg = model.config
    one = cfg.batch * cfg.seq * cfg.d_model * 4  # one [batch, seq, d_model] fp32 activation
    n = 2 * cfg.layers
    assert plan.totals() == {"allreduce": {"count": n, "bytes": n * one}}


def test_llama_learns_below_the_unigram_entropy():
    """A small llama (one block) with the text models' default recipe, AdamW with warmup, cosine
    decay and clipping, learns more than byte frequencies from a slice of the default corpus in
    200 steps (measured: eval 2.22 nats/token against an entropy of 3.21)."""
    from meshdsl.train.data import ByteTokenizer, TokenData, default_corpus_text
    data = TokenData(ByteTokenizer().encode(default_corpus_text(300_000)), seed=0)
    r = md.fit("llama", mesh="data:1", steps=200, data=data, optimizer="adamw", lr=1e-2, warmup_steps=20,
               lr_schedule="cosine", clip_norm=1.0, samples=0, eval_batches=8,
               config=dict(vocab=256, d_model=32, kv_heads=2, group=2, d_head=8, d_ff=96, layers=1, seq=32, batch=16))
    assert r.final_eval_loss < data.unigram_entropy() - 0.5, (r.final_eval_loss, data.unigram_entropy())


# One layout family each on gloo processes (with the vit's data-parallel training run below,
# every family of the new models has run on real processes).
ON_PROCESSES = {
    "llama-pipeline": ["llama", "--mesh", "stage:2", "--layout", "layer:stage", "--microbatches", "2",
                       "--schedule", "1f1b"],
    "llama-megatron": ["llama", "--mesh", "model:2", "--layout", "kv_heads:model; d_ff:model"],
    "vit-fsdp": ["vit", "--mesh", "data:2", "--layout", "batch:data; params.d_model:data"],
}


@pytest.mark.parametrize("job", list(ON_PROCESSES))
def test_new_models_on_processes(job, capsys):
    from meshdsl.tools import cli
    name, *rest = ON_PROCESSES[job]
    rc = cli.main(["check", name, "--tiny", *rest, "--nproc", "2"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "2 processes" in out and "OK: " in out
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("layout", list(VIT_LAYOUTS))
def test_vit_matches_dense(layout):
    mesh, lay, microbatches, schedule = VIT_LAYOUTS[layout]
    model, outs, feeds, want = _reference("vit")
    outs = {**outs, "accuracy": model.metrics["accuracy"]}
    plan = md.compile(outs, mesh, lay, microbatches=microbatches, schedule=schedule)
    assert any(s.kind == "pipeline" for s in plan.steps) == ("stage" in mesh)
    got = md.run_simulated(plan, feeds)
    want = {**want, "accuracy": md.run_dense({"accuracy": model.metrics["accuracy"]}, feeds)["accuracy"]}
    _assert_matches(got, want, f"vit mesh='{mesh}' layout='{lay}' m={microbatches} {schedule}")


def _pixel_values(plan) -> list[str]:
    """The collectives, at any depth of ``plan``, that move image data: a value with a batch
    dim and a pixel dim (the images, the patches before their embedding)."""
    pixel_dims = {"height", "width", "channels", "hp_wp", "patch_feat"}
    found, stack = [], [plan]
    while stack:
        p = stack.pop()
        for s in p.steps:
            for v in s.ins if s.is_collective else ():
                dims = set(p.values[v].shape.names)
                if "batch" in dims and dims & pixel_dims:
                    found.append(f"{s.kind} {s.label}: {p.values[v].shape}")
            stack.extend(s.subplans)
    return found


@pytest.mark.parametrize("mesh, layout", [("data:2", "height:data"), ("data:2; model:2", "batch:data; height:model")])
def test_vit_spatial_split_moves_no_image_data(mesh, layout):
    """``height:data``: the patchify keeps the split (``hp`` is the outer part of ``height`` and of
    ``patches``), so the images and patches never move, forward or backward; the patches' split is
    implied, and the position embedding is split with them (its gradient is not summed over that axis)."""
    model, outs, *_ = _reference("vit")
    plan = md.compile(outs, mesh, layout)
    axis = layout.split("height:")[1]
    assert plan.values[plan.inputs["images"]].sharding.split["height"] == (axis,)
    # (the keys' key_patches meet the queries' patches: whole, gathered once by the rename)
    assert [str(r) for r, _ in plan.layout.implied] == [f"hp_wp:{axis}", f"patches:{axis}"]
    assert _pixel_values(plan) == []
    unbucketed = md.compile(outs, mesh, layout, bucket_mb=0)   # each gradient's sum a step of its own
    summed = {s.label: s.axes for s in unbucketed.steps if s.is_collective}
    assert axis in summed["grad/w_patch"] and axis not in summed.get("grad/pos", ()), summed


def test_vit_trains_on_its_images_on_two_gloo_processes(capsys, tmp_path, one_torch_thread):
    """``meshdsl train vit --nproc 2 --mesh data:2 --layout batch:data`` (each rank building its own
    rows of generated images) gives the one-process run's losses, eval loss and accuracy."""
    from meshdsl.tools import cli
    from meshdsl.train.run_outputs import read_metrics
    common = ["train", "vit", "--tiny", "--steps", "4", "--eval-every", "2", "--samples", "0"]
    rc = cli.main([*common, "--nproc", "2", "--mesh", "data:2", "--layout", "batch:data",
                   "--out", str(tmp_path / "two")])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "data: the model's own batches" in out and "final eval accuracy" in out and "adamw" in out
    assert multiprocessing.active_children() == []
    assert cli.main([*common, "--mesh", "data:1", "--out", str(tmp_path / "one")]) == 0, capsys.readouterr().err
    two, one = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in two if "eval_accuracy" in r] == [2, 4]
    num_eval_rows = 4 * load_model("vit", tiny=True).config.batch
    # fp32: the two ranks' gradient halves are summed in another order (~1e-7 over 4 AdamW steps);
    # accuracy: a reassociated logit may at most flip a row whose two top logits tie within ~1e-6
    for key, atol in (("loss", 1e-6), ("eval_loss", 1e-6), ("eval_accuracy", 1 / num_eval_rows)):
        got = torch.tensor([r.get(key) or 0.0 for r in two], dtype=torch.float64)
        want = torch.tensor([r.get(key) or 0.0 for r in one], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=key)


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


@pytest.mark.parametrize("name", ["mlp", "transformer", "llama", "vit"])
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


# ----------------------------------------------------------------------------- the README's model table

_HEADER_MESH = {"DP": "data:2", "Megatron": "model:2", "FSDP": "data:2", "pipeline": "stage:2", "also": "data:2"}


def _readme_cells():
    """(model, family, mesh, layout) for every layout cell of README.md's model table."""
    lines = (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| model | DP"))
    families = [c.strip().split(" ")[0] for c in lines[start].strip("|").split("|")][1:]
    cells = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        name, *row = [c.strip() for c in ln.strip("|").split("|")]
        for family, cell in zip(families, row):
            code = re.findall(r"`([^`]*)`", cell)
            if code and ":" in code[0]:
                given = [c for c in code[1:] if re.fullmatch(r"\w+:\d+(; \w+:\d+)*", c)]
                mesh = given[0] if given else _HEADER_MESH[family]
                cells.append((name, family, mesh, code[0]))
    return cells


@pytest.mark.parametrize("name, family, mesh, layout", _readme_cells())
def test_every_layout_of_the_readme_model_table_matches_dense(name, family, mesh, layout):
    _, outs, feeds, want = _reference(name)
    m = 2 if family == "pipeline" else 1
    plan = md.compile(outs, mesh, layout, microbatches=m, schedule="1f1b")
    _assert_matches(md.run_simulated(plan, feeds), want, f"{name} {family} {mesh} {layout}")
