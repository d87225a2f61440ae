"""Held-out models of round 14b (written from the README and docs alone): a differential-attention
decoder, a gated linear recurrence, a pooling MetaFormer, a landmark-attention classifier and a
Kolmogorov-Arnold network.

``tests/heldout_difftf.py`` (Differential Transformer: two softmax maps per head subtracted with a
learnable lambda from exps of small dot products, per-head RMSNorm, composite or fused);
``tests/heldout_griffin.py`` (Griffin: RG-LRU recurrence after a causal depthwise ``md.conv``, by
log-space ``md.cumsum``, a masked decay matrix or an inner ``md.repeat`` over ``seq``, interleaved with
sliding-window multi-query attention); ``tests/heldout_poolformer.py`` (PoolFormer: 3x3 average
pooling minus identity as a constant depthwise conv or nine shifts, one-group GroupNorm, strided
patch-embedding convs between two stages); ``tests/heldout_nystrom.py`` (Nystromformer: segment-mean
landmarks, three softmax kernels, a 6-step Newton pseudo-inverse in einsums); ``tests/heldout_kan.py``
(KAN: SiLU plus cubic B-splines per edge, by Cox-de Boor where-masks or truncated relu powers). Each
runs under data, Megatron, sequence/spatial/feature (2-way, uneven 3-way), FSDP, pipeline (1f1b,
zbh1, interleaved:2) and remat layouts against the dense program. Findings: /work/notes/heldout-14b.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id,
                      heldout_outputs, run_cli)

HERE = Path(__file__).parent
DIFFTF, GRIFFIN, POOLFORMER, NYSTROM, KAN = (
    str(HERE / f"heldout_{n}.py") for n in ("difftf", "griffin", "poolformer", "nystrom", "kan"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
FUSED, MATRIX, SCAN, SHIFT, LOCAL, RELU = ({"form": "fused"}, {"scan": "matrix"}, {"scan": "repeat"},
                                           {"pool": "shift"}, {"init": "local"}, {"basis": "relu"})

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (DIFFTF, {}, "model:3", "d_v:model"),                     # per-head norm over an uneven split
    (KAN, {}, "model:3", "basis:model"),                      # spline bases over an uneven split
    (POOLFORMER, {}, "model:2", "h1:model; h2:model"),        # pooling halos, strided convs
]

# more of the same kinds, with -m slow
SLOW_CASES = [
    (DIFFTF, {}, "data:2", "batch:data"),
    (DIFFTF, {}, "model:2", "heads:model; d_ff:model"),
    (DIFFTF, FUSED, "model:2", "heads:model; d_ff:model"),
    (DIFFTF, {}, "model:2", "pair:model"),
    (DIFFTF, {}, "model:3", "seq:model"),
    (DIFFTF, FUSED, "model:2", "seq:model"),
    (DIFFTF, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (DIFFTF, {}, "data:2", "batch:data; params.d_model:data"),
    (DIFFTF, {}, "stage:2", "layer:stage", PIPE),
    (DIFFTF, FUSED, "stage:2", "layer:stage", ZBH1),
    (DIFFTF, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (DIFFTF, {"remat": "full"}, "stage:2; model:2", "layer:stage; heads:model", PIPE),
    (DIFFTF, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (GRIFFIN, {}, "data:2", "batch:data"),
    (GRIFFIN, SCAN, "data:2", "batch:data"),
    (GRIFFIN, {}, "model:2", "d_rnn:model; heads:model; d_ff:model"),
    (GRIFFIN, {}, "model:3", "d_rnn:model"),
    (GRIFFIN, {}, "model:2", "seq:model"),
    (GRIFFIN, {}, "model:3", "seq:model"),
    (GRIFFIN, MATRIX, "model:4", "seq:model"),
    (GRIFFIN, {}, "data:2; model:2", "batch:data; seq:model"),
    (GRIFFIN, {}, "data:2", "batch:data; params.d_model:data"),
    (GRIFFIN, {}, "stage:2", "blk:stage", PIPE),
    (GRIFFIN, SCAN, "stage:2", "blk:stage", ZBH1),
    (GRIFFIN, {"blocks": 4}, "stage:2", "blk:stage", INTERLEAVED),
    (GRIFFIN, {"remat": "full"}, "stage:2; model:2", "blk:stage; seq:model", PIPE),
    (GRIFFIN, {"remat": "selective"}, "model:2", "d_rnn:model; d_ff:model"),
    (POOLFORMER, {}, "data:2", "batch:data"),
    (POOLFORMER, {}, "model:3", "f1:model; f2:model"),
    (POOLFORMER, {}, "model:2", "height:model"),
    (POOLFORMER, SHIFT, "model:2", "h1:model; h2:model"),
    (POOLFORMER, {}, "model:3", "h1:model"),
    (POOLFORMER, {}, "data:2; model:2", "h1:data; w1:model"),
    (POOLFORMER, {}, "data:2", "batch:data; params.d2:data"),
    (POOLFORMER, {}, "stage:2", "layer1:stage", PIPE),
    (POOLFORMER, SHIFT, "stage:2", "layer2:stage", ZBH1),
    (POOLFORMER, {"layers2": 4}, "stage:2", "layer2:stage", INTERLEAVED),
    (POOLFORMER, {"remat": "full"}, "stage:2; model:2", "layer1:stage; h1:model", PIPE),
    (NYSTROM, {}, "data:2", "batch:data"),
    (NYSTROM, {}, "model:2", "heads:model; d_ff:model"),
    (NYSTROM, {}, "model:2", "seq:model"),
    (NYSTROM, {}, "model:3", "seq:model"),
    (NYSTROM, {}, "model:4", "seq:model"),
    (NYSTROM, {}, "model:2", "landmarks:model"),
    (NYSTROM, {}, "model:2", "lk:model"),
    (NYSTROM, {}, "data:2", "batch:data; params.d_model:data"),
    (NYSTROM, LOCAL, "stage:2", "layer:stage", PIPE),
    (NYSTROM, LOCAL, "stage:2", "layer:stage", ZBH1),
    (NYSTROM, {"layers": 4, "init": "local"}, "stage:2", "layer:stage", INTERLEAVED),
    (NYSTROM, {"remat": "full", "init": "local"}, "stage:2; model:2", "layer:stage; heads:model", PIPE),
    (KAN, {}, "data:2", "batch:data"),
    (KAN, RELU, "model:2", "hid:model"),
    (KAN, {}, "model:3", "hid:model"),
    (KAN, {}, "model:2", "d_in:model"),
    (KAN, RELU, "model:2", "basis:model"),
    (KAN, {}, "data:2; model:2", "batch:data; params.hid:data; basis:model"),
    (KAN, {}, "data:3", "batch:data"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("act", ["softplus", "elu"])
def test_a_per_layer_weights_softplus_pipelines(act):
    """Griffin's gate ``softplus(-Lambda)`` of a per-layer weight: its gradient,
    ``where(c, g, g * sigmoid(x))``, is a sum over the micro-batches in both values, jointly linear
    there; the pipelined block passes it on (it refused the layout, 'sums over the micro-batches')."""
    b, d, layer = md.Dim("batch", 4), md.Dim("d", 3), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, d])
        w = md.param("w", [layer, d], scale=1.0)
        act_fn = getattr(md, act)
        h = md.repeat(lambda h, p: h * act_fn(p["w"]), x, {"w": w}, "layer")
        loss = md.reduce_mean(h ** 2)
        outputs = {"loss": loss, **md.grad(loss, {"w": w})}
    feeds = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    result = md.check(outputs, "stage:2", "layer:stage", feeds, microbatches=2, schedule="1f1b")
    assert result.ok, str(result)


def test_nystrom_landmark_twins_stay_whole_under_a_sequence_split():
    """``lq`` and ``lk``, both renamed from the landmarks implied split by ``seq:model``, meet in
    their kernel: an implied split passed to them resharded every pseudo-inverse product (17
    allgathers, 13 reduce-scatters, 4 all-to-alls with one layer and one Newton step); both whole,
    the landmarks are gathered once each (both in one bucket, made back to back: lowering/coalesce.py)
    and the gradients reduce-scattered."""
    model = md.load_model(NYSTROM, tiny=True, layers=1, newton=1)
    plan = md.compile(heldout_outputs(model), "model:2", "seq:model")
    totals = plan.totals()
    [gather] = [s for s, _ in plan.collectives() if s.kind == "bucket_allgather"]
    assert len(gather.ins) == 2 and "allgather" not in totals, totals
    assert totals["reduce_scatter"]["count"] == 2, totals
    assert "alltoall" not in totals, totals


def test_a_max_over_the_batch_in_a_pipelined_block_is_refused_as_a_max():
    """The reference Nystromformer scales its first pseudo-inverse guess by a max over the whole
    batch: no micro-batched form, refused; the message said 'sums' with an empty bullet."""
    model = md.load_model(NYSTROM, tiny=True, layers=2, newton=1)
    with pytest.raises(md.LayoutError, match=r"(?s)takes the max over the micro-batches.*\(max\) over .*"
                                             r"the result of 'reduce_max'.*max or min over the whole batch"):
        md.compile(heldout_outputs(model), "stage:2", "layer:stage", microbatches=2, schedule="1f1b")


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (DIFFTF, "model:2", "heads:model; d_ff:model"),
    (GRIFFIN, "model:2", "seq:model"),
    (POOLFORMER, "model:2", "h1:model; h2:model"),
    (NYSTROM, "model:2", "seq:model"),
    (KAN, "model:2", "hid:model"),
], ids=["difftf", "griffin", "poolformer", "nystrom", "kan"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [DIFFTF, GRIFFIN, POOLFORMER, NYSTROM, KAN],
                         ids=["difftf", "griffin", "poolformer", "nystrom", "kan"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
