"""Shared helpers for the equivalence tests: meshes, layout enumeration, and the
dense-oracle check.

A *case* is a small graph built by a function that creates params/inputs and
returns the op's outputs.  :func:`build_case` adds a loss that weighs every
float output by fixed random weights (so every gradient is non-trivial), the
gradients of that loss w.r.t. every float param, and the dense reference.
:func:`check_layouts` then compiles the case for many layouts of a mesh and
compares the simulated mesh with the dense reference.
"""
from __future__ import annotations

import gc
import itertools
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.ops.nn import step_salt

# One torch thread for the whole session, as each spawned rank has (processes/launcher.py) and
# `meshdsl train` runs: on tiny tensors some kernels (gelu and its backward) still open a 2-thread
# OpenMP region, which costs 8-16 ms a call instead of ~10 us while the other core is busy (a
# spawned rank, another process); in-process test files ran ~3x slower so (test_precision.py +
# test_lazy_sums.py: 44 s against 16 s with a busy core, the same 14 s on an idle one).  Set here,
# not in a test, so no file's speed depends on which test ran before it.  A test that wants another
# count sets it and restores this one (test_trainer.py, the one_torch_thread fixture).
torch.set_num_threads(1)

# The cyclic garbage collector's full (oldest-generation) collections at most once per 1000 collections
# of the middle generation, instead of about every 20.  A full collection walks every live object,
# and the compiler's bounded caches (each node's lowering choice, re-layout and output prices, recent
# plans) hold ~1M of them once warm, so one costs ~0.3-1 s: they were ~20-25% of the CPU time of
# in-process tests (15 such files, 500 tests, in one session: 80.1 s of CPU, now 60.7 s).  What
# refcounting frees (all but cycles) is freed as before; cyclic garbage waits longer for its full
# collection, which still comes (that session's peak RSS: 687 -> 1020 MB).  A smaller last number
# trades some of the time back for memory (200: +1.2 s of CPU per 220 tests, 70 MB less).
gc.set_threshold(*gc.get_threshold()[:2], 1000)

# Mesh axes are x, y, z so that no test reads as if it meant data or model parallelism.
MESHES = {"2": "x:2", "4": "x:4", "2x2": "x:2; y:2", "2x2x2": "x:2; y:2; z:2"}

# fp32 with O(1) values; a split reduction sums its shards in another order than
# the dense program (and a few ops, e.g. layer_norm, chain reductions), so the
# results differ by a few ulps -- 1e-5 is ~100 ulps at 1.0 and still catches
# any wrong element, dropped shard or double-counted partial sum.
RTOL = ATOL = 1e-5


#: The one multiplier of every wall-clock bound a test asserts (docs/guide/testing.md).
TIME_SCALE_ENV = "MESHDSL_TEST_TIME_SCALE"


def time_scale() -> float:
    """``MESHDSL_TEST_TIME_SCALE`` (default 1): a slow or busy machine raises it."""
    text = os.environ.get(TIME_SCALE_ENV, "1")
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise pytest.UsageError(f"{TIME_SCALE_ENV}={text!r}: not a finite number > 0 (e.g. 1, or 3 on a slow machine)")
    return scale


def time_limit(seconds: float) -> float:
    """A speed bound a test asserts (``took < time_limit(3.0)``), stated for a 2-core machine
    with one other busy process and scaled by :func:`time_scale`.

    Only bounds that assert speed go through this; the hard timeouts that keep a hung test
    from hanging the suite (``pytest.mark.timeout``, ``spawn(timeout=...)``) do not.
    """
    return seconds * time_scale()


def pytest_configure(config):
    time_scale()  # a bad multiplier stops the run at once, not in the middle of it


def mesh_axes(mesh: str) -> dict[str, int]:
    return dict(md.Mesh.parse(mesh).axes)


def axis_tuples(axes: dict[str, int]) -> list[tuple[str, ...]]:
    """Every ordered tuple of distinct mesh axes, the empty one first."""
    out = []
    for k in range(len(axes) + 1):
        out.extend(itertools.permutations(axes, k))
    return out


