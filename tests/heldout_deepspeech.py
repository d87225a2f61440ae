"""DeepSpeech2-lite, a held-out model (round 27a): a conv front end, bidirectional GRUs, CTC.

Legend: batch = utterances, time = frames, freq = spectrogram bins, c_in = one input channel,
ch/ch2 = conv channels, kt/kf = conv taps, freq_ch = the conv output flattened per frame, hidden =
the GRU state (hidden2 = a square weight's output, renamed back), layer = the stacked BiGRU layers,
vocab = characters with the CTC blank at 0, label = target positions, ext = the CTC lattice
(blank, l1, blank, l2, ..., blank: 2 * label + 1). The front end is two 3x3 convs over (time,
freq), the first of stride 2 in both, the second of stride 2 in freq only, each clamped to
[0, 20] (DS2's hardtanh); the frames are flattened and projected to ``hidden``. Each layer is a
bidirectional GRU: the input projections for all frames at once, then one ``md.repeat`` over
``time`` forward and one over the flipped frames (``md.flip``), its per-step outputs flipped
back; the two directions are summed (as DS2 does) into the layer's output. There is no CTC op:
the loss is the forward algorithm in log space, a third ``md.repeat`` over ``time`` carrying
alpha ``[batch, ext]`` (each step: logaddexp of the state, its left neighbour and, where the
label differs from the one two back and is no blank, the state two back; plus the frame's
log-probability of the lattice's label, gathered by a one-hot einsum), and the negative
logaddexp of the last two states, averaged over the batch (torch's ``ctc_loss`` with
``reduction="sum"`` over the batch size). ``nest_ctc`` nests that recursion in a one-step block,
the guide's form for a split ``time`` (``time:model`` is then sequence parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    time: int = 32
    freq: int = 16
    ch: int = 8
    hidden: int = 32
    vocab: int = 12
    label: int = 4
    layers: int = 2
    nest_ctc: bool = False      # the CTC recursion as an inner repeat of a one-step block (a split time)
    shift: bool = False         # the lattice's neighbours by md.shift instead of slice + pad
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, time=8, freq=8, ch=2, hidden=4, vocab=5, label=2, layers=2)


GATES = ("r", "z", "n")
DIRS = ("f", "b")
NEG = -1.0e4                     # log of "unreachable": far below any path's log-probability
SP = {"time": "kt", "freq": "kf"}


def _sq(x, w):
    """x [.., hidden] times a square w [hidden, hidden2], back to hidden."""
    return md.rename(md.einsum("... hidden, hidden hidden2 -> ... hidden2", x, w), {"hidden2": "hidden"})


def _gru_step(h, xs, p, d):
    """torch's GRU cell; xs holds this frame's input projections (biases added)."""
    r = md.sigmoid(xs["r"] + _sq(h, p[f"wh_{d}_r"]) + p[f"bh_{d}_r"])
    z = md.sigmoid(xs["z"] + _sq(h, p[f"wh_{d}_z"]) + p[f"bh_{d}_z"])
    n = md.tanh(xs["n"] + r * (_sq(h, p[f"wh_{d}_n"]) + p[f"bh_{d}_n"]))
    h = (1 - z) * n + z * h
    return h, {"y": h}


def _bigru_layer(y, p, h0):
    """y [batch, time, hidden] -> the sum of both directions' outputs, same dims."""
    out = None
    for d in DIRS:
        xs = {g: md.transpose(_sq(y, p[f"wi_{d}_{g}"]) + p[f"bi_{d}_{g}"], ["time", "batch", "hidden"]) for g in GATES}
        if d == "b":
            xs = {g: md.flip(t, "time") for g, t in xs.items()}
        _, per_step = md.repeat(lambda h, s, d=d: _gru_step(h, s, p, d), h0, xs, "time")
        ys = per_step["y"] if d == "f" else md.flip(per_step["y"], "time")
        out = ys if out is None else out + ys
    return md.transpose(out, ["batch", "time", "hidden"])


def ctc_loss(logp, ext, num_ext: int, nest: bool = False, shift: bool = False):
    """logp [time, batch, vocab] (log-probabilities), ext [batch, ext] (the lattice's labels):
    the mean over the batch of -log p(labels), by the forward algorithm over ``time``; ``nest``
    runs it as the inner repeat of a one-step block (the documented form for a split ``time``);
    ``shift`` reads the states one and two back by ``md.shift`` (the zeros it shifts in replaced
    by NEG with a ``where``; ``md.shift(alpha - NEG, ..) + NEG`` would round alpha at 1e4's scale)
    instead of a ``slice_`` then a ``pad``."""
    em = md.einsum("time batch vocab, batch ext vocab -> time batch ext", logp, md.one_hot(ext, logp.shape["vocab"]))
    two_back = md.pad(md.slice_(ext, "ext", 0, num_ext - 2), "ext", 2, 0)
    skip = md.logical_and(md.not_equal(ext, 0), md.not_equal(ext, two_back))
    pos = md.arange(ext.shape["ext"])
    alpha0 = md.where(md.equal(pos, 0), md.constant(0.0, [ext.shape["batch"], ext.shape["ext"]]), NEG)

    def step(alpha, s):
        if shift:                                     # both shifts read alpha: one halo
            a1, a2 = (md.where(md.greater_equal(pos, k), md.shift(alpha, "ext", k), NEG) for k in (1, 2))
        else:
            a1, a2 = (md.pad(md.slice_(alpha, "ext", 0, num_ext - k), "ext", k, 0, value=NEG) for k in (1, 2))
        a2 = md.where(skip, a2, NEG)
        return md.logaddexp(md.logaddexp(alpha, a1), a2) + s["em"]

    if nest:
        alpha = md.repeat(lambda a, _: md.repeat(step, a, {"em": em}, "time"), alpha0, {}, md.Dim("once", 1))
    else:
        alpha = md.repeat(step, alpha0, {"em": em}, "time")
    last = md.slice_(alpha, "ext", num_ext - 2, num_ext)
    return md.reduce_mean(-md.logsumexp(last, "ext"))


