"""A GPT in a user's own short dim names (``B T C``), with ALiBi, a sliding causal window, tied
embeddings, label smoothing as soft targets and a z-loss, written from the README and docs/ alone
(a held-out model).

Legend: ``B`` batch, ``T`` / ``S`` query and key positions, ``C`` channels (the model width),
``H`` heads, ``D`` head width, ``F`` MLP width, ``V`` vocabulary, ``L`` layers.

No position embedding: each head adds ``-slope_h * (t - s)`` (ALiBi, Press et al. 2022; the slopes
a geometric sequence, made in the graph from ``md.arange(H)`` and ``md.exp``) and sees only the
``window`` most recent keys, itself included (``0 <= t - s < window``, a boolean mask from the
integer distance). The head is tied to the token embedding (``logits = x . wte``, so ``wte`` gets
two gradients). The loss is the cross-entropy against label-smoothed soft targets
``(1 - eps) one_hot(y) + eps / V`` (a contraction with ``md.log_softmax``, no ``md.cross_entropy``),
plus PaLM's z-loss ``1e-4 * logsumexp(logits)^2``. GPT-2's pre-LayerNorm blocks with biases and
a GELU MLP, dropout off.
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    V: int = 64
    C: int = 32
    H: int = 4
    D: int = 8
    F: int = 128
    L: int = 4
    T: int = 32
    B: int = 4
    window: int = 8
    smoothing: float = 0.1
    z_loss: float = 1e-4
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(V=32, C=16, H=4, D=4, F=32, L=2, T=12, B=4, window=5)


def build(cfg: Config = Config()) -> md.Model:
    B, T, S = md.Dim("B", cfg.B), md.Dim("T", cfg.T), md.Dim("S", cfg.T)
    C, H, D, F = md.Dim("C", cfg.C), md.Dim("H", cfg.H), md.Dim("D", cfg.D), md.Dim("F", cfg.F)
    V, L = md.Dim("V", cfg.V), md.Dim("L", cfg.L)
    with md.Graph("heldout_alibigpt") as g:
        idx = md.input("idx", [B, T], dtype=torch.int64)
        targets = md.input("targets", [B, T], dtype=torch.int64)
        wte = md.param("wte", [V, C], scale=0.3)
        blocks = {
            "ln1_w": md.param("ln1_w", [L, C], init="ones"),
            "ln1_b": md.param("ln1_b", [L, C], init="zeros"),
            "c_attn": md.param("c_attn", [L, C, md.Dim("three", 3), H, D], fan_out=["L", "three", "H", "D"]),
            "c_proj": md.param("c_proj", [L, H, D, C], fan_out=["L", "C"]),
            "ln2_w": md.param("ln2_w", [L, C], init="ones"),
            "ln2_b": md.param("ln2_b", [L, C], init="zeros"),
            "c_fc": md.param("c_fc", [L, C, F], fan_out=["L", "F"]),
            "fc_b": md.param("fc_b", [L, F], init="zeros"),
            "c_out": md.param("c_out", [L, F, C], fan_out=["L", "C"]),
        }
        lnf_w, lnf_b = md.param("lnf_w", [C], init="ones"), md.param("lnf_b", [C], init="zeros")

        # ALiBi: slope_h = 2^(-8 (h + 1) / H), times the distance t - s; a window of the last keys
        slopes = md.exp(md.cast(md.arange(H) + 1, torch.float32) * (-8.0 * math.log(2.0) / cfg.H))
        dist = md.arange(T) - md.arange(S)                                   # [T, S] int64
        bias = -slopes * md.cast(dist, torch.float32)                        # [H, T, S]
        visible = md.logical_and(md.greater_equal(dist, 0), md.less(dist, cfg.window))

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.layer_norm(x, "C", p["ln1_w"], p["ln1_b"])
            qkv = md.einsum("B T C, C three H D -> three B T H D", h, p["c_attn"])
            q, k, v = (md.squeeze(md.slice_(qkv, "three", i, i + 1), "three") for i in range(3))
            k, v = md.rename(k, T="S"), md.rename(v, T="S")
            att = md.einsum("B T H D, B S H D -> B H T S", q, k) * cfg.D ** -0.5 + bias
            att = md.softmax(md.where(visible, att, -1e9), "S")
            y = md.einsum("B H T S, B S H D -> B T H D", att, v)
            x = x + md.einsum("B T H D, H D C -> B T C", y, p["c_proj"])
            h = md.layer_norm(x, "C", p["ln2_w"], p["ln2_b"])
            f = md.gelu(md.einsum("B T C, C F -> B T F", h, p["c_fc"]) + p["fc_b"])
            return x + md.einsum("B T F, F C -> B T C", f, p["c_out"])

        x = md.gather(wte, idx, "V")
        x = md.repeat(block, x, blocks, "L", remat=cfg.remat)
        x = md.layer_norm(x, "C", lnf_w, lnf_b)
        logits = md.einsum("B T C, V C -> B T V", x, wte)                   # tied head
        soft = md.one_hot(targets, V) * (1.0 - cfg.smoothing) + cfg.smoothing / cfg.V
        ce = -md.einsum("B T V, B T V -> B T", soft, md.log_softmax(logits, "V"))
        z = md.logsumexp(logits, "V")
        loss = md.reduce_mean(ce + cfg.z_loss * z * z)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.V, (cfg.B, cfg.T + 1), generator=gen)
        return {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}

    params = {"wte": wte, **blocks, "lnf_w": lnf_w, "lnf_b": lnf_b}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
