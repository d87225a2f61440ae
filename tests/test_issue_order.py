"""issue_order (a heap of ready steps) gives the order of its definition: list scheduling that
issues a ready asynchronous collective at once (lowest plan index first), otherwise the ready step
whose latest in-flight input was issued earliest, ties broken by plan order."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from meshdsl.runtime.executor import issue_order


def _reference(steps, async_kinds):
    """The definition, written plainly: scan every ready step at every pick."""
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    deps = [{producer[v] for v in s.ins if v in producer} for s in steps]
    done, in_flight, order = set(), {}, []
    while len(order) < len(steps):
        ready = [i for i in range(len(steps)) if i not in done and deps[i] <= done]
        starts = [i for i in ready if steps[i].kind in async_kinds]
        i = min(starts) if starts else min(
            ready, key=lambda j: (max((in_flight[v] for v in steps[j].ins if v in in_flight), default=-1), j))
        if steps[i].kind in async_kinds:
            in_flight.update((v, len(order)) for v in steps[i].outs)
        else:
            for v in steps[i].ins:
                in_flight.pop(v, None)
        done.add(i)
        order.append(i)
    return order


def _random_plan(rng, n):
    """``n`` steps over a random DAG of values: local steps and collectives (some async), a few
    plan inputs, steps reading a value twice, and steps with several outputs."""
    steps, made = [], list(range(-3, 0))   # negative ids: plan inputs
    next_id = 0
    for _ in range(n):
        kind = rng.choice(["local", "local", "allreduce", "allgather", "send"])
        ins = rng.sample(made, min(len(made), rng.randint(0, 3)))
        if ins and rng.random() < 0.1:
            ins.append(ins[0])
        outs = list(range(next_id, next_id + rng.randint(1, 2)))
        next_id += len(outs)
        made += outs
        steps.append(SimpleNamespace(kind=kind, ins=ins, outs=outs))
    return SimpleNamespace(steps=steps)


@pytest.mark.parametrize("async_kinds", [frozenset(), frozenset({"allreduce"}), frozenset({"allreduce", "allgather"})])
def test_issue_order_matches_its_definition_on_random_plans(async_kinds):
    rng = random.Random(7)
    for trial in range(150):
        plan = _random_plan(rng, rng.randint(1, 40))
        assert issue_order(plan, async_kinds) == _reference(plan.steps, async_kinds), trial
