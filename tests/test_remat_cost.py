"""What activation checkpointing costs: no recompute is wasted (meshdsl/ir/remat.py,
meshdsl/lowering/block_order.py), and ``bench/memory.py``'s summary and goal verdicts.

* In a backward block every recompute step's output is read (by a backward step, another
  recompute step or the block's outputs), no value is recomputed twice, and each recompute
  step runs just before its first reader (only recompute steps between them), so a
  recomputed value is held no longer than the backward needs it.
* The bench pairs each policy's step with none's step of the same turn and each peak with
  none's peak of the same round, and calls a goal met only when the median measured memory
  cut and the median wall-clock cost both meet it.
"""
from __future__ import annotations

import dataclasses

import pytest

import meshdsl as md
from models.llama import Config as LlamaConfig, build as build_llama
from models.transformer import Config, build

from conftest import load_bench


bench = load_bench("memory")

MODELS = {
    # dropout on: its recompute must draw the forward's masks, with the step's salt
    "transformer": lambda: build(dataclasses.replace(Config.tiny(), dropout=0.1)),
    "llama": lambda: build_llama(LlamaConfig.tiny()),
}


def _backward_block(model, policy: str, mesh: str, layout: str):
    grads = md.grad(model.loss, model.params, remat=policy)
    plan = md.compile({"loss": model.loss, **grads}, mesh, layout)
    (step,) = [s for s in plan.steps if s.kind == "repeat" and s.args["backward"]]
    return step.subplans[0]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("policy", ["selective", "full"])
@pytest.mark.parametrize("mesh, layout", [("data:1", ""), ("model:2", "d_ff:model")])
def test_no_recompute_is_wasted(name, policy, mesh, layout):
    sub = _backward_block(MODELS[name](), policy, mesh, layout)
    steps = sub.steps
    kept = set(sub.outputs.values())
    again = [i for i, s in enumerate(steps) if s.phase == "recompute"]
    assert again, "the policy recomputes something"
    seen = set()
    for i in again:
        s = steps[i]
        # the same kernel on the same values twice would be a second copy of one activation
        key = (s.kind, s.op, s.ins, s.axes, tuple(sorted((k, repr(v)) for k, v in s.args.items() if k != "fn")))
        assert key not in seen, f"{s.label} recomputed twice"
        seen.add(key)
        readers = [j for j, t in enumerate(steps) if set(s.outs) & set(t.ins)]
        assert readers or set(s.outs) & kept, f"{s.label} ({s.op}) is recomputed and never read"
        if readers:   # nothing but recompute steps between it and its first reader
            assert all(steps[k].phase == "recompute" for k in range(i + 1, min(readers))), \
                f"{s.label} is recomputed {min(readers) - i} steps before its first reader"


# ----------------------------------------------------------------------------- bench/memory.py

def _memory_run(policy: str, allocated: int, rss: int, losses=(3.0, 2.9), grads: int = 60) -> dict:
    return {"policy": policy, "load_at_start": 1.0, "rss_rest": 100, "rss_peak": 100 + rss, "losses": list(losses),
            "allocated_peak": allocated, "plan_saved": allocated, "plan_saved_per_layer": allocated // 4,
            "plan_activations_peak": allocated, "plan_grads": grads, "plan_params": grads, "flops": 1e9}


def _sample(policy: str, turn: int, wall: float, cpu: float, loss: float = 2.5) -> dict:
    return {"policy": policy, "turn": turn, "loss": loss, "wall_s": wall, "cpu_s": cpu, "sys_s": 0.0,
            "minor_faults": 0, "major_faults": 0, "voluntary_switches": 0, "involuntary_switches": 3}


def test_the_bench_pairs_by_turn_and_calls_goals_by_median_measured_figures():
    # peaks with 60 bytes of gradients: activations 840, 450 and 40; RSS activations 940, 540, 140
    runs = [_memory_run("none", 900, 1000), _memory_run("selective", 510, 600), _memory_run("full", 100, 200)]
    # turn 1 ran on a machine twice as busy: paired by turn, the costs stay 1.1x and 1.3x
    walls = {"none": (1.0, 2.0, 1.0), "selective": (1.1, 2.2, 1.1), "full": (1.3, 2.6, 1.3)}
    timing = {"samples": [_sample(p, t, w[t], w[t] / 2) for p, w in walls.items() for t in range(3)]}
    s = bench.summarize(runs, timing)
    assert s["selective"]["time_cost"]["min"] == pytest.approx(1.1)
    assert s["selective"]["time_cost"]["max"] == pytest.approx(1.1)
    assert s["full"]["allocated_memory_cut"]["median"] == 9.0 and s["full"]["rss_memory_cut"]["median"] == 5.0
    assert s["full"]["allocated_activations_memory_cut"]["median"] == 21.0
    assert s["selective"]["rss_activations_memory_cut"]["median"] == pytest.approx(940 / 540)
    # selective: activations 840 / 450 = 1.87x (the goal's figure), 1.76x with the gradients,
    # 1.74x by RSS; 1.1x wall: met by activation memory, not with the gradients or by RSS
    assert s["selective"]["goal"] == {"memory": True, "time": True, "memory_with_grads": False, "memory_by_rss": False,
                                      "time_by_cpu": True, "met": True}
    assert s["full"]["goal"]["met"]
    slow = {**timing, "samples": [dict(x, wall_s=x["wall_s"] * 1.2) if x["policy"] == "selective" else x
                                  for x in timing["samples"]]}
    assert not bench.summarize(runs, slow)["selective"]["goal"]["met"]   # 1.32x > 1.15x
    other = [dict(r, losses=[3.0, 2.8]) if r["policy"] == "full" else r for r in runs]
    assert not bench.summarize(other, timing)["full"]["same_losses_as_none"]


def test_the_bench_rotates_the_policies_turn_by_turn():
    orders = [bench.turn_order(t) for t in range(3)]
    for p in bench.POLICIES:   # each policy first, second and last once in three turns
        assert sorted(o.index(p) for o in orders) == [0, 1, 2], p
