"""A RealNVP normalizing flow on vectors, written from the README and docs/ alone (a held-out model).

Data ``x [batch, d]`` (a curved, correlated distribution). An affine coupling layer splits the
features into halves, ``x1`` and ``x2``; an MLP of ``x1`` gives a scale ``s = tanh(.) * g`` (a
learned per-feature gain ``g``) and a shift ``t``; ``y2 = x2 * exp(s) + t``. The layer returns
``(y2, x1)`` joined in that order, so the next layer transforms the other half (alternating
halves with one block). Two ways to split (``form``): ``slice`` (``md.slice_`` of ``d``, the
halves joined by ``md.concat``) or ``rearrange`` (``(two half) -> two half``, a ``slice_`` and
``squeeze`` per half, joined along ``two`` and merged back). The layers run in a ``md.repeat``
over ``layer``; each returns its log-determinant, ``sum_half s``, as a per-layer output (stacked
over ``layer``). Loss: the Gaussian negative log-likelihood,
``mean_batch(0.5 |z|^2 + d/2 log(2 pi) - sum_layer logdet)``.

Legend: batch; d (features); half, half2 (a half of them, before/after the MLP); two; hid
(the coupling MLP); layer.
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 256
    d: int = 16
    hidden: int = 128
    layers: int = 8
    form: str = "slice"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=8, d=8, hidden=10, layers=4)


def build(cfg: Config = Config()) -> md.Model:
    if cfg.form not in ("slice", "rearrange"):
        raise ValueError(f"form must be 'slice' or 'rearrange', not {cfg.form!r}")
    D, H = cfg.d, cfg.d // 2
    batch, d, layer = md.Dim("batch", cfg.batch), md.Dim("d", D), md.Dim("layer", cfg.layers)
    half, half2, hid = md.Dim("half", H), md.Dim("half2", H), md.Dim("hid", cfg.hidden)
    with md.Graph("heldout_realnvp") as g:
        x = md.input("x", [batch, d])
        L = ["layer"]
        q = {"w1": md.param("w1", [layer, half, hid], fan_out=L + ["hid"]),
             "b1": md.param("b1", [layer, hid], init="zeros"),
             "ws": md.param("ws", [layer, hid, half2], fan_out=L + ["half2"]),
             "bs": md.param("bs", [layer, half2], init="zeros"),
             "gain": md.param("gain", [layer, half2], init=0.5),
             "wt": md.param("wt", [layer, hid, half2], fan_out=L + ["half2"]),
             "bt": md.param("bt", [layer, half2], init="zeros")}

        def halves(v: md.Tensor) -> tuple[md.Tensor, md.Tensor]:
            if cfg.form == "slice":
                return (md.rename(md.slice_(v, "d", 0, H), d="half"),
                        md.rename(md.slice_(v, "d", H, D), d="half"))
            two = md.rearrange(v, "batch (two half) -> batch two half", two=2)
            return (md.squeeze(md.slice_(two, "two", 0, 1), "two"),
                    md.squeeze(md.slice_(two, "two", 1, 2), "two"))

        def join(a: md.Tensor, b: md.Tensor) -> md.Tensor:
            if cfg.form == "slice":
                return md.concat([md.rename(a, half="d"), md.rename(b, half="d")], "d")
            one = md.Dim("two", 1)
            both = md.concat([md.broadcast_to(a, [batch, one, half]), md.broadcast_to(b, [batch, one, half])], "two")
            return md.rename(md.rearrange(both, "batch two half -> batch (two half)"), two_half="d")

        def coupling(v: md.Tensor, w: dict):
            x1, x2 = halves(v)
            a = md.relu(md.einsum("batch half, half hid -> batch hid", x1, w["w1"]) + w["b1"])
            s = md.tanh(md.einsum("batch hid, hid half2 -> batch half2", a, w["ws"]) + w["bs"]) * w["gain"]
            t = md.einsum("batch hid, hid half2 -> batch half2", a, w["wt"]) + w["bt"]
            s, t = md.rename(s, half2="half"), md.rename(t, half2="half")
            y2 = x2 * md.exp(s) + t
            return join(y2, x1), {"logdet": md.reduce_sum(s, "half")}

        z, per_layer = md.repeat(coupling, x, q, "layer", remat=cfg.remat)
        logdet = md.reduce_sum(per_layer["logdet"], "layer")            # [batch]
        nll = 0.5 * md.reduce_sum(z * z, "d") + 0.5 * D * math.log(2 * math.pi) - logdet
        loss = md.reduce_mean(nll)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        u = torch.randn(cfg.batch, D, generator=gen)
        x = u.clone()
        x[:, 1::2] = u[:, 1::2] * 0.5 + 0.8 * u[:, 0::2] ** 2 - 0.8     # each odd feature bent by its neighbour
        return {"x": x}

    return md.Model(g, loss, q, feeds, cfg)