def layout_string(assign: dict[str, tuple[str, ...]], prefix: str = "") -> str:
    parts = []
    for dim, axes in assign.items():
        if axes:
            parts.append(f"{prefix}{dim}:{axes[0] if len(axes) == 1 else '(' + ','.join(axes) + ')'}")
    return "; ".join(parts)


def _graph_dims(nodes, sizes: dict[str, set[int]], leaves: list[tuple[str, ...]]) -> None:
    for n in nodes:
        for t in n.outputs:
            for d in t.shape:
                sizes.setdefault(d.name, set()).add(d.size)
        if n.op.name in ("param", "input"):
            leaves.append(n.outputs[0].shape.names)
        blk = n.attrs.get("block")
        if blk is not None:
            _graph_dims(blk.graph.nodes, sizes, leaves)


def dim_options(sizes: dict[str, set[int]], axes: dict[str, int], whole=()) -> dict[str, list]:
    """For each dim, the axis tuples that divide every size the dim has in the graph."""
    tuples = axis_tuples(axes)
    out = {}
    for d, ss in sizes.items():
        if d in whole:
            out[d] = [()]
        else:
            out[d] = [t for t in tuples if all(s % math.prod(axes[a] for a in t) == 0 for s in ss)]
    return out


def leaf_ok(assign: dict[str, tuple[str, ...]], leaves) -> bool:
    """Params and inputs reject two dims on one mesh axis; skip such layouts."""
    for names in leaves:
        used = [a for n in names for a in assign.get(n, ())]
        if len(used) != len(set(used)):
            return False
    return True


def enumerate_layouts(options: dict[str, list], leaves, cap: int | None, seed: int = 0):
    """All valid assignments (exhaustive up to ``cap``), else a deterministic sample of ``cap``.

    Sampling draws each dim's axes independently with a fixed seed, so a run is
    reproducible and a failure message's layout string is a complete repro.
    """
    names = list(options)
    total = math.prod(len(options[n]) for n in names)
    if cap is None or total <= 4 * cap:
        allv = [dict(zip(names, c)) for c in itertools.product(*(options[n] for n in names))]
        allv = [a for a in allv if leaf_ok(a, leaves)]
        if cap is None or len(allv) <= cap:
            return allv
        return random.Random(seed).sample(allv, cap)
    rng = random.Random(seed)
    seen, out = set(), []
    for _ in range(50 * cap):
        a = {n: rng.choice(options[n]) for n in names}
        key = tuple(a.values())
        if key in seen or not leaf_ok(a, leaves):
            continue
        seen.add(key)
        out.append(a)
        if len(out) == cap:
            break
    return out


@dataclass
class Case:
    """A built graph: outputs to compare, feeds, dims and the dense reference."""

    outputs: dict
    feeds: dict
    sizes: dict[str, set[int]]
    leaves: list
    ref: dict = field(default_factory=dict)
    whole: tuple[str, ...] = ()


def _weights(y, tag: str):
    """Fixed random weights shaped like ``y``: an outer product of 1-D params (one per dim).

    1-D leaves never put two dims on one axis, so they do not restrict the layouts.
    """
    w = None
    for d in y.shape:
        v = md.param(f"wt{tag}_{d.name}", [d], scale=1.0)
        w = v if w is None else w * v
    return w if w.dtype == y.dtype else md.cast(w, y.dtype)


