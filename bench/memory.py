"""Peak memory and step time of activation checkpointing: ``--remat none | selective | full``.

The llama model (``models/llama.py``) at a size where activations dominate: 32 layers, batch 8,
seq 256, d_model 128 (24 MiB of params; without remat the forward keeps 21 MiB per layer for
its backward, 670 MiB in all).  One plain-SGD training step (``md.TrainStep``, one rank, one
torch thread) per policy, measured three ways:

* **the plan** (``lowering/memory.py``): the bytes the forward saves for the backward (what
  one layer keeps, its input included, times the layers), and the peak of activations
  (saved values, one layer's backward at a time, the stacked gradients, the head);
* **allocated**: the most bytes torch's CPU allocator held above what it held when the step
  began, over one step: the allocation and free events the profiler records
  (``profile_memory=True``), summed in time order, the CPU's counterpart of
  ``torch.cuda.max_memory_allocated``; one extra step, after the timed ones;
* **peak RSS**: the process's resident-set high-water mark (VmHWM) over the untimed and the
  timed steps, above its resting RSS (the step built and its params made, before the first
  step).  This holds what the C allocator keeps besides what torch allocated: meshdsl's
  processes keep every freed block for reuse (``processes/malloc.py``), and blocks freed
  between the saved activations of earlier layers leave holes a larger block cannot use.
  ``--malloc mmap`` runs the children with glibc's defaults and blocks from 256 KiB up
  mapped on their own, handed back when freed: RSS then follows what is allocated;
* on a GPU (``--device cuda``): ``torch.cuda.max_memory_allocated`` above ``memory_allocated``
  before the steps (instead of the profiler's figure);
* **step time**: the median of the timed steps, wall-clock and the process's CPU time
  (``time.process_time``): on a machine others load, a step waits for a core as long as it
  computes, and its CPU time is the steadier measure of what it costs.

Each (round, policy) runs in a fresh process (``--child``), so each peak is its own; the
policies take turns in a rotated order each round.  Over the rounds: medians and ranges
(min-max); each child records the load average when it starts.  A memory cut is ``none /
policy`` of a peak, a time cost ``policy / none`` of the step time (wall, CPU), paired round by
round.
Goals (issue 35): full cuts peak activation memory >= 3x at <= 1.4x the step time; selective
>= 1.8x at <= 1.15x.

    python bench/memory.py                  # 3 rounds x 3 timed steps, 32 layers
    python bench/memory.py --layers 8       # a smaller stack (the fixed part weighs more)
    python bench/memory.py --quick          # 1 round x 1 timed step
    python bench/memory.py --device cuda    # GPU memory too (and steps on the GPU)

Writes bench/results/memory.json (``--out``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_end, machine_start  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("none", "selective", "full")
CONFIG = {"d_model": 128, "kv_heads": 2, "group": 2, "d_head": 32, "d_ff": 384, "layers": 32, "seq": 256,
          "batch": 8}
GOALS = {"selective": (1.8, 1.15), "full": (3.0, 1.4)}   # (memory cut at least, time cost at most)
WARMUP = 1
MiB = 2 ** 20
#: ``--malloc mmap``: glibc's own allocator settings, blocks from this size up mapped on their own
MMAP_BYTES = 256 * 1024


# ----------------------------------------------------------------------------- one run (a child process)

def _status_bytes(field: str) -> int:
    """A ``kB`` line of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def allocated_peak(run) -> int:
    """The most bytes torch's CPU allocator holds during ``run()`` above what it held before:
    the profiler's allocation (+) and free (-) events, summed in time order.  A free of a block
    allocated before ``run`` is not recorded, so the figure is an upper bound; the step frees
    only its own blocks."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == DeviceType.CPU), key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def _plan_figures(plan) -> dict:
    """What the plan predicts: saved bytes (all layers, inputs included), peak activations, gradients."""
    import meshdsl as md
    from meshdsl.lowering.memory import saved_per_layer
    report = md.memory_report(plan)
    rows = saved_per_layer(plan)
    return {"plan_saved": sum((r["input"] + r["activations"]) * r["layers"] for r in rows),
            "plan_saved_per_layer": report["saved_per_layer"], "plan_activations_peak": report["activations_peak"],
            "plan_grads": report["grads"], "plan_params": report["params"], "flops": plan.flops()}


def child(policy: str, device: str, steps: int, config: dict, malloc: str) -> dict:
    """Build the step with ``policy``, run ``WARMUP + steps`` steps and one profiled step; the figures of one run."""
    import meshdsl as md
    from meshdsl.processes.malloc import tune_malloc

    load = os.getloadavg()[0]
    if malloc == "tuned":
        tune_malloc()   # as meshdsl's own processes run (`meshdsl train`, every rank)
    torch.set_num_threads(1)
    model = md.load_model("llama", **config)
    comm = md.SimulatedComm(md.Mesh.parse("data:1"), device=device)
    step = md.TrainStep(model.loss, model.params, "data:1", "", comm, lr=0.01, remat=policy)
    feeds = model.feeds(0)
    cuda = torch.device(device).type == "cuda"
    gc.collect()
    rest = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    if cuda:
        torch.cuda.synchronize()
        cuda_rest = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times, cpu, losses = [], [], []
    for i in range(WARMUP + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss, _ = step(feeds)     # the loss is read back: the step has finished
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            losses.append(loss)
    out = {"policy": policy, "load_at_start": load, "rss_rest": rest, "rss_peak": _status_bytes("VmHWM"),
           "step_s": statistics.median(times), "cpu_s": statistics.median(cpu), "losses": losses, **_plan_figures(step.plan)}
    if cuda:
        out.update(cuda_rest=cuda_rest, cuda_peak=torch.cuda.max_memory_allocated())
    else:
        out["allocated_peak"] = allocated_peak(lambda: step(feeds))
    return out


# ----------------------------------------------------------------------------- the bench

def _run_child(policy: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", policy, "--device", args.device, "--steps", str(args.steps),
           "--layers", str(args.layers), "--malloc", args.malloc]
    env = {"PYTHONPATH": str(ROOT), **os.environ, "OMP_NUM_THREADS": "1"}
    if args.malloc == "mmap":
        env.update(MESHDSL_MALLOC="default", MALLOC_MMAP_THRESHOLD_=str(MMAP_BYTES))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"child {policy} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _measured(r: dict) -> dict:
    """One run's measured peaks above rest, in bytes: ``rss`` and ``allocated`` (or ``cuda``)."""
    out = {"rss": r["rss_peak"] - r["rss_rest"]}
    if "cuda_peak" in r:
        out["cuda"] = r["cuda_peak"] - r["cuda_rest"]
    else:
        out["allocated"] = r["allocated_peak"]
    return out


