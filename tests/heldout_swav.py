"""SwAV, written from the README and docs/ alone (a held-out model).

Examples ``x [ex, feat]``, two noisy views (``noise_a``, ``noise_b``, fed), one shared encoder (a
linear stem, residual relu MLP blocks under ``md.repeat`` over ``layer``, a projector to ``emb``)
whose output is L2-normalised. Prototypes ``[emb, proto]`` (a param, L2-normalised per prototype)
give each view's scores ``[ex, proto]``. Codes: Sinkhorn-Knopp on ``exp(scores / eps)`` under
``md.stop_gradient``, 3 iterations of normalising over ``ex`` (each prototype's column to
``1 / K``) then over ``proto`` (each example's row to ``1 / B``), times ``B`` at the end. Swapped
prediction: view a's codes against view b's ``log_softmax(scores / tau)`` over ``proto`` and the
other way round, a cross entropy averaged over the examples and both pairs. The point of the
model: Sinkhorn's sums over ``ex`` under a split of the examples. ``views="stacked"`` runs the
encoder once on both views joined on a ``view`` dim (one repeat; a pipeline of it is still refused:
the codes after the stack read every micro-batch).

Legend: ex (examples), feat, d (width), hid (MLP width), emb (embedding), proto (prototypes).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    ex: int = 32
    feat: int = 16
    d: int = 32
    hid: int = 64
    emb: int = 16
    protos: int = 24
    layers: int = 2
    eps: float = 0.05
    tau: float = 0.1
    iters: int = 3
    noise: float = 0.3
    views: str = "two"          # or "stacked": both views on a `view` dim, one encoder call
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(ex=8, feat=6, d=8, hid=12, emb=6, protos=5, layers=2)


def sinkhorn(scores: md.Tensor, cfg: Config) -> md.Tensor:
    """SwAV's codes ``[ex, proto]`` of ``scores``, no gradient."""
    q = md.exp(md.stop_gradient(scores) / cfg.eps)
    q = q / md.reduce_sum(q)
    for _ in range(cfg.iters):
        q = q / md.reduce_sum(q, "ex") / cfg.protos
        q = q / md.reduce_sum(q, "proto") / cfg.ex
    return q * cfg.ex


def build(cfg: Config = Config()) -> md.Model:
    ex, feat, d, hid = md.Dim("ex", cfg.ex), md.Dim("feat", cfg.feat), md.Dim("d", cfg.d), md.Dim("hid", cfg.hid)
    emb, proto, layer = md.Dim("emb", cfg.emb), md.Dim("proto", cfg.protos), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_swav") as g:
        x = md.input("x", [ex, feat])
        noise = {v: md.input(f"noise_{v}", [ex, feat]) for v in "ab"}
        p = {"stem": md.param("stem", [feat, d], fan_out=["d"]),
             "proj": md.param("proj", [d, emb], fan_out=["emb"]),
             "protos": md.param("protos", [emb, proto], fan_out=["proto"])}
        st = {"ln": md.param("ln", [layer, d], init="ones"),
              "w1": md.param("w1", [layer, d, hid], fan_out=["layer", "hid"]),
              "w2": md.param("w2", [layer, hid, d], fan_out=["layer", "d"])}

        e = "view ex" if cfg.views == "stacked" else "ex"                  # the encoder's example dims

        def block(h: md.Tensor, q: dict) -> md.Tensor:                     # h [(view,) ex, d]
            u = md.relu(md.einsum(f"{e} d, d hid -> {e} hid", md.layer_norm(h, "d", q["ln"]), q["w1"]))
            return h + md.einsum(f"{e} hid, hid d -> {e} d", u, q["w2"])

        c = p["protos"] * md.rsqrt(md.reduce_sum(p["protos"] * p["protos"], "emb"))

        def scores(view: md.Tensor) -> md.Tensor:
            h = md.einsum(f"{e} feat, feat d -> {e} d", view, p["stem"])
            h = md.repeat(block, h, st, "layer", remat=cfg.remat)
            z = md.einsum(f"{e} d, d emb -> {e} emb", h, p["proj"])
            z = z * md.rsqrt(md.reduce_sum(z * z, "emb") + 1e-8)
            return md.einsum(f"{e} emb, emb proto -> {e} proto", z, c)

        if cfg.views == "stacked":
            s = scores(md.concat([md.unsqueeze(x + noise[v] * cfg.noise, "view", 0) for v in "ab"], "view"))
            sa, sb = (md.squeeze(md.slice_(s, "view", i, i + 1), "view") for i in (0, 1))
        else:
            sa, sb = scores(x + noise["a"] * cfg.noise), scores(x + noise["b"] * cfg.noise)
        qa, qb = sinkhorn(sa, cfg), sinkhorn(sb, cfg)
        ce = (md.reduce_sum(qa * md.log_softmax(sb / cfg.tau, "proto"), "proto")
              + md.reduce_sum(qb * md.log_softmax(sa / cfg.tau, "proto"), "proto"))
        loss = -md.reduce_mean(ce) / 2

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.ex, cfg.feat, generator=gen),
                "noise_a": torch.randn(cfg.ex, cfg.feat, generator=gen),
                "noise_b": torch.randn(cfg.ex, cfg.feat, generator=gen)}

    return md.Model(g, loss, {**p, **st}, feeds, cfg)
