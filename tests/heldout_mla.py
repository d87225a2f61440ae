"""A DeepSeek-V2-style decoder with multi-head latent attention (MLA), written from the README and
docs/ alone (a held-out model).

Keys and values come from a compressed latent: a down-projection ``[d_model, kv_latent]``, an
RMSNorm over the latent, then up-projections to per-head non-rotary keys ``[kv_latent, heads,
d_nope]`` and values ``[kv_latent, heads, d_v]``. The rotary part of the keys is decoupled: one
projection ``[d_model, d_rope]`` shared by every head (no ``heads`` dim), rotated, broadcast over
the heads and concatenated after the non-rotary part along ``d_head``. Queries also go through a
low-rank latent (``q_latent``, normed) and are cut into a non-rotary and a rotary part the same
way. Values have their own width ``d_v`` (not the keys'), so the attention is a composite
(einsum, causal ``md.where``, softmax, einsum). RMSNorm pre-norm, SwiGLU MLP, untied head.
``absorb=True`` writes the attention as DeepSeek's inference form: ``w_uk`` absorbed into the
query (scores against the latent itself, never the per-head keys) and ``w_uv`` applied after
the attention-weighted sum of latents: the same math, other einsums.

Legend: b batch, s seq, t key_seq, d d_model, c kv_latent, cq q_latent, h heads, e d_head
(= d_nope + d_rope), r d_rope, dv d_v, f d_ff.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_nope: int = 8
    d_rope: int = 4
    d_v: int = 8
    kv_latent: int = 16
    q_latent: int = 24
    d_ff: int = 48
    layers: int = 2
    seq: int = 16
    batch: int = 4
    rope_theta: float = 10000.0
    absorb: bool = False
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=4, d_nope=4, d_rope=2, d_v=6, kv_latent=8, q_latent=12,
                   d_ff=24, layers=2, seq=8, batch=4)


def rotary(x: md.Tensor, seq: str, d_rope: int, theta: float) -> md.Tensor:
    """Rotate-half rotary embedding over the dim ``d_rope`` of ``x``, by the positions of ``seq``."""
    half = d_rope // 2
    inv = md.constant(theta ** (-torch.arange(half, dtype=torch.float32) / half), [md.Dim("d_rope", half)])
    angles = md.cast(md.arange(x.shape[seq]), torch.float32) * inv
    cos, sin = md.cos(angles), md.sin(angles)
    x1, x2 = md.slice_(x, "d_rope", 0, half), md.slice_(x, "d_rope", half, d_rope)
    return md.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], "d_rope")


def build(cfg: Config = Config()) -> md.Model:
    b, s = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d, h, L = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("layer", cfg.layers)
    c, cq = md.Dim("kv_latent", cfg.kv_latent), md.Dim("q_latent", cfg.q_latent)
    e, r, dv = md.Dim("d_head", cfg.d_nope + cfg.d_rope), md.Dim("d_rope", cfg.d_rope), md.Dim("d_v", cfg.d_v)
    nope, f, v = md.Dim("d_nope", cfg.d_nope), md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab)
    with md.Graph("heldout_mla") as graph:
        ids = md.input("ids", [b, s], dtype=torch.int64)
        labels = md.input("labels", [b, s], dtype=torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        p = {
            "ln1": md.param("ln1", [L, d], init="ones"),
            "w_dq": md.param("w_dq", [L, d, cq], fan_out=["layer", "q_latent"]),
            "q_norm": md.param("q_norm", [L, cq], init="ones"),
            "w_uq": md.param("w_uq", [L, cq, h, e], fan_out=["layer", "heads", "d_head"]),
            "w_dkv": md.param("w_dkv", [L, d, c], fan_out=["layer", "kv_latent"]),
            "kv_norm": md.param("kv_norm", [L, c], init="ones"),
            "w_uk": md.param("w_uk", [L, c, h, nope], fan_out=["layer", "heads", "d_nope"]),
            "w_uv": md.param("w_uv", [L, c, h, dv], fan_out=["layer", "heads", "d_v"]),
            "w_kr": md.param("w_kr", [L, d, r], fan_out=["layer", "d_rope"]),
            "wo": md.param("wo", [L, h, dv, d], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [L, d], init="ones"),
            "w_gate": md.param("w_gate", [L, d, f], fan_out=["layer", "d_ff"]),
            "w_up": md.param("w_up", [L, d, f], fan_out=["layer", "d_ff"]),
            "w_down": md.param("w_down", [L, f, d], fan_out=["layer", "d_model"]),
        }
        norm_f = md.param("norm_f", [d], init="ones")
        head = md.param("head", [d, v], fan_out=["vocab"])
        scale = (cfg.d_nope + cfg.d_rope) ** -0.5

        def attention(x, p):
            cq_ = md.rms_norm(md.einsum("batch seq d_model, d_model q_latent -> batch seq q_latent", x, p["w_dq"]),
                              "q_latent", p["q_norm"])
            q = md.einsum("batch seq q_latent, q_latent heads d_head -> batch seq heads d_head", cq_, p["w_uq"])
            q_rope = rotary(md.rename(md.slice_(q, "d_head", cfg.d_nope, cfg.d_nope + cfg.d_rope), d_head="d_rope"),
                            "seq", cfg.d_rope, cfg.rope_theta)
            q = md.concat([md.slice_(q, "d_head", 0, cfg.d_nope), md.rename(q_rope, d_rope="d_head")], "d_head")
            xk = md.rename(x, seq="key_seq")
            latent = md.rms_norm(md.einsum("batch key_seq d_model, d_model kv_latent -> batch key_seq kv_latent",
                                           xk, p["w_dkv"]), "kv_latent", p["kv_norm"])
            k_rope = rotary(md.einsum("batch key_seq d_model, d_model d_rope -> batch key_seq d_rope", xk, p["w_kr"]),
                            "key_seq", cfg.d_rope, cfg.rope_theta)                 # one for every head
            if cfg.absorb:
                return _absorbed(q, latent, k_rope, p)
            k_nope = md.einsum("batch key_seq kv_latent, kv_latent heads d_nope -> batch key_seq heads d_nope",
                               latent, p["w_uk"])
            k_rope = md.broadcast_to(k_rope, [b, md.Dim("key_seq", cfg.seq), h, r])
            k = md.concat([md.rename(k_nope, d_nope="d_head"), md.rename(k_rope, d_rope="d_head")], "d_head")
            val = md.einsum("batch key_seq kv_latent, kv_latent heads d_v -> batch key_seq heads d_v", latent, p["w_uv"])
            scores = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
            att = md.softmax(md.where(md.causal_mask(s, md.Dim("key_seq", cfg.seq)), scores * scale, -1e9), "key_seq")
            o = md.einsum("batch heads seq key_seq, batch key_seq heads d_v -> batch seq heads d_v", att, val)
            return md.einsum("batch seq heads d_v, heads d_v d_model -> batch seq d_model", o, p["wo"])

        def _absorbed(q, latent, k_rope, p):
            """Scores against the latent (w_uk folded into q) plus the shared rotary key's; the
            values' up-projection after the weighted sum of latents."""
            q_nope = md.rename(md.slice_(q, "d_head", 0, cfg.d_nope), d_head="d_nope")
            q_rope = md.rename(md.slice_(q, "d_head", cfg.d_nope, cfg.d_nope + cfg.d_rope), d_head="d_rope")
            q_lat = md.einsum("batch seq heads d_nope, kv_latent heads d_nope -> batch seq heads kv_latent",
                              q_nope, p["w_uk"])
            scores = (md.einsum("batch seq heads kv_latent, batch key_seq kv_latent -> batch heads seq key_seq",
                                q_lat, latent)
                      + md.einsum("batch seq heads d_rope, batch key_seq d_rope -> batch heads seq key_seq",
                                  q_rope, k_rope))
            att = md.softmax(md.where(md.causal_mask(s, md.Dim("key_seq", cfg.seq)), scores * scale, -1e9), "key_seq")
            o_lat = md.einsum("batch heads seq key_seq, batch key_seq kv_latent -> batch seq heads kv_latent", att, latent)
            o = md.einsum("batch seq heads kv_latent, kv_latent heads d_v -> batch seq heads d_v", o_lat, p["w_uv"])
            return md.einsum("batch seq heads d_v, heads d_v d_model -> batch seq d_model", o, p["wo"])

        def block(x, p):
            x = x + attention(md.rms_norm(x, "d_model", p["ln1"]), p)
            n = md.rms_norm(x, "d_model", p["ln2"])
            gate = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", n, p["w_gate"])
            up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", n, p["w_up"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.silu(gate) * up, p["w_down"])

        x = md.repeat(block, md.gather(wte, ids, "vocab"), p, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", md.rms_norm(x, "d_model", norm_f), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": toks[:, :-1], "labels": toks[:, 1:]}

    return md.Model(graph, loss, {"wte": wte, **p, "norm_f": norm_f, "head": head}, feeds, cfg, logits=logits)
