"""Pipeline schedules: properties of every generated schedule, the validator's errors on
broken hand-written ones, the string and dict forms, and simulated vs recorded figures.

The properties are checked by code written here, not by the module's own helpers
(transfers are paired by scanning the rows; positions are compared directly), so a
bug in the validator cannot hide a bug in a generator.
"""
from __future__ import annotations

import ast
import doctest
import re
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshdsl.errors import MeshDSLError
from meshdsl.lowering import schedule as sch
from meshdsl.lowering import schedule_gen as gen
from meshdsl.lowering import timeline as tl
from meshdsl.lowering import w_placement as wp
from meshdsl.lowering.schedule import Action, Schedule, ScheduleError, parse_action, split_backward, validate
from meshdsl.lowering.schedule_gen import bubble_theory, make_schedule, peak_theory
from meshdsl.lowering.timeline import bubble_from_timeline, costs, format_table, simulate, theory_bubble

GRID = [(name, p, m) for name in ("gpipe", "1f1b") for p in (1, 2, 3, 4) for m in range(1, 9)]


@pytest.mark.parametrize("module, allowed", [(sch, {"errors"}), (gen, {"errors", "schedule", "timeline", "w_placement"}),
                                             (tl, {"schedule"}), (wp, {"schedule", "timeline"})])
def test_module_knows_nothing_about_torch(module, allowed):
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {n.name for node in ast.walk(tree) if isinstance(node, ast.Import) for n in node.names}
    imported |= {(node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.level == 0}
    relative = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0}
    assert not any(name.split(".")[0] == "torch" for name in imported)
    assert relative == allowed


def test_docstring_examples_run():
    results = [doctest.testmod(m) for m in (sch, gen, tl, wp)]
    assert sum(r.failed for r in results) == 0 and sum(r.attempted for r in results) >= 7


# ----------------------------------------------------------------------------- properties

@pytest.mark.parametrize("name,p,m", GRID)
def test_generated_schedule_properties(name, p, m):
    s = make_schedule(name, p, m)
    validate(s)
    assert (s.num_ranks, s.num_microbatches, len(s.actions)) == (p, m, p)
    for rank, row in enumerate(s.actions):
        pos = {a: i for i, a in enumerate(row)}
        assert len(pos) == len(row), "an action appears twice"
        for mb in range(m):
            f, b = Action("F", mb, rank), Action("B", mb, rank)
            assert f in pos and b in pos and pos[f] < pos[b]
        assert sum(a.kind in ("F", "B") for a in row) == 2 * m
    # Transfers between two ranks pair up in order: the k-th send is the k-th receive.
    for src in range(p):
        for dst in range(p):
            sent = [(a.kind[5:], a.microbatch, a.stage, a.peer) for a in s.actions[src]
                    if a.kind.startswith("send") and a.peer == dst]
            got = [(a.kind[5:], a.microbatch, a.peer, a.stage) for a in s.actions[dst]
                   if a.kind.startswith("recv") and a.peer == src]
            assert sent == got
            assert len(sent) == (m if abs(src - dst) == 1 else 0)
    if p == 1:
        assert all(a.kind in ("F", "B") for a in s.actions[0])


@pytest.mark.parametrize("name,p,m", GRID)
def test_unit_cost_bubble_and_peak_match_theory(name, p, m):
    stats = simulate(make_schedule(name, p, m))
    assert stats.makespan == 2 * (m + p - 1)
    for rank, r in enumerate(stats.ranks):
        assert r.busy == 2 * m
        assert r.idle_fraction == Fraction(p - 1, m + p - 1) == bubble_theory(p, m)
        assert r.peak_activations == peak_theory(name, p, m, rank)
    peaks = [r.peak_activations for r in stats.ranks]
    if name == "gpipe":
        assert peaks == [m] * p
    else:
        assert max(peaks) <= p and peaks[0] == min(p, m)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("forward,backward", [(1, 2), (2, 3), (Fraction(1, 3), 1)])
