"""Every shipped model against its plain-torch twin (``tests/torch_twins.py``), in float64.

The layout tests compare the plan with the dense program, and both build their gradients
from the same ``Op.grad`` rules, so a wrong rule passes them.  Here the dense program's
loss, every gradient and the SGD step's new params are compared with a model written
again in ordinary torch and differentiated by torch autograd, from the same weights and
feeds: a wrong gradient rule on a model's path, a wrong mask or a wrong shape rule shows.

float64: the shipped models declare float32 leaves, so each model is built with its
float32 params and inputs declared float64 instead (:func:`build_float64`); the check
that every float value of the graph is then float64 makes sure nothing ran in float32.
The params are their initial values plus noise, so that norm scales (init 1) and biases
(init 0) are not special values that a missing scale or bias term would agree with.
"""
from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

import meshdsl as md
from meshdsl.core.graph import topo_nodes
from meshdsl.train.model import load_model, shipped_models
from meshdsl.train.step import training_outputs
from torch_twins import TWINS

# float64 eps is 1.1e-16.  The two programs differ in summation order and in formulation
# (a fused attention kernel against written-out softmax, the DSL's backward kernels against
# autograd's), each rounding a few ulps of the values involved, over at most a few hundred
# chained ops here: the differences stay below ~1e-13 of each output's largest magnitude.
# 1e-10 keeps three orders of margin and still catches any wrong rule (off by O(1)), a
# dropped term, or an eps off by 1e-5.
REL = 1e-10
LR = 0.1

CASES = [(name, variant) for name, (_, variants) in TWINS.items() for variant in variants]


@contextlib.contextmanager
def _float64_leaves():
    """``md.param`` and ``md.input`` declare float64 where a model asks for float32."""
    originals = {"param": md.param, "input": md.input}

    def in_float64(fn):
        sig = inspect.signature(fn)

        def make(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            if bound.arguments["dtype"] == torch.float32:
                bound.arguments["dtype"] = torch.float64
            return fn(*bound.args, **bound.kwargs)
        return make

    try:
        for name, fn in originals.items():
            setattr(md, name, in_float64(fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(md, name, fn)


def build_float64(name: str, **overrides) -> md.Model:
    """The shipped model ``name`` at ``Config.tiny()`` with ``overrides``, its float leaves float64."""
    with _float64_leaves():
        return load_model(name, tiny=True, **overrides)


def _float_dtypes(outputs) -> set[torch.dtype]:
    """The dtypes of the float values read or made by every node with a float result, inside
    repeat blocks too.  A constant counts where a reader does float math with it (a float32
    scalar compared with an integer tensor is no float math)."""
    seen, stack = set(), [topo_nodes(list(outputs))]
    while stack:
        for n in stack.pop():
            if n.op.name != "constant" and any(t.dtype.is_floating_point for t in n.outputs):
                seen.update(t.dtype for t in (*n.inputs, *n.outputs) if t.dtype.is_floating_point)
            block = n.attrs.get("block")
            if block is not None:
                stack.append(block.graph.nodes)
    return seen


def _weights_and_feeds(model: md.Model, seed: int = 0):
    """The params (initial values plus noise) and the feeds (float ones in float64)."""
    gen = torch.Generator().manual_seed(seed)
    params = {k: v + 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
              for k, v in md.DenseProgram(dict(model.params)).init_params(seed).items()}
    feeds = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in model.feeds(seed).items()}
    return params, feeds


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=REL, atol=REL * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name, variant", CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_dense_program_matches_the_torch_twin(name, variant):
    twin_class, variants = TWINS[name]
    model = build_float64(name, **variants[variant])
    outs = {**training_outputs(model.loss, model.params, LR, with_grads=True), **model.outputs, **model.metrics}
    assert _float_dtypes(outs.values()) == {torch.float64}
    params, feeds = _weights_and_feeds(model)
    got = md.run_dense(outs, feeds, params)

    twin = twin_class(model.config, params)
    want = twin(feeds)
    want["loss"].backward()
    grads = twin.grads()
    assert {k.removeprefix("grad/") for k in outs if k.startswith("grad/")} == set(grads)
    assert set(want) <= set(outs)
    for k, v in want.items():
        _assert_close(got[k], v.detach(), f"{name}[{variant}] '{k}'")
    for k, g in grads.items():
        assert g.abs().max() > 0, f"{name}[{variant}]: the loss does not reach '{k}'; the comparison would be vacuous"
        _assert_close(got[f"grad/{k}"], g, f"{name}[{variant}] 'grad/{k}'")
        _assert_close(got[f"new/{k}"], params[k] - LR * g, f"{name}[{variant}] 'new/{k}' (SGD, lr {LR})")
    if name == "moe":  # the capacity rule is on the path: some routings are dropped
        assert int(got["moe/dropped"]) > 0


def test_every_shipped_model_has_a_twin():
    missing = sorted(set(shipped_models()) - set(TWINS))
    assert not missing, (f"shipped models without a plain-torch twin: {missing}; "
                         "add one to tests/torch_twins.py TWINS")


def test_the_dropout_twin_drops_what_the_dsl_drops():
    """The twin's mask is the DSL's (so the dropout variants compare like with like), and
    the DSL keeps each element with the rate's odds, scaled by 1/(1-rate)."""
    from torch_twins import dropout_keep
    b, s, d = md.Dim("batch", 32), md.Dim("seq", 16), md.Dim("d_model", 8)
    rate = 0.25
    with md.Graph():
        x = md.input("x", [b, s, d], torch.float64)
        y = md.dropout(x, rate, seed=5)
    ones = torch.ones(b.size, s.size, d.size, dtype=torch.float64)
    got = md.run_dense({"y": y}, {"x": ones})["y"]
    keep = dropout_keep((b.size, s.size, d.size), rate, seed=5, layer=None)
    assert torch.equal(got, keep.to(torch.float64) / (1 - rate))
    n = keep.numel()
    # The kept count is Binomial(n, 0.75); 5 standard deviations is a 1-in-1.7-million miss.
    assert abs(int(keep.sum()) - n * (1 - rate)) < 5 * (n * rate * (1 - rate)) ** 0.5
