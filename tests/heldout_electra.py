"""An ELECTRA-style replaced-token-detection pretrainer written from the README and docs/ alone
(a held-out model).

A small *generator* (an MLM encoder, ``gen_layers`` blocks under ``md.repeat`` over
``gen_layer``) predicts the fed masked positions (the cross-entropy on them, divided by their
count, through the embedding tied as its head). Its guesses, the argmax over ``vocab`` by
``md.top_k`` (no gradient flows through a pick), replace the masked ids; the *discriminator*
(``layers`` blocks under ``md.repeat`` over ``layer``, the same token embedding, shared with the
generator, and a position table) reads the corrupted ids and predicts for every position whether
it was replaced (``md.not_equal`` of the corrupted and the true ids, made in the graph), a
sigmoid cross-entropy written as ``softplus``: ``log(1 + exp(-z))`` by ``md.log``/``md.exp``.
The loss is ``gen_weight`` times the generator's MLM loss plus the discriminator's.
Both encoders are post-LN with padding-free bidirectional fused attention.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    gen_d_ff: int = 32
    d_ff: int = 64
    heads: int = 4
    d_head: int = 8
    gen_layers: int = 2
    layers: int = 2
    seq: int = 16
    batch: int = 4
    mask_rate: float = 0.25
    gen_weight: float = 1.0

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=24, d_model=16, gen_d_ff=12, d_ff=24, heads=2, d_head=8, gen_layers=2, layers=2, seq=8, batch=4)


def encoder_params(prefix: str, L: md.Dim, d_model, heads, d_head, ff: md.Dim) -> dict:
    ln = lambda n, init: md.param(prefix + n, [L, d_model], init=init)  # noqa: E731
    return {
        "wq": md.param(prefix + "wq", [L, d_model, heads, d_head], fan_out=[L.name, heads, d_head]),
        "wk": md.param(prefix + "wk", [L, d_model, heads, d_head], fan_out=[L.name, heads, d_head]),
        "wv": md.param(prefix + "wv", [L, d_model, heads, d_head], fan_out=[L.name, heads, d_head]),
        "wo": md.param(prefix + "wo", [L, heads, d_head, d_model], fan_out=[L.name, d_model]),
        "w1": md.param(prefix + "w1", [L, d_model, ff], fan_out=[L.name, ff]),
        "w2": md.param(prefix + "w2", [L, ff, d_model], fan_out=[L.name, d_model]),
        "ln1": ln("ln1", "ones"), "ln1_b": ln("ln1_b", "zeros"), "ln2": ln("ln2", "ones"), "ln2_b": ln("ln2_b", "zeros"),
    }


def encoder_block(x: md.Tensor, p: dict, ff: str) -> md.Tensor:
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wq"])
    k = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wk"]), seq="key_seq")
    v = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wv"]), seq="key_seq")
    a = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model",
                  md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False), p["wo"])
    x = md.layer_norm(x + a, "d_model", p["ln1"], p["ln1_b"])
    h = md.gelu(md.einsum(f"batch seq d_model, d_model {ff} -> batch seq {ff}", x, p["w1"]))
    return md.layer_norm(x + md.einsum(f"batch seq {ff}, {ff} d_model -> batch seq d_model", h, p["w2"]),
                         "d_model", p["ln2"], p["ln2_b"])


def build(cfg: Config = Config()) -> md.Model:
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    gen_ff, d_ff, vocab = md.Dim("gen_d_ff", cfg.gen_d_ff), md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab)
    gen_layer, layer = md.Dim("gen_layer", cfg.gen_layers), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_electra") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)          # with [MASK] (id 0) at the masked positions
        labels = md.input("labels", [batch, seq], dtype=torch.int64)    # the true ids
        masked = md.input("masked", [batch, seq])                       # 1.0 at the masked positions
        wte = md.param("wte", [vocab, d_model], scale=0.1)
        wpe = md.param("wpe", [seq, d_model], scale=0.1)
        gen = encoder_params("g_", gen_layer, d_model, heads, d_head, gen_ff)
        disc = encoder_params("d_", layer, d_model, heads, d_head, d_ff)
        head_w = md.param("disc_head", [d_model], fan_out=[])
        head_b = md.param("disc_head_b", [], init="zeros")

        h = md.repeat(lambda x, p: encoder_block(x, p, "gen_d_ff"), md.gather(wte, ids, "vocab") + wpe, gen, "gen_layer")
        gen_logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", h, wte)
        mlm = md.reduce_sum(md.cross_entropy(gen_logits, labels, "vocab") * masked) / md.reduce_sum(masked)

        _, guess = md.top_k(gen_logits, "vocab", 1, "pick")
        guess = md.squeeze(guess, "pick")                                   # [batch, seq] int64, no gradient
        corrupted = md.where(md.greater(masked, 0.5), guess, labels)
        replaced = md.cast(md.not_equal(corrupted, labels), torch.float32)

        x = md.repeat(lambda x, p: encoder_block(x, p, "d_ff"), md.gather(wte, corrupted, "vocab") + wpe, disc, "layer")
        z = md.einsum("batch seq d_model, d_model -> batch seq", x, head_w) + head_b
        # sigmoid cross-entropy: y * softplus(-z) + (1 - y) * softplus(z), softplus(t) = log(1 + exp(t))
        softplus = lambda t: md.log(md.exp(t) + 1.0)  # noqa: E731
        rtd = md.reduce_mean(replaced * softplus(-z) + (1.0 - replaced) * softplus(z))
        loss = cfg.gen_weight * mlm + rtd

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen_ = torch.Generator().manual_seed(seed)
        tokens = torch.randint(1, cfg.vocab, (cfg.batch, cfg.seq), generator=gen_)
        m = torch.rand(cfg.batch, cfg.seq, generator=gen_) < cfg.mask_rate
        m[:, 0] = True
        return {"ids": torch.where(m, 0, tokens), "labels": tokens, "masked": m.float()}

    params = {"wte": wte, "wpe": wpe, **{f"g_{k}": v for k, v in gen.items()}, **{f"d_{k}": v for k, v in disc.items()},
              "disc_head": head_w, "disc_head_b": head_b}
    return md.Model(g, loss, params, feeds, cfg, outputs={"mlm": mlm, "rtd": rtd})
