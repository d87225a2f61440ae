"""Held-out model (round 22a): a BiLSTM-CRF tagger (Huang et al. 2015; Lample et al. 2016), from the docs alone.

Legend: b = batch, s = seq, v = vocab, m = d_emb, g = gate (i, f, o, c), n = hidden,
t = tags (tp: the previous position's tag).

Embeddings feed a bidirectional LSTM: the forward direction is a recurrence over `seq`
(md.repeat with the per-step input projections stacked over `seq`), the backward one the
same recurrence over md.flip-ped inputs, its outputs flipped back. Emissions per tag, then a
linear-chain CRF: log Z by the forward algorithm (logsumexp over the previous tag in a
recurrence over positions) minus the gold path's score, averaged over the batch.

Both recurrences run at the top level, so `seq` splits only by nesting each in a one-layer
block (`scan` below), as api.md says for a CRF's forward algorithm under `seq:model`.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 128
    batch: int = 8
    seq: int = 16
    d_emb: int = 32
    hidden: int = 32
    tags: int = 9
    remat: str | None = None

    @classmethod
    def tiny(cls):
        return cls(vocab=20, batch=4, seq=6, d_emb=6, hidden=4, tags=5)


def scan(step, carry, stacked, dim, remat=None):
    """md.repeat over `dim`, nested in a one-layer block so a layout may split `dim`."""
    once = md.Dim("once", 1)
    out, per = md.repeat(lambda c, _: md.repeat(step, c, stacked, dim), carry, {}, once, remat=remat)
    return out, {k: md.squeeze(v, "once") for k, v in per.items()}


def _lstm(xg, w_hh, hidden, remat):
    """One LSTM direction over xg [seq, batch, gate, hidden] (input projections): h [seq, batch, hidden]."""
    def step(hc, p):
        # h and c side by side along `state` (not along `hidden`): a split `hidden` cuts both alike
        h = md.rename(md.squeeze(md.slice_(hc, "state", 0, 1), "state"), hidden="hidden_in")
        c = md.squeeze(md.slice_(hc, "state", 1, 2), "state")
        z = p["x"] + md.einsum("batch hidden_in, hidden_in gate hidden -> batch gate hidden", h, w_hh)
        i, f, o, u = (md.squeeze(md.slice_(z, "gate", j, j + 1), "gate") for j in range(4))
        c = md.sigmoid(f) * c + md.sigmoid(i) * md.tanh(u)
        h = md.sigmoid(o) * md.tanh(c)
        return md.concat([md.unsqueeze(h, "state", 0), md.unsqueeze(c, "state", 0)], "state"), {"h": h}

    hc0 = md.constant(0.0, [md.Dim("state", 2), xg.shape["batch"], hidden])
    _, per = scan(step, hc0, {"x": xg}, "seq", remat)
    return per["h"]


def _log_partition(emit, trans, start, end, remat):
    """log Z of the linear-chain CRF by the forward algorithm: [batch]."""
    seq = emit.shape["seq"].size
    alpha0 = md.squeeze(md.slice_(emit, "seq", 0, 1), "seq") + start
    rest = md.transpose(md.slice_(emit, "seq", 1, seq), ["seq", "batch", "tags"])

    def step(alpha, p):
        prev = md.rename(alpha, tags="tags_prev")
        return md.logsumexp(prev + trans, "tags_prev") + p["e"]

    alpha, _ = scan(lambda a, p: (step(a, p), {}), alpha0, {"e": rest}, "seq", remat)
    return md.logsumexp(alpha + end, "tags")


def _gold_score(emit, labels, trans, start, end, T):
    seq = labels.shape["seq"].size
    oh = md.one_hot(labels, T)                                              # [batch, seq, tags]
    score = md.reduce_sum(emit * oh, ["seq", "tags"])
    prev = md.rename(md.slice_(oh, "seq", 0, seq - 1), tags="tags_prev")
    nxt = md.slice_(oh, "seq", 1, seq)
    score = score + md.einsum("batch seq tags_prev, batch seq tags, tags_prev tags -> batch", prev, nxt, trans)
    first = md.squeeze(md.slice_(oh, "seq", 0, 1), "seq")
    last = md.squeeze(md.slice_(oh, "seq", seq - 1, seq), "seq")
    return score + md.reduce_sum(first * start, "tags") + md.reduce_sum(last * end, "tags")


def build(cfg: Config) -> md.Model:
    B, S, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab)
    M, G, N = md.Dim("d_emb", cfg.d_emb), md.Dim("gate", 4), md.Dim("hidden", cfg.hidden)
    Ni, T, Tp = md.Dim("hidden_in", cfg.hidden), md.Dim("tags", cfg.tags), md.Dim("tags_prev", cfg.tags)
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], dtype=torch.int64), md.input("labels", [B, S], dtype=torch.int64)
        emb = md.param("emb", [V, M], scale=0.5)
        w = {d: (md.param(f"w_ih_{d}", [M, G, N], fan_out=[G, N]), md.param(f"w_hh_{d}", [Ni, G, N], fan_out=[G, N]),
                 md.param(f"b_{d}", [G, N], init="zeros"), md.param(f"w_em_{d}", [N, T], fan_out=[T]))
             for d in ("fwd", "bwd")}
        trans = md.param("trans", [Tp, T], scale=0.1)
        start, end = md.param("start", [T], scale=0.1), md.param("end", [T], scale=0.1)

        x = md.transpose(md.gather(emb, ids, "vocab"), ["seq", "batch", "d_emb"])
        emit = None
        for d, (w_ih, w_hh, b, w_em) in w.items():
            xd = md.flip(x, "seq") if d == "bwd" else x
            xg = md.einsum("seq batch d_emb, d_emb gate hidden -> seq batch gate hidden", xd, w_ih) + b
            h = _lstm(xg, w_hh, N, cfg.remat)
            h = md.flip(h, "seq") if d == "bwd" else h
            e = md.einsum("seq batch hidden, hidden tags -> batch seq tags", h, w_em)
            emit = e if emit is None else emit + e
        nll = _log_partition(emit, trans, start, end, cfg.remat) - _gold_score(emit, labels, trans, start, end, T)
        loss = md.reduce_mean(nll)

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        return {"ids": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen),
                "labels": torch.randint(0, cfg.tags, (cfg.batch, cfg.seq), generator=gen)}

    return md.Model(g, loss, g.params(), make_feeds, cfg)


REF_INPUTS = ("ids", "labels")


def reference_loss(cfg: Config, params: dict, ids, labels):
    """The same loss in plain torch: a Python loop per LSTM direction (the backward one over the
    reversed positions) and log Z by enumerating every tag path (tiny configs only)."""
    import itertools

    x = params["emb"][ids]                                               # [batch, seq, d_emb]
    emit = 0.0
    for d in ("fwd", "bwd"):
        order = range(cfg.seq) if d == "fwd" else reversed(range(cfg.seq))
        h = c = torch.zeros(cfg.batch, cfg.hidden, dtype=x.dtype)
        hs = [None] * cfg.seq
        for t in order:
            z = torch.einsum("bm,mgn->bgn", x[:, t], params[f"w_ih_{d}"]) + params[f"b_{d}"]
            z = z + torch.einsum("bi,ign->bgn", h, params[f"w_hh_{d}"])
            i, f, o, u = z.unbind(1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(u)
            h = torch.sigmoid(o) * torch.tanh(c)
            hs[t] = h
        emit = emit + torch.einsum("bsn,nt->bst", torch.stack(hs, 1), params[f"w_em_{d}"])
    trans, start, end = params["trans"], params["start"], params["end"]

    def score(path):                                                     # path [batch, seq]
        s = emit.gather(2, path[..., None])[..., 0].sum(1) + start[path[:, 0]] + end[path[:, -1]]
        return s + trans[path[:, :-1], path[:, 1:]].sum(1)

    paths = torch.tensor(list(itertools.product(range(cfg.tags), repeat=cfg.seq)))
    every = torch.stack([score(p.expand(cfg.batch, -1)) for p in paths], 1)
    return (torch.logsumexp(every, 1) - score(labels)).mean()
