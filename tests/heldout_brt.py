"""Held-out model: a Block-Recurrent Transformer (Hutchins et al. 2022), written from the docs alone.

The sequence is cut into ``segments`` of ``seg_len`` tokens. One recurrent layer runs per
segment under ``md.repeat`` over ``segment`` (the segments' token embeddings are the repeat's
stacked tensor, the carry is the recurrent state ``[batch, state, d_model]``, its start a
learned param). In each segment:

- the tokens attend (one composite attention) to the state's keys and causally to their own;
  then an MLP; the LM head reads the tokens' output (``head`` below);
- the state attends to the segment's tokens (cross-attention) and is updated through gates.

``head``: ``inside`` (each segment's LM head and cross-entropy summed in its layer, a
per-segment output of the repeat: pipelines over ``segment:stage``) or ``after`` (the head reads the
stacked token outputs after the repeat; a pipeline refuses it, since the head's ``layer_norm`` has a
scale param: /work/notes/heldout-15c.md, finding 1).
``form``: ``fixed`` (the paper's fixed gate: a learned per-unit sigmoid, ``s' = g s + (1 - g) u``)
or ``lstm`` (input and forget gates computed from the state and the update,
``s' = f s + i tanh(u)``). Next-token loss over all tokens; the layer's weights are shared by
every segment (read from outside the repeat).

Legend: b batch, n segment, t tok (a segment's tokens), m state, k key (state + tokens),
j key_tok, h heads, e d_head, d d_model, f d_ff, v vocab.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 256
    d_model: int = 128
    heads: int = 4
    d_head: int = 32
    d_ff: int = 512
    segments: int = 8
    seg_len: int = 16
    state: int = 16
    batch: int = 8
    remat: str | None = None
    form: str = "fixed"
    head: str = "inside"

    @classmethod
    def tiny(cls):
        return cls(vocab=32, d_model=16, heads=2, d_head=8, d_ff=32, segments=4, seg_len=4,
                   state=3, batch=4)


def _heads(x, w, pos):
    return md.einsum(f"batch {pos} d_model, d_model heads d_head -> batch {pos} heads d_head", x, w)


def _token_path(x, s, W, keep, cfg):
    """Tokens attend to the state and causally to each other, then an MLP."""
    h = md.layer_norm(x, "d_model", W["ln_t"])
    kv_in = md.concat([md.rename(s, state="key"), md.rename(h, tok="key")], "key")
    q, k, v = _heads(h, W["wq"], "tok"), _heads(kv_in, W["wk"], "key"), _heads(kv_in, W["wv"], "key")
    scores = md.einsum("batch tok heads d_head, batch key heads d_head -> batch heads tok key", q, k)
    att = md.softmax(md.where(keep, scores * cfg.d_head ** -0.5, -1e9), "key")
    o = md.einsum("batch heads tok key, batch key heads d_head -> batch tok heads d_head", att, v)
    x = x + md.einsum("batch tok heads d_head, heads d_head d_model -> batch tok d_model", o, W["wo"])
    h = md.gelu(md.einsum("batch tok d_model, d_model d_ff -> batch tok d_ff", md.layer_norm(x, "d_model", W["ln_m"]), W["w_fc"]))
    return x + md.einsum("batch tok d_ff, d_ff d_model -> batch tok d_model", h, W["w_proj"])


def _state_path(s, x, W, cfg):
    """The state attends to the segment's tokens; gates mix the update into it."""
    h_s, h_x = md.layer_norm(s, "d_model", W["ln_s"]), md.rename(md.layer_norm(x, "d_model", W["ln_x"]), tok="key_tok")
    q, k, v = _heads(h_s, W["sq"], "state"), _heads(h_x, W["sk"], "key_tok"), _heads(h_x, W["sv"], "key_tok")
    o = md.attention(q, k, v, "state", "key_tok", "d_head", causal=False)
    u = md.einsum("batch state heads d_head, heads d_head d_model -> batch state d_model", o, W["so"])
    if cfg.form == "fixed":
        g = md.sigmoid(W["gate_b"])
        return s * g + u * (1.0 - g)
    i = md.sigmoid(md.einsum("batch state d_model, d_model d_gate -> batch state d_gate", u, W["w_i"]) + W["b_i"])
    f = md.sigmoid(md.einsum("batch state d_model, d_model d_gate -> batch state d_gate", u, W["w_f"]) + W["b_f"])
    i, f = md.rename(i, d_gate="d_model"), md.rename(f, d_gate="d_model")
    return s * f + i * md.tanh(u)


