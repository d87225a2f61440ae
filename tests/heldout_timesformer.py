"""TimeSformer (Bertasius et al.), a held-out model written from the docs alone: a video
transformer over patches of every frame.

The video ``[batch, frames, height, width, channels]`` is cut into patches by ``md.rearrange``
(``prow`` x ``pcol`` patches per frame), embedded, and given learned space and time position
embeddings. Each block (under ``md.repeat`` over ``layer``):

- ``form=divided`` (divided space-time attention): time attention over ``frames`` for each patch
  position, then space attention over the patches of each frame (``prow`` and ``pcol`` merged
  into one ``patch`` dim), each pre-norm with its own weights, then the MLP;
- ``form=joint``: one attention over every patch of every frame, then the MLP.

The head mean-pools the tokens (the paper reads a class token), then LayerNorm, the class
logits and the cross-entropy.

Legend: b batch, t frames, r prow, c pcol, h heads, e d_head, d d_model, f d_ff, k classes.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 4
    frames: int = 4
    image: int = 16
    patch: int = 4
    channels: int = 3
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    classes: int = 5
    form: str = "divided"
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(batch=2, frames=4, image=8, patch=2, channels=2, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, classes=3)


TOK = "batch frames prow pcol"


def _qkv(y, p, pre: str):
    proj = f"{TOK} d_model, d_model heads d_head -> {TOK} heads d_head"
    return (md.einsum(proj, y, p[f"{pre}q"]), md.einsum(proj, y, p[f"{pre}k"]), md.einsum(proj, y, p[f"{pre}v"]))


def _out(o, p, pre: str):
    return md.einsum(f"{TOK} heads d_head, heads d_head d_model -> {TOK} d_model", o, p[f"{pre}o"])


def time_attention(x, p):
    q, k, v = _qkv(md.layer_norm(x, "d_model", p["ln_t"]), p, "t")
    k, v = md.rename(k, frames="key_frames"), md.rename(v, frames="key_frames")
    return x + _out(md.attention(q, k, v, "frames", "key_frames", "d_head", causal=False), p, "t")


def space_attention(x, p):
    q, k, v = _qkv(md.layer_norm(x, "d_model", p["ln_s"]), p, "s")
    merge = f"{TOK} heads d_head -> batch frames (prow pcol) heads d_head"
    q, k, v = (md.rename(md.rearrange(t, merge), prow_pcol=n) for t, n in [(q, "patch"), (k, "key_patch"), (v, "key_patch")])
    o = md.attention(q, k, v, "patch", "key_patch", "d_head", causal=False)
    o = md.rearrange(md.rename(o, patch="prow_pcol"), f"batch frames (prow pcol) heads d_head -> {TOK} heads d_head",
                     prow=x.shape["prow"].size)
    return x + _out(o, p, "s")


def joint_attention(x, p):
    q, k, v = _qkv(md.layer_norm(x, "d_model", p["ln_s"]), p, "s")
    merge = f"{TOK} heads d_head -> batch (frames prow pcol) heads d_head"
    q, k, v = (md.rename(md.rearrange(t, merge), frames_prow_pcol=n) for t, n in [(q, "st"), (k, "key_st"), (v, "key_st")])
    o = md.attention(q, k, v, "st", "key_st", "d_head", causal=False)
    o = md.rearrange(md.rename(o, st="frames_prow_pcol"), f"batch (frames prow pcol) heads d_head -> {TOK} heads d_head",
                     frames=x.shape["frames"].size, prow=x.shape["prow"].size)
    return x + _out(o, p, "s")


def block(x, p, form: str):
    x = time_attention(x, p) if form == "divided" else x
    x = space_attention(x, p) if form == "divided" else joint_attention(x, p)
    h = md.gelu(md.einsum(f"{TOK} d_model, d_model d_ff -> {TOK} d_ff", md.layer_norm(x, "d_model", p["ln2"]), p["w1"]))
    return x + md.einsum(f"{TOK} d_ff, d_ff d_model -> {TOK} d_model", h, p["w2"])


def _stacked(cfg, N):
    D, H, E, F = (md.Dim(n, s) for n, s in [("d_model", cfg.d_model), ("heads", cfg.heads), ("d_head", cfg.d_head), ("d_ff", cfg.d_ff)])
    p = {"ln_s": md.param("ln_s", [N, D], init="ones"), "ln2": md.param("ln2", [N, D], init="ones"),
         "w1": md.param("w1", [N, D, F], fan_out=["layer", "d_ff"]),
         "w2": md.param("w2", [N, F, D], fan_out=["layer", "d_model"])}
    for pre in ("t", "s") if cfg.form == "divided" else ("s",):
        for n in "qkv":
            p[f"{pre}{n}"] = md.param(f"{pre}{n}", [N, D, H, E], fan_out=["layer", "heads", "d_head"])
        p[f"{pre}o"] = md.param(f"{pre}o", [N, H, E, D], fan_out=["layer", "d_model"])
    if cfg.form == "divided":
        p["ln_t"] = md.param("ln_t", [N, D], init="ones")
    return p


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("divided", "joint"):
        raise md.ModelError(f"timesformer: form={cfg.form!r}; expected 'divided' or 'joint'")
    n = cfg.image // cfg.patch
    B, T, Hh, Ww, Cc = (md.Dim(k, s) for k, s in [("batch", cfg.batch), ("frames", cfg.frames), ("height", cfg.image),
                                                  ("width", cfg.image), ("channels", cfg.channels)])
    D, K = md.Dim("d_model", cfg.d_model), md.Dim("classes", cfg.classes)
    R, Cp, P = md.Dim("prow", n), md.Dim("pcol", n), md.Dim("pix", cfg.patch * cfg.patch * cfg.channels)
    N = md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        video = md.input("video", [B, T, Hh, Ww, Cc])
        labels = md.input("labels", [B], dtype=torch.int64)
        stacked = _stacked(cfg, N)
        params = dict(stacked,
                      w_patch=md.param("w_patch", [P, D], fan_out=["d_model"]),
                      pos_space=md.param("pos_space", [R, Cp, D], scale=0.02),
                      pos_time=md.param("pos_time", [T, D], scale=0.02),
                      lnf=md.param("lnf", [D], init="ones"),
                      head=md.param("head", [D, K], fan_out=["classes"]))
        patches = md.rearrange(video, "batch frames (prow p1) (pcol p2) channels -> batch frames prow pcol (p1 p2 channels)",
                               p1=cfg.patch, p2=cfg.patch)
        patches = md.rename(patches, p1_p2_channels="pix")
        x = md.einsum(f"{TOK} pix, pix d_model -> {TOK} d_model", patches, params["w_patch"])
        x = x + params["pos_space"] + params["pos_time"]
        x = md.repeat(lambda h, p: block(h, p, cfg.form), x, stacked, N, remat=cfg.remat)
        pooled = md.reduce_mean(x, ["frames", "prow", "pcol"])
        logits = md.einsum("batch d_model, d_model classes -> batch classes",
                           md.layer_norm(pooled, "d_model", params["lnf"]), params["head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        return {"video": torch.randn(cfg.batch, cfg.frames, cfg.image, cfg.image, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, params, make_feeds, cfg)
