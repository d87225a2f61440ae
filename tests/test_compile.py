"""``--compile``: a rank's local steps run as segments compiled by torch.compile give the eager
executor's numbers, on every layout family, on the simulated mesh and on gloo processes.

The cases trace with the ``aot_eager`` backend: dynamo captures every segment and AOT
functionalizes it as inductor would be handed it, but the graph runs torch's own kernels, so
the numbers are bitwise the eager executor's and a wrong segment (a missing input, a value
from the wrong rank) cannot hide in rounding.  Inductor itself, which fuses and reorders, is
checked within ``check``'s tolerance under ``-m slow``: its C++ compile takes about 20 s per
tiny model on a 2-core machine with a cold cache.  Traces are shared between cases by the
segment cache, so the matrix costs little more than its distinct segments.
"""
from __future__ import annotations

import json

import pytest
import torch

import meshdsl as md
from meshdsl.comm.distributed import TorchComm
from meshdsl.processes.launcher import spawn
from meshdsl.runtime.compiled import CompileSettings, segments_of
from meshdsl.runtime.program import units_of
from meshdsl.tools.compare import allowed_diff
from meshdsl.train.jobs import check_job
from meshdsl.train.model import load_model

FSDP = "batch:data; params.d_model:data"
# (model, mesh, layout, micro-batches): every family of the README's table the model has
CASES = [
    ("transformer", "data:1", "", 1),
    ("transformer", "data:2", "batch:data", 1),
    ("transformer", "model:2", "heads:model; d_ff:model", 1),
    ("transformer", "data:2", FSDP, 1),
    ("transformer", "stage:2", "layer:stage", 2),
    # the MLP's families are the transformer's rows above over fewer kernels (its segments split at
    # the same kinds of collectives); its plans stay compiled by default in the fallback, training,
    # gloo, fit and unknown-backend tests below: so its rows run with -m slow
    pytest.param("mlp", "data:1", "", 1, marks=pytest.mark.slow),
    pytest.param("mlp", "data:2", "batch:data", 1, marks=pytest.mark.slow),
    pytest.param("mlp", "model:2", "d_ff:model", 1, marks=pytest.mark.slow),
    pytest.param("mlp", "data:2", FSDP, 1, marks=pytest.mark.slow),
    pytest.param("moe", "data:1", "", 1, marks=pytest.mark.slow),   # see below
    ("moe", "stage:2", "layer:stage", 2),
    # the MoE's other layouts (data:1 included) are the transformer's and the MLP's over the kernels
    # stage:2 traces (its routing too); 5-14 s each to trace on a loaded 2-core machine, so under -m slow
    pytest.param("moe", "model:2", "heads:model; d_ff:model", 1, marks=pytest.mark.slow),
    pytest.param("moe", "data:2", "batch:data", 1, marks=pytest.mark.slow),
    pytest.param("moe", "data:2", FSDP, 1, marks=pytest.mark.slow),
]


def _grads_plan(name: str, mesh: str, layout: str, microbatches: int = 1, **config):
    model = load_model(name, tiny=True, **config)
    outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}
    plan = md.compile(outs, mesh, layout, microbatches=microbatches, schedule="1f1b" if microbatches > 1 else "gpipe")
    return model, plan


def _both(plan, feeds, backend="aot_eager", settings=None):
    """(eager outputs, compiled outputs, compiled executor) of one run of ``plan`` from the same params."""
    comm = md.SimulatedComm(plan.mesh)
    eager = md.Executor(plan, comm)
    compiled = md.Executor(plan, comm, compile=settings or backend)
    params = eager.init_params(0)
    return eager.run(feeds, params), compiled.run(feeds, params), compiled


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want)
    for k in want:
        for j, (g, w) in enumerate(zip(got[k], want[k])):
            if w is None:  # a pipeline stage that does not hold the value
                assert g is None
                continue
            # aot_eager runs torch's own kernels, in the eager executor's order: bitwise equal
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda s: f"{what}, {k} (rank {j}): {s}")


