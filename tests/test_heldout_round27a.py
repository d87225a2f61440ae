"""Held-out models of round 27a (written from the README and docs alone): convnets with grouped,
parallel and multi-resolution channels, an iterative slot attention, and a speech model with CTC.

``tests/heldout_shufflenet.py`` (grouped 1x1 convs as einsums over a ``groups`` dim, ShuffleNet's
channel shuffle as ``md.transpose`` + ``md.reshape`` or two rearranges, a depthwise 3x3 conv, a
layer stack); ``tests/heldout_hrnet.py`` (two resolution branches as a tuple carry, exchanging
features each stage by ``md.upsample`` and a stride-2 conv or ``md.max_pool``);
``tests/heldout_inception.py`` (four parallel branches concatenated on channels, then a 3x3 conv
whose c_in is the concat); ``tests/heldout_slotattn.py`` (Slot Attention: a ``md.repeat`` over
iterations with no stacked params, a softmax over the slots, a GRU update, a spatial-broadcast
decoder); ``tests/heldout_deepspeech.py`` (DeepSpeech2-lite: strided 2-D convs over (time, freq),
a stack of bidirectional GRUs as inner repeats over ``time`` with ``md.flip``, and CTC written as
its forward algorithm, a repeat over ``time`` in log space). Each runs under data, tensor
(channels, groups, slots, hidden, the CTC lattice), spatial (height, time) splits, uneven 3-way
splits, FSDP, remat and pipelines against the dense program, against a float64 torch reference
(``F.ctc_loss`` for the CTC), and for AdamW steps. Findings: /work/notes/heldout-27a.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_dense_is_its_torch_reference, assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      heldout_case_id, run_cli)

HERE = Path(__file__).parent
IDS = ["shufflenet", "hrnet", "inception", "slotattn", "deepspeech"]
SHUF, HRNET, INCEP, SLOT, DS2 = ALL = [str(HERE / f"heldout_{n}.py") for n in IDS]
GPIPE = {"microbatches": 2}
ONEF1B = {"microbatches": 2, "schedule": "1f1b"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (SHUF, {}, "model:2", "ch:model"),                              # the shuffle moves ch's split: alltoalls
    (INCEP, {}, "model:3", "cat:model"),                            # the concat's channels cut 3, 3, 2
    (SLOT, {}, "model:3", "slots:model"),                           # the softmax over 4 slots cut 2, 1, 1
]

SLOW_CASES = [
    (SHUF, {}, "data:2", "batch:data"),
    (SHUF, {}, "model:2", "groups:model"),
    (SHUF, {"form": "rearrange"}, "model:2", "ch:model"),
    (SHUF, {"form": "rearrange"}, "model:2", "groups:model"),
    (SHUF, {"ch": 5}, "model:3", "ch:model"),
    (SHUF, {"groups": 3}, "model:2", "groups:model"),
    (SHUF, {"height": 5}, "model:3", "height:model"),
    (SHUF, {}, "data:2; model:2", "batch:data; ch:model"),
    (SHUF, {}, "data:2", "batch:data; params.ch:data"),
    (SHUF, {"remat": "full"}, "model:2", "ch:model"),
    (SHUF, {"remat": "selective"}, "model:2", "groups:model"),
    (SHUF, {}, "stage:2", "layer:stage", GPIPE),
    (SHUF, {}, "model:2; stage:2", "ch:model; layer:stage", ONEF1B),
    (HRNET, {}, "data:2", "batch:data"),
    (HRNET, {}, "model:2", "height:model"),
    (HRNET, {"up": "bilinear"}, "model:2", "height:model"),
    (HRNET, {"down": "pool"}, "model:2", "height:model"),
    (HRNET, {"height": 12}, "model:3", "height:model"),
    (HRNET, {"height": 10, "width": 6}, "model:3", "height:model"),           # hi 4, 3, 3 and lo 2, 2, 1 rows
    (HRNET, {"height": 10, "width": 6, "up": "bilinear", "down": "pool"}, "model:3", "height:model"),
    (HRNET, {}, "model:2; one:1", "ch:model; cl:model; up.ch:one; to_lo.ch:one"),
    (HRNET, {"ch": 5, "cl": 7}, "model:3; one:1", "ch:model; cl:model; up.ch:one; to_lo.ch:one"),
    (HRNET, {}, "model:2", "co:model; col:model"),
    (HRNET, {}, "data:2; model:2", "batch:data; height:model"),
    (HRNET, {}, "data:2", "batch:data; params.ch:data"),
    (HRNET, {"remat": "full"}, "model:2", "height:model"),
    (HRNET, {"remat": "selective", "up": "bilinear"}, "model:2", "width:model"),
    (HRNET, {}, "stage:2", "layer:stage", GPIPE),                   # (hi, lo) sent on at the boundary
    (HRNET, {}, "model:2; stage:2", "height:model; layer:stage", ONEF1B),
    (INCEP, {}, "data:2", "batch:data"),
    (INCEP, {}, "model:2", "cat:model"),
    (INCEP, {}, "model:4", "cat:model"),
    (INCEP, {}, "model:2", "ch:model"),
    (INCEP, {"ch": 5}, "model:3", "ch:model"),
    (INCEP, {}, "model:2", "c3:model"),
    (INCEP, {}, "model:2", "co:model"),
    (INCEP, {}, "model:2", "height:model"),
    (INCEP, {"height": 5}, "model:3", "height:model"),
    (INCEP, {}, "data:2; model:2", "batch:data; cat:model"),
    (INCEP, {}, "data:2", "batch:data; params.ch:data"),
    (INCEP, {"remat": "full"}, "model:2", "cat:model"),
    (INCEP, {"remat": "selective"}, "model:2", "height:model"),
    (INCEP, {}, "stage:2", "layer:stage", GPIPE),
    (INCEP, {}, "model:2; stage:2", "cat:model; layer:stage", ONEF1B),
    (SLOT, {}, "data:2", "batch:data"),
    (SLOT, {}, "model:2", "slots:model"),
    (SLOT, {}, "model:2", "d:model"),
    (SLOT, {}, "model:3", "d:model"),
    (SLOT, {}, "model:2", "n_in:model"),
    (SLOT, {"n_in": 7}, "model:3", "n_in:model"),
    (SLOT, {}, "model:2", "d_ff:model"),
    (SLOT, {}, "data:2; model:2", "batch:data; slots:model"),
    (SLOT, {}, "data:2; model:2", "batch:data; d:model"),
    (SLOT, {}, "data:2", "batch:data; params.d:data"),
    (SLOT, {"remat": "full"}, "model:2", "slots:model"),
    (SLOT, {"remat": "selective"}, "data:2; model:2", "batch:data; d:model"),
    (SLOT, {}, "stage:2", "iter:stage", GPIPE),                     # shared weights, iterations on 2 stages
    (SLOT, {"iters": 3}, "stage:3", "iter:stage", ONEF1B),
    (SLOT, {}, "model:2; stage:2", "slots:model; iter:stage", ONEF1B),
    (DS2, {}, "data:2", "batch:data"),
    (DS2, {"batch": 3}, "data:3", "batch:data"),
    (DS2, {}, "model:2", "hidden:model"),
    (DS2, {"hidden": 5}, "model:3", "hidden:model"),
    (DS2, {}, "model:2", "ext:model"),                              # the CTC lattice 5 cut 3, 2
    (DS2, {}, "model:3", "ext:model"),
    (DS2, {"shift": True}, "model:2", "ext:model"),
    (DS2, {"shift": True, "label": 4}, "model:3", "ext:model"),
    (DS2, {}, "model:2", "freq:model"),
    (DS2, {}, "model:2", "ch2:model"),
    (DS2, {}, "model:2", "vocab:model"),
    (DS2, {"nest_ctc": True}, "model:2", "time:model"),             # the guide's nested form: sequence parallel
    (DS2, {"nest_ctc": True, "time": 12}, "model:3", "time:model"),
    (DS2, {}, "data:2; model:2", "batch:data; hidden:model"),
    (DS2, {}, "data:2", "batch:data; params.hidden:data"),
    (DS2, {"remat": "full"}, "model:2", "hidden:model"),
    (DS2, {"remat": "selective"}, "data:2", "batch:data"),
    (DS2, {}, "stage:2", "layer:stage", GPIPE),                     # the BiGRU layers on 2 stages
    (DS2, {"batch": 4}, "data:2; stage:2", "batch:data; layer:stage", ONEF1B),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


REFERENCES = [(SHUF, {}), (SHUF, {"form": "rearrange"}), (HRNET, {}), (HRNET, {"up": "bilinear", "down": "pool"}),
              (INCEP, {}), (SLOT, {}), (DS2, {}), (DS2, {"shift": True, "nest_ctc": True})]


@pytest.mark.parametrize("path,over", [pytest.param(p, o, marks=[] if (p, o) == (INCEP, {}) else pytest.mark.slow)
                                       for p, o in REFERENCES],
                         ids=[f"{Path(p).stem[8:]}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}"
                              for p, o in REFERENCES])
def test_the_model_is_its_torch_reference(path, over):
    """Each model written in plain torch (NCHW F.conv2d with groups= for the grouped and depthwise
    convs and view/transpose/view for the shuffle; F.interpolate, F.max_pool2d, torch.cat; GRU cell
    equations in Python loops; F.ctc_loss) gives the DSL model's loss, and torch autograd (float64)
    its gradients."""
    assert_dense_is_its_torch_reference(path, **over)


def _plan(path, mesh, layout, **over):
    model = md.load_model(path, tiny=True, **over)
    return model, md.compile({"loss": model.loss, **md.grad(model.loss, model.params)}, mesh, layout)


@pytest.mark.parametrize("form", ["reshape", pytest.param("rearrange", marks=pytest.mark.slow)])
def test_the_channel_shuffle_over_split_groups_moves_by_one_alltoall_each_way(form):
    """Under groups:model the shuffle (groups the inner part of the merged (ch groups)) moves the
    split to the outer part and back by one alltoall per unit each way, and nothing else moves but
    the cross-entropy's partial logits: no gather of the channels."""
    model, plan = _plan(SHUF, "model:2", "groups:model", form=form)
    kinds = plan.totals()
    assert set(kinds) == {"alltoall", "allreduce"}, kinds
    assert kinds["alltoall"]["count"] == 2 * model.config.layers, kinds
    assert kinds["allreduce"]["count"] == 1, kinds


