"""A BERT-style encoder in Hugging Face's config names, written from the README and docs/ alone (a
held-out model: the user's own dim names).

Dims: ``batch_size``, ``seq_len`` (``key_len`` the keys), ``hidden_size``, ``num_heads``,
``head_dim``, ``intermediate_size``, ``vocab_size``, ``num_layers`` (the stack of ``md.repeat``).
Post-norm LayerNorm blocks with biases, bidirectional attention masked by a fed
``attention_mask [batch_size, seq_len]`` (1 real, 0 pad), a GELU FFN, and a masked-LM loss: the
cross-entropy on the positions whose ``labels`` are not -100, averaged over them.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab_size: int = 512
    hidden_size: int = 128
    num_attention_heads: int = 4
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    max_position_embeddings: int = 64
    batch_size: int = 8

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab_size=30, hidden_size=8, num_attention_heads=2, intermediate_size=12,
                   num_hidden_layers=2, max_position_embeddings=8, batch_size=4)


def build(cfg: Config = Config()) -> md.Model:
    hd = cfg.hidden_size // cfg.num_attention_heads
    B, S, H = md.Dim("batch_size", cfg.batch_size), md.Dim("seq_len", cfg.max_position_embeddings), \
        md.Dim("hidden_size", cfg.hidden_size)
    NH, HD, I = md.Dim("num_heads", cfg.num_attention_heads), md.Dim("head_dim", hd), \
        md.Dim("intermediate_size", cfg.intermediate_size)
    V, L = md.Dim("vocab_size", cfg.vocab_size), md.Dim("num_layers", cfg.num_hidden_layers)
    with md.Graph("hfbert") as g:
        input_ids = md.input("input_ids", [B, S], dtype=torch.int64)
        attention_mask = md.input("attention_mask", [B, S])
        labels = md.input("labels", [B, S], dtype=torch.int64)
        word = md.param("word_embeddings", [V, H], scale=0.02)
        pos = md.param("position_embeddings", [S, H], scale=0.02)
        emb_ln, emb_ln_b = md.param("emb_ln", [H], init="ones"), md.param("emb_ln_b", [H], init="zeros")
        fo = lambda *d: ["num_layers", *d]
        layer = {
            "query": md.param("query", [L, H, NH, HD], fan_out=fo("num_heads", "head_dim")),
            "key": md.param("key", [L, H, NH, HD], fan_out=fo("num_heads", "head_dim")),
            "value": md.param("value", [L, H, NH, HD], fan_out=fo("num_heads", "head_dim")),
            "attn_out": md.param("attn_out", [L, NH, HD, H], fan_out=fo("hidden_size")),
            "attn_out_b": md.param("attn_out_b", [L, H], init="zeros"),
            "ln1": md.param("ln1", [L, H], init="ones"), "ln1_b": md.param("ln1_b", [L, H], init="zeros"),
            "intermediate": md.param("intermediate", [L, H, I], fan_out=fo("intermediate_size")),
            "intermediate_b": md.param("intermediate_b", [L, I], init="zeros"),
            "output": md.param("output", [L, I, H], fan_out=fo("hidden_size")),
            "output_b": md.param("output_b", [L, H], init="zeros"),
            "ln2": md.param("ln2", [L, H], init="ones"), "ln2_b": md.param("ln2_b", [L, H], init="zeros"),
        }
        decoder_b = md.param("decoder_bias", [V], init="zeros")
        # additive mask over the keys: 0 for a real key, -1e9 for padding
        key_bias = md.rename((1.0 - attention_mask) * -1e9, seq_len="key_len")
        proj = "batch_size seq_len hidden_size, hidden_size num_heads head_dim -> batch_size seq_len num_heads head_dim"

        def block(x, p):
            q = md.einsum(proj, x, p["query"])
            k = md.rename(md.einsum(proj, x, p["key"]), seq_len="key_len")
            v = md.rename(md.einsum(proj, x, p["value"]), seq_len="key_len")
            s = md.einsum("batch_size seq_len num_heads head_dim, batch_size key_len num_heads head_dim -> "
                          "batch_size num_heads seq_len key_len", q, k) * (hd ** -0.5) + key_bias
            ctx = md.einsum("batch_size num_heads seq_len key_len, batch_size key_len num_heads head_dim -> "
                            "batch_size seq_len num_heads head_dim", md.softmax(s, "key_len"), v)
            a = md.einsum("batch_size seq_len num_heads head_dim, num_heads head_dim hidden_size -> "
                          "batch_size seq_len hidden_size", ctx, p["attn_out"]) + p["attn_out_b"]
            x = md.layer_norm(x + a, "hidden_size", p["ln1"], p["ln1_b"])
            h = md.gelu(md.einsum("batch_size seq_len hidden_size, hidden_size intermediate_size -> "
                                  "batch_size seq_len intermediate_size", x, p["intermediate"]) + p["intermediate_b"])
            f = md.einsum("batch_size seq_len intermediate_size, intermediate_size hidden_size -> "
                          "batch_size seq_len hidden_size", h, p["output"]) + p["output_b"]
            return md.layer_norm(x + f, "hidden_size", p["ln2"], p["ln2_b"])

        x = md.layer_norm(md.gather(word, input_ids, "vocab_size") + pos, "hidden_size", emb_ln, emb_ln_b)
        x = md.repeat(block, x, layer, "num_layers")
        logits = md.einsum("batch_size seq_len hidden_size, vocab_size hidden_size -> batch_size seq_len vocab_size",
                           x, word) + decoder_b
        keep = md.cast(md.not_equal(labels, -100), torch.float32)
        safe = md.maximum(labels, 0)   # the ignored -100s read class 0, masked out by keep
        ce = md.cross_entropy(logits, safe, "vocab_size")
        loss = md.reduce_sum(ce * keep) / md.maximum(md.reduce_sum(keep), 1.0)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        b, s = cfg.batch_size, cfg.max_position_embeddings
        ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
        lengths = torch.randint(s // 2, s + 1, (b,), generator=gen)
        mask = (torch.arange(s)[None, :] < lengths[:, None]).float()
        picked = (torch.rand(b, s, generator=gen) < 0.3) & (mask > 0)
        picked[:, 0] = True
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(picked, ids, torch.full_like(ids, -100))}

    params = {"word_embeddings": word, "position_embeddings": pos, "emb_ln": emb_ln, "emb_ln_b": emb_ln_b,
              **layer, "decoder_bias": decoder_b}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
