"""Peak memory and step time of activation checkpointing: ``--remat none | selective | full``.

The llama model (``models/llama.py``) at a size where activations dominate: 32 layers, batch 8,
seq 256, d_model 128 (24 MiB of params; without remat the forward keeps 19 MiB per layer for
its backward, its input included, 610 MiB in all; ``selective`` 10 MiB, ``full`` 1 MiB).  One
plain-SGD training step (``md.TrainStep``, one rank, one torch thread) per policy.  From one
run, per policy:

* **the plan** (``lowering/memory.py``): the bytes the forward saves for the backward (what
  one layer keeps, its input included, times the layers), and the peak of activations
  (saved values, one layer's backward at a time, the stacked gradients, the head);
* **measured peak activation memory** (the goals' figure), in a fresh process per (round,
  policy) so that each peak is its own, the policies' turns rotated round by round:
  on the CPU the most bytes torch's allocator held above what it held when the step began,
  over one step (the profiler's allocation and free events, ``profile_memory=True``, summed in
  time order: the CPU's counterpart of ``torch.cuda.max_memory_allocated``); on a GPU
  (``--device cuda``) ``torch.cuda.max_memory_allocated`` above ``memory_allocated`` before
  the steps;
* **peak RSS** of the same processes: the resident-set high-water mark (VmHWM) over their
  steps above the resting RSS (the step built and its params made).  It holds what the C
  allocator keeps besides what torch allocated: meshdsl's processes keep every freed block
  for reuse (``processes/malloc.py``), and the holes transient buffers leave between the
  saved activations of earlier layers are not all reused.  ``--malloc mmap`` runs the
  children with glibc's defaults and blocks from 256 KiB up mapped on their own, handed back
  when freed: RSS then follows what is allocated;
* **step time**, in one more process that builds every policy's step and runs them in turns,
  one step of each per turn, the order rotated turn by turn (``--turns``, at least 3): the
  median and range (min-max) of the wall-clock and CPU time (``time.process_time``) of a
  step, and the cost against ``none`` paired turn by turn (the steps of one turn run seconds
  apart, so the machine's drift under others' load largely cancels in each ratio, where
  separate processes minutes apart differ by tens of percent).  Each step's
  ``getrusage`` tells where wall time beyond CPU time went: involuntary context switches
  (the process was runnable and waited for a core: other load), voluntary ones (it blocked:
  I/O, a lock, a sleep), and page faults and system time (the allocator asking the kernel
  for memory, which counts in CPU time).

The goals are on **activation memory**: each measured peak less the gradients the step makes
(the plan's ``grads``, 24.3 MiB here).  Gradients are model state, as ZeRO counts it (params,
gradients, optimizer state; activations, temporary buffers and fragmentation are the rest),
the same under every policy; a backward loop allocates its stacked gradients when it starts,
before the first layer's backward, so all of them are live at the peak (the plan's peak with
them is the measured one, to 0.1 MiB on the CPU).  The cuts with the gradients counted are
printed beside.  On a GPU the rest is taken after the warm-up step: cuBLAS's workspace
(32 MiB on an H100, allocated by the first matmul and kept) is not the step's.

A memory cut is ``none / policy`` of a peak (paired by round), a time cost ``policy / none``
of a step (paired by turn).  Goals (issue 35): full cuts peak activation memory >= 3x at
<= 1.4x the step time; selective >= 1.8x at <= 1.15x; a goal is met when the median measured
cut and the median wall-clock cost both are (RSS and CPU time are shown beside them).

    python bench/memory.py                  # 3 memory rounds, 9 timing turns, 32 layers
    python bench/memory.py --layers 8       # a smaller stack (the fixed part weighs more)
    python bench/memory.py --quick          # 1 memory round, 3 timing turns
    python bench/memory.py --device cuda    # GPU memory (and steps on the GPU)

Writes bench/results/memory.json (``--out``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
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
MIN_TURNS = 3
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


def _clock() -> dict:
    """Wall and CPU clocks with this process's ``getrusage`` counters, now."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": time.perf_counter(), "cpu_s": time.process_time(), "sys_s": u.ru_stime,
            "minor_faults": u.ru_minflt, "major_faults": u.ru_majflt, "voluntary_switches": u.ru_nvcsw,
            "involuntary_switches": u.ru_nivcsw}


def _since(before: dict) -> dict:
    now = _clock()
    return {k: now[k] - v for k, v in before.items()}


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


def _build(policy: str, device: str, config: dict):
    import meshdsl as md
    model = md.load_model("llama", **config)
    comm = md.SimulatedComm(md.Mesh.parse("data:1"), device=device)
    return md.TrainStep(model.loss, model.params, "data:1", "", comm, lr=0.01, remat=policy), model.feeds(0)


