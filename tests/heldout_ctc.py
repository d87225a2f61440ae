"""A CTC speech recogniser, written from the README and docs/ alone (a held-out model, in the
user's own dim names).

Features ``audio [utt, frames, feat]`` go through a stride-2 conv stem (``md.conv``, 3 taps,
padding (1, 1): ``time`` = frames / 2 positions), gelu, learned positions, and pre-norm transformer
blocks under ``md.repeat`` over ``layer`` (fused non-causal attention over ``time``/``key_time``,
a gelu MLP). The per-frame log-probabilities over ``sym`` (symbol 0 the blank) feed the CTC loss:

- the extended label sequence ``[blank, l1, blank, l2, ..., blank]`` (``ext`` = 2 * lab + 1) is
  made in the graph from the padded labels ``[utt, lab]``: a concat with blanks along ``two``, a
  rearrange merging ``(lab two)`` and a pad of one more blank;
- ``em [utt, time, ext]``: each frame's log-probability of each extended symbol (a one-hot
  contraction of the log-softmax);
- the forward (alpha) recursion over time, in log space: ``alpha_t(s) = logsumexp(alpha(s),
  alpha(s-1), alpha(s-2) where allowed) + em_t(s)`` (s-2 allowed where ext(s) is no blank and
  differs from ext(s-2)). The docs offer no recurrence op beyond ``md.repeat``, so the recursion
  is a repeat over ``tstep`` (time 1..T-1): its stacked tensors are ``em`` from frame 1 on and an
  ``active`` mask (frame t < the utterance's length: afterwards alpha is kept as it was); the
  shifts by 1 and 2 are ``md.pad`` with -1e30 (log 0) then ``md.slice_``;
- the log-likelihood is the logsumexp of the last alpha at the two end positions ``2 len`` and
  ``2 len - 1``; the loss is its negative divided by the label length, averaged over utterances
  (``torch.nn.functional.ctc_loss``'s ``reduction="mean"``).

Legend: utt, frames (input frames), feat, time (k key_time), d_model, heads, d_head, d_ff, sym
(the symbols, blank = 0), lab (label positions), ext (extended label positions), tstep.
"""
from dataclasses import dataclass

import torch

import meshdsl as md

NEG = -1e30   # log 0: finite, so a logsumexp of only impossible paths is no NaN


@dataclass(frozen=True)
class Config:
    utt: int = 8
    frames: int = 64
    feat: int = 16
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    sym: int = 12
    lab: int = 8
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(utt=4, frames=16, feat=4, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, sym=5, lab=3)


