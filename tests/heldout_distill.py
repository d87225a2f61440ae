"""Knowledge distillation of a GPT-style decoder, written from the README and docs/ alone (a held-out model).

Dims: ``batch``, ``seq`` (``key_seq``), ``vocab``; the student's ``d_model``, ``heads``, ``d_ff``,
``layer``; the teacher's ``t_model``, ``t_heads``, ``t_ff``, ``t_layer`` (a layer dim of its own
name, as the pipelines guide asks of a second stack), ``d_head`` shared. Two pre-norm LayerNorm
stacks under ``md.repeat`` read the same tokens. The teacher is frozen: its weights are
``md.param``s left out of the Model's ``params``, and its logits pass ``md.stop_gradient``. The
loss is Hinton's: ``KL(softmax(t / T) || softmax(s / T)) * T**2`` averaged over the tokens,
mixed with the student's cross-entropy on the labels by ``kd_weight``.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    d_model: int = 32
    heads: int = 2
    d_ff: int = 64
    layers: int = 2
    t_model: int = 64
    t_heads: int = 4
    t_ff: int = 128
    t_layers: int = 4
    d_head: int = 16
    seq: int = 32
    batch: int = 8
    temperature: float = 2.0
    kd_weight: float = 0.5

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=20, d_model=8, heads=2, d_ff=12, layers=4, t_model=12, t_heads=4, t_ff=16, t_layers=2,
                   d_head=4, seq=8, batch=4)


def _stack(prefix: str, layer, d_model, heads, d_head, d_ff) -> dict:
    """One decoder stack's params, stacked over ``layer``."""
    L, D, H, E, F = layer.name, d_model.name, heads.name, d_head.name, d_ff.name
    return {
        "ln1": md.param(f"{prefix}ln1", [layer, d_model], init="ones"),
        "wqkv": md.param(f"{prefix}wqkv", [layer, d_model, md.Dim("qkv", 3), heads, d_head],
                         fan_out=[L, "qkv", H, E]),
        "wo": md.param(f"{prefix}wo", [layer, heads, d_head, d_model], fan_out=[L, D]),
        "ln2": md.param(f"{prefix}ln2", [layer, d_model], init="ones"),
        "w_fc": md.param(f"{prefix}w_fc", [layer, d_model, d_ff], fan_out=[L, F]),
        "w_proj": md.param(f"{prefix}w_proj", [layer, d_ff, d_model], fan_out=[L, D]),
    }


def _decoder(x, blocks: dict, layer, D: str, H: str, F: str):
    """Pre-norm causal blocks over ``x [batch, seq, D]``."""
    def block(h, p):
        a = md.layer_norm(h, D, p["ln1"])
        qkv = md.einsum(f"batch seq {D}, {D} qkv {H} d_head -> qkv batch seq {H} d_head", a, p["wqkv"])
        q, k, v = (md.squeeze(md.slice_(qkv, "qkv", i, i + 1), "qkv") for i in range(3))
        k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
        o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
        h = h + md.einsum(f"batch seq {H} d_head, {H} d_head {D} -> batch seq {D}", o, p["wo"])
        m = md.gelu(md.einsum(f"batch seq {D}, {D} {F} -> batch seq {F}", md.layer_norm(h, D, p["ln2"]), p["w_fc"]))
        return h + md.einsum(f"batch seq {F}, {F} {D} -> batch seq {D}", m, p["w_proj"])
    return md.repeat(block, x, blocks, layer)


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, vocab = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab)
    d_head = md.Dim("d_head", cfg.d_head)
    s_dims = (md.Dim("layer", cfg.layers), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), d_head,
              md.Dim("d_ff", cfg.d_ff))
    t_dims = (md.Dim("t_layer", cfg.t_layers), md.Dim("t_model", cfg.t_model), md.Dim("t_heads", cfg.t_heads), d_head,
              md.Dim("t_ff", cfg.t_ff))
    T = cfg.temperature
    with md.Graph("heldout_distill") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)

        def lm(prefix, dims):
            layer, d_model, heads, _, d_ff = dims
            wte = md.param(f"{prefix}wte", [vocab, d_model], scale=0.1)
            wpe = md.param(f"{prefix}wpe", [seq, d_model], scale=0.02)
            blocks = _stack(prefix, *dims)
            lnf = md.param(f"{prefix}lnf", [d_model], init="ones")
            h = _decoder(md.gather(wte, ids, "vocab") + wpe, blocks, layer, d_model.name, heads.name, d_ff.name)
            logits = md.einsum(f"batch seq {d_model.name}, vocab {d_model.name} -> batch seq vocab",
                               md.layer_norm(h, d_model.name, lnf), wte)
            return logits, {f"{prefix}wte": wte, f"{prefix}wpe": wpe, f"{prefix}lnf": lnf,
                            **{f"{prefix}{k}": v for k, v in blocks.items()}}

        teacher, _ = lm("teacher.", t_dims)              # frozen: none of its params is trained
        student, params = lm("", s_dims)
        teacher = md.stop_gradient(teacher)
        log_p_t = md.log_softmax(teacher / T, "vocab")
        log_p_s = md.log_softmax(student / T, "vocab")
        kl = md.reduce_sum(md.exp(log_p_t) * (log_p_t - log_p_s), "vocab")          # [batch, seq]
        ce = md.cross_entropy(student, labels, "vocab")
        loss = cfg.kd_weight * md.reduce_mean(kl) * T ** 2 + (1 - cfg.kd_weight) * md.reduce_mean(ce)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    return md.Model(g, loss, params, feeds, cfg, logits=student, outputs={"kl": md.reduce_mean(kl)})