def build_case(fn, *, loss: bool = True, whole=(), seed: int = 0) -> Case:
    """Build ``fn()`` -> (outputs dict, feeds dict) in a fresh graph.

    With ``loss``: add ``loss = sum_i reduce_sum(y_i * W_i)`` over float outputs and
    the gradients of ``loss`` w.r.t. every float param ``fn`` made.
    """
    torch.manual_seed(seed)
    with md.Graph() as g:
        ys, feeds = fn()
        if not isinstance(ys, dict):
            ys = {"y": ys}
        outs = dict(ys)
        if loss:
            wrt = {k: p for k, p in g.params.items() if p.dtype.is_floating_point}
            total = None
            for i, (k, y) in enumerate(ys.items()):
                if not y.dtype.is_floating_point:
                    continue
                term = md.reduce_sum(y * _weights(y, str(i))) if len(y.shape) else y
                total = term if total is None else total + term
            if total is not None:
                outs["loss"] = total
                if wrt:
                    for k, gr in md.grad(total, wrt).items():
                        outs[f"grad/{k}"] = gr
    sizes, leaves = {}, []
    _graph_dims(md.core.graph.topo_nodes(list(outs.values())), sizes, leaves)
    case = Case(outs, feeds, sizes, leaves, whole=tuple(whole))
    case.ref = md.run_dense(outs, feeds)
    return case


def load_bench(name: str):
    """bench/NAME.py as a module of its own name (``bench_NAME``); bench/ leaves sys.path again
    (its files' names, train.py and search.py among them, would shadow others' imports)."""
    import importlib.util
    path, saved = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py", list(sys.path)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def assert_matches_scaled(got: dict, want: dict, what: str, rel: float) -> None:
    """Every output of ``got`` equals ``want``'s within ``rel`` of that output's largest
    magnitude (a program that sums micro-batches or shards in another order than the dense
    one differs by fp32 rounding only; a lost or doubled part is off by O(1))."""
    assert set(got) == set(want)
    for k, ref in want.items():
        scale = ref.abs().max().item()
        torch.testing.assert_close(got[k], ref, rtol=rel, atol=rel * scale, msg=lambda m, k=k: f"{what}: '{k}': {m}")


def check_plan(case: Case, mesh: str, layout) -> None:
    plan = md.compile(case.outputs, mesh, layout)
    got = md.run_simulated(plan, case.feeds)
    for k, want in case.ref.items():
        torch.testing.assert_close(got[k], want, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"output '{k}': {m}")


def check_layouts(case: Case, mesh: str, cap: int | None = None, seed: int = 0, extra=()) -> int:
    """Compare every layout (or a sample of ``cap``) with the dense reference.

    All failures are collected so one run shows how widespread a bug is; the
    message lists layout strings that reproduce it.  Returns the layout count.
    """
    options = dim_options(case.sizes, mesh_axes(mesh), case.whole)
    layouts = [layout_string(a) for a in enumerate_layouts(options, case.leaves, cap, seed)]
    layouts += list(extra)
    failures = []
    for lay in layouts:
        try:
            check_plan(case, mesh, lay)
        except Exception as e:  # noqa: BLE001 - every failure is reported below
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            failures.append(f"  mesh='{mesh}' layout='{lay}': {type(e).__name__}: {first[:300]}")
    if failures:
        pytest.fail(f"{len(failures)} of {len(layouts)} layouts differ from the dense program:\n"
                    + "\n".join(failures[:12]), pytrace=False)
    return len(layouts)


def kill_when_marked(code: str, marker: Path, what: str, limit_s: float = 120.0) -> None:
    """Run ``code`` in a fresh interpreter (this checkout first on its path) and SIGKILL it as
    soon as it has written ``marker``; the assertion names ``what`` it never reached."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + limit_s
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, f"the child never reached {what}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()


def random_feeds(inputs, seed: int = 0) -> dict:
    """N(0, 1) feeds for graph inputs ``inputs`` (md.input Tensors), by name, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(*p.shape.sizes, generator=g) for p in inputs}


def assert_simulated_matches_dense(plan, outs: dict, feeds: dict) -> None:
    """``plan`` run on the simulated mesh gives the dense program's ``outs`` (rtol = atol = 1e-5:
    a split plan sums parts in another order than one kernel over the whole, fp32 rounding)."""
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def random_params(model, seed: int = 1, frozen: bool = False) -> dict:
    """Full params of ``model`` drawn N(0, 0.25) from ``seed``: away from an init's symmetries, so
    a reference compared with the DSL's model exercises every weight (``frozen``: every param of
    its graph, the frozen ones too, in the graph's order)."""
    gen = torch.Generator().manual_seed(seed)
    params = model.graph.params() if frozen else model.params
    return {k: torch.randn(v.shape.sizes, generator=gen) * 0.5 for k, v in params.items()}


