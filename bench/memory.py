"""Peak memory and step time of activation checkpointing: ``--remat none | selective | full``.

The llama model (``models/llama.py``) at a size where activations dominate (8 layers, batch 8,
seq 256, d_model 128: 6 MiB of params, ~1 MiB per [batch, seq, d_model] activation), one
plain-SGD training step (``md.TrainStep``, one rank, one torch thread), for each policy:

* **peak RSS**: the process's resident-set high-water mark (VmHWM) over the steps, and the
  same above its resting RSS (the step built and its params made, before the first step):
  the step's transient memory, which is activations first (gradients, the head's logits and
  the kernels' workspace are the rest, the same under every policy);
* on a GPU (``--device cuda``): ``torch.cuda.max_memory_allocated`` over the steps, and the
  same above ``memory_allocated`` before them;
* the plan's own figures (``lowering/memory.py``): peak activations, and what one layer
  saves for its backward;
* **step time**: the median of the timed steps.

Each (round, policy) runs in a fresh process (``--child``), so each peak is its own; the
policies take turns in a rotated order each round.  Over the rounds: medians and ranges
(min-max).  The memory cut is ``none / policy`` of the peak above resting RSS; the time cost
is ``policy / none`` of the step time, paired round by round.  Goals (issue 35): full cuts
peak activation memory >= 3x at <= 1.4x the step time; selective >= 1.8x at <= 1.15x.

    python bench/memory.py                  # 3 rounds x 3 timed steps
    python bench/memory.py --quick          # 1 round x 1 timed step
    python bench/memory.py --device cuda    # GPU memory too (and steps on the GPU)

Writes bench/results/memory.json.
"""
from __future__ import annotations

import argparse
import gc
import json
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
CONFIG = {"d_model": 128, "kv_heads": 2, "group": 2, "d_head": 32, "d_ff": 384, "layers": 8, "seq": 256,
          "batch": 8}
GOALS = {"selective": (1.8, 1.15), "full": (3.0, 1.4)}   # (memory cut at least, time cost at most)
WARMUP = 1
MiB = 2 ** 20


# ----------------------------------------------------------------------------- one run (a child process)

