"""An FNet encoder (Fourier token mixing), written from the README and docs/ alone (a held-out model).

FNet (Lee-Thorp et al. 2021) replaces self-attention with the real part of a 2-D discrete
Fourier transform over the sequence and the hidden dims. For a real input X,
``Re(F_tok X F_hid) = C_tok X C_hid - S_tok X S_hid`` with the DFT tables ``C[n, k] = cos(2 pi n k / N)``
and ``S[n, k] = sin(2 pi n k / N)``: four einsums. The sequence tables are made in the graph
(``md.arange`` of ``tok`` and of its frequency dim, their product reduced mod N in integers, then
``md.cos`` / ``md.sin``); the hidden tables are an ``md.constant`` built in torch. Both are made
once before the stack. Post-norm layers (``x = LN(x + mix(x)); x = LN(x + FF(x))``, as FNet), a
GELU MLP; the loss is a masked-token loss plus a sentence-level head on the mean of the tokens
(FNet pre-trains with MLM and NSP).

Dims: ``ex`` (examples), ``tok`` / ``ftok`` (positions, frequencies), ``hid`` / ``fhid``,
``inner`` (the MLP), ``vocab``, ``nsp`` (2 sentence classes), ``layer``.
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    hid: int = 32
    inner: int = 64
    layers: int = 4
    tok: int = 32
    ex: int = 4
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, hid=12, inner=24, layers=2, tok=12, ex=4)


def dft_tables_torch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``2 pi j k / n``, ``[n, n]``."""
    jk = (torch.arange(n)[:, None] * torch.arange(n)[None, :]) % n
    angle = 2 * math.pi * jk.double() / n
    return torch.cos(angle).float(), torch.sin(angle).float()


def build(cfg: Config = Config()) -> md.Model:
    ex, tok, ftok = md.Dim("ex", cfg.ex), md.Dim("tok", cfg.tok), md.Dim("ftok", cfg.tok)
    hid, fhid, inner = md.Dim("hid", cfg.hid), md.Dim("fhid", cfg.hid), md.Dim("inner", cfg.inner)
    vocab, nsp, layer = md.Dim("vocab", cfg.vocab), md.Dim("nsp", 2), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_fnet") as g:
        ids = md.input("ids", [ex, tok], dtype=torch.int64)
        labels = md.input("labels", [ex, tok], dtype=torch.int64)
        weights = md.input("weights", [ex, tok])
        is_next = md.input("is_next", [ex], dtype=torch.int64)
        wte = md.param("wte", [vocab, hid], scale=0.5)
        wpe = md.param("wpe", [tok, hid], scale=0.1)
        emb_norm = md.param("emb_norm", [hid], init="ones")
        blocks = {
            "ln_mix": md.param("ln_mix", [layer, hid], init="ones"),
            "w_in": md.param("w_in", [layer, hid, inner], fan_out=["layer", inner]),
            "b_in": md.param("b_in", [layer, inner], init="zeros"),
            "w_out": md.param("w_out", [layer, inner, hid], fan_out=["layer", hid]),
            "ln_ff": md.param("ln_ff", [layer, hid], init="ones"),
        }
        lm_head = md.param("lm_head", [hid, vocab], fan_out=[vocab])
        nsp_head = md.param("nsp_head", [hid, nsp], fan_out=[nsp])

        # the sequence's DFT tables from iotas: (n k mod N) in integers keeps the angle exact
        nk = md.arange(tok) * md.arange(ftok)
        wraps = md.cast(md.cast(nk, torch.float32) / cfg.tok, torch.int64)   # nk // N (a Tensor has no // or %)
        angle = md.cast(nk - wraps * cfg.tok, torch.float32) * (2 * math.pi / cfg.tok)
        cos_t, sin_t = md.cos(angle), md.sin(angle)                     # [tok, ftok]
        cos_h, sin_h = (md.constant(t, [hid, fhid]) for t in dft_tables_torch(cfg.hid))

        def fourier(x: md.Tensor) -> md.Tensor:
            """Re(DFT over tok and hid) of a real x, back on dims [ex, tok, hid] (frequencies renamed)."""
            xc = md.einsum("ex tok hid, hid fhid -> ex tok fhid", x, cos_h)
            xs = md.einsum("ex tok hid, hid fhid -> ex tok fhid", x, sin_h)
            y = (md.einsum("ex tok fhid, tok ftok -> ex ftok fhid", xc, cos_t)
                 - md.einsum("ex tok fhid, tok ftok -> ex ftok fhid", xs, sin_t))
            return md.rename(y, ftok="tok", fhid="hid")

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            x = md.layer_norm(x + fourier(x), "hid", p["ln_mix"])
            f = md.gelu(md.einsum("ex tok hid, hid inner -> ex tok inner", x, p["w_in"]) + p["b_in"])
            return md.layer_norm(x + md.einsum("ex tok inner, inner hid -> ex tok hid", f, p["w_out"]), "hid", p["ln_ff"])

        x = md.layer_norm(md.gather(wte, ids, "vocab") + wpe, "hid", emb_norm)
        x = md.repeat(block, x, blocks, "layer", remat=cfg.remat)
        logits = md.einsum("ex tok hid, hid vocab -> ex tok vocab", x, lm_head)
        mlm = md.reduce_sum(md.cross_entropy(logits, labels, "vocab") * weights) / md.reduce_sum(weights)
        nsp_logits = md.einsum("ex hid, hid nsp -> ex nsp", md.reduce_mean(x, "tok"), nsp_head)
        loss = mlm + md.reduce_mean(md.cross_entropy(nsp_logits, is_next, "nsp"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        labels_ = torch.randint(1, cfg.vocab, (cfg.ex, cfg.tok), generator=gen)
        masked = torch.rand(cfg.ex, cfg.tok, generator=gen) < 0.2
        masked[:, 2] = True
        return {"ids": torch.where(masked, torch.zeros_like(labels_), labels_), "labels": labels_,
                "weights": masked.float(), "is_next": torch.randint(0, 2, (cfg.ex,), generator=gen)}

    params = {"wte": wte, "wpe": wpe, "emb_norm": emb_norm, **blocks, "lm_head": lm_head, "nsp_head": nsp_head}
    return md.Model(g, loss, params, feeds, cfg)
