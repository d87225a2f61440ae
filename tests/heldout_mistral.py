"""A Mistral-style decoder with sliding-window attention, written from the README and docs/ alone
(a held-out model).

Grouped-query attention (q ``[batch, seq, kv_heads, group, d_head]`` against k, v
``[batch, key_seq, kv_heads, d_head]``), rotary embeddings in the rotate-half form on the whole
head, RMSNorm pre-norm blocks, a SwiGLU MLP, an untied head. Each query sees only the last
``window`` keys (itself included): the mask is made from positions, ``md.arange(seq) -
md.arange(key_seq)`` (``[seq, key_seq]``), combined by ``md.logical_and``/``md.logical_or``, and
applied in a composite attention (einsum, ``md.where``, softmax, einsum). ``sinks`` > 0 adds StreamingLLM's attention sinks: the first
``sinks`` positions stay visible to every later query, outside the window too.

``mlm=True`` turns it into a Longformer/ELECTRA-style masked-LM encoder instead: no causal
mask (a query sees the keys within ``window`` on both sides), the first ``sinks`` positions
are *global* (they see every key and every query sees them), some fed positions' ids are
replaced by a [MASK] id, and the loss is the cross-entropy on those positions only (a fed
float ``weights`` tensor, divided by its sum), through a head tied to the embedding.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    kv_heads: int = 2
    group: int = 2
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 4
    window: int = 4
    sinks: int = 0
    mlm: bool = False
    mask_rate: float = 0.25
    rope_theta: float = 10000.0

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=20, d_model=16, kv_heads=2, group=2, d_head=4, d_ff=24, layers=2, seq=12, batch=4, window=3)


def rotate_half(x: md.Tensor, cos, sin) -> md.Tensor:
    names = " ".join(n for n in x.shape.names if n != "d_head")
    halves = md.rearrange(x, f"{names} (two half) -> {names} two half", two=2)
    out = halves * cos + md.roll(halves, "two", 1) * sin
    return md.rename(md.rearrange(out, f"{names} two half -> {names} (two half)"), two_half="d_head")


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d_model, kv_heads, group = md.Dim("d_model", cfg.d_model), md.Dim("kv_heads", cfg.kv_heads), md.Dim("group", cfg.group)
    d_head, d_ff, vocab = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab)
    layer, half, two = md.Dim("layer", cfg.layers), md.Dim("half", cfg.d_head // 2), md.Dim("two", 2)
    with md.Graph("heldout_mistral") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        weights = md.input("weights", [batch, seq]) if cfg.mlm else None
        wte = md.param("wte", [vocab, d_model], scale=0.1)
        blocks = {
            "attn_norm": md.param("attn_norm", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, kv_heads, group, d_head], fan_out=["layer", kv_heads, group, d_head]),
            "wk": md.param("wk", [layer, d_model, kv_heads, d_head], fan_out=["layer", kv_heads, d_head]),
            "wv": md.param("wv", [layer, d_model, kv_heads, d_head], fan_out=["layer", kv_heads, d_head]),
            "wo": md.param("wo", [layer, kv_heads, group, d_head, d_model], fan_out=["layer", d_model]),
            "mlp_norm": md.param("mlp_norm", [layer, d_model], init="ones"),
            "w_gate": md.param("w_gate", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_up": md.param("w_up", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_down": md.param("w_down", [layer, d_ff, d_model], fan_out=["layer", d_model]),
        }
        norm_f = md.param("norm_f", [d_model], init="ones")
        head = None if cfg.mlm else md.param("lm_head", [vocab, d_model], fan_out=[vocab])

        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.d_head, 2, dtype=torch.float64) / cfg.d_head)
        ang = md.arange(seq, torch.float32) * md.constant(inv.to(torch.float32), [half])
        cos, sin = md.cos(ang), md.sin(ang) * md.constant(torch.tensor([-1.0, 1.0]), [two])

        # the mask from positions: [seq, key_seq]
        q_pos, k_pos = md.arange(seq), md.arange(key_seq)
        dist = q_pos - k_pos
        allowed = md.less(md.abs(dist) if cfg.mlm else dist, cfg.window)
        if cfg.sinks:   # sink / global keys seen by every query; in the encoder, global queries see every key
            allowed = md.logical_or(allowed, md.less(k_pos, cfg.sinks))
            if cfg.mlm:
                allowed = md.logical_or(allowed, md.less(q_pos, cfg.sinks))
        if not cfg.mlm:
            allowed = md.logical_and(allowed, md.greater_equal(dist, 0))

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.rms_norm(x, "d_model", p["attn_norm"])
            q = rotate_half(md.einsum("batch seq d_model, d_model kv_heads group d_head -> batch seq kv_heads group d_head",
                                      h, p["wq"]), cos, sin)
            k = rotate_half(md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head", h, p["wk"]),
                            cos, sin)
            v = md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head", h, p["wv"])
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            s = md.einsum("batch seq kv_heads group d_head, batch key_seq kv_heads d_head -> batch kv_heads group seq key_seq",
                          q, k) * cfg.d_head ** -0.5
            att = md.softmax(md.where(allowed, s, -1e9), "key_seq")
            o = md.einsum("batch kv_heads group seq key_seq, batch key_seq kv_heads d_head -> batch seq kv_heads group d_head",
                          att, v)
            x = x + md.einsum("batch seq kv_heads group d_head, kv_heads group d_head d_model -> batch seq d_model", o, p["wo"])
            h = md.rms_norm(x, "d_model", p["mlp_norm"])
            u = md.silu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_gate"])) * \
                md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_up"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, p["w_down"])

        x = md.repeat(block, md.gather(wte, ids, "vocab"), blocks, "layer")
        x = md.rms_norm(x, "d_model", norm_f)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x, wte if cfg.mlm else head)
        ce = md.cross_entropy(logits, labels, "vocab")
        if cfg.mlm:
            loss = md.reduce_sum(ce * weights) / md.reduce_sum(weights)
        else:
            loss = md.reduce_mean(ce)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        if not cfg.mlm:
            tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
            return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        tokens = torch.randint(1, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)   # id 0 is [MASK]
        masked = torch.rand(cfg.batch, cfg.seq, generator=gen) < cfg.mask_rate
        masked[:, 0] = True                                                          # at least one per row
        return {"ids": torch.where(masked, 0, tokens), "labels": tokens, "weights": masked.float()}

    params = {"wte": wte, **blocks, "norm_f": norm_f, **({} if cfg.mlm else {"lm_head": head})}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
