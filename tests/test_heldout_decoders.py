"""Held-out decoder LMs (written from the README and docs alone) against the dense program.

``tests/heldout_llama3.py`` (grouped-query attention whose ``heads`` a rearrange cuts into
``kv_heads x group``, rotary tables computed in the graph, SwiGLU, RMSNorm, a tied head),
``tests/heldout_neox.py`` (parallel residual, partial rotary, LayerNorm and projections with
biases, einsum attention, an untied head) and ``tests/heldout_alibi.py`` (ALiBi, a sliding
window, a padding mask fed as an input and read inside ``md.repeat``, soft-capped logits, z-loss,
label smoothing), each ``Config.tiny()``, on a representative subset of the layouts they were
checked on by hand (data, tensor over heads / kv_heads / d_ff with uneven splits, FSDP,
sequence, vocab, pipelines under 1f1b / zbh1 / interleaved:2, remat, 2x2 meshes); the Llama-3
graph against the same model in plain torch.  Also the fixes they led to: ``meshdsl train`` on
text refuses an input that text does not make before any step; ``meshdsl check --optimizer
adamw|adafactor`` passes a model whose gradient is zero in exact math in part of a param (the
unrotated features of a key bias); ``md.cross_entropy`` refuses float labels when built.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import run_cli
from meshdsl.tools.compare import report_check

HERE = Path(__file__).parent
LLAMA, NEOX, ALIBI = (str(HERE / f"heldout_{n}.py") for n in ("llama3", "neox", "alibi"))

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (LLAMA, {}, "data:2; model:2", "batch:data; kv_heads:model; d_ff:model", {}),
    (LLAMA, {"heads": 6, "kv_heads": 3}, "model:2", "kv_heads:model; d_ff:model", {}),      # kv_heads 3 over 2
    (LLAMA, {}, "model:3", "heads:model; d_ff:model", {}),     # 4 heads over 3, cut again into kv_heads x group
    (LLAMA, {"rope_inputs": True}, "data:2", "batch:data; params.d_model:data", {}),   # cos/sin fed
    (LLAMA, {}, "model:2", "seq:model; key_seq:model", {"remat": "selective"}),
    (LLAMA, {}, "data:2; model:2", "batch:data; vocab:model", {}),
    (LLAMA, {"layers": 4}, "stage:2; model:2", "layer:stage; kv_heads:model; d_ff:model",
     {"microbatches": 2, "schedule": "interleaved:2"}),
    (NEOX, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model", {}),
    (NEOX, {"d_head": 8, "rotary": 4}, "model:2", "d_head:model", {}),
    (NEOX, {}, "stage:2; model:2", "layer:stage; heads:model; d_ff:model",
     {"microbatches": 2, "schedule": "zbh1", "remat": "full"}),
    (ALIBI, {}, "stage:2; data:2", "layer:stage; batch:data", {"microbatches": 2, "schedule": "1f1b"}),
    (ALIBI, {}, "data:2; model:2", "batch:data; seq:model", {"remat": "selective"}),
    (ALIBI, {}, "model:2", "d_head:model", {}),
    (ALIBI, {"masked_loss": True}, "data:2", "batch:data", {"microbatches": 2}),   # sum(l * keep) / sum(keep)
]


def _id(case) -> str:
    path, over, mesh, layout, kw = case
    extra = [*(f"{k}={v}" for k, v in over.items()), *map(str, kw.values())]
    return f"{Path(path).stem}-{mesh}-{layout}-{'-'.join(extra)}".replace(" ", "")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_heldout_decoder_matches_dense(case):
    path, over, mesh, layout, kw = case
    model = md.load_model(path, tiny=True, **over)
    kw = dict(kw)
    remat = kw.pop("remat", None)
    outputs = {"loss": model.loss, **{f"grad/{k}": g for k, g in md.grad(model.loss, model.params, remat=remat).items()}}
    feeds = model.feeds(0)
    want = md.run_dense(outputs, feeds)
    got = md.run_simulated(md.compile(outputs, mesh, layout, **kw), feeds)
    top = max(w.abs().max().item() for k, w in want.items() if k.startswith("grad/"))
    for k, w in want.items():
        # fp32 sums split over ranks add in another order: ~n * 2**-24 of the magnitudes summed,
        # far below 1e-4 of them; a gradient's rounding is at the scale of the largest gradient
        # (the activation gradients summed into every weight gradient are the same ones).
        scale = w.abs().max().item() if k == "loss" else top
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-4 * scale, msg=f"{_id(case)}: {k}")


def test_text_training_refuses_an_input_text_does_not_make_before_any_step():
    model = md.load_model(ALIBI, tiny=True, vocab=256)
    tokens = md.TokenData(torch.arange(4096) % 256)
    with pytest.raises(md.MeshDSLError, match=r"also reads input 'keep', which text does not make") as e:
        md.fit(model, mesh="data:1", steps=1, data=tokens)
    assert "batches=" in str(e.value)   # the fix names the model's own batches


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_check_passes_a_param_whose_gradient_is_zero_in_exact_math_in_part(capsys, optimizer):
    # The key bias's features that no rotary embedding turns add the same q.b_k to every key's
    # score: the softmax cancels it, their gradient is rounding noise, and an adaptive first step
    # there is lr * sign(noise) on either side (differences of ~lr); Adafactor's clipping by the
    # update's RMS carries that into the param's other elements.
    rc, out, err = run_cli(capsys, ["check", NEOX, "--tiny", "--mesh", "data:2", "--layout", "batch:data",
                                    "--optimizer", optimizer])
    assert rc == 0, out + err
    assert "note: new/bk:" in out and "within its allowance of zero" in out


def test_check_still_fails_an_update_off_where_the_gradient_is_not_noise(capsys):
    grad = torch.tensor([1.0, 1e-9])                # the second element: rounding noise
    want = {"loss": torch.tensor(1.0), "new/w": torch.tensor([0.5, 0.5])}
    noise_only = {"loss": torch.tensor(1.0), "new/w": torch.tensor([0.5, 0.6])}
    real = {"loss": torch.tensor(1.0), "new/w": torch.tensor([0.6, 0.5])}
    assert report_check(want, noise_only, 1e-4, "t", grads={"grad/w": grad}) == 0
    assert report_check(want, real, 1e-4, "t", grads={"grad/w": grad}) == 1
    assert report_check(want, noise_only, 1e-4, "t") == 1    # no gradient known: every element counts
    both = {"loss": torch.tensor(1.0), "new/w": torch.tensor([0.6, 0.6])}
    assert report_check(want, both, 1e-4, "t", grads={"grad/w": grad}) == 1
    # coupled (Adafactor): a param whose noise elements moved is not counted at all ...
    assert report_check(want, both, 1e-4, "t", grads={"grad/w": grad}, coupled=True) == 0
    # ... but one whose noise elements agree still is
    assert report_check(want, real, 1e-4, "t", grads={"grad/w": grad}, coupled=True) == 1


def test_rotary_tables_computed_in_the_graph_are_those_fed_as_inputs():
    # The same params (the init depends on the name only) and tokens: the loss of the graph that
    # computes cos/sin from md.arange matches the one fed torch's tables, to fp32 rounding of sin/cos.
    computed, fed = (md.load_model(LLAMA, tiny=True, rope_inputs=r) for r in (False, True))
    want = md.run_dense({"loss": computed.loss}, computed.feeds(0))["loss"]
    got = md.run_dense({"loss": fed.loss}, fed.feeds(0))["loss"]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def _llama_in_torch(p: dict, ids: torch.Tensor, labels: torch.Tensor, cfg) -> torch.Tensor:
    """The Llama-3 loss written in plain torch (layers unrolled, GQA by repeat_interleave)."""
    import torch.nn.functional as F
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    half = cfg.d_head // 2
    angles = torch.arange(cfg.seq, dtype=torch.float32)[:, None] * cfg.rope_theta ** (-torch.arange(half) / half)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]              # [seq, 1, half]
    rope = lambda t: torch.cat([t[..., :half] * cos - t[..., half:] * sin, t[..., half:] * cos + t[..., :half] * sin], -1)
    x = p["wte"][ids]
    for i in range(cfg.layers):
        h = rms(x, p["attn_norm"][i])
        q = rope(torch.einsum("bsd,dhe->bshe", h, p["wq"][i]))
        k = rope(torch.einsum("bsd,dhe->bshe", h, p["wk"][i]))
        v = torch.einsum("bsd,dhe->bshe", h, p["wv"][i])
        group = cfg.heads // cfg.kv_heads
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))           # query head h reads kv head h // group
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
        x = x + torch.einsum("bshe,hed->bsd", o, p["wo"][i])
        h = rms(x, p["mlp_norm"][i])
        x = x + (F.silu(h @ p["w_gate"][i]) * (h @ p["w_up"][i])) @ p["w_down"][i]
    logits = rms(x, p["norm_f"]) @ p["wte"].T
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), labels.reshape(-1))


def test_the_llama3_graph_is_the_llama3_of_plain_torch():
    # The held-out model means what a Llama-3 means: grouped heads (kv head of query head h is
    # h // group, as the rearrange "(kv_heads group)" cuts them), rotate-half RoPE, a tied head.
    model = md.load_model(LLAMA, tiny=True)
    feeds = model.feeds(0)
    got = md.run_dense({"loss": model.loss, **model.params}, feeds)
    want = _llama_in_torch(got, feeds["ids"], feeds["labels"], model.config)
    # two fp32 programs whose kernels sum in different orders: rounding of a few ulps of the loss
    torch.testing.assert_close(got["loss"], want, rtol=1e-5, atol=0)


def test_cross_entropy_refuses_float_labels_when_the_graph_is_built():
    # Before: built without complaint, then torch's "gather(): Expected dtype int32/int64 for
    # index" as an internal traceback when the graph ran.
    b, v = md.Dim("batch", 2), md.Dim("vocab", 5)
    with md.Graph():
        logits, labels = md.param("logits", [b, v]), md.input("labels", [b])
        with pytest.raises(md.ShapeError, match=r"cross_entropy: labels .* are torch.float32[\s\S]*Fix: make them torch.int64"):
            md.cross_entropy(logits, labels, "vocab")
