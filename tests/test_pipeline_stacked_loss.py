"""A loss that reads a pipelined repeat's per-layer outputs non-linearly (lowering/partition.py).

Layer by layer (a sum over the layer dim of any function of each layer's value: squares,
``exp``), each stage computes its own layers' part of the loss and of the outputs' cotangent
in its forward actions, where its backward reads the cotangent: the same numbers as the dense
program on ``stage:2`` (simulated) for gpipe, 1F1B, ZB-H1 and interleaved virtual stages, with
remat and with a data axis.
Across layers (a function of the sum over layers, a softmax over them) the gradient needs every
stage's layers of a micro-batch at once: refused with the reason and the fix, exit 2 from the CLI.
"""
from __future__ import annotations

import textwrap

import pytest

import meshdsl as md
from meshdsl.errors import LayoutError

from conftest import run_cli
from test_repeat_outputs import B, D, L, PARAMS, _block, _close, _inputs

PIPE = ("stage:2", "layer:stage")


def _model(extra: str, remat=None):
    """The repeat of tests/test_repeat_outputs.py with the loss term ``extra`` of its per-layer
    outputs ``aux`` [layer] and ``row`` [layer, batch]."""
    with md.Graph("rep"):
        x = md.input("x", [B, D])
        ps = {k: md.param(k, [L] + dims, scale=1.0) for k, dims in PARAMS.items()}
        y, per = md.repeat(_block, x, ps, "layer", remat=remat)
        aux, row = per["aux"], per["row"]
        # (a function of ``aux``, a mean over the batch, is no sum of micro-batches: only linear
        # uses of it micro-batch, pipelined or not)
        term = {"squares": lambda: md.reduce_sum(row * row) + md.reduce_sum(aux),
                "exp": lambda: md.reduce_sum(md.exp(row * 0.1)),
                "exp_of_sum": lambda: md.reduce_sum(md.exp(md.reduce_sum(row, "layer") * 0.1)),
                "softmax": lambda: md.reduce_sum(md.softmax(row, "layer") * row)}[extra]()
        loss = md.reduce_sum(md.tanh(y) * x) + term
        grads = md.grad(loss, ps)
    return {"loss": loss, "aux": aux, **{f"d/{k}": v for k, v in grads.items()}}


@pytest.mark.parametrize("extra, mesh, layout, schedule, remat", [
    ("squares", *PIPE, "1f1b", None),
    ("squares", *PIPE, "gpipe", "full"),
    ("squares", *PIPE, "zbh1", None),
    ("exp", *PIPE, "1f1b", "selective"),
    ("squares", "stage:2; data:2", "layer:stage; batch:data", "1f1b", None),
])
def test_a_loss_of_each_layers_outputs_matches_dense(extra, mesh, layout, schedule, remat):
    params, feeds = _inputs()
    outs = _model(extra, remat)
    want = md.run_dense(outs, feeds, params)
    plan = md.compile(outs, mesh, layout, microbatches=2, schedule=schedule)
    _close(md.run_simulated(plan, feeds, params), want, f"{extra} '{mesh}' {schedule}")


@pytest.mark.parametrize("extra, joins", [("exp_of_sum", "allreduce over ('stage',)"),
                                          ("softmax", "allreduce over ('stage',)")])   # split softmax: its sums
def test_a_loss_across_layers_is_refused_with_the_reason(extra, joins):
    with pytest.raises(LayoutError) as e:
        md.compile(_model(extra), *PIPE, microbatches=2, schedule="1f1b")
    text = str(e.value)
    assert "the loss reads the pipelined repeat's per-layer outputs ['row'] across layers" in text
    assert joins in text and "joins the layers of every stage" in text
    assert "Fix: write the term as a sum over layers of a per-layer function" in text


def test_the_cli_refuses_it_with_exit_2(tmp_path, capsys):
    path = tmp_path / "across.py"
    path.write_text(textwrap.dedent('''
        from dataclasses import dataclass
        import torch
        import meshdsl as md

        @dataclass(frozen=True)
        class Config:
            layers: int = 2

        def build(cfg=Config()):
            b, d, f, l = md.Dim("batch", 4), md.Dim("d_model", 4), md.Dim("d_ff", 8), md.Dim("layer", cfg.layers)
            with md.Graph("across") as g:
                x = md.input("x", [b, d])
                ps = {"w1": md.param("w1", [l, d, f]), "w2": md.param("w2", [l, f, d])}
                def block(h, p):
                    u = md.tanh(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["w1"]))
                    h = h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", u, p["w2"])
                    return h, {"norm": md.reduce_sum(u * u, "d_ff")}
                y, per = md.repeat(block, x, ps, "layer")
                loss = md.reduce_sum(y) + md.reduce_sum(md.exp(md.reduce_sum(per["norm"], "layer")))
            return md.Model(g, loss, ps, lambda seed=0: {"x": torch.randn(4, 4)}, cfg)
    '''))
    rc, _, err = run_cli(capsys, ["check", str(path), "--mesh", "stage:2", "--layout", "layer:stage",
                                  "--microbatches", "2", "--schedule", "1f1b"])
    assert rc == 2, err
    assert "per-layer outputs ['norm'] across layers" in err and "Traceback" not in err


@pytest.mark.parametrize("extra, schedule", [("squares", "interleaved:2"), ("exp", "interleaved-zb:2")])
def test_virtual_stages_make_each_chunks_part(extra, schedule):
    """Under interleaved:V each chunk makes its layers' per-layer outputs, joined on its rank
    where the loss's terms run (the rank's last chunk), and each chunk's backward reads its
    layers of their cotangent, made there too (lowering/interleave.py; a value one virtual
    stage makes for another of its rank is dropped after the last of them:
    lowering/pipeline_program.py _finishing)."""
    params, feeds = _inputs()
    outs = _model(extra)
    want = md.run_dense(outs, feeds, params)
    plan = md.compile(outs, *PIPE, microbatches=2, schedule=schedule)
    _close(md.run_simulated(plan, feeds, params), want, f"{extra} {schedule}")
