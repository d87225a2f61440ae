"""A Flamingo-style visual language model, written from the README and docs/ alone (a held-out
model), in dims of its own names.

A frozen vision encoder (its weights left out of the Model's params, its output behind
``md.stop_gradient`` too) turns image patches into features; a Perceiver resampler (a stack of its
own, ``rl``) lets a few learned latents attend to the features and themselves (keys: the features
and the latents joined by ``md.concat``) and keeps them; the causal LM's stack (``blk``) runs, per
layer, a tanh-gated cross-attention from the text to the resampled latents and a tanh-gated MLP,
then an ordinary self-attention layer. The gates start at ``gate0`` (Flamingo's 0 would leave
the cross-attention weights without a gradient at the first step). ``img_text`` masks what each
text position may read: a position before the image token ``img_at`` sees no image (its
cross-attention output is zeroed). ``kv_stacked=True`` makes every layer's cross-attention keys
and values before the stack, one einsum each with the ``blk`` dim, and hands them to the repeat
as stacked inputs.

Legend: n (batch), t (text position; tk: as keys), c (width), img (patch), px (pixel features),
lat (latents), kv (the resampler's keys: patches then latents), h (heads), e (head width),
f (MLP width), voc (vocabulary), rl / blk (the two stacks' layers).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    voc: int = 64
    c: int = 32
    h: int = 4
    e: int = 8
    f: int = 64
    px: int = 24
    img: int = 16
    lat: int = 4
    t: int = 16
    n: int = 4
    rl: int = 2
    blk: int = 2
    gate0: float = 0.5
    img_at: int = 3
    kv_stacked: bool = False
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(voc=20, c=12, h=2, e=6, f=24, px=9, img=6, lat=3, t=8, n=4, rl=2, blk=2, img_at=2)


def build(cfg: Config = Config()) -> md.Model:
    n, t, c = md.Dim("n", cfg.n), md.Dim("t", cfg.t), md.Dim("c", cfg.c)
    img, px, lat, h, e = md.Dim("img", cfg.img), md.Dim("px", cfg.px), md.Dim("lat", cfg.lat), md.Dim("h", cfg.h), md.Dim("e", cfg.e)
    f, voc, rl, blk = md.Dim("f", cfg.f), md.Dim("voc", cfg.voc), md.Dim("rl", cfg.rl), md.Dim("blk", cfg.blk)
    with md.Graph("heldout_flamingo") as g:
        pixels = md.input("pixels", [n, img, px])
        ids = md.input("ids", [n, t], dtype=torch.int64)
        labels = md.input("labels", [n, t], dtype=torch.int64)
        # the frozen vision encoder: not in the Model's params
        vis_w1 = md.param("vis_w1", [px, f], fan_out=[f])
        vis_w2 = md.param("vis_w2", [f, c], fan_out=[c])
        latents = md.param("latents", [lat, c], scale=1.0)
        rs = {
            "ln_q": md.param("rs_ln_q", [rl, c], init="ones"),
            "ln_kv": md.param("rs_ln_kv", [rl, c], init="ones"),
            "wq": md.param("rs_wq", [rl, c, h, e], fan_out=["rl", h, e]),
            "wk": md.param("rs_wk", [rl, c, h, e], fan_out=["rl", h, e]),
            "wv": md.param("rs_wv", [rl, c, h, e], fan_out=["rl", h, e]),
            "wo": md.param("rs_wo", [rl, h, e, c], fan_out=["rl", c]),
            "ln_ff": md.param("rs_ln_ff", [rl, c], init="ones"),
            "w1": md.param("rs_w1", [rl, c, f], fan_out=["rl", f]),
            "w2": md.param("rs_w2", [rl, f, c], fan_out=["rl", c]),
        }
        wte = md.param("wte", [voc, c], scale=0.1)
        lm = {
            "x_ln": md.param("x_ln", [blk, c], init="ones"),
            "x_wq": md.param("x_wq", [blk, c, h, e], fan_out=["blk", h, e]),
            "x_wk": md.param("x_wk", [blk, c, h, e], fan_out=["blk", h, e]),
            "x_wv": md.param("x_wv", [blk, c, h, e], fan_out=["blk", h, e]),
            "x_wo": md.param("x_wo", [blk, h, e, c], fan_out=["blk", c]),
            "x_gate": md.param("x_gate", [blk], init=cfg.gate0),
            "xf_ln": md.param("xf_ln", [blk, c], init="ones"),
            "xf_w1": md.param("xf_w1", [blk, c, f], fan_out=["blk", f]),
            "xf_w2": md.param("xf_w2", [blk, f, c], fan_out=["blk", c]),
            "xf_gate": md.param("xf_gate", [blk], init=cfg.gate0),
            "s_ln": md.param("s_ln", [blk, c], init="ones"),
            "s_wqkv": md.param("s_wqkv", [blk, md.Dim("qkv", 3), c, h, e], fan_out=["blk", "qkv", h, e]),
            "s_wo": md.param("s_wo", [blk, h, e, c], fan_out=["blk", c]),
            "m_ln": md.param("m_ln", [blk, c], init="ones"),
            "m_w1": md.param("m_w1", [blk, c, f], fan_out=["blk", f]),
            "m_w2": md.param("m_w2", [blk, f, c], fan_out=["blk", c]),
        }
        ln_f = md.param("ln_f", [c], init="ones")
        w_out = md.param("w_out", [c, voc], fan_out=[voc])

        feats = md.stop_gradient(md.einsum("n img f, f c -> n img c",
                                           md.gelu(md.einsum("n img px, px f -> n img f", pixels, vis_w1)), vis_w2))

        def mlp(x, ln, w1, w2, dim):
            hid = md.gelu(md.einsum(f"n {dim} c, c f -> n {dim} f", md.layer_norm(x, "c", ln), w1))
            return md.einsum(f"n {dim} f, f c -> n {dim} c", hid, w2)

        def resampler_layer(x, p):
            q_in = md.layer_norm(x, "c", p["ln_q"])
            kv_in = md.concat([md.rename(md.layer_norm(feats, "c", p["ln_kv"]), img="kv"), md.rename(q_in, lat="kv")], "kv")
            q = md.einsum("n lat c, c h e -> n lat h e", q_in, p["wq"])
            k = md.einsum("n kv c, c h e -> n kv h e", kv_in, p["wk"])
            v = md.einsum("n kv c, c h e -> n kv h e", kv_in, p["wv"])
            o = md.attention(q, k, v, "lat", "kv", "e", causal=False)
            x = x + md.einsum("n lat h e, h e c -> n lat c", o, p["wo"])
            return x + mlp(x, p["ln_ff"], p["w1"], p["w2"], "lat")

        vis = md.repeat(resampler_layer, md.broadcast_to(latents, [n, lat, c]), rs, "rl", remat=cfg.remat)
        vis = md.rename(vis, lat="mem")                                            # [n, mem, c]
        sees_image = md.cast(md.greater_equal(md.arange(t), cfg.img_at), torch.float32)   # [t]

        def lm_layer(x, p):
            hq = md.layer_norm(x, "c", p["x_ln"])
            q = md.einsum("n t c, c h e -> n t h e", hq, p["x_wq"])
            if cfg.kv_stacked:
                k, v = p["xk_all"], p["xv_all"]
            else:
                k = md.einsum("n mem c, c h e -> n mem h e", vis, p["x_wk"])
                v = md.einsum("n mem c, c h e -> n mem h e", vis, p["x_wv"])
            o = md.attention(q, k, v, "t", "mem", "e", causal=False) * sees_image
            x = x + md.tanh(p["x_gate"]) * md.einsum("n t h e, h e c -> n t c", o, p["x_wo"])
            x = x + md.tanh(p["xf_gate"]) * mlp(x, p["xf_ln"], p["xf_w1"], p["xf_w2"], "t")
            qkv = md.einsum("n t c, qkv c h e -> qkv n t h e", md.layer_norm(x, "c", p["s_ln"]), p["s_wqkv"])
            q, k, v = (md.squeeze(md.slice_(qkv, "qkv", i, i + 1), "qkv") for i in range(3))
            o = md.attention(q, md.rename(k, t="tk"), md.rename(v, t="tk"), "t", "tk", "e", causal=True)
            x = x + md.einsum("n t h e, h e c -> n t c", o, p["s_wo"])
            return x + mlp(x, p["m_ln"], p["m_w1"], p["m_w2"], "t")

        stacked = dict(lm)
        if cfg.kv_stacked:   # every layer's keys and values from one einsum each, before the stack
            stacked["xk_all"] = md.einsum("n mem c, blk c h e -> blk n mem h e", vis, lm["x_wk"])
            stacked["xv_all"] = md.einsum("n mem c, blk c h e -> blk n mem h e", vis, lm["x_wv"])
        x = md.repeat(lm_layer, md.gather(wte, ids, "voc"), stacked, "blk", remat=cfg.remat)
        logits = md.einsum("n t c, c voc -> n t voc", md.layer_norm(x, "c", ln_f), w_out)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "voc"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.voc, (cfg.n, cfg.t + 1), generator=gen)
        return {"pixels": torch.randn(cfg.n, cfg.img, cfg.px, generator=gen), "ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    params = {"latents": latents, **{f"rs_{k}": v for k, v in rs.items()}, "wte": wte, **lm, "ln_f": ln_f, "w_out": w_out}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
