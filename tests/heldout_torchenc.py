"""A ``torch.nn.TransformerEncoder``-style sequence classifier in PyTorch's docs' letters, written
from the README and docs/ alone (a held-out model: the user's own dim names).

Dims: ``N`` (the batch), ``L`` (positions; ``S`` the keys), ``E`` (embed_dim), ``n_head``,
``hd`` (features per head), ``ffn`` (dim_feedforward), ``C`` (classes). Inputs are float
features ``src [N, L, E]`` (no embedding). ``num_layers`` post-norm encoder layers written as a
plain Python loop (``layers.{i}.*``, no ``md.repeat``), a key-padding mask fed as
``src_key_padding_mask [N, S]`` (1 pad), ReLU FFN, the masked mean over ``L`` and a linear head;
the mean cross-entropy.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    d_model: int = 64
    nhead: int = 4
    dim_feedforward: int = 256
    num_layers: int = 2
    seq: int = 32
    batch: int = 8
    classes: int = 10

    @classmethod
    def tiny(cls) -> "Config":
        return cls(d_model=8, nhead=2, dim_feedforward=12, num_layers=2, seq=6, batch=4, classes=3)


def build(cfg: Config = Config()) -> md.Model:
    hd = cfg.d_model // cfg.nhead
    N, L, E = md.Dim("N", cfg.batch), md.Dim("L", cfg.seq), md.Dim("E", cfg.d_model)
    NH, HD, F, C = md.Dim("n_head", cfg.nhead), md.Dim("hd", hd), md.Dim("ffn", cfg.dim_feedforward), \
        md.Dim("C", cfg.classes)
    params = {}

    def p(name, shape, **kw):
        params[name] = md.param(name, shape, **kw)
        return params[name]

    with md.Graph("torchenc") as g:
        src = md.input("src", [N, L, E])
        pad = md.input("src_key_padding_mask", [N, L])
        labels = md.input("labels", [N], dtype=torch.int64)
        key_bias = md.rename(pad * -1e9, L="S")
        x = src
        for i in range(cfg.num_layers):
            pre = f"layers.{i}."
            q = md.einsum("N L E, E n_head hd -> N L n_head hd", x, p(pre + "q", [E, NH, HD], fan_out=["n_head", "hd"]))
            k = md.rename(md.einsum("N L E, E n_head hd -> N L n_head hd", x, p(pre + "k", [E, NH, HD], fan_out=["n_head", "hd"])), L="S")
            v = md.rename(md.einsum("N L E, E n_head hd -> N L n_head hd", x, p(pre + "v", [E, NH, HD], fan_out=["n_head", "hd"])), L="S")
            s = md.einsum("N L n_head hd, N S n_head hd -> N n_head L S", q, k) * (hd ** -0.5) + key_bias
            o = md.einsum("N n_head L S, N S n_head hd -> N L n_head hd", md.softmax(s, "S"), v)
            a = md.einsum("N L n_head hd, n_head hd E -> N L E", o, p(pre + "out_proj", [NH, HD, E], fan_out=["E"]))
            x = md.layer_norm(x + a, "E", p(pre + "norm1", [E], init="ones"), p(pre + "norm1_b", [E], init="zeros"))
            h = md.relu(md.einsum("N L E, E ffn -> N L ffn", x, p(pre + "linear1", [E, F], fan_out=["ffn"]))
                        + p(pre + "linear1_b", [F], init="zeros"))
            f = md.einsum("N L ffn, ffn E -> N L E", h, p(pre + "linear2", [F, E], fan_out=["E"]))
            x = md.layer_norm(x + f, "E", p(pre + "norm2", [E], init="ones"), p(pre + "norm2_b", [E], init="zeros"))
        keep = 1.0 - pad
        pooled = md.reduce_sum(x * keep, "L") / md.reduce_sum(keep, "L")
        logits = md.einsum("N E, E C -> N C", pooled, p("head", [E, C], fan_out=["C"]))
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "C"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(cfg.seq // 2, cfg.seq + 1, (cfg.batch,), generator=gen)
        pad_mask = (torch.arange(cfg.seq)[None, :] >= lengths[:, None]).float()
        return {"src": torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=gen), "src_key_padding_mask": pad_mask,
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, params, feeds, cfg)
