"""A Hyena-style long-convolution language model, written from README.md and docs/ alone (a held-out model).

Legend: b batch, s seq, d d_model, c inner (the operator's channels), t tap (the long
filter's taps, as many as the sequence: every earlier token reaches every later one), o
order (the filter-MLP's positional features), f filter_ff, v vocab, l layer.

Each layer of the ``md.repeat`` stack (pre-LayerNorm, residual) is a Hyena operator of order 2:

    u = LN(x); v, x1, x2 = three projections of u to ``inner`` (one weight [proj, d, c] sliced apart)
    each through a short causal depthwise conv over ``seq`` (3 taps, ``md.conv``, w [short, c])
    the long filters h1, h2 [tap, c] are implicit: an MLP (sin) of positional features of
    ``md.arange(tap)`` (cos/sin of a constant frequency table), times an exponential decay
    window exp(-decay_c * t) (the decay a learned per-channel param through a softplus-free exp)
    z = x1 * longconv(v, h1) ; z = x2 * longconv(z, h2)   (causal depthwise conv, taps = seq)
    out = z . w_out, plus a per-channel skip ``bias_c * v`` inside each long conv (Hyena's D term)

With ``fft=False`` only (no FFT op in meshdsl): the long conv is ``md.conv(..., padding="causal")``
with as many taps as positions. Then a final LayerNorm and an untied head, next-token CE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 4
    seq: int = 32
    vocab: int = 64
    d_model: int = 32
    inner: int = 32
    order_feats: int = 8       # positional features fed to the filter MLP
    filter_ff: int = 16
    short: int = 3
    layers: int = 2
    filter_len: int = 0        # 0: as long as the sequence
    remat: str = "none"       # what each layer saves for its backward (md.repeat remat=)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, vocab=16, d_model=8, inner=8, order_feats=4, filter_ff=8, short=3, layers=2)

    @property
    def taps(self) -> int:
        return self.filter_len or self.seq


def implicit_filter(p: dict, which: str, cfg: Config, tap: md.Dim) -> md.Tensor:
    """[tap, inner]: an MLP of positional features of the tap index, times a decay window."""
    half = md.Dim("feat_half", cfg.order_feats // 2)
    freq = md.constant(torch.arange(1, cfg.order_feats // 2 + 1, dtype=torch.float32) * (math.pi / cfg.taps), [half])
    t = md.cast(md.arange(tap), torch.float32)
    ang = t * freq                                                          # [tap, feat_half]
    feats = md.rename(md.concat([md.cos(ang), md.sin(ang)], "feat_half"), feat_half="feats")
    hid = md.sin(md.einsum("tap feats, feats filter_ff -> tap filter_ff", feats, p[f"{which}_f1"]))
    h = md.einsum("tap filter_ff, filter_ff inner -> tap inner", hid, p[f"{which}_f2"])
    window = md.exp(-(t * md.exp(p[f"{which}_decay"])) / cfg.taps)             # [tap, inner]
    return h * window


def block(x: md.Tensor, p: dict, cfg: Config) -> md.Tensor:
    tap = md.Dim("tap", cfg.taps)
    u = md.layer_norm(x, "d_model", p["ln"])
    proj = md.einsum("batch seq d_model, proj d_model inner -> batch seq proj inner", u, p["w_in"])
    proj = md.conv(proj, p["short_w"], {"seq": "short"}, padding="causal")   # depthwise over (proj, inner)
    v, x1, x2 = (md.squeeze(md.slice_(proj, "proj", i, i + 1), "proj") for i in range(3))
    z = x1 * (md.conv(v, implicit_filter(p, "h1", cfg, tap), {"seq": "tap"}, padding="causal") + p["h1_skip"] * v)
    z = x2 * (md.conv(z, implicit_filter(p, "h2", cfg, tap), {"seq": "tap"}, padding="causal") + p["h2_skip"] * z)
    return x + md.einsum("batch seq inner, inner d_model -> batch seq d_model", z, p["w_out"])


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    c, v, l = md.Dim("inner", cfg.inner), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    proj, short = md.Dim("proj", 3), md.Dim("short", cfg.short)
    feats, ff = md.Dim("feats", cfg.order_feats), md.Dim("filter_ff", cfg.filter_ff)
    with md.Graph("heldout_hyena") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b, s], torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        blocks = {
            "ln": md.param("ln", [l, d], init="ones"),
            "w_in": md.param("w_in", [l, proj, d, c], fan_out=[l, proj, c]),
            "short_w": md.param("short_w", [l, short, proj, c], fan_out=[l, proj, c]),
            "w_out": md.param("w_out", [l, c, d], fan_out=[l, d]),
        }
        for h in ("h1", "h2"):
            blocks[f"{h}_f1"] = md.param(f"{h}_f1", [l, feats, ff], fan_out=[l, ff])
            blocks[f"{h}_f2"] = md.param(f"{h}_f2", [l, ff, c], fan_out=[l, c])
            blocks[f"{h}_decay"] = md.param(f"{h}_decay", [l, c], init="zeros")
            blocks[f"{h}_skip"] = md.param(f"{h}_skip", [l, c], init="ones")
        lnf = md.param("lnf", [d], init="ones")
        head = md.param("head", [v, d], fan_out=[v])
        x = md.repeat(lambda h_, p: block(h_, p, cfg), md.gather(wte, ids, "vocab"), blocks, l, remat=cfg.remat)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", md.layer_norm(x, "d_model", lnf), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return md.Model(g, loss, {"wte": wte, **blocks, "lnf": lnf, "head": head}, feeds, cfg, logits=logits)
