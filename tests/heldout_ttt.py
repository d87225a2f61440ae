"""Held-out model (round 21a): a TTT-linear language model (test-time training layers).

Written from the user docs alone. Each head holds an inner linear model ``W [d_head, d_head2]``
(``W_0`` a learned param) trained while it reads the sequence: chunk ``c`` takes one gradient
step on the self-supervised loss ``l(W) = sum_j |k_j W - v_j|^2`` over its ``clen`` tokens, and
the outputs use the mini-batch TTT dual form, causal inside the chunk: token ``i`` reads

    z_i = q_i W_{c-1} - eta * sum_{j <= i} (q_i . k_j) * 2 (k_j W_{c-1} - v_j)

and the next chunk starts from ``W_c = W_{c-1} - eta * sum_j 2 k_j^T (k_j W_{c-1} - v_j)``.
``W`` is the carry of an inner ``md.repeat`` over ``chunks`` (the per-chunk q, k, v stacked),
nested in the outer repeat over ``layer``. ``form="closed"`` writes the inner gradient in closed
form; ``form="vjp"`` takes it by ``md.vjp`` of the inner loss inside the block, which makes the
outer gradient second order (``md.grad`` there would not: its results are constants to a later
``md.grad``, as torch's ``autograd.grad`` without ``create_graph``).

Legend: b batch, s seq, c chunks, i clen (query step), j key_step, h heads, e d_head,
f d_head2 (the inner model's output), d d_model, v vocab.
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
    layers: int = 2
    seq: int = 32
    clen: int = 8
    batch: int = 8
    eta: float = 0.1
    form: str = "closed"          # "closed" (the gradient written out) or "vjp" (md.vjp inside)
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=2, d_head=4, layers=2, seq=8, clen=2, batch=4)


def _inner_grad(w, k, v, form: str):
    """d/dW of sum_j |k_j W - v_j|^2 at W (``[batch, heads, d_head, d_head2]``), and the residual."""
    pred = md.einsum("batch clen heads d_head, batch heads d_head d_head2 -> batch clen heads d_head2", k, w)
    resid = pred - v
    if form == "vjp":       # md.grad's results are constants to a later md.grad: vjp's are not
        inner = md.reduce_sum(resid * resid)
        return md.vjp([inner], [md.constant(1.0)], [w])[0], resid
    return 2.0 * md.einsum("batch clen heads d_head, batch clen heads d_head2 -> batch heads d_head d_head2",
                           k, resid), resid


def _ttt_chunk(w, p, eta: float, form: str):
    """One chunk: its causal dual-form outputs (a per-step output) and the updated inner model."""
    q, k, v = p["q"], p["k"], p["v"]
    g, resid = _inner_grad(w, k, v, form)
    keep = md.greater_equal(md.arange(q.shape["clen"]), md.arange(md.Dim("key_step", q.shape["clen"].size)))
    att = md.einsum("batch clen heads d_head, batch key_step heads d_head -> batch heads clen key_step",
                    q, md.rename(k, clen="key_step"))
    att = md.where(keep, att, 0.0)
    z = md.einsum("batch clen heads d_head, batch heads d_head d_head2 -> batch clen heads d_head2", q, w)
    z = z - eta * 2.0 * md.einsum("batch heads clen key_step, batch key_step heads d_head2 "
                                  "-> batch clen heads d_head2", att, md.rename(resid, clen="key_step"))
    return w - eta * g, {"z": z}


def _ttt(x, p, cfg: Config):
    """The TTT layer over ``x [batch, seq, d_model]``."""
    proj = {n: md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p[f"w{n}"])
            for n in "qkv"}
    chunked = {n: md.rearrange(t, "batch (chunks clen) heads d_head -> chunks batch clen heads d_head",
                               clen=cfg.clen) for n, t in proj.items()}
    chunked["v"] = md.rename(chunked["v"], d_head="d_head2")
    w0 = md.broadcast_to(p["w0"], [x.shape["batch"], *p["w0"].shape])
    _, out = md.repeat(lambda w, c: _ttt_chunk(w, c, cfg.eta, cfg.form), w0, chunked, "chunks")
    z = md.rearrange(out["z"], "chunks batch clen heads d_head2 -> batch (chunks clen) heads d_head2")
    z = md.rename(z, chunks_clen="seq")
    z = md.rms_norm(z, "d_head2", p["ln_z"])
    return md.einsum("batch seq heads d_head2, heads d_head2 d_model -> batch seq d_model", z, p["wo"])


def build(cfg: Config = Config()) -> md.Model:
    V, D = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    H, E, F = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_head2", cfg.d_head)
    L, B, S = md.Dim("layer", cfg.layers), md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    with md.Graph("ttt") as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte = md.param("wte", [V, D], scale=0.5)
        stacked = {
            "ln": md.param("ln", [L, D], init="ones"),
            **{f"w{n}": md.param(f"w{n}", [L, D, H, E], fan_out=["layer", "heads", "d_head"]) for n in "qkv"},
            "w0": md.param("w0", [L, H, E, F], fan_out=["layer", "heads", "d_head2"]),
            "ln_z": md.param("ln_z", [L, H, F], init="ones"),
            "wo": md.param("wo", [L, H, F, D], fan_out=["layer", "d_model"]),
        }

        def block(x, p):
            return x + _ttt(md.rms_norm(x, "d_model", p["ln"]), p, cfg)

        x = md.gather(wte, ids, "vocab")
        x = md.repeat(block, x, stacked, "layer", remat=None if cfg.remat == "none" else cfg.remat)
        x = md.rms_norm(x, "d_model", md.param("lnf", [D], init="ones"))
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x,
                           md.param("lm_head", [V, D], fan_out=["vocab"]))
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}

    return md.Model(g, loss, g.params(), feeds, cfg, logits=logits)


REF_INPUTS = ("ids", "labels")


def reference_loss(cfg: Config, params: dict, ids, labels):
    """The TTT LM's loss in plain torch (float64): token by token inside a chunk, W updated per chunk."""
    p = {k: v.double() for k, v in params.items()}

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    x = p["wte"][ids]
    for layer in range(cfg.layers):
        lp = {k: v[layer] for k, v in p.items() if k not in ("wte", "lnf", "lm_head")}
        h = rms(x, lp["ln"])
        q, k, v = (torch.einsum("bsd,dhe->bshe", h, lp[f"w{n}"]) for n in "qkv")
        w = lp["w0"].expand(x.shape[0], *lp["w0"].shape).clone()
        zs = []
        for c in range(cfg.seq // cfg.clen):
            sl = slice(c * cfg.clen, (c + 1) * cfg.clen)
            grads = 2 * (torch.einsum("bjhe,bhef->bjhf", k[:, sl], w) - v[:, sl])      # per-token dl/dpred
            for i in range(cfg.clen):
                # W after the gradient steps of tokens 0..i of the chunk, all taken at W_{c-1}
                wi = w - cfg.eta * torch.einsum("bjhe,bjhf->bhef", k[:, sl][:, :i + 1], grads[:, :i + 1])
                zs.append(torch.einsum("bhe,bhef->bhf", q[:, sl][:, i], wi))
            w = w - cfg.eta * torch.einsum("bjhe,bjhf->bhef", k[:, sl], grads)
        z = rms(torch.stack(zs, 1), lp["ln_z"])
        x = x + torch.einsum("bshf,hfd->bsd", z, lp["wo"])
    logits = rms(x, p["lnf"]) @ p["lm_head"].T
    return torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), labels.reshape(-1))
