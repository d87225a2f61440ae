"""A Mistral-style sliding-window decoder with grouped-query attention, written from the README and
docs/ alone (a held-out model), in dims of its own names.

Attention is the fused ``md.attention(..., window=W)``: query ``i`` reads keys ``i - W < j <= i``
(the sequence is longer than the window), grouped-query (q ``[b, t, kvh, g, hd]`` against k, v
``[b, kt, kvh, hd]``). Positions roll as in a rolling KV buffer: each position's slot in a buffer
of ``W`` entries is ``pos % W`` and its buffer round is ``pos // W`` (``%`` and ``//`` on Tensors);
a learned slot embedding and a round embedding (rounds past ``max_round`` clamped onto it by
``md.clamp``) are added to the tokens' embeddings, and rotary embeddings (interleaved pairs, from
the absolute position) rotate q and k. RMSNorm pre-norm, SwiGLU MLP, untied head, z-loss.

Legend: b (batch), t (position; kt: as keys), dm (width), kvh (key/value heads), g (query heads
per key/value head), hd (head width; pr, two: its pairs), ff (MLP width), v (vocabulary),
slot / rnd (rolling buffer slots and rounds), blk (layers).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    v: int = 64
    dm: int = 32
    kvh: int = 2
    g: int = 2
    hd: int = 8
    ff: int = 64
    blk: int = 2
    t: int = 24
    b: int = 4
    window: int = 6
    max_round: int = 2
    z_loss: float = 1e-3
    theta: float = 10000.0
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(v=20, dm=12, kvh=2, g=2, hd=4, ff=24, blk=2, t=12, b=4, window=4, max_round=2)


def rope_pairs(x, cos, sin):
    """Rotate each (even, odd) pair of ``hd`` by its angle (GPT-J's interleaved form)."""
    names = " ".join(n for n in x.shape.names if n != "hd")
    pairs = md.rearrange(x, f"{names} (pr two) -> {names} pr two", two=2)
    out = pairs * cos + md.roll(pairs, "two", 1) * sin
    return md.rename(md.rearrange(out, f"{names} pr two -> {names} (pr two)"), pr_two="hd")


def build(cfg: Config = Config()) -> md.Model:
    b, t, dm = md.Dim("b", cfg.b), md.Dim("t", cfg.t), md.Dim("dm", cfg.dm)
    kvh, g, hd, ff = md.Dim("kvh", cfg.kvh), md.Dim("g", cfg.g), md.Dim("hd", cfg.hd), md.Dim("ff", cfg.ff)
    v, blk, pr, two = md.Dim("v", cfg.v), md.Dim("blk", cfg.blk), md.Dim("pr", cfg.hd // 2), md.Dim("two", 2)
    slot, rnd = md.Dim("slot", cfg.window), md.Dim("rnd", cfg.max_round + 1)
    with md.Graph("heldout_swagqa") as graph:
        ids = md.input("ids", [b, t], dtype=torch.int64)
        labels = md.input("labels", [b, t], dtype=torch.int64)
        emb = md.param("emb", [v, dm], scale=0.1)
        slot_emb = md.param("slot_emb", [slot, dm], scale=0.1)
        round_emb = md.param("round_emb", [rnd, dm], scale=0.1)
        layers = {
            "n_att": md.param("n_att", [blk, dm], init="ones"),
            "wq": md.param("wq", [blk, dm, kvh, g, hd], fan_out=["blk", kvh, g, hd]),
            "wk": md.param("wk", [blk, dm, kvh, hd], fan_out=["blk", kvh, hd]),
            "wv": md.param("wv", [blk, dm, kvh, hd], fan_out=["blk", kvh, hd]),
            "wo": md.param("wo", [blk, kvh, g, hd, dm], fan_out=["blk", dm]),
            "n_mlp": md.param("n_mlp", [blk, dm], init="ones"),
            "w_gate": md.param("w_gate", [blk, dm, ff], fan_out=["blk", ff]),
            "w_up": md.param("w_up", [blk, dm, ff], fan_out=["blk", ff]),
            "w_down": md.param("w_down", [blk, ff, dm], fan_out=["blk", dm]),
        }
        n_out = md.param("n_out", [dm], init="ones")
        head = md.param("head", [dm, v], fan_out=[v])

        pos = md.arange(t)
        rolled = md.gather(slot_emb, pos % cfg.window, "slot") + \
            md.gather(round_emb, md.clamp(pos // cfg.window, max=cfg.max_round), "rnd")      # [t, dm]
        inv = 1.0 / cfg.theta ** (torch.arange(0, cfg.hd, 2, dtype=torch.float64) / cfg.hd)
        ang = md.cast(pos, torch.float32) * md.constant(inv.to(torch.float32), [pr])
        cos, sin = md.cos(ang), md.sin(ang) * md.constant(torch.tensor([-1.0, 1.0]), [two])

        def layer(x, p):
            h = md.rms_norm(x, "dm", p["n_att"])
            q = rope_pairs(md.einsum("b t dm, dm kvh g hd -> b t kvh g hd", h, p["wq"]), cos, sin)
            k = rope_pairs(md.einsum("b t dm, dm kvh hd -> b t kvh hd", h, p["wk"]), cos, sin)
            val = md.einsum("b t dm, dm kvh hd -> b t kvh hd", h, p["wv"])
            o = md.attention(q, md.rename(k, t="kt"), md.rename(val, t="kt"), "t", "kt", "hd", causal=True,
                             window=cfg.window)
            x = x + md.einsum("b t kvh g hd, kvh g hd dm -> b t dm", o, p["wo"])
            h = md.rms_norm(x, "dm", p["n_mlp"])
            u = md.silu(md.einsum("b t dm, dm ff -> b t ff", h, p["w_gate"])) * md.einsum("b t dm, dm ff -> b t ff", h, p["w_up"])
            return x + md.einsum("b t ff, ff dm -> b t dm", u, p["w_down"])

        x = md.repeat(layer, md.gather(emb, ids, "v") + rolled, layers, "blk", remat=cfg.remat)
        logits = md.einsum("b t dm, dm v -> b t v", md.rms_norm(x, "dm", n_out), head)
        z = md.logsumexp(logits, "v")
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "v")) + cfg.z_loss * md.reduce_mean(z * z)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.v, (cfg.b, cfg.t + 1), generator=gen)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    params = {"emb": emb, "slot_emb": slot_emb, "round_emb": round_emb, **layers, "n_out": n_out, "head": head}
    return md.Model(graph, loss, params, feeds, cfg, logits=logits)
