"""Layout search against measurement: does the cost model rank layouts as the machine does?

Workloads: models/mlp.py (B=64, d_model=512, d_ff=2048) and models/transformer.py at
its default Config, one training step with AdamW (so ZeRO layouts are in the space),
on 2 and 4 gloo processes, 1 torch thread each.  For each (model, processes):

1. ``meshdsl.search`` ranks every enumerated layout by predicted step time, with
   this machine's calibration (``meshdsl calibrate`` first; the defaults otherwise);
2. every layout (``--sample N``: every one of a case with at most N, else N spread
   evenly along the predicted ranking, the pick included; ``--quick``: N = 12) is
   measured on real processes: one spawn per mesh
   runs each of its layouts for two warmup steps and about ``--budget`` seconds of
   timed steps (5 to 40); a step's time is the slowest rank's; over ``--rounds``
   rounds, each in another order, a layout's time is the median of its round medians;
3. reported: Spearman's rank correlation of predicted against measured, the
   measured time of the search's pick against the best measured one, and the
   pick's family (the issue expects TP for the MLP, DP for the GPT, or faster).

    python -m meshdsl calibrate --nproc 4
    python bench/search.py               # every layout
    python bench/search.py --sample 40   # all of a case up to 40, else 40 of them
    python bench/search.py --quick       # 12 per case

Results go to bench/results/search.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import meshdsl as md  # noqa: E402
from meshdsl.processes.launcher import spawn  # noqa: E402
from meshdsl.search.calibrate import load  # noqa: E402
from meshdsl.search.search import search  # noqa: E402
from meshdsl.train.jobs import train_job  # noqa: E402
from meshdsl.train.step import optimizer_outputs  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from _common import machine_end, machine_start  # noqa: E402

CASES = [("mlp", {}, 2), ("mlp", {}, 4), ("transformer", {}, 2), ("transformer", {}, 4)]
MIN_LAYOUTS = 12


def _opt():
    return md.AdamW(lr=1e-3)


def ranks(xs: list[float]) -> list[float]:
    """Ranks 1..n of ``xs`` (ties get their mean rank)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx and vy else float("nan")


def _mesh_job(comm, model, config, mesh, layouts):
    """On every rank: time each (layout, microbatches, schedule, steps) of ``mesh``; the
    median step of each, as the slowest rank saw it (a step ends when every rank is done)."""
    out = []
    for layout, m, sched, steps in layouts:
        res = train_job(comm, model, False, mesh, layout, steps, 1e-3, 0, 2, m, sched, _opt(), None, config)
        out.append([w for _, _, w in res])
    every = [json.loads(t) for t in comm.agree(json.dumps(out))]   # per rank, per layout, per step
    return [statistics.median(max(ws) for ws in zip(*per)) for per in zip(*every)]


def steps_for(predicted_s: float, budget_s: float) -> int:
    """Timed steps for a layout: about ``budget_s`` of them at its predicted time, 5 to 40."""
    return max(5, min(40, round(budget_s / max(predicted_s, 1e-4))))


