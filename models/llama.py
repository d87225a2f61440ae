"""A Llama-style decoder-only language model in named dims.

Dims (the legend for every tensor name below, e.g. ``q_bsnge`` = [batch, seq, kv_heads, group, d_head]):
  b  batch     sequences in the batch
  s  seq       query positions
  k  key_seq   key positions (a second name for the positions, so that
               attention can hold both)
  d  d_model   residual stream width
  n  kv_heads  key/value heads
  g  group     query heads per key/value head (grouped-query attention:
               ``kv_heads * group`` query heads, ``group`` of them reading
               each key/value head)
  e  d_head    features per head, read as (two half) by the rotary embedding
  t  two       the two halves of d_head that a rotation turns into each other
  h  half      rotary frequencies, d_head / 2 of them
  f  d_ff      SwiGLU hidden width
  v  vocab     token ids
  l  layer     blocks, stacked so that ``md.repeat`` scans over them

The model: token embedding (gather), ``layers`` pre-norm blocks run by
``md.repeat`` (RMSNorm; causal grouped-query attention with rotary position
embeddings on q and k; RMSNorm; a SwiGLU MLP, ``(silu(z w_gate) * z w_up) w_down``),
a final RMSNorm, an untied LM head and the cross-entropy of the next token.
There is no learned position embedding: q and k are rotated by angles
``position * theta ** (-2i / d_head)``, in the rotate-half form (feature ``i`` of
the first half pairs with feature ``i`` of the second).  The angle tables are
computed in the graph (``md.arange``, a constant of inverse frequencies,
``md.cos``/``md.sin``) once, outside the stack; every block reads them (a
closure of ``md.repeat``).  Layouts stay out of this file.

Layout families (examples):
  DP        ``batch:data``
  Megatron  ``kv_heads:model; d_ff:model`` (each rank its key/value heads with their
            query groups, and its slice of the MLP; one allreduce after each)
  FSDP      ``batch:data; params.d_model:data``
  pipeline  ``layer:stage`` (with ``--microbatches`` and ``--schedule``)
Also ``group:model`` (query heads split inside a key/value head), ``seq:model``
(sequence parallel) and ``vocab:model`` (a vocab-parallel head).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md
from meshdsl import Model


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 256
    kv_heads: int = 4
    group: int = 2           # query heads per key/value head: 8 query heads
    d_head: int = 32
    d_ff: int = 768          # Llama's rule: 2/3 of 4 * d_model, rounded up to a multiple of 256
    layers: int = 4
    seq: int = 64
    batch: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, kv_heads=2, group=2, d_head=4, d_ff=16, layers=2, seq=8, batch=4)


Q_PROJ = "batch seq d_model, d_model kv_heads group d_head -> batch seq kv_heads group d_head"
KV_PROJ = "batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head"
OUT = "batch seq kv_heads group d_head, kv_heads group d_head d_model -> batch seq d_model"
UP = "batch seq d_model, d_model d_ff -> batch seq d_ff"
DOWN = "batch seq d_ff, d_ff d_model -> batch seq d_model"


def rotary_tables(cfg: Config, s: md.Dim, dtype: torch.dtype):
    """``(cos_sh, sin_sth)``: the rotation's cosines [seq, half], and its sines [seq, two, half]
    with the sign of each half (-sin for the first, +sin for the second)."""
    t, h = md.Dim("two", 2), md.Dim("half", cfg.d_head // 2)
    inv_freq_h = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.d_head, 2, dtype=torch.float64) / cfg.d_head)
    angles_sh = md.arange(s, dtype) * md.constant(inv_freq_h.to(dtype), [h])
    sign_t = md.constant(torch.tensor([-1.0, 1.0], dtype=dtype), [t])
    return md.cos(angles_sh), md.sin(angles_sh) * sign_t


def rotate(x, cos_sh, sin_sth):
    """``x`` (its last dim d_head) turned by each position's angles, in the rotate-half form:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for the halves x1, x2 of d_head."""
    names = " ".join(x.shape.names[:-1])
    halves = md.rearrange(x, f"{names} (two half) -> {names} two half", two=2)
    swapped = md.roll(halves, "two", 1)   # (x2, x1)
    return md.reshape(halves * cos_sh + swapped * sin_sth, x.shape)


