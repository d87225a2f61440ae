"""processes/cores.py: ``MESHDSL_BIND_CORES=rank`` gives each spawned rank cores of its own."""
from __future__ import annotations

import multiprocessing
import os

import pytest
from hypothesis import given, strategies as st

from meshdsl.errors import DistributedError
from meshdsl.processes import cores
from meshdsl.processes import launcher as launch

AFFINITY = hasattr(os, "sched_getaffinity")


@given(nproc=st.integers(1, 9), n_cores=st.integers(1, 33))
def test_the_ranks_slices_are_disjoint_equal_and_in_order(nproc, n_cores):
    usable = list(range(3, 3 + 2 * n_cores, 2))   # not 0..n-1: a container's or taskset's set
    slices = [cores.cores_of(r, nproc, usable) for r in range(nproc)]
    if nproc > n_cores:   # fewer cores than ranks: nobody is bound
        assert all(s == usable for s in slices)
        return
    flat = [c for s in slices for c in s]
    assert len(set(flat)) == len(flat) == nproc * (n_cores // nproc)
    assert flat == usable[:len(flat)]   # contiguous, rank by rank
    assert {len(s) for s in slices} == {n_cores // nproc}


def _affinity(rank):
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(not AFFINITY or len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_spawned_ranks_are_bound_only_when_asked(monkeypatch):
    usable = sorted(os.sched_getaffinity(0))
    monkeypatch.delenv(cores.ENV, raising=False)
    assert launch.spawn(_affinity, 2, timeout=120) == [usable, usable]
    monkeypatch.setenv(cores.ENV, "rank")
    assert launch.spawn(_affinity, 2, timeout=120) == [cores.cores_of(r, 2, usable) for r in range(2)]
    assert sorted(os.sched_getaffinity(0)) == usable   # the parent is left as it was


@pytest.mark.parametrize("bad", ["1", "RANK", "numa"])
def test_an_unknown_binding_is_a_clear_error_before_any_rank_starts(bad, monkeypatch):
    monkeypatch.setenv(cores.ENV, bad)
    with pytest.raises(DistributedError) as e:
        launch.spawn(print, 1)
    text = str(e.value)
    assert f"MESHDSL_BIND_CORES={bad!r}" in text and "none, rank" in text and "Fix:" in text
    assert multiprocessing.active_children() == []