def test_bubble_does_not_depend_on_the_backward_to_forward_ratio(name, forward, backward):
    for p in (2, 3, 4):
        for m in (1, 3, 8):
            stats = simulate(make_schedule(name, p, m), costs(forward, backward))
            assert stats.makespan == (m + p - 1) * (forward + backward)
            assert all(r.idle_fraction == bubble_theory(p, m) for r in stats.ranks)


def test_latency_delays_each_receive():
    # F0@0, (1) F0@1, B0@1, (1) B0@0: four unit computes and two hops of latency 1.
    assert simulate(make_schedule("gpipe", 2, 1), latency=1).makespan == 6


def test_a_new_schedule_is_one_registered_function(monkeypatch):
    monkeypatch.setattr(gen, "SCHEDULES", dict(gen.SCHEDULES))

    @gen.register("gpipe-lifo", peak=lambda p, m, v, rank: m)
    def gpipe_lifo(p, m):
        return [[("F", mb, r) for mb in range(m)] + [("B", mb, r) for mb in reversed(range(m))] for r in range(p)]

    s = make_schedule("gpipe-lifo", 3, 4)
    assert [str(a) for a in s.actions[2][-3:]] == ["sB1@2>1", "B0@2", "sB0@2>1"]
    assert all(r.idle_fraction == bubble_theory(3, 4) and r.peak_activations == 4 for r in simulate(s).ranks)


INTERLEAVED = [(p, m, v) for p in (2, 3, 4) for v in (1, 2, 3) for m in range(p, 13, p)]


@pytest.mark.parametrize("p,m,v", INTERLEAVED)
def test_interleaved_properties(p, m, v):
    s = make_schedule("interleaved", p, m, num_chunks=v)
    assert s.num_stages == p * v
    for rank, row in enumerate(s.actions):
        pos = {a: i for i, a in enumerate(row)}
        assert len(pos) == len(row)
        assert {a.stage for a in row} == set(range(rank, p * v, p))
        for stage in range(rank, p * v, p):
            for mb in range(m):
                assert pos[Action("F", mb, stage)] < pos[Action("B", mb, stage)]
                if stage + 1 < p * v:  # the activation leaves after the F, the gradient arrives before the B
                    assert pos[Action("F", mb, stage)] < pos[Action("send_act", mb, stage, stage + 1)]
                    assert pos[Action("recv_grad", mb, stage, stage + 1)] < pos[Action("B", mb, stage)]
    stats = simulate(s)
    assert stats.makespan == 2 * (v * m + p - 1)
    for rank, r in enumerate(stats.ranks):
        assert r.busy == 2 * v * m
        assert r.idle_fraction == Fraction(p - 1, v * m + p - 1) == bubble_theory(p, m, v)
        assert r.peak_activations == peak_theory("interleaved", p, m, rank, v)
    # One activation per (stage, micro-batch): rank 0 warms up 2(p-1) + (v-1)p forwards, then holds one more.
    assert stats.ranks[0].peak_activations == min(v * m, 2 * (p - 1) + (v - 1) * p + 1)


def test_interleaved_beats_1f1b_bubble_for_more_activations():
    one, inter = simulate(make_schedule("1f1b", 4, 8)), simulate(make_schedule("interleaved", 4, 8, num_chunks=2))
    assert inter.ranks[0].idle_fraction == Fraction(3, 19) < one.ranks[0].idle_fraction == Fraction(3, 11)
    # Per chunk of half a stage: 11 half-stage activations are 5.5 stages' worth, more than 1F1B's 4.
    assert (inter.ranks[0].peak_activations, one.ranks[0].peak_activations) == (11, 4)


def test_interleaved_sizes_and_labels():
    for p, m in ((1, 4), (2, 3), (4, 6)):
        with pytest.raises(ScheduleError, match="needs at least 2 ranks|is not a multiple of the"):
            make_schedule("interleaved", p, m, num_chunks=2)
    s = make_schedule("interleaved", 2, 2, num_chunks=2)
    assert Schedule.from_rows(s.name, [" ".join(map(str, row)) for row in s.actions], 2, num_chunks=2) == s
    assert format_table(s).splitlines()[1:] == [
        "rank 0 | F0@0 F1@0 F0@2 F1@2 .    B0@2 .    B1@2 B0@0 B1@0",
        "rank 1 | .    F0@1 F1@1 F0@3 B0@3 F1@3 B1@3 B0@1 B1@1 .",
    ]


