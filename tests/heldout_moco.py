"""MoCo v2: a query encoder trained by InfoNCE against a momentum (EMA) key encoder and a queue.

Held-out model (round 15a), written from the user guides only. Two views of each example
are inputs (``x_q``, ``x_k``). The query encoder (residual MLP layers under ``md.repeat``, a
2-layer projection head) is trained. ``--config key=frozen`` (the default) gives the key
encoder params of its own left out of the Model's params (frozen: no gradient, no optimizer
update), which follow the query params as an EMA computed in the step (``Model(updates=)``;
:func:`momentum_update` does the same from a Python loop, through ``TrainStep.full_params`` /
``set_params``); ``key=stop`` reads the query encoder's own params
through ``md.stop_gradient`` (momentum 0). The negatives are a queue fed as an input
``[queue, embed]``; InfoNCE is the cross-entropy of the positive among ``1 + queue`` logits.

Legend: b batch, i d_in, d d_model, f d_ff, e embed, k queue; layer / key_layer the two stacks.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 16
    d_in: int = 16
    d_model: int = 16
    d_ff: int = 32
    layers: int = 2
    embed: int = 8
    queue: int = 32
    temperature: float = 0.2
    momentum: float = 0.99
    key: str = "frozen"    # frozen | stop
    remat: str = "none"   # what each repeated layer saves for its backward (md.repeat's remat=)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, d_in=8, d_model=8, d_ff=16, layers=2, embed=4, queue=6)


ENCODER = ("w_in", "w1", "w2", "ln", "w_h1", "w_h2")


def _encoder_params(prefix, cfg, layer):
    I, D, F, E, L = (md.Dim("d_in", cfg.d_in), md.Dim("d_model", cfg.d_model), md.Dim("d_ff", cfg.d_ff),
                     md.Dim("embed", cfg.embed), md.Dim(layer, cfg.layers))
    return {
        "w_in": md.param(f"{prefix}w_in", [I, D], fan_out=["d_model"]),
        "ln": md.param(f"{prefix}ln", [L, D], init="ones"),
        "w1": md.param(f"{prefix}w1", [L, D, F], fan_out=[layer, "d_ff"]),
        "w2": md.param(f"{prefix}w2", [L, F, D], fan_out=[layer, "d_model"]),
        "w_h1": md.param(f"{prefix}w_h1", [D, F], fan_out=["d_ff"]),
        "w_h2": md.param(f"{prefix}w_h2", [F, E], fan_out=["embed"]),
    }


def _encode(x, p, layer, remat):
    """x [batch, d_in] -> a unit embedding [batch, embed]; ``layer`` names the stack's dim."""
    h = md.einsum("batch d_in, d_in d_model -> batch d_model", x, p["w_in"])

    def block(h, q):
        f = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", md.layer_norm(h, "d_model", q["ln"]), q["w1"]))
        return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", f, q["w2"])

    h = md.repeat(block, h, {"ln": p["ln"], "w1": p["w1"], "w2": p["w2"]}, layer, remat=remat)
    z = md.einsum("batch d_ff, d_ff embed -> batch embed",
                  md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["w_h1"])), p["w_h2"])
    return z * md.rsqrt(md.reduce_sum(z * z, "embed") + 1e-6)


def build(cfg: Config = Config()) -> md.Model:
    B, I, E, K = md.Dim("batch", cfg.batch), md.Dim("d_in", cfg.d_in), md.Dim("embed", cfg.embed), md.Dim("queue", cfg.queue)
    with md.Graph("moco") as g:
        x_q, x_k = md.input("x_q", [B, I]), md.input("x_k", [B, I])
        queue = md.input("queue", [K, E])                    # earlier keys, unit rows
        enc_q = _encoder_params("q_", cfg, "layer")
        # the key stack scans a layer dim of its own name: a pipeline over 'layer' splits the query's
        if cfg.key == "frozen":
            enc_k = _encoder_params("k_", cfg, "key_layer")    # not in params: frozen, EMA-updated from Python
        elif cfg.key == "stop":
            enc_k = {n: md.rename(md.stop_gradient(t), layer="key_layer") if "layer" in t.shape.names
                     else md.stop_gradient(t) for n, t in enc_q.items()}
        else:
            raise ValueError(f"key={cfg.key!r}: frozen or stop")
        q = _encode(x_q, enc_q, "layer", cfg.remat)
        k = md.stop_gradient(_encode(x_k, enc_k, "key_layer", cfg.remat))
        l_pos = md.unsqueeze(md.reduce_sum(q * k, "embed"), md.Dim("queue", 1))          # [batch, queue:1]
        l_neg = md.einsum("batch embed, queue embed -> batch queue", q, queue)           # [batch, queue]
        logits = md.concat([l_pos, l_neg], "queue") / cfg.temperature                    # the positive first
        loss = md.reduce_mean(md.logsumexp(logits, "queue") - md.squeeze(md.slice_(logits, "queue", 0, 1), "queue"))
    params = {f"q_{n}": t for n, t in enc_q.items()}
    # key=frozen: the key encoder follows the query encoder by an EMA in the compiled step
    # (md.fit, meshdsl train); a TrainStep applies it when given updates=model.updates
    updates = {f"k_{n}": cfg.momentum * enc_k[n] + (1 - cfg.momentum) * _as_key(enc_q[n])
               for n in ENCODER} if cfg.key == "frozen" else {}

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        base = torch.randn(cfg.batch, cfg.d_in, generator=gen)
        views = [base + 0.1 * torch.randn(base.shape, generator=gen) for _ in range(2)]
        queue = torch.nn.functional.normalize(torch.randn(cfg.queue, cfg.embed, generator=gen), dim=1)
        return {"x_q": views[0], "x_k": views[1], "queue": queue}

    return md.Model(g, loss, params, feeds, cfg, outputs={"keys": k}, updates=updates)


def _as_key(t):
    """A query param in the key stack's dims (its layer dim renamed)."""
    return md.rename(t, layer="key_layer") if "layer" in t.shape.names else t


def momentum_update(step, momentum: float) -> None:
    """The EMA of MoCo's key encoder: k <- m k + (1 - m) q, through TrainStep's full params."""
    full = step.full_params(frozen=True)
    step.set_params({f"k_{n}": momentum * full[f"k_{n}"] + (1 - momentum) * full[f"q_{n}"] for n in ENCODER})


def enqueue(queue: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The newest keys in, the oldest out (a FIFO of ``queue`` rows)."""
    return torch.cat([keys, queue], 0)[: queue.shape[0]]
