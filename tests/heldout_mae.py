"""A masked autoencoder (MAE) ViT written from the README and docs/ alone (a held-out model).

Images ``[batch, height, width, channels]`` are patchified by ``md.rearrange``; each image's
kept patches are picked by a fed index tensor ``keep`` ``[batch, kept]`` (a per-sample random
choice made on the host) with ``md.gather`` of the embedded patches; an encoder runs over the
kept patches only. A light decoder puts each encoded patch back in its place (a one-hot of
``keep`` contracted over ``kept``), fills the other places with a learned mask token, adds
its own position embeddings, and predicts every patch's pixels. The loss is the mean squared
error over the masked patches only (per-patch normalised targets), divided by their count,
which is made from the inputs alone.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 16
    patch: int = 4
    channels: int = 3
    keep: int = 4            # patches kept per image (of (image / patch) ** 2)
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    d_dec: int = 16
    dec_heads: int = 2
    dec_layers: int = 2
    batch: int = 4

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=8, patch=2, channels=2, keep=4, d_model=16, heads=4, d_head=4, d_ff=32, layers=2,
                   d_dec=8, dec_heads=2, dec_layers=2, batch=4)


def _block(x: md.Tensor, p: dict[str, md.Tensor], seq: str, width: str, heads: str, ff: str) -> md.Tensor:
    """A pre-norm encoder block over ``seq`` (non-causal fused attention, gelu MLP)."""
    key = "key_" + seq
    h = md.layer_norm(x, width, p["ln1"], p["ln1_b"])
    q = md.einsum(f"batch {seq} {width}, {width} {heads} d_head -> batch {seq} {heads} d_head", h, p["wq"])
    k = md.einsum(f"batch {seq} {width}, {width} {heads} d_head -> batch {seq} {heads} d_head", h, p["wk"])
    v = md.einsum(f"batch {seq} {width}, {width} {heads} d_head -> batch {seq} {heads} d_head", h, p["wv"])
    k, v = md.rename(k, {seq: key}), md.rename(v, {seq: key})
    o = md.attention(q, k, v, seq, key, "d_head", causal=False)
    x = x + md.einsum(f"batch {seq} {heads} d_head, {heads} d_head {width} -> batch {seq} {width}", o, p["wo"])
    h = md.layer_norm(x, width, p["ln2"], p["ln2_b"])
    h = md.gelu(md.einsum(f"batch {seq} {width}, {width} {ff} -> batch {seq} {ff}", h, p["w_fc"]))
    return x + md.einsum(f"batch {seq} {ff}, {ff} {width} -> batch {seq} {width}", h, p["w_proj"])


def _block_params(prefix: str, layer: md.Dim, width: md.Dim, heads: md.Dim, d_head: md.Dim, ff: md.Dim) -> dict:
    L = "layer" if prefix == "" else layer.name
    return {
        "ln1": md.param(prefix + "ln1", [layer, width], init="ones"),
        "ln1_b": md.param(prefix + "ln1_b", [layer, width], init="zeros"),
        "wq": md.param(prefix + "wq", [layer, width, heads, d_head], fan_out=[L, heads, d_head]),
        "wk": md.param(prefix + "wk", [layer, width, heads, d_head], fan_out=[L, heads, d_head]),
        "wv": md.param(prefix + "wv", [layer, width, heads, d_head], fan_out=[L, heads, d_head]),
        "wo": md.param(prefix + "wo", [layer, heads, d_head, width], fan_out=[L, width]),
        "ln2": md.param(prefix + "ln2", [layer, width], init="ones"),
        "ln2_b": md.param(prefix + "ln2_b", [layer, width], init="zeros"),
        "w_fc": md.param(prefix + "w_fc", [layer, width, ff], fan_out=[L, ff]),
        "w_proj": md.param(prefix + "w_proj", [layer, ff, width], fan_out=[L, width]),
    }


def build(cfg: Config = Config()) -> md.Model:
    side = cfg.image // cfg.patch
    n_patches, d_patch_n = side * side, cfg.patch * cfg.patch * cfg.channels
    batch = md.Dim("batch", cfg.batch)
    height, width_, channels = md.Dim("height", cfg.image), md.Dim("width", cfg.image), md.Dim("channels", cfg.channels)
    patches, kept, d_patch = md.Dim("patches", n_patches), md.Dim("kept", cfg.keep), md.Dim("d_patch", d_patch_n)
    d_model, heads, d_head, d_ff = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    d_dec, dec_heads, dec_ff = md.Dim("d_dec", cfg.d_dec), md.Dim("dec_heads", cfg.dec_heads), md.Dim("dec_ff", 2 * cfg.d_dec)
    layer, dec_layer = md.Dim("layer", cfg.layers), md.Dim("dec_layer", cfg.dec_layers)
    with md.Graph("heldout_mae") as g:
        images = md.input("images", [batch, height, width_, channels])
        keep = md.input("keep", [batch, kept], dtype=torch.int64)
        w_embed = md.param("w_embed", [d_patch, d_model], fan_out=[d_model])
        pos = md.param("pos", [patches, d_model], scale=0.02)
        enc = _block_params("", layer, d_model, heads, d_head, d_ff)
        ln_f, ln_f_b = md.param("ln_f", [d_model], init="ones"), md.param("ln_f_b", [d_model], init="zeros")
        w_dec = md.param("w_dec", [d_model, d_dec], fan_out=[d_dec])
        mask_token = md.param("mask_token", [d_dec], scale=0.02)
        dec_pos = md.param("dec_pos", [patches, d_dec], scale=0.02)
        dec = _block_params("dec_", dec_layer, d_dec, dec_heads, d_head, dec_ff)
        w_pred = md.param("w_pred", [d_dec, d_patch], fan_out=[d_patch])

        x = md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)", ph=cfg.patch, pw=cfg.patch)
        x = md.rename(x, {"hp_wp": "patches", "ph_pw_channels": "d_patch"})
        target = md.layer_norm(x, "d_patch")             # MAE's per-patch normalised pixels
        tokens = md.einsum("batch patches d_patch, d_patch d_model -> batch patches d_model", x, w_embed) + pos
        # each image's kept patches, [batch, kept, d_model]: md.gather picks rows of one table for all
        # ids (ids and table sharing 'batch' is refused), so a per-sample pick is a one-hot contraction
        place = md.cast(md.one_hot(keep, patches), torch.float32)           # [batch, kept, patches]
        h = md.einsum("batch kept patches, batch patches d_model -> batch kept d_model", place, tokens)
        h = md.repeat(lambda t, p: _block(t, p, "kept", "d_model", "heads", "d_ff"), h, enc, "layer")
        h = md.layer_norm(h, "d_model", ln_f, ln_f_b)
        h = md.einsum("batch kept d_model, d_model d_dec -> batch kept d_dec", h, w_dec)

        visible = md.reduce_sum(place, "kept")                              # [batch, patches]: 1 where kept
        full = md.einsum("batch kept patches, batch kept d_dec -> batch patches d_dec", place, h)
        full = full + (1.0 - visible) * mask_token + dec_pos
        full = md.repeat(lambda t, p: _block(t, p, "patches", "d_dec", "dec_heads", "dec_ff"), full, dec, "dec_layer")
        pred = md.einsum("batch patches d_dec, d_dec d_patch -> batch patches d_patch", full, w_pred)
        err = md.reduce_mean((pred - target) ** 2, "d_patch")               # [batch, patches]
        masked = 1.0 - visible
        loss = md.reduce_sum(err * masked) / md.reduce_sum(masked)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        imgs = torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen)
        order = torch.stack([torch.randperm(n_patches, generator=gen) for _ in range(cfg.batch)])
        return {"images": imgs, "keep": order[:, :cfg.keep].sort(dim=1).values}

    params = {"w_embed": w_embed, "pos": pos, **enc, "ln_f": ln_f, "ln_f_b": ln_f_b, "w_dec": w_dec,
              "mask_token": mask_token, "dec_pos": dec_pos, **{"dec_" + k: v for k, v in dec.items()}, "w_pred": w_pred}
    return md.Model(g, loss, params, feeds, cfg)
