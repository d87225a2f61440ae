"""A BigBird-style encoder with block-sparse attention, written from the README and docs/ alone (a held-out model).

The sequence is cut into blocks (``md.rearrange`` to ``[batch, blk, pos, ...]``). Each query block
attends to (BigBird's ITC pattern, Zaheer et al. 2020):

- its sliding window: the key blocks before, at and after it (``md.roll`` over ``kblk`` by -1, 0, +1,
  joined by ``md.concat`` along a ``win`` dim; the wrap at the ends is masked out; or, with
  ``window="shift"``, zero-filled ``md.shift``s);
- the global block 0 (its tokens are global) and ``rand`` fixed pseudo-random key blocks, picked by
  a constant one-hot selection ``[blk, nbr, kblk]`` (a seeded pattern, drawn apart from the window
  and the global block) contracted with the key blocks;

and the global block's own queries attend to every key (a dense row, ``md.slice_`` of block 0,
joined back to the sparse blocks by ``md.concat`` over ``blk``). The softmax runs over the
gathered keys of each query (``win kpos`` and ``nbr kpos`` at once: the two score tensors' max and
sum combined by hand, as a blocked kernel does). Pre-norm layers, a GELU MLP, a mean-pooled
classification head (the long-document classification BigBird was fine-tuned for).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    classes: int = 8
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    blocks: int = 8          # the sequence is blocks * block tokens
    block: int = 4
    rand: int = 1            # random key blocks per query block
    batch: int = 4
    window: str = "roll"     # the window's neighbours by md.roll (wrapped ends masked), or "shift" (zero-filled)
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(classes=4, vocab=32, d_model=16, heads=2, d_head=4, d_ff=24, layers=2, blocks=6, block=2, rand=1,
                   batch=4)


def selection(cfg: Config) -> torch.Tensor:
    """One-hot ``[blk, nbr, kblk]``: slot 0 the global block 0, then ``rand`` blocks outside the window."""
    gen = torch.Generator().manual_seed(1234)
    sel = torch.zeros(cfg.blocks, 1 + cfg.rand, cfg.blocks)
    for i in range(cfg.blocks):
        sel[i, 0, 0] = 1.0
        allowed = [j for j in range(1, cfg.blocks) if abs(j - i) > 1]
        pick = torch.randperm(len(allowed), generator=gen)[: cfg.rand]
        for r, j in enumerate(pick.tolist()):
            sel[i, 1 + r, allowed[j]] = 1.0
    return sel


def window_keep(cfg: Config) -> torch.Tensor:
    """``[blk, win]``: the window's key block exists (not wrapped) and is not the global block 0
    (which every query already reads through the selection)."""
    keep = torch.ones(cfg.blocks, 3)
    for i in range(cfg.blocks):
        for w, j in enumerate((i - 1, i, i + 1)):
            keep[i, w] = float(0 < j < cfg.blocks)
    return keep


def build(cfg: Config = Config()) -> md.Model:
    seq = cfg.blocks * cfg.block
    batch, s = md.Dim("batch", cfg.batch), md.Dim("seq", seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    blk, kblk, win, nbr = (md.Dim("blk", cfg.blocks), md.Dim("kblk", cfg.blocks), md.Dim("win", 3),
                           md.Dim("nbr", 1 + cfg.rand))
    classes = md.Dim("classes", cfg.classes)
    with md.Graph("heldout_bigbird") as g:
        ids = md.input("ids", [batch, s], dtype=torch.int64)
        target = md.input("target", [batch], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.5)
        wpe = md.param("wpe", [s, d_model], scale=0.1)
        qkv = [heads, d_head]
        blocks = {
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, *qkv], fan_out=["layer", *qkv]),
            "wk": md.param("wk", [layer, d_model, *qkv], fan_out=["layer", *qkv]),
            "wv": md.param("wv", [layer, d_model, *qkv], fan_out=["layer", *qkv]),
            "wo": md.param("wo", [layer, *qkv, d_model], fan_out=["layer", d_model]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "w1": md.param("w1", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w2": md.param("w2", [layer, d_ff, d_model], fan_out=["layer", d_model]),
        }
        lnf = md.param("lnf", [d_model], init="ones")
        head = md.param("head", [d_model, classes], fan_out=[classes])

        sel = md.constant(selection(cfg), [blk, nbr, kblk])
        keep = md.constant(window_keep(cfg), [blk, win])
        scale = cfg.d_head ** -0.5
        to_blocks = "batch (blk pos) heads d_head -> batch blk pos heads d_head"

        def sparse_attention(q, k, v):
            """Queries of every block against their window and selected blocks: [batch, blk, pos, heads, d_head]."""
            qb = md.rearrange(q, to_blocks, pos=cfg.block)
            kb = md.rename(md.rearrange(k, to_blocks, pos=cfg.block), blk="kblk", pos="kpos")
            vb = md.rename(md.rearrange(v, to_blocks, pos=cfg.block), blk="kblk", pos="kpos")

            def window(t):   # key blocks i-1, i, i+1 for query block i: [batch, blk, win, kpos, heads, d_head]
                move = md.roll if cfg.window == "roll" else md.shift
                parts = [md.unsqueeze(md.rename(move(t, "kblk", o), kblk="blk"), "win", 2) for o in (1, 0, -1)]
                return md.concat(parts, "win")

            def picked(t):   # the global and random key blocks: [batch, blk, nbr, kpos, heads, d_head]
                return md.einsum("batch kblk kpos heads d_head, blk nbr kblk -> batch blk nbr kpos heads d_head", t, sel)

            s_win = md.einsum("batch blk pos heads d_head, batch blk win kpos heads d_head -> batch blk heads pos win kpos",
                              qb, window(kb)) * scale
            s_win = md.where(md.greater(keep, 0.5), s_win, -1e9)
            s_sel = md.einsum("batch blk pos heads d_head, batch blk nbr kpos heads d_head -> batch blk heads pos nbr kpos",
                              qb, picked(kb)) * scale
            # one softmax over both key sets: a shared max, then the two sums
            m = md.stop_gradient(md.maximum(md.reduce_max(s_win, ["win", "kpos"]), md.reduce_max(s_sel, ["nbr", "kpos"])))
            e_win, e_sel = md.exp(s_win - m), md.exp(s_sel - m)
            denom = md.reduce_sum(e_win, ["win", "kpos"]) + md.reduce_sum(e_sel, ["nbr", "kpos"])
            o = md.einsum("batch blk heads pos win kpos, batch blk win kpos heads d_head -> batch blk pos heads d_head",
                          e_win, window(vb))
            o = o + md.einsum("batch blk heads pos nbr kpos, batch blk nbr kpos heads d_head -> batch blk pos heads d_head",
                              e_sel, picked(vb))
            return o / denom   # denom [batch, blk, heads, pos], broadcast by name

        def global_rows(q, k, v):
            """Block 0's queries against every key: [batch, blk:1, pos, heads, d_head]."""
            qg = md.rearrange(md.slice_(q, "seq", 0, cfg.block), "batch (blk pos) heads d_head -> batch blk pos heads d_head",
                              pos=cfg.block)
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            att = md.softmax(md.einsum("batch blk pos heads d_head, batch key_seq heads d_head -> batch blk heads pos key_seq",
                                       qg, k) * scale, "key_seq")
            return md.einsum("batch blk heads pos key_seq, batch key_seq heads d_head -> batch blk pos heads d_head", att, v)

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.layer_norm(x, "d_model", p["ln1"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
            k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"])
            v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"])
            sparse = md.slice_(sparse_attention(q, k, v), "blk", 1, cfg.blocks)
            o = md.concat([global_rows(q, k, v), sparse], "blk")
            o = md.rearrange(o, "batch blk pos heads d_head -> batch (blk pos) heads d_head")
            o = md.rename(o, blk_pos="seq")
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            h = md.layer_norm(x, "d_model", p["ln2"])
            f = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w1"]))
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, p["w2"])

        x = md.gather(wte, ids, "vocab") + wpe
        x = md.repeat(block, x, blocks, "layer", remat=cfg.remat)
        pooled = md.reduce_mean(md.layer_norm(x, "d_model", lnf), "seq")
        logits = md.einsum("batch d_model, d_model classes -> batch classes", pooled, head)
        loss = md.reduce_mean(md.cross_entropy(logits, target, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"ids": torch.randint(0, cfg.vocab, (cfg.batch, seq), generator=gen),
                "target": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"wte": wte, "wpe": wpe, **blocks, "lnf": lnf, "head": head}
    return md.Model(g, loss, params, feeds, cfg)