@pytest.mark.parametrize("name,mesh,layout,microbatches", CASES, ids=lambda x: str(x))
def test_compiled_segments_give_the_eager_numbers(name, mesh, layout, microbatches):
    # segments everywhere (the simulated mesh would run the plans without a pipeline as one
    # graph: tests/test_compile_whole.py)
    model, plan = _grads_plan(name, mesh, layout, microbatches)
    want, got, ex = _both(plan, model.feeds(0), settings=CompileSettings("aot_eager", whole=False))
    _assert_same(got, want, f"{name} on {mesh} / {layout}")
    stats = ex.compiling.stats
    assert stats.segments + stats.shared > 0 and not stats.fallbacks, stats.summary()


def test_only_local_steps_are_compiled_and_collectives_split_segments():
    _, plan = _grads_plan("transformer", "data:2", FSDP)
    ex = md.Executor(plan, md.SimulatedComm(plan.mesh), compile="aot_eager")
    units = segments_of(ex, units_of(ex), ex.compiling)
    steps = plan.steps
    segs = [u for u in units if u.kind == "segment"]
    assert segs and all(steps[i].kind == "local" for u in segs for i in u.steps)
    assert any(steps[u.steps[0]].is_collective for u in units if u.kind == "call")
    # no segment spans a collective: every step between a segment's first and last in the issue
    # order is local (one of its own, or a constant it reads, which runs just before it)
    pos = {i: p for p, i in enumerate(ex.order)}
    for u in segs:
        between = ex.order[pos[u.steps[0]]:pos[u.steps[-1]] + 1]
        assert all(steps[i].kind == "local" and (i in u.steps or not steps[i].ins) for i in between)


def test_dropout_stays_eager_and_draws_the_eager_masks():
    # dropout reads the run's salt (per step and layer): it runs between segments, so each
    # layer and step still draws its own mask
    model, plan = _grads_plan("transformer", "data:2", "batch:data", dropout=0.25)
    comm = md.SimulatedComm(plan.mesh)
    eager, compiled = md.Executor(plan, comm), md.Executor(plan, comm, compile="aot_eager")
    params = eager.init_params(0)
    for salt in (1, 2):
        _assert_same(compiled.run(model.feeds(0), params, salt=salt), eager.run(model.feeds(0), params, salt=salt),
                     f"dropout, salt {salt}")
    assert compiled.whole is False and not compiled.compiling.stats.fallbacks   # no whole step (runtime/whole.py)


def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend rejects every graph\nsecond line")


def test_a_segment_the_backend_rejects_runs_eagerly_with_a_one_line_notice():
    model, plan = _grads_plan("mlp", "data:2", "batch:data")
    lines = []
    settings = CompileSettings(_failing_backend, notice=lines.append, whole=False)
    want, got, ex = _both(plan, model.feeds(0), settings=settings)
    _assert_same(got, want, "fallback")
    assert lines and len(lines) == len(settings.stats.fallbacks)
    assert all("\n" not in x and "runs eagerly: RuntimeError: this backend rejects every graph" in x for x in lines)
    # later runs stay eager, silently
    _assert_same(ex.run(model.feeds(0), ex.init_params(0)), want, "second run")
    assert len(lines) == len(settings.stats.fallbacks)


def test_training_steps_compile_once_and_follow_eager_training():
    # the updates overwrite their params in the eager step (donation) and make new ones compiled
    model = load_model("mlp", tiny=True)
    comm = md.SimulatedComm(md.Mesh.parse("data:2"))
    steps = [md.TrainStep(model.loss, model.params, "data:2", "batch:data", comm, optimizer=md.AdamW(lr=1e-2),
                          compile=c) for c in (False, "aot_eager")]
    for n in range(3):
        (a, _), (b, _) = (s(model.feeds(n)) for s in steps)
        assert a == b, f"step {n}: eager loss {a}, compiled {b}"
        if n == 0:
            stats = steps[1].executor.compiling.stats
            first = stats.whole + stats.segments
    assert stats.whole + stats.segments == first > 0   # nothing recompiled after step 1