def _weights(cfg, D, H, E, F, M):
    G = md.Dim("d_gate", cfg.d_model)
    W = {n: md.param(n, [D], init="ones") for n in ("ln_t", "ln_m", "ln_s", "ln_x")}
    for n in ("wq", "wk", "wv", "sq", "sk", "sv"):
        W[n] = md.param(n, [D, H, E], fan_out=["heads", "d_head"])
    W["wo"] = md.param("wo", [H, E, D], fan_out=["d_model"])
    W["so"] = md.param("so", [H, E, D], fan_out=["d_model"])
    W["w_fc"] = md.param("w_fc", [D, F], fan_out=["d_ff"])
    W["w_proj"] = md.param("w_proj", [F, D], fan_out=["d_model"])
    if cfg.form == "fixed":
        W["gate_b"] = md.param("gate_b", [D], init=1.0)    # starts keeping most of the state
    else:
        W["w_i"], W["w_f"] = md.param("w_i", [D, G], fan_out=["d_gate"]), md.param("w_f", [D, G], fan_out=["d_gate"])
        W["b_i"], W["b_f"] = md.param("b_i", [G], init=-1.0), md.param("b_f", [G], init=1.0)
    W["state0"] = md.param("state0", [M, D], scale=0.5)
    return W


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("fixed", "lstm"):
        raise ValueError(f"form must be 'fixed' or 'lstm', got {cfg.form!r}")
    if cfg.head not in ("inside", "after"):
        raise ValueError(f"head must be 'inside' or 'after', got {cfg.head!r}")
    B, S, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.segments * cfg.seg_len), md.Dim("vocab", cfg.vocab)
    D, H, E, F = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    M, T, K = md.Dim("state", cfg.state), md.Dim("tok", cfg.seg_len), md.Dim("key", cfg.state + cfg.seg_len)
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte, wpe = md.param("wte", [V, D], scale=0.5), md.param("wpe", [T, D], scale=0.1)
        lnf, lm_head = md.param("lnf", [D], init="ones"), md.param("lm_head", [D, V], fan_out=["vocab"])
        W = _weights(cfg, D, H, E, F, M)
        key_pos = md.arange(K)                  # the state's keys first, then the tokens'
        keep = md.logical_or(key_pos < cfg.state, key_pos - cfg.state <= md.arange(T))   # [key, tok]
        x = md.rearrange(md.gather(wte, ids, "vocab"), "batch (segment tok) d_model -> segment batch tok d_model",
                         tok=cfg.seg_len) + wpe

        labels_ = md.rearrange(labels, "batch (segment tok) -> segment batch tok", tok=cfg.seg_len)

        def head_ce(h, lab, lead=""):
            logits = md.einsum(f"{lead}batch tok d_model, d_model vocab -> {lead}batch tok vocab",
                               md.layer_norm(h, "d_model", lnf), lm_head)
            return md.cross_entropy(logits, lab, "vocab")

        def block(s, p):
            h = _token_path(p["x"], s, W, keep, cfg)
            if cfg.head == "inside":      # each segment's loss terms in its own layer: pipelines
                return _state_path(s, p["x"], W, cfg), {"ce": md.reduce_sum(head_ce(h, p["labels"]))}
            return _state_path(s, p["x"], W, cfg), {"h": h}

        s0 = md.broadcast_to(W["state0"], [B, M, D])
        _, per_segment = md.repeat(block, s0, {"x": x, "labels": labels_}, "segment", remat=cfg.remat)
        if cfg.head == "inside":
            loss = md.reduce_sum(per_segment["ce"]) / (cfg.batch * S.size)
        else:                             # the head reads the stacked outputs after the repeat
            loss = md.reduce_mean(head_ce(per_segment["h"], labels_, "segment "))
        params = {"wte": wte, "wpe": wpe, "lnf": lnf, "lm_head": lm_head, **W}

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg.vocab, (cfg.batch, S.size + 1), generator=gen)
        return {"ids": toks[:, :-1].contiguous(), "labels": toks[:, 1:].contiguous()}

    return md.Model(g, loss, params, make_feeds, cfg)
