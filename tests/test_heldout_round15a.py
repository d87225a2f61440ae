"""Held-out models of round 15a (written from the README and docs alone): a two-tower
image/text model with a pairwise sigmoid loss, a normalising flow, a CRF tagger, a momentum
contrastive encoder and an hourglass language model.

``tests/heldout_siglip.py`` (SigLIP: patchified image tower and causal text tower, every image
against every caption of the batch in a ``[batch, batch2]`` logits matrix with a learnable
temperature and bias; ``loss=softmax`` is CLIP's loss); ``tests/heldout_glow.py`` (Glow:
squeeze, actnorm, an invertible 1x1 conv in LU form, an affine or additive coupling with a conv
net, NLL in bits/dim; ``levels=2`` factors out half the channels and squeezes again);
``tests/heldout_crf.py`` (a transformer encoder and a linear-chain CRF: log Z by pairwise
log-space matrix products, ``seq -> (seq two)``, or by an inner ``md.repeat`` over ``seq``);
``tests/heldout_moco.py`` (MoCo v2: a query encoder, a frozen key encoder updated as an EMA
from Python, or the query's weights through ``md.stop_gradient``, a queue of negatives fed as
an input, InfoNCE); ``tests/heldout_hourglass.py`` (Hourglass: shift right, merge pairs,
middle layers at half length, upsample with a residual, causal LM loss). Each runs under
data, Megatron, sequence/spatial/feature (2-way, uneven 3-way), FSDP, pipeline (1f1b, zbh1,
interleaved:2) and remat layouts against the dense program. Findings: /work/notes/heldout-15a.md.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id,
                      heldout_outputs, run_cli)

HERE = Path(__file__).parent
SIGLIP, GLOW, CRF, MOCO, HOURGLASS = (
    str(HERE / f"heldout_{n}.py") for n in ("siglip", "glow", "crf", "moco", "hourglass"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
ONE_1F1B, ONE_ZBH1 = {"microbatches": 1, "schedule": "1f1b"}, {"microbatches": 1, "schedule": "zbh1"}
SOFTMAX, LEVELS2, ADDITIVE, SCAN, STOP, MEAN = ({"loss": "softmax"}, {"levels": 2}, {"coupling": "additive"},
                                                {"form": "scan"}, {"key": "stop"}, {"pool": "mean"})

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (SIGLIP, {}, "data:3", "batch:data"),                     # cross-example logits, batch 4 over 3
    (CRF, {}, "model:2", "seq:model"),                        # the log-space tree keeps seq split
    (HOURGLASS, {}, "model:2", "seq:model"),                  # shortening keeps seq split
]

SLOW_CASES = [
    (SIGLIP, {}, "data:2", "batch:data"),
    (SIGLIP, SOFTMAX, "data:2", "batch:data"),
    (SIGLIP, SOFTMAX, "data:3", "batch:data"),
    (SIGLIP, {}, "data:2", "batch:data; batch2:data"),
    (SIGLIP, {}, "model:2", "heads:model; d_ff:model"),
    (SIGLIP, {}, "model:3", "d_ff:model; embed:model"),
    (SIGLIP, {}, "model:2", "height:model; seq:model"),
    (SIGLIP, {}, "model:3", "patches:model"),
    (SIGLIP, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (SIGLIP, {}, "data:2", "batch:data; params.d_model:data"),
    # a contrastive loss needs the whole batch at once: pipelines of one micro-batch (see below)
    (SIGLIP, {}, "stage:2", "layer:stage", ONE_1F1B),
    (SIGLIP, SOFTMAX, "stage:2", "layer:stage", ONE_ZBH1),
    (SIGLIP, {"text_layers": 2}, "stage:2; data:2", "layer:stage; text_layer:stage; batch:data", ONE_1F1B),
    (SIGLIP, {"remat": "full"}, "model:2", "heads:model"),
    (GLOW, {}, "data:2", "batch:data"),
    (GLOW, {}, "data:3", "batch:data"),
    (GLOW, {}, "data:2", "height:data"),
    (GLOW, {}, "data:3", "height:data"),
    (GLOW, {}, "data:2", "width:data"),
    (GLOW, {}, "model:2", "hidden:model"),
    (GLOW, {}, "model:2", "c1:model"),
    (GLOW, LEVELS2, "data:2", "height:data"),
    (GLOW, LEVELS2, "data:2; model:2", "c2:data; hidden:model"),
    (GLOW, ADDITIVE, "data:2; model:2", "batch:data; height:model"),
    (GLOW, {}, "data:2", "batch:data; params.hidden:data"),
    (GLOW, {}, "stage:2", "layer:stage", PIPE),
    (GLOW, ADDITIVE, "stage:2", "layer:stage", ZBH1),
    (GLOW, {"steps": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (GLOW, {"remat": "full"}, "stage:2; data:2", "layer:stage; height:data", PIPE),
    (CRF, {}, "data:2", "batch:data"),
    (CRF, SCAN, "data:2", "batch:data"),
    (CRF, {}, "model:2", "heads:model; d_ff:model"),
    (CRF, {}, "model:3", "seq:model"),
    (CRF, {}, "model:4", "seq:model"),
    (CRF, {}, "model:2", "tags:model"),
    (CRF, {}, "model:3", "tag_from:model; d_ff:model"),
    (CRF, SCAN, "model:2", "tags:model"),
    (CRF, {}, "data:2; model:2", "batch:data; seq:model"),
    (CRF, {}, "data:2", "batch:data; params.d_model:data"),
    (CRF, {}, "stage:2", "layer:stage", PIPE),
    (CRF, SCAN, "stage:2", "layer:stage", ZBH1),
    (CRF, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (CRF, {"remat": "full"}, "stage:2; model:2", "layer:stage; heads:model", PIPE),
    (MOCO, {}, "data:2", "batch:data"),
    (MOCO, {}, "data:3", "batch:data"),
    (MOCO, STOP, "data:2", "batch:data"),
    (MOCO, {}, "model:2", "d_ff:model"),
    (MOCO, {}, "model:2", "queue:model"),
    (MOCO, {}, "model:4", "queue:model"),
    (MOCO, {}, "model:3", "embed:model"),
    (MOCO, STOP, "model:3", "d_model:model"),
    (MOCO, {}, "data:2; model:2", "batch:data; d_ff:model; queue:model"),
    (MOCO, {}, "data:2", "batch:data; params.d_model:data"),
    (MOCO, {}, "stage:2", "layer:stage", PIPE),
    (MOCO, STOP, "stage:2", "layer:stage", ZBH1),
    (MOCO, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (MOCO, {"remat": "full"}, "stage:2; model:2", "layer:stage; d_ff:model", PIPE),
    (HOURGLASS, {}, "data:2", "batch:data"),
    (HOURGLASS, MEAN, "data:2", "batch:data"),
    (HOURGLASS, {}, "model:2", "heads:model; d_ff:model"),
    (HOURGLASS, {}, "model:3", "seq:model"),
    (HOURGLASS, {}, "model:4", "seq:model"),
    (HOURGLASS, MEAN, "model:2", "seq:model"),
    (HOURGLASS, {}, "model:3", "vocab:model"),
    (HOURGLASS, {}, "data:2; model:2", "batch:data; seq:model"),
    (HOURGLASS, {}, "data:2", "batch:data; params.d_model:data"),
    (HOURGLASS, {}, "stage:2", "layer:stage", PIPE),
    (HOURGLASS, MEAN, "stage:2", "layer:stage", ZBH1),
    (HOURGLASS, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (HOURGLASS, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _moco_run(mesh: str, layout: str, steps: int = 3) -> tuple[list[float], dict]:
    """MoCo's training loop from Python: an AdamW step of the query encoder, then the key
    encoder's EMA (``momentum_update``) and the queue's FIFO, per step; the losses and the
    first and last key weights."""
    model = md.load_model(MOCO, tiny=True)
    mod = __import__("heldout_moco")
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=md.AdamW(lr=0.05))
    step.set_params({f"k_{n}": w for n, w in ((n, step.full_params()[f"q_{n}"]) for n in mod.ENCODER)})
    queue, losses, first = model.feeds(0)["queue"], [], step.full_params(frozen=True)["k_w1"]
    keys_of = md.compile({"keys": model.outputs["keys"]}, "data:1", "")
    for t in range(steps):
        feeds = {**model.feeds(t + 1), "queue": queue}
        losses.append(step(feeds)[0])
        mod.momentum_update(step, 0.9)
        keys = md.run_simulated(keys_of, {k: v for k, v in feeds.items() if k == "x_k"},
                                params={k: v for k, v in step.full_params(frozen=True).items()
                                        if k.startswith("k_")})["keys"]
        queue = mod.enqueue(queue, keys)
    return losses, {"first": first, "last": step.full_params(frozen=True)["k_w1"]}


def test_moco_ema_training_loop_matches_dense():
    """The key encoder is frozen (no gradient, no update from the step) and follows the query
    encoder by an EMA written in Python over ``full_params``/``set_params``; the queue takes each
    step's keys. Three AdamW steps under ``batch:data; d_ff:model`` give the one-device losses."""
    import sys
    sys.path.insert(0, str(HERE))
    want, want_k = _moco_run("data:1", "")
    got, got_k = _moco_run("data:2; model:2", "batch:data; d_ff:model")
    # fp32 sums in another order, three steps: ~1e-6 of the loss; a wrong EMA or queue is O(0.1)
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    assert want[0] != pytest.approx(want[-1], rel=1e-3)
    torch.testing.assert_close(got_k["last"], want_k["last"], rtol=0, atol=1e-5)   # same rounding bound
    assert not torch.allclose(want_k["last"], want_k["first"])    # the EMA moved the frozen key encoder


