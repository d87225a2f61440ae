"""A decoder with ALiBi, a sliding window, a padding mask input, soft-capped logits, z-loss and
label smoothing, written from the README and docs/ alone (a held-out model).

No position embedding: each head adds ``slope_h * (key - query)`` to its scores (ALiBi), keys
further back than ``window`` are masked (a sliding window), and the input ``keep``
``[batch, key_seq]`` (1: a real token, 0: padding) is read inside ``md.repeat`` as part of the
attention mask. The logits are soft-capped (``cap * tanh(logits / cap)``) and the loss is the
label-smoothed cross-entropy plus a z-loss on ``logsumexp(logits)``.
"""
from dataclasses import dataclass

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
    seq: int = 16
    batch: int = 4
    window: int = 6
    softcap: float = 5.0      # small, so that the cap bends the logits of a tiny model
    z_loss: float = 1e-2
    smoothing: float = 0.1
    masked_loss: bool = False   # the loss a mean over real tokens only: sum(loss * keep) / sum(keep)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=4, d_head=4, d_ff=32, layers=2, seq=8, batch=4, window=3)


def alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_alibi") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        keep = md.input("keep", [batch, key_seq])
        wte = md.param("wte", [vocab, d_model], scale=0.5)
        blocks = {
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=[d_model]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "w_fc": md.param("w_fc", [layer, d_model, d_ff], fan_out=[d_ff]),
            "w_proj": md.param("w_proj", [layer, d_ff, d_model], fan_out=[d_model]),
        }
        lnf = md.param("lnf", [d_model], init="ones")
        lm_head = md.param("lm_head", [d_model, vocab], fan_out=[vocab])

        distance = md.cast(md.arange(key_seq), torch.float32) - md.cast(md.arange(seq), torch.float32)  # [key_seq, seq]
        alibi = md.constant(alibi_slopes(cfg.heads), [heads]) * distance
        in_window = md.greater(distance, -float(cfg.window))
        allowed = md.where(md.causal_mask(seq, key_seq), md.cast(in_window, torch.float32), 0.0)

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.rms_norm(x, "d_model", p["ln1"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
            k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"])
            v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"])
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            scores = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
            # a padding key is masked like a future one (the input ``keep`` read in every layer); a
            # query whose keys are all masked attends uniformly, exactly, to -1e9 everywhere
            visible = md.greater(allowed * keep, 0.5)
            att = md.softmax(md.where(visible, scores * cfg.d_head ** -0.5 + alibi, -1e9), "key_seq")
            o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            h = md.rms_norm(x, "d_model", p["ln2"])
            f = md.relu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_fc"])) ** 2
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, p["w_proj"])

        x = md.gather(wte, ids, "vocab")
        x = md.repeat(block, x, blocks, "layer")
        x = md.rms_norm(x, "d_model", lnf)
        raw = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", x, lm_head)
        logits = cfg.softcap * md.tanh(raw / cfg.softcap)
        nll = md.cross_entropy(logits, labels, "vocab")
        uniform = -md.reduce_mean(md.log_softmax(logits, "vocab"), "vocab")
        z = md.logsumexp(logits, "vocab")
        per_token = (1.0 - cfg.smoothing) * nll + cfg.smoothing * uniform + cfg.z_loss * z ** 2
        if cfg.masked_loss:
            real = md.rename(keep, key_seq="seq")
            loss = md.reduce_sum(per_token * real) / md.reduce_sum(real)
        else:
            loss = md.reduce_mean(per_token)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        keep = torch.ones(cfg.batch, cfg.seq)
        for b in range(cfg.batch):                     # row b has b padding tokens at its start
            keep[b, : b % cfg.seq] = 0.0
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:], "keep": keep}

    params = {"wte": wte, **blocks, "lnf": lnf, "lm_head": lm_head}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