@st.composite
def _any_order(draw):
    """A schedule with one F order and one B order of the micro-batches shared by every rank (so
    transfers pair up), each rank interleaving them at random with every F before its B."""
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    forwards, backwards = draw(st.permutations(range(m))), draw(st.permutations(range(m)))
    orders = []
    for r in range(p):
        order, i, j = [], 0, 0
        while j < m:
            if i < m and (backwards[j] not in forwards[:i] or draw(st.booleans())):
                order.append(("F", forwards[i], r))
                i += 1
            else:
                order.append(("B", backwards[j], r))
                j += 1
        orders.append(order)
    return Schedule("random", p, m, sch.with_transfers(orders, p))


@settings(derandomize=True, max_examples=200, deadline=None)
@given(_any_order())
def test_any_valid_order_has_at_least_the_theoretical_bubble(s):
    p, m = s.num_ranks, s.num_microbatches
    try:
        validate(s)
    except ScheduleError as e:
        # The rows are built to pass every static check; only the walk can fail.
        assert "deadlock" in str(e).splitlines()[0]
        return
    stats = simulate(s)
    # Rank p-1 cannot start before p-1 and has 2m units to do; the last gradient then needs
    # p-1 more steps to reach rank 0: no order beats 2(m+p-1).
    assert stats.makespan >= 2 * (m + p - 1)
    assert all(r.idle_fraction >= bubble_theory(p, m) and 1 <= r.peak_activations <= m for r in stats.ranks)


# ----------------------------------------------------------------------------- string and table forms

@pytest.mark.parametrize("name,p,m", [("gpipe", 3, 2), ("1f1b", 4, 5)])
def test_string_round_trip(name, p, m):
    s = make_schedule(name, p, m)
    for row in s.actions:
        for a in row:
            assert parse_action(str(a)) == a
            assert parse_action(a.label(with_stage=False), stage=a.stage) == a
    assert Schedule.from_rows(name, [" ".join(a.label(False) for a in row) for row in s.actions], m) == s


def test_labels():
    assert [str(a) for a in (Action("F", 3, 1), Action("B", 0, 2), Action("send_act", 3, 1, 2),
                             Action("recv_act", 3, 2, 1), Action("send_grad", 4, 2, 1),
                             Action("recv_grad", 4, 1, 2), Action("W", 4, 2))] == [
        "F3@1", "B0@2", "sF3@1>2", "rF3@2<1", "sB4@2>1", "rB4@1<2", "W4@2"]
    assert parse_action("W4", stage=2) == Action("W", 4, 2)


@pytest.mark.parametrize("text", ["X3", "F", "sF3", "sF3<1", "rB3>1", "F3>1", "f3", "F-1", "sF3@1>2 ", "sW3>1",
                                  "rW3<1"])
def test_bad_labels_are_rejected_with_a_caret(text):
    with pytest.raises(ScheduleError, match=re.escape(text)) as e:
        parse_action(text, stage=0)
    assert "^" in str(e.value) and "Fix:" in str(e.value)


# ----------------------------------------------------------------------------- split backward (W)

@pytest.mark.parametrize("name,p,m", [("gpipe", 2, 4), ("1f1b", 2, 8), ("1f1b", 4, 5), ("gpipe", 3, 1)])
def test_split_backward_puts_each_sent_gradients_weights_right_after_the_send(name, p, m):
    s = make_schedule(name, p, m)
    split = split_backward(s)
    validate(split)
    for rank, (row, new) in enumerate(zip(s.actions, split.actions)):
        assert [a for a in new if a.kind != "W"] == list(row)
        ws = [i for i, a in enumerate(new) if a.kind == "W"]
        assert len(ws) == (m if rank > 0 else 0)          # the first stage sends no gradient
        for i in ws:
            assert new[i - 1] == Action("send_grad", new[i].microbatch, rank, rank - 1)
    # W costs nothing at unit cost: the theory is unchanged
    assert [r.idle_fraction for r in simulate(split).ranks] == [r.idle_fraction for r in simulate(s).ranks]
    assert Schedule.from_rows(name, [" ".join(map(str, row)) for row in split.actions], m) == split


