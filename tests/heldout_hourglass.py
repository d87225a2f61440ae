"""Hourglass transformer: a causal LM that shortens its sequence by 2 in the middle.

Held-out model (round 15a), written from the user guides only. A pre block runs at full
length; the sequence is shifted right by one (the shortening factor minus one, so that a
short position never sees a token after the ones it stands for) and merged in pairs,
``seq -> (seq2 two)``; the middle layers (``md.repeat``) run at half length; an upsampling
projection splits each short vector back into two and adds the pre block's output (the
residual); a post block and the LM head finish at full length. ``--config pool=linear``
(the default) merges a pair by a linear map of its concatenation, ``pool=mean`` by its mean.

Legend: b batch, s seq, s2 seq2 (the short length), t two (a pair's position), d d_model.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    seq: int = 16
    vocab: int = 32
    d_model: int = 16
    heads: int = 2
    d_head: int = 8
    d_ff: int = 32
    layers: int = 2          # the middle (short) layers
    pool: str = "linear"     # linear | mean
    remat: str = "none"   # what each repeated layer saves for its backward (md.repeat's remat=)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2)


def _block_params(prefix, dims, layer=None):
    D, Hh, E, F = dims
    lead = [layer] if layer is not None else []
    fo = [layer.name] if layer is not None else []
    return {
        "ln1": md.param(f"{prefix}ln1", lead + [D], init="ones"), "ln2": md.param(f"{prefix}ln2", lead + [D], init="ones"),
        "wq": md.param(f"{prefix}wq", lead + [D, Hh, E], fan_out=fo + ["heads", "d_head"]),
        "wk": md.param(f"{prefix}wk", lead + [D, Hh, E], fan_out=fo + ["heads", "d_head"]),
        "wv": md.param(f"{prefix}wv", lead + [D, Hh, E], fan_out=fo + ["heads", "d_head"]),
        "wo": md.param(f"{prefix}wo", lead + [Hh, E, D], fan_out=fo + ["d_model"]),
        "w1": md.param(f"{prefix}w1", lead + [D, F], fan_out=fo + ["d_ff"]),
        "w2": md.param(f"{prefix}w2", lead + [F, D], fan_out=fo + ["d_model"]),
    }


def _block(x, p, seq):
    """One pre-norm causal decoder layer over ``seq``."""
    key = f"key_{seq}"
    h = md.layer_norm(x, "d_model", p["ln1"])
    q = md.einsum(f"batch {seq} d_model, d_model heads d_head -> batch {seq} heads d_head", h, p["wq"])
    k = md.rename(md.einsum(f"batch {seq} d_model, d_model heads d_head -> batch {seq} heads d_head", h, p["wk"]), {seq: key})
    v = md.rename(md.einsum(f"batch {seq} d_model, d_model heads d_head -> batch {seq} heads d_head", h, p["wv"]), {seq: key})
    a = md.attention(q, k, v, seq, key, "d_head", causal=True)
    x = x + md.einsum(f"batch {seq} heads d_head, heads d_head d_model -> batch {seq} d_model", a, p["wo"])
    f = md.gelu(md.einsum(f"batch {seq} d_model, d_model d_ff -> batch {seq} d_ff", md.layer_norm(x, "d_model", p["ln2"]), p["w1"]))
    return x + md.einsum(f"batch {seq} d_ff, d_ff d_model -> batch {seq} d_model", f, p["w2"])


def build(cfg: Config = Config()) -> md.Model:
    B, S, V, D = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    dims = (D, md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff))
    L, T2 = md.Dim("layer", cfg.layers), md.Dim("two", 2)
    with md.Graph("hourglass") as g:
        ids, labels = md.input("ids", [B, S], dtype=torch.int64), md.input("labels", [B, S], dtype=torch.int64)
        wte, wpe = md.param("wte", [V, D], scale=0.5), md.param("wpe", [S, D], scale=0.5)
        pre, post = _block_params("pre_", dims), _block_params("post_", dims)
        mid = _block_params("mid_", dims, L)
        x = _block(md.gather(wte, ids, "vocab") + wpe, pre, "seq")
        # shorten: shift right by one so short position i sees tokens <= 2i only, then merge pairs
        pairs = md.rearrange(md.shift(x, "seq", 1), "batch (seq2 two) d_model -> batch seq2 two d_model", two=2)
        if cfg.pool == "linear":
            w_down = md.param("w_down", [T2, D, md.Dim("d_short", cfg.d_model)], fan_out=["d_short"])
            short = md.rename(md.einsum("batch seq2 two d_model, two d_model d_short -> batch seq2 d_short", pairs, w_down),
                              d_short="d_model")
        elif cfg.pool == "mean":
            w_down = None
            short = md.reduce_mean(pairs, "two")
        else:
            raise ValueError(f"pool={cfg.pool!r}: linear or mean")
        short = md.repeat(lambda h, p: _block(h, p, "seq2"), short, mid, L, remat=cfg.remat)
        # upsample: each short vector becomes two, added to the pre block's output
        w_up = md.param("w_up", [D, T2, md.Dim("d_up", cfg.d_model)], fan_out=["two", "d_up"])
        up = md.einsum("batch seq2 d_model, d_model two d_up -> batch seq2 two d_up", short, w_up)
        x = x + md.rename(md.rearrange(up, "batch seq2 two d_up -> batch (seq2 two) d_up"), seq2_two="seq", d_up="d_model")
        x = md.layer_norm(_block(x, post, "seq"), "d_model")
        lm_head = md.param("lm_head", [D, V], fan_out=["vocab"])
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", x, lm_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))
    params = {"wte": wte, "wpe": wpe, "w_up": w_up, "lm_head": lm_head}
    params.update({f"pre_{k}": v for k, v in pre.items()})
    params.update({f"post_{k}": v for k, v in post.items()})
    params.update({f"mid_{k}": v for k, v in mid.items()})
    if w_down is not None:
        params["w_down"] = w_down

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": toks[:, :-1], "labels": toks[:, 1:]}

    return md.Model(g, loss, params, feeds, cfg, logits=logits)
