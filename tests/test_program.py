"""The executor's straight-line program (meshdsl/runtime/program.py): the interpreted loop's
numbers, its timings when asked, its errors, and its frees."""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.ops.registry import OPS
from meshdsl.runtime import program
from meshdsl.train.model import load_model


def _executor(mesh="data:2", layout="batch:data"):
    model = load_model("transformer", tiny=True)
    outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}
    plan = md.compile(outs, mesh, layout)
    return model, md.Executor(plan, md.SimulatedComm(plan.mesh))


def _interpreted(ex, feeds, params):
    """The step-by-step loop, as a run missing a feed takes it (every name given: it runs through)."""
    saved = ex._needs
    ex._needs = (frozenset({"no such input"}), frozenset())
    try:
        return ex.run(feeds, params)
    finally:
        ex._needs = saved


def test_the_program_gives_the_interpreted_loops_numbers_timed_or_not():
    model, ex = _executor()
    params = ex.init_params(0)
    want = _interpreted(ex, model.feeds(0), params)
    stats = {}
    for got in (ex.run(model.feeds(0), params), ex.run(model.feeds(0), params, stats=stats)):
        for k in want:
            for g, w in zip(got[k], want[k]):
                # the same kernels on the same tensors in the same order: bitwise equal
                torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda s: f"{k}: {s}")
    assert stats["local"] > 0 and stats["allreduce"] + stats.get("bucket_allreduce", 0.0) > 0


def test_a_missing_feed_or_param_is_the_steps_error():
    model, ex = _executor()
    params = ex.init_params(0)
    with pytest.raises(md.GraphError, match="no value fed for input 'labels'"):
        ex.run({"ids": model.feeds(0)["ids"]}, params)
    del params["wte"]
    with pytest.raises(md.GraphError, match="no value for param 'wte'"):
        ex.run(model.feeds(0), params)


def test_aliases_bind_the_same_tensor_and_their_kernels_return_their_input():
    x = torch.randn(3)
    for op in program.ALIASES:   # the program binds instead of calling: the kernel must agree
        assert OPS[op].compute(None, {"mapping": {}}, x) is x
    model, ex = _executor("data:1", "")
    ex.run(model.feeds(0), ex.init_params(0))
    src = ex._programs[0].source
    assert "K" in src and "R" in src   # kernels inline, the loops through their rules


def test_env_keeps_only_what_rules_still_read_and_the_outputs():
    model, ex = _executor()
    seen = {}
    rules = list(ex.calls)

    def spy(i, call):
        def wrapped(env, get, run):
            seen[i] = set(env)
            return call(env, get, run)
        return wrapped
    # the program reads calls when it is written, at the first run
    ex.calls[:] = [spy(i, c) if ex.plan.steps[i].kind == "repeat" else c for i, c in enumerate(rules)]
    ex.rules = tuple(ex.calls)
    ex.run(model.feeds(0), ex.init_params(0))
    later = {i: {v for j in ex.order[ex.order.index(i):] for v in ex.plan.steps[j].ins} for i in seen}
    for i, names in seen.items():
        # a value in env when a loop starts is one the loop or a later step reads, or an output
        assert names <= later[i] | set(ex.plan.outputs.values()), i


@pytest.mark.parametrize("mesh, layout", [("data:2", "batch:data"), ("data:1; model:2", "heads:model; d_ff:model")])
def test_a_loops_body_program_gives_the_per_layer_runs_numbers(mesh, layout, monkeypatch):
    """A layer loop runs its body as a program with positional feeds and a tuple of outputs
    (layers._Body); the numbers are bitwise those of ``Executor.run`` per layer, timed or not."""
    from meshdsl.runtime import layers
    model, ex = _executor(mesh, layout)
    params = ex.init_params(0)
    calls, body = [], layers._Body.__call__
    monkeypatch.setattr(layers._Body, "__call__", lambda self, *a: calls.append(1) or body(self, *a))
    stats = {}
    got = [ex.run(model.feeds(0), params), ex.run(model.feeds(0), params, stats=stats)]
    # two runs, each a forward and a backward loop over every layer
    assert len(calls) == 2 * 2 * model.config.layers and stats["local"] > 0
    monkeypatch.setattr(layers._Body, "of", classmethod(lambda cls, sub, ins, outs: None))   # Executor.run per layer
    _, plain = _executor(mesh, layout)
    want = plain.run(model.feeds(0), params)
    for run in got:
        for k in want:
            for g, w in zip(run[k], want[k]):
                # the same kernels on the same tensors in the same order: bitwise equal
                torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda s: f"{k}: {s}")