def _status_bytes(field: str) -> int:
    """A ``kB`` line of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(policy: str, device: str, steps: int) -> dict:
    """Build the step with ``policy``, run ``WARMUP + steps`` steps; the figures of one run."""
    import meshdsl as md
    from meshdsl.lowering.memory import saved_per_layer
    from meshdsl.processes.malloc import tune_malloc

    tune_malloc()   # as meshdsl's own processes run (`meshdsl train`, every rank)
    torch.set_num_threads(1)
    model = md.load_model("llama", **CONFIG)
    comm = md.SimulatedComm(md.Mesh.parse("data:1"), device=device)
    step = md.TrainStep(model.loss, model.params, "data:1", "", comm, lr=0.01, remat=policy)
    feeds = model.feeds(0)
    report = md.memory_report(step.plan)
    cuda = torch.device(device).type == "cuda"
    gc.collect()
    rest = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    if cuda:
        torch.cuda.synchronize()
        cuda_rest = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(WARMUP + steps):
        t0 = time.perf_counter()
        loss, _ = step(feeds)     # the loss is read back: the step has finished
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    out = {"policy": policy, "rss_rest": rest, "rss_peak": _status_bytes("VmHWM"), "step_s": statistics.median(times),
           "losses": losses, "plan_activations_peak": report["activations_peak"],
           "plan_saved_per_layer": report["saved_per_layer"], "plan_layers": saved_per_layer(step.plan),
           "flops": step.plan.flops()}
    if cuda:
        out.update(cuda_rest=cuda_rest, cuda_peak=torch.cuda.max_memory_allocated())
    return out


# ----------------------------------------------------------------------------- the bench

def _run_child(policy: str, device: str, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", policy, "--device", device, "--steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), **__import__("os").environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"child {policy} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(runs: list[dict]) -> dict:
    """Per policy: medians and ranges over the rounds; ratios against none (paired by round)."""
    by = {p: [r for r in runs if r["policy"] == p] for p in POLICIES}
    out = {}
    for p, rs in by.items():
        above = [r["rss_peak"] - r["rss_rest"] for r in rs]
        row = {"rss_peak_mib": _spread([r["rss_peak"] / MiB for r in rs]),
               "rss_above_rest_mib": _spread([a / MiB for a in above]),
               "step_s": _spread([r["step_s"] for r in rs]),
               "plan_activations_peak_mib": rs[0]["plan_activations_peak"] / MiB,
               "plan_saved_per_layer_mib": rs[0]["plan_saved_per_layer"] / MiB,
               "gflops": rs[0]["flops"] / 1e9}
        if "cuda_peak" in rs[0]:
            row["cuda_above_rest_mib"] = _spread([(r["cuda_peak"] - r["cuda_rest"]) / MiB for r in rs])
        if p != "none":
            base = by["none"]
            row["memory_cut"] = _spread([(b["rss_peak"] - b["rss_rest"]) / a for b, a in zip(base, above)])
            row["time_cost"] = _spread([r["step_s"] / b["step_s"] for r, b in zip(rs, base)])
            if "cuda_peak" in rs[0]:
                row["cuda_memory_cut"] = _spread([(b["cuda_peak"] - b["cuda_rest"]) / (r["cuda_peak"] - r["cuda_rest"])
                                                  for r, b in zip(rs, base)])
            row["plan_memory_cut"] = by["none"][0]["plan_activations_peak"] / rs[0]["plan_activations_peak"]
            row["same_losses_as_none"] = all(r["losses"] == b["losses"] for r, b in zip(rs, base))
        out[p] = row
    return out


def _fmt(s: dict, unit: str = "", digits: int = 1) -> str:
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def print_table(summary: dict) -> None:
    print(f"{'policy':<10} {'peak RSS MiB':>22} {'above rest MiB':>22} {'step s':>20} {'plan act. MiB':>14} "
          f"{'plan saved/layer':>17} {'memory cut':>20} {'time cost':>20}")
    for p, r in summary.items():
        cut = _fmt(r["memory_cut"], "x", 2) if "memory_cut" in r else "-"
        cost = _fmt(r["time_cost"], "x", 2) if "time_cost" in r else "-"
        print(f"{p:<10} {_fmt(r['rss_peak_mib']):>22} {_fmt(r['rss_above_rest_mib']):>22} "
              f"{_fmt(r['step_s'], '', 2):>20} {r['plan_activations_peak_mib']:>14.1f} "
              f"{r['plan_saved_per_layer_mib']:>17.2f} {cut:>20} {cost:>20}")
        if "cuda_above_rest_mib" in r:
            print(f"{'':<10} GPU max_memory_allocated above rest: {_fmt(r['cuda_above_rest_mib'])} MiB"
                  + (f", cut {_fmt(r['cuda_memory_cut'], 'x', 2)}" if "cuda_memory_cut" in r else ""))
    for p, (mem, cost) in GOALS.items():
        r = summary[p]
        print(f"goal {p}: memory cut >= {mem}x (measured {r['memory_cut']['median']:.2f}x, plan "
              f"{r['plan_memory_cut']:.2f}x), time cost <= {cost}x (measured {r['time_cost']['median']:.2f}x); "
              f"losses bitwise equal to none: {r['same_losses_as_none']}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one untimed)")
    ap.add_argument("--quick", action="store_true", help="1 round x 1 timed step")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.device, args.steps)))
        return
    if args.quick:
        args.rounds, args.steps = 1, 1
    info = machine_start(args.device, threads=1)
    print(f"llama {CONFIG}, plain SGD, one rank; {args.rounds} round(s) x {args.steps} timed step(s) per policy")
    runs = []
    for r in range(args.rounds):
        for p in POLICIES[r % 3:] + POLICIES[:r % 3]:   # turns rotate round by round
            runs.append(_run_child(p, args.device, args.steps))
            print(f"  round {r + 1} {p}: peak RSS {runs[-1]['rss_peak'] / MiB:.1f} MiB "
                  f"(rest {runs[-1]['rss_rest'] / MiB:.1f}), step {runs[-1]['step_s']:.2f} s", flush=True)
    summary = summarize(runs)
    print_table(summary)
    info = machine_end(info)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": info, "config": CONFIG, "rounds": args.rounds,
                                          "steps": args.steps, "runs": runs, "summary": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
