"""Held-out models of round 11a (written from the README and docs alone).

``tests/heldout_deberta.py`` (DeBERTa's disentangled attention: content-to-position and
position-to-content scores against a shared, log-bucketed relative position table, picked per
(query, key) by a one-hot contraction; a tied MLM head); ``tests/heldout_bigbird.py`` (BigBird's
block-sparse attention: blocks by a rearrange, a sliding window by rolls and a concat, a global
block and fixed random blocks by a constant one-hot selection, one softmax over both key sets,
the global block's dense rows joined back by a concat); ``tests/heldout_fnet.py`` (FNet: the real
part of a 2-D DFT as four einsums against cos/sin tables made from iotas and a constant; MLM and
NSP losses); ``tests/heldout_retro.py`` (a RETRO decoder: an extra input of retrieved neighbour
embeddings ``[batch, chunks, nbrs, nlen, d_model]`` encoded once before the stack, chunked
cross-attention by a shift, a rearrange into chunks and one softmax over ``nbrs`` and ``nlen``);
``tests/heldout_alibigpt.py`` (a GPT in dims ``B T C``: ALiBi slopes made in the graph, a
sliding causal window, a tied head, label smoothing as soft targets and a z-loss). Each runs under
data, Megatron, sequence (each seq-like dim: blocks, chunks, neighbours, frequencies, relative
buckets), FSDP, uneven 3-way, pipeline (1f1b, zbh1, interleaved:2) and remat layouts against the
dense program. Findings and fixes: /work/notes/heldout-11a.md.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id,
                      run_cli)

HERE = Path(__file__).parent
DEBERTA, BIGBIRD, FNET, RETRO, ALIBIGPT = (
    str(HERE / f"heldout_{n}.py") for n in ("deberta", "bigbird", "fnet", "retro", "alibigpt"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 4, "schedule": "interleaved:2"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (DEBERTA, {}, "model:3", "tok:model; key_tok:model"),                         # c2p / p2c picks over split dims
    (DEBERTA, {}, "data:2; model:2", "ex:data; heads:model; ffn:model"),
    (BIGBIRD, {}, "model:3", "blk:model"),                                        # rolls and the global concat
    (BIGBIRD, {}, "stage:2; model:2", "layer:stage; seq:model", ZBH1),
    (FNET, {}, "model:3", "tok:model"),                                           # the DFT's partial sums over tok
    (FNET, {}, "data:3", "ex:data; params.hid:data"),
    (RETRO, {}, "model:3", "nlen:model"),                                         # a softmax over [nbrs, nlen], split
    (RETRO, {}, "stage:2; model:3", "layer:stage; seq:model", PIPE),              # shift halos of clen - 1 rows
    (ALIBIGPT, {}, "model:3", "T:model"),
    (ALIBIGPT, {}, "data:2; model:2", "B:data; H:model; F:model"),
]

# more of the same kinds, with -m slow (the file keeps under 5 s on a quiet machine)
SLOW_CASES = [
    (DEBERTA, {}, "data:2", "ex:data"),
    (DEBERTA, {}, "model:3", "heads:model; ffn:model"),
    (DEBERTA, {}, "model:2", "rel:model"),
    (DEBERTA, {}, "model:3", "hid:model"),
    (DEBERTA, {}, "data:3", "ex:data; params.hid:data"),
    (DEBERTA, {}, "stage:2", "layer:stage", ZBH1),
    (DEBERTA, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (DEBERTA, {"remat": "full"}, "stage:2; model:2", "layer:stage; tok:model", PIPE),
    (DEBERTA, {"remat": "selective"}, "data:2; model:2", "ex:data; heads:model"),
    (BIGBIRD, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (BIGBIRD, {"heads": 3}, "model:3", "heads:model; d_ff:model"),
    (BIGBIRD, {}, "model:3", "seq:model"),
    (BIGBIRD, {}, "model:3", "kblk:model"),
    (BIGBIRD, {}, "model:2", "nbr:model"),
    (BIGBIRD, {}, "model:3", "win:model"),
    (BIGBIRD, {}, "data:3", "batch:data; params.d_model:data"),
    (BIGBIRD, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (BIGBIRD, {"remat": "full"}, "stage:2", "layer:stage", PIPE),
    (BIGBIRD, {"remat": "selective"}, "data:2; model:2", "batch:data; seq:model"),
    (BIGBIRD, {"window": "shift"}, "model:3", "kblk:model"),
    (BIGBIRD, {"window": "shift"}, "stage:2; model:2", "layer:stage; blk:model", PIPE),
    (FNET, {}, "data:2; model:2", "ex:data; inner:model"),
    (FNET, {}, "model:3", "ftok:model"),
    (FNET, {}, "model:3", "hid:model"),
    (FNET, {}, "model:2", "fhid:model"),
    (FNET, {}, "model:3", "vocab:model"),
    (FNET, {}, "stage:2; model:3", "layer:stage; tok:model", ZBH1),
    (FNET, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (FNET, {"remat": "full"}, "stage:2", "layer:stage", PIPE),
    (FNET, {"layers": 3}, "stage:3", "layer:stage", PIPE),
    (RETRO, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (RETRO, {"heads": 3}, "model:3", "heads:model"),
    (RETRO, {}, "model:3", "chunks:model"),
    (RETRO, {}, "model:3", "cpos:model"),
    (RETRO, {}, "model:2", "nbrs:model"),
    (RETRO, {"keys": "merged"}, "model:2", "nbrs:model"),
    (RETRO, {}, "data:3", "batch:data; params.d_model:data"),
    (RETRO, {}, "stage:2; model:2", "layer:stage; chunks:model", ZBH1),
    (RETRO, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (RETRO, {"remat": "selective"}, "data:2; model:2", "batch:data; seq:model"),
    (RETRO, {"cca_every": 2, "layers": 3}, "stage:2", "layer:stage", {**PIPE, "stage_layers": (2, 1)}),
    (RETRO, {"cca_every": 2, "layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (ALIBIGPT, {}, "model:3", "H:model; F:model"),
    (ALIBIGPT, {}, "model:3", "S:model"),
    (ALIBIGPT, {}, "model:3", "V:model"),
    (ALIBIGPT, {}, "model:3", "C:model"),
    (ALIBIGPT, {}, "data:3", "B:data; params.C:data"),
    (ALIBIGPT, {}, "stage:2; model:2", "L:stage; H:model", ZBH1),
    (ALIBIGPT, {"L": 4}, "stage:2", "L:stage", INTERLEAVED),
    (ALIBIGPT, {"remat": "full"}, "stage:2; model:3", "L:stage; T:model", PIPE),
    (ALIBIGPT, {"L": 3}, "stage:3", "L:stage", PIPE),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_the_models_index_math_is_the_references():
    """DeBERTa's log buckets made in the graph are its torch reference's; FNet's four einsums
    against the DFT tables are ``torch.fft.fft2(x).real``."""
    import importlib.util

    def load(path):
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    deberta, fnet = load(DEBERTA), load(FNET)
    for span, max_position, n in [(4, 12, 12), (8, 32, 40)]:
        with md.Graph():
            b = deberta.log_buckets(md.arange(md.Dim("tok", n)) - md.arange(md.Dim("key_tok", n)), span, max_position)
        assert torch.equal(md.run_dense({"b": b})["b"], deberta.log_buckets_torch(n, span, max_position))
    x = torch.randn(2, 12, 10, generator=torch.Generator().manual_seed(0))
    (ct, st), (ch, sh) = fnet.dft_tables_torch(12), fnet.dft_tables_torch(10)
    re = torch.einsum("etf,tu->euf", x @ ch, ct) - torch.einsum("etf,tu->euf", x @ sh, st)
    # fp32 sums of 10 and then 12 terms of size ~1: ~1e-6 off; an index off by one is O(1) off
    torch.testing.assert_close(re, torch.fft.fft2(x).real, rtol=0, atol=1e-4)


def test_the_models_other_forms_compute_the_same_thing():
    """RETRO's one softmax over ``[nbrs, nlen]`` and over one merged ``(nbrs nlen)`` dim, and
    BigBird's window by rolls (the wrapped ends masked) and by zero-filled shifts, give the same loss."""
    def loss(path, **over):
        m = md.load_model(path, tiny=True, **over)
        return float(md.run_dense({"l": m.loss}, m.feeds(0))["l"])

    # the same sums in another order: fp32 rounding, ~1e-7 relative
    assert loss(RETRO, keys="merged") == pytest.approx(loss(RETRO), rel=1e-5)
    assert loss(BIGBIRD, window="shift") == pytest.approx(loss(BIGBIRD), rel=1e-5)