def test_a_pipelined_stacks_params_read_outside_it():
    """A stacked param pipelined over ``layer:stage`` and read again outside its stack (MoCo's
    key encoder reading the query encoder's weights through ``md.stop_gradient``; a sum over its
    layers): the gather or sum over the stage axis ran on the reading stage's ranks only (an
    internal AssertionError, 'needs ranks this view does not hold'); it runs on every stage.
    Read with its gradient, the second stack's gradient would be cut on one stage only: refused."""
    b, d, layer = md.Dim("batch", 4), md.Dim("d", 3), md.Dim("layer", 2)
    feeds = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    for form in ("stop", "sum", "grad"):
        with md.Graph():
            x = md.input("x", [b, d])
            w = md.param("w", [layer, d], scale=1.0)
            h = md.repeat(lambda h, p: md.tanh(h * p["w"]), x, {"w": w}, "layer")
            if form == "sum":
                k = x * md.reduce_sum(md.stop_gradient(w), "layer")
            else:
                w2 = md.rename(md.stop_gradient(w) if form == "stop" else w, layer="key_layer")
                k = md.repeat(lambda h, p: md.tanh(h * p["w"]), x, {"w": w2}, "key_layer")
            loss = md.reduce_mean(h * k)
            outputs = {"loss": loss, **md.grad(loss, {"w": w})}
        if form == "grad":
            with pytest.raises(md.LayoutError, match=r"(?s)cuts the layers' parts of 'layer'.*stop_gradient"):
                md.compile(outputs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b")
            continue
        result = md.check(outputs, "stage:2", "layer:stage", feeds, microbatches=2, schedule="1f1b")
        assert result.ok, (form, str(result))


def test_a_reduction_over_a_pipelined_scan_dim_before_the_scan_is_refused():
    """A recurrence as a top-level ``md.repeat`` over ``seq`` (a CRF's forward algorithm) under
    ``seq:model``: the rule makes ``model`` a pipeline axis over the positions, and a sum over ``seq``
    made before the scan (its first carry) was an allreduce over ``model`` on stage 0's ranks only
    (an internal AssertionError at run time); refused at compile time, naming it."""
    b, s, d = md.Dim("batch", 2), md.Dim("seq", 4), md.Dim("d", 3)
    with md.Graph():
        x = md.input("x", [b, s, d])
        w = md.param("w", [d, md.Dim("e", 3)], fan_out=["e"])
        e = md.rename(md.einsum("batch seq d, d e -> batch seq e", x, w), e="d")
        h = md.repeat(lambda h, p: md.tanh(h + p["e"]), md.reduce_sum(x, "seq") * 0.5, {"e": e}, "seq")
        loss = md.reduce_mean(h * h)
        outputs = {"loss": loss, **md.grad(loss, {"w": w})}
    with pytest.raises(md.LayoutError, match=r"(?s)allreduce over the pipeline axis 'model' on stage\(s\) \[0\] only"):
        md.compile(outputs, "model:2", "seq:model")


def test_a_one_layer_tower_on_the_stage_axis_is_named_as_such():
    """SigLIP with a 1-layer text tower under ``layer:stage; text_layer:stage``: a size-1 dim is
    never split, so that stack is not pipelined; the refusal said 'a pipeline axis splits only
    the layer dim', though two towers on one stage axis are supported. It now names the stack."""
    b, d = md.Dim("batch", 4), md.Dim("d", 3)
    with md.Graph():
        x = md.input("x", [b, d])
        w = md.param("w", [md.Dim("layer", 2), d], scale=1.0)
        v = md.param("v", [md.Dim("text_layer", 1), d], scale=1.0)
        h = md.repeat(lambda h, p: md.tanh(h * p["w"]), x, {"w": w}, "layer")
        t = md.repeat(lambda h, p: md.tanh(h * p["v"]), x, {"v": v}, "text_layer")
        loss = md.reduce_mean(h * t)
    with pytest.raises(md.LayoutError, match=r"(?s)repeat over 'text_layer' is not pipelined over 'stage'.*"
                                             r"size 1 .*drop 'text_layer:stage'"):
        md.compile(loss, "stage:2", "layer:stage; text_layer:stage")


def test_siglip_logits_pair_every_image_with_every_caption():
    """The ``[batch, batch2]`` logits under ``batch:data`` on 3 ranks (4 rows: 2, 1, 1) are the dense
    ones, each rank's images against all captions (the captions' embeddings gathered once)."""
    model = md.load_model(SIGLIP, tiny=True)
    feeds = model.feeds(0)
    want = md.run_dense({"logits": model.outputs["logits"]}, feeds)["logits"]
    plan = md.compile({"logits": model.outputs["logits"], "loss": model.loss}, "data:3", "batch:data")
    got = md.run_simulated(plan, model.feeds(0))["logits"]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))  # fp32 rounding
    kinds = {k: t["count"] for k, t in plan.totals().items()}
    assert kinds.get("allgather") == 1, plan.totals()


