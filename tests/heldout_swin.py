"""A Swin-style vision transformer, written from the README and docs/ alone (a held-out model).

Images ``[batch, height, width, channels]`` are cut into patches by ``md.rearrange`` and
embedded into a token grid ``[batch, hp, wp, d_model]`` that stays two-dimensional. Each layer
of the ``md.repeat`` stack is a pair of blocks: window attention (the grid cut into
``window x window`` windows by a rearrange, attention inside each window, the windows merged
back), then shifted-window attention (the grid rolled by ``window // 2`` along both axes with
``md.roll``, windowed, masked so that a token attends only to tokens of its own region, the
windows merged and the grid rolled back). Each window attention adds a learned relative
position bias (a table ``[rel_pos, heads]`` indexed by a constant of relative offsets, read
with ``md.gather``). LayerNorm, a gelu MLP, a mean-pooled head and a cross-entropy over classes.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 32
    patch: int = 2
    channels: int = 3
    window: int = 4
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    classes: int = 10
    batch: int = 8

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=16, patch=2, channels=3, window=4, d_model=16, heads=2, d_head=8, d_ff=32,
                   layers=2, classes=5, batch=4)


def shift_mask(grid: int, window: int) -> torch.Tensor:
    """Swin's mask of the shifted windows: ``[nh, nw, win, key_win]``, True where a query may attend."""
    shift = window // 2
    region = torch.zeros(grid, grid, dtype=torch.int64)
    cuts = (slice(0, grid - window), slice(grid - window, grid - shift), slice(grid - shift, grid))
    for i, rows in enumerate(cuts):
        for j, cols in enumerate(cuts):
            region[rows, cols] = 3 * i + j
    n = grid // window
    win = region.reshape(n, window, n, window).permute(0, 2, 1, 3).reshape(n, n, window * window)
    return win[:, :, :, None] == win[:, :, None, :]


def relative_index(window: int) -> torch.Tensor:
    """Swin's relative position index: ``[win, key_win]`` in ``0 .. (2 window - 1)^2 - 1``."""
    ys, xs = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    dy = ys[:, None] - ys[None, :] + window - 1
    dx = xs[:, None] - xs[None, :] + window - 1
    return dy * (2 * window - 1) + dx


