"""``--compile``'s whole step (meshdsl/runtime/whole.py): a plan whose ranks all run in this
process, traced once as one graph, gives the eager executor's numbers.

As in tests/test_compile.py the cases compile with ``aot_eager``: the traced graph runs torch's
own kernels in the eager executor's order, so the numbers are bitwise the eager executor's and a
value lost in the trace (a write into a buffer, a layer's slice) cannot hide in rounding.
Inductor is checked within ``check``'s tolerance under ``-m slow``.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.runtime.compiled import CompileSettings
from meshdsl.runtime.whole import MAX_LAYERS, why_not
from meshdsl.tools.compare import allowed_diff
from meshdsl.train.model import load_model

FSDP = "batch:data; params.d_model:data"


def _grads_plan(name: str, mesh: str, layout: str, microbatches: int = 1, **config):
    model = load_model(name, tiny=True, **config)
    outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}
    plan = md.compile(outs, mesh, layout, microbatches=microbatches, schedule="1f1b" if microbatches > 1 else "gpipe")
    return model, plan


def _executors(plan, settings):
    comm = md.SimulatedComm(plan.mesh)
    return md.Executor(plan, comm), md.Executor(plan, comm, compile=settings)


_TRACED: dict = {}


def _traced_pair(name: str, mesh: str, layout: str):
    """(model, eager executor, ``aot_eager`` executor) of a tiny model's gradients, made once per
    test session: tracing a whole step costs seconds, and two tests read the same one."""
    key = (name, mesh, layout)
    if key not in _TRACED:
        model, plan = _grads_plan(name, mesh, layout)
        _TRACED[key] = (model, *_executors(plan, "aot_eager"))
    return _TRACED[key]


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want)
    for k in want:
        for j, (g, w) in enumerate(zip(got[k], want[k])):
            # aot_eager runs torch's own kernels, in the eager executor's order: bitwise equal
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda s: f"{what}, {k} (rank {j}): {s}")


@pytest.mark.parametrize("name,mesh,layout", [
    ("transformer", "data:1", ""),                          # loops unrolled, forward and backward
    ("llama", "data:1", ""),                                # rms norm, rotary tables, grouped-query attention
    ("mlp", "model:2", "d_ff:model"),                       # the simulated mesh's collectives in the graph
    ("mlp", "data:2", FSDP),                                # gathers and reduce-scatters of sharded params
], ids=str)
def test_the_whole_step_is_one_graph_with_the_eager_numbers(name, mesh, layout):
    model, eager, compiled = _traced_pair(name, mesh, layout)
    assert why_not(eager) is None
    for seed in (0, 1):   # new params and feeds: the same graph, no new trace
        params = eager.init_params(seed)
        _assert_same(compiled.run(model.feeds(seed), params), eager.run(model.feeds(seed), params),
                     f"{name} on {mesh} / {layout}, seed {seed}")
    stats = compiled.compiling.stats
    assert (stats.whole, stats.segments, stats.fallbacks) == (1, 0, []), stats.summary()
    assert "the whole step as 1 graph(s)" in stats.summary()


def test_a_timed_training_step_runs_the_whole_step_and_counts_it_as_compute():
    """``meshdsl train --compile`` times every step (its progress line splits compute and
    communication): a timed run took the segments, so a one-process run never used the whole
    step. Now it does, and its time is the step's compute."""
    model = load_model("mlp", tiny=True)
    eager = md.TrainStep(model.loss, model.params, "data:1", "", md.SimulatedComm("data:1"), lr=0.1, seed=0)
    step = md.TrainStep(model.loss, model.params, "data:1", "", md.SimulatedComm("data:1"), lr=0.1, seed=0,
                        compile="aot_eager")
    feeds = model.feeds(0)
    for _ in range(2):
        want, _ = eager(feeds)
        got, st = step(feeds, timed=True)
        # aot_eager runs torch's own kernels in the eager order: bitwise the eager step's loss
        assert got == want
        assert st.compute > 0 and st.comm == 0
    stats = step.executor.compiling.stats
    assert (stats.whole, stats.segments) == (1, 0), stats.summary()


def test_what_cannot_be_one_graph_runs_the_segments():
    cases = {"pipeline": _grads_plan("transformer", "stage:2", "layer:stage", 2)[1],
             "salt": _grads_plan("transformer", "data:1", "", dropout=0.25)[1],
             "layer by layer": _grads_plan("transformer", "data:2", "batch:data")[1],
             f"at most {MAX_LAYERS}": _grads_plan("transformer", "data:1", "", layers=MAX_LAYERS + 1)[1]}
    for words, plan in cases.items():
        why = why_not(md.Executor(plan, md.SimulatedComm(plan.mesh)))
        assert why is not None and words in why, (words, why)
    # such a plan runs its segments, silently: tests/test_compile.py's dropout case