def build(cfg: Config) -> md.Model:
    B, T, Fq, C1 = md.Dim("batch", cfg.batch), md.Dim("time", cfg.time), md.Dim("freq", cfg.freq), md.Dim("c_in", 1)
    Ch, Ch2, Kt, Kf = md.Dim("ch", cfg.ch), md.Dim("ch2", cfg.ch), md.Dim("kt", 3), md.Dim("kf", 3)
    Hd, Hd2, V, L = md.Dim("hidden", cfg.hidden), md.Dim("hidden2", cfg.hidden), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    E = md.Dim("ext", 2 * cfg.label + 1)
    FqCh = md.Dim("freq_ch", (cfg.freq // 4) * cfg.ch)
    with md.Graph() as g:
        spec = md.input("spec", [B, T, Fq, C1])
        ext = md.input("ext", [B, E], dtype=torch.int64)
        w1 = md.param("conv1", [Kt, Kf, C1, Ch], fan_out=["ch"])
        w2 = md.param("conv2", [Kt, Kf, Ch, Ch2], fan_out=["ch2"])
        proj = md.param("proj", [FqCh, Hd], fan_out=["hidden"])
        stacked = {}
        for d in DIRS:
            for gt in GATES:
                for side in ("i", "h"):
                    stacked[f"w{side}_{d}_{gt}"] = md.param(f"w{side}_{d}_{gt}", [L, Hd, Hd2], fan_out=["layer", "hidden2"])
                    stacked[f"b{side}_{d}_{gt}"] = md.param(f"b{side}_{d}_{gt}", [L, Hd], init="zeros")
        w_out = md.param("w_out", [Hd, V], fan_out=["vocab"])
        b_out = md.param("b_out", [V], init="zeros")
        x = md.clamp(md.conv(spec, w1, SP, padding=(1, 1), stride=2), 0, 20)
        x = md.clamp(md.conv(x, w2, SP, padding=(1, 1), stride={"freq": 2}), 0, 20)
        feat = md.rename(md.rearrange(x, "batch time freq ch2 -> batch time (freq ch2)"), {"freq_ch2": "freq_ch"})
        y = md.einsum("batch time freq_ch, freq_ch hidden -> batch time hidden", feat, proj)
        h0 = md.constant(0.0, [B, Hd])
        y = md.repeat(lambda c, p: _bigru_layer(c, p, h0), y, stacked, "layer", remat=cfg.remat)
        logits = md.einsum("batch time hidden, hidden vocab -> time batch vocab", y, w_out) + b_out
        loss = ctc_loss(md.log_softmax(logits, "vocab"), ext, 2 * cfg.label + 1, cfg.nest_ctc, cfg.shift)

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        labels = torch.randint(1, cfg.vocab, (cfg.batch, cfg.label), generator=gen)
        lattice = torch.zeros(cfg.batch, 2 * cfg.label + 1, dtype=torch.int64)
        lattice[:, 1::2] = labels
        return {"spec": torch.randn(cfg.batch, cfg.time, cfg.freq, 1, generator=gen), "ext": lattice}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("spec", "ext")


def reference_loss(cfg: Config, p: dict, spec, ext):
    """The same model in plain torch: F.conv2d with stride, F.hardtanh, torch's GRU cell equations
    in a Python loop per direction, and F.ctc_loss (the labels read back from the lattice)."""
    F = torch.nn.functional
    x = spec.permute(0, 3, 1, 2)                                          # [b, 1, time, freq]
    x = F.hardtanh(F.conv2d(x, p["conv1"].permute(3, 2, 0, 1), stride=2, padding=1), 0, 20)
    x = F.hardtanh(F.conv2d(x, p["conv2"].permute(3, 2, 0, 1), stride=(1, 2), padding=1), 0, 20)
    b, c, t, f = x.shape
    y = x.permute(0, 2, 3, 1).reshape(b, t, f * c) @ p["proj"]          # freq-major, as (freq ch2)
    for i in range(cfg.layers):
        out = 0
        for d in DIRS:
            gi = {g: y @ p[f"wi_{d}_{g}"][i] + p[f"bi_{d}_{g}"][i] for g in GATES}
            h, ys = torch.zeros(b, cfg.hidden, dtype=y.dtype), [None] * t
            for s in (range(t) if d == "f" else reversed(range(t))):
                gh = {g: h @ p[f"wh_{d}_{g}"][i] + p[f"bh_{d}_{g}"][i] for g in GATES}
                r, z = torch.sigmoid(gi["r"][:, s] + gh["r"]), torch.sigmoid(gi["z"][:, s] + gh["z"])
                h = (1 - z) * torch.tanh(gi["n"][:, s] + r * gh["n"]) + z * h
                ys[s] = h
            out = out + torch.stack(ys, 1)
        y = out
    logp = F.log_softmax(y @ p["w_out"] + p["b_out"], -1).transpose(0, 1)   # [time, b, vocab]
    labels = ext[:, 1::2]
    return F.ctc_loss(logp, labels, torch.full((b,), t), torch.full((b,), labels.shape[1]),
                      blank=0, reduction="sum") / b