@pytest.mark.slow
def test_hrnet_split_over_height_trades_halos_and_gathers_nothing():
    """Under height:model both branches stay split: the convs (the stride-2 one too), the bilinear
    upsample and the pools trade halo rows (permutes); the only other collectives are the
    pooled head's and the weight gradients' allreduces."""
    _, plan = _plan(HRNET, "model:2", "height:model", up="bilinear")
    kinds = plan.totals()
    assert not [k for k in kinds if "gather" in k or "scatter" in k or "alltoall" in k], kinds
    assert kinds["permute"]["count"] > 0, kinds


@pytest.mark.slow
def test_slot_attention_over_split_slots_moves_no_slot():
    """Under slots:model the softmax over the slots and the decoder's mix over them reduce their
    max and sum (allreduces): no slot is gathered or moved."""
    _, plan = _plan(SLOT, "model:2", "slots:model")
    assert {k.removeprefix("bucket_") for k in plan.totals()} == {"allreduce"}, plan.totals()


@pytest.mark.slow
def test_the_ctc_lattice_split_trades_one_halo_per_frame_when_both_shifts_read_one_tensor():
    """Under ext:model the forward algorithm reads each state's left neighbour and the one two back;
    written as two md.shifts of one tensor they share one halo: one permute per frame (of the
    two rows the wider shift reads), forward."""
    model, plan = _plan(DS2, "model:2", "ext:model", shift=True)
    frames = model.config.time // 2
    loop = [(s, k) for s, k in plan.walk() if s.kind == "permute" and s.phase == "forward" and k == frames]
    assert len(loop) == 1 and "2 'ext' rows" in loop[0][0].note, [(s.label, s.note, k) for s, k in loop]


