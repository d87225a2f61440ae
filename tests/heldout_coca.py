"""CoCa-lite (Contrastive Captioner), a held-out model (round 27b).

Legend: batch = image-caption pairs, batch2 = the same pairs as the other side of the similarity,
height/width/channels = the image, patches = its patches (patch_d = one patch's pixels), seq = the
caption's tokens (the last one a learned [CLS] slot), key_seq = keys, img_key = image tokens as
keys, vocab, d_model/heads/d_head/d_ff as in a transformer, uni_layer/layer = the unimodal and
multimodal decoder stacks' layers.
An image encoder (a patch einsum, position embeddings, one non-causal attention + MLP block)
gives image tokens; an attention pooler (one learned query) gives the image embedding. The text
decoder is two stacks: the unimodal half (causal self-attention + MLP), whose last
position (the [CLS] slot, which sees the whole caption) is the text embedding, and the multimodal
half (causal self-attention, cross-attention to the image tokens, MLP) whose outputs predict the
next token. The loss: the symmetric InfoNCE of the two embeddings (temperature fixed) plus the
captioning cross-entropy over the caption's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 4
    image: int = 8
    patch: int = 4
    channels: int = 3
    seq: int = 8            # caption tokens, the [CLS] slot included (the last)
    vocab: int = 32
    d_model: int = 16
    heads: int = 4
    d_head: int = 4
    d_ff: int = 32
    layers: int = 2         # per decoder half
    temperature: float = 0.1
    caption_weight: float = 2.0
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, image=4, patch=2, channels=2, seq=5, vocab=12, d_model=8, heads=2, d_head=4, d_ff=16, layers=2)


def _heads(x, w, seq="seq", out="seq"):
    y = md.einsum(f"batch {seq} d_model, d_model heads d_head -> batch {seq} heads d_head", x, w)
    return y if out == seq else md.rename(y, {seq: out})


def _attend(xn, p, prefix, causal, kv=None, kv_dim="seq", key="key_seq"):
    kv = xn if kv is None else kv
    q = _heads(xn, p[f"{prefix}q"])
    o = md.attention(q, _heads(kv, p[f"{prefix}k"], kv_dim, key), _heads(kv, p[f"{prefix}v"], kv_dim, key),
                     "seq", key, "d_head", causal=causal)
    return md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p[f"{prefix}o"])


def _mlp(x, p):
    h = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", md.layer_norm(x, "d_model", p["ln_m"]), p["fc"]))
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", h, p["proj"])


def _uni_block(x, p):
    x = x + _attend(md.layer_norm(x, "d_model", p["ln_a"]), p, "s", causal=True)
    return _mlp(x, p)


def _multi_block(x, p, img):
    x = x + _attend(md.layer_norm(x, "d_model", p["ln_a"]), p, "s", causal=True)
    x = x + _attend(md.layer_norm(x, "d_model", p["ln_x"]), p, "x", causal=False, kv=img, kv_dim="patches", key="img_key")
    return _mlp(x, p)


def _stack_params(prefix, lead, D, H, E, F, cross: bool):
    """A block's params, with the stack's ``lead`` dims first ([layer], or [] for one block)."""
    fo = [d.name for d in lead]
    p = {}
    for n in ("sq", "sk", "sv") + (("xq", "xk", "xv") if cross else ()):
        p[n] = md.param(f"{prefix}_{n}", [*lead, D, H, E], fan_out=[*fo, "heads", "d_head"])
    for n in ("so",) + (("xo",) if cross else ()):
        p[n] = md.param(f"{prefix}_{n}", [*lead, H, E, D], fan_out=[*fo, "d_model"])
    p["fc"] = md.param(f"{prefix}_fc", [*lead, D, F], fan_out=[*fo, "d_ff"])
    p["proj"] = md.param(f"{prefix}_proj", [*lead, F, D], fan_out=[*fo, "d_model"])
    for n in ("ln_a", "ln_m") + (("ln_x",) if cross else ()):
        p[n] = md.param(f"{prefix}_{n}", [*lead, D], init="ones")
    return p


def build(cfg: Config) -> md.Model:
    n = cfg.image // cfg.patch
    B, Ch = md.Dim("batch", cfg.batch), md.Dim("channels", cfg.channels)
    Ht, Wd = md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    P, PD = md.Dim("patches", n * n), md.Dim("patch_d", cfg.patch * cfg.patch * cfg.channels)
    S, V, D = md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    H, E, F = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    UL, L = md.Dim("uni_layer", cfg.layers), md.Dim("layer", cfg.layers)     # two stacks: a layer dim each
    with md.Graph() as g:
        img = md.input("image", [B, Ht, Wd, Ch])
        ids = md.input("ids", [B, S], dtype=torch.int64)          # the last position is where [CLS] goes
        labels = md.input("labels", [B, S], dtype=torch.int64)    # next tokens; -100 where none
        w_patch, pos_img = md.param("w_patch", [PD, D], fan_out=["d_model"]), md.param("pos_img", [P, D], scale=0.1)
        enc = _stack_params("enc", [], D, H, E, F, cross=False)
        pool_q = md.param("pool_q", [md.Dim("seq", 1), H, E], scale=1.0)
        pool = {n_: md.param(f"pool_{n_}", [D, H, E], fan_out=["heads", "d_head"]) for n_ in ("k", "v")}
        pool_o = md.param("pool_o", [H, E, D], fan_out=["d_model"])
        wte, pos_txt, cls = md.param("wte", [V, D], scale=1.0), md.param("pos_txt", [S, D], scale=0.1), md.param("cls", [D], scale=1.0)
        uni = _stack_params("uni", [UL], D, H, E, F, cross=False)
        multi = _stack_params("multi", [L], D, H, E, F, cross=True)
        ln_f, head = md.param("ln_f", [D], init="ones"), md.param("head", [D, V], fan_out=["vocab"])
        Em = md.Dim("embed", cfg.d_model)
        img_proj, txt_proj = (md.param(f"{n_}_proj", [D, Em], fan_out=["embed"]) for n_ in ("img", "txt"))

        # image encoder: patches, one block (as a one-position "seq" dim over patches)
        pt = md.rearrange(img, "batch (ph p1) (pw p2) channels -> batch (ph pw) (p1 p2 channels)", p1=cfg.patch, p2=cfg.patch)
        pt = md.rename(pt, {"ph_pw": "seq", "p1_p2_channels": "patch_d"})
        x = md.einsum("batch seq patch_d, patch_d d_model -> batch seq d_model", pt, w_patch) + md.rename(pos_img, {"patches": "seq"})
        x = x + _attend(md.layer_norm(x, "d_model", enc["ln_a"]), enc, "s", causal=False)
        tokens = md.rename(_mlp(x, enc), {"seq": "patches"})                      # [batch, patches, d_model]
        pk, pv = (_heads(tokens, pool[n_], "patches", "img_key") for n_ in ("k", "v"))
        pooled = md.attention(md.broadcast_to(pool_q, [B, *pool_q.shape]), pk, pv, "seq", "img_key", "d_head", causal=False)
        z_img = md.einsum("batch seq heads d_head, heads d_head d_model, d_model embed -> batch embed",
                          pooled, pool_o, img_proj)

        # text: the unimodal half, its [CLS] row the text embedding; then the multimodal half
        is_cls = md.equal(md.arange(S), cfg.seq - 1)
        t = md.where(is_cls, cls, md.gather(wte, ids, "vocab")) + pos_txt
        t = md.repeat(_uni_block, t, uni, "uni_layer", remat=cfg.remat)
        t_cls = md.squeeze(md.slice_(t, "seq", cfg.seq - 1, cfg.seq), "seq")
        z_txt = md.einsum("batch d_model, d_model embed -> batch embed", t_cls, txt_proj)
        t = md.repeat(lambda c, p: _multi_block(c, p, tokens), t, multi, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", md.layer_norm(t, "d_model", ln_f), head)
        ce = md.cross_entropy(logits, labels, "vocab", ignore_index=-100)
        kept = md.reduce_sum(md.cast(md.not_equal(labels, -100), torch.float32))
        caption = md.reduce_sum(ce) / kept

        zi = z_img * md.rsqrt(md.reduce_sum(z_img * z_img, "embed") + 1e-12)
        zt = md.rename(z_txt * md.rsqrt(md.reduce_sum(z_txt * z_txt, "embed") + 1e-12), {"batch": "batch2"})
        sim = md.einsum("batch embed, batch2 embed -> batch batch2", zi, zt) / cfg.temperature
        i2t = md.reduce_mean(md.cross_entropy(sim, md.arange(B), "batch2"))
        t2i = md.reduce_mean(md.cross_entropy(sim, md.arange(md.Dim("batch2", cfg.batch)), "batch"))
        loss = 0.5 * (i2t + t2i) + cfg.caption_weight * caption

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        labels = torch.cat([ids[:, 1:cfg.seq - 1], torch.full((cfg.batch, 2), -100)], 1)   # no target at the last token nor [CLS]
        return {"image": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen), "ids": ids, "labels": labels}

    return md.Model(g, loss, g.params(), feeds, cfg, outputs={"caption": caption, "i2t": i2t})


REF_INPUTS = ("image", "ids", "labels")


def reference_loss(cfg: Config, p: dict, image, ids, labels):
    """The same model in plain torch: sdpa for every attention, F.cross_entropy both ways."""
    F = torch.nn.functional
    D = cfg.d_model
    sdpa = F.scaled_dot_product_attention

    def attn(xn, kv, w, causal):
        q, k, v = (torch.einsum("bsd,dhe->bhse", x, wi) for x, wi in ((xn, w[0]), (kv, w[1]), (kv, w[2])))
        return torch.einsum("bhse,hed->bsd", sdpa(q, k, v, is_causal=causal), w[3])

    def mlp(x, pre, i):
        return x + F.gelu(F.layer_norm(x, (D,), p[f"{pre}_ln_m"][i]) @ p[f"{pre}_fc"][i]) @ p[f"{pre}_proj"][i]

    B, n, c = image.shape[0], cfg.image // cfg.patch, cfg.channels
    pt = image.reshape(B, n, cfg.patch, n, cfg.patch, c).permute(0, 1, 3, 2, 4, 5).reshape(B, n * n, -1)
    x = pt @ p["w_patch"] + p["pos_img"]
    e = lambda nm: p[f"enc_{nm}"]
    x = x + attn(F.layer_norm(x, (D,), e("ln_a")), F.layer_norm(x, (D,), e("ln_a")), [e("sq"), e("sk"), e("sv"), e("so")], False)
    x = x + F.gelu(F.layer_norm(x, (D,), e("ln_m")) @ e("fc")) @ e("proj")
    tokens = x
    q = p["pool_q"][None].expand(B, 1, cfg.heads, cfg.d_head).transpose(1, 2)
    k, v = (torch.einsum("bsd,dhe->bhse", tokens, p[f"pool_{w}"]) for w in ("k", "v"))
    z_img = torch.einsum("bhse,hed->bsd", sdpa(q, k, v), p["pool_o"])[:, 0] @ p["img_proj"]
    t = p["wte"][ids].clone()
    t[:, -1] = p["cls"]
    t = t + p["pos_txt"]
    for i in range(cfg.layers):
        u = lambda nm: p[f"uni_{nm}"][i]
        tn = F.layer_norm(t, (D,), u("ln_a"))
        t = mlp(t + attn(tn, tn, [u("sq"), u("sk"), u("sv"), u("so")], True), "uni", i)
    z_txt = t[:, -1] @ p["txt_proj"]
    for i in range(cfg.layers):
        m = lambda nm: p[f"multi_{nm}"][i]
        tn = F.layer_norm(t, (D,), m("ln_a"))
        t = t + attn(tn, tn, [m("sq"), m("sk"), m("sv"), m("so")], True)
        t = t + attn(F.layer_norm(t, (D,), m("ln_x")), tokens, [m("xq"), m("xk"), m("xv"), m("xo")], False)
        t = mlp(t, "multi", i)
    logits = F.layer_norm(t, (D,), p["ln_f"]) @ p["head"]
    caption = F.cross_entropy(logits.reshape(-1, cfg.vocab), labels.reshape(-1), ignore_index=-100)
    zi, zt = F.normalize(z_img, dim=-1, eps=0.0), F.normalize(z_txt, dim=-1, eps=0.0)
    sim = zi @ zt.T / cfg.temperature
    target = torch.arange(B)
    return 0.5 * (F.cross_entropy(sim, target) + F.cross_entropy(sim.T, target)) + cfg.caption_weight * caption