def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend rejects every graph\nsecond line")


def test_a_whole_step_the_backend_rejects_runs_the_segments_after_a_one_line_notice():
    model, plan = _grads_plan("mlp", "data:2", "batch:data")
    lines = []
    eager, compiled = _executors(plan, CompileSettings(_failing_backend, notice=lines.append))
    params = eager.init_params(0)
    _assert_same(compiled.run(model.feeds(0), params), eager.run(model.feeds(0), params), "fallback")
    # the whole step's line first, then each segment's (the same backend rejects them too)
    assert lines[0].startswith("--compile: the whole step could not be compiled, segments run instead: "
                               "RuntimeError: this backend rejects every graph")
    assert all("\n" not in x for x in lines) and len(lines) > 1
    n = len(lines)
    _assert_same(compiled.run(model.feeds(0), params), eager.run(model.feeds(0), params), "second run")
    assert len(lines) == n and compiled.compiling.stats.whole == 0


def test_user_errors_stay_the_eager_errors():
    model, eager, compiled = _traced_pair("transformer", "data:1", "")
    params = eager.init_params(0)
    feeds = model.feeds(0)
    _assert_same(compiled.run(feeds, params), eager.run(feeds, params), "first run")
    # an id outside the vocabulary: the compiled lookup raises, the step runs again eagerly and
    # raises the gather's own error; the whole step stays on for the next run
    bad = {**feeds, "ids": feeds["ids"].clone().fill_(model.config.vocab)}
    with pytest.raises(md.GraphError, match="gather: ids range over"):
        compiled.run(bad, params)
    assert not compiled.compiling.stats.fallbacks and compiled.whole and not compiled.whole.off
    # a feed of the wrong shape: a new trace, whose feed check raises the eager error
    with pytest.raises(md.GraphError, match="feed 'ids'"):
        compiled.run({**feeds, "ids": feeds["ids"][:1]}, params)
    _assert_same(compiled.run(feeds, params), eager.run(feeds, params), "after the errors")
    assert compiled.compiling.stats.whole == 1


@pytest.mark.slow   # inductor's C++ compile of the unrolled step: about 15-30 s on a loaded 2-core machine
@pytest.mark.parametrize("name", ["transformer", "llama"])   # llama: rope tables folded into constants
def test_inductor_whole_step_matches_eager_within_check_tolerance(name):
    model, plan = _grads_plan(name, "data:1", "")
    eager, compiled = _executors(plan, "inductor")
    params = eager.init_params(0)
    want, got = eager.run(model.feeds(0), params), compiled.run(model.feeds(0), params)
    stats = compiled.compiling.stats
    assert stats.whole == 1 and not stats.fallbacks, stats.summary()
    # inductor fuses and reorders fp32 sums: rounding, 10x inside check's 1e-4
    allowed = allowed_diff({k: v[0] for k, v in want.items()}, 1e-5)
    for k, w in want.items():
        assert (got[k][0] - w[0]).abs().max().item() <= allowed[k], k
    # inductor's lookup checks its bounds: an id outside the vocabulary is the gather's own error
    bad = {**model.feeds(0), "ids": model.feeds(0)["ids"].clone().fill_(model.config.vocab)}
    with pytest.raises(md.GraphError, match="gather: ids range over"):
        compiled.run(bad, params)


def test_inputs_with_other_strides_trace_again():
    # the key is all a call checks: a feed laid out otherwise is another graph, not a wrong read
    model, eager, compiled = _traced_pair("mlp", "data:2", FSDP)
    params, feeds = eager.init_params(0), model.feeds(0)
    before = compiled.compiling.stats.whole
    compiled.run(feeds, params)
    strided = {**feeds, "x": feeds["x"].t().contiguous().t()}   # the same values, column-major
    _assert_same(compiled.run(strided, params), eager.run(feeds, params), "column-major feed")
    assert compiled.compiling.stats.whole == max(before, 1) + 1