@pytest.mark.parametrize("mesh, layout", [("model:3", "nlen:model"), ("x:2; y:3", "nbrs:x; nlen:y")])
def test_a_softmax_over_several_dims_matches_torch_on_any_split(mesh, layout):
    """``md.softmax(x, ["nbrs", "nlen"])`` normalises over both dims at once, as ``md.log_softmax``
    and ``md.logsumexp`` already took a list; it said "dim '['nbrs', 'nlen']' is not a dim". Its
    value and gradient are torch's over the flattened dims, and a split of either stays split."""
    q_, n_, l_ = md.Dim("q", 3), md.Dim("nbrs", 2), md.Dim("nlen", 6)
    x0 = torch.randn(3, 2, 6, generator=torch.Generator().manual_seed(0))
    t0 = torch.randn(3, 2, 6, generator=torch.Generator().manual_seed(1))
    with md.Graph():
        x = md.param("x", [q_, n_, l_])
        t = md.input("t", [q_, n_, l_])
        p = md.softmax(x, ["nbrs", "nlen"])
        loss = md.reduce_sum(p * t)
        outs = {"p": p, "loss": loss, **md.grad(loss, {"grad/x": x})}
    xt = x0.clone().requires_grad_(True)
    want_p = torch.softmax(xt.reshape(3, 12), -1).reshape(3, 2, 6)
    (want_g,) = torch.autograd.grad((want_p * t0).sum(), xt)
    plan = md.compile(outs, mesh, layout)
    moved = [(st.kind, st.label) for st in plan.steps if st.kind in ("allgather", "alltoall")]
    assert not moved, moved    # only the max and the sum (and the loss) are allreduced
    got = md.run_simulated(plan, {"t": t0}, params={"x": x0})
    # fp32 softmax over 12 terms, in another order: ~1e-7
    torch.testing.assert_close(got["p"], want_p.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["grad/x"], want_g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_a_norm_over_several_dims_names_the_rule(op):
    """A norm takes one dim; a list of two said "dim '['a', 'b']' is not a dim of ...", which reads
    as a typo. It now says the op normalises over one dim and how to merge them."""
    with md.Graph():
        x = md.input("x", [md.Dim("a", 2), md.Dim("b", 3)])
        with pytest.raises(md.ShapeError, match=rf"(?s){op}: normalises over one dim; got 2: \['a', 'b'\].*rearrange"):
            getattr(md, op)(x, ["a", "b"])


def test_a_z_loss_and_a_log_softmax_of_the_same_logits_share_one_logsumexp():
    """The GPT's smoothed cross-entropy reads ``md.log_softmax(logits)`` and its z-loss
    ``md.logsumexp(logits)``: two identical logsumexps, whose max and sum were each allreduced
    under ``V:model`` (4 allreduces where 2 do). An elementwise op or a reduction of the same
    tensors with the same attrs is now built once, and the numbers are the dense program's."""
    b, v = md.Dim("B", 4), md.Dim("V", 6)
    with md.Graph():
        w = md.param("w", [b, v], scale=1.0)
        y = md.input("y", [b], dtype=torch.int64)
        soft = md.one_hot(y, v) * 0.9 + 0.1 / 6
        z = md.logsumexp(w, "V")
        loss = md.reduce_mean(-md.einsum("B V, B V -> B", soft, md.log_softmax(w, "V")) + 1e-2 * z * z)
        outs = {"loss": loss, **md.grad(loss, {"grad/w": w})}
    plan = md.compile(outs, "model:3", "V:model")
    fwd = [s.label for s in plan.steps if s.kind == "allreduce" and s.phase == "forward"]
    assert sorted(fwd) == ["log", "reduce_max", "reduce_mean"], fwd   # the max, the sum, the loss's mean
    feeds = {"y": torch.tensor([0, 5, 2, 3])}
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k in want:
        # sums over 3 ranks' vocab parts in another order: fp32 rounding, ~1e-7 relative
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_sampling_from_a_model_of_a_small_vocab_names_its_own_config_field():
    """``md.generate`` on the ``B T C`` GPT (its Config calls the vocab ``V``) at its tiny vocab
    of 32: the fix said ``--config vocab=256``, a field that Config lacks. It names ``V``; with
    ``V=256`` the tied head samples text."""
    model = md.load_model(ALIBIGPT, tiny=True)
    params = {k: md.run_dense({k: t})[k] for k, t in model.params.items()}
    with pytest.raises(md.ModelError, match=r"build the model with V=256 \(--config V=256\)"):
        md.generate(model, params, "ab", max_new_tokens=2)
    model = md.load_model(ALIBIGPT, tiny=True, V=256)
    params = {k: md.run_dense({k: t})[k] for k, t in model.params.items()}
    assert len(md.generate(model, params, "ab", max_new_tokens=3, temperature=0).encode("utf-8", "replace")) >= 1


def test_the_cli_checks_the_retro_decoder_pipelined_with_split_chunks(capsys):
    """``meshdsl check`` on the RETRO model file, the layers pipelined and the chunks split."""
    code, out, err = run_cli(capsys, ["check", RETRO, "--tiny", "--mesh", "stage:2; model:3", "--layout",
                                      "layer:stage; chunks:model", "--microbatches", "2", "--schedule", "1f1b"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
def test_the_cli_trains_the_retro_decoder_on_its_own_batches(capsys, tmp_path):
    """``meshdsl train`` on RETRO: its ``batches=`` make the retrieved neighbours that text would
    not, and the loss of 3 zbh1-pipelined steps is finite."""
    code, out, err = run_cli(capsys, ["train", RETRO, "--tiny", "--steps", "3", "--mesh", "stage:2; model:2",
                                      "--layout", "layer:stage; chunks:model", "--microbatches", "2", "--schedule",
                                      "zbh1", "--samples", "0", "--out", str(tmp_path / "o")])
    assert code == 0, out + err
    row = [ln for ln in out.splitlines() if "final train loss" in ln][0]
    assert math.isfinite(float(row.split("│")[-2])), row


# each search takes 4-15 s on a quiet machine: with -m slow
@pytest.mark.slow
@pytest.mark.parametrize("path", [DEBERTA, BIGBIRD, FNET, RETRO, ALIBIGPT],
                         ids=["deberta", "bigbird", "fnet", "retro", "alibigpt"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