def summarize(runs: list[dict]) -> dict:
    """Per policy: medians and ranges over the rounds; ratios against none (paired by round)."""
    by = {p: [r for r in runs if r["policy"] == p] for p in POLICIES}
    out = {}
    for p, rs in by.items():
        first, peaks = rs[0], [_measured(r) for r in rs]
        row = {"plan_saved_mib": first["plan_saved"] / MiB, "plan_saved_per_layer_mib": first["plan_saved_per_layer"] / MiB,
               "plan_activations_peak_mib": first["plan_activations_peak"] / MiB,
               "plan_grads_mib": first["plan_grads"] / MiB, "plan_params_mib": first["plan_params"] / MiB,
               "gflops": first["flops"] / 1e9, "step_s": _spread([r["step_s"] for r in rs]),
               "cpu_s": _spread([r["cpu_s"] for r in rs]),
               "load_at_start": _spread([r["load_at_start"] for r in rs]),
               **{f"{k}_above_rest_mib": _spread([m[k] / MiB for m in peaks]) for k in peaks[0]}}
        if p != "none":
            base = by["none"]
            base_peaks = [_measured(b) for b in base]
            row["plan_memory_cut"] = base[0]["plan_activations_peak"] / first["plan_activations_peak"]
            row["plan_saved_cut"] = base[0]["plan_saved"] / first["plan_saved"]
            for k in peaks[0]:
                row[f"{k}_memory_cut"] = _spread([b[k] / m[k] for b, m in zip(base_peaks, peaks)])
            row["time_cost"] = _spread([r["step_s"] / b["step_s"] for r, b in zip(rs, base)])
            row["cpu_time_cost"] = _spread([r["cpu_s"] / b["cpu_s"] for r, b in zip(rs, base)])
            row["same_losses_as_none"] = all(r["losses"] == b["losses"] for r, b in zip(rs, base))
        out[p] = row
    return out


