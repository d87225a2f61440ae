"""A T5-style encoder with a bucketed relative position bias, written from the README and docs/ alone (a held-out model).

T5's relative attention: the key position minus the query position is cut into ``buckets``
(half for keys before the query, half after; exact buckets for small distances, then
logarithmic ones up to ``max_distance``), a learned table ``[buckets, heads]`` is looked up
with ``md.gather`` and the result ``[seq, key_seq, heads]`` is added to the attention scores
of every layer (one table for all layers, as T5: made once outside ``md.repeat`` and read by
each block, so its gradient sums every layer's). The bucket index is integer math in the
graph: ``md.arange``, subtraction, ``md.maximum`` for the absolute value, ``md.log`` on the
floats, a cast to int64 for the floor, ``md.minimum`` to clamp. RMSNorm (pre-norm, no
biases), a gated-GELU MLP (T5 v1.1), unscaled dot-product scores, a composite softmax
attention; a masked-token loss over an untied ``vocab`` head.
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    seq: int = 32
    batch: int = 4
    buckets: int = 16
    max_distance: int = 32

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=4, d_head=4, d_ff=24, layers=2, seq=16, batch=4, buckets=8, max_distance=16)


def bucket_ids(seq: md.Dim, key_seq: md.Dim, buckets: int, max_distance: int) -> md.Tensor:
    """T5's bidirectional bucket of (key position - query position): int64 ``[key_seq, seq]``."""
    half = buckets // 2
    exact = half // 2
    rel = md.arange(key_seq) - md.arange(seq)                     # int64, broadcast by name
    after = md.cast(md.greater(rel, 0), torch.int64) * half       # keys after the query: upper half
    n = md.abs(rel)                                               # |distance|
    far = md.log(md.cast(n, torch.float32) / exact) / math.log(max_distance / exact) * (half - exact)
    far = md.minimum(md.cast(far, torch.int64) + exact, half - 1)   # the cast floors (far >= 0 where used)
    return after + md.where(md.less(n, exact), n, far)


def bucket_ids_torch(seq: int, buckets: int, max_distance: int) -> torch.Tensor:
    """The same buckets as Hugging Face's T5 computes them, ``[seq (query), key]``."""
    rel = torch.arange(seq)[None, :] - torch.arange(seq)[:, None]
    half = buckets // 2
    exact = half // 2
    out = (rel > 0).long() * half
    n = rel.abs()
    far = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    far = torch.minimum(far, torch.full_like(far, half - 1))
    return out + torch.where(n < exact, n, far)


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    buckets = md.Dim("buckets", cfg.buckets)
    with md.Graph("heldout_t5rel") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        weights = md.input("weights", [batch, seq])            # 1 at a masked position, else 0
        wte = md.param("wte", [vocab, d_model], scale=1.0)
        rel_table = md.param("rel_table", [buckets, heads], scale=0.5)
        blocks = {
            "attn_norm": md.param("attn_norm", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "mlp_norm": md.param("mlp_norm", [layer, d_model], init="ones"),
            "wi_gate": md.param("wi_gate", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "wi_up": md.param("wi_up", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "wo_ff": md.param("wo_ff", [layer, d_ff, d_model], fan_out=["layer", d_model]),
        }
        norm_f = md.param("norm_f", [d_model], init="ones")
        lm_head = md.param("lm_head", [d_model, vocab], fan_out=[vocab])

        # one bias for every layer: [key_seq, seq, heads]
        bias = md.gather(rel_table, bucket_ids(seq, key_seq, cfg.buckets, cfg.max_distance), "buckets")

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.rms_norm(x, "d_model", p["attn_norm"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
            k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"])
            v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"])
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            scores = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
            att = md.softmax(scores + bias, "key_seq")          # T5: no 1/sqrt(d_head)
            o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            h = md.rms_norm(x, "d_model", p["mlp_norm"])
            gate = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["wi_gate"])
            up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["wi_up"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.gelu(gate) * up, p["wo_ff"])

        x = md.gather(wte, ids, "vocab")
        x = md.repeat(block, x, blocks, "layer")
        x = md.rms_norm(x, "d_model", norm_f)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", x, lm_head)
        ce = md.cross_entropy(logits, labels, "vocab")
        loss = md.reduce_sum(ce * weights) / md.reduce_sum(weights)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        labels_ = torch.randint(1, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        masked = torch.rand(cfg.batch, cfg.seq, generator=gen) < 0.3
        masked[:, 0] = True                                   # at least one masked token per row
        return {"ids": torch.where(masked, torch.zeros_like(labels_), labels_), "labels": labels_,
                "weights": masked.float()}

    params = {"wte": wte, "rel_table": rel_table, **blocks, "norm_f": norm_f, "lm_head": lm_head}
    return md.Model(g, loss, params, feeds, cfg)
