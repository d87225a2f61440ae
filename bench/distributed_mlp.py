"""MLP training step on 2 gloo processes: meshdsl DP and Megatron TP vs DDP and DTensor.

Workload: models/mlp.py (B=64, d_model=512, d_ff=2048, fp32, MSE), one step =
forward + backward + SGD update, every process on 1 torch thread.  Nine variants:

  1 proc    plain torch (two matmuls + relu + F.mse_loss, autograd, fused SGD): the baseline
  1 proc    torch compiled: the same module through torch.compile (compiles on its first,
            untimed step)
  1 proc    meshdsl, mesh "data:1", layout ""   (framework overhead reference)
  2 procs   DDP, each rank B/2; and DDP compiled: torch.compile of the DDP module
  2 procs   meshdsl DP, mesh "data:2", layout "batch:data"
  2 procs   DTensor Megatron TP (ColwiseParallel w1, RowwiseParallel w2)
  2 procs   hand-written Megatron TP in plain torch (local matmuls, one all_reduce,
            manual backward, addmm_ updates): what this machine allows, no framework
  2 procs   meshdsl Megatron TP, mesh "model:2", layout "d_ff:model"

Every variant runs under meshdsl.processes.launcher.spawn (the same harness: spawned
processes, 1 thread, gloo on 127.0.0.1).  A round is one 1-process job that
interleaves the two 1-process variants, then one 2-process job that
interleaves the five 2-process variants.  Variants take turns (rotating their
order): a turn is one untimed step (cold caches), a barrier, then ``block - 1``
steps back to back, whose mean step time is the turn's sample: sustained
training throughput, as a training loop sees it.  On 2 processes a sample is
the slower rank's.  ``--step-barrier`` times every step on its own after a
barrier instead (per-step latency, which adds the ranks' skew at each
barrier).  Rounds repeat, so the two kinds of job alternate in time; the
tables show the median over all samples and the range of the per-round
medians.  Every variant starts from meshdsl's deterministic init and the
step-0 losses are checked against the baseline's.

    python bench/distributed_mlp.py                   # 3 rounds x 10 turns x 6 steps
    python bench/distributed_mlp.py --step-barrier    # per-step latency instead
    python bench/distributed_mlp.py --rounds 1 --reps 4
    python bench/distributed_mlp.py --profile         # where meshdsl's 2-process time goes

Results go to bench/results/distributed_mlp.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import machine_end, machine_start, paired_ratio, sgd_optimizer  # noqa: E402

MODEL = str(ROOT / "models" / "mlp.py")
RESULTS = ROOT / "bench" / "results" / "distributed_mlp.json"
# Goals from the issue: meshdsl DP no slower than DDP; meshdsl TP >= 1.6x one process.
DP_GOAL, TP_GOAL = 1.0, 1.6
# Step-0 losses agree up to fp32 summation order (sums split over ranks, other kernels):
# observed differences are ~1e-7 relative.  1e-4 covers any reordering of these sums, and a
# wrong init or wrong math still fails it, because either moves the loss by O(1).
LOSS_RTOL = 1e-4

SINGLE = ("torch", "torch compiled", "meshdsl 1p")
PAIR = ("DDP", "DDP compiled", "meshdsl DP", "DTensor TP", "hand TP", "meshdsl TP")
MESHDSL = {"meshdsl 1p": ("data:1", ""), "meshdsl DP": ("data:2", "batch:data"),
           "meshdsl TP": ("model:2", "d_ff:model")}


# ----------------------------------------------------------------------------- variants

def _setup(seed: int):
    """The meshdsl model, its feeds, and its initial weights as full tensors."""
    from meshdsl.ops.leaf import init_value
    from meshdsl.train.model import load_model
    model = load_model(MODEL)
    w = {k: init_value(t, seed) for k, t in model.params.items()}
    return model, model.feeds(seed), w


class TwoMatmul(nn.Module):
    """The MLP with meshdsl's weight shapes: w1 [d_model, d_ff], w2 [d_ff, d_model]."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w1 = nn.Parameter(w1.clone())
        self.w2 = nn.Parameter(w2.clone())

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2