def test_splitting_the_backward_shortens_the_step_when_the_weights_cost_time():
    """With F = 1, B = 2 and a third of B in its weight gradients, stage 0 gets each gradient
    sooner: the 1F1B step of 2 stages and 8 micro-batches ends earlier."""
    s = make_schedule("1f1b", 2, 8)
    whole = simulate(s, lambda a: {"F": 3, "B": 6}.get(a.kind, 0)).makespan
    split = simulate(split_backward(s), lambda a: {"F": 3, "B": 4, "W": 2}.get(a.kind, 0)).makespan
    assert split < whole


def test_a_w_needs_its_b():
    _error(["F0 sF0>1 rB0<1 B0", "rF0<0 F0 W0 B0 sB0>0"], 1,
           ["rank 1 position 2: W0@1 needs B0@1 earlier on rank 1 (at position 3)"])


def test_a_label_without_stage_needs_one():
    with pytest.raises(ScheduleError):
        parse_action("F3")


def test_table_shows_time_steps_and_the_bubble():
    assert format_table(make_schedule("1f1b", 2, 3)).splitlines()[1:] == [
        "rank 0 | F0 F1 .  B0 F2 B1 .  B2",
        "rank 1 | .  F0 B0 F1 B1 F2 B2 .",
    ]
    assert "bubble 1/4" in format_table(make_schedule("1f1b", 2, 3))
    lines = format_table(make_schedule("gpipe", 2, 2), transfers=True).splitlines()[1:]
    assert [line.split() for line in lines] == [
        ["rank", "0", "|", "F0", "sF0>1", "F1", "sF1>1", "rB0<1", "B0", "rB1<1", "B1"],
        ["rank", "1", "|", "rF0<0", "F0", "rF1<0", "F1", "B0", "sB0>0", "B1", "sB1>0"],
    ]


# ----------------------------------------------------------------------------- broken schedules

def _error(rows, m, match_all):
    s = Schedule.from_rows("hand", rows, m)
    with pytest.raises(ScheduleError) as e:
        validate(s)
    text = str(e.value)
    for piece in match_all:
        assert piece in text, f"{piece!r} not in:\n{text}"
    assert isinstance(e.value, MeshDSLError) and isinstance(e.value, ValueError)
    assert "Rule:" in text
    return text


def test_b_before_its_f():
    _error(["B0 F0"], 1, ["rank 0 position 0: B0@0 needs F0@0 earlier on rank 0 (at position 1)"])


def test_missing_receive():
    _error(["F0 sF0>1 rB0<1 B0", "F0 B0 sB0>0"], 1,
           ["rank 1 position 0: F0@1 needs rF0@1<0 earlier on rank 1 (missing)"])


def test_backward_and_send_need_their_inputs():
    _error(["F0 sF0>1 B0", "rF0<0 F0 B0 sB0>0"], 1,
           ["rank 0 position 2: B0@0 needs rB0@0<1 earlier on rank 0 (missing)"])
    _error(["sF0>1 F0 rB0<1 B0", "rF0<0 F0 B0 sB0>0"], 1,
           ["rank 0 position 0: sF0@0>1 needs F0@0 earlier on rank 0 (at position 1)"])


def test_receive_of_something_never_sent():
    _error(["F0 rB0<1 B0", "rF0<0 F0 B0 sB0>0"], 1,
           ["transfer 0 from rank 0 to rank 1 does not match", "send:    nothing",
            "receive: rank 1 position 0: rF0@1<0"])


