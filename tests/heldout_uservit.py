"""A ViT written by a new user from the README and docs/guide only, in their own names.

Images ``[batch, height, width, channels]`` are cut into patches by ``md.rearrange``
(``batch (gh ph) (gw pw) channels -> batch (gh gw) (ph pw channels)``), or with
``patchify="reshape"`` torch-style by ``md.reshape``, ``md.transpose``, ``md.reshape``, embedded to ``embed``
with a bias, given learned position embeddings and, with ``pool="cls"``, a class token
concatenated in front (``pool="mean"``: the mean over patches). Pre-norm LayerNorm blocks
(``n_heads`` x ``head_dim`` non-causal attention, a gelu MLP over ``mlp``, biases), then an MLP
head to ``classes`` and a label-smoothed cross-entropy, with an ``accuracy`` metric.

``scan=True`` runs the blocks under ``md.repeat`` over ``depth``; ``scan=False`` is a Python loop
with params ``blocks.<i>.<name>``. Data: ``batches(seed, rows)`` draws each row from its own stream.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 16
    image: int = 32
    patch: int = 8
    channels: int = 3
    embed: int = 96
    n_heads: int = 4
    head_dim: int = 24
    mlp: int = 192
    depth: int = 4
    head_hidden: int = 64
    classes: int = 10
    pool: str = "cls"
    scan: bool = True
    smoothing: float = 0.1
    patchify: str = "rearrange"   # or "reshape": md.reshape, md.transpose, md.reshape

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, image=8, patch=4, channels=3, embed=12, n_heads=6, head_dim=2, mlp=10,
                   depth=4, head_hidden=6, classes=10)


def build(cfg: Config = Config()) -> md.Model:
    grid = cfg.image // cfg.patch
    n_patches = grid * grid
    B = md.Dim("batch", cfg.batch)
    HT, WD, C = md.Dim("height", cfg.image), md.Dim("width", cfg.image), md.Dim("channels", cfg.channels)
    E, NH, HD = md.Dim("embed", cfg.embed), md.Dim("n_heads", cfg.n_heads), md.Dim("head_dim", cfg.head_dim)
    M, L, K = md.Dim("mlp", cfg.mlp), md.Dim("depth", cfg.depth), md.Dim("classes", cfg.classes)
    PX = md.Dim("pixels", cfg.patch * cfg.patch * cfg.channels)
    seq = n_patches + (1 if cfg.pool == "cls" else 0)
    P, HH = md.Dim("patches", seq), md.Dim("head_hidden", cfg.head_hidden)
    with md.Graph("uservit") as g:
        images = md.input("images", [B, HT, WD, C])
        labels = md.input("labels", [B], dtype=torch.int64)
        params = {
            "patch_w": md.param("patch_w", [PX, E], fan_out=["embed"]),
            "patch_b": md.param("patch_b", [E], scale=0.0),
            "pos": md.param("pos", [P, E], scale=0.02),
            "norm_w": md.param("norm_w", [E], init="ones"),
            "norm_b": md.param("norm_b", [E], scale=0.0),
            "head_w1": md.param("head_w1", [E, HH], fan_out=["head_hidden"]),
            "head_b1": md.param("head_b1", [HH], scale=0.0),
            "head_w2": md.param("head_w2", [HH, K], fan_out=["classes"]),
            "head_b2": md.param("head_b2", [K], scale=0.0),
        }
        if cfg.patchify == "rearrange":
            x = md.rearrange(images, "batch (gh ph) (gw pw) channels -> batch (gh gw) (ph pw channels)",
                             ph=cfg.patch, pw=cfg.patch)
            x = md.rename(x, {"gh_gw": "patches", "ph_pw_channels": "pixels"})
        else:   # torch-style: view, permute, view
            GH, GW = md.Dim("gh", grid), md.Dim("gw", grid)
            PH, PW = md.Dim("ph", cfg.patch), md.Dim("pw", cfg.patch)
            x = md.reshape(images, [B, GH, PH, GW, PW, C])
            x = md.transpose(x, ["batch", "gh", "gw", "ph", "pw", "channels"])
            x = md.reshape(x, [B, md.Dim("patches", n_patches), PX])
        x = md.einsum("batch patches pixels, pixels embed -> batch patches embed", x, params["patch_w"])
        x = x + params["patch_b"]
        if cfg.pool == "cls":
            params["cls"] = md.param("cls", [md.Dim("patches", 1), E], scale=0.02)
            cls = md.broadcast_to(params["cls"], [B, md.Dim("patches", 1), E])
            x = md.concat([cls, x], "patches")
        x = x + params["pos"]

        def layer_shapes(stack):
            pre, fo = ([L], ["depth"]) if stack else ([], [])
            return {
                "ln1_w": ([*pre, E], dict(init="ones")), "ln1_b": ([*pre, E], dict(scale=0.0)),
                "ln2_w": ([*pre, E], dict(init="ones")), "ln2_b": ([*pre, E], dict(scale=0.0)),
                "qkv": ([*pre, md.Dim("three", 3), E, NH, HD], dict(fan_out=[*fo, "three", "n_heads", "head_dim"])),
                "qkv_b": ([*pre, md.Dim("three", 3), NH, HD], dict(scale=0.0)),
                "proj": ([*pre, NH, HD, E], dict(fan_out=[*fo, "embed"])),
                "proj_b": ([*pre, E], dict(scale=0.0)),
                "fc1": ([*pre, E, M], dict(fan_out=[*fo, "mlp"])), "fc1_b": ([*pre, M], dict(scale=0.0)),
                "fc2": ([*pre, M, E], dict(fan_out=[*fo, "embed"])), "fc2_b": ([*pre, E], dict(scale=0.0)),
            }

        def block(x, p):
            a = md.layer_norm(x, "embed", p["ln1_w"], p["ln1_b"])
            qkv = md.einsum("batch patches embed, three embed n_heads head_dim -> three batch patches n_heads head_dim",
                            a, p["qkv"]) + p["qkv_b"]
            q, k, v = (md.squeeze(md.slice_(qkv, "three", i, i + 1), "three") for i in range(3))
            k, v = md.rename(k, patches="keys"), md.rename(v, patches="keys")
            att = md.attention(q, k, v, "patches", "keys", "head_dim", causal=False)
            x = x + md.einsum("batch patches n_heads head_dim, n_heads head_dim embed -> batch patches embed",
                              att, p["proj"]) + p["proj_b"]
            m = md.layer_norm(x, "embed", p["ln2_w"], p["ln2_b"])
            h = md.gelu(md.einsum("batch patches embed, embed mlp -> batch patches mlp", m, p["fc1"]) + p["fc1_b"])
            return x + md.einsum("batch patches mlp, mlp embed -> batch patches embed", h, p["fc2"]) + p["fc2_b"]

        if cfg.scan:
            stacked = {n: md.param(n, s, **kw) for n, (s, kw) in layer_shapes(True).items()}
            params.update(stacked)
            x = md.repeat(block, x, stacked, "depth")
        else:
            for i in range(cfg.depth):
                p = {n: md.param(f"blocks.{i}.{n}", s, **kw) for n, (s, kw) in layer_shapes(False).items()}
                params.update({f"blocks.{i}.{n}": t for n, t in p.items()})
                x = block(x, p)

        x = md.layer_norm(x, "embed", params["norm_w"], params["norm_b"])
        if cfg.pool == "cls":
            feat = md.squeeze(md.slice_(x, "patches", 0, 1), "patches")
        else:
            feat = md.reduce_mean(x, "patches")
        h = md.gelu(md.einsum("batch embed, embed head_hidden -> batch head_hidden", feat, params["head_w1"])
                    + params["head_b1"])
        logits = md.einsum("batch head_hidden, head_hidden classes -> batch classes", h, params["head_w2"]) + params["head_b2"]
        ce = md.cross_entropy(logits, labels, "classes")
        if cfg.smoothing:
            ce = (1 - cfg.smoothing) * ce - cfg.smoothing * md.reduce_mean(md.log_softmax(logits, "classes"), "classes")
        loss = md.reduce_mean(ce)
        hit = md.greater_equal(md.reduce_sum(logits * md.one_hot(labels, K), "classes"), md.reduce_max(logits, "classes"))
        accuracy = md.reduce_mean(md.cast(hit, torch.float32))

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        imgs, labs = [], []
        for r in range(cfg.batch)[rows or slice(None)]:
            gen = md.row_generator(seed, r)
            k = int(torch.randint(0, cfg.classes, (), generator=gen))
            img = 0.3 * torch.randn(cfg.image, cfg.image, cfg.channels, generator=gen)
            img[:, :, k % cfg.channels] += (k + 1) / cfg.classes          # the class shows in one channel's level
            imgs.append(img)
            labs.append(k)
        if not imgs:
            return {"images": torch.zeros(0, cfg.image, cfg.image, cfg.channels),
                    "labels": torch.zeros(0, dtype=torch.int64)}
        return {"images": torch.stack(imgs), "labels": torch.tensor(labs, dtype=torch.int64)}

    return md.Model(g, loss, params, batches=batches, config=cfg, metrics={"accuracy": accuracy})
