"""Held-out model (round 16a): Instant-NGP, lite: a multiresolution hash encoding of 2-D points.

At each of ``levels`` resolutions a point's scaled coordinates give the four corners of its grid
cell (``floor`` plus the offsets 0/1); a corner's integer coordinates are hashed
(``(x * 1) ^ (y * 2654435761) % table`` with ``md.bitwise_xor``, ``hash=xor``; or the sum
``x * 1 + y * 2654435761``, ``hash=sum``), its feature row looked up,
and the four rows mixed with bilinear weights. The levels' features, joined, go through a small
MLP (hidden layers under ``md.repeat``) to a colour; the loss is the MSE to the target colours.
``lookup=gather``: one flat table of ``levels * table`` rows, each level's hash offset by its
level, read by ``md.gather``; ``lookup=onehot``: a table per level ``[levels, entries, feat]``
read by a one-hot contraction (so ``levels`` can be split).

Legend: p = points, l = levels, c = corner, x = coord, n = entries, f = feat, h = hidden, r = rgb.
"""
from dataclasses import dataclass

import torch

import meshdsl as md

PRIMES = (1, 2654435761)


@dataclass
class Config:
    points: int = 256
    levels: int = 4
    base_res: int = 4
    growth: int = 2
    table: int = 64
    feat: int = 2
    hidden: int = 32
    layers: int = 2
    lookup: str = "gather"       # gather | onehot
    hash: str = "xor"            # xor | sum
    remat: str = "none"          # none | full | selective (the layer stack)

    @classmethod
    def tiny(cls):
        return cls(points=12, levels=3, base_res=2, growth=2, table=11, feat=2, hidden=8, layers=2)


class _Params(dict):
    def __call__(self, name, shape, **kw):
        self[name] = md.param(name, shape, **kw)
        return self[name]


def _corners(xy_px, cfg, Lv):
    """Hashed corner ids [points, levels, corner] (within a level's table) and bilinear
    weights [points, levels, corner] of points [points, coord] in [0, 1)."""
    C, X = md.Dim("corner", 4), xy_px.shape["coord"]
    res = md.constant(torch.tensor([float(cfg.base_res * cfg.growth ** i) for i in range(cfg.levels)]), [Lv])
    scaled = xy_px * res                                           # [points, coord, levels]
    cell = md.floor(scaled)
    frac = scaled - cell
    offs = md.constant(torch.tensor([[0, 0], [1, 0], [0, 1], [1, 1]]), [C, X])
    ids = md.cast(cell, torch.int64) + offs                        # [points, coord, levels, corner]
    spread = ids * md.constant(torch.tensor(PRIMES), [X])
    if cfg.hash == "xor":                                          # Instant-NGP's: x*1 ^ y*2654435761
        hashed = md.bitwise_xor(md.squeeze(md.slice_(spread, "coord", 0, 1), "coord"),
                                md.squeeze(md.slice_(spread, "coord", 1, 2), "coord")) % cfg.table
    else:                                                          # a sum instead of the xor
        hashed = md.reduce_sum(spread, "coord") % cfg.table        # [points, levels, corner]
    w_x = md.where(md.equal(offs, 1), frac, 1.0 - frac)            # [points, coord, levels, corner]
    w = md.squeeze(md.slice_(w_x, "coord", 0, 1), "coord") * md.squeeze(md.slice_(w_x, "coord", 1, 2), "coord")
    return hashed, w


def build(cfg: Config) -> md.Model:
    if cfg.lookup not in ("gather", "onehot") or cfg.hash not in ("xor", "sum"):
        raise ValueError(f"lookup must be 'gather' or 'onehot' and hash 'xor' or 'sum', not {cfg.lookup!r}, {cfg.hash!r}")
    Pt, X, Lv = md.Dim("points", cfg.points), md.Dim("coord", 2), md.Dim("levels", cfg.levels)
    Fe, H, R, L = md.Dim("feat", cfg.feat), md.Dim("hidden", cfg.hidden), md.Dim("rgb", 3), md.Dim("layer", cfg.layers)
    P = _Params()
    with md.Graph() as g:
        xy = md.input("xy", [Pt, X])
        rgb = md.input("rgb", [Pt, R])
        hashed, w = _corners(xy, cfg, Lv)
        if cfg.lookup == "gather":
            N = md.Dim("entries", cfg.levels * cfg.table)
            flat = hashed + md.arange(Lv) * cfg.table                  # level l's rows start at l * table
            rows = md.gather(P("table", [N, Fe], init="uniform", scale=1e-1), flat, "entries")
        else:
            N = md.Dim("entries", cfg.table)
            table = P("table", [Lv, N, Fe], init="uniform", scale=1e-1)
            rows = md.einsum("points levels corner entries, levels entries feat -> points levels corner feat",
                             md.one_hot(hashed, N), table)
        enc = md.reduce_sum(rows * w, "corner")                        # [points, levels, feat]
        h = md.relu(md.einsum("points levels feat, levels feat hidden -> points hidden", enc,
                              P("w_in", [Lv, Fe, H], fan_out=["hidden"])) + P("b_in", [H], init="zeros"))

        def layer(h, p):
            y = md.einsum("points hidden, hidden hidden_out -> points hidden_out", h, p["w"])
            return md.relu(md.rename(y, {"hidden_out": "hidden"}) + p["b"])

        h = md.repeat(layer, h, {"w": P("w_h", [L, H, md.Dim("hidden_out", cfg.hidden)], fan_out=["layer", "hidden_out"]),
                                 "b": P("b_h", [L, H], init="zeros")}, "layer",
                      remat=None if cfg.remat == "none" else cfg.remat)
        out = md.sigmoid(md.einsum("points hidden, hidden rgb -> points rgb", h, P("w_out", [H, R], fan_out=["rgb"])))
        loss = md.reduce_mean((out - rgb) ** 2)

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        xy = torch.rand(cfg.points, 2, generator=gen)
        col = torch.stack([torch.sin(6 * xy[:, 0]), torch.cos(5 * xy[:, 1]), xy.prod(1)], 1) * 0.5 + 0.5
        return {"xy": xy, "rgb": col}

    return md.Model(g, loss, dict(P), make_feeds, cfg, outputs={"rgb": out})
