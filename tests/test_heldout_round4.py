"""Held-out models of round 4 (written from the README and docs alone) against the dense program.

``tests/heldout_clip.py`` (a two-tower contrastive model: an image and a text encoder, a
``[batch, text_batch]`` logit matrix and a symmetric cross-entropy that couples the whole
batch), ``tests/heldout_dit.py`` (a diffusion transformer: adaLN-Zero modulation vectors per
sample broadcast over the patches, patchify and unpatchify by rearrange, a sinusoidal timestep
embedding), ``tests/heldout_retnet.py`` (retention with a causal decay mask built from positions,
or from a cumsum of log-decays; a group norm written from ops) and ``tests/heldout_gnn.py``
(message passing over a fixed edge list: gathers of source and destination nodes, a sum into
destinations by a one-hot einsum), each ``Config.tiny()``, on a subset of the layouts they were
checked on by hand.

Also what they led to: ``shape["seq"]`` is the dim of that name; two pipelined towers joined
only by the loss run (one micro-batch: the loss reads every row), and an op that reads every
micro-batch's rows is refused with the reason and the fix.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_case_id, heldout_outputs

HERE = Path(__file__).parent
CLIP, DIT, RETNET, GNN = (str(HERE / f"heldout_{n}.py") for n in ("clip", "dit", "retnet", "gnn"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (CLIP, {}, "data:4", "batch:data"),                                   # the loss gathers the text embeddings
    (CLIP, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (CLIP, {}, "model:2", "seq:model; patches:model"),
    (CLIP, {}, "stage:2", "layer:stage"),                                  # the text tower, one micro-batch
    (DIT, {}, "data:2", "batch:data; params.d_model:data"),
    (DIT, {}, "data:2; model:2", "height:data; heads:model; d_ff:model"),  # patchify keeps the split
    (DIT, {}, "stage:2", "layer:stage", PIPE),                             # modulation read from outside
    (RETNET, {}, "model:2", "seq:model; key_seq:model"),
    (RETNET, {"recurrent": True}, "data:2; model:2", "batch:data; seq:model"),   # cumsum over a split seq
    (RETNET, {}, "stage:2", "layer:stage", PIPE),
    (GNN, {}, "model:2", "edges:model"),
    (GNN, {}, "data:2; model:2", "batch:data; nodes:model"),
    (GNN, {}, "stage:2", "layer:stage", PIPE),
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_the_decay_mask_is_retnets():
    """Both ways of making the decay (positions, or a cumsum of log-gammas) give gamma^(n-m) below
    the diagonal and 0 above it."""
    retnet = _load("retnet")
    s, k, h = md.Dim("seq", 6), md.Dim("key_seq", 6), md.Dim("heads", 2)
    gamma = 1 - 2.0 ** (-5.0 - torch.arange(2.0))
    n = torch.arange(6.0)
    want = torch.where(n[:, None] >= n[None, :], gamma[:, None, None] ** (n[:, None] - n[None, :]), 0.0)
    for recurrent in (False, True):
        with md.Graph():
            mask = retnet.decay_mask(s, k, h, recurrent)
        got = md.run_dense({"m": mask})["m"].permute(*[mask.shape.names.index(d) for d in ("heads", "seq", "key_seq")])
        # exp of a log-decay times a distance against torch's pow: fp32 rounding of values <= 1
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _load(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"heldout_{name}", HERE / f"heldout_{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_shape_indexed_by_a_dim_name_is_that_dim():
    b, s = md.Dim("batch", 2), md.Dim("seq", 5)
    shape = md.Shape([b, s])
    assert shape["seq"] is s and shape[s] is s and shape[0] is b and shape[-1] is s
    assert shape[:1] == (b,)
    with pytest.raises(md.ShapeError, match="dim 'sq' is not in shape .*Did you mean 'seq'"):
        shape["sq"]


@pytest.mark.parametrize("mesh, layout", [("stage:2", "img_layer:stage; layer:stage"),
                                          ("stage:2; data:2", "img_layer:stage; layer:stage; batch:data")])
def test_two_towers_pipelined_together_match_dense(mesh, layout):
    """CLIP's image and text stacks both on 'stage' (once refused: their outputs meet only in the
    loss): the image tower's output goes up to the text tower's last stage, where the loss joins
    them, and its gradient comes back down.  The contrastive loss reads every row, so one
    micro-batch; tests/test_two_towers.py has towers joined per row under m = 2 and 4."""
    assert_heldout_case_matches_dense((CLIP, {}, mesh, layout))


def test_a_contrastive_loss_under_micro_batches_is_refused_with_the_reason():
    """The [batch, text_batch] logits need every micro-batch's text rows at once."""
    model = md.load_model(CLIP, tiny=True)
    with pytest.raises(md.LayoutError) as e:
        md.compile(heldout_outputs(model), "stage:2", "layer:stage", **PIPE)
    text = str(e.value)
    assert "allgather over the micro-batches" in text and "{text_batch:micro-batches}" in text, text
    assert "contrastive loss" in text and "microbatches=1" in text, text


