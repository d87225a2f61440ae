"""A transformer encoder with a linear-chain CRF loss (a tagger with no BiLSTM).

Held-out model (round 15a), written from the user guides only. The encoder's emissions
``[batch, seq, tags]`` and a learned transition matrix score every tag path; the loss is
log Z (the forward algorithm) minus the gold path's score. ``--config form=scan`` runs the
forward algorithm's logsumexp recurrence as an inner ``md.repeat`` over ``seq`` (one step per
position, the emissions as its stacked tensor); ``form=tree`` (the default) multiplies the
per-position transition matrices in log space pairwise, ``seq -> (seq two)``, log2(seq) levels.

Legend: b batch, s seq, d d_model, t tags (to), f tag_from, j mid (the summed tag).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    seq: int = 16
    vocab: int = 32
    tags: int = 5
    d_model: int = 16
    heads: int = 2
    d_head: int = 8
    d_ff: int = 32
    layers: int = 2
    form: str = "tree"   # tree | scan
    remat: str = "none"   # what each repeated layer saves for its backward (md.repeat's remat=)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, vocab=16, tags=3, d_model=8, heads=2, d_head=4, d_ff=16, layers=2)


def _block(x, p):
    """One pre-norm bidirectional encoder layer."""
    h = md.layer_norm(x, "d_model", p["ln1"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
    k = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"]), seq="key_seq")
    v = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"]), seq="key_seq")
    a = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False)
    x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", a, p["wo"])
    h = md.layer_norm(x, "d_model", p["ln2"])
    f = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w1"]))
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, p["w2"])


def _log_matmul(a, b):
    """(a (x) b)[.., tag_from, tags] = logsumexp over mid of a[.., tag_from, mid] + b[.., mid, tags]."""
    return md.logsumexp(md.rename(a, tags="mid") + md.rename(b, tag_from="mid"), "mid")


def _log_z_tree(emit, trans, start, end, cfg):
    """log Z by pairwise log-space products of the per-position matrices M_t[from, to]."""
    S = emit.shape["seq"]
    first = md.equal(md.arange(S), 0)                                           # [seq]
    # M_0[from, to] = start[to] + e_0[to] for every from (row 0 is read at the end); M_t = trans + e_t
    m = md.where(first, md.broadcast_to(start, trans.shape), trans) + emit          # [batch, seq, tag_from, tags]
    n = cfg.seq
    while n > 1:
        pairs = md.rearrange(m, "batch (seq two) tag_from tags -> batch seq two tag_from tags", two=2)
        m = _log_matmul(md.squeeze(md.slice_(pairs, "two", 0, 1), "two"), md.squeeze(md.slice_(pairs, "two", 1, 2), "two"))
        n //= 2
    row = md.squeeze(md.slice_(md.squeeze(m, "seq"), "tag_from", 0, 1), "tag_from")   # [batch, tags]
    return md.logsumexp(row + end, "tags")


def _log_z_scan(emit, trans, start, end):
    """log Z by the forward recurrence alpha_t = logsumexp_from(alpha_{t-1} + trans) + e_t."""
    n = emit.shape["seq"].size
    alpha0 = md.squeeze(md.slice_(emit, "seq", 0, 1), "seq") + start                  # [batch, tags]
    rest = md.slice_(emit, "seq", 1, n)                                              # [batch, seq-1, tags]

    def step(alpha, p):
        return md.logsumexp(md.rename(alpha, tags="tag_from") + trans, "tag_from") + p["e"]

    alpha = md.repeat(step, alpha0, {"e": rest}, "seq")
    return md.logsumexp(alpha + end, "tags")


def _gold(emit, tags, trans, start, end, cfg):
    """The gold path's score: its emissions, its transitions (gathered rows), start and end."""
    T, S = emit.shape["tags"], emit.shape["seq"]
    gold_t = md.one_hot(tags, T)                                                   # [batch, seq, tags]
    score = md.reduce_sum(emit * gold_t, ["seq", "tags"])
    prev = md.shift(tags, "seq", 1)                                                 # tags[t - 1] (0 at t = 0)
    rows = md.gather(trans, prev, "tag_from")                                        # [batch, seq, tags]
    later = md.cast(md.greater(md.arange(S), 0), torch.float32)                      # no transition into t = 0
    score = score + md.reduce_sum(rows * gold_t * later, ["seq", "tags"])
    score = score + md.reduce_sum(md.squeeze(md.slice_(gold_t, "seq", 0, 1), "seq") * start, "tags")
    return score + md.reduce_sum(md.squeeze(md.slice_(gold_t, "seq", cfg.seq - 1, cfg.seq), "seq") * end, "tags")


def build(cfg: Config = Config()) -> md.Model:
    B, S, V, D = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    Hh, E, F, L = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    T, TF = md.Dim("tags", cfg.tags), md.Dim("tag_from", cfg.tags)
    if cfg.form == "tree" and cfg.seq & (cfg.seq - 1):
        raise ValueError(f"form=tree halves seq: seq={cfg.seq} must be a power of 2 (or form=scan)")
    with md.Graph("crf") as g:
        ids = md.input("ids", [B, S], dtype=torch.int64)
        tags = md.input("tags", [B, S], dtype=torch.int64)
        wte, wpe = md.param("wte", [V, D], scale=0.5), md.param("wpe", [S, D], scale=0.5)
        blocks = {
            "ln1": md.param("ln1", [L, D], init="ones"), "ln2": md.param("ln2", [L, D], init="ones"),
            "wq": md.param("wq", [L, D, Hh, E], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [L, D, Hh, E], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [L, D, Hh, E], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [L, Hh, E, D], fan_out=["layer", "d_model"]),
            "w1": md.param("w1", [L, D, F], fan_out=["layer", "d_ff"]),
            "w2": md.param("w2", [L, F, D], fan_out=["layer", "d_model"]),
        }
        x = md.repeat(_block, md.gather(wte, ids, "vocab") + wpe, blocks, L, remat=cfg.remat)
        w_emit = md.param("w_emit", [D, T], fan_out=["tags"])
        emit = md.einsum("batch seq d_model, d_model tags -> batch seq tags", md.layer_norm(x, "d_model"), w_emit)
        trans = md.param("trans", [TF, T], scale=0.5)
        start, end = md.param("start", [T], scale=0.5), md.param("end", [T], scale=0.5)
        if cfg.form == "tree":
            log_z = _log_z_tree(emit, trans, start, end, cfg)
        elif cfg.form == "scan":
            log_z = _log_z_scan(emit, trans, start, end)
        else:
            raise ValueError(f"form={cfg.form!r}: tree or scan")
        loss = md.reduce_mean(log_z - _gold(emit, tags, trans, start, end, cfg))
    params = {"wte": wte, "wpe": wpe, "w_emit": w_emit, "trans": trans, "start": start, "end": end, **blocks}

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        return {"ids": ids, "tags": (ids * 7 + torch.randint(0, 2, ids.shape, generator=gen)) % cfg.tags}

    return md.Model(g, loss, params, feeds, cfg, outputs={"emit": emit, "log_z": log_z})
