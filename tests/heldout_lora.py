"""LoRA fine-tuning of a small Llama-style decoder, written from the README and docs/ alone (a held-out model).

Dims: ``batch``, ``seq`` (``key_seq``), ``d_model``, ``heads``, ``d_head``, ``d_ff``, ``vocab``,
``layer``, ``rank`` (the adapters' low rank). The base model (embedding, RMSNorm pre-norm
blocks with causal fused attention and a SwiGLU MLP under ``md.repeat``, an untied head) is
frozen: its weights are ``md.param``s left out of the Model's ``params`` (the trainable state,
as ``help(md.Model)`` says), so no gradient or update is made for them. The trainable state is
the low-rank adapters on q and v: ``A [layer, d_model, rank]`` and ``B [layer, rank, heads,
d_head]``, added as ``(x A B) * alpha / rank``. LoRA starts ``B`` at zero (the fine-tune starts
from the base model exactly); ``b_scale`` > 0 starts it small and random instead, so that A's
gradient is not zero in a one-step check.

``frozen="input"`` feeds the base weights instead (``md.input``s named like the params, made by
``feeds`` from a fixed seed as a stand-in for a pretrained checkpoint), the way before
``TrainStep.set_params`` / ``md.fit(init=...)`` loaded given weights into frozen params too
(``tests/test_init_weights.py`` loads this model's base from a file).
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
    d_ff: int = 172
    layers: int = 4
    seq: int = 32
    batch: int = 8
    rank: int = 8
    alpha: float = 16.0
    b_scale: float = 0.0
    frozen: str = "param"      # "param": md.params left out of Model.params; "input": fed weights

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=24, d_model=16, heads=4, d_head=4, d_ff=20, layers=4, seq=8, batch=4, rank=2,
                   alpha=4.0, b_scale=0.1)


def _base_shapes(d_model, heads, d_head, d_ff, vocab, layer) -> dict:
    """The base model's weights: name -> (shape, md.param keywords)."""
    return {
        "wte": ([vocab, d_model], dict(scale=0.1)),
        "attn_norm": ([layer, d_model], dict(init="ones")),
        "wq": ([layer, d_model, heads, d_head], dict(fan_out=["layer", heads, d_head])),
        "wk": ([layer, d_model, heads, d_head], dict(fan_out=["layer", heads, d_head])),
        "wv": ([layer, d_model, heads, d_head], dict(fan_out=["layer", heads, d_head])),
        "wo": ([layer, heads, d_head, d_model], dict(fan_out=["layer", d_model])),
        "mlp_norm": ([layer, d_model], dict(init="ones")),
        "w_gate": ([layer, d_model, d_ff], dict(fan_out=["layer", d_ff])),
        "w_up": ([layer, d_model, d_ff], dict(fan_out=["layer", d_ff])),
        "w_down": ([layer, d_ff, d_model], dict(fan_out=["layer", d_model])),
        "norm_f": ([d_model], dict(init="ones")),
        "lm_head": ([vocab, d_model], dict(fan_out=[vocab])),
    }


def build(cfg: Config = Config()) -> md.Model:
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer, rank = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers), \
        md.Dim("rank", cfg.rank)
    scaling = cfg.alpha / cfg.rank
    with md.Graph("heldout_lora") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        # the frozen base model
        frozen = {n: (md.input(n, shape) if cfg.frozen == "input" else md.param(n, shape, **kw))
                  for n, (shape, kw) in _base_shapes(d_model, heads, d_head, d_ff, vocab, layer).items()}
        wte, norm_f, head = frozen.pop("wte"), frozen.pop("norm_f"), frozen.pop("lm_head")
        base = frozen
        frozen_tensors = {"wte": wte, **base, "norm_f": norm_f, "lm_head": head}
        # the trainable adapters
        b_init = dict(scale=cfg.b_scale) if cfg.b_scale else dict(init="zeros")
        lora = {
            "q_a": md.param("q_a", [layer, d_model, rank], fan_out=["layer", rank]),
            "q_b": md.param("q_b", [layer, rank, heads, d_head], **b_init),
            "v_a": md.param("v_a", [layer, d_model, rank], fan_out=["layer", rank]),
            "v_b": md.param("v_b", [layer, rank, heads, d_head], **b_init),
        }

        def adapted(h, w, a, b):
            y = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, w)
            low = md.einsum("batch seq d_model, d_model rank -> batch seq rank", h, a)
            return y + md.einsum("batch seq rank, rank heads d_head -> batch seq heads d_head", low, b) * scaling

        def block(x, p):
            h = md.rms_norm(x, "d_model", p["attn_norm"])
            q = adapted(h, p["wq"], p["q_a"], p["q_b"])
            k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"])
            v = adapted(h, p["wv"], p["v_a"], p["v_b"])
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            h = md.rms_norm(x, "d_model", p["mlp_norm"])
            u = md.silu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_gate"])) * \
                md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_up"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, p["w_down"])

        x = md.repeat(block, md.gather(wte, ids, "vocab"), {**base, **lora}, "layer")
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", md.rms_norm(x, "d_model", norm_f), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        out = {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        if cfg.frozen == "input":     # the "pretrained" weights: the same whatever the batch's seed
            gen = torch.Generator().manual_seed(1234)
            for n, t in frozen_tensors.items():
                out[n] = 1.0 + 0.1 * torch.randn(t.shape.sizes, generator=gen) if "norm" in n else \
                    torch.randn(t.shape.sizes, generator=gen) * 0.2
        return out

    return md.Model(g, loss, lora, feeds, cfg, logits=logits)
