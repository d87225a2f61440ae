"""A tiny grouped-query-attention model: its key/value heads are a dim no search knows by name.

Legend: b batch, s seq (k: key_seq, the key positions), d d_model, n kv_heads (key/value
heads), g group (query heads per key/value head), e d_head, f d_ff, l layer.

Each of ``layers`` blocks (under ``md.repeat``) runs grouped-query attention (no mask),
queries ``[b s n g e]`` against keys and values ``[b k n e]`` shared by each group, then a
relu MLP; the loss is the mean squared error against a random target.  Loaded by path
(``md.load_model(PATH)``, ``meshdsl search PATH``) in tests/test_dims.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md
from meshdsl import Model


@dataclass(frozen=True)
class Config:
    batch: int = 4
    seq: int = 4
    d_model: int = 8
    kv_heads: int = 4
    group: int = 2
    d_head: int = 2
    d_ff: int = 16
    layers: int = 2

    @classmethod
    def tiny(cls) -> "Config":
        return cls()


def block(x_bsd, p):
    """One layer: grouped-query attention, then an MLP, each added to the residual."""
    q_bsnge = md.einsum("batch seq d_model, d_model kv_heads group d_head -> batch seq kv_heads group d_head",
                        x_bsd, p["wq"])
    kv = "batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head"
    k_bkne = md.rename(md.einsum(kv, x_bsd, p["wk"]), seq="key_seq")
    v_bkne = md.rename(md.einsum(kv, x_bsd, p["wv"]), seq="key_seq")
    att_bngsk = md.softmax(md.einsum("batch seq kv_heads group d_head, batch key_seq kv_heads d_head "
                                     "-> batch kv_heads group seq key_seq", q_bsnge, k_bkne), "key_seq")
    y_bsnge = md.einsum("batch kv_heads group seq key_seq, batch key_seq kv_heads d_head "
                        "-> batch seq kv_heads group d_head", att_bngsk, v_bkne)
    x_bsd = x_bsd + md.einsum("batch seq kv_heads group d_head, kv_heads group d_head d_model "
                              "-> batch seq d_model", y_bsnge, p["wo"])
    h_bsf = md.relu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", x_bsd, p["w_fc"]))
    return x_bsd + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", h_bsf, p["w_proj"])


def build(cfg: Config = Config()) -> Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    n, g, e = md.Dim("kv_heads", cfg.kv_heads), md.Dim("group", cfg.group), md.Dim("d_head", cfg.d_head)
    f, l = md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    with md.Graph("gqa") as graph:
        x_bsd = md.input("x", [b, s, d])
        target_bsd = md.input("target", [b, s, d])
        params = {"wq": md.param("wq", [l, d, n, g, e], fan_out=[l, n, g, e]),
                  "wk": md.param("wk", [l, d, n, e], fan_out=[l, n, e]),
                  "wv": md.param("wv", [l, d, n, e], fan_out=[l, n, e]),
                  "wo": md.param("wo", [l, n, g, e, d], fan_out=[l, d]),
                  "w_fc": md.param("w_fc", [l, d, f], fan_out=[l, f]),
                  "w_proj": md.param("w_proj", [l, f, d], fan_out=[l, d])}
        y_bsd = md.repeat(block, x_bsd, params, l)
        loss = md.reduce_mean((y_bsd - target_bsd) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=gen),
                "target": torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=gen)}

    return Model(graph, loss, params, feeds, cfg)
