"""Pipelined plans on real gloo processes give the dense program's loss and every gradient.

One spawn per process count runs every case in turn (process start-up dominates).
Each rank checks the plan signature with the others, runs its own stage's actions
(send/recv between stages, isend never blocking), and returns the full outputs it
holds and its measured peak of held activations; the parent compares every rank's
outputs with the dense program (the carry goes through shared memory, comm/shm_pipe.py,
where the machine has it).  A rank killed mid-pipeline brings the job down fast,
naming it.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.errors import DistributedError
from meshdsl.processes import launcher as launch
from meshdsl.comm import shm
from meshdsl.comm.distributed import TorchComm
from meshdsl.comm.microbatch import for_plan
from meshdsl.lowering.schedule_gen import parse_schedule, peak_theory
from meshdsl.lowering.timeline import bubble_from_timeline
from meshdsl.train.jobs import agree_plan
from meshdsl.train.step import training_outputs

from conftest import time_limit, torchrun_env
from models.transformer import Config, build

REL = 1e-5  # as tests/test_pipeline_exec.py: rounding only, relative to each output's magnitude
CFG = dataclasses.replace(Config.tiny(), layers=4, batch=8)

# (config overrides, mesh, layout, micro-batches, schedule)
CASES = {
    2: [({}, "stage:2", "layer:stage", m, s) for s in ("gpipe", "1f1b") for m in (1, 2, 4, 8)]
       + [({}, "stage:2", "layer:stage", 4, "zbh1"), ({}, "stage:2", "layer:stage", 2, "interleaved:2"),
          ({}, "stage:2", "layer:stage", 4, "interleaved-zb:2")],   # rank 1 runs its last Ws after its last B
    4: [({}, "stage:4", "layer:stage", m, s) for s in ("gpipe", "1f1b") for m in (1, 4)]
       + [({"layers": 8}, "stage:4", "layer:stage", 4, "interleaved:2")]
       + [({}, "stage:2; data:2", "layer:stage; batch:data", 2, "1f1b"),
          ({}, "stage:2; model:2", "layer:stage; heads:model; d_ff:model", 2, "gpipe"),
          ({"tied": True}, "stage:2; data:2", "layer:stage; batch:data", 2, "1f1b")],
    8: [({}, "stage:2; data:2; model:2", "layer:stage; batch:data; heads:model; d_ff:model", 2, "1f1b")],
}


def _outputs(overrides):
    model = build(dataclasses.replace(CFG, **overrides))
    return model, training_outputs(model.loss, model.params, 0.1, with_grads=True)


def _run_cases(rank, cases):
    out = []
    for overrides, mesh, layout, m, schedule in cases:
        comm = TorchComm(mesh)
        model, outs = _outputs(overrides)
        plan = md.compile(outs, mesh, layout, microbatches=m, schedule=schedule)
        agree_plan(comm, plan)
        ex = md.Executor(plan, for_plan(comm, plan))
        res = ex.run(model.feeds(0))
        full = {k: ex.to_full_held(plan.outputs[k], xs) for k, xs in res.items()}
        stage = plan.mesh.coords(comm.rank * m)["stage"]  # its first virtual rank (the micro-batch axis is minor)
        peak = bubble_from_timeline(ex.last_timeline).ranks[0].peak_activations
        pipes = [p is not None for p in comm._pipes.values()]   # the carry went through shared memory
        out.append(({k: v for k, v in full.items() if v is not None}, stage, peak, pipes))
    return out


# The 8-process case (stage x data x model) runs with -m slow: tests/test_pipeline_exec.py checks
# that layout on the simulated mesh, and 2 and 4 processes keep the pipelines on gloo.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [pytest.param(n, marks=pytest.mark.slow) if n == 8 else n for n in sorted(CASES)])
def test_pipelines_match_dense(nproc):
    results = launch.spawn(_run_cases, nproc, args=(CASES[nproc],), timeout=280)
    assert multiprocessing.active_children() == []
    for c, (overrides, mesh, layout, m, schedule) in enumerate(CASES[nproc]):
        model, outs = _outputs(overrides)
        want = md.run_dense(outs, model.feeds(0))
        p = md.Mesh.parse(mesh).sizes["stage"]
        seen = set()
        for rank in range(nproc):
            got, stage, peak, pipes = results[rank][c]
            what = f"{mesh} / {layout} m={m} {schedule} rank {rank}"
            name, chunks = parse_schedule(schedule)
            assert peak == peak_theory(name, p, m, stage, chunks), what
            assert pipes == [shm.supported()], what
            for k, v in got.items():
                scale = want[k].abs().max().item()
                torch.testing.assert_close(v, want[k], rtol=REL, atol=REL * scale,
                                           msg=lambda e, k=k: f"{what} '{k}': {e}")
            seen |= set(got)
        assert seen == set(want)  # every output is held by some rank


def _killed_mid_pipeline(rank, pid_dir):
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    comm = TorchComm("stage:2")
    model, outs = _outputs({})
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b")
    ex = md.Executor(plan, for_plan(comm, plan))
    if rank == 1:  # the last stage dies before receiving its first activation
        Path(pid_dir, "failed_at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    ex.run(model.feeds(0))


@pytest.mark.timeout(90)
def test_rank_killed_mid_pipeline_is_named_fast(tmp_path):
    with pytest.raises(DistributedError) as e:
        launch.spawn(_killed_mid_pipeline, 2, args=(str(tmp_path),), collective_timeout=60, timeout=80)
    # The death itself is reported, not the survivor's 60 s receive timing out or the job's 80 s.
    assert "rank 1 of 2 was killed by signal SIGKILL" in str(e.value)
    delay = time.time() - float(Path(tmp_path, "failed_at").read_text())
    assert delay < time_limit(10.0), f"the failure took {delay:.1f} s to surface"
    assert multiprocessing.active_children() == []


def _jobs(comm, mesh, layout):
    from meshdsl.train.jobs import check_job, train_job
    return (check_job(comm, "transformer", True, mesh, layout, microbatches=2, schedule="1f1b"),
            train_job(comm, "transformer", True, mesh, layout, 3, 0.1, microbatches=2, schedule="1f1b"))


@pytest.mark.timeout(120)
def test_check_and_train_jobs_report_on_rank_0():
    """The CLI's jobs: rank 0 returns every output and the loss curve though the last stage makes them."""
    mesh, layout = "stage:2", "layer:stage"
    (got, steps), _ = launch.spawn(_jobs, 2, args=(mesh, layout), mesh=mesh, timeout=100)
    from meshdsl.train.model import load_model
    model = load_model("transformer", tiny=True)
    want = md.run_dense({"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}, model.feeds(0))
    assert set(got) == set(want)
    for k in want:
        scale = want[k].abs().max().item()
        torch.testing.assert_close(got[k], want[k], rtol=REL, atol=REL * scale)
    losses = [loss for loss, _, _ in steps]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]


# With -m slow: test_torchrun.py's two-node check runs `meshdsl check` under torchrun, and
# test_check_and_train_jobs_report_on_rank_0 runs the pipelined check job on 2 processes.
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_torchrun_pipelined_check(tmp_path):
    """Under torchrun (two processes, one per stage), `meshdsl check` of a pipelined layout matches dense."""
    import subprocess
    import sys
    env = torchrun_env(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", "-m", "meshdsl", "check", "transformer", "--tiny", "--mesh", "stage:2",
           "--layout", "layer:stage", "--backend", "gloo", "--timeout", "60"]
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = (tmp_path / "log").read_text()
    assert proc.returncode == 0, text
    assert "OK" in text and "match the dense program" in text, text


def _posts_and_actions(rank, m):
    # Through shared memory a carry's receive is bound once and needs no posting (its sender
    # writes the message into the ring whenever it comes): posting is gloo's, tested there.
    comm = TorchComm("stage:2", shm=False)
    model, outs = _outputs({})
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=m, schedule="1f1b")
    ex = md.Executor(plan, for_plan(comm, plan))
    posts = []
    start = comm.start

    def logged(kind, xs, axes, args):
        posts.append((time.perf_counter(), kind, args["tag"]))
        return start(kind, xs, axes, args)
    comm.start = logged
    stats: dict = {}
    out = ex.run(model.feeds(0), stats=stats)
    ((row),) = ex.last_timeline
    return (posts, [(a.kind, a.microbatch, t0) for a, t0, _ in row], stats.get("recv", 0.0),
            _bound_transfers(plan, model, out))