def _setup(malloc: str) -> float:
    """As meshdsl's own processes run (`meshdsl train`, every rank): one torch thread, malloc tuned
    unless ``--malloc mmap``; the load average now."""
    from meshdsl.processes.malloc import tune_malloc
    load = os.getloadavg()[0]
    if malloc == "tuned":
        tune_malloc()
    torch.set_num_threads(1)
    return load


def memory_child(policy: str, device: str, steps: int, config: dict, malloc: str) -> dict:
    """Build the step with ``policy``, run ``WARMUP + steps`` steps and one profiled step: its peaks."""
    load = _setup(malloc)
    step, feeds = _build(policy, device, config)
    cuda = torch.device(device).type == "cuda"
    gc.collect()
    rest = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    losses = [step(feeds)[0] for _ in range(WARMUP)]   # each loss read back: its step has finished
    if cuda:   # after the warm-up: what the first step made and kept (cuBLAS's workspace) is not a step's
        torch.cuda.synchronize()
        cuda_rest = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    losses += [step(feeds)[0] for _ in range(steps)]
    out = {"policy": policy, "load_at_start": load, "rss_rest": rest, "rss_peak": _status_bytes("VmHWM"),
           "losses": losses, **_plan_figures(step.plan)}
    if cuda:
        out.update(cuda_rest=cuda_rest, cuda_peak=torch.cuda.max_memory_allocated())
    else:
        out["allocated_peak"] = allocated_peak(lambda: step(feeds))
    return out


def turn_order(turn: int) -> tuple[str, ...]:
    """The policies' order in ``turn``: rotated turn by turn, so each runs first, second and
    last equally often over three turns."""
    k = turn % len(POLICIES)
    return POLICIES[k:] + POLICIES[:k]


def timing_child(device: str, turns: int, config: dict, malloc: str) -> dict:
    """Every policy's step built in this process, warmed up, then ``turns`` turns of one step
    each: per step its policy, turn, loss, clocks and ``getrusage`` counters."""
    load = _setup(malloc)
    built = {p: _build(p, device, config) for p in POLICIES}
    for p, (step, feeds) in built.items():
        for _ in range(WARMUP):
            step(feeds)
    samples = []
    for turn in range(turns):
        for p in turn_order(turn):
            step, feeds = built[p]
            gc.collect()
            before = _clock()
            loss, _ = step(feeds)   # the loss is read back: the step has finished
            samples.append({"policy": p, "turn": turn, "loss": loss, **_since(before)})
    return {"load_at_start": load, "samples": samples}


# ----------------------------------------------------------------------------- the bench

def _run_child(what: list[str], args) -> dict:
    cmd = [sys.executable, __file__, *what, "--device", args.device, "--steps", str(args.steps),
           "--turns", str(args.turns), "--layers", str(args.layers), "--malloc", args.malloc]
    env = {"PYTHONPATH": str(ROOT), **os.environ, "OMP_NUM_THREADS": "1"}
    if args.malloc == "mmap":
        env.update(MESHDSL_MALLOC="default", MALLOC_MMAP_THRESHOLD_=str(MMAP_BYTES))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"child {' '.join(what)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _measured(r: dict) -> dict:
    """One memory run's measured peaks above rest, in bytes: ``allocated`` (or ``cuda``) and
    ``rss``, and each less the step's gradients (``..._activations``: the goals' figures)."""
    out = {"cuda": r["cuda_peak"] - r["cuda_rest"]} if "cuda_peak" in r else {"allocated": r["allocated_peak"]}
    out["rss"] = r["rss_peak"] - r["rss_rest"]
    return {**out, **{f"{k}_activations": b - r["plan_grads"] for k, b in out.items()}}


def _memory_row(rs: list[dict], base: list[dict] | None) -> dict:
    """One policy's memory figures over its rounds; its cuts against ``base`` (none's runs), round by round."""
    first, peaks = rs[0], [_measured(r) for r in rs]
    row = {"plan_saved_mib": first["plan_saved"] / MiB, "plan_saved_per_layer_mib": first["plan_saved_per_layer"] / MiB,
           "plan_activations_peak_mib": first["plan_activations_peak"] / MiB,
           "plan_grads_mib": first["plan_grads"] / MiB, "plan_params_mib": first["plan_params"] / MiB,
           "gflops": first["flops"] / 1e9, "load_at_start": _spread([r["load_at_start"] for r in rs]),
           **{f"{k}_above_rest_mib": _spread([m[k] / MiB for m in peaks]) for k in peaks[0]}}
    if base is not None:
        base_peaks = [_measured(b) for b in base]
        row["plan_memory_cut"] = base[0]["plan_activations_peak"] / first["plan_activations_peak"]
        row["plan_saved_cut"] = base[0]["plan_saved"] / first["plan_saved"]
        for k in peaks[0]:
            row[f"{k}_memory_cut"] = _spread([b[k] / m[k] for b, m in zip(base_peaks, peaks)])
        row["same_losses_as_none"] = all(r["losses"] == b["losses"] for r, b in zip(rs, base))
    return row