@pytest.mark.slow   # inductor's C++ compile: about 20 s on a 2-core machine with a cold cache
def test_inductor_matches_eager_within_check_tolerance():
    model, plan = _grads_plan("mlp", "data:2", "batch:data")
    want, got, ex = _both(plan, model.feeds(0), backend="inductor")
    assert not ex.compiling.stats.fallbacks
    full = {k: v[0] for k, v in want.items()}
    allowed = allowed_diff(full, 1e-5)   # inductor fuses and reorders fp32 sums: rounding, 10x inside check's 1e-4
    for k, w in want.items():
        for g, x in zip(got[k], w):
            assert (g - x).abs().max().item() <= allowed[k], k


@pytest.mark.slow
def test_inductor_transformer_matches_eager_within_check_tolerance():
    model, plan = _grads_plan("transformer", "data:2", "batch:data")
    want, got, ex = _both(plan, model.feeds(0), backend="inductor")
    assert not ex.compiling.stats.fallbacks
    allowed = allowed_diff({k: v[0] for k, v in want.items()}, 1e-5)   # as above
    for k, w in want.items():
        for g, x in zip(got[k], w):
            assert (g - x).abs().max().item() <= allowed[k], k


def _gloo_case(rank: int):
    torch.set_num_threads(1)
    return check_job(TorchComm("data:2"), "mlp", True, "data:2", FSDP, compile="aot_eager")


def test_two_gloo_processes_compiled_match_dense():
    got = spawn(_gloo_case, 2, timeout=300)[0]
    model = load_model("mlp", tiny=True)
    want = md.run_dense({"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}, model.feeds(0))
    for k in want:
        # fp32; gloo sums in another order than the dense kernels, and the values are O(1):
        # 1e-5 absolute leaves room for that rounding only (as tests/test_multiprocess.py)
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda s: f"{k}: {s}")


# ----------------------------------------------------------------------------- the command line and fit

def test_check_compile_matches_dense_and_prints_what_compiling_cost(capsys):
    from meshdsl.tools import cli
    rc = cli.main(["check", "transformer", "--tiny", "--mesh", "data:2", "--layout", FSDP,
                   "--compile", "--compile-backend", "aot_eager"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "OK:" in out
    assert "check: --compile:" in err and "segment(s) of" in err and "compiled in" in err


def test_plan_compile_shows_the_segments_without_compiling(capsys):
    from meshdsl.tools import cli
    from meshdsl.runtime import compiled
    before = dict(compiled._COMPILED)
    rc = cli.main(["plan", "transformer", "--tiny", "--mesh", "data:2", "--layout", FSDP, "--compile", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    report = json.loads(out)["compile"]
    assert 0 < report["compiled_steps"] <= report["local_steps"] and report["segments"] > 0
    assert "gather" in report["eager_ops"]   # it checks its ids on the host
    assert compiled._COMPILED.keys() == before.keys()   # nothing was traced
    cli.main(["plan", "transformer", "--tiny", "--mesh", "data:2", "--layout", FSDP, "--compile"])
    assert "--compile: each rank runs" in capsys.readouterr().out


def test_fit_compile_follows_the_eager_run(tmp_path):
    runs = [md.fit("mlp", tiny=True, mesh="data:2", layout="batch:data", steps=3, compile=c,
                   out=str(tmp_path / str(c))) for c in (False, "aot_eager")]
    assert [r["loss"] for r in runs[0].rows] == [r["loss"] for r in runs[1].rows]


def test_an_unknown_backend_is_a_clear_error():
    _, plan = _grads_plan("mlp", "data:1", "")
    with pytest.raises(md.GraphError, match="unknown backend"):
        md.Executor(plan, md.SimulatedComm(plan.mesh), compile="inducter")
