"""A LLaVA-style vision-language model, written from README.md and docs/ only (a held-out model).

- Vision tower: images ``[batch, height, width, channels]`` cut into patches by ``md.rearrange``,
  a patch embedding plus learned positions, a pre-LN encoder stack over ``v_layer``
  (``md.repeat``, non-causal fused attention, gelu MLP). ``freeze_vision=True`` leaves the tower's
  params out of the Model's ``params`` (frozen, as LLaVA's first stage trains the projector only).
- Projector: a two-layer gelu MLP from the tower's ``d_vis`` to the LM's ``d_model``.
- The image tokens (patches renamed to ``seq``) and the text tokens' embeddings
  (``[batch, seq:text, d_model]``) are concatenated along ``seq``, image first; learned
  positions over the joint sequence.
- A causal LM stack over ``layer`` (pre-RMSNorm, fused causal attention, SwiGLU MLP) over the
  joint sequence, a final norm and an LM head.
- The loss: next-token cross-entropy on the text positions only (the logits of positions
  ``n_img .. n_img + text - 2`` predict text tokens ``1 .. text - 1``; the image positions
  predict nothing), each text row's padding masked out (``text_len`` per example).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    size: int = 16
    channels: int = 3
    patch: int = 4
    d_vis: int = 32
    v_heads: int = 4
    v_layers: int = 2
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 128
    layers: int = 4
    vocab: int = 64
    text: int = 16
    freeze_vision: bool = False

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, size=8, channels=2, patch=2, d_vis=8, v_heads=2, v_layers=2, d_model=16,
                   heads=2, d_head=8, d_ff=24, layers=2, vocab=16, text=6)


def build(cfg: Config = Config()) -> md.Model:
    n_img = (cfg.size // cfg.patch) ** 2
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    channels, pix = md.Dim("channels", cfg.channels), md.Dim("pix", cfg.patch * cfg.patch * cfg.channels)
    patches, d_vis = md.Dim("patches", n_img), md.Dim("d_vis", cfg.d_vis)
    v_heads, v_ff, v_layer = md.Dim("v_heads", cfg.v_heads), md.Dim("v_ff", 2 * cfg.d_vis), md.Dim("v_layer", cfg.v_layers)
    v_head = md.Dim("v_head", cfg.d_vis // cfg.v_heads)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, layer, vocab = md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers), md.Dim("vocab", cfg.vocab)
    text, seq, tgt = md.Dim("seq", cfg.text), md.Dim("seq", n_img + cfg.text), md.Dim("tgt", cfg.text - 1)
    d_proj = md.Dim("d_proj", cfg.d_model)

    with md.Graph("heldout_llava") as g:
        images = md.input("images", [batch, height, width, channels])
        tokens = md.input("tokens", [batch, text], dtype=torch.int64)
        text_len = md.input("text_len", [batch], dtype=torch.int64)
        vis = {
            "v_embed": md.param("v_embed", [pix, d_vis], fan_out=["d_vis"]),
            "v_pos": md.param("v_pos", [patches, d_vis], scale=0.5),
        }
        v_stack = {
            "v_ln1": md.param("v_ln1", [v_layer, d_vis], init="ones"),
            **{f"v_w{n}": md.param(f"v_w{n}", [v_layer, d_vis, v_heads, v_head], fan_out=["v_layer", "v_heads", "v_head"])
               for n in "qkv"},
            "v_wo": md.param("v_wo", [v_layer, v_heads, v_head, d_vis], fan_out=["v_layer", "d_vis"]),
            "v_ln2": md.param("v_ln2", [v_layer, d_vis], init="ones"),
            "v_fc": md.param("v_fc", [v_layer, d_vis, v_ff], fan_out=["v_layer", "v_ff"]),
            "v_proj": md.param("v_proj", [v_layer, v_ff, d_vis], fan_out=["v_layer", "d_vis"]),
        }
        projector = {
            "p_ln": md.param("p_ln", [d_vis], init="ones"),
            "p_w1": md.param("p_w1", [d_vis, d_proj], fan_out=["d_proj"]),
            "p_w2": md.param("p_w2", [d_proj, d_model], fan_out=["d_model"]),
        }
        lm = {
            "wte": md.param("wte", [vocab, d_model], scale=0.5),
            "wpe": md.param("wpe", [seq, d_model], scale=0.1),
        }
        stack = {
            "norm1": md.param("norm1", [layer, d_model], init="ones"),
            **{f"w{n}": md.param(f"w{n}", [layer, d_model, heads, d_head], fan_out=["layer", "heads", "d_head"])
               for n in "qkv"},
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", "d_model"]),
            "norm2": md.param("norm2", [layer, d_model], init="ones"),
            "w_gate": md.param("w_gate", [layer, d_model, d_ff], fan_out=["layer", "d_ff"]),
            "w_up": md.param("w_up", [layer, d_model, d_ff], fan_out=["layer", "d_ff"]),
            "w_down": md.param("w_down", [layer, d_ff, d_model], fan_out=["layer", "d_model"]),
        }
        norm_f = md.param("norm_f", [d_model], init="ones")
        lm_head = md.param("lm_head", [d_model, vocab], fan_out=["vocab"])

        def vision_block(x, p):
            h = md.layer_norm(x, "d_vis", p["v_ln1"])
            q, k, v = (md.einsum("batch patches d_vis, d_vis v_heads v_head -> batch patches v_heads v_head",
                                 h, p[f"v_w{n}"]) for n in "qkv")
            k, v = md.rename(k, patches="key_patches"), md.rename(v, patches="key_patches")
            o = md.attention(q, k, v, "patches", "key_patches", "v_head", causal=False)
            x = x + md.einsum("batch patches v_heads v_head, v_heads v_head d_vis -> batch patches d_vis", o, p["v_wo"])
            h = md.gelu(md.einsum("batch patches d_vis, d_vis v_ff -> batch patches v_ff",
                                  md.layer_norm(x, "d_vis", p["v_ln2"]), p["v_fc"]))
            return x + md.einsum("batch patches v_ff, v_ff d_vis -> batch patches d_vis", h, p["v_proj"])

        def lm_block(x, p):
            h = md.rms_norm(x, "d_model", p["norm1"])
            q, k, v = (md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p[f"w{n}"])
                       for n in "qkv")
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            h = md.rms_norm(x, "d_model", p["norm2"])
            gate = md.silu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_gate"]))
            up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_up"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", gate * up, p["w_down"])

        # the vision tower
        px = md.rename(md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)",
                                    ph=cfg.patch, pw=cfg.patch), hp_wp="patches", ph_pw_channels="pix")
        v = md.einsum("batch patches pix, pix d_vis -> batch patches d_vis", px, vis["v_embed"]) + vis["v_pos"]
        v = md.repeat(vision_block, v, v_stack, "v_layer")
        # the projector to the LM's width
        h = md.gelu(md.einsum("batch patches d_vis, d_vis d_proj -> batch patches d_proj",
                              md.layer_norm(v, "d_vis", projector["p_ln"]), projector["p_w1"]))
        img_tokens = md.einsum("batch patches d_proj, d_proj d_model -> batch patches d_model", h, projector["p_w2"])
        # image tokens, then the text's, along one sequence
        txt = md.gather(lm["wte"], tokens, "vocab")
        x = md.concat([md.rename(img_tokens, patches="seq"), txt], "seq") + lm["wpe"]
        x = md.repeat(lm_block, x, stack, "layer")
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", md.rms_norm(x, "d_model", norm_f), lm_head)
        # the text positions only: n_img + t predicts text token t + 1
        text_logits = md.rename(md.slice_(logits, "seq", n_img, n_img + cfg.text - 1), seq="tgt")
        targets = md.rename(md.slice_(tokens, "seq", 1, cfg.text), seq="tgt")
        keep = md.cast(md.less(md.arange(tgt) + 1, text_len), torch.float32)     # [tgt, batch]
        ce = md.cross_entropy(text_logits, targets, "vocab") * keep
        loss = md.reduce_sum(ce) / md.reduce_sum(keep)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.size, cfg.size, cfg.channels, generator=gen),
                "tokens": torch.randint(0, cfg.vocab, (cfg.batch, cfg.text), generator=gen),
                "text_len": torch.randint(2, cfg.text + 1, (cfg.batch,), generator=gen)}

    vision = {**vis, **v_stack}
    params = {**({} if cfg.freeze_vision else vision), **projector, **lm, **stack, "norm_f": norm_f,
              "lm_head": lm_head}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
