"""A reward model for RLHF, written from the README and docs/ alone (a held-out model).

Dims: ``batch`` (preference pairs), ``pair`` (2: chosen, rejected), ``seq`` (``key_seq``),
``vocab``, ``layer``, ``d_model``, ``heads``, ``d_head``, ``d_ff``. A pre-norm causal decoder
reads each padded sequence; ``lengths [batch, pair]`` (fed) says how many tokens are real, and
the scalar head reads the final hidden state of the last real token (a one-hot of
``lengths - 1`` over ``seq`` contracted with the hidden states). The loss is Bradley-Terry's,
``-log sigmoid(r_chosen - r_rejected)`` averaged over the pairs, plus a small penalty on the
rewards' size (``reward_l2 * mean(r**2)``) that keeps them centred (``center=True``: on the
rewards less the batch's mean, a whole-batch value).
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
    layers: int = 2
    seq: int = 32
    batch: int = 8
    reward_l2: float = 0.01
    center: bool = False            # subtract the batch's mean reward before the penalty

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, seq=8, batch=4)


def _block(h, p):
    """A pre-norm causal decoder block over ``h [batch, pair, seq, d_model]``."""
    a = md.layer_norm(h, "d_model", p["ln1"])
    proj = lambda w: md.einsum("batch pair seq d_model, d_model heads d_head -> batch pair seq heads d_head", a, w)
    k, v = (md.rename(proj(p[w]), seq="key_seq") for w in ("wk", "wv"))
    o = md.attention(proj(p["wq"]), k, v, "seq", "key_seq", "d_head", causal=True)
    h = h + md.einsum("batch pair seq heads d_head, heads d_head d_model -> batch pair seq d_model", o, p["wo"])
    m = md.relu(md.einsum("batch pair seq d_model, d_model d_ff -> batch pair seq d_ff",
                          md.layer_norm(h, "d_model", p["ln2"]), p["w_fc"]))
    return h + md.einsum("batch pair seq d_ff, d_ff d_model -> batch pair seq d_model", m, p["w_proj"])


def _softplus(x):
    return md.maximum(x, 0.0) + md.log(1.0 + md.exp(-md.abs(x)))


def build(cfg: Config = Config()) -> md.Model:
    batch, pair, seq = md.Dim("batch", cfg.batch), md.Dim("pair", 2), md.Dim("seq", cfg.seq)
    vocab, d_model, layer = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model), md.Dim("layer", cfg.layers)
    heads, d_head, d_ff = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    with md.Graph("heldout_reward") as g:
        ids = md.input("ids", [batch, pair, seq], dtype=torch.int64)
        lengths = md.input("lengths", [batch, pair], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.1)
        wpe = md.param("wpe", [seq, d_model], scale=0.02)
        blocks = {
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "w_fc": md.param("w_fc", [layer, d_model, d_ff], fan_out=["layer", "d_ff"]),
            "w_proj": md.param("w_proj", [layer, d_ff, d_model], fan_out=["layer", "d_model"]),
        }
        lnf = md.param("lnf", [d_model], init="ones")
        w_r = md.param("w_r", [d_model])
        b_r = md.param("b_r", [], init="zeros")
        h = md.repeat(_block, md.gather(wte, ids, "vocab") + wpe, blocks, "layer")
        last = md.one_hot(lengths - 1, seq)                                          # [batch, pair, seq]
        h_last = md.einsum("batch pair seq d_model, batch pair seq -> batch pair d_model",
                           md.layer_norm(h, "d_model", lnf), last)
        reward = md.einsum("batch pair d_model, d_model -> batch pair", h_last, w_r) + b_r
        chosen, rejected = (md.squeeze(md.slice_(reward, "pair", i, i + 1), "pair") for i in (0, 1))
        # centring by the batch mean needs every row's reward at once (a whole-batch value of params)
        centred = reward - md.reduce_mean(reward) if cfg.center else reward
        loss = md.reduce_mean(_softplus(rejected - chosen)) + cfg.reward_l2 * md.reduce_mean(centred ** 2)
        accuracy = md.reduce_mean(md.cast(md.greater(chosen, rejected), torch.float32))
    params = {"wte": wte, "wpe": wpe, "lnf": lnf, "w_r": w_r, "b_r": b_r, **blocks}

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        """Chosen sequences hold more of the tokens below vocab/2 than rejected ones; padding 0."""
        idx = range(cfg.batch)[rows or slice(None)]
        ids = torch.zeros(len(idx), 2, cfg.seq, dtype=torch.int64)
        lengths = torch.zeros(len(idx), 2, dtype=torch.int64)
        half = cfg.vocab // 2
        for i, r in enumerate(idx):
            gen = md.row_generator(seed, r)
            for j in range(2):
                n = int(torch.randint(2, cfg.seq + 1, (), generator=gen))
                low = torch.rand(n, generator=gen) < (0.8 if j == 0 else 0.2)
                tok = torch.where(low, torch.randint(1, half, (n,), generator=gen),
                                  torch.randint(half, cfg.vocab, (n,), generator=gen))
                ids[i, j, :n], lengths[i, j] = tok, n
        return {"ids": ids, "lengths": lengths}

    return md.Model(g, loss, params, batches=batches, config=cfg, metrics={"accuracy": accuracy},
                    outputs={"reward": reward})
