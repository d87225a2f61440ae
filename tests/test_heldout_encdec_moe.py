"""Held-out encoder-decoder and mixture-of-experts models against the dense program.

``tests/heldout_bart.py`` (a BART/Whisper-style encoder-decoder: padding-masked encoder,
causal decoder with cross-attention, learned positions, tied embedding) and
``tests/heldout_mixtral.py`` (top-2 routed SwiGLU experts plus a shared expert, a per-layer
balance loss returned from ``md.repeat``; a Switch-style top-1 variant with a capacity) were
written from the README and docs alone. Each layout below gives the dense program's loss,
gradients and per-layer outputs on the simulated mesh: data, tensor, expert (also with experts
the axis does not divide), FSDP, pipelines (1F1B, ZB-H1, interleaved virtual stages, with a data
axis and split experts, with remat). Both stacks of the encoder-decoder on one stage axis while
they scan one layer dim are refused with the fix; the decoder stack alone pipelines, interleaved
too (both stacks with layer dims of their own: tests/test_two_stacks.py).
"""
from __future__ import annotations

import pathlib

import pytest
import torch

import meshdsl as md
from meshdsl.errors import LayoutError

HERE = pathlib.Path(__file__).parent
BART, MIXTRAL = str(HERE / "heldout_bart.py"), str(HERE / "heldout_mixtral.py")


def _outputs(model, remat=None):
    outs = {"loss": model.loss, **model.outputs}
    grads = md.grad(model.loss, model.params, **({"remat": remat} if remat else {}))
    return {**outs, **{f"grad/{k}": g for k, g in grads.items()}}


def _assert_matches_dense(outs, feeds, mesh, layout, **kw):
    want = md.run_dense(outs, feeds)
    got = md.run_simulated(md.compile(outs, mesh, layout, **kw), feeds)
    # The tolerance of `meshdsl check`: 1e-4 of an output's largest magnitude (of the largest
    # gradient's for a gradient). A split contraction or a micro-batch sum adds fp32 partial
    # sums in another order, n * 2**-24 of the magnitudes for n terms, far below 1e-4; a layout
    # bug is off by O(1). Integer outputs (dropped-routing counts) must be equal.
    top_grad = max(float(v.abs().max()) for k, v in want.items() if k.startswith("grad/"))
    for k, w in want.items():
        if not w.is_floating_point():
            assert torch.equal(got[k], w), k
            continue
        scale = top_grad if k.startswith("grad/") else float(w.abs().max())
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-4 * scale, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("over, mesh, layout, kw", [
    ({}, "data:2; model:2", "batch:data; heads:model; d_ff:model; vocab:model", {}),
    ({"heads": 3}, "model:2", "heads:model; src:model", {}),
    ({"enc_layer": "enc_layer"}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "zbh1", "remat": "full"}),
    ({"enc_layer": "enc_layer", "layers": 4}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "interleaved:2"}),
], ids=["dp-megatron-vocab", "uneven-heads-seq", "decoder-pipeline-zbh1-full", "decoder-pipeline-interleaved"])
def test_encoder_decoder_matches_dense(over, mesh, layout, kw):
    m = md.load_model(BART, tiny=True, **over)
    kw = dict(kw)
    outs = _outputs(m, kw.pop("remat", None))
    _assert_matches_dense(outs, m.feeds(0), mesh, layout, **kw)


@pytest.mark.parametrize("over, mesh, layout, kw", [
    ({"experts": 3}, "data:2", "batch:data; experts:data", {}),
    ({}, "model:2", "experts:model; heads:model; d_shared:model", {}),
    ({"router": "switch", "capacity_factor": 1.0}, "data:2", "batch:data; experts:data", {"remat": "selective"}),
    ({}, "stage:2; data:2", "layer:stage; batch:data; experts:data", {"microbatches": 2, "schedule": "1f1b"}),
    ({"layers": 4}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "interleaved:2"}),
], ids=["ep-uneven", "ep-model-tp", "switch-ep-selective", "pipeline-dp-ep-1f1b", "pipeline-interleaved"])
def test_moe_matches_dense(over, mesh, layout, kw):
    m = md.load_model(MIXTRAL, tiny=True, **over)
    kw = dict(kw)
    outs = _outputs(m, kw.pop("remat", None))
    _assert_matches_dense(outs, m.feeds(0), mesh, layout, **kw)


def test_switch_capacity_drops_routings():
    """The capacity factor 1.0 of the top-1 variant really drops tokens at this size (so the
    layouts above check the dropping path), and dropless top-2 drops none."""
    for over, dropped in (({"router": "switch", "capacity_factor": 1.0}, True), ({}, False)):
        m = md.load_model(MIXTRAL, tiny=True, **over)
        got = md.run_dense({"d": m.outputs["moe/dropped"]}, {"ids": m.feeds(0)["ids"]})["d"]
        assert (int(got) > 0) == dropped, (over, int(got))


