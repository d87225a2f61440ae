"""A GPT-style decoder-only language model, nanoGPT-style, in named dims.

Dims (the legend for every tensor name below, e.g. ``x_bsd`` = [batch, seq, d_model]):
  b  batch     sequences in the batch
  s  seq       query positions
  k  key_seq   key positions (a second name for the positions, so that
               attention scores [seq, key_seq] can hold both)
  d  d_model   residual stream width
  h  heads     attention heads
  e  d_head    features per head
  f  d_ff      MLP hidden width
  v  vocab     token ids
  l  layer     blocks, stacked so that ``md.repeat`` scans over them

The model: token embedding (gather) + learned position embedding, ``layers``
pre-norm blocks (causal multi-head attention, then a gelu MLP) run by
``md.repeat``, a final norm, the LM head and the cross-entropy of the next
token.  Layouts stay out of this file.  Useful dims to split: ``batch`` (DP),
``heads`` and ``d_ff`` (Megatron TP), ``vocab`` (vocab-parallel head, with
``tied=False``), ``seq`` (sequence parallel), ``params.d_model`` (FSDP).
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
    heads: int = 8
    d_head: int = 32
    d_ff: int = 1024
    layers: int = 4
    seq: int = 64
    batch: int = 16
    dropout: float = 0.0
    norm: str = "layer"    # "layer" (LayerNorm with bias) or "rms" (RMSNorm)
    tied: bool = False     # share the token embedding with the LM head

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=4, d_head=2, d_ff=16, layers=2, seq=8, batch=4)


# The einsums of attention; k/v use 'key_seq' so scores can hold both positions.
PROJ = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
SCORES = "batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq"
MIX = "batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head"
OUT = "batch seq heads d_head, heads d_head d_model -> batch seq d_model"


def norm(x, cfg: Config, scale, bias=None):
    if cfg.norm == "rms":
        return md.rms_norm(x, "d_model", scale)
    return md.layer_norm(x, "d_model", scale, bias)


def drop(x, cfg: Config, seed: int):
    # The mask hashes the global element index, the seed and the layer, so
    # every layout drops the same elements.
    return md.dropout(x, cfg.dropout, seed) if cfg.dropout else x


def attention(z_bsd, p, cfg: Config):
    """Causal multi-head self-attention of the normed residual ``z_bsd``."""
    s = z_bsd.shape.get("seq")
    q_bshe = md.einsum(PROJ, z_bsd, p["wq"])
    k_bkhe = md.rename(md.einsum(PROJ, z_bsd, p["wk"]), seq="key_seq")
    v_bkhe = md.rename(md.einsum(PROJ, z_bsd, p["wv"]), seq="key_seq")
    if cfg.dropout:  # dropout on the probabilities needs them written out
        att_bhsk = md.einsum(SCORES, q_bshe, k_bkhe) * (cfg.d_head ** -0.5)
        att_bhsk = md.where(md.causal_mask(s, md.Dim("key_seq", s.size)), att_bhsk, -1e9)
        att_bhsk = drop(md.softmax(att_bhsk, "key_seq"), cfg, seed=1)
        y_bshe = md.einsum(MIX, att_bhsk, v_bkhe)
    else:  # the same math as one fused kernel (torch's flash attention), no score tensor
        y_bshe = md.attention(q_bshe, k_bkhe, v_bkhe, "seq", "key_seq", "d_head", causal=True)
    return md.einsum(OUT, y_bshe, p["wo"])


def mlp(z_bsd, p, cfg: Config):
    u_bsf = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", z_bsd, p["w_fc"]))
    return md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u_bsf, p["w_proj"])


def block(x_bsd, p, cfg: Config):
    """One pre-norm transformer block; ``p`` holds this layer's slice of each stacked param."""
    g = x_bsd.graph
    with g.scope("attn"):
        x_bsd = x_bsd + drop(attention(norm(x_bsd, cfg, p["ln1"], p.get("ln1_b")), p, cfg), cfg, seed=2)
    with g.scope("mlp"):
        return x_bsd + drop(mlp(norm(x_bsd, cfg, p["ln2"], p.get("ln2_b")), p, cfg), cfg, seed=3)


def build(cfg: Config = Config()) -> Model:
    """Build the model and its next-token cross-entropy loss."""
    if cfg.norm not in ("layer", "rms"):
        raise md.GraphError(f"transformer: Config.norm is {cfg.norm!r}; use 'layer' or 'rms'.")
    b, s = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, v, l = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)

    with md.Graph("transformer") as g:
        ids_bs = md.input("ids", [b, s], torch.int64)
        labels_bs = md.input("labels", [b, s], torch.int64)

        wte_vd = md.param("wte", [v, d], scale=0.02)
        wpe_sd = md.param("wpe", [s, d], scale=0.02)
        # Block params are stacked along 'layer'.  fan_out lists every dim that
        # is not an input feature, so each layer's init has std 1/sqrt(fan_in).
        blocks = {
            "ln1": md.param("ln1", [l, d], init="ones"),
            "wq": md.param("wq", [l, d, h, e], fan_out=[l, h, e]),
            "wk": md.param("wk", [l, d, h, e], fan_out=[l, h, e]),
            "wv": md.param("wv", [l, d, h, e], fan_out=[l, h, e]),
            "wo": md.param("wo", [l, h, e, d], fan_out=[l, d]),
            "ln2": md.param("ln2", [l, d], init="ones"),
            "w_fc": md.param("w_fc", [l, d, f], fan_out=[l, f]),
            "w_proj": md.param("w_proj", [l, f, d], fan_out=[l, d]),
        }
        if cfg.norm == "layer":
            blocks["ln1_b"] = md.param("ln1_b", [l, d], init="zeros")
            blocks["ln2_b"] = md.param("ln2_b", [l, d], init="zeros")
        lnf = md.param("lnf", [d], init="ones")
        lnf_b = md.param("lnf_b", [d], init="zeros") if cfg.norm == "layer" else None
        lm_head_vd = wte_vd if cfg.tied else md.param("lm_head", [v, d], fan_out=[v])

        x_bsd = drop(md.gather(wte_vd, ids_bs, "vocab") + wpe_sd, cfg, seed=0)
        x_bsd = md.repeat(lambda x, p: block(x, p, cfg), x_bsd, blocks, l)
        x_bsd = norm(x_bsd, cfg, lnf, lnf_b)
        logits_bsv = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x_bsd, lm_head_vd)
        loss = md.reduce_mean(md.cross_entropy(logits_bsv, labels_bs, "vocab"))

    params = {**{"wte": wte_vd, "wpe": wpe_sd}, **blocks, "lnf": lnf}
    if lnf_b is not None:
        params["lnf_b"] = lnf_b
    if not cfg.tied:
        params["lm_head"] = lm_head_vd

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        # Random tokens; the labels are the ids shifted by one (next-token prediction).
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return Model(g, loss, params, feeds, cfg, logits=logits_bsv)