def assert_dense_is_its_torch_reference(path, frozen: bool = False, **over) -> None:
    """The held-out model at ``path`` (tiny, config ``over``), run as the dense program, gives the
    loss of its file's ``reference_loss`` (plain torch in float64, reading the feeds named by its
    ``REF_INPUTS``), and torch autograd's gradients: the dense oracle itself is right.
    ``frozen``: the frozen params are drawn too (and given to the reference, without gradients)."""
    from meshdsl.train.model import load_module
    mod = load_module(path)
    model = md.load_model(path, tiny=True, **over)
    params, feeds = random_params(model, frozen=frozen), model.feeds(0)
    got = md.run_dense({"loss": model.loss, **md.grad(model.loss, model.params)}, feeds, params=params)
    ref = {k: v.double().requires_grad_(k in model.params) for k, v in params.items()}
    ins = [feeds[k].double() if feeds[k].is_floating_point() else feeds[k] for k in getattr(mod, "REF_INPUTS", ("x",))]
    want = mod.reference_loss(model.config, ref, *ins)
    want.backward()
    # fp32 against fp64 on a loss of O(1-200): ~1e-7 relative; a wrong op in either is O(1e-1)
    assert float(got["loss"]) == pytest.approx(float(want.detach()), rel=1e-5)
    top = max(float(ref[k].grad.abs().max()) for k in model.params)
    for k in model.params:
        # fp32 rounding at the largest gradient's scale, as the layout checks allow
        torch.testing.assert_close(got[k].double(), ref[k].grad, rtol=0, atol=1e-5 * top, msg=lambda m, k=k: f"{k}: {m}")


def adamw_dense_curve(model, opt, clip: float, steps: int, feeds=None) -> tuple[list[float], list[float]]:
    """The dense program's losses and global gradient norms over ``steps`` optimizer steps.

    The oracle of the "same curve whatever the layout" tests: ``model``'s step with
    optimizer ``opt`` and clipping at ``clip`` run as the dense program, params and
    optimizer state carried by hand; step ``i`` reads ``feeds(i)`` (default ``model.feeds``).
    """
    step = md.TrainStep(model.loss, model.params, "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")),
                        optimizer=opt, clip_norm=clip)
    prog = md.DenseProgram(step.outputs)
    state = prog.init_params(0)
    losses, norms = [], []
    for i in range(steps):
        hyper = {**opt.feeds(i), "opt/clip_norm": torch.tensor(clip)}
        # each step draws its own dropout masks, as TrainStep's run of step i does
        out = prog({**(feeds or model.feeds)(i), **hyper}, state, salt=step_salt(i))
        losses.append(float(out["loss"]))
        norms.append(float(out["grad_norm"]))
        state = {k: out.get(f"new/{k}", v) for k, v in state.items()}   # a frozen param keeps its value
    return losses, norms


def assert_adamw_steps_track_dense(path, mesh: str, layout: str, steps: int = 3) -> None:
    """``steps`` AdamW steps (clipped at 1) of the tiny model at ``path`` on ``mesh``/``layout``
    (simulated) give the dense program's losses (:func:`adamw_dense_curve`), and move the model."""
    model = md.load_model(path, tiny=True)
    opt = md.AdamW(lr=0.01, weight_decay=0.1)
    want, _ = adamw_dense_curve(model, opt, 1.0, steps)
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=opt, clip_norm=1.0)
    got = [step(model.feeds(i), lr=0.01)[0] for i in range(steps)]
    # fp32 sums in another order over a few steps: ~1e-6 relative; a wrong update is O(1e-2)
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    assert want[0] != pytest.approx(want[-1], rel=1e-4)     # the steps moved the model


