"""A Mixture-of-Depths decoder, written from the README and docs/ alone (a held-out model).

Dims: ``batch``, ``seq``, ``kept`` (``key_kept``: the tokens a layer processes), ``d_model``,
``heads``, ``d_head``, ``d_ff``, ``vocab``, ``layer``. In every layer (``md.repeat``) a router
scores each token (``x . w_router``, ``[batch, seq]``) and ``md.top_k`` over ``seq`` picks the
``capacity`` best of each sequence. Those tokens are gathered by a per-sample one-hot einsum (as
the docs write a per-sample gather), go through a pre-norm block (causal attention among
themselves, by their original positions, then an MLP), and the block's update, multiplied by the
token's router score, is scattered back by the one-hot's transpose; the other tokens skip the
layer on the residual. Each layer also returns, as a per-layer output, the router's auxiliary
loss: a binary cross-entropy of ``sigmoid(score)`` against whether the token was picked (what
lets a sampler decide causally), added to the LM loss with ``aux_weight``.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 256
    layers: int = 4
    seq: int = 32
    batch: int = 8
    capacity: float = 0.5      # the fraction of a sequence's tokens each layer processes
    aux_weight: float = 0.1

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=20, d_model=16, heads=4, d_head=4, d_ff=24, layers=4, seq=8, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    k = max(1, int(cfg.seq * cfg.capacity))
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    kept, key_kept = md.Dim("kept", k), md.Dim("key_kept", k)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_mod") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.1)
        wpe = md.param("wpe", [seq, d_model], scale=0.1)
        blocks = {
            "w_router": md.param("w_router", [layer, d_model], fan_out=["layer"]),
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "w_fc": md.param("w_fc", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_proj": md.param("w_proj", [layer, d_ff, d_model], fan_out=["layer", d_model]),
        }
        lnf = md.param("lnf", [d_model], init="ones")

        def block(x, p):
            score = md.einsum("batch seq d_model, d_model -> batch seq", x, p["w_router"])
            top, idx = md.top_k(score, "seq", k, new_dim="kept")                      # [batch, kept]
            pick = md.one_hot(idx, seq)                                               # [batch, kept, seq]
            xs = md.einsum("batch kept seq, batch seq d_model -> batch kept d_model", pick, x)
            # causal among the picked tokens, by their places in the sequence
            allowed = md.less_equal(md.rename(idx, kept="key_kept"), idx)              # [batch, key_kept, kept]
            h = md.layer_norm(xs, "d_model", p["ln1"])
            q = md.einsum("batch kept d_model, d_model heads d_head -> batch kept heads d_head", h, p["wq"])
            hk = md.rename(h, kept="key_kept")
            kk = md.einsum("batch key_kept d_model, d_model heads d_head -> batch key_kept heads d_head", hk, p["wk"])
            v = md.einsum("batch key_kept d_model, d_model heads d_head -> batch key_kept heads d_head", hk, p["wv"])
            s = md.einsum("batch kept heads d_head, batch key_kept heads d_head -> batch heads kept key_kept", q, kk)
            att = md.softmax(md.where(allowed, s * cfg.d_head ** -0.5, -1e9), "key_kept")
            o = md.einsum("batch heads kept key_kept, batch key_kept heads d_head -> batch kept heads d_head", att, v)
            a = md.einsum("batch kept heads d_head, heads d_head d_model -> batch kept d_model", o, p["wo"])
            m = md.gelu(md.einsum("batch kept d_model, d_model d_ff -> batch kept d_ff",
                                  md.layer_norm(xs + a, "d_model", p["ln2"]), p["w_fc"]))
            update = a + md.einsum("batch kept d_ff, d_ff d_model -> batch kept d_model", m, p["w_proj"])
            out = x + md.einsum("batch kept seq, batch kept d_model -> batch seq d_model", pick, update * top)
            # the router's auxiliary loss: was the token picked?
            chosen = md.stop_gradient(md.reduce_sum(pick, "kept"))                   # [batch, seq]
            prob = md.sigmoid(score)
            bce = -(chosen * md.log(prob + 1e-6) + (1 - chosen) * md.log(1 - prob + 1e-6))
            return out, {"aux": md.reduce_mean(bce)}

        x, per_layer = md.repeat(block, md.gather(wte, ids, "vocab") + wpe, blocks, "layer")
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", md.layer_norm(x, "d_model", lnf), wte)
        aux = md.reduce_sum(per_layer["aux"], "layer")
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab")) + cfg.aux_weight * aux

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    return md.Model(g, loss, {"wte": wte, "wpe": wpe, **blocks, "lnf": lnf}, feeds, cfg, logits=logits,
                    outputs={"router_aux": aux})
