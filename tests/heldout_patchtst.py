"""A PatchTST-style time-series forecaster with RevIN, written from the README and docs/ alone
(a held-out model).

Legend: ``channels`` the series of a sample (each forecast on its own: a batch dim),
``time`` the look-back window, ``patches`` x ``patch_len`` the window cut into patches,
``horizon`` the steps forecast.

RevIN normalises each series by its own mean and standard deviation over ``time`` (with a
learned per-channel affine), and the forecast is denormalised with the same statistics. The
window is cut into patches by ``md.rearrange`` (``(patches patch_len)``), each patch embedded by
an einsum plus a learned position embedding, and a pre-norm transformer encoder (``md.repeat``
over ``layer``, non-causal ``md.attention`` over ``patches``) runs over the patches of each
series. A linear head reads the flattened ``(patches d_model)`` and predicts the horizon; the
loss is the mean squared error to the future values.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    channels: int = 7
    time: int = 64
    patch_len: int = 8
    horizon: int = 16
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    batch: int = 8

    @classmethod
    def tiny(cls) -> "Config":
        return cls(channels=3, time=12, patch_len=3, horizon=4, d_model=8, heads=2, d_head=4, d_ff=12, layers=2,
                   batch=4)


def build(cfg: Config = Config()) -> md.Model:
    assert cfg.time % cfg.patch_len == 0, "time must be a multiple of patch_len"
    num_patches = cfg.time // cfg.patch_len
    batch, channels, time = md.Dim("batch", cfg.batch), md.Dim("channels", cfg.channels), md.Dim("time", cfg.time)
    horizon, layer = md.Dim("horizon", cfg.horizon), md.Dim("layer", cfg.layers)
    patches, patch_len = md.Dim("patches", num_patches), md.Dim("patch_len", cfg.patch_len)
    d_model, heads, d_head, d_ff = (md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads),
                                    md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff))
    flat = md.Dim("patches_d_model", num_patches * cfg.d_model)
    with md.Graph("heldout_patchtst") as g:
        x = md.input("x", [batch, channels, time])
        y = md.input("y", [batch, channels, horizon])
        rev_w = md.param("rev_w", [channels], init="ones")
        rev_b = md.param("rev_b", [channels], init="zeros")
        w_patch = md.param("w_patch", [patch_len, d_model], fan_out=["d_model"])
        pos = md.param("pos", [patches, d_model], scale=0.02)
        blocks = {
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "w1": md.param("w1", [layer, d_model, d_ff], fan_out=["layer", "d_ff"]),
            "w2": md.param("w2", [layer, d_ff, d_model], fan_out=["layer", "d_model"]),
        }
        head = md.param("head", [flat, horizon], fan_out=["horizon"])

        mean = md.reduce_mean(x, "time")                                   # [batch, channels]
        std = md.sqrt(md.reduce_mean((x - mean) ** 2, "time") + 1e-5)
        xn = (x - mean) / std * rev_w + rev_b
        xp = md.rearrange(xn, "batch channels (patches patch_len) -> batch channels patches patch_len",
                          patch_len=cfg.patch_len)
        h = md.einsum("batch channels patches patch_len, patch_len d_model -> batch channels patches d_model",
                      xp, w_patch) + pos

        def block(h: md.Tensor, p: dict) -> md.Tensor:
            u = md.layer_norm(h, "d_model", p["ln1"])
            q = md.einsum("batch channels patches d_model, d_model heads d_head -> batch channels patches heads d_head",
                          u, p["wq"])
            kv = md.rename(u, patches="key_patches")
            k = md.einsum("batch channels key_patches d_model, d_model heads d_head -> "
                          "batch channels key_patches heads d_head", kv, p["wk"])
            v = md.einsum("batch channels key_patches d_model, d_model heads d_head -> "
                          "batch channels key_patches heads d_head", kv, p["wv"])
            a = md.attention(q, k, v, "patches", "key_patches", "d_head", causal=False)
            h = h + md.einsum("batch channels patches heads d_head, heads d_head d_model -> "
                              "batch channels patches d_model", a, p["wo"])
            f = md.gelu(md.einsum("batch channels patches d_model, d_model d_ff -> batch channels patches d_ff",
                                  md.layer_norm(h, "d_model", p["ln2"]), p["w1"]))
            return h + md.einsum("batch channels patches d_ff, d_ff d_model -> batch channels patches d_model",
                                 f, p["w2"])

        h = md.repeat(block, h, blocks, "layer")
        h = md.rearrange(h, "batch channels patches d_model -> batch channels (patches d_model)")
        out = md.einsum("batch channels patches_d_model, patches_d_model horizon -> batch channels horizon", h, head)
        forecast = (out - rev_b) / (rev_w + 1e-10) * std + mean
        loss = md.reduce_mean((forecast - y) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = torch.arange(cfg.time + cfg.horizon, dtype=torch.float32)
        period = 4 + 8 * torch.rand(cfg.batch, cfg.channels, 1, generator=gen)
        level = 10 * torch.randn(cfg.batch, cfg.channels, 1, generator=gen)
        amp = 1 + 3 * torch.rand(cfg.batch, cfg.channels, 1, generator=gen)
        series = level + amp * torch.sin(2 * torch.pi * t / period) + 0.3 * torch.randn(
            cfg.batch, cfg.channels, len(t), generator=gen)
        return {"x": series[..., :cfg.time].contiguous(), "y": series[..., cfg.time:].contiguous()}

    params = {"rev_w": rev_w, "rev_b": rev_b, "w_patch": w_patch, "pos": pos, **blocks, "head": head}
    return md.Model(g, loss, params, feeds, cfg, outputs={"forecast": forecast})
