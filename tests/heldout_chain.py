"""Two chained stacks: a "dense" stack whose output, pooled and projected, is the first carry of a
second stack (tests/test_chained_stacks.py).

The first stack (``enc_layers`` residual blocks over ``enc_layer``) reads ``[batch, seq, d_model]``;
its output is averaged over ``seq`` and projected by ``proj`` (ops outside any block, per
micro-batch) into ``[batch, d_in]``, where the second stack (``layers`` blocks over ``layer``)
starts.  The loss is the second stack's mean square plus ``aux`` times the first stack's, so the
first stack's backward gets its gradient from both: through the ops between the stacks and from
its own term.  ``whole_batch_norm`` divides the pooled features by their mean over the whole batch
(a statistic of every micro-batch, made from params: what a pipeline cannot run between the stacks).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 4
    seq: int = 3
    d_model: int = 4
    d_in: int = 6
    enc_layers: int = 2
    layers: int = 2
    aux: float = 0.5
    whole_batch_norm: bool = False

    @classmethod
    def tiny(cls) -> "Config":
        return cls()


def build(cfg: Config = Config()) -> md.Model:
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d_model, d_in = md.Dim("d_model", cfg.d_model), md.Dim("d_in", cfg.d_in)
    enc_layer, layer = md.Dim("enc_layer", cfg.enc_layers), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_chain") as g:
        x = md.input("x", [batch, seq, d_model])
        params = {
            "enc_w": md.param("enc_w", [enc_layer, d_model, md.Dim("d_hid", cfg.d_model)],
                              fan_out=["enc_layer", "d_hid"]),
            "enc_g": md.param("enc_g", [enc_layer, d_model], init="ones"),
            "proj": md.param("proj", [d_model, d_in], fan_out=["d_in"]),
            "w": md.param("w", [layer, d_in, md.Dim("d_out", cfg.d_in)], fan_out=["layer", "d_out"]),
        }

        def enc_block(h, p):
            a = md.rename(md.einsum("batch seq d_model, d_model d_hid -> batch seq d_hid", h, p["w"]), d_hid="d_model")
            return h + md.tanh(a) * p["g"]

        def block(h, p):
            return h + md.tanh(md.rename(md.einsum("batch d_in, d_in d_out -> batch d_out", h, p["w"]), d_out="d_in"))

        h = md.repeat(enc_block, x, {"w": params["enc_w"], "g": params["enc_g"]}, "enc_layer")
        pooled = md.reduce_mean(h, "seq")                                  # between the stacks, per micro-batch
        if cfg.whole_batch_norm:
            pooled = pooled / md.reduce_mean(pooled * pooled)              # a statistic of the whole batch
        start = md.tanh(md.einsum("batch d_model, d_model d_in -> batch d_in", pooled, params["proj"]))
        y = md.repeat(block, start, {"w": params["w"]}, "layer")
        main, aux = md.reduce_mean(y * y), md.reduce_mean(h * h)
        loss = main + cfg.aux * aux

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=gen)}

    return md.Model(g, loss, params, feeds, cfg, outputs={"main": main, "aux": aux})
