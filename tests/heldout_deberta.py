"""A DeBERTa-style encoder with disentangled attention, written from the README and docs/ alone (a held-out model).

Each score is the sum of three terms (DeBERTa, He et al. 2020): content-to-content ``q_c . k_c``,
content-to-position ``q_c . k_r[bucket(i - j)]`` and position-to-content ``k_c . q_r[bucket(j - i)]``,
scaled by ``1/sqrt(3 d_head)``. The relative position embeddings ``rel_emb [rel, d_model]`` are one
table shared by every layer (layer-normed once before the stack, as DeBERTa-v2's ``norm_rel_ebd``);
each layer projects it to ``k_r`` and ``q_r`` with its own content projections (``share_att_key``).
The relative distance is log-bucketed (DeBERTa-v2's ``make_log_bucket_position``: exact near the
token, logarithmic beyond ``buckets // 2``) and clamped to ``[0, 2 span)``; the per-(query, key)
pick of a bucket from ``[batch, heads, tok, rel]`` is a one-hot contraction (``md.one_hot`` of the
bucket ids ``[tok, key_tok]`` against ``rel``), as the API guide writes a per-sample gather.
Post-norm layers (BERT's), a GELU MLP, a masked-token loss over a head tied to the word embeddings.

Dims: ``ex`` (examples), ``tok`` / ``key_tok`` (positions), ``hid`` (model width), ``heads``,
``d_head``, ``ffn``, ``rel`` (2 span relative buckets), ``vocab``, ``layer``.
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    hid: int = 32
    heads: int = 4
    d_head: int = 8
    ffn: int = 64
    layers: int = 2
    tok: int = 32
    ex: int = 4
    span: int = 8            # buckets per side: rel is 2 * span
    max_position: int = 32
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, hid=16, heads=4, d_head=4, ffn=24, layers=2, tok=12, ex=4, span=4, max_position=12)


def log_buckets(rel: md.Tensor, span: int, max_position: int) -> md.Tensor:
    """DeBERTa-v2's log bucket of a relative distance ``rel`` (int64), shifted into ``[0, 2 span)``."""
    mid = span // 2
    sign = md.cast(md.greater_equal(rel, 0), torch.int64) * 2 - 1      # md.where(cond, -1, 1) wants a Tensor operand
    n = md.abs(rel)
    # log part: mid + ceil(log(n / mid) / log((max - 1) / mid) * (mid - 1)), for n > mid
    logpos = md.log(md.cast(md.maximum(n, 1), torch.float32) / mid) / math.log((max_position - 1) / mid) * (mid - 1)
    up = md.cast(logpos, torch.int64)
    up = up + md.cast(md.greater(logpos, md.cast(up, torch.float32)), torch.int64)   # ceil for logpos >= 0
    bucket = md.where(md.less_equal(n, mid), rel, sign * (up + mid))
    return md.minimum(md.maximum(bucket + span, 0), 2 * span - 1)


def log_buckets_torch(tok: int, span: int, max_position: int) -> torch.Tensor:
    """The same buckets in torch, ``[tok (query), key]`` of query minus key (DeBERTa's c2p)."""
    rel = torch.arange(tok)[:, None] - torch.arange(tok)[None, :]
    mid = span // 2
    n = rel.abs()
    logpos = torch.ceil(torch.log(n.clamp(min=1).float() / mid) / math.log((max_position - 1) / mid) * (mid - 1))
    bucket = torch.where(n <= mid, rel, rel.sign() * (logpos.long() + mid))
    return (bucket + span).clamp(0, 2 * span - 1)


