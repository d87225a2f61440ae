"""A Llama-style decoder written by a new user from the README and docs/guide only, in their own names.

Dims: ``batch``, ``tokens`` (and ``key_tokens``), ``hidden``, ``n_heads``, ``head_dim``, ``mlp``,
``vocab``, ``depth`` (the layer dim). Pre-norm RMSNorm, a SwiGLU MLP, rotary embeddings from
positions computed in the graph (``md.arange``) or fed (``fed_positions=True``: an input ``pos``),
causal fused attention, optional biases on q/k/v, a tied or separate head, label smoothing and a
mean of the cross-entropy over the non-pad labels (``labels != pad``).

``scan=True`` runs the blocks under ``md.repeat`` over ``depth`` (pipelinable); ``scan=False``
is the plain Python loop over layers with one set of params per layer (``layers.0.wq``, ...),
as many users write it first.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    hidden: int = 128
    n_heads: int = 4
    head_dim: int = 32
    mlp: int = 384
    depth: int = 4
    tokens: int = 64
    batch: int = 8
    scan: bool = True
    tied: bool = True
    bias: bool = False
    smoothing: float = 0.1
    pad: int = 0
    fed_positions: bool = False

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=40, hidden=24, n_heads=6, head_dim=4, mlp=20, depth=4, tokens=8, batch=4)


def _rotary(x, cos, sin, half):
    """x * cos + rotate_half(x) * sin, rotate_half = (-x2, x1) over the two halves of head_dim."""
    x1 = md.slice_(x, "head_dim", 0, half)
    x2 = md.slice_(x, "head_dim", half, 2 * half)
    return x * cos + md.concat([-x2, x1], "head_dim") * sin


def build(cfg: Config = Config()) -> md.Model:
    B, T = md.Dim("batch", cfg.batch), md.Dim("tokens", cfg.tokens)
    H, NH, HD = md.Dim("hidden", cfg.hidden), md.Dim("n_heads", cfg.n_heads), md.Dim("head_dim", cfg.head_dim)
    M, V, L = md.Dim("mlp", cfg.mlp), md.Dim("vocab", cfg.vocab), md.Dim("depth", cfg.depth)
    half = cfg.head_dim // 2
    with md.Graph("userllama") as g:
        ids = md.input("ids", [B, T], dtype=torch.int64)
        labels = md.input("labels", [B, T], dtype=torch.int64)
        emb = md.param("emb", [V, H], scale=0.02)
        params = {"emb": emb}

        # rotary angles [.., tokens, head_dim]: positions x the inverse frequencies, each twice
        inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        freqs = md.constant(torch.cat([inv, inv]), [HD])
        if cfg.fed_positions:
            pos = md.cast(md.input("pos", [B, T], dtype=torch.int64), torch.float32)
        else:
            pos = md.cast(md.arange(T), torch.float32)
        cos, sin = md.cos(pos * freqs), md.sin(pos * freqs)

        def layer_shapes(stack):
            pre = [L] if stack else []
            fo = ["depth"] if stack else []
            shapes = {
                "norm1": ([*pre, H], dict(init="ones")), "norm2": ([*pre, H], dict(init="ones")),
                "wq": ([*pre, H, NH, HD], dict(fan_out=[*fo, "n_heads", "head_dim"])),
                "wk": ([*pre, H, NH, HD], dict(fan_out=[*fo, "n_heads", "head_dim"])),
                "wv": ([*pre, H, NH, HD], dict(fan_out=[*fo, "n_heads", "head_dim"])),
                "wo": ([*pre, NH, HD, H], dict(fan_out=[*fo, "hidden"])),
                "w_gate": ([*pre, H, M], dict(fan_out=[*fo, "mlp"])),
                "w_up": ([*pre, H, M], dict(fan_out=[*fo, "mlp"])),
                "w_down": ([*pre, M, H], dict(fan_out=[*fo, "hidden"])),
            }
            if cfg.bias:
                for n in ("bq", "bk", "bv"):
                    shapes[n] = ([*pre, NH, HD], dict(scale=0.0))
            return shapes

        def block(x, p):
            a = md.rms_norm(x, "hidden", p["norm1"])
            q = md.einsum("batch tokens hidden, hidden n_heads head_dim -> batch tokens n_heads head_dim", a, p["wq"])
            k = md.einsum("batch tokens hidden, hidden n_heads head_dim -> batch tokens n_heads head_dim", a, p["wk"])
            v = md.einsum("batch tokens hidden, hidden n_heads head_dim -> batch tokens n_heads head_dim", a, p["wv"])
            if cfg.bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q, k = _rotary(q, cos, sin, half), _rotary(k, cos, sin, half)
            k, v = md.rename(k, tokens="key_tokens"), md.rename(v, tokens="key_tokens")
            att = md.attention(q, k, v, "tokens", "key_tokens", "head_dim", causal=True)
            x = x + md.einsum("batch tokens n_heads head_dim, n_heads head_dim hidden -> batch tokens hidden", att, p["wo"])
            m = md.rms_norm(x, "hidden", p["norm2"])
            gate = md.einsum("batch tokens hidden, hidden mlp -> batch tokens mlp", m, p["w_gate"])
            up = md.einsum("batch tokens hidden, hidden mlp -> batch tokens mlp", m, p["w_up"])
            return x + md.einsum("batch tokens mlp, mlp hidden -> batch tokens hidden", md.silu(gate) * up, p["w_down"])

        x = md.gather(emb, ids, "vocab")                       # [batch, tokens, hidden]
        if cfg.scan:
            stacked = {n: md.param(n, s, **kw) for n, (s, kw) in layer_shapes(True).items()}
            params.update(stacked)
            x = md.repeat(block, x, stacked, "depth")
        else:
            for i in range(cfg.depth):
                p = {n: md.param(f"layers.{i}.{n}", s, **kw) for n, (s, kw) in layer_shapes(False).items()}
                params.update({f"layers.{i}.{n}": t for n, t in p.items()})
                x = block(x, p)

        params["norm_f"] = md.param("norm_f", [H], init="ones")
        x = md.rms_norm(x, "hidden", params["norm_f"])
        head = emb if cfg.tied else md.param("head", [V, H], fan_out=["vocab"])
        if not cfg.tied:
            params["head"] = head
        logits = md.einsum("batch tokens hidden, vocab hidden -> batch tokens vocab", x, head)

        ce = md.cross_entropy(logits, labels, "vocab")
        if cfg.smoothing:
            uniform = -md.reduce_mean(md.log_softmax(logits, "vocab"), "vocab")
            ce = (1 - cfg.smoothing) * ce + cfg.smoothing * uniform
        keep = md.cast(md.not_equal(labels, cfg.pad), torch.float32)
        loss = md.reduce_sum(ce * keep) / md.maximum(md.reduce_sum(keep), 1.0)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.tokens + 1), generator=gen)
        out = {"ids": toks[:, :-1], "labels": toks[:, 1:]}
        if cfg.fed_positions:
            out["pos"] = torch.arange(cfg.tokens).repeat(cfg.batch, 1)
        return out

    return md.Model(g, loss, params, feeds, cfg, logits=logits)
