"""A Gemma-2-style decoder written from the README and docs/ alone (a held-out model).

Grouped-query attention with fewer key/value heads (2) than a model axis may have (4), the
attention logits soft-capped (``tanh(s / c) * c``, so a composite attention: einsum, cap,
causal ``md.where``, softmax), a "sandwich" of norms (RMSNorm before and after each
sub-block, the post-norm on the branch before the residual add), a GeGLU MLP, the input
embedding scaled by sqrt(d_model) and tied to the output head, the final logits soft-capped,
and a per-layer scalar gate on each residual branch (``[layer]`` param, a Mixture-of-Depths
flavoured skip). ``exit_loss=True`` adds an early-exit loss: each layer returns the
cross-entropy of its own output through the tied head (a per-layer output of ``md.repeat``),
summed over the layers into the loss.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    kv_heads: int = 2
    d_head: int = 8
    d_ff: int = 48
    layers: int = 2
    seq: int = 16
    batch: int = 4
    attn_cap: float = 50.0
    final_cap: float = 30.0
    exit_loss: bool = False
    exit_weight: float = 0.1

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=4, kv_heads=2, d_head=4, d_ff=24, layers=4, seq=8, batch=4,
                   attn_cap=2.0, final_cap=3.0)


def softcap(x: md.Tensor, cap: float) -> md.Tensor:
    return md.tanh(x * (1.0 / cap)) * cap


def build(cfg: Config = Config()) -> md.Model:
    group = cfg.heads // cfg.kv_heads
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d_model, heads, kv_heads = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("kv_heads", cfg.kv_heads)
    d_head, d_ff, vocab, layer = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_gemma") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.5)
        blocks = {
            "pre_attn": md.param("pre_attn", [layer, d_model], init="ones"),
            "post_attn": md.param("post_attn", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wk": md.param("wk", [layer, d_model, kv_heads, d_head], fan_out=["layer", kv_heads, d_head]),
            "wv": md.param("wv", [layer, d_model, kv_heads, d_head], fan_out=["layer", kv_heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "pre_mlp": md.param("pre_mlp", [layer, d_model], init="ones"),
            "post_mlp": md.param("post_mlp", [layer, d_model], init="ones"),
            "w_gate": md.param("w_gate", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_up": md.param("w_up", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_down": md.param("w_down", [layer, d_ff, d_model], fan_out=["layer", d_model]),
            "gate": md.param("gate", [layer], scale=1.0),
        }
        norm_f = md.param("norm_f", [d_model], init="ones")
        mask = md.causal_mask(seq, key_seq)

        def head(x: md.Tensor) -> md.Tensor:
            x = md.rms_norm(x, "d_model", norm_f)
            return softcap(md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x, wte), cfg.final_cap)

        def block(x: md.Tensor, p: dict[str, md.Tensor]):
            gate = md.sigmoid(p["gate"])
            h = md.rms_norm(x, "d_model", p["pre_attn"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
            k = md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head", h, p["wk"])
            v = md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head", h, p["wv"])
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            q = md.rearrange(q, "batch seq (kv_heads group) d_head -> batch seq kv_heads group d_head", group=group)
            s = md.einsum("batch seq kv_heads group d_head, batch key_seq kv_heads d_head -> batch kv_heads group seq key_seq", q, k)
            s = softcap(s * cfg.d_head ** -0.5, cfg.attn_cap)
            att = md.softmax(md.where(mask, s, -1e9), "key_seq")
            o = md.einsum("batch kv_heads group seq key_seq, batch key_seq kv_heads d_head -> batch seq kv_heads group d_head", att, v)
            o = md.rename(md.rearrange(o, "batch seq kv_heads group d_head -> batch seq (kv_heads group) d_head"), kv_heads_group="heads")
            a = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            x = x + gate * md.rms_norm(a, "d_model", p["post_attn"])
            h = md.rms_norm(x, "d_model", p["pre_mlp"])
            up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_up"])
            gt = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_gate"])
            m = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.gelu(gt) * up, p["w_down"])
            x = x + gate * md.rms_norm(m, "d_model", p["post_mlp"])
            if not cfg.exit_loss:
                return x
            return x, {"exit": md.reduce_mean(md.cross_entropy(head(x), labels, "vocab"))}

        x = md.gather(wte, ids, "vocab") * cfg.d_model ** 0.5
        if cfg.exit_loss:
            x, per_layer = md.repeat(block, x, blocks, "layer")
        else:
            x = md.repeat(block, x, blocks, "layer")
        logits = head(x)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))
        if cfg.exit_loss:
            loss = loss + cfg.exit_weight * md.reduce_sum(per_layer["exit"], "layer")

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    return md.Model(g, loss, {"wte": wte, **blocks, "norm_f": norm_f}, feeds, cfg, logits=logits)
