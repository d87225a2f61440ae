"""Gradient buckets of reduce-scatters whose parts differ in length (lowering/bucket.py).

FSDP of ``d_model`` (8) over ``data:3`` cuts each gradient 3, 3, 2: the reduce-scatters pack into
one flat buffer per bucket, each member cut at its own lengths, the buffer cut at the sums (its
``uneven`` arg), as on ``data:2``'s even cut.  The simulated mesh checks every bucket's flat parts
as real ranks would hand them in (comm/real_parts.py), and the numbers are the dense program's.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_outputs, run_cli
from meshdsl.comm.bucket import pack_reduce_scatter

SOFTMOE = Path(__file__).parent / "heldout_softmoe.py"
FSDP = "batch:data; params.d_model:data"


def _counts(plan) -> dict:
    return {k: v["count"] for k, v in plan.totals().items()}


@pytest.mark.parametrize("mesh", ["data:3", "data:2"])
def test_fsdp_on_an_uneven_split_buckets_its_reduce_scatters_like_an_even_one(mesh):
    m = md.load_model(SOFTMOE, tiny=True)
    assert m.config.d_model % 3   # the uneven case really is uneven
    counts = _counts(md.compile(heldout_outputs(m), mesh, FSDP))
    # a bucket per layer (the loop streams them) and one for the rest, whatever the cut
    assert counts.get("bucket_reduce_scatter") == m.config.layers + 1
    assert "reduce_scatter" not in counts
    assert_heldout_case_matches_dense((SOFTMOE, {}, mesh, FSDP))


def test_an_uneven_bucket_is_packed_part_major_at_each_members_lengths():
    a, b = torch.arange(8.0), torch.arange(10.0, 16.0).reshape(2, 3)
    flat = pack_reduce_scatter([a, b], 3, [0, 1], [(3, 3, 2), ()])
    want = torch.cat([a[:3], b[:, :1].reshape(-1), a[3:6], b[:, 1:2].reshape(-1), a[6:], b[:, 2:].reshape(-1)])
    torch.testing.assert_close(flat, want, rtol=0, atol=0)   # a copy: exact


@pytest.mark.slow
def test_uneven_buckets_on_real_processes_match_dense(capsys):
    # gloo moves parts of one length: the bucket's flat parts are padded to the longest and cut back
    rc, out, err = run_cli(capsys, ["check", str(SOFTMOE), "--tiny", "--mesh", "data:3", "--layout", FSDP,
                                    "--nproc", "3", "--job-timeout", "120"])
    assert rc == 0, out + err
    assert "OK: 16 outputs match the dense program" in out