class LinearMLP(nn.Module):
    """The MLP as two bias-free nn.Linear, the form parallelize_module expects."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w1 = nn.Linear(w1.shape[0], w1.shape[1], bias=False)
        self.w2 = nn.Linear(w2.shape[0], w2.shape[1], bias=False)
        with torch.no_grad():  # nn.Linear keeps [out, in]
            self.w1.weight.copy_(w1.t())
            self.w2.weight.copy_(w2.t())

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def torch_step(w, feeds, lr, compile=False):
    """Plain torch on one process: the module (through torch.compile with ``compile``),
    autograd, fused SGD."""
    net = TwoMatmul(w["w1"], w["w2"])
    return module_step(torch.compile(net) if compile else net, feeds["x"], feeds["target"], lr)


def hand_tp_step(w, x, t, lr):
    """Megatron TP written by hand: this rank's column block of w1 and row block of w2,
    one all_reduce of the output, the backward by hand, updates fused into addmm_."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = w["w1"].shape[1] // world
    w1 = w["w1"][:, rank * n:(rank + 1) * n].contiguous()
    w2 = w["w2"][rank * n:(rank + 1) * n].contiguous()

    def step():
        h = torch.relu(x @ w1)
        y = h @ w2
        dist.all_reduce(y)
        d = y - t
        loss = (d * d).mean()
        dy = d * (2.0 / d.numel())
        dh = (dy @ w2.t()) * (h > 0)
        w2.addmm_(h.t(), dy, alpha=-lr)
        w1.addmm_(x.t(), dh, alpha=-lr)
        return loss.item()
    return step


