"""models/vit.py written in plain torch, as a careful torch engineer would: the peer of
``bench/dense_vs_torch.py --model vit``.

timm-style on meshdsl's initial weights: the patchify as one ``view``/``permute``/``reshape``,
the patch embedding as one ``F.linear`` with its bias (addmm), the query/key/value
projections packed into one ``[d, 3 h e]`` matmul, ``F.scaled_dot_product_attention``
(non-causal), ``F.layer_norm``, ``F.gelu``, ``F.cross_entropy``.  The same math as the DSL
model, so both sides compute the same loss from the same weights.

Legend: b batch, n patches, p patch_feat, d d_model, h heads, e d_head, f d_ff, k classes.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import stacked_block_grads

BLOCK_PARAMS = ("ln1", "ln1_b", "wq", "wk", "wv", "wo", "ln2", "ln2_b", "w_fc", "w_proj")


class VitBlock(nn.Module):
    """One pre-norm encoder block; weights are one layer's slices of meshdsl's stacked params."""

    def __init__(self, cfg, w: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        d, he = cfg.d_model, cfg.heads * cfg.d_head
        self.ln1 = nn.Parameter(w["ln1"].clone())
        self.ln1_b = nn.Parameter(w["ln1_b"].clone())
        # [d, (3 h e)]: q, k and v side by side, one matmul for the three
        self.w_qkv = nn.Parameter(torch.cat([w[k].reshape(d, he) for k in ("wq", "wk", "wv")], dim=1))
        self.wo = nn.Parameter(w["wo"].reshape(he, d).clone())
        self.ln2 = nn.Parameter(w["ln2"].clone())
        self.ln2_b = nn.Parameter(w["ln2_b"].clone())
        self.w_fc = nn.Parameter(w["w_fc"].clone())                   # [d, f]
        self.w_proj = nn.Parameter(w["w_proj"].clone())               # [f, d]

    def forward(self, x_bnd):
        cfg = self.cfg
        b, n, d = x_bnd.shape
        z_bnd = F.layer_norm(x_bnd, (d,), self.ln1, self.ln1_b, eps=1e-5)
        qkv = (z_bnd @ self.w_qkv).view(b, n, 3, cfg.heads, cfg.d_head).permute(2, 0, 3, 1, 4)  # [3, b, h, n, e]
        y_bhne = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x_bnd = x_bnd + y_bhne.transpose(1, 2).reshape(b, n, -1) @ self.wo
        z_bnd = F.layer_norm(x_bnd, (d,), self.ln2, self.ln2_b, eps=1e-5)
        return x_bnd + F.gelu(z_bnd @ self.w_fc) @ self.w_proj


class TorchViT(nn.Module):
    def __init__(self, cfg, w: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.w_patch = nn.Parameter(w["w_patch"].t().contiguous())    # [d, p], F.linear's layout
        self.b_patch = nn.Parameter(w["b_patch"].clone())
        self.pos = nn.Parameter(w["pos"].clone())                     # [n, d]
        self.blocks = nn.ModuleList(VitBlock(cfg, {k: w[k][l] for k in BLOCK_PARAMS}) for l in range(cfg.layers))
        self.lnf = nn.Parameter(w["lnf"].clone())
        self.lnf_b = nn.Parameter(w["lnf_b"].clone())
        self.w_head = nn.Parameter(w["w_head"].clone())               # [d, k]

    def forward(self, images, labels):
        cfg = self.cfg
        b, ps, g = images.shape[0], cfg.patch, cfg.size // cfg.patch
        patches_bnp = images.view(b, g, ps, g, ps, cfg.channels).permute(0, 1, 3, 2, 4, 5).reshape(b, g * g, -1)
        x_bnd = F.linear(patches_bnp, self.w_patch, self.b_patch) + self.pos
        for block in self.blocks:
            x_bnd = block(x_bnd)
        pooled_bd = F.layer_norm(x_bnd, (cfg.d_model,), self.lnf, self.lnf_b, eps=1e-5).mean(1)
        return F.cross_entropy(pooled_bd @ self.w_head, labels)

    def stacked_grads(self) -> dict[str, torch.Tensor]:
        """Gradients in meshdsl's param shapes, for comparison."""
        cfg = self.cfg
        d, h, e = cfg.d_model, cfg.heads, cfg.d_head
        out = {k: getattr(self, k).grad for k in ("b_patch", "pos", "lnf", "lnf_b", "w_head")}
        out["w_patch"] = self.w_patch.grad.t()
        return {**out, **stacked_block_grads(self.blocks, d, h, e)}
