"""Held-out model (round 16b): a Deformable-DETR-lite encoder, written from the docs alone.

Each query (one per feature-map position) predicts, per head, K sampling offsets and K weights;
the values are read at the fractional positions ``ref + offset`` by linear (form=1d) or bilinear
(form=2d) interpolation, written as one-hot einsums over the key positions (zero outside the map),
and summed with the softmaxed weights. A tiny encoder (md.repeat) and an MSE regression loss.

Legend: b batch, s/h/w query positions, k*/kh/kw key positions, n heads, p points, e d_head, d d_model.
"""
import dataclasses

import torch

import meshdsl as md


@dataclasses.dataclass
class Config:
    form: str = "1d"            # "1d": a sequence of features; "2d": a height x width map
    batch: int = 4
    seq: int = 16               # 1d: positions; 2d: height = width = seq // 2
    d_model: int = 32
    heads: int = 4
    points: int = 4
    layers: int = 2
    offset_scale: float = 2.0

    remat: str = "none"        # md.repeat's remat: none | full | selective

    @classmethod
    def tiny(cls):
        return cls(batch=2, seq=8, d_model=8, heads=2, points=2, layers=2)


def _interp(pos, key_dim):
    """Linear interpolation weights of fractional ``pos`` over ``key_dim`` (zero outside)."""
    lo = md.floor(pos)
    frac = pos - lo                           # floor has a zero gradient: d frac = d pos
    i0 = md.cast(lo, torch.int64)
    return (md.one_hot(i0, key_dim) * (1.0 - frac)) + (md.one_hot(i0 + 1, key_dim) * frac)


def _sample_1d(cfg, x, p, dims):
    b, s, n, e, pt, ks = dims
    off = md.einsum("batch seq d_model, d_model heads points -> batch seq heads points", x, p["w_off"])
    logit = md.einsum("batch seq d_model, d_model heads points -> batch seq heads points", x, p["w_att"])
    att = md.softmax(logit, "points")
    pos = md.cast(md.arange(s), torch.float32) + md.tanh(off) * cfg.offset_scale
    mix = md.einsum("batch seq heads points key_seq, batch seq heads points -> batch seq heads key_seq",
                    _interp(pos, ks), att)
    v = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["w_v"]),
                  seq="key_seq")
    return md.einsum("batch seq heads key_seq, batch key_seq heads d_head -> batch seq heads d_head", mix, v)


def _sample_2d(cfg, x, p, dims):
    hh, ww, kh, kw = dims
    spec = "batch height width d_model, d_model heads points -> batch height width heads points"
    oy, ox = md.einsum(spec, x, p["w_off"]), md.einsum(spec, x, p["w_off2"])
    att = md.softmax(md.einsum(spec, x, p["w_att"]), "points")
    py = md.cast(md.arange(hh), torch.float32) + md.tanh(oy) * cfg.offset_scale
    px = md.cast(md.arange(ww), torch.float32) + md.tanh(ox) * cfg.offset_scale
    v = md.rename(md.einsum("batch height width d_model, d_model heads d_head -> batch height width heads d_head",
                            x, p["w_v"]), height="key_h", width="key_w")
    rows = md.einsum("batch height width heads points key_h, batch key_h key_w heads d_head "
                     "-> batch height width heads points key_w d_head", _interp(py, kh), v)
    return md.einsum("batch height width heads points key_w, batch height width heads points, "
                     "batch height width heads points key_w d_head -> batch height width heads d_head",
                     _interp(px, kw), att, rows)


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("1d", "2d"):
        raise ValueError(f"form={cfg.form!r}: '1d' or '2d'")
    d_head = cfg.d_model // cfg.heads
    B, D = md.Dim("batch", cfg.batch), md.Dim("d_model", cfg.d_model)
    N, E, P, L = md.Dim("heads", cfg.heads), md.Dim("d_head", d_head), md.Dim("points", cfg.points), md.Dim("layer", cfg.layers)
    if cfg.form == "1d":
        S = md.Dim("seq", cfg.seq)
        space, dims = [S], (B, S, N, E, P, md.Dim("key_seq", cfg.seq))
    else:
        side = cfg.seq // 2
        hh, ww = md.Dim("height", side), md.Dim("width", side)
        space, dims = [hh, ww], (hh, ww, md.Dim("key_h", side), md.Dim("key_w", side))
    with md.Graph() as g:
        x = md.input("x", [B, *space, D])
        target = md.input("target", [B, *space, D])
        stacked = {
            "w_off": md.param("w_off", [L, D, N, P], scale=0.5, fan_out=["layer", "heads", "points"]),
            "w_att": md.param("w_att", [L, D, N, P], fan_out=["layer", "heads", "points"]),
            "w_v": md.param("w_v", [L, D, N, E], fan_out=["layer", "heads", "d_head"]),
            "w_o": md.param("w_o", [L, N, E, D], fan_out=["layer", "d_model"]),
            "ln": md.param("ln", [L, D], init="ones"),
        }
        if cfg.form == "2d":
            stacked["w_off2"] = md.param("w_off2", [L, D, N, P], scale=0.5, fan_out=["layer", "heads", "points"])
        sample = _sample_1d if cfg.form == "1d" else _sample_2d
        heads_out = ("batch seq heads d_head" if cfg.form == "1d" else "batch height width heads d_head")
        sp = " ".join(d.name for d in space)

        def block(h, p):
            a = md.layer_norm(h, "d_model", p["ln"])
            y = sample(cfg, a, p, dims)
            return h + md.einsum(f"{heads_out}, heads d_head d_model -> batch {sp} d_model", y, p["w_o"])

        h = md.repeat(block, x, stacked, L, remat=cfg.remat)
        loss = md.reduce_mean((h - target) ** 2)

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        shape = [cfg.batch, *[d.size for d in space], cfg.d_model]
        return {"x": torch.randn(*shape, generator=gen), "target": torch.randn(*shape, generator=gen)}

    return md.Model(g, loss, stacked, make_feeds, cfg)