def _per_layer_graph(layers: int):
    """A repeat whose layers return a scalar and a per-row output, read by the loss layer by layer."""
    b, d, lay = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("layer", layers)
    with md.Graph():
        x = md.input("x", [b, d])
        w = md.param("w", [lay, d, md.Dim("d_out", 4)], fan_out=["d_out"])

        def block(h, p):
            y = md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), {"d_out": "d_model"})
            return h + md.tanh(y), {"aux": md.reduce_mean(y ** 2), "row": md.reduce_sum(y, "d_model")}

        h, per = md.repeat(block, x, {"w": w}, "layer")
        loss = (md.reduce_mean(h ** 2) + 0.1 * md.reduce_sum(per["aux"], "layer")
                + 0.01 * md.reduce_sum(md.exp(per["row"])))
        return {"loss": loss, "aux": per["aux"], **md.grad(loss, {"w": w})}


@pytest.mark.parametrize("layers, schedule, stage_layers", [(6, "interleaved:3", None),
                                                            (6, "interleaved:2", (1, 2, 2, 1))])
def test_per_layer_outputs_under_virtual_stages(layers, schedule, stage_layers):
    """The reduction of the MoE's pipelined interleaved case: per-layer outputs under virtual
    stages, equal and unequal chunks (lowering/interleave.py, lowering/pipeline_program.py)."""
    outs = _per_layer_graph(layers)
    feeds = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(0))}
    _assert_matches_dense({**outs, "grad/w": outs.pop("w")}, feeds, "stage:2", "layer:stage",
                          microbatches=4, schedule=schedule, stage_layers=stage_layers)


def _cross_graph(layers: int):
    """A stack whose layers read a tensor made per micro-batch before it (an encoder's output,
    from a param and an input), differentiated into that param."""
    b, s, d, lay = md.Dim("batch", 4), md.Dim("src", 3), md.Dim("d_model", 4), md.Dim("layer", layers)
    with md.Graph():
        x, src = md.input("x", [b, d]), md.input("src", [b, s, d])
        we = md.param("we", [d, md.Dim("d_e", 4)])
        w = md.param("w", [lay, d, md.Dim("d_out", 4)], fan_out=["layer", "d_out"])
        mem = md.rename(md.tanh(md.einsum("batch src d_model, d_model d_e -> batch src d_e", src, we)), {"d_e": "d_model"})

        def block(h, p):
            y = md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), {"d_out": "d_model"})
            return h + md.tanh(y) * md.reduce_mean(md.einsum("batch d_model, batch src d_model -> batch src", y, mem), "src")

        loss = md.reduce_mean(md.repeat(block, x, {"w": w}, "layer") ** 2)
        return {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, {"w": w, "we": we}).items()}}


@pytest.mark.parametrize("mesh, layers, schedule, stage_layers", [("stage:4", 8, "interleaved:2", None),
                                                                  ("stage:2", 6, "interleaved-zb:2", (1, 2, 2, 1))])
def test_a_tensor_made_per_microbatch_under_virtual_stages(mesh, layers, schedule, stage_layers):
    """The reduction of the encoder-decoder's interleaved case: the closed-over tensor reaches
    each rank's first chunk, its gradient is summed over the rank's chunks, then down the stages
    (four stages: a chained sum), equal and unequal chunks (lowering/interleave.py)."""
    gen = torch.Generator().manual_seed(0)
    feeds = {"x": torch.randn(4, 4, generator=gen), "src": torch.randn(4, 3, 4, generator=gen)}
    _assert_matches_dense(_cross_graph(layers), feeds, mesh, "layer:stage", microbatches=4, schedule=schedule,
                          stage_layers=stage_layers)


def test_two_pipelined_stacks_are_refused_with_the_fix():
    m = md.load_model(BART, tiny=True)
    with pytest.raises(LayoutError, match=r"(?s)more than one repeat is pipelined.*scan dim 'layer'.*"
                                          r"Fix: give each stack a layer dim of its own name"):
        md.compile({"loss": m.loss}, "stage:2", "layer:stage", microbatches=2, schedule="1f1b")


def test_a_whole_batch_balance_loss_under_microbatches_is_refused_with_the_fix():
    """Switch's balance loss over the whole batch multiplies two batch means inside each layer,
    which no sum of micro-batches gives: refused, naming the per-sequence form (which the model
    uses by default and the cases above check)."""
    m = md.load_model(MIXTRAL, tiny=True, balance="batch")
    with pytest.raises(LayoutError, match=r"(?s)sums over the micro-batches in every layer.*Fix: .*per sequence"):
        md.compile({"loss": m.loss}, "stage:2", "layer:stage", microbatches=2, schedule="1f1b")


def test_per_layer_outputs_on_unequal_ranks_match_dense_and_auto_splits_them():
    """What the loss makes of per-layer outputs runs on each rank's own, unequal number of layers
    (lowering/local_parts.py; it was refused once), and ``balance_stages`` (``--stage-layers
    auto``) returns a split the compiler takes."""
    for sched, counts in (("1f1b", (3, 1)), ("interleaved:2", (2, 1, 2, 1))):
        m = md.load_model(MIXTRAL, tiny=True, layers=sum(counts), vocab=512)
        outs = _outputs(m)
        _assert_matches_dense(outs, m.feeds(0), "stage:2", "layer:stage", microbatches=2, schedule=sched,
                              stage_layers=counts)
        auto = md.balance_stages(outs, "stage:2", "layer:stage", microbatches=2, schedule=sched)
        md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule=sched, stage_layers=auto)
