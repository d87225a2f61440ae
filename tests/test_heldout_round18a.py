"""Held-out models of round 18a (written from the README and docs alone): StyleGAN2-lite,
Conv-TasNet-lite, CenterNet-lite, an RSSM world model and Matryoshka representation learning.

``tests/heldout_stylegan.py`` (a mapping MLP, modulated 3x3 convs with weight demodulation and fed
noise under md.repeat, a small discriminator and the non-saturating loss or a regression; per-sample
weights by one einsum per tap, or input scaling around a plain conv); ``tests/heldout_tasnet.py``
(a strided conv encoder, a TCN of dilated depthwise convs with PReLU and a global or per-frame layer
norm, sigmoid masks, an einsum + overlap-add decoder and the SI-SNR loss with two-speaker PIT);
``tests/heldout_centernet.py`` (a conv backbone, the penalty-reduced focal loss against a fed
Gaussian heatmap, size/offset regression read at the centres by one-hot contractions or a mask);
``tests/heldout_rssm.py`` (a GRU state scanned over time, a Gaussian or straight-through
categorical latent from fed noise, reconstruction and KL balancing by stop_gradient);
``tests/heldout_matryoshka.py`` (nested slices of a split embedding, each with its own or a shared
sliced classifier). Each runs under data, Megatron, spatial/time/feature splits (2-way, uneven
3-way), FSDP, pipeline (1f1b, zbh1, interleaved:2) and remat layouts against the dense program.
Findings: /work/notes/heldout-18a.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import meshdsl as md
from conftest import (assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id,
                      run_cli)

HERE = Path(__file__).parent
STYLEGAN, TASNET, CENTERNET, RSSM, MRL = (
    str(HERE / f"heldout_{n}.py") for n in ("stylegan", "tasnet", "centernet", "rssm", "matryoshka"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
SCALED, REGRESS, CLN, MASK, CAT, SHARED = ({"form": "scaled"}, {"form": "scaled", "loss": "regress"}, {"norm": "cln"},
                                           {"gather": "mask"}, {"latent_kind": "cat"}, {"heads": "shared"})
NAMED = {"heads": "named"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (STYLEGAN, REGRESS, "data:3", "height:data"),            # demodulated conv over an uneven spatial split
    (TASNET, {}, "data:3", "frames:data"),                   # dilated depthwise convs + global norm, uneven
    (CENTERNET, {}, "model:4", "height:model"),              # one-hot gather of centres over a split height
    (RSSM, CAT, "model:3", "latent:model"),                  # straight-through categoricals, uneven latent
    (MRL, SHARED, "model:3", "embed:model"),                 # nested slices across an uneven split
]

SLOW_CASES = [
    (STYLEGAN, {}, "data:2", "batch:data"),
    (STYLEGAN, {}, "model:2", "channels:model"),
    (STYLEGAN, {}, "model:4", "channels:model"),
    (STYLEGAN, {}, "data:3", "height:data"),
    (STYLEGAN, {}, "model:3", "width:model"),
    (STYLEGAN, {}, "data:2; model:2", "batch:data; channels:model"),
    (STYLEGAN, {}, "data:2; model:3", "batch:data; height:model"),
    (STYLEGAN, {}, "data:2", "batch:data; params.channels:data"),
    (STYLEGAN, {}, "stage:2", "layer:stage", PIPE),
    (STYLEGAN, {}, "stage:2", "layer:stage", ZBH1),
    (STYLEGAN, {}, "stage:2", "layer:stage", INTERLEAVED),
    (STYLEGAN, {"remat": "full"}, "data:2", "height:data"),
    (STYLEGAN, {"remat": "selective"}, "model:3", "channels:model"),
    (STYLEGAN, REGRESS, "model:3", "channels:model"),
    (STYLEGAN, SCALED, "data:3", "height:data"),
    (STYLEGAN, REGRESS, "stage:2", "layer:stage", PIPE),
    (TASNET, {}, "data:2", "batch:data"),
    (TASNET, {}, "model:2", "channels:model"),
    (TASNET, {}, "model:3", "hidden:model"),
    (TASNET, {}, "model:3", "n_basis:model"),
    (TASNET, {}, "data:4", "time:data"),
    (TASNET, {}, "model:2", "spk:model"),
    (TASNET, {}, "data:2; model:3", "batch:data; frames:model"),
    (TASNET, {}, "data:2", "batch:data; params.hidden:data"),
    (TASNET, {}, "stage:2", "rep:stage", PIPE),
    (TASNET, {}, "stage:2", "rep:stage", ZBH1),
    (TASNET, {"repeats": 4}, "stage:2", "rep:stage", INTERLEAVED),
    (TASNET, {"remat": "full"}, "data:2", "frames:data"),
    (TASNET, {"remat": "selective"}, "stage:2", "rep:stage", PIPE),
    (TASNET, CLN, "data:3", "frames:data"),
    (TASNET, CLN, "model:3", "time:model"),
    (CENTERNET, {}, "data:2", "batch:data"),
    (CENTERNET, {}, "model:3", "classes:model"),
    (CENTERNET, {}, "model:2", "channels:model"),
    (CENTERNET, {}, "model:3", "width:model"),
    (CENTERNET, {}, "data:2; model:3", "batch:data; height:model"),
    (CENTERNET, {}, "data:2; model:2", "batch:data; classes:model"),
    (CENTERNET, {}, "data:2", "batch:data; params.channels:data"),
    (CENTERNET, {}, "stage:2", "layer:stage", PIPE),
    (CENTERNET, {}, "stage:2", "layer:stage", ZBH1),
    (CENTERNET, {}, "stage:2", "layer:stage", INTERLEAVED),
    (CENTERNET, {"remat": "full"}, "data:3", "height:data"),
    (CENTERNET, {"remat": "selective"}, "model:2", "classes:model"),
    (CENTERNET, MASK, "data:4", "height:data"),
    (CENTERNET, MASK, "data:2; model:2", "height:data; width:model"),
    (CENTERNET, MASK, "stage:2", "layer:stage", PIPE),
    (RSSM, {}, "data:2", "batch:data"),
    (RSSM, {}, "model:2", "hidden:model"),
    (RSSM, {}, "model:3", "hidden:model"),
    (RSSM, {}, "model:3", "latent:model"),
    (RSSM, {}, "model:2", "obs:model"),
    (RSSM, {}, "data:3", "batch:data"),
    (RSSM, {}, "data:2; model:2", "batch:data; hidden:model"),
    (RSSM, {}, "data:2", "batch:data; params.hidden:data"),
    (RSSM, {}, "stage:2", "time:stage", PIPE),
    (RSSM, {}, "stage:2", "time:stage", ZBH1),
    (RSSM, {"remat": "full"}, "data:2", "batch:data"),
    (RSSM, CAT, "model:3", "classes:model"),
    (RSSM, CAT, "model:2", "hidden:model"),
    (RSSM, CAT, "stage:2", "time:stage", PIPE),
    (RSSM, {**CAT, "remat": "full"}, "stage:2", "time:stage", ZBH1),
    (MRL, {}, "data:2", "batch:data"),
    (MRL, {}, "model:2", "embed:model"),
    (MRL, {}, "model:3", "d_ff:model"),
    (MRL, {}, "model:3", "classes:model"),
    (MRL, {}, "data:3", "batch:data"),
    (MRL, {}, "data:2; model:2", "batch:data; embed:model"),
    (MRL, {}, "data:2", "batch:data; params.embed:data"),
    (MRL, {}, "stage:2", "layer:stage", PIPE),
    (MRL, {}, "stage:2", "layer:stage", ZBH1),
    (MRL, {}, "stage:2", "layer:stage", INTERLEAVED),
    (MRL, NAMED, "stage:2", "layer:stage", PIPE),
    (MRL, {"remat": "full"}, "model:2", "embed:model"),
    (MRL, SHARED, "model:4", "embed:model"),
    (MRL, NAMED, "model:3", "embed:model"),
    (MRL, NAMED, "data:3", "batch:data; params.embed:data"),
    (MRL, SHARED, "data:3", "batch:data; params.embed:data"),
    (MRL, {**SHARED, "remat": "selective"}, "stage:2", "layer:stage", PIPE),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_a_narrow_head_under_a_split_embedding_is_refused_with_the_renaming_fix():
    """Matryoshka's 2-row head ``head2 [embed:2, classes]`` under ``embed:model`` on 3 ranks is refused
    (a param's part may not be empty), and the Fix names the way out that keeps ``embed`` split in the
    encoder: a dim name of its own for the head (``heads=named``, checked in SLOW_CASES), or the
    head's dim kept whole by a rule for that one tensor ('head2.embed:()', tests/test_layout_whole.py)."""
    model = md.load_model(MRL, tiny=True)
    with pytest.raises(md.LayoutError, match="too small to split unevenly") as info:
        md.compile({"loss": model.loss}, "model:3", "embed:model")
    assert "a name of its own" in str(info.value) and "Dim('embed_2', 2)" in str(info.value), str(info.value)


def test_a_cut_of_a_whole_value_is_not_gathered_again():
    """The RSSM's step reads its GRU state from the carry, held whole (no rule splits ``state``):
    the slice renamed to ``hidden`` is cut locally by ``hidden:model``, and the recurrent matmul
    renames it to ``hidden_in``, which the layout keeps whole. That read is the whole slice the
    rank already holds, not an allgather of the cut (it was one per step: 17 -> 13 allgathers on the
    tiny RSSM); the numbers stay the dense program's."""
    b, s, k, k2 = md.Dim("batch", 4), md.Dim("state", 6), md.Dim("hidden", 4), md.Dim("hidden_in", 4)
    with md.Graph():
        x, u = md.param("x", [b, s]), md.param("u", [k2, k])
        h = md.rename(md.slice_(x, "state", 0, 4), state="hidden")
        z = md.einsum("batch hidden_in, hidden_in hidden -> batch hidden", md.rename(h, hidden="hidden_in"), u) * h
        loss = md.reduce_sum(z * z)
        outputs = {"loss": loss, **md.grad(loss, {"x": x, "u": u})}
    plan = md.compile(outputs, "model:2", "hidden:model")
    gathers = [st for st in plan.steps if st.kind == "allgather" and st.phase == "forward"]
    assert not gathers, [(st.label, st.note) for st in gathers]
    assert md.check(outputs, "model:2", "hidden:model", {}).ok


def _dense(path, over):
    m = md.load_model(path, tiny=True, **over)
    return md.run_dense({"loss": m.loss, **md.grad(m.loss, m.params)}, m.feeds(0))


@pytest.mark.slow
@pytest.mark.parametrize("path,a,b", [(STYLEGAN, {}, SCALED), (CENTERNET, {}, MASK)], ids=["stylegan", "centernet"])
def test_the_two_forms_give_the_same_model(path, a, b):
    """StyleGAN's per-sample weights against input scaling around a plain conv, and CenterNet's
    one-hot gather against the mask: the same math, so the loss and every gradient agree (fp32
    rounding of reordered sums, ~1e-7 of each magnitude; a wrong tap or centre is off by O(1))."""
    want, got = _dense(path, a), _dense(path, b)
    for k in want:
        assert float((got[k] - want[k]).abs().max()) <= 1e-5 * float(want[k].abs().max()) + 1e-9, k


@pytest.mark.slow
@pytest.mark.parametrize("path,layout", [
    (STYLEGAN, "batch:data"), (TASNET, "frames:data"), (CENTERNET, "height:data"), (RSSM, "batch:data"),
    (MRL, "batch:data"),
], ids=["stylegan", "tasnet", "centernet", "rssm", "matryoshka"])
def test_the_cli_checks_each_model_on_two_real_processes(path, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", "data:2", "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [STYLEGAN, TASNET, CENTERNET, RSSM, MRL],
                         ids=["stylegan", "tasnet", "centernet", "rssm", "matryoshka"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (STYLEGAN, "data:2; model:2", "batch:data; channels:model"),
    (TASNET, "data:2; model:2", "params.hidden:data; frames:model"),
    (CENTERNET, "data:2; model:2", "batch:data; height:model"),
    (RSSM, "data:2; model:2", "batch:data; hidden:model"),
    (MRL, "data:2; model:2", "params.d_ff:data; embed:model"),
], ids=["stylegan", "tasnet", "centernet", "rssm", "matryoshka"])
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)
