"""``bench/pipeline.py``'s account of a stage's idle time: where it goes, and what the ranks' own
work explains.

* :func:`idle_breakdown` cuts each rank's share of the makespan into busy time, its sends, its
  receives after and before the sender's send ended, the time between its actions and its fill
  and drain; the parts add up to the makespan.
* :func:`bubble_at_own_costs` replays the schedule at the mean costs of what each rank does
  itself: given a run simulated at exactly such costs, it gives back that run's bubble.
"""
from __future__ import annotations


import pytest

from meshdsl.lowering.pipeline_program import PipelineProgram
from meshdsl.lowering.schedule_gen import make_schedule
from meshdsl.lowering.timeline import simulate

from conftest import load_bench


bench = load_bench("pipeline")

# Binary fractions: every sum below is exact in floating point.
COMPUTE = {"F": 2.0, "B": 3.0, "W": 1.5}
SEND, COPY = 0.25, 0.5


def _cost(a):
    return COMPUTE.get(a.kind, SEND if a.is_send else COPY)


def _rows(stats) -> list:
    """A simulated timeline as the bench gathers measured ones: per rank, (kind, micro-batch,
    stage, peer, start, end)."""
    return [[(a.kind, a.microbatch, a.stage, a.peer, float(t0), float(t1)) for a, t0, t1 in row]
            for row in stats.timeline]


HAND = [[("F", 0, 0, None, 0.0, 2.0), ("send_act", 0, 0, 1, 2.0, 2.5),
         ("recv_grad", 0, 0, 1, 3.0, 9.5), ("B", 0, 0, None, 9.5, 13.5)],
        [("recv_act", 0, 1, 0, 0.0, 3.0), ("F", 0, 1, None, 3.0, 5.0),
         ("B", 0, 1, None, 5.5, 8.5), ("send_grad", 0, 1, 0, 8.5, 8.75)]]


def _ms(**parts):
    return {k.replace("_", " ").replace("fill drain", "fill+drain"): v * 1e3 for k, v in parts.items()}


@pytest.mark.parametrize("skew", [0.0, 0.375, -1.25])
def test_idle_breakdown_of_a_hand_made_step(skew):
    """Each way a transfer takes 1 from send start to receive end, so the clocks line up; a
    process whose clock is off by ``skew`` is shifted back onto the other's."""
    rows = [HAND[0], [(*a[:4], a[4] + skew, a[5] + skew) for a in HAND[1]]]
    first, second = bench.idle_breakdown([rows], 2)
    # stage 0 waits for the gradient sent at 8.75 from 3, then takes it in (0.75); 0.5 between its send and that receive
    assert first == pytest.approx(_ms(makespan=13.5, busy=6, send=0.5, recv_copy=0.75, recv_wait=5.75, between=0.5,
                                      fill_drain=0))
    # stage 1 waits until 2.5 for its input, takes 0.5 to take it in, and is done 4.75 before stage 0
    assert second == pytest.approx(_ms(makespan=13.5, busy=5, send=0.25, recv_copy=0.5, recv_wait=2.5, between=0.5,
                                       fill_drain=4.75))


@pytest.mark.parametrize("name,m,v", [("1f1b", 4, 1), ("interleaved", 4, 2), ("zbh1", 4, 1), ("interleaved-zb", 4, 2)])
def test_the_ranks_own_costs_explain_a_run_at_those_costs(name, m, v):
    prog = PipelineProgram.of_schedule(make_schedule(name, 2, m, v))
    # the runtime's split schedule, with each receive taking COPY after its message is sent
    stats = simulate(prog.run_schedule(True), _cost, COPY)
    rows = _rows(stats)
    assert bench.bubble_at_own_costs(prog, [rows]) == pytest.approx([float(r.idle_fraction) for r in stats.ranks])
    for parts, r, row in zip(bench.idle_breakdown([rows], 2), stats.ranks, rows):
        assert sum(parts[k] for k in ("busy", *bench.IDLE_PARTS)) == pytest.approx(parts["makespan"])
        assert parts["busy"] == pytest.approx(float(r.busy) * 1e3)
        assert parts["send"] == pytest.approx(SEND * 1e3 * sum(kind.startswith("send") for kind, *_ in row))
        assert parts["recv copy"] == pytest.approx(COPY * 1e3 * sum(kind.startswith("recv") for kind, *_ in row))
        assert parts["between"] == 0   # a simulated rank starts each action as the one before ends
    # free transfers: the theory's bubble is what is left
    free = simulate(prog.run_schedule(True), lambda a: COMPUTE.get(a.kind, 0.0))
    assert bench.bubble_at_own_costs(prog, [_rows(free)]) == pytest.approx([float(r.idle_fraction) for r in free.ranks])


def test_ws_placed_at_a_runs_costs_are_never_worse_there():
    """interleaved-zb's Ws placed at a run's mean costs: the run's own bubble comes back, and the
    placed schedule's is no larger on any rank (the same work, a makespan no longer)."""
    prog = PipelineProgram.of_schedule(make_schedule("interleaved", 2, 8, 2))
    heavy = lambda a: COMPUTE.get(a.kind, 0.0) * (1.5 if a.stage == 3 else 1.0)  # noqa: E731  (the head's stage)
    stats = simulate(prog.run_schedule(True), heavy)
    got = bench.placed_at_measured_costs(prog, [_rows(stats)])
    assert got["bubble_run"] == pytest.approx([float(r.idle_fraction) for r in stats.ranks])
    # 1e-12: the two ratios are divided from sums taken in other orders (exact here, binary fractions)
    assert all(a <= b + 1e-12 for a, b in zip(got["bubble_placed"], got["bubble_run"]))
    assert got["ws_after_last_b"][1] > 1 and min(got["bubble_placed"]) < min(got["bubble_run"])