def test_crf_log_partition_is_the_sum_over_every_tag_path():
    """Both forms' log Z is logsumexp over all tags**seq paths, and the loss its mean minus the gold
    path's score, enumerated in torch (tiny: 3**8 paths)."""
    for form in ("tree", "scan"):
        model = md.load_model(CRF, tiny=True, form=form)
        feeds = model.feeds(0)
        out = md.run_dense({"emit": model.outputs["emit"], "log_z": model.outputs["log_z"], "loss": model.loss,
                            **{k: model.params[k] for k in ("trans", "start", "end")}}, feeds)
        e, tr, st, en = out["emit"], out["trans"], out["start"], out["end"]
        n, s, t = e.shape
        paths = torch.tensor(list(itertools.product(range(t), repeat=s)))

        def score(b, p):
            return (st[p[:, 0]] + en[p[:, -1]] + e[b][torch.arange(s)[None], p].sum(-1)
                    + tr[p[:, :-1], p[:, 1:]].sum(-1))

        log_z = torch.stack([torch.logsumexp(score(b, paths), 0) for b in range(n)])
        gold = torch.stack([score(b, feeds["tags"][b][None])[0] for b in range(n)])
        # fp32 logsumexps of ~10-sized scores in another order: ~1e-6
        torch.testing.assert_close(out["log_z"], log_z, rtol=0, atol=1e-5)
        torch.testing.assert_close(out["loss"], (log_z - gold).mean(), rtol=0, atol=1e-5)