def _bound_transfers(plan, model, gloo_out):
    """The same plan with the carry through shared memory: its sends and receives go through
    links bound at the first run, never through ``collective`` or ``start``, and are booked as
    transfers; the outputs are the gloo run's."""
    comm = TorchComm("stage:2")
    calls = []
    for name in ("collective", "start"):
        plain = getattr(comm, name)
        setattr(comm, name, lambda kind, *a, plain=plain: calls.append(kind) or plain(kind, *a))
    out = md.Executor(plan, for_plan(comm, plan)).run(model.feeds(0))
    same = out.keys() == gloo_out.keys() and all(
        len(xs) == len(gloo_out[k]) and all((x is None) == (y is None) and (x is None or torch.equal(x, y))
                                            for x, y in zip(xs, gloo_out[k]))
        for k, xs in out.items())
    return calls, {k: comm.stats.get(k, {}).get("count", 0) for k in ("send", "recv")}, same


@pytest.mark.timeout(120)
def test_carry_receives_are_posted_before_the_compute_they_overlap():
    """On real processes a stage posts the receive of micro-batch k's carry (or its gradient)
    before it starts computing micro-batch k-1, so the message lands meanwhile; only carries
    are received that way (tag: carry tag * m + micro-batch).  Timed, the waits count as 'recv'.
    Through shared memory the carry's transfers are bound once instead (no posting)."""
    m = 4
    results = launch.spawn(_posts_and_actions, 2, args=(m,), mesh="stage:2", timeout=100)
    assert multiprocessing.active_children() == []
    for rank, (posts, actions, recv_seconds, (calls, counts, same)) in enumerate(results):
        assert "send" not in calls and "recv" not in calls and counts == {"send": m, "recv": m}, (calls, counts)
        assert same   # the carry's bytes arrive unchanged, whichever path: the outputs are bitwise gloo's
        assert recv_seconds > 0  # a timed run books the receives it took under 'recv'
        carry_tag, compute = (0, "F") if rank == 1 else (1, "B")
        assert [k for _, k, _ in posts] == ["recv"] * m
        assert [tag for _, _, tag in posts] == [carry_tag * m + mb for mb in range(m)]
        began = {mb: t for kind, mb, t in actions if kind == compute}
        posted = {tag % m: t for t, _, tag in posts}
        assert posted[0] < min(t for _, _, t in actions)
        for mb in range(1, m):
            assert posted[mb] < began[mb - 1], f"rank {rank}: micro-batch {mb}'s carry posted late"


