"""A Stable-Diffusion-style U-Net block stack, written from the README and docs/ alone (a held-out model).

Images in the user's own NHWC letters: ``N`` images, ``H`` x ``W`` pixels, ``C`` channels. A
flow-matching objective: clean images ``x0`` and noise make ``xt = (1 - s) x0 + s noise`` for a fed
integer timestep ``t`` (``s = t / steps``); the net predicts the velocity ``noise - x0``, MSE loss.
The timestep's sinusoidal embedding (sines and cosines joined by ``md.concat``) goes through a SiLU
MLP to ``E``. ResNet blocks: GroupNorm written from reductions over ``(H, W, Cg)`` after a
``md.rearrange`` of the channels into ``(G Cg)``, SiLU, a 3x3 ``md.conv``, FiLM (a scale and a shift
projected from the timestep embedding), GroupNorm, SiLU, a 3x3 conv, the residual. Down: a 3x3
conv of stride 2 to the half-size grid ``h`` x ``w`` with ``D`` channels. The mid stack, a
``md.repeat`` over ``B`` blocks, each a ResNet block, spatial self-attention over the merged pixels
``(h w)`` and cross-attention to the text tokens ``T``. Up: an einsum to ``(ph pw C)`` and a
``md.rearrange`` back to ``H`` x ``W``, the level-1 skip joined by ``md.concat`` and a 1x1 conv,
a ResNet block, GroupNorm, SiLU and a 3x3 conv to the image channels.

Legend: N = image, H/W = pixel rows/cols, h/w = the half grid, C/D = channels, G = groups,
T = text tokens, U = text features, E = timestep features, A = heads, e = head features.
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    images: int = 8
    size: int = 32
    rgb: int = 3
    C: int = 64
    D: int = 128
    groups: int = 8
    tokens: int = 16
    text: int = 64
    E: int = 128
    heads: int = 4
    blocks: int = 2
    steps: int = 1000
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(images=2, size=8, rgb=3, C=4, D=8, groups=2, tokens=3, text=4, E=8, heads=2, blocks=2, steps=100)


def group_norm(x: md.Tensor, ch: str, spatial: list[str], groups: int, g: md.Tensor, b: md.Tensor) -> md.Tensor:
    """GroupNorm of ``x [N, spatial..., ch]``: mean and variance over the spatial dims and each group's channels."""
    names = " ".join(n for n in x.shape.names if n != ch)
    gc = f"{ch}_G {ch}_Cg"                     # the channels cut into (groups, channels per group)
    xg = md.rearrange(x, f"{names} ({gc}) -> {names} {gc}", **{f"{ch}_G": groups})
    over = [*spatial, f"{ch}_Cg"]
    mean = md.reduce_mean(xg, over)
    var = md.reduce_mean((xg - mean) ** 2, over)
    xn = md.rearrange((xg - mean) * md.rsqrt(var + 1e-5), f"{names} {gc} -> {names} ({gc})")
    return md.rename(xn, {f"{ch}_G_{ch}_Cg": ch}) * g + b