def module_step(module, x, t, lr):
    """One SGD step of ``module`` (plain, DDP or DTensor-parallelised, eager or compiled); returns
    this rank's loss."""
    opt = sgd_optimizer(module.parameters(), lr)

    def step():
        loss = F.mse_loss(module(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def meshdsl_step(model, feeds, comm, name, lr, seed, stats):
    """A meshdsl TrainStep; appends each timed step's StepStats to ``stats``."""
    from meshdsl.train.jobs import agree_plan
    from meshdsl.train.step import TrainStep
    mesh, layout = MESHDSL[name]
    ts = TrainStep(model.loss, model.params, mesh, layout, comm, lr=lr, seed=seed)
    agree_plan(comm, ts.plan)

    def step(timed=False):
        loss, st = ts(feeds, timed=timed)
        if st is not None:
            stats.append({"total": st.total, "compute": st.compute, "comm": st.comm,
                          "overhead": st.overhead, "by_kind": dict(st.by_kind)})
        return loss
    return step


# ----------------------------------------------------------------------------- jobs

def _interleave(steps: dict, warmup: int, reps: int, block: int, sync=None, timed_arg=(),
                step_barrier=False):
    """Step-0 losses, then warmup, then ``reps`` rotating turns of ``block`` steps each.

    A turn runs one variant for ``block`` consecutive steps, as a training loop
    does.  Its first step finds the caches holding the previous variant's
    tensors and is not timed; then (after ``sync``, a barrier, on 2 processes)
    the other ``block - 1`` steps run back to back and the turn yields their
    mean, i.e. sustained training throughput.  With ``step_barrier`` every
    step is timed on its own, after a barrier of its own.  Returns step-0
    losses, last losses, and wall and CPU seconds per sample (CPU: this
    process, every thread, so gloo's work counts; it leaves out time spent
    descheduled, which on a loaded machine is most of the noise).
    """
    names = list(steps)
    loss0 = {k: steps[k]() for k in names}  # step 0 from the shared init, untimed
    for _ in range(warmup):
        for k in names:
            steps[k]()
    times = {k: [] for k in names}
    cpu = {k: [] for k in names}
    last = {}
    def sample(k, n):
        """``n`` steps of variant ``k`` after ``sync``: mean wall and CPU seconds, last loss."""
        if sync:
            sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            loss = steps[k](True) if k in timed_arg else steps[k]()
        if torch.cuda.is_initialized():  # on a GPU the steps end when their kernels have run
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n, loss

    for i in range(reps):
        order = names[i % len(names):] + names[: i % len(names)]
        for k in order:
            last[k] = steps[k]()  # the cold step
            runs = [1] * (block - 1) if step_barrier else [block - 1]
            for n in runs:
                wall, busy, last[k] = sample(k, n)
                times[k].append(wall)
                cpu[k].append(busy)
    return loss0, last, times, cpu


def single_job(comm, warmup, reps, block, lr, seed, step_barrier=False):
    """1 process: plain torch and meshdsl on mesh data:1, interleaved."""
    model, feeds, w = _setup(seed)
    stats = {"meshdsl 1p": []}
    steps = {"torch": torch_step(w, feeds, lr), "torch compiled": torch_step(w, feeds, lr, compile=True),
             "meshdsl 1p": meshdsl_step(model, feeds, comm, "meshdsl 1p", lr, seed, stats["meshdsl 1p"])}
    loss0, last, times, cpu = _interleave(steps, warmup, reps, block, timed_arg=("meshdsl 1p",),
                                          step_barrier=step_barrier)
    return {"loss0": loss0, "last": last, "times": times, "cpu": cpu, "stats": stats}


def pair_job(comm, warmup, reps, block, lr, seed, step_barrier=False, profile=False):
    """2 processes: DDP, meshdsl DP, DTensor TP, hand-written TP and meshdsl TP, interleaved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meshdsl.comm.distributed import TorchComm
    rank, world = dist.get_rank(), dist.get_world_size()
    model, feeds, w = _setup(seed)
    x, t = feeds["x"], feeds["target"]
    half = x.shape[0] // world
    x_r, t_r = x[rank * half:(rank + 1) * half].contiguous(), t[rank * half:(rank + 1) * half].contiguous()

    ddp = nn.parallel.DistributedDataParallel(TwoMatmul(w["w1"], w["w2"]))
    ddp_compiled = torch.compile(nn.parallel.DistributedDataParallel(TwoMatmul(w["w1"], w["w2"])))
    tp = parallelize_module(LinearMLP(w["w1"], w["w2"]), init_device_mesh("cpu", (world,)),
                            {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    model_comm = TorchComm(f"model:{world}")  # comm (from spawn) is on data:2
    stats = {"meshdsl DP": [], "meshdsl TP": []}
    steps = {"DDP": module_step(ddp, x_r, t_r, lr), "DDP compiled": module_step(ddp_compiled, x_r, t_r, lr),
             "meshdsl DP": meshdsl_step(model, feeds, comm, "meshdsl DP", lr, seed, stats["meshdsl DP"]),
             "DTensor TP": module_step(tp, x, t, lr),
             "hand TP": hand_tp_step(w, x, t, lr),
             "meshdsl TP": meshdsl_step(model, feeds, model_comm, "meshdsl TP", lr, seed, stats["meshdsl TP"])}
    if profile:
        return _profile(steps, warmup)
    loss0, last, times, cpu = _interleave(steps, warmup, reps, block, sync=dist.barrier,
                                          timed_arg=("meshdsl DP", "meshdsl TP"), step_barrier=step_barrier)
    # DDP's loss is this rank's half batch; the batch loss is the mean over ranks.
    for k in ("DDP", "DDP compiled"):
        ddp_loss = torch.tensor([loss0[k], last[k]], dtype=torch.float64)
        dist.all_reduce(ddp_loss)
        loss0[k], last[k] = (ddp_loss / world).tolist()
    return {"loss0": loss0, "last": last, "times": times, "cpu": cpu, "stats": stats}


def _profile(steps, warmup, num_steps=20):
    """Per variant on this rank: torch ops (self CPU) and meshdsl's Python hot spots."""
    import cProfile
    import io
    import pstats
    from torch.profiler import ProfilerActivity, profile as tprofile
    out = io.StringIO()
    for k in steps:
        for _ in range(warmup):
            steps[k]()
    for k, fn in steps.items():
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(num_steps):
                dist.barrier()
                fn()
        out.write(f"\n===== {k}: torch ops, rank {dist.get_rank()}, {num_steps} steps\n")
        out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
        if k.startswith("meshdsl"):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(num_steps):
                dist.barrier()
                fn()
            pr.disable()
            out.write(f"\n===== {k}: Python (cProfile, tottime), {num_steps} steps\n")
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


# ----------------------------------------------------------------------------- report

def _ms(xs):
    return statistics.median(xs) * 1e3


def _p10_ms(xs):
    """The fastest-10% step time: on a shared machine, the steps least disturbed by others."""
    return statistics.quantiles(xs, n=10)[0] * 1e3


def _cpu_ticks():
    """(steal, total) CPU ticks since boot from /proc/stat, or None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[7] if len(fields) > 7 else 0, sum(fields[:8])


def bench(args) -> int:
    from meshdsl.processes.launcher import spawn
    console = Console(width=max(Console().width, 150))
    machine = machine_start(threads=1)
    t_start, ticks0 = time.perf_counter(), _cpu_ticks()
    if args.profile:
        text = spawn(pair_job, 2, args=(args.warmup, 0, 2, args.lr, args.seed, False, True), mesh="data:2")[0]
        console.print(text, markup=False, highlight=False)
        return 0

    times = {k: [] for k in SINGLE + PAIR}
    cpu = {k: [] for k in SINGLE + PAIR}
    per_round = {k: [] for k in SINGLE + PAIR}
    stats = {k: [] for k in MESHDSL}
    loss0, last = {}, {}
    for rnd in range(args.rounds):
        one = spawn(single_job, 1, args=(args.warmup, args.reps, args.block, args.lr, args.seed, args.step_barrier),
                    mesh="data:1")[0]
        two = spawn(pair_job, 2, args=(args.warmup, args.reps, args.block, args.lr, args.seed, args.step_barrier),
                    mesh="data:2")
        for k in SINGLE:
            times[k] += one["times"][k]
            cpu[k] += one["cpu"][k]
            per_round[k].append(_ms(one["times"][k]))
        for k in PAIR:  # a step is done when its slowest rank is
            wall = [max(ts) for ts in zip(*(r["times"][k] for r in two))]
            times[k] += wall
            cpu[k] += [max(cs) for cs in zip(*(r["cpu"][k] for r in two))]
            per_round[k].append(_ms(wall))
        for src in (one, two[0]):
            for k, v in src["stats"].items():
                stats[k] += v
        if rnd == 0:
            loss0 = {**one["loss0"], **two[0]["loss0"]}
            last = {**one["last"], **two[0]["last"]}
    wall_s, ticks1 = time.perf_counter() - t_start, _cpu_ticks()
    steal = (ticks1[0] - ticks0[0]) / max(1, ticks1[1] - ticks0[1]) if ticks0 and ticks1 else None
    machine_end(machine)
    report(args, console, times, cpu, per_round, stats, loss0, last, wall_s, steal, machine)
    return 0 if all(abs(v - loss0["torch"]) <= LOSS_RTOL * abs(loss0["torch"]) for v in loss0.values()) else 1


def report(args, console, times, cpu, per_round, stats, loss0, last, wall_s, steal, machine) -> None:
    """Print the tables and write the JSON."""
    base_loss = loss0["torch"]
    loss_ok = {k: abs(v - base_loss) <= LOSS_RTOL * abs(base_loss) for k, v in loss0.items()}
    med = {k: _ms(v) for k, v in times.items()}
    med_cpu = {k: _ms(v) for k, v in cpu.items()}
    p10 = {k: _p10_ms(v) for k, v in times.items()}
    speedup = {k: med["torch"] / v for k, v in med.items()}
    p10_speedup = {k: p10["torch"] / v for k, v in p10.items()}
    cpu_speedup = {k: med_cpu["torch"] / v for k, v in med_cpu.items()}
    pairs = {f"{a} / {b}": (a, b) for a, b in (
        ("meshdsl DP", "DDP"), ("meshdsl DP", "DDP compiled"), ("meshdsl TP", "DTensor TP"),
        ("meshdsl TP", "hand TP"), ("meshdsl 1p", "torch"), ("meshdsl 1p", "torch compiled"))}
    ratios = {name: med[a] / med[b] for name, (a, b) in pairs.items()}
    paired = {name: paired_ratio(times[a], times[b]) for name, (a, b) in pairs.items()}
    split = {}
    for k, sts in stats.items():
        # Means, so that compute + comm + overhead add up to total.
        n, tot = len(sts), sum(s["total"] for s in sts)
        kinds = sorted({kk for s in sts for kk in s["by_kind"]})
        split[k] = {**{f"{f}_ms": sum(s[f] for s in sts) / n * 1e3 for f in ("total", "compute", "comm", "overhead")},
                    **{f"{f}_frac": sum(s[f] for s in sts) / tot for f in ("compute", "comm", "overhead")},
                    "by_kind_ms": {kk: sum(s["by_kind"].get(kk, 0.0) for s in sts) / n * 1e3 for kk in kinds}}

    t = Table(title=f"MLP training step (fwd+bwd+SGD), B=64 d_model=512 d_ff=2048 fp32, 1 thread/process, "
                    f"{args.rounds} round(s) x {args.reps} turns x {args.block} steps", title_justify="left")
    for col in ("variant", "procs", "median ms", "round medians", "speedup", "p10 ms", "p10 speedup",
                "CPU ms", "CPU speedup", "loss step 0", f"loss step {args.warmup + args.reps * args.block}"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for k in SINGLE + PAIR:
        ok = "" if loss_ok[k] else " [red]MISMATCH[/]"
        t.add_row(k, "1" if k in SINGLE else "2", f"{med[k]:.2f}",
                  f"{min(per_round[k]):.1f}-{max(per_round[k]):.1f}", f"{speedup[k]:.2f}x",
                  f"{p10[k]:.2f}", f"{p10_speedup[k]:.2f}x", f"{med_cpu[k]:.2f}", f"{cpu_speedup[k]:.2f}x",
                  f"{loss0[k]:.6f}{ok}", f"{last[k]:.6f}")
    console.print(t)
    sample = "step (each after a barrier)" if args.step_barrier else "turn (mean step of a turn's back-to-back steps)"
    console.print(f"ms per step; one sample per {sample}, the slower rank's on 2 processes.  speedup: vs plain "
                  "torch, median / median.  p10: the fastest 10% of samples (least disturbed by other load).  "
                  "CPU ms: busy CPU time per step (all threads of the process; the slower rank), which leaves "
                  "out time spent descheduled or blocked.")

    s = Table(title="meshdsl per step (rank 0, means)", title_justify="left")
    for col in ("variant", "total ms", "compute ms", "comm ms", "overhead ms", "compute", "comm", "overhead",
                "by kind (ms)"):
        s.add_column(col, justify="left" if col in ("variant", "by kind (ms)") else "right")
    for k, d in split.items():
        s.add_row(k, f"{d['total_ms']:.2f}", f"{d['compute_ms']:.2f}", f"{d['comm_ms']:.2f}",
                  f"{d['overhead_ms']:.2f}", f"{d['compute_frac']:.0%}", f"{d['comm_frac']:.0%}",
                  f"{d['overhead_frac']:.1%}",
                  ", ".join(f"{kk} {v:.2f}" for kk, v in d["by_kind_ms"].items() if v >= 0.005))
    console.print(s)
    console.print("comm: issuing collectives plus time blocked on them ('wait'); overhead: the step "
                  "minus kernels and collectives (the executor's own Python).")

    dp_ok = ratios["meshdsl DP / DDP"] <= DP_GOAL
    tp_ok = speedup["meshdsl TP"] >= TP_GOAL
    for name, val in ratios.items():
        p = paired[name]
        console.print(f"{name} = {val:.3f}; turn by turn: median {p['median']:.3f}, 10-90% {p['p10']:.3f}-"
                      f"{p['p90']:.3f} over {p['turns']} turns", highlight=False)
    console.print(f"goal DP <= DDP: [bold {'green' if dp_ok else 'red'}]{'met' if dp_ok else 'missed'}[/]"
                  f" ({ratios['meshdsl DP / DDP']:.2f}x DDP's time)")
    console.print(f"goal TP >= {TP_GOAL}x one process: [bold {'green' if tp_ok else 'red'}]"
                  f"{'met' if tp_ok else 'missed'}[/] ({speedup['meshdsl TP']:.2f}x median, "
                  f"{p10_speedup['meshdsl TP']:.2f}x p10, {cpu_speedup['meshdsl TP']:.2f}x in CPU time)")
    bad = [k for k, ok in loss_ok.items() if not ok]
    console.print(f"step-0 losses vs torch (rtol {LOSS_RTOL:g}): "
                  + ("all equal" if not bad else f"[red]MISMATCH in {', '.join(bad)}[/]")
                  + f"; max |diff| = {max(abs(v - base_loss) for v in loss0.values()):.2e}")
    load = os.getloadavg()
    console.print(f"wall time {wall_s:.0f} s; load average {load[0]:.2f} (1 min) {load[1]:.2f} (5 min) "
                  f"on {os.cpu_count()} cores"
                  + (f"; CPU time stolen by the hypervisor during the run: {steal:.1%}" if steal is not None else ""))

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "workload": {"batch": 64, "d_model": 512, "d_ff": 2048, "dtype": "float32", "lr": args.lr,
                     "threads_per_process": 1},
        "run": {"rounds": args.rounds, "reps": args.reps, "block": args.block,
                "step_barrier": args.step_barrier, "warmup": args.warmup, "wall_s": wall_s,
                "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                "loadavg_end": load, "steal_fraction": steal, "machine": machine},
        "median_ms": med, "round_median_ms": per_round, "min_ms": {k: min(v) * 1e3 for k, v in times.items()},
        "p10_ms": p10, "cpu_median_ms": med_cpu, "speedup_vs_torch": speedup,
        "p10_speedup_vs_torch": p10_speedup, "cpu_speedup_vs_torch": cpu_speedup,
        "ratios": ratios, "paired_ratios": paired, "meshdsl_split": split,
        "loss_step0": loss0, "loss_step0_ok": loss_ok, "loss_last": last,
        "goals": {"dp_not_slower_than_ddp": dp_ok, f"tp_speedup_at_least_{TP_GOAL}": tp_ok},
        "step_ms": {k: [x * 1e3 for x in v] for k, v in times.items()},
    }, indent=1))
    console.print(f"wrote {RESULTS.relative_to(ROOT)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="1-process + 2-process job pairs (default 3)")
    p.add_argument("--reps", type=int, default=10, help="turns per variant per round")
    p.add_argument("--block", type=int, default=6,
                   help="consecutive steps per turn (at least 2); the first of each is untimed")
    p.add_argument("--step-barrier", action="store_true",
                   help="time every step on its own after a barrier (latency per step, with the "
                        "ranks' skew at each barrier), instead of a turn's steps back to back")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="profile the 2-process variants on rank 0")
    args = p.parse_args(argv)
    if args.block < 2:
        p.error("--block must be at least 2 (a turn's first step is untimed)")
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
