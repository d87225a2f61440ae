"""A Neural Turing Machine-lite (Graves et al.), a held-out model written from the docs alone: an
MLP controller stepping over time with one head that reads and writes an external memory.

Each time step: the controller ``h = tanh(W_x x_t + W_h h + W_r r)``; the head's key, sharpness
``beta = softplus(.)``, erase and add vectors; content addressing ``w = softmax(beta * cos(key,
M_i))`` over the memory's slots; the write ``M <- M * (1 - w e) + w a``; the read ``r = sum_i w_i
M_i``; the output ``y_t = W_o [h, r]``. The memory starts from a learned ``[slots, width]``
table. The loss is the mean squared error of every step's output against its target.

Forms (``--config form=...``):
  repeat:   the steps under ``md.repeat`` over ``time``, the per-step inputs as its stacked tensor,
            the carry the controller state, the read vector and the flattened memory joined by
            ``md.concat`` along ``state`` (sliced apart in the block), each step's output a
            per-step output of the repeat; the weights are shared by every step.
  unrolled: the same steps as a Python loop.

Legend: b batch, t time, i d_in, h hidden, s slots, w width, o d_out.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 16
    time: int = 8
    d_in: int = 8
    hidden: int = 32
    slots: int = 8
    width: int = 8
    d_out: int = 8
    form: str = "repeat"
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(batch=4, time=4, d_in=3, hidden=8, slots=4, width=4, d_out=3)


def ntm_step(x, h, r, mem, p):
    """One step from x [batch, d_in], h [batch, hidden], r [batch, width], mem [batch, slots, width]:
    the new (h, r, mem) and the step's output [batch, d_out]."""
    h = md.tanh(md.einsum("batch d_in, d_in hidden -> batch hidden", x, p["w_x"])
                + md.rename(md.einsum("batch hidden, hidden hidden2 -> batch hidden2", h, p["w_h"]), hidden2="hidden")
                + md.einsum("batch width, width hidden -> batch hidden", r, p["w_r"]))
    head = md.einsum("batch hidden, hidden part width -> batch part width", h, p["w_head"])
    key = md.squeeze(md.slice_(head, "part", 0, 1), "part")
    erase = md.sigmoid(md.squeeze(md.slice_(head, "part", 1, 2), "part"))
    add = md.tanh(md.squeeze(md.slice_(head, "part", 2, 3), "part"))
    beta = md.softplus(md.einsum("batch hidden, hidden -> batch", h, p["w_beta"]))
    dot = md.einsum("batch width, batch slots width -> batch slots", key, mem)
    norms = md.sqrt(md.reduce_sum(key * key, "width")) * md.sqrt(md.reduce_sum(mem * mem, "width"))
    w = md.softmax(beta * dot / (norms + 1e-6), "slots")
    mem = mem * (1.0 - w * erase) + w * add
    r = md.einsum("batch slots, batch slots width -> batch width", w, mem)
    y = (md.einsum("batch hidden, hidden d_out -> batch d_out", h, p["w_oh"])
         + md.einsum("batch width, width d_out -> batch d_out", r, p["w_or"]))
    return h, r, mem, y


def _run_repeat(xs, h0, r0, mem0, p, cfg):
    H, W, S = cfg.hidden, cfg.width, cfg.slots
    flat = md.rearrange(mem0, "batch slots width -> batch (slots width)")
    state = md.concat([md.rename(h0, hidden="state"), md.rename(r0, width="state"),
                       md.rename(flat, slots_width="state")], "state")

    def block(s, step):
        h = md.rename(md.slice_(s, "state", 0, H), state="hidden")
        r = md.rename(md.slice_(s, "state", H, H + W), state="width")
        mem = md.rearrange(md.rename(md.slice_(s, "state", H + W, H + W + S * W), state="slots_width"),
                           "batch (slots width) -> batch slots width", slots=S)
        h, r, mem, y = ntm_step(step["x"], h, r, mem, p)
        flat = md.rearrange(mem, "batch slots width -> batch (slots width)")
        new = md.concat([md.rename(h, hidden="state"), md.rename(r, width="state"),
                         md.rename(flat, slots_width="state")], "state")
        return new, {"y": y}

    _, per_step = md.repeat(block, state, {"x": xs}, "time", remat=cfg.remat)
    return per_step["y"]                                              # [time, batch, d_out]


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("repeat", "unrolled"):
        raise md.ModelError(f"ntm: form={cfg.form!r}; expected 'repeat' or 'unrolled'")
    B, T, I = md.Dim("batch", cfg.batch), md.Dim("time", cfg.time), md.Dim("d_in", cfg.d_in)
    H, H2, S = md.Dim("hidden", cfg.hidden), md.Dim("hidden2", cfg.hidden), md.Dim("slots", cfg.slots)
    W, O, P = md.Dim("width", cfg.width), md.Dim("d_out", cfg.d_out), md.Dim("part", 3)
    with md.Graph() as g:
        xs = md.input("x", [T, B, I])
        target = md.input("target", [T, B, O])
        p = {
            "w_x": md.param("w_x", [I, H], fan_out=["hidden"]),
            "w_h": md.param("w_h", [H, H2], fan_out=["hidden2"]),
            "w_r": md.param("w_r", [W, H], fan_out=["hidden"]),
            "w_head": md.param("w_head", [H, P, W], fan_out=["part", "width"]),
            "w_beta": md.param("w_beta", [H]),
            "w_oh": md.param("w_oh", [H, O], fan_out=["d_out"]),
            "w_or": md.param("w_or", [W, O], fan_out=["d_out"]),
            "mem0": md.param("mem0", [S, W], scale=0.5),
        }
        h0 = md.broadcast_to(md.constant(0.0), [B, H])
        r0 = md.broadcast_to(md.constant(0.0), [B, W])
        mem0 = md.broadcast_to(p["mem0"], [B, S, W])
        if cfg.form == "repeat":
            ys = _run_repeat(xs, h0, r0, mem0, p, cfg)
            loss = md.reduce_mean((ys - target) ** 2)
        else:
            h, r, mem, sq = h0, r0, mem0, []
            for t in range(cfg.time):
                h, r, mem, y = ntm_step(md.squeeze(md.slice_(xs, "time", t, t + 1), "time"), h, r, mem, p)
                sq.append(md.reduce_mean((y - md.squeeze(md.slice_(target, "time", t, t + 1), "time")) ** 2))
            loss = sum(sq[1:], sq[0]) * (1.0 / cfg.time)

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.time, cfg.batch, cfg.d_in, generator=gen),
                "target": torch.randn(cfg.time, cfg.batch, cfg.d_out, generator=gen)}

    return md.Model(g, loss, p, make_feeds, cfg)