def _fmt(s: dict, unit: str = "", digits: int = 1) -> str:
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def print_table(summary: dict) -> None:
    measured = "cuda" if "cuda_above_rest_mib" in summary["none"] else "allocated"
    print(f"{'policy':<10} {'plan saved':>11} {'plan peak':>10} {measured + ' MiB':>22} {'RSS above rest MiB':>22} "
          f"{'step s':>18} {'CPU s':>18} {'cut: plan':>10} {measured:>20} {'RSS':>20} {'time cost':>20} "
          f"{'CPU time cost':>20}")
    for p, r in summary.items():
        cuts = [f"{r['plan_memory_cut']:.2f}x", _fmt(r[f"{measured}_memory_cut"], "x", 2),
                _fmt(r["rss_memory_cut"], "x", 2), _fmt(r["time_cost"], "x", 2),
                _fmt(r["cpu_time_cost"], "x", 2)] if p != "none" else ["-"] * 5
        print(f"{p:<10} {r['plan_saved_mib']:>11.1f} {r['plan_activations_peak_mib']:>10.1f} "
              f"{_fmt(r[f'{measured}_above_rest_mib']):>22} {_fmt(r['rss_above_rest_mib']):>22} "
              f"{_fmt(r['step_s'], '', 2):>18} {_fmt(r['cpu_s'], '', 2):>18} {cuts[0]:>10} {cuts[1]:>20} "
              f"{cuts[2]:>20} {cuts[3]:>20} {cuts[4]:>20}")
    none = summary["none"]
    print(f"plan: params {none['plan_params_mib']:.1f} MiB, gradients {none['plan_grads_mib']:.1f} MiB; saved per "
          "layer (input included) " + ", ".join(f"{p} {r['plan_saved_per_layer_mib']:.2f} MiB"
                                                for p, r in summary.items())
          + "; load average (1 min) at each child's start " + ", ".join(
              f"{p} {_fmt(r['load_at_start'], '', 2)}" for p, r in summary.items()))
    for p, (mem, cost) in GOALS.items():
        r = summary[p]
        print(f"goal {p}: memory cut >= {mem}x (plan {r['plan_memory_cut']:.2f}x, {measured} "
              f"{r[f'{measured}_memory_cut']['median']:.2f}x, RSS {r['rss_memory_cut']['median']:.2f}x), time cost "
              f"<= {cost}x (wall {r['time_cost']['median']:.2f}x, CPU {r['cpu_time_cost']['median']:.2f}x); "
              "losses bitwise equal to none: "
              f"{r['same_losses_as_none']}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one untimed)")
    ap.add_argument("--layers", type=int, default=CONFIG["layers"])
    ap.add_argument("--quick", action="store_true", help="1 round x 1 timed step")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--malloc", choices=("tuned", "mmap"), default="tuned",
                    help="tuned: as meshdsl's processes (every freed block kept); mmap: glibc's defaults, blocks "
                         f"from {MMAP_BYTES // 1024} KiB up mapped on their own")
    ap.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    args = ap.parse_args(argv)
    config = {**CONFIG, "layers": args.layers}
    if args.child:
        print(json.dumps(child(args.child, args.device, args.steps, config, args.malloc)))
        return
    if args.quick:
        args.rounds, args.steps = 1, 1
    info = machine_start(args.device, threads=1)
    print(f"llama {config}, plain SGD, one rank, malloc {args.malloc}; {args.rounds} round(s) x {args.steps} timed "
          "step(s) per policy")
    runs = []
    for r in range(args.rounds):
        for p in POLICIES[r % 3:] + POLICIES[:r % 3]:   # turns rotate round by round
            runs.append(_run_child(p, args))
            got = runs[-1]
            peaks = ", ".join(f"{k} {b / MiB:.1f}" for k, b in _measured(got).items())
            print(f"  round {r + 1} {p}: above rest (MiB) {peaks}; step {got['step_s']:.2f} s (CPU "
                  f"{got['cpu_s']:.2f} s), load "
                  f"{got['load_at_start']:.2f}", flush=True)
    summary = summarize(runs)
    print_table(summary)
    info = machine_end(info)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": info, "config": config, "malloc": args.malloc,
                                          "rounds": args.rounds, "steps": args.steps, "runs": runs,
                                          "summary": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
