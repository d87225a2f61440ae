"""Held-out models of round 28a (written from the README and docs alone): the Fourier ops and
detection heads.

``tests/heldout_gfnet.py`` (GFNet: a global filter, md.rfft along height then md.fft along width,
times a learned complex filter, back by md.ifft / md.irfft; MLP; a layer stack);
``tests/heldout_s4d.py`` (S4D-lite: a diagonal state-space kernel from learned log dt, A and C by
exp/cos/sin, applied as a long convolution by md.rfft / md.irfft zero-padded to 2L);
``tests/heldout_fno2d.py`` (FNO-2D: kept low modes on both grid dims, irfft's zero padding for
the dropped ones, complex einsums; lifting and projection); ``tests/heldout_retinanet.py``
(RetinaNet-lite: a conv backbone, an FPN of 1x1 laterals, nearest upsampling and 3x3 convs, class
and box heads shared over the levels, a sigmoid focal loss and smooth L1 on positive anchors);
``tests/heldout_bifpn.py`` (BiFPN-lite: fast normalized weighted fusion of upsampled and pooled
levels over two passes, the three levels a tuple carry of md.repeat). Each runs under data,
tensor, transformed-dim and spatial splits (2-way, uneven 3- and 4-way), FSDP, remat and
pipelines (where there is a layer stack) against the dense program, against a float64 torch
reference (torch.fft for the first three), and for AdamW steps. Findings: /work/notes/heldout-28a.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.train.model import load_module
from conftest import assert_adamw_steps_track_dense, assert_heldout_case_matches_dense, heldout_case_id, run_cli

HERE = Path(__file__).parent
IDS = ["gfnet", "s4d", "fno2d", "retinanet", "bifpn"]
GF, S4D, FNO, RET, BIFPN = ALL = [str(HERE / f"heldout_{n}.py") for n in IDS]
ONE_F_ONE_B = {"microbatches": 2, "schedule": "1f1b"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (GF, {}, "data:3", "height:data"),                     # the rfft's dim cut 2/1/1: gathered for each transform
    (FNO, {}, "data:3", "kx:data"),                        # the kept modes (4) cut unevenly, low and high apart
    (S4D, {}, "data:3", "seq:data"),                       # the zero padding to 2L of an unevenly split seq
]

SLOW_CASES = [
    (GF, {}, "data:2", "batch:data"),
    (GF, {}, "model:2", "chan:model"),
    (GF, {}, "model:4", "chan:model"),                     # 6 channels over 4
    (GF, {}, "model:3", "hidden:model"),                   # 8 over 3
    (GF, {}, "data:4", "width:data"),                      # fft's dim, 6 over 4
    (GF, {}, "data:2", "height:data; fh:data"),
    (GF, {}, "data:2", "batch:data; params.chan:data"),
    (GF, {"remat": "full"}, "data:2; model:2", "batch:data; chan:model"),
    (GF, {"remat": "selective"}, "model:3", "chan:model"),
    (GF, {}, "stage:2", "layer:stage", ONE_F_ONE_B),
    (GF, {}, "data:2; stage:2", "batch:data; layer:stage", {"microbatches": 2}),
    (S4D, {}, "data:2", "batch:data"),
    (S4D, {}, "data:3", "batch:data"),
    (S4D, {}, "model:2", "chan:model"),
    (S4D, {}, "model:4", "chan:model"),                    # 6 over 4
    (S4D, {}, "model:3", "state:model"),                   # the kernel's sum over modes split
    (S4D, {}, "data:2", "seq:data; freq:data"),
    (S4D, {}, "data:2", "batch:data; params.chan:data"),
    (S4D, {"remat": "full"}, "data:2; model:2", "batch:data; chan:model"),
    (S4D, {"remat": "selective"}, "model:4", "chan:model"),
    (S4D, {}, "stage:2", "layer:stage", ONE_F_ONE_B),
    (FNO, {}, "data:2", "batch:data"),
    (FNO, {}, "data:3", "batch:data"),
    (FNO, {}, "model:2", "width:model"),
    (FNO, {}, "model:3", "width:model"),                   # 4 over 3
    (FNO, {}, "model:3", "width_out:model"),
    (FNO, {}, "data:4", "gx:data"),                        # fft's dim, 6 over 4
    (FNO, {}, "data:3", "gy:data"),                        # rfft's dim, 8 over 3
    (FNO, {}, "model:2", "ky:model"),                      # 3 kept rfft modes over 2
    (FNO, {}, "data:2", "batch:data; params.width:data"),
    (FNO, {"remat": "full"}, "data:2; model:2", "batch:data; width:model"),
    (FNO, {}, "stage:2", "layer:stage", ONE_F_ONE_B),
    (RET, {}, "data:2", "batch:data"),
    (RET, {}, "data:3", "batch:data"),
    (RET, {}, "model:3", "fpn:model"),                     # 4 over 3
    (RET, {}, "model:2", "fpn_out:model"),
    (RET, {}, "data:2", "height:data"),                    # halos on every level, 16 rows down to 2
    (RET, {}, "data:2; model:2", "height:data; width:model"),
    (RET, {}, "model:2", "anchors:model"),
    (RET, {}, "data:3", "classes:data"),
    (RET, {}, "data:2", "batch:data; params.fpn:data"),
    (BIFPN, {}, "data:2", "batch:data"),
    (BIFPN, {}, "data:3", "batch:data"),
    (BIFPN, {}, "model:3", "chan:model"),                  # 4 over 3
    (BIFPN, {}, "model:4", "chan_out:model"),
    (BIFPN, {}, "data:2", "height:data"),
    (BIFPN, {}, "model:3", "f3:model"),                    # a fusion's 3 weights over 3
    (BIFPN, {}, "data:2", "batch:data; params.chan:data"),
    (BIFPN, {"remat": "full"}, "data:2; model:2", "batch:data; chan:model"),
    (BIFPN, {"remat": "selective"}, "data:2", "batch:data"),
    (BIFPN, {}, "stage:2", "layer:stage", ONE_F_ONE_B),    # the tuple carry of three levels sent on
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("path", [pytest.param(p, marks=[] if p == FNO else pytest.mark.slow) for p in ALL], ids=IDS)
def test_the_model_is_its_torch_reference(path):
    """Each model written in plain torch (torch.fft.rfft/fft/ifft/irfft and rfft2/irfft2 on complex
    tensors, F.conv2d, pooling, F.interpolate, torch's BCE and smooth L1) gives the DSL model's loss,
    and torch autograd (float64) its gradients. Every param is drawn at random (BiFPN's fusion
    weights as |w|: a node whose relu'd weights are all zero passes no gradient)."""
    mod = load_module(path)
    model = md.load_model(path, tiny=True)
    gen = torch.Generator().manual_seed(1)
    params = {k: torch.randn(v.shape.sizes, generator=gen) * 0.5 for k, v in model.graph.params().items()}
    params = {k: v.abs() if k.startswith("fw_") else v for k, v in params.items()}
    feeds = model.feeds(0)
    got = md.run_dense({"loss": model.loss, **md.grad(model.loss, model.params)}, feeds, params=params)
    ref = {k: v.double().requires_grad_(k in model.params) for k, v in params.items()}
    ins = [feeds[k].double() if feeds[k].is_floating_point() else feeds[k] for k in mod.REF_INPUTS]
    want = mod.reference_loss(model.config, ref, *ins)
    want.backward()
    # fp32 against fp64: ~1e-7 relative; a wrong frequency, mode, tap or level is O(1e-1)
    assert float(got["loss"]) == pytest.approx(float(want.detach()), rel=1e-5)
    top = max(float(ref[k].grad.abs().max()) for k in model.params)
    assert top > 0
    for k in model.params:
        # fp32 rounding at the largest gradient's scale, as the layout checks allow
        torch.testing.assert_close(got[k].double(), ref[k].grad, rtol=0, atol=1e-5 * top, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("path,mesh,layout,steps", [
    pytest.param(GF, "data:2; model:2", "batch:data; chan:model", 3, marks=pytest.mark.slow),
    # S4D's first and third losses happen to lie within 1e-4 of each other: a fourth step moves it
    pytest.param(S4D, "data:2; model:2", "batch:data; chan:model", 4, marks=pytest.mark.slow),
    pytest.param(FNO, "data:2; model:2", "batch:data; width:model", 3, marks=pytest.mark.slow),
    pytest.param(RET, "data:2; model:2", "batch:data; fpn:model", 3, marks=pytest.mark.slow),
    pytest.param(BIFPN, "data:2; model:2", "batch:data; chan:model", 3, marks=pytest.mark.slow),
], ids=IDS)
def test_adamw_steps_track_dense(path, mesh, layout, steps):
    """A few AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout, steps=steps)


@pytest.mark.parametrize("op", ["fft", "ifft", "irfft", "fft2", "ifft2"])
def test_a_real_tensor_given_to_a_complex_transform_is_told_how_to_make_it_complex(op):
    """fft/ifft/irfft of a tensor without the part dim: the error names the missing part dim and how
    a real tensor becomes complex, not only 'use a dim from [...]'; fft2/ifft2 name themselves, not
    the fft they are built from."""
    b, s = md.Dim("batch", 2), md.Dim("seq", 8)
    with md.Graph():
        x = md.input("x", [b, s])
        call = {"fft": lambda: md.fft(x, "seq"), "ifft": lambda: md.ifft(x, "seq"),
                "irfft": lambda: md.irfft(x, "seq", "reim", "time", n=8),
                "fft2": lambda: md.fft2(x, ["batch", "seq"]), "ifft2": lambda: md.ifft2(x, ["batch", "seq"])}[op]
        with pytest.raises(md.ShapeError) as err:
            call()
    text = str(err.value)
    assert f"{op}: part 'reim' is not a dim of" in text
    assert "md.pad(md.unsqueeze(x, 'reim'), 'reim', 0, 1)" in text
    assert ("part= of the md.rfft" in text) if op == "irfft" else ("md.rfft(x, '" in text)


@pytest.mark.slow
def test_the_cli_checks_fno_on_two_real_processes(capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", FNO, "--tiny", "--mesh", "model:2", "--layout", "width:model",
                                      "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err