def _donated_steps(comm):
    """Three SGD steps of a 2-stage 1F1B TrainStep; the params must keep their buffers."""
    from meshdsl.train.step import TrainStep
    torch.set_num_threads(1)
    model = build(CFG)
    ts = TrainStep(model.loss, model.params, "stage:2", "layer:stage", comm, lr=0.1, microbatches=2,
                   schedule="1f1b")
    ptrs = {k: [None if x is None else x.data_ptr() for x in v] for k, v in ts.params.items()}
    losses = [ts(model.feeds(0))[0] for _ in range(3)]
    kept = all([None if x is None else x.data_ptr() for x in ts.params[k]] == ptrs[k] for k in ptrs)
    return losses, kept, sorted(k for k, v in ts.params.items() if any(x is not None for x in v))


@pytest.mark.timeout(120)
def test_pipelined_updates_overwrite_the_params_and_train_as_dense():
    """On real processes each stage's final segment updates its params in place (the executor
    donates them), and three SGD steps give the dense program's losses."""
    (l0, kept0, held0), (l1, kept1, held1) = launch.spawn(_donated_steps, 2, mesh="stage:2", timeout=100)
    assert kept0 and kept1
    assert "wte" in held0 and "lm_head" in held1 and "wq" in held0 and "wq" in held1
    from meshdsl.comm.simulated import SimulatedComm
    from meshdsl.train.step import TrainStep
    model = build(CFG)
    dense = TrainStep(model.loss, model.params, "data:1", "", SimulatedComm(md.Mesh.parse("data:1")), lr=0.1)
    want = [dense(model.feeds(0))[0] for _ in range(3)]
    got = l1  # the loss lives on the last stage
    assert got == pytest.approx(want, rel=REL)
