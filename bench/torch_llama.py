"""models/llama.py written in plain torch, as a careful torch engineer would: the peer of
``bench/dense_vs_torch.py --model llama``.

HF/Meta Llama style on meshdsl's initial weights: ``F.rms_norm``, rotary tables computed
once (buffers) and applied in the rotate-half form, grouped-query attention through
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` (no copy of k and v per
group), ``F.silu`` in the SwiGLU MLP, ``F.cross_entropy``.  The same math as the DSL model,
so both sides compute the same loss from the same weights.

Legend: b batch, s seq, d d_model, n kv_heads, g group, e d_head, f d_ff, v vocab.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCK_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def rope_tables(cfg, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [s, e] of the angles ``position * theta ** (-2i / e)``, each half repeated."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.d_head, 2, dtype=torch.float64) / cfg.d_head)
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float64), inv_freq).to(torch.float32)
    angles = torch.cat((angles, angles), dim=-1).to(device)
    return angles.cos(), angles.sin()


def rotate(x_bhse, cos_se, sin_se):
    half = x_bhse.shape[-1] // 2
    return x_bhse * cos_se + torch.cat((-x_bhse[..., half:], x_bhse[..., :half]), dim=-1) * sin_se


class LlamaBlock(nn.Module):
    """One block; weights are one layer's slices of meshdsl's stacked params, as matrices."""

    def __init__(self, cfg, w: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        d, nq, nkv = cfg.d_model, cfg.kv_heads * cfg.group * cfg.d_head, cfg.kv_heads * cfg.d_head
        self.attn_norm = nn.Parameter(w["attn_norm"].clone())
        self.wq = nn.Parameter(w["wq"].reshape(d, nq).clone())        # [d, (n g e)]: head n*g+g'
        self.wk = nn.Parameter(w["wk"].reshape(d, nkv).clone())       # [d, (n e)]
        self.wv = nn.Parameter(w["wv"].reshape(d, nkv).clone())
        self.wo = nn.Parameter(w["wo"].reshape(nq, d).clone())
        self.mlp_norm = nn.Parameter(w["mlp_norm"].clone())
        self.w_gate = nn.Parameter(w["w_gate"].clone())               # [d, f]
        self.w_up = nn.Parameter(w["w_up"].clone())
        self.w_down = nn.Parameter(w["w_down"].clone())               # [f, d]

    def forward(self, x_bsd, cos_se, sin_se):
        cfg = self.cfg
        b, s, d = x_bsd.shape
        h_bsd = F.rms_norm(x_bsd, (d,), self.attn_norm, eps=cfg.norm_eps)
        q = (h_bsd @ self.wq).view(b, s, cfg.kv_heads * cfg.group, cfg.d_head).transpose(1, 2)
        k = (h_bsd @ self.wk).view(b, s, cfg.kv_heads, cfg.d_head).transpose(1, 2)
        v = (h_bsd @ self.wv).view(b, s, cfg.kv_heads, cfg.d_head).transpose(1, 2)
        q, k = rotate(q, cos_se, sin_se), rotate(k, cos_se, sin_se)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x_bsd = x_bsd + y.transpose(1, 2).reshape(b, s, -1) @ self.wo
        h_bsd = F.rms_norm(x_bsd, (d,), self.mlp_norm, eps=cfg.norm_eps)
        return x_bsd + (F.silu(h_bsd @ self.w_gate) * (h_bsd @ self.w_up)) @ self.w_down


class TorchLlama(nn.Module):
    def __init__(self, cfg, w: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Parameter(w["tok_emb"].clone())                # [v, d]
        self.blocks = nn.ModuleList(LlamaBlock(cfg, {k: w[k][l] for k in BLOCK_PARAMS}) for l in range(cfg.layers))
        self.norm = nn.Parameter(w["norm"].clone())
        self.lm_head = nn.Parameter(w["lm_head"].clone())                # [v, d]
        cos, sin = rope_tables(cfg, w["norm"].device)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, ids, labels):
        x = F.embedding(ids, self.tok_emb)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        x = F.rms_norm(x, (self.cfg.d_model,), self.norm, eps=self.cfg.norm_eps)
        logits = x @ self.lm_head.t()
        return F.cross_entropy(logits.view(-1, self.cfg.vocab), labels.view(-1))

    def stacked_grads(self) -> dict[str, torch.Tensor]:
        """Gradients in meshdsl's param shapes, for comparison."""
        cfg = self.cfg
        n, g, e, d = cfg.kv_heads, cfg.group, cfg.d_head, cfg.d_model
        shapes = {"wq": (d, n, g, e), "wk": (d, n, e), "wv": (d, n, e), "wo": (n, g, e, d)}
        out = {k: getattr(self, k).grad for k in ("tok_emb", "norm", "lm_head")}
        for k in BLOCK_PARAMS:
            out[k] = torch.stack([getattr(b, k).grad.reshape(shapes.get(k, getattr(b, k).shape)) for b in self.blocks])
        return out
