"""A DiT (diffusion transformer), written from the README and docs/ alone (a held-out model).

Noisy latents ``[batch, height, width, channels]`` are patchified by ``md.rearrange`` and
projected; a timestep's sinusoidal embedding (``md.sin``/``md.cos`` of the step times
geometric frequencies, ``md.concat`` over a ``sincos`` dim) and a class embedding (gathered)
make the conditioning vector ``c [batch, d_model]``. Each layer of the ``md.repeat`` stack
maps ``silu(c)`` to six per-sample modulation vectors (shift, scale, gate for attention and for
the MLP: a ``[layer, d_model, mods, d_model]`` weight, zero-initialised as adaLN-Zero does
with a small random part so gradients are not all zero) and applies them broadcast over the
patches: ``x + gate * f(ln(x) * (1 + scale) + shift)``. The final layer is modulated the same
way, projected back to patch pixels, unpatchified by ``md.rearrange`` and compared with the
noise by a mean squared error.

Legend: b = batch, n = patches, d = d_model, m = mods (the six modulation vectors).
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 16
    patch: int = 2
    channels: int = 4
    classes: int = 10
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 256
    freq: int = 16          # sinusoid frequencies of the timestep embedding
    layers: int = 2
    batch: int = 8
    steps: int = 1000

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=8, patch=2, channels=2, classes=5, d_model=16, heads=2, d_head=8, d_ff=32, freq=4,
                   layers=2, batch=4)


def timestep_embedding(t: md.Tensor, freq: md.Dim, max_period: float = 10000.0) -> md.Tensor:
    """[batch] float steps -> [batch, sincos, freq]: cos and sin of t * max_period^(-i/freq)."""
    f = md.constant(torch.exp(-math.log(max_period) * torch.arange(freq.size, dtype=torch.float32) / freq.size),
                    [freq])
    arg = t * f
    return md.concat([md.unsqueeze(md.cos(arg), "sincos"), md.unsqueeze(md.sin(arg), "sincos")], "sincos")


def _modulate(x: md.Tensor, shift: md.Tensor, scale: md.Tensor) -> md.Tensor:
    return x * (1.0 + scale) + shift          # [batch, d_model] broadcast over the patches


def build(cfg: Config = Config()) -> md.Model:
    n = cfg.image // cfg.patch
    batch, d_model, d_ff = md.Dim("batch", cfg.batch), md.Dim("d_model", cfg.d_model), md.Dim("d_ff", cfg.d_ff)
    heads, d_head, layer = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("layer", cfg.layers)
    d_patch = md.Dim("d_patch", cfg.patch * cfg.patch * cfg.channels)
    freq, classes = md.Dim("freq", cfg.freq), md.Dim("classes", cfg.classes)
    mods, mods_f = md.Dim("mods", 6), md.Dim("mods_f", 2)
    d_cond = md.Dim("d_cond", cfg.d_model)
    with md.Graph("heldout_dit") as g:
        noisy = md.input("noisy", [batch, md.Dim("height", cfg.image), md.Dim("width", cfg.image),
                                   md.Dim("channels", cfg.channels)])
        noise = md.input("noise", noisy.shape)
        steps = md.input("steps", [batch], dtype=torch.int64)
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_in = md.param("w_in", [d_patch, d_model], fan_out=[d_model])
        pos = md.param("pos", [md.Dim("patches", n * n), d_model], scale=0.1)
        w_t1 = md.param("w_t1", [md.Dim("sincos", 2), freq, d_cond], fan_out=[d_cond])
        w_t2 = md.param("w_t2", [d_cond, d_model], fan_out=[d_model])
        y_table = md.param("y_table", [classes, d_model], scale=0.5)
        stack = {
            "ada": md.param("ada", [layer, d_model, mods, md.Dim("d_mod", cfg.d_model)],
                            fan_out=["layer", "mods", "d_mod"], scale=0.1),   # adaLN-Zero, small not zero
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "w1": md.param("w1", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w2": md.param("w2", [layer, d_ff, d_model], fan_out=["layer", d_model]),
        }
        ada_f = md.param("ada_f", [d_model, mods_f, md.Dim("d_mod", cfg.d_model)], fan_out=["mods_f", "d_mod"],
                         scale=0.1)
        w_out = md.param("w_out", [d_model, d_patch], fan_out=[d_patch])

        # conditioning: timestep MLP + class embedding
        temb = timestep_embedding(md.cast(steps, torch.float32), freq)
        c = md.silu(md.einsum("batch sincos freq, sincos freq d_cond -> batch d_cond", temb, w_t1))
        c = md.einsum("batch d_cond, d_cond d_model -> batch d_model", c, w_t2) + md.gather(y_table, labels, "classes")
        c_act = md.silu(c)

        # patchify
        x = md.rearrange(noisy, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)",
                         ph=cfg.patch, pw=cfg.patch)
        x = md.rename(x, {"hp_wp": "patches", "ph_pw_channels": "d_patch"})
        x = md.einsum("batch patches d_patch, d_patch d_model -> batch patches d_model", x, w_in) + pos

        def block(h: md.Tensor, p: dict) -> md.Tensor:
            m = md.einsum("batch d_model, d_model mods d_mod -> batch mods d_mod", c_act, p["ada"])
            m = md.rename(m, d_mod="d_model")
            shift1, scale1, gate1, shift2, scale2, gate2 = (md.squeeze(md.slice_(m, "mods", i, i + 1), "mods")
                                                            for i in range(6))
            x = _modulate(md.layer_norm(h, "d_model"), shift1, scale1)
            q = md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", x, p["wq"])
            k = md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", x, p["wk"])
            v = md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", x, p["wv"])
            k, v = md.rename(k, patches="key_patches"), md.rename(v, patches="key_patches")
            o = md.attention(q, k, v, "patches", "key_patches", "d_head", causal=False)
            h = h + gate1 * md.einsum("batch patches heads d_head, heads d_head d_model -> batch patches d_model",
                                      o, p["wo"])
            x = _modulate(md.layer_norm(h, "d_model"), shift2, scale2)
            x = md.gelu(md.einsum("batch patches d_model, d_model d_ff -> batch patches d_ff", x, p["w1"]))
            return h + gate2 * md.einsum("batch patches d_ff, d_ff d_model -> batch patches d_model", x, p["w2"])

        h = md.repeat(block, x, stack, "layer")
        mf = md.rename(md.einsum("batch d_model, d_model mods_f d_mod -> batch mods_f d_mod", c_act, ada_f),
                       d_mod="d_model")
        shift, scale = (md.squeeze(md.slice_(mf, "mods_f", i, i + 1), "mods_f") for i in range(2))
        h = _modulate(md.layer_norm(h, "d_model"), shift, scale)
        out = md.einsum("batch patches d_model, d_model d_patch -> batch patches d_patch", h, w_out)
        out = md.rename(out, {"patches": "hp_wp", "d_patch": "ph_pw_channels"})
        img = md.rearrange(out, "batch (hp wp) (ph pw channels) -> batch (hp ph) (wp pw) channels",
                           hp=n, ph=cfg.patch, pw=cfg.patch)
        img = md.rename(img, {"hp_ph": "height", "wp_pw": "width"})
        loss = md.reduce_mean((img - noise) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        shape = (cfg.batch, cfg.image, cfg.image, cfg.channels)
        return {"noisy": torch.randn(*shape, generator=gen), "noise": torch.randn(*shape, generator=gen),
                "steps": torch.randint(0, cfg.steps, (cfg.batch,), generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"w_in": w_in, "pos": pos, "w_t1": w_t1, "w_t2": w_t2, "y_table": y_table, **stack,
              "ada_f": ada_f, "w_out": w_out}
    return md.Model(g, loss, params, feeds, cfg)