def test_hourglass_is_causal():
    """Changing token p changes no logit before p (the shift before the pairs merge keeps the
    short positions from seeing later tokens), and does change those at p."""
    model = md.load_model(HOURGLASS, tiny=True)
    feeds = model.feeds(0)
    feeds = {"ids": feeds["ids"]}
    base = md.run_dense({"logits": model.logits}, feeds)["logits"]
    for p in (1, 2, 5):
        ids = feeds["ids"].clone()
        ids[:, p] = (ids[:, p] + 1) % model.config.vocab
        got = md.run_dense({"logits": model.logits}, {"ids": ids})["logits"]
        assert torch.equal(got[:, :p], base[:, :p]), p
        assert not torch.allclose(got[:, p], base[:, p]), p


def test_glow_log_determinant_is_the_jacobians():
    """The flow's log-likelihood of one image is log N(z) + log|det dz/dx|, with the Jacobian of
    the dense flow taken by torch (64 x 64, tiny): the LU form's sum of log|s|, actnorm's and the
    coupling's log-determinants are the true ones."""
    model = md.load_model(GLOW, tiny=True, batch=1)
    feeds = model.feeds(0)
    x = feeds["images"]

    def flow(images):
        return md.run_dense({"z": model.outputs["z"]}, {"images": images})["z"].reshape(-1)

    jac = torch.autograd.functional.jacobian(flow, x).reshape(x.numel(), x.numel())
    z = flow(x)
    want = (-0.5 * z * z - 0.5 * torch.log(torch.tensor(2 * torch.pi))).sum() + torch.linalg.slogdet(jac)[1]
    got = md.run_dense({"ll": model.outputs["log_likelihood"]}, feeds)["ll"]
    # a 64 x 64 slogdet in fp32 and the model's sums of logs: ~1e-5 of the ~100-sized value
    torch.testing.assert_close(got.reshape(()), want, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_siglip_refuses_micro_batches_naming_the_pairwise_logits():
    """Every image meets every caption of the batch: one micro-batch at a time cannot make the
    ``[batch, batch2]`` logits, and the pipeline says so (the fix: one micro-batch)."""
    model = md.load_model(SIGLIP, tiny=True)
    with pytest.raises(md.LayoutError, match=r"(?s)cannot be micro-batched.*batch2:micro-batches.*contrastive"):
        md.compile(heldout_outputs(model), "stage:2", "layer:stage", microbatches=2, schedule="1f1b")


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (SIGLIP, "data:2", "batch:data"),
    (GLOW, "data:2", "height:data"),
    (CRF, "model:2", "seq:model"),
    (MOCO, "model:2", "queue:model"),
    (HOURGLASS, "model:2", "seq:model"),
], ids=["siglip", "glow", "crf", "moco", "hourglass"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [SIGLIP, GLOW, CRF, MOCO, HOURGLASS],
                         ids=["siglip", "glow", "crf", "moco", "hourglass"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (SIGLIP, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (GLOW, "data:2", "batch:data; params.hidden:data"),
    (CRF, "data:2; model:2", "batch:data; seq:model"),
    (HOURGLASS, "data:2; model:2", "batch:data; seq:model"),
], ids=["siglip", "glow", "crf", "hourglass"])
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses and norms."""
    from conftest import adamw_dense_curve
    model = md.load_model(path, tiny=True)
    opt = md.AdamW(lr=0.01, weight_decay=0.1)
    want, _ = adamw_dense_curve(model, opt, 1.0, 3)
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=opt, clip_norm=1.0)
    got = []
    for i in range(3):
        got.append(step(model.feeds(i), lr=0.01)[0])
    # fp32 sums in another order over three steps: ~1e-6 relative; a wrong update is O(1e-2)
    assert got == pytest.approx(want, rel=1e-5), (got, want)