@pytest.mark.slow
def test_a_top_level_ctc_under_a_time_split_is_refused_with_the_nesting_fix():
    """time:model pipelines DeepSpeech2's top-level CTC recursion over 'model', while the conv front
    end's halos and the BiGRU stack's gathers of 'time', run per micro-batch outside it, would
    exchange over that same axis within each stage (it compiled, then died in the simulated run on
    an internal assertion): refused at compile time with the guide's fix; nested (``nest_ctc``) it
    runs (SLOW_CASES)."""
    model = md.load_model(DS2, tiny=True)
    with pytest.raises(md.LayoutError) as err:
        md.compile({"loss": model.loss, **md.grad(model.loss, model.params)}, "model:2", "time:model")
    assert "runs in the stages' actions" in str(err.value), str(err.value)
    assert "md.Dim('once', 1)" in str(err.value), str(err.value)


@pytest.mark.parametrize("form", ["flip", "shift"])
def test_an_exchange_before_a_pipelined_recurrence_is_refused(form):
    """A top-level repeat over the split 'time' reads frames that a flip (a permute to the mirrored
    rank: the run crashed, 'NoneType' object has no attribute 'select') or a shift (a halo: the run
    gave a loss off by 0.78) made over that axis, within each stage's actions: refused, naming it."""
    T, B, E = md.Dim("time", 4), md.Dim("batch", 2), md.Dim("ext", 3)
    with md.Graph():
        w = md.param("w", [E])
        em = md.transpose(md.log_softmax(md.input("x", [B, T, E]) * w, "ext"), ["time", "batch", "ext"])
        em = md.flip(em, "time") if form == "flip" else em + md.shift(em, "time", 1)
        alpha = md.repeat(lambda a, s: md.logaddexp(a, md.shift(a, "ext", 1)) + s["em"], md.constant(0.0, [B, E]),
                          {"em": em}, "time")
        loss = md.reduce_mean(alpha)
        with pytest.raises(md.LayoutError, match=f"'{form}' runs in the stages' actions"):
            md.compile({"loss": loss, **md.grad(loss, {"w": w})}, "model:2", "time:model")


