"""A CLIP-style two-tower contrastive model, written from the README and docs/ alone (a held-out model).

An image tower (patchify by ``md.rearrange``, a learned position table, a pre-LN transformer
stack, a mean over the patches) and a text tower (token embedding, a causal transformer
stack, the last position's row picked by ``md.slice_`` + ``md.squeeze``), each projected to
a shared ``d_embed`` and L2-normalised. The logits are the ``[batch, text_batch]`` matrix of
every image against every text (the text embeddings renamed ``batch -> text_batch``), times a
learned temperature ``exp(logit_scale)``; the loss is the symmetric cross-entropy over it:
image->text along ``text_batch`` and text->image along ``batch``, each row's label its own
index (``md.arange``). The loss couples the whole batch: under ``batch:data`` each rank needs
every other rank's text embeddings.

Legend: b = batch, t = text_batch, p = patches, s = seq, d = d_model.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 32
    patch: int = 8
    channels: int = 3
    vocab: int = 64
    seq: int = 16
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 128
    d_embed: int = 32
    layers: int = 2
    batch: int = 8

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=8, patch=4, channels=3, vocab=16, seq=6, d_model=16, heads=2, d_head=8, d_ff=32,
                   d_embed=8, layers=2, batch=4)


def _stack(prefix: str, layer, d_model, heads, d_head, d_ff) -> dict:
    fan = [layer.name]
    return {
        f"{prefix}ln1": md.param(f"{prefix}ln1", [layer, d_model], init="ones"),
        f"{prefix}wq": md.param(f"{prefix}wq", [layer, d_model, heads, d_head], fan_out=[*fan, heads, d_head]),
        f"{prefix}wk": md.param(f"{prefix}wk", [layer, d_model, heads, d_head], fan_out=[*fan, heads, d_head]),
        f"{prefix}wv": md.param(f"{prefix}wv", [layer, d_model, heads, d_head], fan_out=[*fan, heads, d_head]),
        f"{prefix}wo": md.param(f"{prefix}wo", [layer, heads, d_head, d_model], fan_out=[*fan, d_model]),
        f"{prefix}ln2": md.param(f"{prefix}ln2", [layer, d_model], init="ones"),
        f"{prefix}w1": md.param(f"{prefix}w1", [layer, d_model, d_ff], fan_out=[*fan, d_ff]),
        f"{prefix}w2": md.param(f"{prefix}w2", [layer, d_ff, d_model], fan_out=[*fan, d_model]),
    }


def _encoder_block(prefix: str, pos: str, causal: bool):
    """A pre-LN transformer layer over the sequence dim ``pos``."""
    key = f"key_{pos}"

    def block(h: md.Tensor, p: dict) -> md.Tensor:
        x = md.layer_norm(h, "d_model", p[f"{prefix}ln1"])
        q = md.einsum(f"batch {pos} d_model, d_model heads d_head -> batch {pos} heads d_head", x, p[f"{prefix}wq"])
        k = md.einsum(f"batch {pos} d_model, d_model heads d_head -> batch {pos} heads d_head", x, p[f"{prefix}wk"])
        v = md.einsum(f"batch {pos} d_model, d_model heads d_head -> batch {pos} heads d_head", x, p[f"{prefix}wv"])
        k, v = md.rename(k, {pos: key}), md.rename(v, {pos: key})
        o = md.attention(q, k, v, pos, key, "d_head", causal=causal)
        h = h + md.einsum(f"batch {pos} heads d_head, heads d_head d_model -> batch {pos} d_model", o, p[f"{prefix}wo"])
        x = md.layer_norm(h, "d_model", p[f"{prefix}ln2"])
        x = md.gelu(md.einsum(f"batch {pos} d_model, d_model d_ff -> batch {pos} d_ff", x, p[f"{prefix}w1"]))
        return h + md.einsum(f"batch {pos} d_ff, d_ff d_model -> batch {pos} d_model", x, p[f"{prefix}w2"])

    return block


def _unit(x: md.Tensor, dim: str) -> md.Tensor:
    return x * md.rsqrt(md.reduce_sum(x * x, dim) + 1e-6)


def build(cfg: Config = Config()) -> md.Model:
    n = cfg.image // cfg.patch
    batch, d_model, d_ff = md.Dim("batch", cfg.batch), md.Dim("d_model", cfg.d_model), md.Dim("d_ff", cfg.d_ff)
    heads, d_head, layer = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("layer", cfg.layers)
    img_layer = md.Dim("img_layer", cfg.layers)    # two stacks pipeline over one stage axis: a layer dim each
    patches, seq, vocab = md.Dim("patches", n * n), md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab)
    d_patch, d_embed = md.Dim("d_patch", cfg.patch * cfg.patch * cfg.channels), md.Dim("d_embed", cfg.d_embed)
    with md.Graph("heldout_clip") as g:
        images = md.input("images", [batch, md.Dim("height", cfg.image), md.Dim("width", cfg.image),
                                     md.Dim("channels", cfg.channels)])
        tokens = md.input("tokens", [batch, seq], dtype=torch.int64)
        w_patch = md.param("w_patch", [d_patch, d_model], fan_out=[d_model])
        pos_img = md.param("pos_img", [patches, d_model], scale=0.1)
        wte = md.param("wte", [vocab, d_model], scale=0.5)
        pos_txt = md.param("pos_txt", [seq, d_model], scale=0.1)
        img_stack = _stack("img_", img_layer, d_model, heads, d_head, d_ff)
        txt_stack = _stack("txt_", layer, d_model, heads, d_head, d_ff)
        ln_img, ln_txt = md.param("ln_img", [d_model], init="ones"), md.param("ln_txt", [d_model], init="ones")
        proj_img = md.param("proj_img", [d_model, d_embed], fan_out=[d_embed])
        proj_txt = md.param("proj_txt", [d_model, d_embed], fan_out=[d_embed])
        logit_scale = md.param("logit_scale", [], init="zeros")

        # image tower
        x = md.rearrange(images, "batch (ph p1) (pw p2) channels -> batch (ph pw) (p1 p2 channels)",
                         p1=cfg.patch, p2=cfg.patch)
        x = md.rename(x, {x.shape.names[1]: "patches", x.shape.names[2]: "d_patch"})
        h = md.einsum("batch patches d_patch, d_patch d_model -> batch patches d_model", x, w_patch) + pos_img
        h = md.repeat(_encoder_block("img_", "patches", causal=False), h, img_stack, "img_layer")
        img = md.reduce_mean(md.layer_norm(h, "d_model", ln_img), "patches")
        img = _unit(md.einsum("batch d_model, d_model d_embed -> batch d_embed", img, proj_img), "d_embed")

        # text tower: the last position (an end-of-text token in CLIP) is the sentence
        t = md.gather(wte, tokens, "vocab") + pos_txt
        t = md.repeat(_encoder_block("txt_", "seq", causal=True), t, txt_stack, "layer")
        t = md.squeeze(md.slice_(md.layer_norm(t, "d_model", ln_txt), "seq", cfg.seq - 1, cfg.seq), "seq")
        txt = _unit(md.einsum("batch d_model, d_model d_embed -> batch d_embed", t, proj_txt), "d_embed")

        # every image against every text; symmetric cross-entropy with the diagonal as labels
        txt = md.rename(txt, batch="text_batch")
        logits = md.einsum("batch d_embed, text_batch d_embed -> batch text_batch", img, txt) * md.exp(logit_scale)
        i2t = md.cross_entropy(logits, md.arange(batch), "text_batch")
        t2i = md.cross_entropy(logits, md.arange(md.Dim("text_batch", cfg.batch)), "batch")
        loss = 0.5 * (md.reduce_mean(i2t) + md.reduce_mean(t2i))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen),
                "tokens": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)}

    params = {"w_patch": w_patch, "pos_img": pos_img, "wte": wte, "pos_txt": pos_txt, **img_stack, **txt_stack,
              "ln_img": ln_img, "ln_txt": ln_txt, "proj_img": proj_img, "proj_txt": proj_txt,
              "logit_scale": logit_scale}
    return md.Model(g, loss, params, feeds, cfg)