def test_what_no_input_reaches_is_folded_into_constants():
    from torch.fx.experimental.proxy_tensor import make_fx
    from meshdsl.runtime.whole import _fold_constants

    def f(x):   # a rope-like table made from nothing but sizes, and a large one left alone
        return x * torch.arange(8.0).cos(), torch.zeros(1 << 17).add(1.0) + x.sum()

    x = torch.randn(8)
    gm = make_fx(f)(x)
    _fold_constants(gm)
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("arange" in o or "cos" in o for o in ops), ops
    assert any("zeros" in o for o in ops), ops   # above MAX_FOLDED: computed in the graph
    for got, want in zip(gm(x), f(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)   # the same kernels ran, once: bitwise


def test_a_compiled_step_that_disagrees_with_eager_runs_eagerly():
    """Before its first use, a compiled whole step's outputs are compared with the eager
    executor's at ``check``'s tolerance; a backend that gets them wrong (here: a loss 1% off)
    is not used: the step runs eagerly, with one notice that names the output."""
    def wrong(gm, example):
        def fn(*xs):
            out = list(gm(*xs))
            return [out[0] * 1.01] + out[1:]   # the first output is the loss
        return fn

    lines = []
    model, plan = _grads_plan("mlp", "data:1", "")
    eager, compiled = _executors(plan, CompileSettings(wrong, notice=lines.append))
    for seed in (0, 1):
        params = eager.init_params(seed)
        _assert_same(compiled.run(model.feeds(seed), params), eager.run(model.feeds(seed), params), f"seed {seed}")
    assert len(lines) == 1 and "differs from the eager executor's (loss by" in lines[0], lines
    assert "compiled again with torch's layer-norm backward kernel: loss by" in lines[0], lines
    assert "and without the graph rewrites: loss by" in lines[0] and "the step runs eagerly" in lines[0]


@pytest.mark.parametrize("wrong", [1, 2])
def test_a_step_that_disagrees_is_compiled_again_and_used_where_that_agrees(wrong):
    """A compiled step that differs from the eager executor is traced and compiled again, first
    with the layer norms' backward as one opaque op (torch's kernel), then also without the graph
    rewrites: the first form that agrees is used, with one notice; here a backend wrong on its
    first ``wrong`` graphs."""
    graphs, lines = [], []

    def first_wrong(gm, example):
        graphs.append(gm)
        if len(graphs) > wrong:
            return gm
        return lambda *xs: [x * 1.01 for x in gm(*xs)]

    model, plan = _grads_plan("transformer", "data:1", "")   # (a loop: stacked gradients to rewrite)
    eager, compiled = _executors(plan, CompileSettings(first_wrong, notice=lines.append))
    params = eager.init_params(0)
    _assert_same(compiled.run(model.feeds(0), params), eager.run(model.feeds(0), params), "seed 0")
    assert len(graphs) == wrong + 1 and len(lines) == 1, lines
    how = "kernel, it agrees" if wrong == 1 else "kernel and without the graph rewrites, it agrees"
    assert "compiled again with torch's layer-norm backward " + how in lines[0], lines
    stacked = (torch.ops.aten.cat.default, torch.ops.aten.stack.default)
    cats = [sum(n.target in stacked for n in g.graph.nodes) for g in graphs]
    assert cats[0] == cats[1] and (wrong == 1 or cats[1] > cats[2]), cats   # no rewrites in the last form only
    for g, opaque in zip(graphs, (False, True, True)):   # torch's layer-norm backward, opaque, from the second on
        ops = [n.target for n in g.graph.nodes]
        assert (torch.ops.meshdsl.layer_norm_backward.default in ops) == opaque
        assert (torch.ops.aten.native_layer_norm_backward.default in ops) != opaque


@pytest.mark.slow
def test_inductor_compiles_the_opaque_layer_norm_backward_to_torchs_numbers():
    """The second form's layer-norm backward (one opaque op) through inductor on the CPU: the
    whole transformer step agrees with the eager executor's."""
    lines = []
    model, plan = _grads_plan("transformer", "data:1", "")
    eager, compiled = _executors(plan, CompileSettings("inductor", notice=lines.append))
    from meshdsl.runtime.whole import WholeStep, _flat
    params, feeds = eager.init_params(0), model.feeds(0)
    whole = WholeStep(compiled, compiled.compiling)
    traced, off = whole._attempt(_flat(feeds, params)[0], feeds, params, opaque=True)
    assert traced is not None and off is None and not lines, (off, lines)


def test_cuda_graphs_follow_the_environment(monkeypatch):
    """``MESHDSL_CUDA_GRAPHS``: 1 (or unset) captures a whole step on a GPU, 0 leaves it out, any
    other value is an error that names the variable."""
    monkeypatch.delenv("MESHDSL_CUDA_GRAPHS", raising=False)
    assert CompileSettings().cuda_graphs
    monkeypatch.setenv("MESHDSL_CUDA_GRAPHS", "0")
    assert not CompileSettings().cuda_graphs
    monkeypatch.setenv("MESHDSL_CUDA_GRAPHS", "yes")
    with pytest.raises(md.GraphError, match="MESHDSL_CUDA_GRAPHS='yes'"):
        CompileSettings()


def test_layer_slices_written_one_by_one_become_one_cat_the_matmuls_write_into():
    """A loop's stacked weight gradient, written layer slice by layer slice (``mm(out=slice)``,
    which functionalization turns into ``select_scatter``s: a copy of each product into the
    buffer), is rewritten as one ``cat`` of the products themselves, which inductor lays out so
    that each matmul writes its rows of the stacked buffer."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from meshdsl.runtime.whole import _stack_layer_writes

    def f(x, w, layers: int):
        buf = x.new_empty(3, 4, 2, 3)
        for l, d in enumerate(buf.unbind(0)[:layers]):
            torch.mm(x * (l + 1), w, out=d.view(8, 3))   # the slice seen as the product's matrix
        return buf

    x, w = torch.randn(8, 5), torch.randn(5, 3)
    gm = make_fx(torch.func.functionalize(lambda x, w: f(x, w, 3), remove="mutations"))(x, w)
    assert _stack_layer_writes(gm) == 1
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.select_scatter.default not in ops, ops
    (cat,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert [a.target for a in cat.args[0]] == [torch.ops.aten.mm.default] * 3
    torch.testing.assert_close(gm(x, w), f(x, w, 3), rtol=0, atol=0)   # the same products, moved: bitwise
    # a slice never written: the buffer is left as the trace made it
    part = make_fx(torch.func.functionalize(lambda x, w: f(x, w, 2), remove="mutations"))(x, w)
    assert _stack_layer_writes(part) == 0
    assert any(n.target is torch.ops.aten.select_scatter.default for n in part.graph.nodes)


def test_matrix_vector_products_become_sums_inductor_fuses():
    """Before inductor, an ``mm`` whose product is one column or one row (an RMS norm's backward
    sums its rows by BLAS in eager torch) becomes a product and a sum."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from meshdsl.runtime.whole import _vector_products_as_sums

    def f(a, col, row, b):
        return a @ col, row @ a, a @ b   # the last is a matrix product: left to BLAS

    args = (torch.randn(64, 32), torch.randn(32, 1), torch.randn(1, 64), torch.randn(32, 16))
    gm = make_fx(f)(*args)
    assert _vector_products_as_sums(gm) == 2
    assert sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes) == 1
    for got, want in zip(gm(*args), f(*args)):
        # fp32 sums of 32 and 64 terms in another order than BLAS's: rounding only, well inside
        # assert_close's fp32 default (rtol 1.3e-6, atol 1e-5) for values of size ~10
        torch.testing.assert_close(got, want)


