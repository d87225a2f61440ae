"""Held-out models of round 13b (written from the README and docs alone): click-through rate,
graphs with coordinates, flows and capsules.

``tests/heldout_deepfm.py`` (DeepFM: every field's ids embedded from one table by ``md.gather`` at
field offsets, the FM second-order term ``((sum v)^2 - sum v^2) / 2``, a deep MLP over the
flattened fields, BCE from softplus); ``tests/heldout_dcnv2.py`` (DCN-v2: embeddings and dense
features joined by ``md.concat``, cross layers ``x0 * (W x_l + b) + x_l`` in a repeat that reads
``x0`` from outside, an MLP, BCE from log-sigmoid); ``tests/heldout_egnn.py`` (an E(n)-equivariant
GNN: dense all-pairs edges with a mask, an edge MLP of ``(h_i, h_j, |x_i - x_j|^2)``, coordinate
and node updates, ``h`` and ``x`` carried together by a concat, energy and denoising losses);
``tests/heldout_realnvp.py`` (RealNVP: affine coupling layers on halves cut by ``slice_`` or by
``rearrange``, alternating, the log-determinants as per-layer outputs, Gaussian NLL);
``tests/heldout_capsnet.py`` (a capsule network: conv primary capsules, squash, 3 unrolled
iterations of routing by agreement, margin loss). Each runs under data, Megatron, feature, field,
table, node and spatial splits (2-way, uneven 3- and 4-way, 2x2, two axes on one dim), FSDP,
pipelines (1f1b, zbh1, interleaved, interleaved-zb, unequal stages) and remat against the dense
program. Findings: /work/notes/heldout-13b.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id,
                      heldout_outputs, run_cli)

HERE = Path(__file__).parent
DEEPFM, DCNV2, EGNN, REALNVP, CAPSNET = (
    str(HERE / f"heldout_{n}.py") for n in ("deepfm", "dcnv2", "egnn", "realnvp", "capsnet"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
REARRANGE = {"form": "rearrange"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (DEEPFM, {}, "model:4", "vocab:model"),                                  # the one table's rows, 8/8/7/7
    (DCNV2, {}, "stage:2", "layer:stage", {**PIPE, "schedule": "zbh1"}),     # x0 read by every stage
    (EGNN, {}, "model:3", "node:model"),                                     # all-pairs edges, 7 nodes in 3/2/2
    (REALNVP, REARRANGE, "model:3", "d:model"),                              # halves cut from an uneven split
    (REALNVP, {}, "stage:2", "layer:stage", INTERLEAVED),                    # per-layer log-dets, 2 chunks a stage
    (CAPSNET, {}, "model:3", "outcaps:model"),                               # routing softmax over split classes
]

# more of the same kinds, with -m slow
SLOW_CASES = [
    (DEEPFM, {}, "data:2", "batch:data"),
    (DEEPFM, {}, "data:3", "batch:data"),
    (DEEPFM, {}, "model:2", "h1:model"),
    (DEEPFM, {}, "model:3", "h2:model"),
    (DEEPFM, {}, "model:3", "k:model"),
    (DEEPFM, {}, "model:4", "field:model"),
    (DEEPFM, {}, "model:3", "field_k:model"),
    (DEEPFM, {}, "model:2", "field:model; vocab:model"),
    (DEEPFM, {}, "data:2", "batch:data; params.k:data"),
    (DEEPFM, {}, "data:2; model:2", "batch:data; vocab:model"),
    (DEEPFM, {}, "data:2; model:2", "vocab:(data,model)"),
    (DCNV2, {}, "data:2", "batch:data"),
    (DCNV2, {}, "model:2", "d2:model"),
    (DCNV2, {}, "model:3", "d:model"),
    (DCNV2, {}, "model:4", "h:model"),
    (DCNV2, {}, "model:2", "vocab:model"),
    (DCNV2, {}, "data:2", "batch:data; params.d:data"),
    (DCNV2, {}, "data:2; model:2", "d:(data,model)"),
    (DCNV2, {}, "stage:2", "layer:stage", PIPE),
    (DCNV2, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (DCNV2, {"layers": 3}, "stage:2", "layer:stage", {**PIPE, "stage_layers": [2, 1]}),
    (DCNV2, {"remat": "full"}, "stage:2; model:2", "layer:stage; d:model", PIPE),
    (DCNV2, {"remat": "selective"}, "model:2", "d2:model"),
    (EGNN, {}, "data:2", "batch:data"),
    (EGNN, {}, "model:2", "node2:model"),
    (EGNN, {}, "model:2", "e:model"),
    (EGNN, {}, "model:3", "c:model"),
    (EGNN, {"nodes": 5}, "model:4", "node2:model"),
    (EGNN, {}, "data:2; model:2", "node:(data,model)"),
    (EGNN, {}, "data:2; model:2", "node:data; node2:model"),
    (EGNN, {}, "data:2", "batch:data; params.f:data"),
    (EGNN, {}, "stage:2", "layer:stage", PIPE),
    (EGNN, {"layers": 4}, "stage:2", "layer:stage", {"microbatches": 4, "schedule": "interleaved-zb:2"}),
    (EGNN, {"layers": 4}, "stage:2", "layer:stage", {"microbatches": 4, "schedule": "1f1b", "stage_layers": [3, 1]}),
    (EGNN, {"remat": "full"}, "stage:2; model:2", "layer:stage; node:model", PIPE),
    (EGNN, {"remat": "selective"}, "model:2", "e:model"),
    (REALNVP, {}, "data:2", "batch:data"),
    (REALNVP, {}, "model:3", "hid:model"),
    (REALNVP, {}, "model:2", "d:model"),
    (REALNVP, {"d": 10}, "model:3", "d:model"),
    (REALNVP, {}, "model:3", "half:model"),
    (REALNVP, REARRANGE, "model:2", "two_half:model"),
    (REALNVP, {}, "data:2", "batch:data; params.hid:data"),
    (REALNVP, {}, "stage:4", "layer:stage", PIPE),
    (REALNVP, {}, "stage:2; data:2", "layer:stage; batch:data", {**PIPE, "schedule": "zbh1"}),
    (REALNVP, {"remat": "full"}, "stage:2; model:2", "layer:stage; hid:model", PIPE),
    (REALNVP, REARRANGE, "stage:2; model:2", "layer:stage; d:model", PIPE),
    (CAPSNET, {}, "data:2", "batch:data"),
    (CAPSNET, {}, "model:2", "height:model"),
    (CAPSNET, {"size": 7}, "model:2", "height:model"),
    (CAPSNET, {}, "model:3", "width:model"),
    (CAPSNET, {}, "model:3", "incaps:model"),
    (CAPSNET, {}, "model:2", "od:model"),
    (CAPSNET, {}, "model:2", "cd:model"),
    (CAPSNET, {}, "data:2", "batch:data; params.incaps:data"),
    (CAPSNET, {}, "data:2; model:2", "incaps:model; outcaps:data"),
    (CAPSNET, {}, "data:2; model:2", "height:(data,model)"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_realnvps_two_ways_to_cut_the_halves_compute_the_same_flow():
    """Halves cut by ``slice_`` and joined by ``concat``, or by ``rearrange`` into ``(two half)``,
    a ``slice_`` + ``squeeze`` each and a concat along ``two``: the same loss, bit for bit."""
    def loss(**over):
        m = md.load_model(REALNVP, tiny=True, **over)
        return float(md.run_dense({"l": m.loss}, m.feeds(0))["l"])

    assert loss(form="rearrange") == loss()


def test_a_repeat_given_two_carries_carries_both():
    """An EGNN carries node features and coordinates through its layers: a tuple carry (once refused
    with the concat workaround) carries both, each with its own shape, as the Python loop does."""
    b, n, f, layer = md.Dim("batch", 2), md.Dim("node", 3), md.Dim("f", 4), md.Dim("layer", 2)
    with md.Graph():
        h, x = md.input("h", [b, n, f]), md.input("x", [b, n, md.Dim("xyz", 3)])
        w = md.param("w", [layer, f])
        hs, xs = md.repeat(lambda c, p: (c[0] * p["w"], c[1] + md.reduce_sum(c[0] * p["w"], "f")), (h, x), {"w": w},
                           "layer")
    gen = torch.Generator().manual_seed(0)
    feeds, wv = {"h": torch.randn(2, 3, 4, generator=gen), "x": torch.randn(2, 3, 3, generator=gen)}, torch.randn(2, 4)
    got = md.run_dense({"h": hs, "x": xs}, feeds, {"w": wv})
    want_h, want_x = feeds["h"], feeds["x"]
    for l in range(2):   # the Python loop, in torch
        want_h = want_h * wv[l]
        want_x = want_x + want_h.sum(-1, keepdim=True)
    # fp32, the same products and sums in the same order: rounding only
    torch.testing.assert_close(got["h"], want_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["x"], want_x, rtol=1e-6, atol=1e-6)


def test_a_partial_gradient_of_the_rows_is_reduced_before_its_scatter_into_a_bigger_table():
    """DeepFM under ``h1:model``: the fields' embeddings' gradient comes back from the split MLP as a
    partial sum. Its table (300 rows x 4) is bigger than the rows read (8 x 6 x 4), so the rows'
    gradient is allreduced before the scatter-add (768 B), not the table's after it (4800 B); the
    numbers are the dense program's."""
    case = (DEEPFM, {"field_rows": 50}, "model:2", "h1:model")
    model = md.load_model(DEEPFM, tiny=True, field_rows=50)
    plan = md.compile(heldout_outputs(model), "model:2", "h1:model")
    back = [(s.kind, s.bytes) for s in plan.steps if s.is_collective and s.phase == "backward"]
    assert back == [("allreduce", 8 * 6 * 4 * 4)], back
    assert_heldout_case_matches_dense(case)


@pytest.mark.slow
def test_the_cli_checks_the_egnn_with_nodes_split_on_two_processes(capsys):
    """``meshdsl check --nproc 2`` (gloo) on the EGNN, its nodes split unevenly (4, 3)."""
    code, out, err = run_cli(capsys, ["check", EGNN, "--tiny", "--mesh", "model:2", "--layout", "node:model",
                                      "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


# each search takes 3-25 s: with -m slow
@pytest.mark.slow
@pytest.mark.parametrize("path", [DEEPFM, DCNV2, EGNN, REALNVP, CAPSNET],
                         ids=["deepfm", "dcnv2", "egnn", "realnvp", "capsnet"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
