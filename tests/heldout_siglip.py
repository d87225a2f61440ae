"""SigLIP: an image tower and a text tower trained by the pairwise sigmoid loss.

Held-out model (round 15a), written from the user guides only. Every image of the batch
meets every caption of the batch: the logits are a ``[batch, batch2]`` matrix, scaled by a
learnable temperature and shifted by a learnable bias; the diagonal pairs are positives,
the rest negatives. ``--config loss=softmax`` swaps in CLIP's symmetric softmax loss.

Legend: b batch (images), b2 batch2 (the same examples' captions, renamed so the two meet),
p patches, s seq, d d_model, e embed.
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    size: int = 8
    patch: int = 4
    channels: int = 3
    vocab: int = 32
    seq: int = 8
    d_model: int = 16
    heads: int = 2
    d_head: int = 8
    d_ff: int = 32
    layers: int = 2
    text_layers: int = 1
    embed: int = 8
    loss: str = "sigmoid"   # sigmoid (SigLIP) | softmax (CLIP)
    remat: str = "none"   # what each repeated layer saves for its backward (md.repeat's remat=)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, size=8, patch=4, channels=2, vocab=16, seq=4, d_model=8, heads=2,
                   d_head=4, d_ff=16, layers=2, text_layers=1, embed=4)


def _block(x, p, seq, key_seq, causal):
    """One pre-norm encoder layer: attention over ``seq`` and a gelu MLP."""
    h = md.layer_norm(x, "d_model", p["ln1"])
    q = md.einsum(f"batch {seq} d_model, d_model heads d_head -> batch {seq} heads d_head", h, p["wq"])
    k = md.rename(md.einsum(f"batch {seq} d_model, d_model heads d_head -> batch {seq} heads d_head", h, p["wk"]),
                  {seq: key_seq})
    v = md.rename(md.einsum(f"batch {seq} d_model, d_model heads d_head -> batch {seq} heads d_head", h, p["wv"]),
                  {seq: key_seq})
    a = md.attention(q, k, v, seq, key_seq, "d_head", causal=causal)
    x = x + md.einsum(f"batch {seq} heads d_head, heads d_head d_model -> batch {seq} d_model", a, p["wo"])
    h = md.layer_norm(x, "d_model", p["ln2"])
    f = md.gelu(md.einsum(f"batch {seq} d_model, d_model d_ff -> batch {seq} d_ff", h, p["w1"]))
    return x + md.einsum(f"batch {seq} d_ff, d_ff d_model -> batch {seq} d_model", f, p["w2"])


def _stack(prefix, layer, d, h, e, f):
    return {
        "ln1": md.param(f"{prefix}ln1", [layer, d], init="ones"),
        "wq": md.param(f"{prefix}wq", [layer, d, h, e], fan_out=[layer.name, "heads", "d_head"]),
        "wk": md.param(f"{prefix}wk", [layer, d, h, e], fan_out=[layer.name, "heads", "d_head"]),
        "wv": md.param(f"{prefix}wv", [layer, d, h, e], fan_out=[layer.name, "heads", "d_head"]),
        "wo": md.param(f"{prefix}wo", [layer, h, e, d], fan_out=[layer.name, "d_model"]),
        "ln2": md.param(f"{prefix}ln2", [layer, d], init="ones"),
        "w1": md.param(f"{prefix}w1", [layer, d, f], fan_out=[layer.name, "d_ff"]),
        "w2": md.param(f"{prefix}w2", [layer, f, d], fan_out=[layer.name, "d_model"]),
    }


def _unit(x_be):
    """L2-normalise the embedding rows."""
    return x_be * md.rsqrt(md.reduce_sum(x_be * x_be, "embed") + 1e-6)


def build(cfg: Config = Config()) -> md.Model:
    n = cfg.size // cfg.patch
    B, H, W, C = (md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size),
                  md.Dim("channels", cfg.channels))
    S, V, D = md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    Hh, E, F = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    P, PX, Em = md.Dim("patches", n * n), md.Dim("ph_pw_channels", cfg.patch ** 2 * cfg.channels), md.Dim("embed", cfg.embed)
    L, TL = md.Dim("layer", cfg.layers), md.Dim("text_layer", cfg.text_layers)
    with md.Graph("siglip") as g:
        images = md.input("images", [B, H, W, C])
        ids = md.input("ids", [B, S], dtype=torch.int64)
        # image tower: patchify, embed, encoder layers, mean pool, project
        x = md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)",
                         ph=cfg.patch, pw=cfg.patch)
        x = md.rename(x, {"hp_wp": "patches"})
        w_patch = md.param("w_patch", [PX, D], fan_out=["d_model"])
        pos_img = md.param("pos_img", [P, D], scale=0.02)
        x = md.einsum("batch patches ph_pw_channels, ph_pw_channels d_model -> batch patches d_model", x, w_patch) + pos_img
        img = _stack("img_", L, D, Hh, E, F)
        x = md.repeat(lambda h, p: _block(h, p, "patches", "key_patches", False), x, img, L, remat=cfg.remat)
        x = md.layer_norm(x, "d_model")
        w_img = md.param("w_img", [D, Em], fan_out=["embed"])
        img_be = _unit(md.einsum("batch d_model, d_model embed -> batch embed", md.reduce_mean(x, "patches"), w_img))
        # text tower: token and position embeddings, causal layers, the last token, project
        wte = md.param("wte", [V, D], scale=0.02)
        pos_txt = md.param("pos_txt", [S, D], scale=0.02)
        t = md.gather(wte, ids, "vocab") + pos_txt
        txt = _stack("txt_", TL, D, Hh, E, F)
        t = md.repeat(lambda h, p: _block(h, p, "seq", "key_seq", True), t, txt, TL, remat=cfg.remat)
        t = md.layer_norm(md.squeeze(md.slice_(t, "seq", cfg.seq - 1, cfg.seq), "seq"), "d_model")
        w_txt = md.param("w_txt", [D, Em], fan_out=["embed"])
        txt_be = _unit(md.einsum("batch d_model, d_model embed -> batch embed", t, w_txt))
        # every image against every caption
        txt_b2e = md.rename(txt_be, {"batch": "batch2"})
        t_prime = md.param("t_prime", [], init=math.log(10.0))   # log temperature (SigLIP: log 10)
        bias = md.param("bias", [], init=-10.0)                  # SigLIP starts it at -10
        logits = (md.einsum("batch embed, batch2 embed -> batch batch2", img_be, txt_b2e)
                  * md.exp(t_prime) + bias)
        same = md.equal(md.arange(B), md.arange(md.Dim("batch2", cfg.batch)))     # [batch, batch2]
        if cfg.loss == "sigmoid":
            z = md.where(same, 1.0, -1.0)
            loss = -md.reduce_sum(md.log_sigmoid(z * logits)) / cfg.batch
        elif cfg.loss == "softmax":
            pos = md.reduce_sum(logits * md.cast(same, torch.float32), "batch2")            # [batch]
            i2t = md.logsumexp(logits, "batch2") - pos
            t2i = md.logsumexp(logits, "batch") - md.rename(pos, {"batch": "batch2"})
            loss = 0.5 * (md.reduce_mean(i2t) + md.reduce_mean(t2i))
        else:
            raise ValueError(f"loss={cfg.loss!r}: sigmoid or softmax")
    params = {"w_patch": w_patch, "pos_img": pos_img, "w_img": w_img, "wte": wte, "pos_txt": pos_txt,
              "w_txt": w_txt, "t_prime": t_prime, "bias": bias}
    params.update({f"img_{k}": v for k, v in img.items()})
    params.update({f"txt_{k}": v for k, v in txt.items()})

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.size, cfg.size, cfg.channels, generator=gen),
                "ids": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)}

    return md.Model(g, loss, params, feeds, cfg, outputs={"logits": logits})
