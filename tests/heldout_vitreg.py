"""A ViT with register tokens, LayerScale and stochastic depth, written from the README and docs/
alone (a held-out model).

Images ``[batch, height, width, channels]`` are cut into patches by ``md.rearrange`` and embedded,
plus learned positions. The sequence is ``[cls; patches; registers]`` along ``tokens`` (a
``concat`` of a class token ``[tokens:1, d_model]`` and ``regs`` register tokens, both params
broadcast over the batch: "Vision Transformers Need Registers"). Pre-norm blocks under
``md.repeat``: fused non-causal attention over ``tokens``/``key_tokens`` and a gelu MLP, each
branch scaled per channel by LayerScale (``gamma [layer, d_model]``, init 0.1) and dropped per
example by stochastic depth ("drop path": the whole branch of one example is zeroed, the kept
ones scaled by 1 / (1 - rate)). ``drop`` picks how the per-example mask is made:

- ``"dropout"``: ``md.dropout`` of a ``[batch]`` tensor of ones (a mask that depends only on the
  element's index, the seed and the layer), broadcast over tokens and channels by name;
- ``"input"``: a fed uniform ``[layer, batch]`` against per-layer rates rising linearly from 0
  (timm's schedule), both stacked over ``layer`` in the repeat;
- ``"none"``: no drop path.

The head reads the class token (``slice_`` + ``squeeze``) after a final LayerNorm; the loss is the
cross-entropy over ``classes``. Registers are read by attention only and discarded at the end.

Legend: b batch, t tokens (k key_tokens), d d_model, h heads, e d_head, f d_ff, c classes.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 16
    patch: int = 4
    channels: int = 3
    regs: int = 4
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 4
    classes: int = 10
    batch: int = 8
    drop_rate: float = 0.2
    drop: str = "dropout"         # or "input", "none"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=8, patch=4, channels=3, regs=2, d_model=16, heads=2, d_head=8, d_ff=32, layers=2,
                   classes=5, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    if cfg.drop not in ("dropout", "input", "none"):
        raise ValueError(f"drop={cfg.drop!r}: 'dropout', 'input' or 'none'")
    n_side = cfg.image // cfg.patch
    b, d = md.Dim("batch", cfg.batch), md.Dim("d_model", cfg.d_model)
    h, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    L, c = md.Dim("layer", cfg.layers), md.Dim("classes", cfg.classes)
    pix = md.Dim("ph_pw_channels", cfg.patch * cfg.patch * cfg.channels)
    patches = md.Dim("patches", n_side * n_side)
    with md.Graph("heldout_vitreg") as graph:
        images = md.input("images", [b, md.Dim("height", cfg.image), md.Dim("width", cfg.image),
                                     md.Dim("channels", cfg.channels)])
        labels = md.input("labels", [b], dtype=torch.int64)
        w_embed = md.param("w_embed", [pix, d], fan_out=["d_model"])
        pos = md.param("pos", [patches, d], scale=0.02)
        cls_tok = md.param("cls", [md.Dim("tokens", 1), d], scale=0.02)
        # its own dim name, renamed to ``tokens`` where it joins them: a param's dim smaller than the
        # axes that split ``tokens`` (2 registers under tokens:model on model:3) is refused
        regs = md.param("regs", [md.Dim("reg", cfg.regs), d], scale=0.02)
        p = {
            "ln1": md.param("ln1", [L, d], init="ones"), "ln1_b": md.param("ln1_b", [L, d], init="zeros"),
            "wq": md.param("wq", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [L, h, e, d], fan_out=["layer", "d_model"]),
            "gamma1": md.param("gamma1", [L, d], init=0.1),
            "ln2": md.param("ln2", [L, d], init="ones"), "ln2_b": md.param("ln2_b", [L, d], init="zeros"),
            "w_up": md.param("w_up", [L, d, f], fan_out=["layer", "d_ff"]),
            "w_down": md.param("w_down", [L, f, d], fan_out=["layer", "d_model"]),
            "gamma2": md.param("gamma2", [L, d], init=0.1),
        }
        lnf, lnf_b = md.param("lnf", [d], init="ones"), md.param("lnf_b", [d], init="zeros")
        head = md.param("head", [d, c], fan_out=["classes"])

        x = md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)",
                         ph=cfg.patch, pw=cfg.patch)
        x = md.einsum("batch hp_wp ph_pw_channels, ph_pw_channels d_model -> batch hp_wp d_model", x, w_embed)
        x = md.rename(x, hp_wp="patches") + pos
        x = md.concat([md.broadcast_to(cls_tok, [b, cls_tok.shape["tokens"], d]), md.rename(x, patches="tokens"),
                       md.broadcast_to(md.rename(regs, reg="tokens"), [b, md.Dim("tokens", cfg.regs), d])], "tokens")

        stacked = dict(p)
        if cfg.drop == "input":
            stacked["u"] = md.input("drop_u", [L, b])
            rates = torch.linspace(0.0, cfg.drop_rate, cfg.layers)
            stacked["rate"] = md.constant(rates, [L])
        ones_b = md.broadcast_to(md.constant(1.0), [b])

        def drop_path(branch: md.Tensor, q: dict, seed: int) -> md.Tensor:
            if cfg.drop == "none":
                return branch
            if cfg.drop == "dropout":
                return branch * md.dropout(ones_b, cfg.drop_rate, seed=seed)
            keep = md.cast(md.greater_equal(q["u"], q["rate"]), torch.float32)
            return branch * (keep / (1.0 - q["rate"]))

        def block(x: md.Tensor, q: dict) -> md.Tensor:
            n = md.layer_norm(x, "d_model", q["ln1"], q["ln1_b"])
            proj = "batch tokens d_model, d_model heads d_head -> batch tokens heads d_head"
            qh = md.einsum(proj, n, q["wq"])
            kh = md.rename(md.einsum(proj, n, q["wk"]), tokens="key_tokens")
            vh = md.rename(md.einsum(proj, n, q["wv"]), tokens="key_tokens")
            o = md.attention(qh, kh, vh, "tokens", "key_tokens", "d_head", causal=False)
            a = md.einsum("batch tokens heads d_head, heads d_head d_model -> batch tokens d_model", o, q["wo"])
            x = x + drop_path(a * q["gamma1"], q, seed=1)
            n = md.layer_norm(x, "d_model", q["ln2"], q["ln2_b"])
            m = md.gelu(md.einsum("batch tokens d_model, d_model d_ff -> batch tokens d_ff", n, q["w_up"]))
            m = md.einsum("batch tokens d_ff, d_ff d_model -> batch tokens d_model", m, q["w_down"])
            return x + drop_path(m * q["gamma2"], q, seed=2)

        x = md.repeat(block, x, stacked, "layer", remat=cfg.remat)
        cls_out = md.squeeze(md.slice_(x, "tokens", 0, 1), "tokens")
        logits = md.einsum("batch d_model, d_model classes -> batch classes",
                           md.layer_norm(cls_out, "d_model", lnf, lnf_b), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        out = {"images": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen),
               "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}
        if cfg.drop == "input":
            out["drop_u"] = torch.rand(cfg.layers, cfg.batch, generator=gen)
        return out

    params = {"w_embed": w_embed, "pos": pos, "cls": cls_tok, "regs": regs, **p, "lnf": lnf, "lnf_b": lnf_b,
              "head": head}
    return md.Model(graph, loss, params, feeds, cfg)
