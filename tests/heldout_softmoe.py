"""A decoder-free Soft MoE transformer (Puigcerver et al., "From Sparse to Soft Mixtures of
Experts"), written from the README and docs/ alone (a held-out model).

Every layer of the ``md.repeat`` stack is pre-norm fused attention (non-causal) and a Soft MoE MLP:

- the router logits ``[batch, seq, experts, slots]`` are the tokens against ``phi [d_model,
  experts, slots]``; with ``normalize=True`` both are L2-normalised over ``d_model`` first and
  scaled by a learned scalar (the paper's normalisation for large widths);
- dispatch weights: a softmax over ``seq`` (each slot a convex combination of all the tokens of
  its sequence); the slot inputs ``[batch, experts, slots, d_model]`` are that combination;
- each expert (``w_up [experts, d_model, d_ff]``, gelu, ``w_down``) runs on its own slots;
- combine weights: a softmax over all ``(experts slots)`` jointly, per token: the logits merged
  into one dim ``experts_slots`` by ``md.rearrange``, softmaxed, and split back
  (``combine="rearrange"``), or ``md.softmax`` over both dims at once (``"joint"``), or
  ``exp(logits - md.logsumexp(logits, [experts, slots]))`` (``"logsumexp"``);
  each token's output is the combination of every slot's output.

No token is dropped and nothing is discrete, so every gradient is exact. Tokens come from a
vocabulary; a mean-pooled head classifies each sequence (cross-entropy over ``classes``), plus an
auxiliary next-token loss over ``vocab`` from the same states.

Legend: b batch, s seq (k key_seq), d d_model, h heads, e d_head, x experts, n slots, f d_ff.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 16
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    experts: int = 4
    slots: int = 2
    d_ff: int = 64
    layers: int = 2
    classes: int = 8
    batch: int = 8
    normalize: bool = True
    combine: str = "rearrange"   # or "joint" (md.softmax over two dims), "logsumexp"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, seq=6, d_model=8, heads=2, d_head=4, experts=4, slots=2, d_ff=12, layers=2,
                   classes=3, batch=4)


def _combine(logits: md.Tensor, form: str) -> md.Tensor:
    """The softmax of the router logits over every (expert, slot) of a token."""
    if form == "joint":       # md.softmax over two dims at once
        return md.softmax(logits, ["experts", "slots"])
    if form == "logsumexp":
        return md.exp(logits - md.logsumexp(logits, ["experts", "slots"]))
    merged = md.rearrange(logits, "batch seq experts slots -> batch seq (experts slots)")
    return md.rearrange(md.softmax(merged, "experts_slots"),
                        "batch seq (experts slots) -> batch seq experts slots", slots=logits.shape["slots"].size)


def soft_moe(x: md.Tensor, q: dict, normalize: bool, combine_form: str = "rearrange") -> md.Tensor:
    """One Soft MoE layer over ``x [batch, seq, d_model]``."""
    phi = q["phi"]
    if normalize:
        x_n = x * md.rsqrt(md.reduce_sum(x * x, "d_model") + 1e-6)
        phi = phi * md.rsqrt(md.reduce_sum(phi * phi, "d_model") + 1e-6) * q["scale"]
    else:
        x_n = x
    logits = md.einsum("batch seq d_model, d_model experts slots -> batch seq experts slots", x_n, phi)
    dispatch = md.softmax(logits, "seq")
    slots_in = md.einsum("batch seq experts slots, batch seq d_model -> batch experts slots d_model", dispatch, x)
    hid = md.gelu(md.einsum("batch experts slots d_model, experts d_model d_ff -> batch experts slots d_ff",
                            slots_in, q["w_up"]))
    slots_out = md.einsum("batch experts slots d_ff, experts d_ff d_model -> batch experts slots d_model",
                          hid, q["w_down"])
    combine = _combine(logits, combine_form)
    return md.einsum("batch seq experts slots, batch experts slots d_model -> batch seq d_model", combine, slots_out)


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    h, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    x_, n_ = md.Dim("experts", cfg.experts), md.Dim("slots", cfg.slots)
    L, v, c = md.Dim("layer", cfg.layers), md.Dim("vocab", cfg.vocab), md.Dim("classes", cfg.classes)
    with md.Graph("heldout_softmoe") as graph:
        ids = md.input("ids", [b, s], dtype=torch.int64)
        nxt = md.input("next", [b, s], dtype=torch.int64)
        cls = md.input("cls", [b], dtype=torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        pos = md.param("pos", [s, d], scale=0.1)
        p = {
            "ln1": md.param("ln1", [L, d], init="ones"),
            "wq": md.param("wq", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [L, h, e, d], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [L, d], init="ones"),
            "phi": md.param("phi", [L, d, x_, n_], fan_out=["layer", "experts", "slots"]),
            "scale": md.param("scale", [L], init="ones"),
            "w_up": md.param("w_up", [L, x_, d, f], fan_out=["layer", "experts", "d_ff"]),
            "w_down": md.param("w_down", [L, x_, f, d], fan_out=["layer", "experts", "d_model"]),
        }
        lnf = md.param("lnf", [d], init="ones")
        head = md.param("head", [d, c], fan_out=["classes"])
        lm = md.param("lm", [d, v], fan_out=["vocab"])

        def block(hid: md.Tensor, q: dict) -> md.Tensor:
            n = md.rms_norm(hid, "d_model", q["ln1"])
            proj = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
            k = md.rename(md.einsum(proj, n, q["wk"]), seq="key_seq")
            val = md.rename(md.einsum(proj, n, q["wv"]), seq="key_seq")
            o = md.attention(md.einsum(proj, n, q["wq"]), k, val, "seq", "key_seq", "d_head", causal=False)
            hid = hid + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, q["wo"])
            return hid + soft_moe(md.rms_norm(hid, "d_model", q["ln2"]), q, cfg.normalize, cfg.combine)

        hid = md.repeat(block, md.gather(wte, ids, "vocab") + pos, p, "layer", remat=cfg.remat)
        hid = md.rms_norm(hid, "d_model", lnf)
        logits = md.einsum("batch d_model, d_model classes -> batch classes", md.reduce_mean(hid, "seq"), head)
        tok_logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", hid, lm)
        loss = (md.reduce_mean(md.cross_entropy(logits, cls, "classes"))
                + 0.5 * md.reduce_mean(md.cross_entropy(tok_logits, nxt, "vocab")))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": toks[:, :-1], "next": toks[:, 1:],
                "cls": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"wte": wte, "pos": pos, **p, "lnf": lnf, "head": head, "lm": lm}
    return md.Model(graph, loss, params, feeds, cfg)