def _encoder(cfg: Config, audio: md.Tensor) -> tuple[md.Tensor, dict]:
    """[utt, time, sym] log-probabilities, and the params."""
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, L, T = md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers), md.Dim("time", cfg.frames // 2)
    p = {"w_stem": md.param("w_stem", [md.Dim("tap", 3), audio.shape["feat"], d], fan_out=["d_model"]),
         "pos": md.param("pos", [T, d], scale=0.1),
         "lnf": md.param("lnf", [d], init="ones"),
         "w_out": md.param("w_out", [d, md.Dim("sym", cfg.sym)], fan_out=["sym"])}
    st = {"ln1": md.param("ln1", [L, d], init="ones"),
          "wq": md.param("wq", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
          "wk": md.param("wk", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
          "wv": md.param("wv", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
          "wo": md.param("wo", [L, h, e, d], fan_out=["layer", "d_model"]),
          "ln2": md.param("ln2", [L, d], init="ones"),
          "w1": md.param("w1", [L, d, f], fan_out=["layer", "d_ff"]),
          "w2": md.param("w2", [L, f, d], fan_out=["layer", "d_model"])}

    def block(x: md.Tensor, q: dict) -> md.Tensor:
        n = md.rms_norm(x, "d_model", q["ln1"])
        proj = "utt time d_model, d_model heads d_head -> utt time heads d_head"
        k = md.rename(md.einsum(proj, n, q["wk"]), time="key_time")
        v = md.rename(md.einsum(proj, n, q["wv"]), time="key_time")
        o = md.attention(md.einsum(proj, n, q["wq"]), k, v, "time", "key_time", "d_head", causal=False)
        x = x + md.einsum("utt time heads d_head, heads d_head d_model -> utt time d_model", o, q["wo"])
        m = md.gelu(md.einsum("utt time d_model, d_model d_ff -> utt time d_ff", md.rms_norm(x, "d_model", q["ln2"]),
                              q["w1"]))
        return x + md.einsum("utt time d_ff, d_ff d_model -> utt time d_model", m, q["w2"])

    x = md.gelu(md.conv(audio, p["w_stem"], {"frames": "tap"}, padding=(1, 1), stride=2))
    x = md.rename(x, frames="time") + p["pos"]
    x = md.repeat(block, x, st, "layer", remat=cfg.remat)
    logits = md.einsum("utt time d_model, d_model sym -> utt time sym", md.rms_norm(x, "d_model", p["lnf"]), p["w_out"])
    return md.log_softmax(logits, "sym"), {**p, **st}


def _extended(labels: md.Tensor) -> md.Tensor:
    """[utt, ext]: blank, l1, blank, l2, ..., blank."""
    lab = labels.shape["lab"].size
    blanks = md.cast(labels, torch.int64) * 0
    both = md.concat([md.unsqueeze(blanks, md.Dim("two", 1)), md.unsqueeze(labels, md.Dim("two", 1))], "two")
    ext = md.rename(md.rearrange(both, "utt lab two -> utt (lab two)"), lab_two="ext")
    assert ext.shape["ext"].size == 2 * lab
    return md.pad(ext, "ext", 0, 1)


def _shifted(alpha: md.Tensor, k: int) -> md.Tensor:
    """alpha(s - k) along ``ext``, log 0 before the start."""
    n = alpha.shape["ext"].size
    return md.slice_(md.pad(alpha, "ext", k, 0, value=NEG), "ext", 0, n)


def ctc_loss(lp: md.Tensor, labels: md.Tensor, label_len: md.Tensor, in_len: md.Tensor) -> md.Tensor:
    """The mean over utterances of -log p(labels | lp) / label length."""
    ext_ids = _extended(labels)
    n_sym = lp.shape["sym"]
    em = md.einsum("utt time sym, utt ext sym -> utt time ext", lp, md.one_hot(ext_ids, n_sym))
    s_pos = md.arange(ext_ids.shape["ext"])
    skip = md.logical_and(md.not_equal(ext_ids, 0), md.not_equal(ext_ids, md.shift(ext_ids, "ext", 2)))
    skip = md.logical_and(skip, md.greater_equal(s_pos, 2))
    n_time = lp.shape["time"].size
    alpha0 = md.where(md.less(s_pos, 2), md.squeeze(md.slice_(em, "time", 0, 1), "time"), NEG)
    em_rest = md.rename(md.slice_(em, "time", 1, n_time), time="tstep")
    steps = md.arange(em_rest.shape["tstep"]) + 1
    active = md.less(steps, in_len)                          # [tstep, utt]

    def step(alpha: md.Tensor, q: dict) -> md.Tensor:
        paths = [alpha, _shifted(alpha, 1), md.where(skip, _shifted(alpha, 2), NEG)]
        paths = md.concat([md.unsqueeze(a, md.Dim("path", 1)) for a in paths], "path")
        new = md.logsumexp(paths, "path") + q["em"]
        return md.where(q["active"], new, alpha)

    alpha = md.repeat(step, alpha0, {"em": em_rest, "active": active}, "tstep")
    end = md.logical_or(md.equal(s_pos, label_len * 2), md.equal(s_pos, label_len * 2 - 1))
    ll = md.logsumexp(md.where(end, alpha, NEG), "ext")
    return md.reduce_mean(-ll / md.cast(label_len, torch.float32))


def build(cfg: Config = Config()) -> md.Model:
    utt = md.Dim("utt", cfg.utt)
    with md.Graph("heldout_ctc") as graph:
        audio = md.input("audio", [utt, md.Dim("frames", cfg.frames), md.Dim("feat", cfg.feat)])
        labels = md.input("labels", [utt, md.Dim("lab", cfg.lab)], dtype=torch.int64)
        label_len = md.input("label_len", [utt], dtype=torch.int64)
        in_len = md.input("in_len", [utt], dtype=torch.int64)
        lp, params = _encoder(cfg, audio)
        loss = ctc_loss(lp, labels, label_len, in_len)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = cfg.frames // 2
        label_len = torch.randint(1, cfg.lab + 1, (cfg.utt,), generator=gen)
        labels = torch.randint(1, cfg.sym, (cfg.utt, cfg.lab), generator=gen)
        labels = torch.where(torch.arange(cfg.lab)[None, :] < label_len[:, None], labels, 0)
        # every utterance long enough for its labels (2 * lab + 1 frames at worst)
        in_len = torch.randint(min(t, 2 * cfg.lab + 1), t + 1, (cfg.utt,), generator=gen)
        return {"audio": torch.randn(cfg.utt, cfg.frames, cfg.feat, generator=gen), "labels": labels,
                "label_len": label_len, "in_len": in_len}

    return md.Model(graph, loss, params, feeds, cfg, outputs={"logprobs": lp})
