"""Held-out model (round 21a): VideoMAE-lite, a masked autoencoder on video clips.

Written from the user docs alone. A clip ``[batch, time, height, width, ch]`` (fed) is cut into
tubes of ``tt x ph x pw`` pixels by ``md.rearrange`` (``tokens`` = t' h' w'); a fed list of
visible token indices per clip picks the encoder's tokens (a one-hot contraction, the per-sample
gather of api.md), which a pre-norm transformer encodes (blocks under ``md.repeat`` over
``layer``). The decoder puts the encoded tokens back at their places and a learned mask token at
the masked ones (the transposed one-hot contractions), adds position embeddings, runs its own
blocks (``md.repeat`` over ``dec_layer``) and predicts each masked tube's pixels, normalised per
tube as VideoMAE does; the loss is the MSE on the masked tubes only.

Legend: b batch, t time, y height, x width, c ch, n tokens, k visible, m masked, p patch (tube
pixels), d d_model, h heads, e d_head, f d_ff, q d_dec.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    time: int = 8
    height: int = 16
    width: int = 16
    ch: int = 3
    tt: int = 2
    patch: int = 4
    visible: int = 16          # of tokens = (time/tt)(height/patch)(width/patch) = 64
    d_model: int = 48
    heads: int = 4
    d_ff: int = 96
    layers: int = 2
    d_dec: int = 32
    dec_layers: int = 1
    batch: int = 4
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(time=4, height=4, width=4, ch=2, tt=2, patch=2, visible=3, d_model=8, heads=2,
                   d_ff=16, layers=2, d_dec=8, dec_layers=2, batch=4)

    @property
    def tokens(self) -> int:
        return (self.time // self.tt) * (self.height // self.patch) * (self.width // self.patch)


def _block(x, p, seq: str, width: str, ff: str):
    """A pre-norm encoder block over tokens ``seq`` of width ``width`` (non-causal attention)."""
    h = md.layer_norm(x, width, p["ln1"])
    qkv = {n: md.einsum(f"batch {seq} {width}, {width} heads d_head -> batch {seq} heads d_head", h, p[f"w{n}"])
           for n in "qkv"}
    key = f"key_{seq}"
    a = md.attention(qkv["q"], md.rename(qkv["k"], {seq: key}), md.rename(qkv["v"], {seq: key}),
                     seq, key, "d_head", causal=False)
    x = x + md.einsum(f"batch {seq} heads d_head, heads d_head {width} -> batch {seq} {width}", a, p["wo"])
    h = md.layer_norm(x, width, p["ln2"])
    h = md.gelu(md.einsum(f"batch {seq} {width}, {width} {ff} -> batch {seq} {ff}", h, p["w_fc"]))
    return x + md.einsum(f"batch {seq} {ff}, {ff} {width} -> batch {seq} {width}", h, p["w_proj"])


def _stack(prefix: str, layer, width, ff, heads, d_head):
    L, W, F, H, E = layer, width, ff, heads, d_head
    lname = layer.name
    return {
        "ln1": md.param(f"{prefix}ln1", [L, W], init="ones"), "ln2": md.param(f"{prefix}ln2", [L, W], init="ones"),
        **{f"w{n}": md.param(f"{prefix}w{n}", [L, W, H, E], fan_out=[lname, "heads", "d_head"]) for n in "qkv"},
        "wo": md.param(f"{prefix}wo", [L, H, E, W], fan_out=[lname, W.name]),
        "w_fc": md.param(f"{prefix}w_fc", [L, W, F], fan_out=[lname, F.name]),
        "w_proj": md.param(f"{prefix}w_proj", [L, F, W], fan_out=[lname, W.name]),
    }


def build(cfg: Config = Config()) -> md.Model:
    B, T = md.Dim("batch", cfg.batch), md.Dim("time", cfg.time)
    Y, X, C = md.Dim("height", cfg.height), md.Dim("width", cfg.width), md.Dim("ch", cfg.ch)
    N, K = md.Dim("tokens", cfg.tokens), md.Dim("visible", cfg.visible)
    M = md.Dim("masked", cfg.tokens - cfg.visible)
    P = md.Dim("patch", cfg.tt * cfg.patch * cfg.patch * cfg.ch)
    D, Q, H = md.Dim("d_model", cfg.d_model), md.Dim("d_dec", cfg.d_dec), md.Dim("heads", cfg.heads)
    E, E2 = md.Dim("d_head", cfg.d_model // cfg.heads), md.Dim("d_head", cfg.d_dec // cfg.heads)
    F, F2 = md.Dim("d_ff", cfg.d_ff), md.Dim("d_ff_dec", 2 * cfg.d_dec)
    remat = None if cfg.remat == "none" else cfg.remat
    with md.Graph("videomae") as g:
        clip = md.input("clip", [B, T, Y, X, C])
        vis_ids = md.input("visible_ids", [B, K], torch.int64)
        mask_ids = md.input("masked_ids", [B, M], torch.int64)
        tubes = md.rearrange(clip, "batch (tt2 tt) (hp ph) (wp pw) ch -> batch (tt2 hp wp) (tt ph pw ch)",
                             tt=cfg.tt, ph=cfg.patch, pw=cfg.patch)
        tubes = md.rename(tubes, {"tt2_hp_wp": "tokens", "tt_ph_pw_ch": "patch"})
        pick_v, pick_m = md.one_hot(vis_ids, N), md.one_hot(mask_ids, N)     # [batch, visible|masked, tokens]
        w_emb = md.param("w_emb", [P, D], fan_out=["d_model"])
        pos = md.param("pos", [N, D], scale=0.02)
        emb = md.einsum("batch tokens patch, patch d_model -> batch tokens d_model", tubes, w_emb) + pos
        x = md.einsum("batch visible tokens, batch tokens d_model -> batch visible d_model", pick_v, emb)
        x = md.repeat(lambda h, p: _block(h, p, "visible", "d_model", "d_ff"), x,
                      _stack("", md.Dim("layer", cfg.layers), D, F, H, E), "layer", remat=remat)
        x = md.layer_norm(x, "d_model", md.param("lnf", [D], init="ones"))
        # the decoder: encoded tokens back at their places, the mask token at the others
        y = md.einsum("batch visible d_model, d_model d_dec -> batch visible d_dec", x,
                      md.param("w_enc2dec", [D, Q], fan_out=["d_dec"]))
        full = md.einsum("batch visible tokens, batch visible d_dec -> batch tokens d_dec", pick_v, y)
        mask_tok = md.param("mask_token", [Q], scale=0.02)
        full = full + md.einsum("batch masked tokens, d_dec -> batch tokens d_dec", pick_m, mask_tok)
        full = full + md.param("pos_dec", [N, Q], scale=0.02)
        full = md.repeat(lambda h, p: _block(h, p, "tokens", "d_dec", "d_ff_dec"), full,
                         _stack("dec_", md.Dim("dec_layer", cfg.dec_layers), Q, F2, H, E2), "dec_layer",
                         remat=remat)
        full = md.layer_norm(full, "d_dec", md.param("ln_dec", [Q], init="ones"))
        pred = md.einsum("batch tokens d_dec, d_dec patch -> batch tokens patch", full,
                         md.param("w_pix", [Q, P], fan_out=["patch"]))
        # targets: each tube normalised by its own mean and variance
        mu = md.reduce_mean(tubes, "patch")
        var = md.reduce_mean((tubes - mu) ** 2, "patch")
        target = (tubes - mu) * md.rsqrt(var + 1e-6)
        err = md.einsum("batch masked tokens, batch tokens patch -> batch masked patch", pick_m, pred - target)
        loss = md.reduce_mean(err * err)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        clip = torch.randn(cfg.batch, cfg.time, cfg.height, cfg.width, cfg.ch, generator=gen)
        perm = torch.stack([torch.randperm(cfg.tokens, generator=gen) for _ in range(cfg.batch)])
        return {"clip": clip, "visible_ids": perm[:, :cfg.visible].contiguous(),
                "masked_ids": perm[:, cfg.visible:].contiguous()}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("clip", "visible_ids", "masked_ids")


def reference_loss(cfg: Config, params: dict, clip, visible_ids, masked_ids):
    """VideoMAE-lite in plain torch (float64): reshape, index, scatter, nn-style blocks."""
    p = {k: v.double() for k, v in params.items()}
    F = torch.nn.functional
    b, t, hh, ww, c = clip.shape
    tubes = clip.double().reshape(b, t // cfg.tt, cfg.tt, hh // cfg.patch, cfg.patch, ww // cfg.patch, cfg.patch, c)
    tubes = tubes.permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(b, cfg.tokens, -1)

    def blocks(x, prefix, layers, heads):
        for i in range(layers):
            lp = {k[len(prefix):]: v[i] for k, v in p.items() if k.startswith(prefix) and v.dim() >= 2
                  and k[len(prefix):] in ("ln1", "ln2", "wq", "wk", "wv", "wo", "w_fc", "w_proj")}
            h = F.layer_norm(x, x.shape[-1:], lp["ln1"])
            q, k, v = (torch.einsum("bsd,dhe->bhse", h, lp[f"w{n}"]) for n in "qkv")
            a = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v
            x = x + torch.einsum("bhse,hed->bsd", a, lp["wo"])
            h = F.gelu(F.layer_norm(x, x.shape[-1:], lp["ln2"]) @ lp["w_fc"])
            x = x + h @ lp["w_proj"]
        return x

    emb = tubes @ p["w_emb"] + p["pos"]
    x = torch.gather(emb, 1, visible_ids[..., None].expand(-1, -1, emb.shape[-1]))
    x = F.layer_norm(blocks(x, "", cfg.layers, cfg.heads), x.shape[-1:], p["lnf"]) @ p["w_enc2dec"]
    full = p["mask_token"].expand(b, cfg.tokens, -1).clone()
    full.scatter_(1, visible_ids[..., None].expand(-1, -1, full.shape[-1]), x)
    full = blocks(full + p["pos_dec"], "dec_", cfg.dec_layers, cfg.heads)
    pred = F.layer_norm(full, full.shape[-1:], p["ln_dec"]) @ p["w_pix"]
    mu, var = tubes.mean(-1, keepdim=True), tubes.var(-1, unbiased=False, keepdim=True)
    target = (tubes - mu) / torch.sqrt(var + 1e-6)
    idx = masked_ids[..., None].expand(-1, -1, pred.shape[-1])
    return ((torch.gather(pred, 1, idx) - torch.gather(target, 1, idx)) ** 2).mean()
