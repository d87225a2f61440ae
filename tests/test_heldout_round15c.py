"""Held-out models of round 15c (written from the README and docs alone): a prefix LM, factorized
sparse attention, a spatial gating MLP, a protein masked LM and a block-recurrent transformer.

``tests/heldout_paligemma.py`` (PaliGemma-style prefix LM: image patch tokens and a text prefix
attend bidirectionally, the suffix causally, by a composite masked attention; the loss on the
suffix only; a fixed or per-example (``ragged``) prefix length); ``tests/heldout_sparsetf.py``
(Sparse Transformer: the ``fixed`` block-local + summary-column pattern or the ``strided`` one, as
masks from ``md.arange``, ``//`` and ``%``); ``tests/heldout_gmlp.py`` (gMLP: a spatial gating unit
whose causal ``[seq2, seq]`` token-mixing weight meets the activations along ``seq``);
``tests/heldout_esm.py`` (ESM-2: rotary embeddings, pre-LN encoder, masked-LM loss on the masked
positions only, tied or untied head); ``tests/heldout_brt.py`` (Block-Recurrent Transformer: one
``md.repeat`` over segments carrying a ``[batch, state, d_model]`` state, updated by gated
cross-attention, fixed or LSTM gates). Each under data, Megatron, sequence / feature splits (2-way,
uneven 3-way), FSDP, 1f1b / zbh1 / interleaved:2 pipelines, remat, against the dense program; two
AdamW steps; the layout search's top 3; one gloo case each. Findings: /work/notes/heldout-15c.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense,
                      assert_steps_track_dense, heldout_case_id, run_cli)

HERE = Path(__file__).parent
PALI, SPARSE, GMLP, ESM, BRT = (str(HERE / f"heldout_{n}.py") for n in ("paligemma", "sparsetf", "gmlp", "esm", "brt"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
RAGGED, STRIDED, SEPARATE, UNTIED, LSTM = ({"form": "ragged"}, {"form": "strided"}, {"form": "separate"},
                                          {"form": "untied"}, {"form": "lstm"})

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (PALI, RAGGED, "model:3", "seq:model"),                   # per-example prefix mask, uneven split
    (GMLP, {}, "model:2", "seq:model"),                       # a sequence split meets the mixing weight
    (BRT, {}, "stage:2", "segment:stage", PIPE),              # the recurrent state sent stage to stage
]

# more of the same kinds, with -m slow
SLOW_CASES = [
    (PALI, {}, "data:2", "batch:data"),
    (PALI, {}, "model:2", "heads:model; d_ff:model"),
    (PALI, {}, "model:2", "seq:model"),
    (PALI, RAGGED, "model:3", "d_ff:model"),
    (PALI, {}, "model:2", "text:model"),
    (PALI, {}, "model:2", "d_model:model"),
    (PALI, RAGGED, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (PALI, {}, "data:2", "batch:data; params.d_model:data"),
    (PALI, {}, "stage:2", "layer:stage", PIPE),
    (PALI, RAGGED, "stage:2", "layer:stage", ZBH1),
    (PALI, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (PALI, {"remat": "full"}, "stage:2; model:2", "layer:stage; heads:model", PIPE),
    (PALI, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (PALI, {}, "data:3", "batch:data"),
    (SPARSE, {}, "data:2", "batch:data"),
    (SPARSE, STRIDED, "model:2", "heads:model; d_ff:model"),
    (SPARSE, {}, "model:2", "seq:model"),
    (SPARSE, STRIDED, "model:4", "seq:model"),
    (SPARSE, {"seq": 11}, "model:3", "seq:model"),
    (SPARSE, {}, "model:3", "d_ff:model"),
    (SPARSE, {}, "model:2", "key_seq:model"),
    (SPARSE, {}, "data:2; model:2", "batch:data; seq:model"),
    (SPARSE, {}, "data:2", "batch:data; params.d_model:data"),
    (SPARSE, {}, "stage:2", "layer:stage", PIPE),
    (SPARSE, STRIDED, "stage:2", "layer:stage", ZBH1),
    (SPARSE, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (SPARSE, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (SPARSE, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (GMLP, {}, "data:2", "batch:data"),
    (GMLP, {}, "model:2", "d_sgu:model"),
    (GMLP, SEPARATE, "model:2", "d_sgu:model"),
    (GMLP, SEPARATE, "model:3", "seq:model"),
    (GMLP, {}, "model:2", "seq2:model"),
    (GMLP, {}, "data:2; model:2", "seq:data; seq2:model"),
    (GMLP, {}, "model:3", "d_sgu:model"),
    (GMLP, {}, "data:2; model:2", "batch:data; seq:model"),
    (GMLP, {}, "data:2", "batch:data; params.d_model:data"),
    (GMLP, {}, "stage:2", "layer:stage", PIPE),
    (GMLP, SEPARATE, "stage:2", "layer:stage", ZBH1),
    (GMLP, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (GMLP, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (GMLP, {"remat": "selective"}, "model:2", "d_sgu:model"),
    (ESM, {}, "data:2", "batch:data"),
    (ESM, UNTIED, "model:2", "heads:model; d_ff:model"),
    (ESM, {}, "model:2", "seq:model"),
    (ESM, UNTIED, "model:3", "seq:model"),
    (ESM, {}, "model:2", "vocab:model"),
    (ESM, {}, "model:3", "d_ff:model"),
    (ESM, {}, "model:2", "half:model"),
    (ESM, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (ESM, UNTIED, "data:2", "batch:data; params.d_model:data"),
    (ESM, {}, "stage:2", "layer:stage", PIPE),
    (ESM, UNTIED, "stage:2", "layer:stage", ZBH1),
    (ESM, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (ESM, {"remat": "full"}, "stage:2; model:2", "layer:stage; heads:model", PIPE),
    (ESM, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (BRT, {}, "data:2", "batch:data"),
    (BRT, LSTM, "model:2", "heads:model; d_ff:model"),
    (BRT, {}, "model:2", "tok:model"),
    (BRT, LSTM, "model:3", "tok:model"),
    (BRT, {}, "model:2", "state:model"),
    (BRT, {}, "model:3", "d_ff:model"),
    (BRT, {"head": "after"}, "model:2", "tok:model"),
    (BRT, {"head": "after"}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (BRT, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (BRT, LSTM, "data:2", "batch:data; params.d_model:data"),
    (BRT, LSTM, "stage:2", "segment:stage", ZBH1),
    (BRT, {"segments": 4}, "stage:2", "segment:stage", INTERLEAVED),
    (BRT, {"remat": "full"}, "stage:2; model:2", "segment:stage; heads:model", PIPE),
    (BRT, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (BRT, {}, "stage:4", "segment:stage", {"microbatches": 4, "schedule": "1f1b"}),
    (BRT, {"segments": 5}, "stage:2", "segment:stage", {"microbatches": 2, "schedule": "1f1b", "stage_layers": [3, 2]}),
    (SPARSE, {"seq": 13}, "model:4", "seq:model"),
    (ESM, {}, "data:2; model:2", "seq:data; vocab:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _load(path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _brute_sparse_mask(n: int, stride: int, summary: int, form: str) -> torch.Tensor:
    """The Sparse Transformer's patterns by the paper's definitions, one (query, key) pair at a time."""
    keep = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            if form == "fixed":
                keep[i, j] = i // stride == j // stride or j % stride >= stride - summary
            else:
                keep[i, j] = i - j < stride or (i - j) % stride == 0
    return keep


@pytest.mark.parametrize("form", ["fixed", "strided"])
def test_sparse_masks_are_the_papers_patterns(form):
    """The masks built from ``md.arange``, ``//``, ``%`` and the comparisons are Child et al.'s
    patterns (a check of the model, not of a layout: the layout cases compare against it)."""
    mod = _load(SPARSE)
    cfg = mod.Config(seq=11, stride=4, summary=2, form=form)
    S, K = md.Dim("seq", 11), md.Dim("key_seq", 11)
    with md.Graph():
        keep = mod.sparse_mask(S, K, cfg)
        got = md.run_dense({"keep": keep})["keep"]
    assert torch.equal(got, _brute_sparse_mask(11, 4, 2, form))


def test_esm_rotary_is_rotate_half():
    """ESM's rotary embedding, written with slices and a concat over ``half``, is the reference
    ``x cos + rotate_half(x) sin`` (cos, sin repeated over both halves)."""
    mod = _load(ESM)
    s_, e_ = 6, 8
    S, E, R = md.Dim("seq", s_), md.Dim("d_head", e_), md.Dim("half", e_ // 2)
    x = torch.randn(s_, e_, generator=torch.Generator().manual_seed(0))
    inv = 1.0 / 10000 ** (torch.arange(0, e_, 2) / e_)
    with md.Graph():
        angles = md.arange(S, torch.float32) * md.constant(inv, [R])
        got = md.run_dense({"y": mod.rotate(md.constant(x, [S, E]), md.cos(angles), md.sin(angles), "seq")})["y"]
    ang = torch.arange(s_)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    want = x * cos + torch.cat([-x[:, e_ // 2:], x[:, :e_ // 2]], -1) * sin
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)   # fp32 products of O(1) values


def _adamw_step(model, mesh, layout, **kw):
    from meshdsl.comm.simulated import SimulatedComm
    mesh = md.Mesh.parse(mesh) if mesh else md.Mesh(())
    return md.TrainStep(model.loss, model.params, mesh, layout, SimulatedComm(mesh), optimizer=md.AdamW(lr=0.01), **kw)


@pytest.mark.slow
@pytest.mark.parametrize("path, over, mesh, layout, kw", [
    (PALI, RAGGED, "stage:2; model:2", "layer:stage; heads:model", PIPE),
    (SPARSE, {}, "data:2; model:2", "batch:data; seq:model", {}),
    (GMLP, {}, "stage:2", "layer:stage", ZBH1),
    (ESM, UNTIED, "data:2", "batch:data; params.d_model:data", {}),
    (BRT, LSTM, "stage:2", "segment:stage", PIPE),
], ids=["paligemma", "sparsetf", "gmlp", "esm", "brt"])
def test_two_adamw_steps_track_the_dense_program(path, over, mesh, layout, kw, one_torch_thread):
    """Two AdamW steps: the losses and then every param match the dense program's (a param whose
    update lands on the wrong rank or stage shows only after a step)."""
    model = md.load_model(path, tiny=True, **over)
    dense, step = _adamw_step(model, "", None), _adamw_step(model, mesh, layout, **kw)
    # fp32, O(1) values: ranks, stages and micro-batches add the same terms in another order
    assert_steps_track_dense(step, dense, model, 1e-5, f"{Path(path).stem} {mesh} {layout}")


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (PALI, "model:2", "seq:model"),
    (SPARSE, "model:2", "seq:model"),
    (GMLP, "model:2", "seq:model"),
    (ESM, "model:2", "heads:model; d_ff:model"),
    (BRT, "model:2", "heads:model; d_ff:model"),
], ids=["paligemma", "sparsetf", "gmlp", "esm", "brt"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [PALI, SPARSE, GMLP, ESM, BRT], ids=["paligemma", "sparsetf", "gmlp", "esm", "brt"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