def build(cfg: Config = Config()) -> md.Model:
    grid = cfg.image // cfg.patch
    assert grid % cfg.window == 0, "the token grid must be a whole number of windows"
    n_win, win_len, shift = grid // cfg.window, cfg.window * cfg.window, cfg.window // 2
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    channels, patch_in = md.Dim("channels", cfg.channels), md.Dim("ph_pw_channels", cfg.patch ** 2 * cfg.channels)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, classes, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    rel_pos = md.Dim("rel_pos", (2 * cfg.window - 1) ** 2)
    nh, nw = md.Dim("nh", n_win), md.Dim("nw", n_win)
    win, key_win = md.Dim("win", win_len), md.Dim("key_win", win_len)
    scale = cfg.d_head ** -0.5
    with md.Graph("heldout_swin") as g:
        images = md.input("images", [batch, height, width, channels])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_embed = md.param("w_embed", [patch_in, d_model], fan_out=[d_model])
        b_embed = md.param("b_embed", [d_model], init="zeros")
        blocks = {}
        for part in ("w", "sw"):   # the window block and the shifted-window block of each layer
            blocks.update({
                f"{part}_ln1": md.param(f"{part}_ln1", [layer, d_model], init="ones"),
                f"{part}_wqkv": md.param(f"{part}_wqkv", [layer, md.Dim("qkv", 3), d_model, heads, d_head],
                                         fan_out=["layer", "qkv", heads, d_head]),
                f"{part}_rel": md.param(f"{part}_rel", [layer, rel_pos, heads], scale=0.02),
                f"{part}_wo": md.param(f"{part}_wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
                f"{part}_ln2": md.param(f"{part}_ln2", [layer, d_model], init="ones"),
                f"{part}_w1": md.param(f"{part}_w1", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
                f"{part}_w2": md.param(f"{part}_w2", [layer, d_ff, d_model], fan_out=["layer", d_model]),
            })
        ln_f = md.param("ln_f", [d_model], init="ones")
        w_head = md.param("w_head", [d_model, classes], fan_out=[classes])

        rel_idx = md.constant(relative_index(cfg.window), [win, key_win])
        allowed = md.constant(shift_mask(grid, cfg.window), [nh, nw, win, key_win])

        def windows(x: md.Tensor) -> md.Tensor:
            """[batch, hp, wp, d_model] -> [batch, nh, nw, win, d_model]."""
            x = md.rearrange(x, "batch (nh wh) (nw ww) d_model -> batch nh nw (wh ww) d_model",
                             wh=cfg.window, ww=cfg.window)
            return md.rename(x, wh_ww="win")

        def merge(x: md.Tensor) -> md.Tensor:
            """[batch, nh, nw, win, d_model] -> [batch, hp, wp, d_model]."""
            x = md.rearrange(x, "batch nh nw (wh ww) d_model -> batch (nh wh) (nw ww) d_model",
                             wh=cfg.window, ww=cfg.window)
            return md.rename(x, nh_wh="hp", nw_ww="wp")

        def attend(x: md.Tensor, p: dict[str, md.Tensor], part: str, mask: md.Tensor | None) -> md.Tensor:
            h = md.layer_norm(x, "d_model", p[f"{part}_ln1"])
            qkv = md.einsum("batch nh nw win d_model, qkv d_model heads d_head -> qkv batch nh nw win heads d_head",
                            h, p[f"{part}_wqkv"])
            q, k, v = (md.squeeze(md.slice_(qkv, "qkv", i, i + 1), "qkv") for i in range(3))
            k, v = md.rename(k, win="key_win"), md.rename(v, win="key_win")
            scores = md.einsum("batch nh nw win heads d_head, batch nh nw key_win heads d_head "
                               "-> batch nh nw heads win key_win", q, k) * scale
            scores = scores + md.gather(p[f"{part}_rel"], rel_idx, "rel_pos")
            if mask is not None:
                scores = md.where(mask, scores, -1e9)
            att = md.softmax(scores, "key_win")
            o = md.einsum("batch nh nw heads win key_win, batch nh nw key_win heads d_head "
                          "-> batch nh nw win heads d_head", att, v)
            return md.einsum("batch nh nw win heads d_head, heads d_head d_model -> batch nh nw win d_model",
                             o, p[f"{part}_wo"])

        def mlp(x: md.Tensor, p: dict[str, md.Tensor], part: str) -> md.Tensor:
            h = md.layer_norm(x, "d_model", p[f"{part}_ln2"])
            h = md.gelu(md.einsum("batch hp wp d_model, d_model d_ff -> batch hp wp d_ff", h, p[f"{part}_w1"]))
            return md.einsum("batch hp wp d_ff, d_ff d_model -> batch hp wp d_model", h, p[f"{part}_w2"])

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            x = x + merge(attend(windows(x), p, "w", None))
            x = x + mlp(x, p, "w")
            rolled = md.roll(md.roll(x, "hp", -shift), "wp", -shift)
            o = merge(attend(windows(rolled), p, "sw", allowed))
            x = x + md.roll(md.roll(o, "hp", shift), "wp", shift)
            return x + mlp(x, p, "sw")

        patches = md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch hp wp (ph pw channels)",
                               ph=cfg.patch, pw=cfg.patch)
        x = md.einsum("batch hp wp ph_pw_channels, ph_pw_channels d_model -> batch hp wp d_model",
                      patches, w_embed) + b_embed
        x = md.repeat(block, x, blocks, "layer")
        pooled = md.reduce_mean(md.layer_norm(x, "d_model", ln_f), ["hp", "wp"])
        logits = md.einsum("batch d_model, d_model classes -> batch classes", pooled, w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"w_embed": w_embed, "b_embed": b_embed, **blocks, "ln_f": ln_f, "w_head": w_head}
    return md.Model(g, loss, params, feeds, cfg)