def test_send_never_received():
    _error(["F0 sF0>1 sF0>1 rB0<1 B0", "rF0<0 F0 B0 sB0>0"], 1, ["duplicated action", "rank 0 position 2: sF0@0>1"])
    _error(["F0 sF0>1 F1 sF1>1 rB0<1 B0 rB1<1 B1", "rF0<0 F0 F1 B0 sB0>0 B1 sB1>0"], 2,
           ["F1@1 needs rF1@1<0", "(missing)"])


def test_swapped_receive_order_does_not_match_the_sends():
    text = _error(["F0 sF0>1 F1 sF1>1 rB0<1 B0 rB1<1 B1",
                   "rF1<0 rF0<0 F0 F1 B0 sB0>0 B1 sB1>0"], 2,
                  ["transfer 0 from rank 0 to rank 1 does not match",
                   "send:    rank 0 position 1: sF0@0>1", "receive: rank 1 position 0: rF1@1<0"])
    assert "Fix:" in text


def test_deadlock_names_each_blocked_rank():
    # Rank 0 waits for the gradient before sending the activation rank 1 needs to produce it.
    _error(["F0 rB0<1 sF0>1 B0", "rF0<0 F0 B0 sB0>0"], 1,
           ["deadlock", "rank 0 position 1: rB0@0<1 waits for sB0@1>0 on rank 1 (position 3)",
            "rank 1 position 0: rF0@1<0 waits for sF0@0>1 on rank 0 (position 2)"])


def test_missing_duplicated_misplaced_and_wrong_peer():
    _error(["F0 F1 B0", "F0"], 2, ["missing action", "rank 0 has no B1@0"])
    _error(["F0 B0 B0"], 1, ["duplicated action", "rank 0 position 2: B0@0"])
    _error(["F0 B0 F0@1 B0@1", ""], 1, ["wrong rank", "rank 0 position 2: F0@1 belongs to rank 1"])
    _error(["F0 sF0>1 B0"], 1, ["past an end", "rank 0 position 1: sF0@0>1: there is no stage 1"])
    _error(["F0 sF0>0 rB0<1 B0", "rF0<0 F0 B0 sB0>0"], 1, ["wrong peer", "peer should be stage 1"])
    _error(["F0 B0 F1 B1"], 1, ["out of range", "rank 0 position 2: F1@0"])


def test_one_action_list_per_rank():
    s = make_schedule("gpipe", 2, 2)
    with pytest.raises(ScheduleError, match="1 action lists for 2 ranks"):
        validate(Schedule("gpipe", 2, 2, s.actions[:1]))


def test_unknown_name_and_bad_sizes():
    with pytest.raises(ScheduleError, match="Did you mean '1f1b'"):
        make_schedule("1fb1", 2, 4)
    with pytest.raises(ScheduleError, match="Did you mean 'gpipe'"):
        make_schedule("gipe", 2, 4)
    for p, m in ((0, 4), (2, 0), (-1, 1), (2, True), (2.0, 4)):
        with pytest.raises(ScheduleError, match="positive integers"):
            make_schedule("1f1b", p, m)
    with pytest.raises(ScheduleError, match="no virtual stages"):
        make_schedule("gpipe", 2, 4, num_chunks=2)


# ----------------------------------------------------------------------------- recorded timelines

