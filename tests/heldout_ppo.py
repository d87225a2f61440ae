"""PPO's actor-critic loss on a token policy, written from the README and docs/ alone (a held-out model).

The policy reads observation tokens ``[batch, seq]`` with a small causal transformer (pre-norm
blocks under ``md.repeat``) and gives, at every position, logits over ``act`` actions (the
actor) and a value (the critic, a linear head). The rollout is fed in: the actions taken, their
log-probabilities under the old policy, the advantages and the returns. The loss, per position
and averaged: ``-min(ratio * A, clamp(ratio, 1 - eps, 1 + eps) * A)`` for ``ratio = exp(logp -
old_logp)``, plus ``vf * (value - return)**2`` and minus ``ent * entropy``. The log-probability
of the taken action is picked by a one-hot contraction (``form=onehot``; ``md.gather`` picks rows
of one table for all ids, not one per sample, api.md) or read off the cross entropy, ``logp =
-cross_entropy(logits, action)`` (``form=ce``).

Legend: b batch, s seq, k key_seq, d d_model, n heads, e d_head, f d_ff, v vocab (observations),
a act (actions), l layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    actions: int = 16
    d_model: int = 128
    heads: int = 4
    d_head: int = 32
    d_ff: int = 512
    layers: int = 4
    seq: int = 32
    batch: int = 16
    clip: float = 0.2
    vf: float = 0.5
    ent: float = 0.01
    form: str = "onehot"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=12, actions=6, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, seq=8, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    if cfg.form not in ("onehot", "ce"):
        raise ValueError(f"form must be 'onehot' or 'ce', not {cfg.form!r}")
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    n, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    v, a, l = md.Dim("vocab", cfg.vocab), md.Dim("act", cfg.actions), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_ppo") as g:
        obs = md.input("obs", [b, s], torch.int64)
        action = md.input("action", [b, s], torch.int64)
        old_logp = md.input("old_logp", [b, s])
        adv = md.input("advantage", [b, s])
        ret = md.input("returns", [b, s])
        p = {"emb": md.param("emb", [v, d], scale=0.5),
             "pos": md.param("pos", [s, d], scale=0.5),
             "ln_f": md.param("ln_f", [d], init="ones"),
             "actor": md.param("actor", [d, a], fan_out=[a]),
             "critic": md.param("critic", [d])}
        blocks = {
            "ln1": md.param("ln1", [l, d], init="ones"),
            "wq": md.param("wq", [l, d, n, e], fan_out=[l, n, e]),
            "wk": md.param("wk", [l, d, n, e], fan_out=[l, n, e]),
            "wv": md.param("wv", [l, d, n, e], fan_out=[l, n, e]),
            "wo": md.param("wo", [l, n, e, d], fan_out=[l, d]),
            "ln2": md.param("ln2", [l, d], init="ones"),
            "w1": md.param("w1", [l, d, f], fan_out=[l, f]),
            "w2": md.param("w2", [l, f, d], fan_out=[l, d]),
        }

        def block(x, q):
            z = md.layer_norm(x, "d_model", q["ln1"])
            proj = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
            kk = md.rename(md.einsum(proj, z, q["wk"]), seq="key_seq")
            vv = md.rename(md.einsum(proj, z, q["wv"]), seq="key_seq")
            y = md.attention(md.einsum(proj, z, q["wq"]), kk, vv, "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, q["wo"])
            z = md.layer_norm(x, "d_model", q["ln2"])
            u = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", z, q["w1"]))
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, q["w2"])

        x = md.gather(p["emb"], obs, "vocab") + p["pos"]
        x = md.repeat(block, x, blocks, l, remat=cfg.remat)
        h = md.layer_norm(x, "d_model", p["ln_f"])
        logits = md.einsum("batch seq d_model, d_model act -> batch seq act", h, p["actor"])
        value = md.einsum("batch seq d_model, d_model -> batch seq", h, p["critic"])
        logp_all = logits - md.logsumexp(logits, "act")                    # [batch, seq, act]
        if cfg.form == "onehot":
            logp = md.reduce_sum(logp_all * md.one_hot(action, a), "act")
        else:
            logp = -md.cross_entropy(logits, action, "act")
        ratio = md.exp(logp - old_logp)
        surrogate = md.minimum(ratio * adv, md.clamp(ratio, 1.0 - cfg.clip, 1.0 + cfg.clip) * adv)
        entropy = -md.reduce_sum(md.exp(logp_all) * logp_all, "act")
        loss = (md.reduce_mean(-surrogate) + cfg.vf * md.reduce_mean((value - ret) ** 2)
                - cfg.ent * md.reduce_mean(entropy))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        shape = (cfg.batch, cfg.seq)
        act = torch.randint(0, cfg.actions, shape, generator=gen)
        # old log-probs near a uniform policy's, so some ratios fall outside the clip range
        old = -torch.log(torch.tensor(float(cfg.actions))) + 0.4 * torch.randn(shape, generator=gen)
        return {"obs": torch.randint(0, cfg.vocab, shape, generator=gen), "action": act, "old_logp": old,
                "advantage": torch.randn(shape, generator=gen), "returns": torch.randn(shape, generator=gen)}

    return md.Model(g, loss, {**p, **blocks}, feeds, cfg)