def build(cfg: Config = Config()) -> md.Model:
    ex, tok, key_tok = md.Dim("ex", cfg.ex), md.Dim("tok", cfg.tok), md.Dim("key_tok", cfg.tok)
    hid, heads, d_head = md.Dim("hid", cfg.hid), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    ffn, vocab, layer, rel = md.Dim("ffn", cfg.ffn), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers), \
        md.Dim("rel", 2 * cfg.span)
    with md.Graph("heldout_deberta") as g:
        ids = md.input("ids", [ex, tok], dtype=torch.int64)
        labels = md.input("labels", [ex, tok], dtype=torch.int64)
        weights = md.input("weights", [ex, tok])                 # 1 at a masked position, else 0
        wte = md.param("wte", [vocab, hid], scale=0.3)
        emb_norm = md.param("emb_norm", [hid], init="ones")
        rel_emb = md.param("rel_emb", [rel, hid], scale=1.0)
        rel_norm = md.param("rel_norm", [hid], init="ones")
        qkv = [heads, d_head]
        blocks = {
            "wq": md.param("wq", [layer, hid, *qkv], fan_out=["layer", *qkv]),
            "wk": md.param("wk", [layer, hid, *qkv], fan_out=["layer", *qkv]),
            "wv": md.param("wv", [layer, hid, *qkv], fan_out=["layer", *qkv]),
            "wo": md.param("wo", [layer, *qkv, hid], fan_out=["layer", hid]),
            "ln1": md.param("ln1", [layer, hid], init="ones"),
            "w_in": md.param("w_in", [layer, hid, ffn], fan_out=["layer", ffn]),
            "w_out": md.param("w_out", [layer, ffn, hid], fan_out=["layer", hid]),
            "ln2": md.param("ln2", [layer, hid], init="ones"),
        }
        head_norm = md.param("head_norm", [hid], init="ones")

        # bucket ids: c2p reads bucket(i - j), p2c reads bucket(j - i) (DeBERTa's r_pos), one-hot over rel
        dist = md.arange(tok) - md.arange(key_tok)                          # [tok, key_tok] query minus key
        c2p_pick = md.one_hot(log_buckets(dist, cfg.span, cfg.max_position), rel)
        p2c_pick = md.one_hot(log_buckets(-dist, cfg.span, cfg.max_position), rel)
        rel_h = md.layer_norm(rel_emb, "hid", rel_norm)                      # once, read by every layer
        scale = (3 * cfg.d_head) ** -0.5

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            q = md.einsum("ex tok hid, hid heads d_head -> ex tok heads d_head", x, p["wq"])
            k = md.rename(md.einsum("ex tok hid, hid heads d_head -> ex tok heads d_head", x, p["wk"]), tok="key_tok")
            v = md.rename(md.einsum("ex tok hid, hid heads d_head -> ex tok heads d_head", x, p["wv"]), tok="key_tok")
            k_r = md.einsum("rel hid, hid heads d_head -> rel heads d_head", rel_h, p["wk"])
            q_r = md.einsum("rel hid, hid heads d_head -> rel heads d_head", rel_h, p["wq"])
            c2c = md.einsum("ex tok heads d_head, ex key_tok heads d_head -> ex heads tok key_tok", q, k)
            c2p_all = md.einsum("ex tok heads d_head, rel heads d_head -> ex heads tok rel", q, k_r)
            c2p = md.einsum("ex heads tok rel, tok key_tok rel -> ex heads tok key_tok", c2p_all, c2p_pick)
            p2c_all = md.einsum("ex key_tok heads d_head, rel heads d_head -> ex heads key_tok rel", k, q_r)
            p2c = md.einsum("ex heads key_tok rel, tok key_tok rel -> ex heads tok key_tok", p2c_all, p2c_pick)
            att = md.softmax((c2c + c2p + p2c) * scale, "key_tok")
            o = md.einsum("ex heads tok key_tok, ex key_tok heads d_head -> ex tok heads d_head", att, v)
            x = md.layer_norm(x + md.einsum("ex tok heads d_head, heads d_head hid -> ex tok hid", o, p["wo"]),
                              "hid", p["ln1"])
            f = md.gelu(md.einsum("ex tok hid, hid ffn -> ex tok ffn", x, p["w_in"]))
            return md.layer_norm(x + md.einsum("ex tok ffn, ffn hid -> ex tok hid", f, p["w_out"]), "hid", p["ln2"])

        x = md.layer_norm(md.gather(wte, ids, "vocab"), "hid", emb_norm)
        x = md.repeat(block, x, blocks, "layer", remat=cfg.remat)
        x = md.layer_norm(x, "hid", head_norm)
        logits = md.einsum("ex tok hid, vocab hid -> ex tok vocab", x, wte)      # tied to the embeddings
        ce = md.cross_entropy(logits, labels, "vocab")
        loss = md.reduce_sum(ce * weights) / md.reduce_sum(weights)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        labels_ = torch.randint(1, cfg.vocab, (cfg.ex, cfg.tok), generator=gen)
        masked = torch.rand(cfg.ex, cfg.tok, generator=gen) < 0.25
        masked[:, 1] = True
        return {"ids": torch.where(masked, torch.zeros_like(labels_), labels_), "labels": labels_,
                "weights": masked.float()}

    params = {"wte": wte, "emb_norm": emb_norm, "rel_emb": rel_emb, "rel_norm": rel_norm, **blocks,
              "head_norm": head_norm}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