#: per step, the ``getrusage`` counters that say where wall time beyond CPU time went
USAGE = ("sys_s", "minor_faults", "major_faults", "voluntary_switches", "involuntary_switches")


def _time_row(samples: list[dict], policy: str) -> dict:
    """One policy's step times over the turns; its costs against none's step of the same turn."""
    mine = sorted((s for s in samples if s["policy"] == policy), key=lambda s: s["turn"])
    none = {s["turn"]: s for s in samples if s["policy"] == "none"}
    row = {"step_s": _spread([s["wall_s"] for s in mine]), "cpu_s": _spread([s["cpu_s"] for s in mine]),
           "wall_minus_cpu_s": statistics.median(s["wall_s"] - s["cpu_s"] for s in mine),
           **{k: statistics.median(s[k] for s in mine) for k in USAGE}}
    if policy != "none":
        row["time_cost"] = _spread([s["wall_s"] / none[s["turn"]]["wall_s"] for s in mine])
        row["cpu_time_cost"] = _spread([s["cpu_s"] / none[s["turn"]]["cpu_s"] for s in mine])
        row["same_losses_as_none_in_turns"] = all(s["loss"] == none[s["turn"]]["loss"] for s in mine)
    return row


def goal_verdict(row: dict, goal: tuple[float, float], measured: str) -> dict:
    """Whether ``row`` meets ``goal`` (memory cut at least, time cost at most): by the median
    measured cut of activation memory (``measured``: allocated or cuda, less the gradients) and
    the median wall-clock cost; by RSS, by the peaks with the gradients and by CPU time beside
    them."""
    cut, cost = goal
    verdict = {"memory": row[f"{measured}_activations_memory_cut"]["median"] >= cut,
               "time": row["time_cost"]["median"] <= cost,
               "memory_with_grads": row[f"{measured}_memory_cut"]["median"] >= cut,
               "memory_by_rss": row["rss_activations_memory_cut"]["median"] >= cut,
               "time_by_cpu": row["cpu_time_cost"]["median"] <= cost}
    verdict["met"] = verdict["memory"] and verdict["time"]
    return verdict


def summarize(runs: list[dict], timing: dict) -> dict:
    """Per policy: memory (medians and ranges over the rounds, cuts paired by round), step time
    (over the turns, costs paired by turn), and the goals' verdicts."""
    by = {p: [r for r in runs if r["policy"] == p] for p in POLICIES}
    measured = "cuda" if "cuda_peak" in runs[0] else "allocated"
    out = {}
    for p, rs in by.items():
        row = {**_memory_row(rs, None if p == "none" else by["none"]), **_time_row(timing["samples"], p)}
        if p in GOALS:
            row["goal"] = goal_verdict(row, GOALS[p], measured)
        out[p] = row
    return out


