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


def test_kernels_bound_to_their_shapes_are_their_computes():
    """Ops whose program kernel is bound to the plan's local shapes (Op.direct_for) give their
    compute's numbers, bitwise: the embedding's gather and its gradient, a broadcast, an add whose
    operand torch's broadcasting lines up, and an einsum."""
    from meshdsl.ops.registry import DENSE_CTX
    g = torch.Generator().manual_seed(2)
    v, b, s, d = md.Dim("vocab", 5), md.Dim("batch", 3), md.Dim("seq", 4), md.Dim("d_model", 6)
    with md.Graph():
        ids, table = md.input("ids", [b, s], dtype=torch.int64), md.param("table", [v, d])
        x, pe, c = md.input("x", [b, s, d]), md.param("pe", [s, d]), md.input("c", [])
        nodes = [md.gather(table, ids, "vocab"), x + pe, md.broadcast_to(c, md.Shape([b, s])),
                 md.einsum("batch seq d_model, seq d_model -> batch seq", x, pe)]
    vals = {"ids": torch.randint(0, 5, (3, 4), generator=g), "table": torch.randn(5, 6, generator=g),
            "x": torch.randn(3, 4, 6, generator=g), "pe": torch.randn(4, 6, generator=g), "c": torch.randn((), generator=g)}
    grad_in = torch.randn(3, 4, 6, generator=g)
    for t in nodes:
        node = t.node
        xs = [vals[i.name] for i in node.inputs]
        want = node.op.compute(DENSE_CTX, node.attrs, *xs)
        fn = node.op.direct_for(node.attrs, tuple(tuple(x.shape) for x in xs), (tuple(want.shape),))
        assert fn is not None, node.op.name
        torch.testing.assert_close(fn(*xs), want, rtol=0, atol=0, msg=node.op.name)
    scatter = OPS["scatter_add"]
    attrs = {"dim": v, "table": md.Shape([v, d])}
    want = scatter.compute(DENSE_CTX, attrs, vals["ids"], grad_in)
    fn = scatter.direct_for(attrs, ((3, 4), (3, 4, 6)), ((5, 6),))
    torch.testing.assert_close(fn(vals["ids"], grad_in), want, rtol=0, atol=0)


def test_a_forward_loops_results_are_read_from_env_and_einsums_call_their_generated_matmul():
    """A forward loop's results are never in flight: the program reads them from ``env`` (no
    ``get``, no ``drop``).  An einsum's line calls the matmul generated for its shapes itself."""
    model, ex = _executor("data:1", "")
    ex.run(model.feeds(0), ex.init_params(0))
    prog = ex._programs[0]
    (i,) = [i for i, s in enumerate(ex.plan.steps) if s.kind == "repeat" and not s.args["backward"]]
    assert ex.calls[i].settled
    for v in ex.plan.steps[i].outs:
        assert f"get({v})" not in prog.source and f"drop(env, {v})" not in prog.source
    einsums = [i for i, s in enumerate(ex.plan.steps) if s.kind == "local" and s.op == "einsum"]
    assert einsums and all(prog.__globals__[f"K{i}"].__name__ == "run" for i in einsums)


def test_a_tiny_steps_python_calls_stay_few():
    """The eager step's cost outside kernels, counted (not timed: the count is the same on any
    machine and load): Python-level calls per training step of the tiny transformer through the
    plan executor.  199 when written (loops' layouts worked out once, kernels bound to their
    shapes, loop results read straight from env); 506 before.  The bound leaves room for small
    changes and catches a return of per-step work that grows with the step count."""
    import cProfile
    import pstats
    from meshdsl.train.step import training_outputs
    model = load_model("transformer", tiny=True)
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    plan = md.compile({k: v for k, v in outs.items() if k == "loss" or k.startswith("grad/")}, "data:1", "")
    ex = md.Executor(plan, md.SimulatedComm(plan.mesh))
    params, feeds = ex.init_params(0), model.feeds(0)
    for _ in range(2):   # (the first run builds the programs)
        ex.run(feeds, params)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        ex.run(feeds, params)
    prof.disable()
    calls = sum(n for (file, _, _), (_, n, *_) in pstats.Stats(prof).stats.items() if file != "~") / 3
    assert calls <= 260, calls