@pytest.mark.parametrize("mesh, layout", [("x:1", ""), ("x:2", "rot:x"), ("x:2", "batch:x; two_rot:x")])
def test_rearrange_takes_the_left_dims_in_any_order(mesh, layout):
    """A left side naming the input's dims in another order transposes first (a concat put 'two'
    last; RetNet's rotary merges (two rot)); a group stands for a dim the plain names leave."""
    b, s, r, t = md.Dim("batch", 2), md.Dim("seq", 3), md.Dim("rot", 4), md.Dim("two", 2)
    xt, wt = torch.randn(2, 3, 4, 2, generator=torch.Generator().manual_seed(4)), torch.randn(8, 2)
    with md.Graph():
        x = md.param("x", [b, s, r, t])
        y = md.rearrange(x, "batch seq two rot -> batch seq (two rot)")
        w = md.param("w", [md.Dim("d", 8), b])
        z = md.rearrange(w, "batch (two rot) -> rot batch two", two=2)
        loss = md.reduce_sum(md.tanh(y) * md.arange(md.Dim("two_rot", 8), torch.float32)) + md.reduce_sum(z ** 2)
        outs = {"y": y, "z": z, **md.grad(loss, {"gx": x, "gw": w})}
    params = {"x": xt, "w": wt}
    got = md.run_simulated(md.compile(outs, mesh, layout), params=params)
    xr, wr = xt.clone().requires_grad_(), wt.clone().requires_grad_()
    want_y = xr.permute(0, 1, 3, 2).reshape(2, 3, 8)
    want_z = wr.T.reshape(2, 2, 4).permute(2, 0, 1)          # [batch, (two rot)] -> [rot, batch, two]
    ((want_y.tanh() * torch.arange(8.0)).sum() + (want_z ** 2).sum()).backward()
    # moves are exact; the gradients are one product each, summed over no more than 8 terms
    for k, ref in (("y", want_y), ("z", want_z), ("gx", xr.grad), ("gw", wr.grad)):
        torch.testing.assert_close(got[k], ref, rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def _smoothed_z_loss():
    """A T5/PaLM-style LM loss: label smoothing (a mean of log_softmax over vocab), a z-loss
    (logsumexp squared) and ignore_index=-100 tokens masked out of a mean over the kept ones."""
    b, s, d, v = md.Dim("batch", 4), md.Dim("seq", 6), md.Dim("d_model", 8), md.Dim("vocab", 10)
    with md.Graph():
        x, labels = md.input("x", [b, s, d]), md.input("labels", [b, s], dtype=torch.int64)
        w = md.param("w", [d, v], fan_out=[v])
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", md.tanh(x), w)
        keep = md.greater_equal(labels, 0)
        ce = md.cross_entropy(logits, md.where(keep, labels, 0), "vocab")
        smooth = -md.reduce_mean(md.log_softmax(logits, "vocab"), "vocab")
        per_token = 0.9 * ce + 0.1 * smooth + 1e-2 * md.logsumexp(logits, ["vocab"]) ** 2
        loss = md.reduce_sum(md.where(keep, per_token, 0.0)) / md.reduce_sum(md.cast(keep, torch.float32))
        outs = {"loss": loss, **md.grad(loss, {"grad/w": w, "grad/x": x})}
    gen = torch.Generator().manual_seed(6)
    lab = torch.randint(0, 10, (4, 6), generator=gen)
    lab[:, :2] = -100
    return outs, {"x": torch.randn(4, 6, 8, generator=gen), "labels": lab}


@pytest.mark.parametrize("mesh, layout", [("x:2", "vocab:x"), ("x:2; y:2", "batch:x; vocab:y")])
def test_a_smoothed_z_loss_over_a_split_vocab_reduces_rows_not_logits(mesh, layout):
    """The smoothing term's gradient broadcasts a per-token sum over the split vocab: its partial
    sum is allreduced at the token's size, not reduce-scattered at the logits' size."""
    outs, feeds = _smoothed_z_loss()
    plan = md.compile(outs, mesh, layout)
    assert "reduce_scatter" not in plan.totals() and "allgather" not in plan.totals(), plan.totals()
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    x = feeds["x"].clone().requires_grad_()
    wt = md.DenseProgram(outs).init_params()["w"].clone().requires_grad_()
    logits = torch.tanh(x) @ wt
    keep = feeds["labels"] >= 0
    ls = logits.log_softmax(-1)
    per_token = (0.9 * torch.nn.functional.cross_entropy(logits.transpose(1, 2), feeds["labels"].clamp(min=0),
                                                         reduction="none")
                 - 0.1 * ls.mean(-1) + 1e-2 * logits.logsumexp(-1) ** 2)
    (per_token * keep).sum().div(keep.sum()).backward()
    # split sums over ranks, and the composite against torch's kernels: fp32 rounding of O(1) values
    for k, ref in (("loss", per_token.detach().mul(keep).sum() / keep.sum()), ("grad/w", wt.grad), ("grad/x", x.grad)):
        torch.testing.assert_close(want[k], ref, rtol=0, atol=1e-5, msg=lambda m, k=k: f"dense {k}: {m}")
        torch.testing.assert_close(got[k], ref, rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