def test_a_flip_of_per_layer_outputs_after_a_pipelined_stack_still_runs():
    """The refusal above is of exchanges in the stages' actions only: per-layer outputs flipped over
    the layer dim after the stack (run once, after the micro-batches) keep the dense numbers."""
    B, D, L = md.Dim("batch", 4), md.Dim("d_model", 3), md.Dim("layer", 4)
    with md.Graph():
        w = md.param("w", [L, D, md.Dim("d_out", 3)], fan_out=["d_out"])

        def block(h, p):
            y = md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), {"d_out": "d_model"})
            return h + md.tanh(y), {"aux": md.reduce_mean(y * y, "d_model")}

        h, per = md.repeat(block, md.input("x", [B, D]), {"w": w}, "layer")
        aux = md.flip(per["aux"], "layer") * md.cast(md.arange(L), torch.float32)
        loss = md.reduce_mean(h * h) + 0.1 * md.reduce_mean(aux)
        outputs = {"loss": loss, **md.grad(loss, {"w": w})}
    feeds = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    want = md.run_dense(outputs, feeds)
    got = md.run_simulated(md.compile(outputs, "stage:2", "layer:stage", microbatches=2), feeds)
    for k in want:
        # a sum over 2 micro-batches in another order: ~1e-7 of the values; a lost part is O(1)
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5 * float(want[k].abs().max()))


@pytest.mark.slow
def test_the_cli_checks_shufflenet_on_two_real_processes(capsys):
    """``meshdsl check ... --tiny --nproc 2``: the shuffle's alltoalls on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", SHUF, "--tiny", "--mesh", "model:2", "--layout", "groups:model",
                                      "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.parametrize("path,mesh,layout", [
    pytest.param(SHUF, "data:2; model:2", "batch:data; groups:model", marks=pytest.mark.slow),
    pytest.param(HRNET, "model:2", "height:model", marks=pytest.mark.slow),
    pytest.param(INCEP, "model:2", "cat:model", marks=pytest.mark.slow),
    pytest.param(SLOT, "data:2; model:2", "batch:data; slots:model", marks=pytest.mark.slow),
    pytest.param(DS2, "data:2; model:2", "batch:data; hidden:model", marks=pytest.mark.slow),
], ids=IDS)
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)