def _fmt(s: dict, unit: str = "", digits: int = 1) -> str:
    return f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def print_table(summary: dict) -> None:
    measured = "cuda" if "cuda_above_rest_mib" in summary["none"] else "allocated"
    act = f"{measured}_activations"
    print(f"{'policy':<10} {'plan act.':>9} {'activations MiB':>22} {'cut':>7} {'+grads cut':>10} "
          f"{'RSS act. MiB':>22} {'RSS cut':>8} {'step s (wall)':>19} {'cost':>19} {'step s (CPU)':>19} {'CPU cost':>19}")
    for p, r in summary.items():
        cuts = ([f"{r[f'{act}_memory_cut']['median']:.2f}x", f"{r[f'{measured}_memory_cut']['median']:.2f}x",
                 f"{r['rss_activations_memory_cut']['median']:.2f}x", _fmt(r["time_cost"], "x", 2),
                 _fmt(r["cpu_time_cost"], "x", 2)] if p != "none" else ["-"] * 5)
        print(f"{p:<10} {r['plan_activations_peak_mib'] - r['plan_grads_mib']:>9.1f} "
              f"{_fmt(r[f'{act}_above_rest_mib']):>22} {cuts[0]:>7} {cuts[1]:>10} "
              f"{_fmt(r['rss_activations_above_rest_mib']):>22} {cuts[2]:>8} {_fmt(r['step_s'], '', 3):>19} "
              f"{cuts[3]:>19} {_fmt(r['cpu_s'], '', 3):>19} {cuts[4]:>19}")
    none = summary["none"]
    print(f"activations: the measured peak above rest less the step's gradients; with them, none's peak is "
          f"{none[f'{measured}_above_rest_mib']['median']:.1f} MiB (plan {none['plan_activations_peak_mib']:.1f})")
    print(f"plan: params {none['plan_params_mib']:.1f} MiB, gradients {none['plan_grads_mib']:.1f} MiB; saved per "
          "layer (input included) " + ", ".join(f"{p} {r['plan_saved_per_layer_mib']:.2f} MiB"
                                                for p, r in summary.items()))
    print("per step (medians), wall minus CPU time: " + "; ".join(
        f"{p} {r['wall_minus_cpu_s']:.3f} s, {r['involuntary_switches']:.0f} involuntary and "
        f"{r['voluntary_switches']:.0f} voluntary context switches, {r['minor_faults']:.0f} minor faults, "
        f"{r['sys_s']:.3f} s system" for p, r in summary.items()))
    yes = {True: "met", False: "NOT met"}
    for p, (mem, cost) in GOALS.items():
        r, v = summary[p], summary[p]["goal"]
        print(f"goal {p}: activation memory cut >= {mem}x: {measured} {r[f'{act}_memory_cut']['median']:.2f}x "
              f"{yes[v['memory']]} (with the gradients {r[f'{measured}_memory_cut']['median']:.2f}x "
              f"{yes[v['memory_with_grads']]}; RSS {r['rss_activations_memory_cut']['median']:.2f}x "
              f"{yes[v['memory_by_rss']]}); time cost <= {cost}x: wall {r['time_cost']['median']:.2f}x "
              f"{yes[v['time']]} (CPU {r['cpu_time_cost']['median']:.2f}x {yes[v['time_by_cpu']]}); losses "
              f"bitwise equal to none: {r['same_losses_as_none'] and r['same_losses_as_none_in_turns']} -> "
              f"{yes[v['met']].upper()}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="memory runs per policy, a fresh process each")
    ap.add_argument("--steps", type=int, default=1, help="steps per memory run (after one untimed), then one profiled")
    ap.add_argument("--turns", type=int, default=9, help=f"timing turns, one step of each policy per turn "
                                                         f"(at least {MIN_TURNS})")
    ap.add_argument("--layers", type=int, default=CONFIG["layers"])
    ap.add_argument("--quick", action="store_true", help=f"1 memory round, {MIN_TURNS} timing turns")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--malloc", choices=("tuned", "mmap"), default="tuned",
                    help="tuned: as meshdsl's processes (every freed block kept); mmap: glibc's defaults, blocks "
                         f"from {MMAP_BYTES // 1024} KiB up mapped on their own")
    ap.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    ap.add_argument("--timing-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    args = ap.parse_args(argv)
    config = {**CONFIG, "layers": args.layers}
    if args.child:
        print(json.dumps(memory_child(args.child, args.device, args.steps, config, args.malloc)))
        return
    if args.timing_child:
        print(json.dumps(timing_child(args.device, args.turns, config, args.malloc)))
        return
    if args.quick:
        args.rounds, args.turns = 1, MIN_TURNS
    if args.turns < MIN_TURNS or args.rounds < 1:
        ap.error(f"--turns is at least {MIN_TURNS} and --rounds at least 1")
    info = machine_start(args.device, threads=1)
    print(f"llama {config}, plain SGD, one rank, malloc {args.malloc}; memory: {args.rounds} round(s) x "
          f"{WARMUP + args.steps} step(s) per policy; time: {args.turns} turns")
    runs = []
    for r in range(args.rounds):
        for p in turn_order(r):
            runs.append(_run_child(["--child", p], args))
            peaks = ", ".join(f"{k} {b / MiB:.1f}" for k, b in _measured(runs[-1]).items())
            print(f"  memory round {r + 1} {p}: above rest (MiB) {peaks}; load {runs[-1]['load_at_start']:.2f}",
                  flush=True)
    timing = _run_child(["--timing-child"], args)
    print(f"  timing: {args.turns} turns, load {timing['load_at_start']:.2f} at its start", flush=True)
    summary = summarize(runs, timing)
    print_table(summary)
    info = machine_end(info)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": info, "config": config, "malloc": args.malloc,
                                          "rounds": args.rounds, "steps": args.steps, "turns": args.turns,
                                          "runs": runs, "timing": timing, "summary": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
