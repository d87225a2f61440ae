"""A Set Transformer (ISAB blocks, PMA pooling), written from the README and docs/ alone
(a held-out model).

Legend: ``elems`` the set's elements (no order), ``induce`` the learned inducing points,
``seeds`` PMA's learned seed vectors, ``heads``/``d_head`` attention heads.

A multihead attention block ``MAB(Q, K) = LN(H + rFF(H))``, ``H = LN(Q + attention(Q, K, K))``,
with ``md.attention`` (not causal). Each ISAB, under ``md.repeat`` over ``layer``, lets the
inducing points attend to the set (``MAB(I, X)``, query dim ``induce``, key dim ``elems``, the
points broadcast over ``batch``) and the set attend back to them (``MAB(X, H)``, query dim
``elems``, key dim ``induce``). PMA pools the set by one seed attending to it, and a linear head
classifies; the loss is the cross-entropy. The output does not depend on the order of the
elements (``tests/test_heldout_round7b.py`` checks it).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    d_in: int = 3
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    induce: int = 8
    elems: int = 32
    layers: int = 2
    classes: int = 4
    batch: int = 8

    @classmethod
    def tiny(cls) -> "Config":
        return cls(d_in=3, d_model=8, heads=2, d_head=4, d_ff=12, induce=3, elems=6, layers=2, classes=3, batch=4)


def _mab(q_in: md.Tensor, kv_in: md.Tensor, p: dict, qd: str, kd: str) -> md.Tensor:
    """MAB(Q, K): multihead attention of ``q_in`` (query dim ``qd``) over ``kv_in`` (key dim
    ``kd``), then a residual feed-forward, each with a post layer norm."""
    q = md.einsum(f"{qd} d_model, d_model heads d_head -> {qd} heads d_head", q_in, p["wq"]) \
        if "batch" not in q_in.shape.names else \
        md.einsum(f"batch {qd} d_model, d_model heads d_head -> batch {qd} heads d_head", q_in, p["wq"])
    k = md.einsum(f"batch {kd} d_model, d_model heads d_head -> batch {kd} heads d_head", kv_in, p["wk"])
    v = md.einsum(f"batch {kd} d_model, d_model heads d_head -> batch {kd} heads d_head", kv_in, p["wv"])
    if "batch" not in q.shape.names:      # learned points: the same for every set
        q = md.broadcast_to(q, [kv_in.shape["batch"], *q.shape])
    a = md.attention(q, k, v, qd, kd, "d_head", causal=False)
    h = md.layer_norm(q_in + md.einsum(f"batch {qd} heads d_head, heads d_head d_model -> batch {qd} d_model",
                                       a, p["wo"]), "d_model", p["ln1"])
    f = md.einsum(f"batch {qd} d_ff, d_ff d_model -> batch {qd} d_model",
                  md.relu(md.einsum(f"batch {qd} d_model, d_model d_ff -> batch {qd} d_ff", h, p["w1"])), p["w2"])
    return md.layer_norm(h + f, "d_model", p["ln2"])


def _mab_params(prefix: str, dims: dict, stack: list) -> dict:
    """One MAB's weights, each with the ``stack`` dims first (``[layer]`` in the repeat)."""
    lead = [d.name for d in stack]
    d_model, heads, d_head, d_ff = dims["d_model"], dims["heads"], dims["d_head"], dims["d_ff"]
    return {
        "wq": md.param(f"{prefix}wq", [*stack, d_model, heads, d_head], fan_out=[*lead, "heads", "d_head"]),
        "wk": md.param(f"{prefix}wk", [*stack, d_model, heads, d_head], fan_out=[*lead, "heads", "d_head"]),
        "wv": md.param(f"{prefix}wv", [*stack, d_model, heads, d_head], fan_out=[*lead, "heads", "d_head"]),
        "wo": md.param(f"{prefix}wo", [*stack, heads, d_head, d_model], fan_out=[*lead, "d_model"]),
        "ln1": md.param(f"{prefix}ln1", [*stack, d_model], init="ones"),
        "w1": md.param(f"{prefix}w1", [*stack, d_model, d_ff], fan_out=[*lead, "d_ff"]),
        "w2": md.param(f"{prefix}w2", [*stack, d_ff, d_model], fan_out=[*lead, "d_model"]),
        "ln2": md.param(f"{prefix}ln2", [*stack, d_model], init="ones"),
    }


def build(cfg: Config = Config()) -> md.Model:
    batch, elems, layer = md.Dim("batch", cfg.batch), md.Dim("elems", cfg.elems), md.Dim("layer", cfg.layers)
    dims = {n: md.Dim(n, getattr(cfg, n)) for n in ("d_in", "d_model", "heads", "d_head", "d_ff", "induce", "classes")}
    seeds = md.Dim("seeds", 1)
    with md.Graph("heldout_settransformer") as g:
        x = md.input("x", [batch, elems, dims["d_in"]])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_in = md.param("w_in", [dims["d_in"], dims["d_model"]], fan_out=["d_model"])
        blocks = {"points": md.param("points", [layer, dims["induce"], dims["d_model"]], fan_out=["layer"], scale=1.0),
                  **{f"a_{k}": v for k, v in _mab_params("a_", dims, [layer]).items()},
                  **{f"b_{k}": v for k, v in _mab_params("b_", dims, [layer]).items()}}
        seed = md.param("seed", [seeds, dims["d_model"]], scale=1.0)
        pma = _mab_params("pma_", dims, [])
        head = md.param("head", [dims["d_model"], dims["classes"]], fan_out=["classes"])

        def isab(h: md.Tensor, p: dict) -> md.Tensor:
            a = {k[2:]: v for k, v in p.items() if k.startswith("a_")}
            b = {k[2:]: v for k, v in p.items() if k.startswith("b_")}
            ind = _mab(p["points"], h, a, "induce", "elems")          # [batch, induce, d_model]
            return _mab(h, ind, b, "elems", "induce")                  # [batch, elems, d_model]

        h = md.einsum("batch elems d_in, d_in d_model -> batch elems d_model", x, w_in)
        h = md.repeat(isab, h, blocks, "layer")
        pooled = md.squeeze(_mab(seed, h, pma, "seeds", "elems"), "seeds")
        logits = md.einsum("batch d_model, d_model classes -> batch classes", pooled, head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(cfg.batch, cfg.elems, cfg.d_in, generator=gen)
        # the label: how many elements have a positive first feature, in bins (a set function)
        labels = ((x[..., 0] > 0).sum(-1) * cfg.classes // (cfg.elems + 1)).clamp(max=cfg.classes - 1)
        return {"x": x, "labels": labels}

    params = {"w_in": w_in, **blocks, "seed": seed, **{f"pma_{k}": v for k, v in pma.items()}, "head": head}
    return md.Model(g, loss, params, feeds, cfg, outputs={"logits": logits})
