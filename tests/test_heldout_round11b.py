"""Held-out models of round 11b (written from the README and docs alone): science, vision, time
series and graphs.

``tests/heldout_schnet.py`` (a SchNet-style molecular energy model: pairwise distances over
``(atom, atom2)``, a radial basis expansion and a smooth cosine cutoff, continuous-filter
convolutions as einsums over the neighbour dim, the energy summed over each molecule's real
atoms); ``tests/heldout_nbeats.py`` (N-BEATS in a user's own dim names: fully connected blocks
that each subtract a backcast from the residual and add a forecast, collected as per-block
outputs or carried with the residual in one concatenated ``window``); ``tests/heldout_sam.py``
(a SAM-style mask decoder: a ViT encoder, point prompts and a mask token, a two-way transformer
whose carry is tokens and image concatenated, an upsampling head by rearrange, sigmoid BCE plus
dice); ``tests/heldout_graphormer.py`` (a graph transformer on padded graphs: attention biased
by edge features and masked by the adjacency, a mean over each graph's real nodes);
``tests/heldout_tcn.py`` (a TCN: dilated causal convs, dilations 1, 2, 4, 8, written as shifts
or as ``md.conv`` with ``dilation=``, residual levels). Each runs under data, tensor, long-dim
(atoms, nodes, node pairs, patches, pixels, time), FSDP, uneven 3-way, pipeline (1f1b, zbh1,
interleaved:2) and remat layouts against the dense program.
Findings and fixes: /work/notes/heldout-11b.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id,
                      heldout_outputs, run_cli)

HERE = Path(__file__).parent
SCHNET, NBEATS, SAM, GRAPHORMER, TCN = (
    str(HERE / f"heldout_{n}.py") for n in ("schnet", "nbeats", "sam", "graphormer", "tcn"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
CARRY = {"collect": "carry"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (SCHNET, {}, "model:3", "atom:model"),                                  # the neighbours' features gathered
    (SCHNET, {}, "data:2; model:2", "atom:data; atom2:model"),              # the pair matrix split both ways
    (NBEATS, CARRY, "model:3", "window:model"),                             # backcast | forecast concat over 3
    (NBEATS, CARRY, "stage:2", "blk:stage", {**PIPE, "schedule": "zbh1"}),
    (SAM, {}, "model:3", "patch:model"),                                    # 16 patches as 6, 5, 5
    (SAM, {}, "model:2", "height:model"),                                   # the pixels' rearrange split
    (GRAPHORMER, {}, "model:3", "node2:model"),                             # softmax over a split node2
    (GRAPHORMER, {}, "stage:2; model:2", "depth:stage; node:model", PIPE),
    (TCN, {}, "model:3", "time:model"),                                     # halos of 2..16 rows
    (TCN, {"form": "conv"}, "stage:2; model:3", "cycle:stage; time:model", PIPE),
]

# more of the same kinds, with -m slow (the file keeps under 5 s on a quiet machine)
SLOW_CASES = [
    (SCHNET, {}, "data:3", "mol:data"),
    (SCHNET, {}, "model:3", "filt:model"),
    (SCHNET, {}, "model:4", "atom:model"),
    (SCHNET, {}, "model:2", "rbf:model"),
    (SCHNET, {}, "data:2", "mol:data; params.hidden:data"),
    (SCHNET, {}, "stage:2; model:2", "interaction:stage; atom:model", PIPE),
    (SCHNET, {"interactions": 4}, "stage:2", "interaction:stage", INTERLEAVED),
    (SCHNET, {"remat": "full"}, "stage:2", "interaction:stage", PIPE),
    (NBEATS, {}, "model:3", "units:model"),
    (NBEATS, {}, "model:3", "lookback:model"),
    (NBEATS, {}, "data:2", "series:data; params.units:data"),
    (NBEATS, CARRY, "data:2; model:2", "series:data; units:model"),
    (NBEATS, {**CARRY, "blocks": 4}, "stage:2", "blk:stage", INTERLEAVED),
    (NBEATS, {**CARRY, "remat": "full"}, "stage:2; model:2", "blk:stage; units:model", PIPE),
    (SAM, {}, "data:2; model:2", "img:data; heads:model; d_ff:model"),
    (SAM, {}, "model:3", "seq:model"),
    (SAM, {}, "model:2", "height:model; patch:model"),
    (SAM, {}, "data:2", "img:data; params.d_model:data"),
    (SAM, {}, "stage:2", "enc:stage; dec:stage", PIPE),
    (SAM, {"enc_layers": 4}, "stage:2", "enc:stage", INTERLEAVED),
    (SAM, {"remat": "selective"}, "stage:2; model:2", "enc:stage; patch:model", PIPE),
    (GRAPHORMER, {}, "data:3", "graph:data"),
    (GRAPHORMER, {}, "data:2; model:2", "graph:data; head:model; hidden:model"),
    (GRAPHORMER, {}, "model:4", "node:model"),
    (GRAPHORMER, {}, "data:3", "graph:data; params.hidden:data"),
    (GRAPHORMER, {"depth": 4}, "stage:2", "depth:stage", INTERLEAVED),
    (GRAPHORMER, {"remat": "selective"}, "stage:2", "depth:stage", {**PIPE, "schedule": "zbh1"}),
    (TCN, {}, "model:5", "time:model"),
    (TCN, {}, "data:2; model:2", "clip:data; time:model"),
    (TCN, {"form": "conv"}, "model:3", "chan:model"),
    (TCN, {}, "data:2", "clip:data; params.chan:data"),
    (TCN, {"cycles": 4}, "stage:2", "cycle:stage", INTERLEAVED),
    (TCN, {"remat": "full"}, "model:3", "time:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_the_models_other_forms_compute_the_same_thing():
    """N-BEATS's forecasts collected as per-block outputs or carried in one window, and the TCN's
    dilated convs as shifts or as ``md.conv`` with ``dilation=``, give the same loss."""
    def loss(path, **over):
        m = md.load_model(path, tiny=True, **over)
        return float(md.run_dense({"l": m.loss}, m.feeds(0))["l"])

    # the same sums in another order: fp32 rounding, ~1e-7 relative
    assert loss(NBEATS, collect="carry") == pytest.approx(loss(NBEATS), rel=1e-5)
    assert loss(TCN, form="conv") == pytest.approx(loss(TCN), rel=1e-5)


def test_a_loss_of_the_sum_of_per_block_forecasts_pipelined_is_refused_with_the_fix(capsys):
    """N-BEATS's squared error of the blocks' summed forecasts is a function of every block at
    once: ``meshdsl check`` refuses to pipeline it (exit 2), naming the rule and the fix (carry
    the running total)."""
    code, out, err = run_cli(capsys, ["check", NBEATS, "--tiny", "--mesh", "stage:2", "--layout", "blk:stage",
                                      "--microbatches", "2", "--schedule", "1f1b"])
    assert code == 2 and "per-layer outputs ['forecast'] across layers" in err and "running total" in err, out + err


def test_the_cli_checks_the_tcn_pipelined_with_split_time(capsys):
    """``meshdsl check`` on the TCN, its cycles pipelined and time split (halos inside stages)."""
    code, out, err = run_cli(capsys, ["check", TCN, "--tiny", "--mesh", "stage:2; model:2", "--layout",
                                      "cycle:stage; time:model", "--microbatches", "2", "--schedule", "1f1b"])
    assert code == 0 and "OK:" in out, out + err


def _collectives(plan, under: str = "") -> list[tuple[str, str]]:
    """(label path, kind) of each collective of ``plan`` and its sub-plans (a repeat's block)."""
    out = []
    for st in plan.steps:
        if st.is_collective:
            out.append((under + st.label, st.kind))
        for sub in st.subplans:
            out += _collectives(sub, under + st.label + "/")
    return out


def test_a_tensor_renamed_twice_alike_is_renamed_once_and_its_gradient_reduced_once():
    """The graph transformer makes its keys and its values each from ``md.rename(y,
    node="node2")``: two rename nodes of one tensor. Under ``node:model`` each layer's backward
    then reduced the two gradient paths apart (an allreduce of the keys' and of the values'
    gradient, ``[graph, node2, head, hd]`` each, per layer), where one rename sums them first
    and reduce-scatters the sum once. An identical rename of one tensor is now the same node."""
    with md.Graph():
        x = md.input("x", [md.Dim("graph", 2), md.Dim("node", 4)])
        assert md.rename(x, node="node2") is md.rename(x, node="node2")
        assert md.rename(x, node="node3") is not md.rename(x, node="node2")
    case = (GRAPHORMER, {}, "model:3", "node:model")
    model = md.load_model(GRAPHORMER, tiny=True)
    backward = [(label, kind) for label, kind in _collectives(md.compile(heldout_outputs(model), *case[2:]))
                if label.startswith("grad_repeat/") and kind != "bucket_allreduce"]
    assert [kind for _, kind in backward] == ["reduce_scatter"], backward
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_a_conv_in_a_repeat_takes_its_weight_gradient_from_the_halo_its_input_gradient_trades(padding):
    """The TCN's convs under ``time:model``: outside a repeat a conv's weight gradient reuses the
    forward's halo of x, but in a repeat's backward block x is a new value, and its halo was
    traded again (TCN tiny, conv form, ``model:3``: 48 permutes where 32 do). In a block the
    weight gradient is now that of the input gradient's conv (input dy, output gradient x): it
    reads dy's halo, which the input gradient trades anyway. The numbers are the unrolled
    stack's (which keeps the plain weight gradient) and the dense program's (3 ranks: uneven
    for the valid conv's 10 positions)."""
    b, s, c, L = md.Dim("batch", 2), md.Dim("seq", 12), md.Dim("chan", 4), md.Dim("layer", 2)

    def build(stacked: bool):
        with md.Graph():
            x = md.input("x", [b, s, c])
            w = md.param("w", [L, md.Dim("tap", 3), c, md.Dim("c2", 4)], fan_out=["layer", "c2"])

            def block(h, p):
                y = md.rename(md.conv(h, p["w"], {"seq": "tap"}, padding=padding), c2="chan")
                return h + md.tanh(y if padding == "same" else md.pad(y, "seq", 1, 1))
            if stacked:
                h = md.repeat(block, x, {"w": w}, "layer")
            else:
                h = x
                for i in range(2):
                    h = block(h, {"w": md.squeeze(md.slice_(w, "layer", i, i + 1), "layer")})
            loss = md.reduce_mean(h * h * md.cast(md.arange(s), torch.float32))
            return {"loss": loss, **md.grad(loss, {"w": w})}
    outs = build(True)
    plan = md.compile(outs, "model:3", "seq:model")
    halos = [label for label, kind in _collectives(plan) if kind == "permute" and label.startswith("grad_repeat/")]
    assert "grad_repeat/repeat_grad/grad_conv/conv" in halos and not any("weight_grad" in h for h in halos), halos
    feeds = {"x": torch.randn(2, 12, 4, generator=torch.Generator().manual_seed(0))}
    want = md.run_dense(build(False), feeds)
    for got in (md.run_dense(outs, feeds), md.run_simulated(plan, feeds)):
        for k in want:
            # the same products summed in another order (a split seq): fp32 rounding, ~1e-7 relative
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


# each search takes 3-10 s on a quiet machine: with -m slow
@pytest.mark.slow
@pytest.mark.parametrize("path", [SCHNET, NBEATS, SAM, GRAPHORMER, TCN],
                         ids=["schnet", "nbeats", "sam", "graphormer", "tcn"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