def sgd_dense_losses(model, lr: float, steps: int, seed: int = 0) -> list[float]:
    """The dense program's losses over ``steps`` plain-SGD steps of ``lr``, params initialised
    from ``seed``, every step on the batch ``model.feeds(seed)``: what ``meshdsl run`` trains
    (its warmup steps included), whatever its mesh, layout or micro-batches."""
    from meshdsl.train.step import training_outputs

    prog = md.DenseProgram(training_outputs(model.loss, model.params, lr))
    state, feeds, losses = prog.init_params(seed), model.feeds(seed), []
    for _ in range(steps):
        out = prog(feeds, state)
        losses.append(float(out["loss"]))
        state = {k: out[f"new/{k}"] for k in state}
    return losses


def torchrun_env(tmp_path) -> dict:
    """The environment of a torchrun under test: loopback, one thread, and its agent's log
    folder (``torchelastic_*``, which torchrun leaves behind) under the test's own tmp_path."""
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                TMPDIR=str(tmp_path))


@pytest.fixture
def one_torch_thread():
    """One torch thread for a test that trains in this process, as each spawned rank has, so
    that a busy machine's cores are not fought over by spinning intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- the command line in-process


def run_cli(capsys, argv):
    """``cli.main(argv)`` -> (exit code, stdout, stderr); argparse's exits are caught too."""
    try:
        from meshdsl.tools import cli
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if a process would be started."""
    def spawn(*a, **k):
        raise AssertionError("spawn was called for an invalid job")
    from meshdsl.processes import launcher as launch
    monkeypatch.setattr(launch, "spawn", spawn)


# ----------------------------------------------------------------------------- held-out models

def heldout_case_id(case) -> str:
    """A test id for a held-out model case ``(path, config overrides, mesh, layout[, compile kwargs])``."""
    path, over, mesh, layout, *kw = case
    extra = [*(f"{k}={v}" for k, v in over.items()), *(str(v) for k in kw for v in k.values())]
    return f"{Path(path).stem}-{mesh}-{layout}-{'-'.join(extra)}".replace(" ", "")


def heldout_outputs(model) -> dict:
    """A loaded model's loss and each param's gradient (``grad/<name>``)."""
    return {"loss": model.loss, **{f"grad/{k}": g for k, g in md.grad(model.loss, model.params).items()}}


#: (path, overrides) -> (outputs, feeds, dense outputs) of the held-out models checked lately. A
#: round's cases run one model on many layouts in a row: its graph is built and its dense program
#: run once, not per layout (the equivalence harness reuses a graph across compilations the same
#: way). Bounded, so a session holds a few models' graphs at most.
_HELDOUT_DENSE: dict = {}
_HELDOUT_KEEP = 4


def _heldout_dense(path, over: dict) -> tuple[dict, dict, dict]:
    """A held-out model's outputs, its feeds of seed 0 and the dense program's values of them, made
    once per (path, overrides) while recent; a fresh copy of the feeds each call (the caller's run
    may write into what it is given)."""
    try:
        key = (str(path), tuple(sorted(over.items())))
        hash(key)
    except TypeError:   # an unhashable override: build it afresh
        key = None
    if key is None or key not in _HELDOUT_DENSE:
        model = md.load_model(path, tiny=True, **over)
        outputs, feeds = heldout_outputs(model), model.feeds(0)
        made = (outputs, feeds, md.run_dense(outputs, _fresh(feeds)))
        if key is None:
            return made
        _HELDOUT_DENSE[key] = made
        while len(_HELDOUT_DENSE) > _HELDOUT_KEEP:
            _HELDOUT_DENSE.pop(next(iter(_HELDOUT_DENSE)))
    outputs, feeds, want = _HELDOUT_DENSE[key]
    return outputs, _fresh(feeds), want


def _fresh(feeds: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in feeds.items()}


def assert_heldout_case_matches_dense(case) -> None:
    """A held-out model (tiny config and ``over``rides) on ``mesh`` and ``layout``: its loss and
    every param's gradient on the simulated mesh are the dense program's."""
    path, over, mesh, layout, *kw = case
    outputs, feeds, want = _heldout_dense(path, over)
    got = md.run_simulated(md.compile(outputs, mesh, layout, **(kw[0] if kw else {})), feeds)
    top = max(float(w.abs().max()) for k, w in want.items() if k.startswith("grad/"))
    for k, w in want.items():
        # fp32 sums split over ranks (or micro-batches) add in another order: ~n * 2**-24 of the
        # magnitudes summed, far below 1e-4 of them; a layout bug is off by O(1). A gradient's
        # rounding is at the scale of the largest gradient (every weight gradient sums the same
        # activation gradients), so it is allowed 1e-4 of that, as `meshdsl check` does.
        scale = top if k.startswith("grad/") else float(w.abs().max())
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-4 * scale,
                                   msg=lambda m, k=k: f"{heldout_case_id(case)}: {k}: {m}")


def assert_steps_track_dense(pipe, dense, model, rel: float, what: str, steps: int = 2) -> None:
    """``steps`` training steps of TrainStep ``pipe`` give ``dense``'s losses, and then its params
    (a param whose update lands on the wrong stage shows only after a step)."""
    for t in range(steps):
        assert pipe(model.feeds(t))[0] == pytest.approx(dense(model.feeds(t))[0], rel=rel), f"step {t}: {what}"
    for k in model.params:
        got = pipe.executor.to_full_held(pipe.plan.params[k], pipe.params[k])
        assert_matches_scaled({k: got}, {k: dense.executor.to_full_held(dense.plan.params[k], dense.params[k])},
                              f"after {steps} steps ({what})", rel)


def assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path, top: int = 3) -> None:
    """``md.search_layouts`` of the model at ``path`` (tiny) on 4 processes with the default
    calibration (none of the host's): its ``top`` best candidates compile and give the dense
    program's loss and gradients."""
    import meshdsl as md
    monkeypatch.setenv("MESHDSL_CACHE_DIR", str(tmp_path))
    model = md.load_model(path, tiny=True)
    ranked = md.search_layouts(model, model.train_step(0.01), 4, md.load_calibration()).ranked
    assert ranked
    for r in ranked[:top]:
        c = r.candidate
        res = md.check(heldout_outputs(model), c.mesh, c.layout, model.feeds(0),
                       microbatches=c.microbatches, schedule=c.schedule)
        assert res.ok, (c, str(res))


def pipeline_steps_by_segment(plan):
    """Per segment of the plan's pipeline (1: forward, 2: backward), ``(step, stages)`` of its steps."""
    pipe = next(s for s in plan.steps if s.kind == "pipeline")
    prog = pipe.args["program"]
    return {k: [(s, prog.stages[k][j]) for j, s in enumerate(pipe.subplans[k].steps)] for k in (1, 2)}


def held_outputs_on_this_rank(comm, plan, feeds: dict) -> dict:
    """``plan`` run on this process's ranks of ``comm`` (after every process is checked to hold the
    same plan): each output this process holds, whole (a real-process case's result to compare)."""
    from meshdsl.comm.microbatch import for_plan
    from meshdsl.train.jobs import agree_plan
    agree_plan(comm, plan)
    ex = md.Executor(plan, for_plan(comm, plan))
    res = ex.run(feeds)
    full = {k: ex.to_full_held(plan.outputs[k], xs) for k, xs in res.items()}
    return {k: v for k, v in full.items() if v is not None}


def assert_ranks_match_dense(results: list[dict], want: dict, rel: float) -> None:
    """Each process's held outputs (:func:`held_outputs_on_this_rank`) match the dense ``want``, every
    output is held by some process, and no process is left behind."""
    import multiprocessing
    assert multiprocessing.active_children() == []
    seen: dict = {}
    for rank, got in enumerate(results):
        assert_matches_scaled(got, {k: want[k] for k in got}, f"rank {rank}", rel)
        seen.update(got)
    assert set(seen) == set(want)