def test_bubble_from_a_recorded_timeline_agrees_with_simulate():
    f = lambda kind, mb, stage: Action(kind, mb, stage)  # noqa: E731
    # GPipe, 2 ranks, 2 micro-batches, as a runtime would record it (transfers omitted:
    # they do not count as busy), in wall-clock seconds from an arbitrary origin.
    t0 = 1000.0
    recorded = [[(f("F", 0, 0), t0 + 0, t0 + 1), (f("F", 1, 0), t0 + 1, t0 + 2),
                 (f("B", 0, 0), t0 + 4, t0 + 5), (f("B", 1, 0), t0 + 5, t0 + 6)],
                [(f("F", 0, 1), t0 + 1, t0 + 2), (f("F", 1, 1), t0 + 2, t0 + 3),
                 (f("B", 0, 1), t0 + 3, t0 + 4), (f("B", 1, 1), t0 + 4, t0 + 5)]]
    measured = bubble_from_timeline(recorded)
    simulated = simulate(make_schedule("gpipe", 2, 2))
    assert measured.makespan == simulated.makespan == 6
    for got, want in zip(measured.ranks, simulated.ranks):
        assert got.busy == want.busy == 4
        assert got.idle_fraction == pytest.approx(float(want.idle_fraction)) and want.idle_fraction == Fraction(1, 3)
        assert got.peak_activations == want.peak_activations == 2
    compute = [[e for e in row if e[0].kind in ("F", "B")] for row in simulated.timeline]
    assert compute == [[(a, t - t0, u - t0) for a, t, u in row] for row in recorded]


def test_a_receive_posted_before_the_first_forward_is_not_bubble():
    """A later stage that finished the previous step first waits in its receive before the
    first stage's F0 starts: that wait is the previous step's flush.  The makespan starts
    at the first F, so the recorded step gives the simulated bubble exactly."""
    f = lambda kind, mb, stage, peer=None: Action(kind, mb, stage, peer)  # noqa: E731
    t0 = 50.0
    early = [[(f("F", 0, 0), t0 + 0, t0 + 1), (f("F", 1, 0), t0 + 1, t0 + 2),
              (f("B", 0, 0), t0 + 4, t0 + 5), (f("B", 1, 0), t0 + 5, t0 + 6)],
             [(f("recv_act", 0, 1, 0), t0 - 7, t0 + 1),   # posted 7 time units before F0 started
              (f("F", 0, 1), t0 + 1, t0 + 2), (f("F", 1, 1), t0 + 2, t0 + 3),
              (f("B", 0, 1), t0 + 3, t0 + 4), (f("B", 1, 1), t0 + 4, t0 + 5)]]
    measured = bubble_from_timeline(early)
    simulated = simulate(make_schedule("gpipe", 2, 2))
    assert measured.makespan == simulated.makespan == 6
    assert [r.idle_fraction for r in measured.ranks] == pytest.approx([1 / 3, 1 / 3])
    # with no F or B at all (transfers only), the span is the transfers' own
    assert bubble_from_timeline([[(f("recv_act", 0, 1, 0), 2, 5)]]).makespan == 3


def test_peak_counts_an_activation_until_its_backward_ends():
    f = lambda kind, mb: Action(kind, mb, 0)  # noqa: E731
    # Recorded out of order: the runtime may append per thread; B0 ends before F2 starts.
    row = [(f("F", 2), 3, 4), (f("F", 0), 0, 1), (f("F", 1), 1, 2), (f("B", 0), 2, 3), (f("B", 1), 4, 5),
           (f("B", 2), 5, 6)]
    stats = bubble_from_timeline([row])
    assert stats.ranks[0].peak_activations == 2 and stats.ranks[0].busy == 6 and stats.ranks[0].idle_fraction == 0


# ----------------------------------------------------------------------------- zero bubble (ZB-H1)

ZB = [(p, m) for p in (1, 2, 3, 4) for m in range(1, 9)]


@pytest.mark.parametrize("p,m", ZB)
def test_zbh1_delays_rank_rs_last_ws_by_r_micro_batches(p, m):
    s = make_schedule("zbh1", p, m)
    for rank, row in enumerate(s.actions):
        pos = {a: i for i, a in enumerate(row)}
        bs = [a.microbatch for a in row if a.kind == "B"]
        assert [a.microbatch for a in row if a.kind == "W"] == list(range(m))
        for mb in range(m):
            w = pos[Action("W", mb, rank)]
            assert w > pos[Action("B", mb, rank)]
            # the rank's Bs before this W: its own, and over the last p micro-batches the next
            # `rank` too (all there are, at the end)
            want = mb + 1 if mb < m - p else min(mb + rank + 1, m)
            assert sum(row[i].kind == "B" for i in range(w)) == want
        # without its Ws, the rank runs 1F1B's list
        assert [a for a in row if a.kind != "W"] == list(make_schedule("1f1b", p, m).actions[rank])
        assert bs == list(range(m))
    # split_backward leaves a schedule's own Ws alone
    assert split_backward(s) == s


