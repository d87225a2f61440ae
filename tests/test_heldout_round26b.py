"""Held-out models of round 26b (written from the README and docs alone).

``tests/heldout_informer.py`` (Informer-lite: ProbSparse self-attention, its active queries the top-u
by a sparsity measure over fed sampled keys, the rest the mean of V; a distilling conv + ELU +
max-pool between two encoder layers; MSE forecast); ``tests/heldout_nhits.py`` (DLinear's
moving-average decomposition with edge padding, N-HiTS stacks of MLP blocks on multi-rate pooled
inputs, interpolated by a constant matrix, residual backcasts through a repeat's carry, forecasts
as per-layer outputs or, ``form=carry``, in the carry); ``tests/heldout_sage.py`` (GraphSAGE on a fed
sampled neighbourhood: masked mean and -inf-masked max, concat with self, L2 norm, masked node
CE); ``tests/heldout_cfc.py`` (a closed-form continuous-time RNN over fed time gaps, per-step
outputs of ``md.repeat``); ``tests/heldout_canine.py`` (CANINE-lite: K hash embeddings summed, a
block-diagonal local attention from md.arange integer math, a stride-4 conv down to a deep
transformer, upsampling by broadcast + rearrange, a conv back to chars, masked char CE). Each runs
under data, Megatron, sequence/feature splits (2-way, uneven 3-way), FSDP, pipelines (where a
layer stack allows one), remat and the search's layouts against the dense program, and each is
its plain-torch reference. Two fixes they found are tested here too: edge padding over a split
time moved the whole padded length (lowering/window.py), and md.top_k kept other indices of tied
values over a split dim than densely (ops/topk.py). Findings: /work/notes/heldout-26b.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_dense_is_its_torch_reference, assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id, run_cli)

HERE = Path(__file__).parent
IDS = ["informer", "nhits", "sage", "cfc", "canine"]
INFORMER, NHITS, SAGE, CFC, CANINE = ALL = [str(HERE / f"heldout_{n}.py") for n in IDS]
PIPE = {"microbatches": 2, "schedule": "1f1b"}
GPIPE = {"microbatches": 2, "schedule": "gpipe"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (SAGE, {}, "data:3", "nodes:data"),                            # the gathered table split unevenly
    (CFC, {}, "model:2", "hidden:model"),                          # the recurrence's state split
    (NHITS, {}, "model:3", "time:model"),                          # edge padding, pooling, backcast over a split
]

SLOW_CASES = [
    (INFORMER, {}, "data:2", "batch:data"),
    (INFORMER, {"batch": 5}, "data:3", "batch:data"),
    (INFORMER, {}, "model:2", "heads:model; d_ff:model"),
    (INFORMER, {}, "model:2", "time:model"),                       # top-k over a split time, distilling halos
    (INFORMER, {}, "model:3", "time:model"),
    (INFORMER, {}, "model:2", "d_model:model"),
    (INFORMER, {"d_ff": 15}, "model:3", "d_ff:model"),
    (INFORMER, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (INFORMER, {}, "data:2; model:2", "batch:data; time:model"),
    (INFORMER, {}, "data:2", "batch:data; params.d_model:data"),
    (INFORMER, {"time": 18}, "model:3", "time:model"),            # u = 9 over 3 after the max-pool
    (NHITS, {}, "data:2", "batch:data"),
    (NHITS, {"batch": 5}, "data:3", "batch:data"),
    (NHITS, {}, "model:2", "time:model"),
    (NHITS, {}, "model:2", "hidden:model"),
    (NHITS, {}, "model:3", "hidden:model"),
    (NHITS, {}, "model:2", "horizon:model"),
    (NHITS, {}, "data:2; model:2", "batch:data; hidden:model"),
    (NHITS, {}, "data:2", "batch:data; params.hidden:data"),
    (NHITS, {"form": "carry"}, "stage:2", "blk0:stage; blk1:stage", PIPE),
    (NHITS, {"form": "carry", "blocks": 4}, "stage:2", "blk0:stage; blk1:stage", INTERLEAVED),
    (NHITS, {"form": "carry"}, "stage:2; data:2", "blk0:stage; blk1:stage; batch:data", GPIPE),
    (NHITS, {"remat": "full"}, "model:2", "time:model"),
    (NHITS, {"form": "carry"}, "stage:2; model:2", "blk0:stage; blk1:stage; time:model", PIPE),
    (SAGE, {}, "data:2", "nodes:data"),
    (SAGE, {}, "data:2", "fanout:data"),
    (SAGE, {}, "data:3", "fanout:data"),
    (SAGE, {}, "model:2", "hidden:model"),
    (SAGE, {}, "model:3", "hidden:model"),
    (SAGE, {}, "data:2; model:2", "nodes:data; hidden:model"),
    (SAGE, {}, "data:2; model:2", "fanout:data; classes:model"),
    (SAGE, {}, "data:2", "nodes:data; params.hidden:data"),
    (SAGE, {"nodes": 13}, "data:2; model:2", "nodes:data; fanout:model"),
    (CFC, {}, "data:2", "batch:data"),
    (CFC, {}, "data:3", "batch:data"),
    (CFC, {}, "model:2", "backbone:model"),
    (CFC, {}, "model:3", "hidden:model"),
    (CFC, {}, "data:2; model:2", "batch:data; hidden:model"),
    (CFC, {}, "data:2", "batch:data; params.hidden:data"),
    (CFC, {}, "stage:2", "time:stage", PIPE),                     # the recurrence's steps pipelined
    (CFC, {}, "stage:3", "time:stage", GPIPE),
    (CFC, {}, "stage:4", "time:stage", {"microbatches": 2, "stage_layers": (1, 2, 2, 1)}),
    (CFC, {"remat": "full"}, "data:2", "batch:data"),
    (CANINE, {}, "data:2", "batch:data"),
    (CANINE, {"batch": 5}, "data:3", "batch:data"),
    (CANINE, {}, "model:2", "heads:model; d_ff:model"),
    (CANINE, {}, "model:2", "chars:model"),                        # halos of both convs, keys gathered
    (CANINE, {}, "model:3", "chars:model"),
    (CANINE, {}, "model:2", "mol:model"),
    (CANINE, {}, "model:2", "d_model:model"),
    (CANINE, {"heads": 4}, "model:3", "heads:model"),
    (CANINE, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (CANINE, {}, "data:2", "batch:data; params.d_model:data"),
    (CANINE, {}, "stage:2", "layer:stage", PIPE),
    (CANINE, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (CANINE, {}, "stage:2; model:2", "layer:stage; chars:model", PIPE),
    (CANINE, {"remat": "selective"}, "model:2", "heads:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("path,over", [
    pytest.param(INFORMER, {}, marks=pytest.mark.slow, id="informer"),
    pytest.param(NHITS, {}, marks=pytest.mark.slow, id="nhits"),
    pytest.param(NHITS, {"form": "carry"}, marks=pytest.mark.slow, id="nhits-carry"),
    pytest.param(SAGE, {}, id="sage"),
    pytest.param(CFC, {}, marks=pytest.mark.slow, id="cfc"),
    pytest.param(CANINE, {}, marks=pytest.mark.slow, id="canine"),
])
def test_the_model_is_its_torch_reference(path, over):
    """Each model written in plain torch (topk + scatter, sdpa, conv1d + max_pool1d; replicate
    padding, avg/max_pool1d, F.interpolate; a row index and masked_fill; a Python loop over time;
    table rows, a block-diagonal mask, a strided conv1d, repeat_interleave) gives the DSL model's
    loss, and torch autograd (float64) its gradients: the dense oracle itself is right."""
    assert_dense_is_its_torch_reference(path, **over)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (INFORMER, "model:2", "time:model"),
    (NHITS, "model:2", "time:model"),
    (SAGE, "data:2", "nodes:data"),
    (CFC, "data:2", "batch:data"),
    (CANINE, "model:2", "chars:model"),
], ids=IDS)
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (INFORMER, "data:2; model:2", "batch:data; heads:model"),
    (NHITS, "data:2; model:2", "batch:data; hidden:model"),
    (SAGE, "data:2; model:2", "nodes:data; hidden:model"),
    (CFC, "data:2", "batch:data"),
    (CANINE, "data:2; model:2", "batch:data; chars:model"),
], ids=IDS)
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)


def _edge_padded_plan(time: int):
    """DLinear's edge padding (first and last rows repeated, N-HiTS's decomposition) under
    ``time:model``: its plan and whether it gives the dense program's loss and gradient."""
    B, C = md.Dim("batch", 4), md.Dim("series", 2)
    with md.Graph():
        x = md.input("x", [B, md.Dim("time", time), C])
        w = md.param("w", [C], fan_out=[])
        padded = md.concat([md.slice_(x, "time", 0, 1), x, md.slice_(x, "time", time - 1, time)], "time") * w
        loss = md.reduce_sum(padded * padded)
        outputs = {"loss": loss, **md.grad(loss, {"w": w})}
        feeds = {"x": torch.randn(4, time, 2, generator=torch.Generator().manual_seed(0))}
        return md.compile(outputs, "model:2", "time:model"), md.check(outputs, "model:2", "time:model", feeds)


