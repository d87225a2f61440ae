"""A Phi-3-style decoder with fused projections, written from the README and docs/ alone (a
held-out model).

``fused="dims"``: one qkv weight ``[d_model, qkv=3, heads, d_head]``, its output cut into q, k and
v by ``md.slice_`` over ``qkv`` and ``md.squeeze``; one gate_up weight ``[d_model, gate_up=2,
d_ff]`` cut in two the same way. ``fused="flat"``: the weights as a checkpoint stores them, one
flat ``[d_model, qkv_flat=3*heads*d_head]`` and ``[d_model, gate_up_flat=2*d_ff]``, the outputs
``md.rearrange``d to ``(qkv heads d_head)`` and ``(gate_up d_ff)`` before the cut.
``fused="reshape"``: the flat form cut by ``md.reshape`` to named dims instead.
``fused="none"``: separate wq, wk, wv, w_gate, w_up (the reference plan). RMSNorm pre-norm,
rotary embeddings (rotate-half), causal fused attention, SwiGLU, untied head.

Legend: b batch, s seq, t key_seq, d d_model, h heads, e d_head, f d_ff.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 48
    layers: int = 2
    seq: int = 16
    batch: int = 4
    fused: str = "dims"      # "dims", "flat", "reshape" or "none"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=4, d_head=4, d_ff=24, layers=2, seq=8, batch=4)


def part(x: md.Tensor, dim: str, i: int) -> md.Tensor:
    """The ``i``-th entry of the fused dim ``dim``, that dim dropped."""
    return md.squeeze(md.slice_(x, dim, i, i + 1), dim)


def rotary(x: md.Tensor, seq: str, d_head: int) -> md.Tensor:
    half = d_head // 2
    inv = md.constant(10000.0 ** (-torch.arange(half, dtype=torch.float32) / half), [md.Dim("d_head", half)])
    angles = md.cast(md.arange(x.shape[seq]), torch.float32) * inv
    cos, sin = md.cos(angles), md.sin(angles)
    x1, x2 = md.slice_(x, "d_head", 0, half), md.slice_(x, "d_head", half, d_head)
    return md.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], "d_head")


def _params(cfg: Config, L, d, h, e, f) -> dict:
    p = {"ln1": md.param("ln1", [L, d], init="ones"), "ln2": md.param("ln2", [L, d], init="ones"),
         "wo": md.param("wo", [L, h, e, d], fan_out=["layer", "d_model"]),
         "w_down": md.param("w_down", [L, f, d], fan_out=["layer", "d_model"])}
    if cfg.fused == "dims":
        p["wqkv"] = md.param("wqkv", [L, d, md.Dim("qkv", 3), h, e], fan_out=["layer", "qkv", "heads", "d_head"])
        p["w_gate_up"] = md.param("w_gate_up", [L, d, md.Dim("gate_up", 2), f], fan_out=["layer", "gate_up", "d_ff"])
    elif cfg.fused in ("flat", "reshape"):
        qkv_flat = md.Dim("qkv_flat", 3 * cfg.heads * cfg.d_head)
        p["wqkv"] = md.param("wqkv", [L, d, qkv_flat], fan_out=["layer", "qkv_flat"])
        p["w_gate_up"] = md.param("w_gate_up", [L, d, md.Dim("gate_up_flat", 2 * cfg.d_ff)],
                                  fan_out=["layer", "gate_up_flat"])
    else:
        for n in ("wq", "wk", "wv"):
            p[n] = md.param(n, [L, d, h, e], fan_out=["layer", "heads", "d_head"])
        for n in ("w_gate", "w_up"):
            p[n] = md.param(n, [L, d, f], fan_out=["layer", "d_ff"])
    return p


def build(cfg: Config = Config()) -> md.Model:
    if cfg.fused not in ("dims", "flat", "reshape", "none"):
        raise ValueError(f"fused must be 'dims', 'flat', 'reshape' or 'none', not {cfg.fused!r}")
    b, s = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, v, L = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_phi3") as graph:
        ids = md.input("ids", [b, s], dtype=torch.int64)
        labels = md.input("labels", [b, s], dtype=torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        p = _params(cfg, L, d, h, e, f)
        norm_f = md.param("norm_f", [d], init="ones")
        head = md.param("head", [d, v], fan_out=["vocab"])

        def project_qkv(n, p):
            if cfg.fused == "none":
                return [md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", n, p[w])
                        for w in ("wq", "wk", "wv")]
            if cfg.fused == "dims":
                qkv = md.einsum("batch seq d_model, d_model qkv heads d_head -> batch seq qkv heads d_head", n, p["wqkv"])
            else:
                flat = md.einsum("batch seq d_model, d_model qkv_flat -> batch seq qkv_flat", n, p["wqkv"])
                if cfg.fused == "reshape":
                    qkv = md.reshape(flat, [b, s, md.Dim("qkv", 3), h, e])
                else:
                    qkv = md.rearrange(flat, "batch seq (qkv heads d_head) -> batch seq qkv heads d_head",
                                       qkv=3, heads=cfg.heads)
            return [part(qkv, "qkv", i) for i in range(3)]

        def project_gate_up(n, p):
            if cfg.fused == "none":
                return [md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", n, p[w]) for w in ("w_gate", "w_up")]
            if cfg.fused == "dims":
                gu = md.einsum("batch seq d_model, d_model gate_up d_ff -> batch seq gate_up d_ff", n, p["w_gate_up"])
            else:
                flat = md.einsum("batch seq d_model, d_model gate_up_flat -> batch seq gate_up_flat", n, p["w_gate_up"])
                if cfg.fused == "reshape":
                    gu = md.reshape(flat, [b, s, md.Dim("gate_up", 2), f])
                else:
                    gu = md.rearrange(flat, "batch seq (gate_up d_ff) -> batch seq gate_up d_ff", gate_up=2)
            return [part(gu, "gate_up", i) for i in range(2)]

        def block(x, p):
            q, k, val = project_qkv(md.rms_norm(x, "d_model", p["ln1"]), p)
            q = rotary(q, "seq", cfg.d_head)
            k = rotary(md.rename(k, seq="key_seq"), "key_seq", cfg.d_head)
            o = md.attention(q, k, md.rename(val, seq="key_seq"), "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            gate, up = project_gate_up(md.rms_norm(x, "d_model", p["ln2"]), p)
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.silu(gate) * up, p["w_down"])

        x = md.repeat(block, md.gather(wte, ids, "vocab"), p, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", md.rms_norm(x, "d_model", norm_f), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": toks[:, :-1], "labels": toks[:, 1:]}

    return md.Model(graph, loss, {"wte": wte, **p, "norm_f": norm_f, "head": head}, feeds, cfg, logits=logits)