def build(cfg: Config = Config()) -> md.Model:
    half = cfg.E // 2
    N, H, W, R = md.Dim("N", cfg.images), md.Dim("H", cfg.size), md.Dim("W", cfg.size), md.Dim("R", cfg.rgb)
    C, C2, D, D2 = md.Dim("C", cfg.C), md.Dim("C2", cfg.C), md.Dim("D", cfg.D), md.Dim("D2", cfg.D)
    T, U, E, E2, F = md.Dim("T", cfg.tokens), md.Dim("U", cfg.text), md.Dim("E", cfg.E), md.Dim("E2", cfg.E), md.Dim("F", half)
    kh, kw, B = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("B", cfg.blocks)
    A, e = md.Dim("A", cfg.heads), md.Dim("e", cfg.D // cfg.heads)
    K, P = md.Dim("K", 2 * cfg.C), md.Dim("P", 4 * cfg.C)
    conv2 = {"H": "kh", "W": "kw"}
    with md.Graph("heldout_sdunet") as g:
        x0, noise = md.input("x0", [N, H, W, R]), md.input("noise", [N, H, W, R])
        t = md.input("t", [N], dtype=torch.int64)
        text = md.input("text", [N, T, U])

        def res_params(pre: str, c: md.Dim, c2: md.Dim, stack: list) -> dict:
            fo = [s.name for s in stack]
            return {f"{pre}g1": md.param(f"{pre}g1", [*stack, c], init="ones"),
                    f"{pre}b1": md.param(f"{pre}b1", [*stack, c], init="zeros"),
                    f"{pre}conv1": md.param(f"{pre}conv1", [*stack, kh, kw, c, c2], fan_out=[*fo, c2.name]),
                    f"{pre}film_s": md.param(f"{pre}film_s", [*stack, E2, c2], fan_out=[*fo, c2.name]),
                    f"{pre}film_b": md.param(f"{pre}film_b", [*stack, E2, c2], fan_out=[*fo, c2.name]),
                    f"{pre}g2": md.param(f"{pre}g2", [*stack, c2], init="ones"),
                    f"{pre}b2": md.param(f"{pre}b2", [*stack, c2], init="zeros"),
                    f"{pre}conv2": md.param(f"{pre}conv2", [*stack, kh, kw, c2, c], fan_out=[*fo, c.name])}

        p = {"t1": md.param("t1", [md.Dim("F", 2 * half), E], fan_out=["E"]),
             "t2": md.param("t2", [E, E2], fan_out=["E2"]),
             "conv_in": md.param("conv_in", [kh, kw, R, C], fan_out=["C"]),
             **res_params("enc_", C, C2, []),
             "down": md.param("down", [kh, kw, C, D], fan_out=["D"]),
             "up": md.param("up", [D, P], fan_out=["P"]),
             "merge": md.param("merge", [K, C2], fan_out=["C2"]),
             **res_params("dec_", C, C2, []),
             "g_out": md.param("g_out", [C], init="ones"), "b_out": md.param("b_out", [C], init="zeros"),
             "conv_out": md.param("conv_out", [kh, kw, C, md.Dim("R2", cfg.rgb)], fan_out=["R2"])}
        mid = res_params("", D, D2, [B])
        for n in ("q", "k", "v", "cq"):
            mid[f"w{n}"] = md.param(f"w{n}", [B, D, A, e], fan_out=["B", "A", "e"])
        for n in ("ck", "cv"):
            mid[f"w{n}"] = md.param(f"w{n}", [B, U, A, e], fan_out=["B", "A", "e"])
        for n in ("o", "co"):
            mid[f"w{n}"] = md.param(f"w{n}", [B, A, e, D2], fan_out=["B", "D2"])
        for n in ("ln1", "ln2"):
            mid[f"{n}_g"] = md.param(f"{n}_g", [B, D], init="ones")
            mid[f"{n}_b"] = md.param(f"{n}_b", [B, D], init="zeros")

        s = md.cast(t, torch.float32) * (1.0 / cfg.steps)
        xt = x0 * (1.0 - s) + noise * s
        freqs = md.constant(torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half), [F])
        ang = md.cast(t, torch.float32) * freqs                               # [N, F]
        temb = md.concat([md.sin(ang), md.cos(ang)], "F")
        temb = md.einsum("N E, E E2 -> N E2", md.silu(md.einsum("N F, F E -> N E", temb, p["t1"])), p["t2"])
        temb = md.silu(temb)

        def resnet(x: md.Tensor, q: dict, pre: str, c: str, c2: str, sp: list[str], groups: int) -> md.Tensor:
            taps = {sp[0]: "kh", sp[1]: "kw"}
            y = md.silu(group_norm(x, c, sp, groups, q[f"{pre}g1"], q[f"{pre}b1"]))
            y = md.conv(y, q[f"{pre}conv1"], taps)                           # [N, sp.., c2]
            scale = md.einsum(f"N E2, E2 {c2} -> N {c2}", temb, q[f"{pre}film_s"])
            shift = md.einsum(f"N E2, E2 {c2} -> N {c2}", temb, q[f"{pre}film_b"])
            y = y * (1.0 + scale) + shift
            y = md.silu(group_norm(y, c2, sp, groups, q[f"{pre}g2"], q[f"{pre}b2"]))
            y = md.conv(y, q[f"{pre}conv2"], taps)                           # [N, sp.., c]
            return x + y

        def mid_block(x: md.Tensor, q: dict) -> md.Tensor:       # x [N, h, w, D]
            x = resnet(x, q, "", "D", "D2", ["h", "w"], cfg.groups)
            tok = md.rearrange(x, "N h w D -> N (h w) D")                       # [N, h_w, D]
            y = md.layer_norm(tok, "D", q["ln1_g"], q["ln1_b"])
            qh = md.einsum("N h_w D, D A e -> N h_w A e", y, q["wq"])
            kh_ = md.rename(md.einsum("N h_w D, D A e -> N h_w A e", y, q["wk"]), h_w="kv")
            vh = md.rename(md.einsum("N h_w D, D A e -> N h_w A e", y, q["wv"]), h_w="kv")
            att = md.attention(qh, kh_, vh, "h_w", "kv", "e", causal=False)
            tok = tok + md.rename(md.einsum("N h_w A e, A e D2 -> N h_w D2", att, q["wo"]), D2="D")
            y = md.layer_norm(tok, "D", q["ln2_g"], q["ln2_b"])
            qc = md.einsum("N h_w D, D A e -> N h_w A e", y, q["wcq"])
            kc = md.einsum("N T U, U A e -> N T A e", text, q["wck"])
            vc = md.einsum("N T U, U A e -> N T A e", text, q["wcv"])
            att = md.attention(qc, kc, vc, "h_w", "T", "e", causal=False)
            tok = tok + md.rename(md.einsum("N h_w A e, A e D2 -> N h_w D2", att, q["wco"]), D2="D")
            return md.rearrange(tok, "N (h w) D -> N h w D", h=cfg.size // 2)

        h1 = md.conv(xt, p["conv_in"], conv2)                                   # [N, H, W, C]
        h1 = resnet(h1, p, "enc_", "C", "C2", ["H", "W"], cfg.groups)
        h = md.conv(h1, p["down"], conv2, padding=(1, 1), stride=2)             # [N, H/2, W/2, D]
        h = md.rename(h, H="h", W="w")
        h = md.repeat(mid_block, h, mid, "B", remat=cfg.remat)
        h = md.einsum("N h w D, D P -> N h w P", h, p["up"])
        h = md.rearrange(h, "N h w (ph pw C) -> N (h ph) (w pw) C", ph=2, pw=2)
        h = md.rename(h, h_ph="H", w_pw="W")
        h = md.rename(md.concat([h, h1], "C"), C="K")
        h = md.rename(md.einsum("N H W K, K C2 -> N H W C2", h, p["merge"]), C2="C")
        h = resnet(h, p, "dec_", "C", "C2", ["H", "W"], cfg.groups)
        h = md.silu(group_norm(h, "C", ["H", "W"], cfg.groups, p["g_out"], p["b_out"]))
        pred = md.rename(md.conv(h, p["conv_out"], conv2), R2="R")
        loss = md.reduce_mean((pred - (noise - x0)) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        shape = (cfg.images, cfg.size, cfg.size, cfg.rgb)
        return {"x0": torch.randn(shape, generator=gen), "noise": torch.randn(shape, generator=gen),
                "t": torch.randint(0, cfg.steps, (cfg.images,), generator=gen),
                "text": torch.randn(cfg.images, cfg.tokens, cfg.text, generator=gen)}

    return md.Model(g, loss, {**p, **mid}, feeds, cfg)
