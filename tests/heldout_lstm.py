"""A two-layer LSTM language model, written from the README and docs/ alone (a held-out model).

Legend: ``x_bsd`` [batch, seq, d_model], ``h_bd`` [batch, d_model] one step's hidden state,
``pre_bgd`` [batch, gate, d_model] one step's four gate pre-activations (input, forget, cell,
output, in that order along ``gate``).

The two layers are an ``md.repeat`` over ``layer`` (stacked weights ``w_x``, ``w_h``, ``bias``);
inside a layer the gates run over ``seq`` one step at a time. The docs offer no recurrence op,
so ``recurrence`` picks how the time steps are written:

- ``"loop"``: a Python loop, each step's input picked by ``md.slice_`` + ``md.squeeze`` and the
  hidden states joined again by ``md.concat`` over ``seq``;
- ``"repeat"``: a second ``md.repeat``, over ``seq``, nested in the layer's block: the input
  projections ``[batch, seq, gate, d_model]`` are its stacked tensor (as a fed per-layer memory
  is in ``tests/heldout_txl.py``), the carry is ``h`` and ``c`` side by side along ``hc``, and
  each step's ``h`` is a per-step output, stacked over ``seq`` (first).

The head is untied and the loss the next-token cross-entropy.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    layers: int = 2
    seq: int = 16
    batch: int = 8
    recurrence: str = "loop"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=6, layers=2, seq=5, batch=4)


def _gates(pre_bgd: md.Tensor, c_bd: md.Tensor | None) -> tuple[md.Tensor, md.Tensor]:
    """One LSTM cell update from the four gate pre-activations: the new (h, c)."""
    def gate(k: int) -> md.Tensor:
        return md.squeeze(md.slice_(pre_bgd, "gate", k, k + 1), "gate")
    i, f, g, o = md.sigmoid(gate(0)), md.sigmoid(gate(1)), md.tanh(gate(2)), md.sigmoid(gate(3))
    c_bd = i * g if c_bd is None else f * c_bd + i * g
    return o * md.tanh(c_bd), c_bd


def _layer_loop(xp_bsgd: md.Tensor, w_h: md.Tensor, seq: int) -> md.Tensor:
    h_bd = c_bd = None
    hs = []
    for t in range(seq):
        pre = md.squeeze(md.slice_(xp_bsgd, "seq", t, t + 1), "seq")
        if h_bd is not None:
            pre = pre + md.einsum("batch d_in, d_in gate d_model -> batch gate d_model",
                                  md.rename(h_bd, d_model="d_in"), w_h)
        h_bd, c_bd = _gates(pre, c_bd)
        hs.append(md.unsqueeze(h_bd, md.Dim("seq", 1), position=1))
    return md.concat(hs, "seq")


def _layer_repeat(xp_bsgd: md.Tensor, w_h: md.Tensor, hc0: md.Tensor) -> md.Tensor:
    def step(hc: md.Tensor, p: dict):
        h_bd = md.squeeze(md.slice_(hc, "hc", 0, 1), "hc")
        c_bd = md.squeeze(md.slice_(hc, "hc", 1, 2), "hc")
        pre = p["xp"] + md.einsum("batch d_in, d_in gate d_model -> batch gate d_model",
                                  md.rename(h_bd, d_model="d_in"), w_h)
        h_bd, c_bd = _gates(pre, c_bd)
        hc = md.concat([md.unsqueeze(h_bd, md.Dim("hc", 1), position=1),
                        md.unsqueeze(c_bd, md.Dim("hc", 1), position=1)], "hc")
        return hc, {"h": h_bd}

    _, per_step = md.repeat(step, hc0, {"xp": xp_bsgd}, "seq")
    return md.transpose(per_step["h"], ["batch", "seq", "d_model"])


def build(cfg: Config = Config()) -> md.Model:
    if cfg.recurrence not in ("loop", "repeat"):
        raise ValueError(f"recurrence={cfg.recurrence!r}: 'loop' or 'repeat'")
    batch, seq, layer = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("layer", cfg.layers)
    vocab, d_model, d_in = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model), md.Dim("d_in", cfg.d_model)
    gate, hc = md.Dim("gate", 4), md.Dim("hc", 2)
    with md.Graph("heldout_lstm") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.5)
        blocks = {
            "w_x": md.param("w_x", [layer, d_in, gate, d_model], fan_out=["layer", gate, d_model]),
            "w_h": md.param("w_h", [layer, d_in, gate, d_model], fan_out=["layer", gate, d_model]),
            "bias": md.param("bias", [layer, gate, d_model], scale=0.1),
        }
        head = md.param("head", [d_model, vocab], fan_out=[vocab])
        hc0 = md.constant(torch.zeros(cfg.batch, 2, cfg.d_model), [batch, hc, d_model], name="hc0")

        def block(x_bsd: md.Tensor, p: dict) -> md.Tensor:
            xp = md.einsum("batch seq d_in, d_in gate d_model -> batch seq gate d_model",
                           md.rename(x_bsd, d_model="d_in"), p["w_x"]) + p["bias"]
            if cfg.recurrence == "loop":
                return _layer_loop(xp, p["w_h"], cfg.seq)
            return _layer_repeat(xp, p["w_h"], hc0)

        x = md.repeat(block, md.gather(wte, ids, "vocab"), blocks, "layer")
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", x, head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    return md.Model(g, loss, {"wte": wte, **blocks, "head": head}, feeds, cfg, logits=logits)