@pytest.mark.parametrize("p,m", ZB)
def test_zbh1_bubble_and_peak(p, m):
    s = make_schedule("zbh1", p, m)
    stats = simulate(s, costs(1, 1, w=1))
    for rank, r in enumerate(stats.ranks):
        assert r.busy == 3 * m
        assert r.peak_activations == peak_theory("zbh1", p, m, rank) == min(p, m)   # at most 1F1B's largest
    one_f_one_b = simulate(make_schedule("1f1b", p, m), costs(1, 2)).makespan
    if m >= p:   # p - 1 idle steps on each rank instead of 1F1B's 3(p - 1)
        assert stats.makespan == 3 * m + p - 1
        assert all(r.idle_fraction == Fraction(p - 1, 3 * m + p - 1) for r in stats.ranks)
        assert theory_bubble(s) == Fraction(p - 1, 3 * m + p - 1)
    assert stats.makespan <= one_f_one_b and (p == 1 or stats.makespan < one_f_one_b)


def test_zbh1_ends_sooner_when_the_last_stage_is_slower():
    """The measured shape of bench/pipeline.py at m = 8: the last stage (head and loss) is the
    slower one.  Its second delayed W overlaps the first stage's last backward."""
    cost = {("F", 0): 5.2, ("B", 0): 5.3, ("W", 0): 5.4, ("F", 1): 6.4, ("B", 1): 5.0, ("W", 1): 5.3}
    price = lambda a: cost.get((a.kind, a.stage), 0.0)  # noqa: E731
    split = simulate(split_backward(make_schedule("1f1b", 2, 8)),
                     lambda a: 10.7 if (a.kind, a.stage) == ("B", 0) else price(a)).makespan
    zb = simulate(make_schedule("zbh1", 2, 8), price).makespan
    assert zb == pytest.approx(split - 5.3)


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2)])
def test_theory_bubble_is_the_closed_form_for_unsplit_schedules(name, p, m, v):
    assert theory_bubble(make_schedule(name, p, m, v)) == bubble_theory(p, m, v)


def test_zbh1_table_shows_its_ws():
    assert format_table(make_schedule("zbh1", 2, 4)).splitlines() == [
        "zbh1: 2 ranks, 4 micro-batches; one column per time step with F = B = W = 1; '.' is idle; bubble 1/13",
        "rank 0 | F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 B3 W3",
        "rank 1 | .  F0 B0 W0 F1 B1 W1 F2 B2 F3 B3 W2 W3"]


def test_delaying_every_w_as_the_paper_draws_it_gains_nothing():
    """The figure of ZB-H1 delays rank r's every W by r micro-batches; zbh1 delays only those
    of the last p.  Same makespan at F = B = W = 1, same peak, for every p, m checked."""
    def every_w_delayed(p, m):
        rows = []
        for r in range(p):
            order = []
            for kind, mb, stage in gen._warm_then_alternate([("F", i, r) for i in range(m)],
                                                            [("B", i, r) for i in range(m)], min(p - 1 - r, m)):
                order.append((kind, mb, stage))
                if kind == "B" and mb >= r:
                    order.append(("W", mb - r, stage))
            rows.append(order + [("W", i, r) for i in range(max(m - r, 0), m)])
        return rows
    for p in range(1, 7):
        for m in range(1, 13):
            ours = make_schedule("zbh1", p, m)
            paper = Schedule("paper", p, m, sch.with_transfers(every_w_delayed(p, m), p))
            a, b = simulate(ours, sch.theory_cost(ours)), simulate(paper, sch.theory_cost(paper))
            assert a.makespan == b.makespan, (p, m)
            assert [r.peak_activations for r in a.ranks] == [r.peak_activations for r in b.ranks], (p, m)
