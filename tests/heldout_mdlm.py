"""A masked diffusion language model (MDLM / LLaDA-style training), written from the README and
docs/ alone (a held-out model).

Dims: ``batch``, ``seq`` (``key_seq``), ``vocab`` (the last id is ``[MASK]``), ``layer``,
``d_model``, ``heads``, ``d_head``, ``d_ff``. Each sequence gets its own mask rate ``t`` in
(0, 1] (fed: ``rate [batch]``) and each token a uniform draw (fed: ``noise [batch, seq]``);
a token is masked where ``noise < t``. A bidirectional pre-norm transformer reads the masked
sequence and predicts the original tokens; the loss counts the masked positions only, each
weighted by ``1 / t`` (the continuous-time ELBO's weight under a linear schedule), summed and
divided by the number of tokens, ``batch * seq`` (``normalize="masked"``: by the number of
masked tokens in the whole batch instead, a count made from the inputs).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 256
    layers: int = 2
    seq: int = 32
    batch: int = 8
    min_rate: float = 0.05
    normalize: str = "tokens"       # "tokens": over batch * seq (the ELBO); "masked": over the masked count

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=17, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, seq=8, batch=4)


def _block(h, p):
    """A pre-norm bidirectional encoder block over ``h [batch, seq, d_model]``."""
    a = md.rms_norm(h, "d_model", p["ln1"])
    proj = lambda w: md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", a, w)
    k, v = (md.rename(proj(p[w]), seq="key_seq") for w in ("wk", "wv"))
    o = md.attention(proj(p["wq"]), k, v, "seq", "key_seq", "d_head", causal=False)
    h = h + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
    m = md.silu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff",
                          md.rms_norm(h, "d_model", p["ln2"]), p["w_fc"]))
    return h + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", m, p["w_proj"])


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, vocab = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab)
    d_model, layer = md.Dim("d_model", cfg.d_model), md.Dim("layer", cfg.layers)
    heads, d_head, d_ff = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    mask_id = cfg.vocab - 1
    with md.Graph("heldout_mdlm") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        rate = md.input("rate", [batch])
        noise = md.input("noise", [batch, seq])
        wte = md.param("wte", [vocab, d_model], scale=0.1)
        wpe = md.param("wpe", [seq, d_model], scale=0.02)
        blocks = {
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "w_fc": md.param("w_fc", [layer, d_model, d_ff], fan_out=["layer", "d_ff"]),
            "w_proj": md.param("w_proj", [layer, d_ff, d_model], fan_out=["layer", "d_model"]),
        }
        lnf = md.param("lnf", [d_model], init="ones")
        head = md.param("head", [d_model, vocab], fan_out=["vocab"])

        masked = md.less(noise, rate)                                     # [batch, seq]
        noisy = md.where(masked, mask_id, ids)
        h = md.repeat(_block, md.gather(wte, noisy, "vocab") + wpe, blocks, "layer")
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", md.rms_norm(h, "d_model", lnf), head)
        ce = md.cross_entropy(logits, ids, "vocab")
        weighted = ce * md.cast(masked, torch.float32) / rate
        num_masked = md.reduce_sum(md.cast(masked, torch.float32))       # a count over the whole batch
        loss = md.reduce_mean(weighted) if cfg.normalize == "tokens" else md.reduce_sum(weighted) / num_masked
        masked_ce = md.reduce_sum(ce * md.cast(masked, torch.float32)) / num_masked
    params = {"wte": wte, "wpe": wpe, "lnf": lnf, "head": head, **blocks}

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        """Token runs that repeat a short per-row motif (learnable from the unmasked context)."""
        idx = range(cfg.batch)[rows or slice(None)]
        ids, rate, noise = [], [], []
        for r in idx:
            gen = md.row_generator(seed, r)
            motif = torch.randint(0, cfg.vocab - 1, (3,), generator=gen)
            ids.append(motif.repeat(cfg.seq // 3 + 1)[:cfg.seq])
            rate.append(cfg.min_rate + (1 - cfg.min_rate) * torch.rand((), generator=gen))
            noise.append(torch.rand(cfg.seq, generator=gen))
        if not ids:
            return {"ids": torch.zeros(0, cfg.seq, dtype=torch.int64), "rate": torch.zeros(0),
                    "noise": torch.zeros(0, cfg.seq)}
        return {"ids": torch.stack(ids), "rate": torch.stack(rate), "noise": torch.stack(noise)}

    return md.Model(g, loss, params, batches=batches, config=cfg, logits=logits,
                    metrics={"masked_ce": masked_ce}, outputs={"masked": masked})