def sample(n: int, k: int) -> list[int]:
    """``k`` indices spread evenly over ``range(n)`` (all when ``n <= k``), 0 included."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def run_case(name, config, nproc, budget_s, rounds, limit, cal):
    model = md.load_model(name, **config)
    outs = optimizer_outputs(model.loss, model.params, _opt(), False)
    result = search(model, outs, nproc, cal)
    ranked = result.ranked
    chosen = [ranked[i] for i in sample(len(ranked), max(limit or len(ranked), 2))]
    by_mesh: dict[str, list] = {}
    for r in chosen:
        by_mesh.setdefault(r.candidate.mesh, []).append(r)
    samples: dict[int, list[float]] = {id(r): [] for r in chosen}
    meshes = list(by_mesh.items())
    for k in range(rounds):  # each round visits the meshes, and each mesh's layouts, in another order
        for mesh, rs in meshes[k % len(meshes):] + meshes[:k % len(meshes)]:
            rs = rs[k % len(rs):] + rs[:k % len(rs)]
            layouts = [(r.candidate.layout, r.candidate.microbatches, r.candidate.schedule,
                        steps_for(r.prediction.step_s, budget_s)) for r in rs]
            times = spawn(_mesh_job, nproc, args=(name, config, mesh, layouts), mesh=mesh, timeout=1800)[0]
            for r, t in zip(rs, times):
                samples[id(r)].append(t)
    measured = {}
    for r in chosen:
        t = measured[id(r)] = statistics.median(samples[id(r)])
        sched = f" {r.candidate.schedule}" if "layer:" in r.candidate.layout else ""
        print(f"  {r.candidate.mesh:18s} {r.candidate.layout or '(replicated)':55s} m={r.candidate.microbatches}{sched} "
              f"predicted {r.prediction.step_s * 1e3:8.2f} ms  measured {t * 1e3:8.2f} ms "
              f"[{min(samples[id(r)]) * 1e3:.2f}-{max(samples[id(r)]) * 1e3:.2f}]", flush=True)
    pred = [r.prediction.step_s for r in chosen]
    meas = [measured[id(r)] for r in chosen]
    best = min(meas)
    pick = ranked[0]
    return {"model": name, "nproc": nproc, "num_candidates": result.num_candidates, "num_measured": len(chosen),
            "spearman": spearman(pred, meas), "pick": {"mesh": pick.candidate.mesh, "layout": pick.candidate.layout,
                                                      "family": pick.candidate.family},
            "pick_measured_ms": measured[id(pick)] * 1e3, "best_measured_ms": best * 1e3,
            "pick_over_best": measured[id(pick)] / best,
            "best_measured": next(r.candidate.family for r in chosen if measured[id(r)] == best),
            "layouts": [{"mesh": r.candidate.mesh, "layout": r.candidate.layout, "microbatches": r.candidate.microbatches,
                         "schedule": r.candidate.schedule,
                         "family": r.candidate.family, "predicted_ms": r.prediction.step_s * 1e3,
                         "measured_ms": measured[id(r)] * 1e3} for r in chosen]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"measure {MIN_LAYOUTS} layouts per case, not all")
    ap.add_argument("--sample", type=int, default=None,
                    help="measure every layout of a case with at most this many, else this many spread "
                         "evenly along the predicted ranking (the pick included)")
    ap.add_argument("--budget", type=float, default=0.4,
                    help="seconds of timed steps per layout and round, at its predicted step time "
                         "(5 to 40 steps; default 0.4)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds, each in another order; a layout's time is the median of its round "
                         "medians (default 3)")
    ap.add_argument("--cases", nargs="*", default=None, help="e.g. mlp:2 transformer:4 (default: all four)")
    args = ap.parse_args()
    machine = machine_start(threads=1)
    cal = load()
    cases = CASES if not args.cases else [(c.split(":")[0], {}, int(c.split(":")[1])) for c in args.cases]
    print(f"calibration: {cal.source} figures of {cal.host}; load {os.getloadavg()[0]:.1f}", flush=True)
    out = {"calibration": cal.source, "load_before": os.getloadavg(), "machine": machine, "cases": []}
    t0 = time.time()
    for name, config, nproc in cases:
        print(f"{name} on {nproc} processes:", flush=True)
        res = run_case(name, config, nproc, args.budget, args.rounds,
                       MIN_LAYOUTS if args.quick else max(args.sample or 0, 0) or None, cal)
        out["cases"].append(res)
        print(f"  -> {res['num_measured']} of {res['num_candidates']} layouts measured; Spearman "
              f"{res['spearman']:.2f}; pick {res['pick']['family']} '{res['pick']['layout']}' measured "
              f"{res['pick_measured_ms']:.2f} ms = {res['pick_over_best']:.2f}x the best "
              f"({res['best_measured']}, {res['best_measured_ms']:.2f} ms)", flush=True)
    out["seconds"] = time.time() - t0
    out["load_after"] = machine_end(machine)["load_end"]
    path = ROOT / "bench" / "results" / "search.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
