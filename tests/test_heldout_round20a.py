"""Held-out models of round 20a (written from the README and docs alone).

``tests/heldout_evoformer.py`` (Evoformer-lite: an MSA track and a pair representation joined
along one ``row`` dim as the repeat's carry; row attention with a pair bias, fused column
attention, the outer-product mean, the triangle multiplicative updates outgoing and incoming as
einsums over a renamed ``res_k``, transitions, a distogram CE); ``tests/heldout_fno.py`` (FNO-lite:
a 1-D spectral convolution by truncated real DFTs written as einsums with constant cos/sin tables,
there being no FFT op; pointwise convs, gelu, MSE on a fed heat-equation solution);
``tests/heldout_convlstm.py`` (ConvLSTM: the outermost repeat scans ``time``, 3x3 convs of the
frame and of the hidden state into four gates, h and c joined along ``hid`` as the carry,
next-frame MSE from per-step outputs); ``tests/heldout_tacotron.py`` (Tacotron-lite: conv
encoder, a decoder recurrence over mel frames with location-sensitive attention: a conv over the
previous and cumulative attention weights feeding the energies, a length mask, mel L1 + stop-token
BCE); ``tests/heldout_maskgit.py`` (MaskGIT-lite: a bidirectional transformer over VQ ids, a
learned [MASK] embedding mixed in by md.where on a fed cosine-schedule mask, CE averaged over the
masked positions). Each runs under data, Megatron, spatial / residue / grid / mode / feature
splits (2-way, uneven 3- to 5-way), FSDP, pipelines (1f1b, zbh1, interleaved:2 over its stack or
its recurrence), remat and the search's top layouts against the dense program.
Findings: /work/notes/heldout-20a.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (adamw_dense_curve, assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id, run_cli)

HERE = Path(__file__).parent
EVO, FNO, CONVLSTM, TACOTRON, MASKGIT = (
    str(HERE / f"heldout_{n}.py") for n in ("evoformer", "fno", "convlstm", "tacotron", "maskgit"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (CONVLSTM, {}, "model:4", "height:model"),                 # gate convs trading halos over an uneven split
    (FNO, {}, "model:5", "grid:model"),                        # the DFT contracts an uneven split grid
    (TACOTRON, {}, "stage:2", "frames:stage", PIPE),           # the decoder's frames pipelined, stop BCE per frame
]

SLOW_CASES = [
    (EVO, {}, "data:2", "batch:data"),
    (EVO, {}, "model:4", "res_j:model"),
    (EVO, {}, "model:2", "res_i:model"),
    (EVO, {}, "model:4", "res_i:model"),
    (EVO, {}, "model:2", "res_j:model"),
    (EVO, {}, "model:2", "c_pair:model"),
    (EVO, {}, "model:3", "c_pair:model"),
    (EVO, {}, "model:2", "heads:model"),
    (EVO, {}, "data:2; model:2", "res_i:data; res_j:model"),
    (EVO, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model; c_tri:model"),
    (EVO, {}, "model:3", "msa:model"),
    (EVO, {}, "model:3", "row:model"),
    (EVO, {}, "data:2", "batch:data; params.c_pair:data"),
    (EVO, {}, "stage:2", "layer:stage", PIPE),
    (EVO, {}, "stage:2", "layer:stage", ZBH1),
    (EVO, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (EVO, {"remat": "full"}, "model:2", "res_i:model"),
    (EVO, {"remat": "selective"}, "data:2", "batch:data"),
    (FNO, {}, "data:2", "batch:data"),
    (FNO, {}, "data:3", "batch:data"),
    (FNO, {}, "model:2", "grid:model"),
    (FNO, {}, "model:2", "modes:model"),
    (FNO, {}, "model:3", "modes:model"),
    (FNO, {}, "model:2", "channels:model"),
    (FNO, {}, "model:2", "c_out:model"),
    (FNO, {}, "model:4", "channels:model"),
    (FNO, {}, "data:2; model:2", "batch:data; grid:model"),
    (FNO, {}, "data:2; model:2", "grid:data; modes:model"),
    (FNO, {}, "data:2; model:2", "modes:data; channels:model"),
    (FNO, {}, "data:2", "batch:data; params.channels:data"),
    (FNO, {}, "stage:2", "layer:stage", PIPE),
    (FNO, {}, "stage:2", "layer:stage", ZBH1),
    (FNO, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (FNO, {"remat": "full"}, "model:2", "grid:model"),
    (FNO, {"remat": "selective"}, "model:2", "modes:model"),
    (CONVLSTM, {}, "data:2", "batch:data"),
    (CONVLSTM, {}, "model:2", "height:model"),
    (CONVLSTM, {}, "model:3", "width:model"),
    (CONVLSTM, {}, "model:3", "hid:model"),
    (CONVLSTM, {}, "model:2", "gates:model"),
    (CONVLSTM, {}, "model:2", "channels:model"),
    (CONVLSTM, {}, "data:2; model:2", "batch:data; height:model"),
    (CONVLSTM, {}, "data:2; model:2", "height:data; width:model"),
    (CONVLSTM, {}, "data:2", "batch:data; params.gates:data"),
    (CONVLSTM, {}, "stage:2", "time:stage", PIPE),
    (CONVLSTM, {}, "stage:2", "time:stage", ZBH1),
    (CONVLSTM, {"time": 8}, "stage:2", "time:stage", INTERLEAVED),
    (CONVLSTM, {"remat": "full"}, "model:2", "height:model"),
    (CONVLSTM, {"remat": "selective"}, "data:2", "batch:data"),
    (TACOTRON, {}, "data:2", "batch:data"),
    (TACOTRON, {}, "model:2", "enc_seq:model"),
    (TACOTRON, {}, "model:3", "enc_seq:model"),
    (TACOTRON, {}, "model:2", "channels:model"),
    (TACOTRON, {}, "model:4", "channels:model"),
    (TACOTRON, {}, "model:2", "att:model"),
    (TACOTRON, {}, "data:2; model:2", "batch:data; enc_seq:model"),
    (TACOTRON, {}, "data:2; model:3", "batch:data; channels:model"),
    (TACOTRON, {}, "data:2", "batch:data; params.channels:data"),
    (TACOTRON, {}, "model:3", "state:model"),
    (TACOTRON, {}, "stage:2", "frames:stage", ZBH1),
    (TACOTRON, {"frames": 8}, "stage:2", "frames:stage", INTERLEAVED),
    (TACOTRON, {"remat": "full"}, "model:2", "enc_seq:model"),
    (TACOTRON, {"remat": "selective"}, "data:2", "batch:data"),
    (MASKGIT, {}, "data:2", "batch:data"),
    (MASKGIT, {}, "data:3", "batch:data"),
    (MASKGIT, {}, "model:2", "heads:model; d_ff:model"),
    (MASKGIT, {}, "model:3", "vocab:model"),
    (MASKGIT, {}, "model:2", "seq:model"),
    (MASKGIT, {}, "model:4", "seq:model"),
    (MASKGIT, {}, "model:3", "d_ff:model"),
    (MASKGIT, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model; vocab:model"),
    (MASKGIT, {}, "data:2", "batch:data; params.d_model:data"),
    (MASKGIT, {}, "data:3", "batch:data; params.d_model:data"),
    (MASKGIT, {}, "stage:2", "layer:stage", PIPE),
    (MASKGIT, {}, "stage:2", "layer:stage", ZBH1),
    (MASKGIT, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (MASKGIT, {"remat": "full"}, "stage:2; model:2", "layer:stage; heads:model", PIPE),
    (MASKGIT, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_fno_dft_tables_are_torchs_truncated_rfft_and_irfft():
    """The model's spectral conv with identity weights on every kept mode is torch's
    irfft(rfft(h) with the modes past ``modes`` zeroed), on the dense program."""
    from importlib.util import module_from_spec, spec_from_file_location
    spec = spec_from_file_location("heldout_fno_tables", FNO)
    fno = module_from_spec(spec)
    spec.loader.exec_module(fno)
    n, k, c = 10, 4, 3
    t = fno.dft_tables(n, k)
    b, x_, m, ch, co = md.Dim("batch", 2), md.Dim("grid", n), md.Dim("modes", k), md.Dim("channels", c), md.Dim("c_out", c)
    with md.Graph():
        h = md.input("h", [b, x_, ch])
        eye = md.constant(torch.eye(c).expand(k, c, c).contiguous(), [m, ch, co])
        zero = md.constant(torch.zeros(k, c, c), [m, ch, co])
        tables = (md.constant(t["cos"], [x_, m]), md.constant(t["sin"], [x_, m]),
                  md.constant(t["icos"], [m, x_]), md.constant(t["isin"], [m, x_]))
        y = fno.spectral_conv(h, eye, zero, tables)
    feed = torch.randn(2, n, c, generator=torch.Generator().manual_seed(0))
    spec_ = torch.fft.rfft(feed, dim=1)
    spec_[:, k:] = 0
    want = torch.fft.irfft(spec_, n=n, dim=1)
    # fp32 sums of 10 terms against torch's FFT: rounding ~1e-6 of the values; a wrong table is O(1)
    torch.testing.assert_close(md.run_dense({"y": y}, {"h": feed})["y"], want, rtol=0, atol=1e-5)


def test_a_per_layer_outputs_loss_weighted_by_a_per_layer_input_pipelines():
    """``t * log_sigmoid(y)`` of a pipelined repeat's per-layer outputs ``y`` and a fed per-layer
    input ``t`` (Tacotron's stop-token BCE against per-frame targets) is a sum over layers of a
    per-layer function: it pipelines with the dense numbers. Before, the cotangent factor ``g * t``
    (made without ``y``) ran after the micro-batches and the compile refused it."""
    b, d, layer = md.Dim("batch", 4), md.Dim("d_model", 3), md.Dim("layer", 4)
    with md.Graph():
        x, t = md.input("x", [b, d]), md.input("t", [layer, b])
        w = md.param("w", [layer, d, md.Dim("d_out", 3)], fan_out=["d_out"])

        def block(h, p):
            y = md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), d_out="d_model")
            return h + md.tanh(y), {"s": md.reduce_sum(y, "d_model")}

        h, per_layer = md.repeat(block, x, {"w": w}, "layer")
        s = per_layer["s"]
        loss = md.reduce_mean(h ** 2) - md.reduce_mean(t * md.log_sigmoid(s) + (1 - t) * md.log_sigmoid(-s))
        outputs = {"loss": loss, **md.grad(loss, {"w": w})}
    gen = torch.Generator().manual_seed(0)
    feeds = {"x": torch.randn(4, 3, generator=gen), "t": torch.rand(4, 4, generator=gen)}
    for schedule in ("1f1b", "zbh1"):
        res = md.check(outputs, "stage:2", "layer:stage", feeds, microbatches=2, schedule=schedule)
        assert res.ok, str(res)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (EVO, "model:2", "res_i:model"),
    (FNO, "model:2", "grid:model"),
    (CONVLSTM, "model:2", "height:model"),
    (TACOTRON, "model:2", "enc_seq:model"),
    (MASKGIT, "model:2", "heads:model; d_ff:model"),
], ids=["evoformer", "fno", "convlstm", "tacotron", "maskgit"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [EVO, FNO, CONVLSTM, TACOTRON, MASKGIT],
                         ids=["evoformer", "fno", "convlstm", "tacotron", "maskgit"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (EVO, "data:2; model:2", "batch:data; res_j:model"),
    (FNO, "data:2; model:2", "params.channels:data; grid:model"),
    (CONVLSTM, "data:2; model:2", "batch:data; height:model"),
    (TACOTRON, "data:2; model:2", "batch:data; enc_seq:model"),
    (MASKGIT, "data:2; model:2", "params.d_model:data; heads:model"),
], ids=["evoformer", "fno", "convlstm", "tacotron", "maskgit"])
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)


def test_a_layer_norm_backward_over_a_split_dim_sends_its_two_row_sums_in_one_allreduce():
    """Evoformer under ``c_pair:model`` normalises over the split channels 17 times a step. The
    composite backward's two row sums (of ``g`` and ``g * x_hat``) went in two allreduces; packed
    after the sums (one value per row each), they go in one, with the dense program's numbers."""
    b, d = md.Dim("batch", 4), md.Dim("d_model", 8)
    with md.Graph():
        x = md.input("x", [b, d])
        w, s, bias = md.param("w", [d]), md.param("s", [d], init="ones"), md.param("b", [d], init="zeros")
        loss = md.reduce_sum(md.tanh(md.layer_norm(x * w, "d_model", s, bias)) * x)
        outputs = {"loss": loss, **md.grad(loss, {"w": w, "s": s, "b": bias})}
    plan = md.compile(outputs, "model:2", "d_model:model")
    backward = [st for st in plan.steps if st.is_collective and st.phase == "backward"]
    assert [(st.kind, st.bytes) for st in backward] == [("allreduce", 2 * 4 * 4)], backward   # [batch, 2] fp32
    res = md.check(outputs, "model:2", "d_model:model", {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))})
    assert res.ok, str(res)


@pytest.mark.slow
def test_adamw_steps_of_the_pipelined_tacotron_decoder_track_dense():
    """Three AdamW steps of Tacotron with its decoder's frames pipelined (1f1b, 2 micro-batches):
    the dense program's losses (the stop BCE's cotangent factor per stage and micro-batch)."""
    model = md.load_model(TACOTRON, tiny=True)
    opt = md.AdamW(lr=0.01, weight_decay=0.1)
    want, _ = adamw_dense_curve(model, opt, 1.0, 3)
    step = md.TrainStep(model.loss, model.params, "stage:2", "frames:stage", md.SimulatedComm(md.Mesh.parse("stage:2")),
                        optimizer=opt, clip_norm=1.0, microbatches=2, schedule="1f1b")
    got = [step(model.feeds(i), lr=0.01)[0] for i in range(3)]
    # fp32 sums in another order over a few steps: ~1e-6 relative; a wrong update is O(1e-2)
    assert got == pytest.approx(want, rel=1e-5), (got, want)