def attention(z_bsd, p, rope):
    """Causal grouped-query attention of the normed residual ``z_bsd``, q and k rotated."""
    q_bsnge = rotate(md.einsum(Q_PROJ, z_bsd, p["wq"]), *rope)
    k_bkne = md.rename(rotate(md.einsum(KV_PROJ, z_bsd, p["wk"]), *rope), seq="key_seq")
    v_bkne = md.rename(md.einsum(KV_PROJ, z_bsd, p["wv"]), seq="key_seq")
    y_bsnge = md.attention(q_bsnge, k_bkne, v_bkne, "seq", "key_seq", "d_head", causal=True)
    return md.einsum(OUT, y_bsnge, p["wo"])


def mlp(z_bsd, p):
    """SwiGLU: ``(silu(z w_gate) * (z w_up)) w_down``."""
    u_bsf = md.silu(md.einsum(UP, z_bsd, p["w_gate"])) * md.einsum(UP, z_bsd, p["w_up"])
    return md.einsum(DOWN, u_bsf, p["w_down"])


def block(x_bsd, p, rope, cfg: Config):
    """One pre-norm block; ``p`` holds this layer's slice of each stacked param, ``rope`` the
    rotary tables made outside the stack."""
    g = x_bsd.graph
    with g.scope("attn"):
        x_bsd = x_bsd + attention(md.rms_norm(x_bsd, "d_model", p["attn_norm"], cfg.norm_eps), p, rope)
    with g.scope("mlp"):
        return x_bsd + mlp(md.rms_norm(x_bsd, "d_model", p["mlp_norm"], cfg.norm_eps), p)


def build(cfg: Config = Config()) -> Model:
    """Build the model and its next-token cross-entropy loss."""
    if cfg.d_head % 2:
        raise md.GraphError(md.errors.message(f"llama: Config.d_head is {cfg.d_head}, an odd number.",
                                    rule="the rotary embedding turns d_head's two halves into each other",
                                    fix=f"give an even d_head, e.g. --config d_head={cfg.d_head + 1}"))
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    n, gr, e = md.Dim("kv_heads", cfg.kv_heads), md.Dim("group", cfg.group), md.Dim("d_head", cfg.d_head)
    f, v, l = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)

    with md.Graph("llama") as g:
        ids_bs = md.input("ids", [b, s], torch.int64)
        labels_bs = md.input("labels", [b, s], torch.int64)

        tok_emb_vd = md.param("tok_emb", [v, d], scale=0.02)
        # Block params are stacked along 'layer'; fan_out lists every dim that is not an
        # input feature, so each layer's init has std 1/sqrt(fan_in).
        blocks = {
            "attn_norm": md.param("attn_norm", [l, d], init="ones"),
            "wq": md.param("wq", [l, d, n, gr, e], fan_out=[l, n, gr, e]),
            "wk": md.param("wk", [l, d, n, e], fan_out=[l, n, e]),
            "wv": md.param("wv", [l, d, n, e], fan_out=[l, n, e]),
            "wo": md.param("wo", [l, n, gr, e, d], fan_out=[l, d]),
            "mlp_norm": md.param("mlp_norm", [l, d], init="ones"),
            "w_gate": md.param("w_gate", [l, d, f], fan_out=[l, f]),
            "w_up": md.param("w_up", [l, d, f], fan_out=[l, f]),
            "w_down": md.param("w_down", [l, f, d], fan_out=[l, d]),
        }
        norm_d = md.param("norm", [d], init="ones")
        lm_head_vd = md.param("lm_head", [v, d], fan_out=[v])

        rope = rotary_tables(cfg, s, tok_emb_vd.dtype)   # once, read by every layer
        x_bsd = md.gather(tok_emb_vd, ids_bs, "vocab")
        x_bsd = md.repeat(lambda x, p: block(x, p, rope, cfg), x_bsd, blocks, l)
        x_bsd = md.rms_norm(x_bsd, "d_model", norm_d, cfg.norm_eps)
        logits_bsv = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x_bsd, lm_head_vd)
        loss = md.reduce_mean(md.cross_entropy(logits_bsv, labels_bs, "vocab"))

    params = {"tok_emb": tok_emb_vd, **blocks, "norm": norm_d, "lm_head": lm_head_vd}

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        # Random tokens; the labels are the ids shifted by one (next-token prediction).
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return Model(g, loss, params, feeds, cfg, logits=logits_bsv)