def test_sums_read_again_are_written_out_and_activations_recomputed_per_reader():
    """Before inductor: a sum with three or more readers (a residual stream's value, read by the
    next sum, its norm and the backward's norm) goes through one op that makes inductor write it
    out, and each reader of a SiLU past the first gets its own (the backward computes it again
    from the input it reads anyway).  Neither changes a number."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from meshdsl.runtime.whole import SUM_READERS, _recompute_activations, _write_out_sums

    def f(x, d, g):
        s = x + d                          # read three times
        a = torch.nn.functional.silu(s)    # read twice: the forward's product, the backward's
        return (s + d) * s.sum(-1, keepdim=True) * a, g * a, x + g   # x + g: read once, left inline

    args = [torch.randn(4, 8) for _ in range(3)]
    gm = make_fx(f)(*args)
    assert _recompute_activations(gm) == 1 and SUM_READERS == 3 and _write_out_sums(gm) == 1   # (inductor's order)
    silus = [n for n in gm.graph.nodes if n.target is torch.ops.aten.silu.default]
    assert len(silus) == 2 and all(len(n.users) == 1 for n in silus)
    (s,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor and len(n.users) == 1
            and "force_stride_order" in str(next(iter(n.users)).target)]
    assert len(next(iter(s.users)).users) == 4   # the sum, the row sum and the two SiLUs read what is written
    for got, want in zip(gm(*args), f(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)   # the same kernels, run again: bitwise
