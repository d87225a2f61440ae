"""A GPT in nanoGPT's letters, written from the README and docs/ alone (a held-out model: the
user's own dim names).

Dims: ``B`` (examples), ``T`` (positions, ``Tk`` the keys), ``C`` (the residual width,
``n_embd``), ``nh`` (heads), ``hs`` (head size), ``F`` (the MLP's 4C), ``V`` (vocab), ``L``
(the layer stack of ``md.repeat``). Pre-norm LayerNorm blocks, causal fused attention, a GELU
MLP, learned positions, the head tied to the token embedding, the mean cross-entropy.

``usual_names=True`` builds the same graph under the README's names (``batch``, ``seq``,
``d_model``, ``heads``, ...): the layout search must rank both alike (tests/test_heldout_round9c.py).
"""
import re
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    batch_size: int = 8
    usual_names: bool = False

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab_size=24, block_size=8, n_layer=2, n_head=2, n_embd=8, batch_size=4)


#: nanoGPT's letters -> the README's names (``usual_names=True``).
USUAL = {"B": "batch", "T": "seq", "Tk": "key_seq", "C": "d_model", "nh": "heads", "hs": "d_head", "F": "d_ff",
         "V": "vocab", "L": "layer"}


def build(cfg: Config = Config()) -> md.Model:
    names = USUAL if cfg.usual_names else {}
    n = lambda text: re.sub(r"\w+", lambda m: names.get(m.group(), m.group()), text)   # a letter's name
    B, T, C = md.Dim(n("B"), cfg.batch_size), md.Dim(n("T"), cfg.block_size), md.Dim(n("C"), cfg.n_embd)
    nh, hs = md.Dim(n("nh"), cfg.n_head), md.Dim(n("hs"), cfg.n_embd // cfg.n_head)
    F, V, L = md.Dim(n("F"), 4 * cfg.n_embd), md.Dim(n("V"), cfg.vocab_size), md.Dim(n("L"), cfg.n_layer)
    with md.Graph("nanogpt") as g:
        idx = md.input("idx", [B, T], dtype=torch.int64)
        targets = md.input("targets", [B, T], dtype=torch.int64)
        wte = md.param("wte", [V, C], scale=0.02)
        wpe = md.param("wpe", [T, C], scale=0.02)
        blocks = {
            "ln_1": md.param("ln_1", [L, C], init="ones"), "ln_2": md.param("ln_2", [L, C], init="ones"),
            "c_attn_q": md.param("c_attn_q", [L, C, nh, hs], fan_out=[n("L"), n("nh"), n("hs")]),
            "c_attn_k": md.param("c_attn_k", [L, C, nh, hs], fan_out=[n("L"), n("nh"), n("hs")]),
            "c_attn_v": md.param("c_attn_v", [L, C, nh, hs], fan_out=[n("L"), n("nh"), n("hs")]),
            "c_proj": md.param("c_proj", [L, nh, hs, C], fan_out=[n("L"), n("C")]),
            "c_fc": md.param("c_fc", [L, C, F], fan_out=[n("L"), n("F")]),
            "mlp_proj": md.param("mlp_proj", [L, F, C], fan_out=[n("L"), n("C")]),
        }
        ln_f = md.param("ln_f", [C], init="ones")

        def block(x, p):
            a = md.layer_norm(x, n("C"), p["ln_1"])
            q = md.einsum(n("B T C, C nh hs -> B T nh hs"), a, p["c_attn_q"])
            k = md.rename(md.einsum(n("B T C, C nh hs -> B T nh hs"), a, p["c_attn_k"]), **{n("T"): n("Tk")})
            v = md.rename(md.einsum(n("B T C, C nh hs -> B T nh hs"), a, p["c_attn_v"]), **{n("T"): n("Tk")})
            y = md.attention(q, k, v, n("T"), n("Tk"), n("hs"), causal=True)
            x = x + md.einsum(n("B T nh hs, nh hs C -> B T C"), y, p["c_proj"])
            m = md.gelu(md.einsum(n("B T C, C F -> B T F"), md.layer_norm(x, n("C"), p["ln_2"]), p["c_fc"]))
            return x + md.einsum(n("B T F, F C -> B T C"), m, p["mlp_proj"])

        x = md.gather(wte, idx, n("V")) + wpe
        x = md.layer_norm(md.repeat(block, x, blocks, n("L")), n("C"), ln_f)
        logits = md.einsum(n("B T C, V C -> B T V"), x, wte)
        loss = md.reduce_mean(md.cross_entropy(logits, targets, n("V")))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size + 1), generator=gen)
        return {"idx": toks[:, :-1], "targets": toks[:, 1:]}

    return md.Model(g, loss, {"wte": wte, "wpe": wpe, **blocks, "ln_f": ln_f}, feeds, cfg, logits=logits)