@pytest.mark.parametrize("pos, scale, bias", [(2, True, True), (2, True, False), (2, False, False), (1, True, True)])
def test_layer_norms_direct_kernels_are_its_computes(pos, scale, bias):
    """The program calls a layer norm's kernels without ctx (Op.direct): the same numbers, bitwise."""
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    n = x.shape[pos]
    params = [torch.randn(n, generator=g) for on in (scale, bias) if on]
    attrs = {"dim": "d", "eps": 1e-5, "scale": scale, "bias": bias, "pos": pos}
    fwd, bwd = OPS["layer_norm"], OPS["layer_norm_backward"]
    want = fwd.compute(None, attrs, x, *params)
    got = fwd.direct(attrs)(x, *params)
    for w, o in zip(want, got, strict=True):
        torch.testing.assert_close(o, w, rtol=0, atol=0)
    ins = (dy, x, want[1], want[2], *params[:1 if scale else 0])
    for w, o in zip(bwd.compute(None, attrs, *ins), bwd.direct(attrs)(*ins), strict=True):
        torch.testing.assert_close(o, w, rtol=0, atol=0)


def test_an_add_into_an_operand_is_called_directly():
    """An in-place add whose operands need no moves runs without ctx, into the same operand."""
    from meshdsl.ops.inplace import add_into_first, add_into_second, direct_add
    plain = {"align": ((None, None), (None, None))}
    assert direct_add(add_into_first, {"align": ((1, 0), None)}) is None   # a moved operand: the kernel's own
    for fn in (add_into_first, add_into_second):
        x, y = torch.randn(4), torch.randn(4)
        want = fn(None, plain, x.clone(), y.clone())
        into = (x, y)[fn is add_into_second]
        got = direct_add(fn, plain)(x, y)
        assert got is into
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    b, d, e = md.Dim("batch", 4), md.Dim("d_model", 4), md.Dim("e", 4)
    with md.Graph():
        x, w, v = md.input("x", [b, d]), md.param("w", [d, e]), md.param("v", [d, e])
        mm = "batch d_model, d_model e -> batch e"
        out = {"s": md.einsum(mm, x, w) + md.einsum(mm, x, v)}   # a fresh product, read once: added into
    plan = md.compile(out, "data:1", "")
    ex = md.Executor(plan, md.SimulatedComm(plan.mesh))
    xv, wv, vv = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    got = ex.run({"x": xv}, {"w": [wv], "v": [vv]})["s"][0]
    torch.testing.assert_close(got, xv @ wv + xv @ vv, rtol=0, atol=0)   # the same add, in the same order
    (i,) = ex.add_into
    assert f"K{i}(v" in ex._programs[0].source, ex._programs[0].source


@pytest.mark.parametrize("pos", [2, 0])
def test_cross_entropys_direct_kernels_are_its_computes(pos):
    """The program calls the fused cross-entropy's kernels without ctx: the same numbers, bitwise."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 5, generator=g).movedim(2, pos).contiguous()   # 5 classes at pos
    labels = torch.randint(0, 5, (3, 4), generator=g)
    d_loss = torch.randn(3, 4, generator=g)
    attrs = {"dim": "vocab", "pos": pos}
    fwd, bwd = OPS["cross_entropy"], OPS["cross_entropy_backward"]
    want = fwd.compute(None, attrs, logits, labels)
    for w, o in zip(want, fwd.direct(attrs)(logits, labels), strict=True):
        torch.testing.assert_close(o, w, rtol=0, atol=0)
    ins = (logits, labels, want[1], d_loss)
    torch.testing.assert_close(bwd.direct(attrs)(*ins), bwd.compute(None, attrs, *ins), rtol=0, atol=0)
