"""Held-out models of round 26a (written from the README and docs alone).

``tests/heldout_tokenformer.py`` (a causal LM whose every projection is a Pattention layer: tokens
attend over learnable key/value param tokens, normalised by gelu over an L2 norm instead of a
softmax); ``tests/heldout_blt.py`` (Byte Latent Transformer-lite: byte embeddings pooled into patches
by a one-hot segment mean with md.where for empty patches, a global causal stack over patches, a byte
decoder reading its patch's state and cross-attending causally by patch); ``tests/heldout_itransformer.py``
(attention across variates, each variate's series one token, instance normalisation undone at the head);
``tests/heldout_flowdit.py`` (a rectified-flow DiT: md.rearrange patchify, sinusoidal time plus class
condition, adaLN blocks); ``tests/heldout_coatnet.py`` (an MBConv stage with running batch norms and
squeeze-excite, a strided downsample, transformer blocks with a 2-D relative position bias table read
at offsets from md.arange's integer math). Each runs under data, Megatron, token/patch/variate/
param-token/spatial/channel splits (2-way, uneven 3-way), FSDP, pipelines, remat and the search's
layouts against the dense program, and each model against a plain-torch reference (float64).
Findings: /work/notes/heldout-26a.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_dense_is_its_torch_reference, assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id, run_cli)

HERE = Path(__file__).parent
IDS = ["tokenformer", "blt", "itransformer", "flowdit", "coatnet"]
TOKENFORMER, BLT, ITRANS, FLOWDIT, COATNET = ALL = [str(HERE / f"heldout_{n}.py") for n in IDS]
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (TOKENFORMER, {}, "model:2", "ptok:model"),                   # param tokens split: the L2 norm and out summed
    (BLT, {}, "model:3", "patches:model"),                        # 4 patches over 3 (one empty in a sample)
    (COATNET, {}, "model:3", "height:model"),                     # rows 8 over 3 through BN, depthwise, stride 2
]

SLOW_CASES = [
    (TOKENFORMER, {}, "model:4", "ptok:model"),                   # 6 param tokens over 4
    (TOKENFORMER, {}, "data:2", "batch:data"),
    (TOKENFORMER, {}, "model:2", "heads:model"),
    (TOKENFORMER, {}, "model:2", "ptok_ff:model; ptok:model; ptok_head:model"),
    (TOKENFORMER, {}, "model:3", "ptok:model; seq:model"),
    (TOKENFORMER, {}, "model:2", "seq:model"),
    (TOKENFORMER, {}, "data:2; model:2", "seq:data; ptok:model"),
    (TOKENFORMER, {}, "data:2", "batch:data; params.ptok:data"),
    (TOKENFORMER, {}, "stage:2; model:2", "layer:stage; ptok:model", PIPE),
    (TOKENFORMER, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (TOKENFORMER, {"remat": "selective"}, "model:2", "ptok:model"),
    (TOKENFORMER, {"remat": "full"}, "model:2", "seq:model"),
    (BLT, {}, "data:2", "batch:data"),
    (BLT, {}, "model:2", "heads:model; d_ff:model"),
    (BLT, {}, "model:2", "bytes:model"),                          # 9 bytes over 2
    (BLT, {}, "model:4", "bytes:model"),
    (BLT, {}, "model:3", "bytes:model; patches:model"),
    (BLT, {}, "model:3", "d_model:model"),
    (BLT, {}, "data:2; model:2", "bytes:data; patches:model"),
    (BLT, {}, "data:2", "batch:data; params.d_model:data"),
    (BLT, {}, "stage:2", "layer:stage", ZBH1),
    (BLT, {}, "stage:2; data:2; model:2", "layer:stage; batch:data; heads:model", PIPE),
    (BLT, {"remat": "selective"}, "data:2; model:2", "batch:data; patches:model"),
    (ITRANS, {}, "data:2", "batch:data"),
    (ITRANS, {}, "model:2", "heads:model; d_ff:model"),
    (ITRANS, {}, "model:2", "variate:model"),
    (ITRANS, {}, "model:4", "variate:model"),                     # 6 variates over 4
    (ITRANS, {}, "model:3", "time:model"),                        # the instance norm's mean and std over a split time
    (ITRANS, {}, "model:3", "horizon:model"),
    (ITRANS, {}, "model:3", "d_model:model"),
    (ITRANS, {}, "data:2; model:2", "variate:data; heads:model"),
    (ITRANS, {}, "data:2", "batch:data; params.d_model:data"),
    (ITRANS, {}, "stage:2", "layer:stage", {"microbatches": 4, "schedule": "1f1b"}),
    (ITRANS, {"remat": "full"}, "model:2", "variate:model"),
    (FLOWDIT, {}, "data:2", "batch:data"),
    (FLOWDIT, {}, "model:2", "heads:model; d_ff:model"),
    (FLOWDIT, {}, "model:2", "patches:model"),
    (FLOWDIT, {}, "model:2", "height:model"),                     # the patchify keeps the split (hp_wp)
    (FLOWDIT, {}, "model:3", "height:model"),
    (FLOWDIT, {}, "model:3", "patches:model"),
    (FLOWDIT, {}, "model:2", "d_model:model"),
    (FLOWDIT, {}, "model:4", "mod:model"),
    (FLOWDIT, {}, "model:2", "d_cond:model"),
    (FLOWDIT, {}, "data:2; model:2", "height:data; width:model"),
    (FLOWDIT, {}, "data:2", "batch:data; params.d_model:data"),
    (FLOWDIT, {}, "stage:2", "layer:stage", PIPE),
    (FLOWDIT, {"remat": "full"}, "model:2", "patches:model"),
    (COATNET, {}, "data:2", "batch:data"),
    (COATNET, {}, "model:2", "heads:model; d_ff:model"),
    (COATNET, {}, "model:2", "height:model"),
    (COATNET, {}, "model:3", "width:model"),
    (COATNET, {}, "data:2; model:2", "height:data; width:model"),
    (COATNET, {}, "model:2", "tokens:model"),
    (COATNET, {}, "model:3", "tokens:model"),
    (COATNET, {}, "model:3", "c_exp:model"),
    (COATNET, {}, "model:2", "rel_h:model"),
    (COATNET, {}, "data:2", "batch:data; params.d_model:data"),
    (COATNET, {}, "stage:2", "layer:stage", ZBH1),
    (COATNET, {"remat": "full"}, "model:2", "height:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("path", [pytest.param(p, marks=[] if p == BLT else pytest.mark.slow) for p in ALL], ids=IDS)
def test_the_model_is_its_torch_reference(path):
    """Each model written in plain torch (Pattention by matmuls and sdpa; segment means by
    scatter_add and a boolean cross-attention mask; instance norm by hand; a reshape/permute patchify;
    F.conv2d convs, training-mode batch norm and a meshgrid-indexed bias table) gives the DSL model's
    loss, and torch autograd (float64) its gradients."""
    assert_dense_is_its_torch_reference(path)


def test_blt_segment_means_cover_an_empty_patch():
    """The tiny feeds leave a patch with no bytes in some sample (md.where's zero branch is read),
    and every other patch id is monotone along the bytes."""
    pid = md.load_model(BLT, tiny=True).feeds(0)["patch_id"]
    assert bool((pid[:, 1:] >= pid[:, :-1]).all())
    assert any(len(torch.unique(row)) < 4 for row in pid)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,layout,kw", [
    ("data:2", "batch:data", {}),
    ("model:3", "height:model", {}),
    ("model:2", "c_exp:model", {}),
    ("stage:2", "layer:stage", PIPE),
])
def test_coatnet_running_statistics_match_dense(mesh, layout, kw):
    """The training step's new params, the three batch norms' running mean and variance among them
    (set from the whole batch's statistics), are the dense program's on each layout."""
    model = md.load_model(COATNET, tiny=True)
    outputs = model.train_step(0.1)
    assert {f"new/bn{i}_{s}" for i in range(3) for s in ("rm", "rv")} <= set(outputs)
    res = md.check(outputs, mesh, layout, model.feeds(0), **kw)
    assert res.ok, str(res)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (TOKENFORMER, "model:2", "ptok:model"),
    (BLT, "model:2", "patches:model"),
    (ITRANS, "model:2", "variate:model"),
    (FLOWDIT, "model:2", "height:model"),
    (COATNET, "model:2", "height:model"),
], ids=IDS)
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.parametrize("path,mesh,layout", [
    pytest.param(TOKENFORMER, "data:2; model:2", "batch:data; ptok:model", marks=pytest.mark.slow),
    pytest.param(BLT, "data:2; model:2", "batch:data; patches:model", marks=pytest.mark.slow),
    (ITRANS, "data:2; model:2", "batch:data; variate:model"),
    pytest.param(FLOWDIT, "data:2; model:2", "batch:data; heads:model; d_ff:model", marks=pytest.mark.slow),
    pytest.param(COATNET, "data:2; model:2", "batch:data; height:model", marks=pytest.mark.slow),
], ids=IDS)
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)


@pytest.mark.parametrize("mesh", ["model:2", "model:3"])
def test_an_affine_free_layer_norm_over_a_split_dim_allreduces_its_statistics(mesh):
    """flowdit's adaLN norms (md.layer_norm without scale or bias, the ``normalize`` op) under
    ``d_model:model`` gathered the activation for each norm and its backward; like the fused
    layer_norm they now join the row statistics in place (lowering/norms.py): the dense
    program's numbers, no gather of the activation, and fewer bytes than one gathered activation."""
    b, s, d, o = md.Dim("batch", 4), md.Dim("seq", 16), md.Dim("d_model", 10), md.Dim("d_out", 3)
    with md.Graph():
        x = md.input("x", [b, s, d])
        w = md.param("w", [d], scale=1.0)
        v = md.param("v", [d, o], fan_out=["d_out"])
        y = md.layer_norm(x * w, "d_model")                                 # no affine: `normalize`
        loss = md.reduce_mean(md.einsum("batch seq d_model, d_model d_out -> batch seq d_out", y, v) ** 2)
        outputs = {"loss": loss, **md.grad(loss, {"grad/w": w, "grad/v": v})}
    assert y.node.op.name == "normalize"
    feeds = {"x": torch.randn(4, 16, 10, generator=torch.Generator().manual_seed(0))}
    res = md.check(outputs, mesh, "d_model:model", feeds)      # 1e-4: split sums in another order
    assert res.ok, str(res)
    plan = md.compile(outputs, mesh, "d_model:model")
    # gathered: only each rank's two moments a row (lowering/norms.py), never the activation
    gathers = {st.op for st in plan.steps if st.is_collective and "gather" in st.kind}
    assert gathers <= {"combine_moments"}, gathers
    activation = 4 * 16 * 10 * 4                                  # bytes of x, fp32
    assert sum(t["bytes"] for t in plan.totals().values()) < activation, plan.totals()