def test_edge_padding_over_a_split_time_moves_its_rows_not_the_padded_length():
    """Each rank's overlap with the first (last) row is a partial sum; padded lazily to the whole
    padded length it was reduce-scattered at that length (1,152 B at time 16, 4,224 B at 64, 8 MiB
    at batch 32 x time 512 x 64 series). The pad reduces its one-row input first where the cost
    model finds that cheaper: the bytes stay those of the rows, whatever the length."""
    short, ok_short = _edge_padded_plan(16)
    long, ok_long = _edge_padded_plan(64)
    assert ok_short.ok and ok_long.ok, (str(ok_short), str(ok_long))
    assert short.totals() == long.totals(), (short.totals(), long.totals())
    moved = sum(s.bytes for s in long.steps if s.is_collective and s.phase == "forward")
    assert moved <= 2 * 4 * 2 * 4 + 4, long.totals()      # two rows of [batch 4, series 2] and the loss


def test_top_k_keeps_the_lowest_indices_of_tied_values_on_every_layout():
    """ProbSparse picks its active queries by md.top_k; tied scores (identical queries: a padded
    or constant series) used to keep other indices over a split dim (each rank's top k, then the
    candidates') than torch.topk kept densely, so a mask made from them differed. Tied values are
    now kept and ordered lowest index first (a stable descending sort's first k), dense and split."""
    B, N = md.Dim("batch", 3), md.Dim("time", 32)
    rows = [[1.0] * 32, [0.0, 2.0] * 16, [float(i % 4) for i in range(32)]]
    x_ = torch.tensor(rows)
    stable = torch.sort(x_, dim=1, descending=True, stable=True)
    for k in (2, 3, 5):
        with md.Graph():
            x = md.input("x", [B, N])
            vals, idx = md.top_k(x, "time", k, new_dim="active")
            mask = md.reduce_sum(md.one_hot(idx, N), "active")
            outputs = {"vals": vals, "idx": idx, "mask": mask}
            want = md.run_dense(outputs, {"x": x_})
            assert torch.equal(want["idx"], stable.indices[:, :k]), (k, want["idx"])
            for mesh in ("model:2", "model:4"):       # the two-round top-k over 16- and 8-long parts
                got = md.run_simulated(md.compile(outputs, mesh, "time:model"), {"x": x_})
                for name in outputs:
                    assert torch.equal(got[name], want[name]), (k, mesh, name, got[name], want[name])
