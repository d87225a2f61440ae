"""Held-out model (round 17b): a MusicGen-style multi-codebook LM with the delay pattern.

Legend: b = batch, k = codebooks, s = seq (frames), v = vocab (card codes + 1 special id, the last,
for "no code here": delayed padding and the start), d = d_model, h = heads, e = d_head, f = d_ff.

Delay pattern: codebook k is shifted right by k frames (``slice_`` its first ``seq - k`` frames and
``pad`` k special ids before them), so at frame t the model predicts codebook 0 of frame t, codebook
1 of frame t-1, ...; the input is that delayed grid shifted right once more (the start id first).
The K codebook embeddings of a frame are summed (one einsum with ``one_hot`` over ``[codebooks,
vocab, d_model]``), a causal pre-norm transformer under ``md.repeat`` runs over the frames, and K
output heads (``[codebooks, d_model, vocab]``) give each codebook's logits. The loss is the
cross-entropy summed over codebooks and averaged over the frames, ignoring the delayed padding
(positions whose label is the special id, masked by ``where``).
``form=bias``: the heads also get a per-codebook, per-frame learned bias (none in ``plain``), to
exercise a ``[codebooks, seq, vocab]`` param under seq and codebook splits.
``delay=shift``: the same delay from one ``md.shift`` of the whole grid per k, kept on codebook k by a
mask (no op cuts ``codebooks`` apart: under ``codebooks:model`` the slice form's parts are summed
from the ranks, 4 allreduces the shift form does without; under ``seq:model`` its halos are one per
shift, not one per slice and pad).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    card: int = 63
    codebooks: int = 4
    seq: int = 32
    d_model: int = 64
    heads: int = 4
    d_ff: int = 128
    layers: int = 2
    batch: int = 8
    form: str = "plain"    # plain | bias
    remat: str = "none"
    delay: str = "slice"   # slice: slice_/pad per codebook, concat | shift: md.shift of the whole grid per k, masked

    @classmethod
    def tiny(cls):
        return cls(card=7, codebooks=4, seq=8, d_model=8, heads=2, d_ff=16, layers=2, batch=4)


def _delay(codes, cfg, special: int):
    """``codes [batch, codebooks, seq]`` with codebook k shifted right by k frames."""
    parts = []
    for k in range(cfg.codebooks):
        c = md.slice_(md.slice_(codes, "codebooks", k, k + 1), "seq", 0, cfg.seq - k)
        parts.append(md.pad(c, "seq", k, 0, value=special))
    return md.concat(parts, "codebooks")


def _delay_by_shift(codes, cfg, special: int):
    """The same delay as :func:`_delay`, from ``md.shift``s of the whole grid (one per k) each kept on
    codebook k by a mask, so no op cuts the ``codebooks`` dim apart."""
    K, S = codes.shape["codebooks"], codes.shape["seq"]
    cb = md.arange(K)
    out = None
    for k in range(cfg.codebooks):
        part = md.where(md.equal(cb, k), md.shift(codes, "seq", k), 0)
        out = part if out is None else out + part
    return md.where(md.greater_equal(md.arange(S), cb), out, special)


def _block(x, p):
    a = md.layer_norm(x, "d_model", p["ln1"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", a, p["wq"])
    kv = md.rename(a, seq="key_seq")
    k = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", kv, p["wk"])
    v = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", kv, p["wv"])
    y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
    x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["wo"])
    h = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff",
                          md.layer_norm(x, "d_model", p["ln2"]), p["w1"]))
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", h, p["w2"])


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("plain", "bias"):
        raise ValueError(f"form must be 'plain' or 'bias', not {cfg.form!r}")
    special = cfg.card
    B, K, S = md.Dim("batch", cfg.batch), md.Dim("codebooks", cfg.codebooks), md.Dim("seq", cfg.seq)
    V, D, H = md.Dim("vocab", cfg.card + 1), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    E, F, L = md.Dim("d_head", cfg.d_model // cfg.heads), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        codes = md.input("codes", [B, K, S], dtype=torch.int64)
        labels = (_delay if cfg.delay == "slice" else _delay_by_shift)(codes, cfg, special)                              # [batch, codebooks, seq]
        inputs = md.pad(md.slice_(labels, "seq", 0, cfg.seq - 1), "seq", 1, 0, value=special)
        emb = md.param("emb", [K, V, D], scale=0.5)
        pos = md.param("pos", [S, D], scale=0.1)
        x = md.einsum("batch codebooks seq vocab, codebooks vocab d_model -> batch seq d_model",
                      md.one_hot(inputs, V), emb) + pos
        ps = {"ln1": md.param("ln1", [L, D], init="ones"), "ln2": md.param("ln2", [L, D], init="ones")}
        for n, shape, fo in (("wq", [L, D, H, E], ["heads", "d_head"]), ("wk", [L, D, H, E], ["heads", "d_head"]),
                             ("wv", [L, D, H, E], ["heads", "d_head"]), ("wo", [L, H, E, D], ["d_model"]),
                             ("w1", [L, D, F], ["d_ff"]), ("w2", [L, F, D], ["d_model"])):
            ps[n] = md.param(n, shape, fan_out=["layer", *fo])
        lnf = md.param("lnf", [D], init="ones")
        h = md.layer_norm(md.repeat(_block, x, ps, L, remat=cfg.remat), "d_model", lnf)
        heads_w = md.param("heads_w", [K, D, V], fan_out=["codebooks", "vocab"])
        logits = md.einsum("batch seq d_model, codebooks d_model vocab -> batch codebooks seq vocab", h, heads_w)
        params = {"emb": emb, "pos": pos, **ps, "lnf": lnf, "heads_w": heads_w}
        if cfg.form == "bias":
            params["head_b"] = md.param("head_b", [K, S, V], init="zeros")
            logits = logits + params["head_b"]
        keep = md.not_equal(labels, special)
        ce = md.cross_entropy(logits, md.where(keep, labels, 0), "vocab") * md.cast(keep, torch.float32)
        # summed over codebooks, averaged over every (batch, frame)
        loss = md.reduce_sum(ce) / (cfg.batch * cfg.seq)

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"codes": torch.randint(0, cfg.card, (cfg.batch, cfg.codebooks, cfg.seq), generator=gen)}

    return md.Model(g, loss, params, make_feeds, cfg)
