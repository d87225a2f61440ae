"""The pipeline's value store (meshdsl/runtime/pipeline_store.py): a rank a collective gave
nothing reads None, on a view of several ranks (the simulated mesh) and of one (each action's
view on real processes) alike.

A halo's permute at the end of a dim gives the end rank nothing on the side with no neighbour
(its glue reads zeros there). Where that permute runs in a pipeline's prologue (DeiT's tokens
joined to split patches, under ``layer:stage; seq:model`` on 4 gloo processes), the one-rank
view stored nothing for the value at all, and the glue's read raised a KeyError.
"""
from __future__ import annotations

import pytest
import torch

from meshdsl.runtime.pipeline_store import OneRankEnv, ViewEnv


@pytest.mark.parametrize("make, ranks", [(ViewEnv, (0, 1)), (OneRankEnv, (0,))])
def test_a_rank_given_nothing_reads_none(make, ranks):
    store = {}
    env = make(store, ranks)
    env[7] = [None] * len(ranks)             # a permute's result at the end of a dim
    assert env.get(7) == [None] * len(ranks)
    x = torch.ones(2)
    env[8] = [x] * len(ranks)
    assert all(got is x for got in env.get(8))


def test_a_value_never_written_is_still_an_error():
    """Only a written None reads as None: a value no step made stays a KeyError (a lowering bug)."""
    with pytest.raises(KeyError):
        OneRankEnv({}, (0,)).get(9)
