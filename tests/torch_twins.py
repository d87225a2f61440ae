"""Plain-torch twins of the shipped models: the oracle of ``tests/test_model_twins.py``.

A twin is a model written a second time in ordinary torch (``nn.Module``,
``torch.nn.functional``, torch autograd), from the model file's docstring and math,
never from meshdsl's ops or gradient rules.  It holds copies of the DSL's params under
their DSL names and shapes, so its autograd gradients compare with the DSL's ``grad/<name>``
outputs as they are.  Where the two would have to agree on randomness (dropout), the
twin rebuilds the mask from its documented definition (:func:`dropout_keep`).

Adding a model (a Llama, a ViT): write a :class:`Twin` subclass whose ``forward(feeds)``
returns ``{"loss": ..., <Model.outputs or Model.metrics name>: ...}``, and add it to ``TWINS`` under the
model's name with the ``Config`` overrides worth checking (``{}`` is ``Config.tiny()``).
``test_every_shipped_model_has_a_twin`` fails until a new model file has one.

Legend (as in the model files): b batch, s seq, k key_seq, d d_model, h heads,
e d_head, f d_ff, v vocab, x experts; the ViT's own: y height, x width, c channels, n patches,
m key_patches, k classes.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Twin(nn.Module):
    """A model's plain-torch twin: params by their DSL names; a subclass defines
    ``forward(feeds) -> {"loss": ..., <Model.outputs name>: ...}``."""

    STACKED: tuple[str, ...] = ()  # params stacked along the model's ``layer`` dim

    def __init__(self, cfg, params: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.p = nn.ParameterDict({k: nn.Parameter(v.detach().clone()) for k, v in params.items()})

    def layer(self, l: int) -> dict[str, torch.Tensor]:
        """Layer ``l``'s slice of every param stacked along ``layer`` (the names in ``STACKED``)."""
        return {k: self.p[k][l] for k in self.STACKED if k in self.p}

    def grads(self) -> dict[str, torch.Tensor]:
        """Each param's gradient after ``backward`` (zeros for a param the loss never reached)."""
        return {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in self.p.items()}


# ----------------------------------------------------------------------------- shared pieces
# Written from their definitions in elementary torch ops, so that autograd differentiates
# them term by term: ``F.layer_norm``, ``F.gelu`` or ``F.cross_entropy`` would run the very
# backward kernels (``native_layer_norm_backward``, ``gelu_backward``) some DSL rules call.

def layer_norm(x, scale, bias, eps: float = 1e-5):
    """Over the last dim: ``(x - mean) / sqrt(var + eps) * scale + bias`` (biased variance)."""
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.square().mean(-1, keepdim=True) + eps) * scale + bias


def rms_norm(x, scale, eps: float = 1e-6):
    """Over the last dim: ``x / sqrt(mean(x^2) + eps) * scale``."""
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * scale


def gelu(x):
    """The exact gelu, ``x * Phi(x)``."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def softmax(x, dim: int = -1):
    e = torch.exp(x - x.max(dim, keepdim=True).values.detach())
    return e / e.sum(dim, keepdim=True)


def dropout_keep(shape: tuple[int, ...], rate: float, seed: int, layer: int | None) -> torch.Tensor:
    """The keep mask of ``md.dropout(x, rate, seed)`` for a tensor of ``shape`` (its dims in
    the DSL tensor's order).

    The DSL's contract: element ``i`` (row-major index over the full shape) is kept when
    ``hash32(i, seed') / 2**32 >= rate`` in float32, where ``seed' = seed + 1000003 * salt``
    and the salt is ``layer + 1`` inside a ``repeat`` (0 outside), hash32 being the
    xor-shift-multiply finaliser below.
    """
    salt = 0 if layer is None else layer + 1
    seed = seed + 1000003 * salt
    mask32 = 0xFFFFFFFF
    index = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    h = (index ^ ((seed * 0x9E3779B1 + 0x7F4A7C15) & mask32)) & mask32
    for _ in range(2):
        h = (((h >> 16) ^ h) * 0x45D9F3B) & mask32
    h = ((h >> 16) ^ h) & mask32
    uniform = (h.to(torch.float64) / 2.0 ** 32).to(torch.float32)
    return uniform >= rate


def dropout(x: torch.Tensor, rate: float, seed: int, layer: int | None = None) -> torch.Tensor:
    """Inverted dropout with the DSL's mask: kept elements scaled by 1/(1-rate)."""
    if not rate:
        return x
    return x * dropout_keep(tuple(x.shape), rate, seed, layer).to(x.dtype) / (1.0 - rate)


def causal_attention(z_bsd, wq_dhe, wk_dhe, wv_dhe, wo_hed, rate: float = 0.0, layer: int | None = None):
    """Causal multi-head attention, nanoGPT-style: the probabilities are written out
    [b, h, s, k], optionally dropped (seed 1, the transformer's), then mixed into the values."""
    b, s, d = z_bsd.shape
    _, h, e = wq_dhe.shape
    q_bhse, k_bhke, v_bhke = ((z_bsd @ w.reshape(d, h * e)).view(b, s, h, e).transpose(1, 2)
                              for w in (wq_dhe, wk_dhe, wv_dhe))
    scores_bhsk = (q_bhse @ k_bhke.transpose(-2, -1)) / math.sqrt(e)
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs_bhsk = softmax(scores_bhsk.masked_fill(future, float("-inf")))
    probs_bhsk = dropout(probs_bhsk, rate, seed=1, layer=layer)
    y_bsd = (probs_bhsk @ v_bhke).transpose(1, 2).reshape(b, s, h * e)
    return y_bsd @ wo_hed.reshape(h * e, d)


def next_token_loss(x_bsd, head_vd, labels_bs):
    """Mean cross-entropy of the next token over every position: ``logsumexp - logit[label]``."""
    logits_bsv = x_bsd @ head_vd.T
    top_bs1 = logits_bsv.max(-1, keepdim=True).values.detach()
    logsumexp_bs = torch.log(torch.exp(logits_bsv - top_bs1).sum(-1)) + top_bs1.squeeze(-1)
    return (logsumexp_bs - logits_bsv.gather(-1, labels_bs.unsqueeze(-1)).squeeze(-1)).mean()


# ----------------------------------------------------------------------------- models/mlp.py

class MlpTwin(Twin):
    """``mean((relu(x @ w1) @ w2 - target) ** 2)``."""

    def forward(self, feeds):
        y = torch.relu(feeds["x"] @ self.p["w1"]) @ self.p["w2"]
        return {"loss": F.mse_loss(y, feeds["target"])}


# ----------------------------------------------------------------------------- models/transformer.py

class TransformerTwin(Twin):
    """GPT: embeddings, pre-norm blocks (attention, gelu MLP), final norm, LM head
    (``wte`` itself when tied); LayerNorm with bias (eps 1e-5) or RMSNorm (eps 1e-6); dropout
    after the embeddings (seed 0), on the attention probabilities (1) and on each residual
    branch (2: attention, 3: MLP)."""

    STACKED = ("ln1", "ln1_b", "wq", "wk", "wv", "wo", "ln2", "ln2_b", "w_fc", "w_proj")

    def norm(self, x_bsd, scale, bias):
        return rms_norm(x_bsd, scale) if self.cfg.norm == "rms" else layer_norm(x_bsd, scale, bias)

    def block(self, x_bsd, l: int):
        """Layer ``l``: its slice of each stacked param (a bias only with LayerNorm)."""
        rate = self.cfg.dropout
        w = self.layer(l)
        z_bsd = self.norm(x_bsd, w["ln1"], w.get("ln1_b"))
        attn = causal_attention(z_bsd, w["wq"], w["wk"], w["wv"], w["wo"], rate, l)
        x_bsd = x_bsd + dropout(attn, rate, seed=2, layer=l)
        z_bsd = self.norm(x_bsd, w["ln2"], w.get("ln2_b"))
        mlp = gelu(z_bsd @ w["w_fc"]) @ w["w_proj"]
        return x_bsd + dropout(mlp, rate, seed=3, layer=l)

    def forward(self, feeds):
        cfg = self.cfg
        x_bsd = dropout(F.embedding(feeds["ids"], self.p["wte"]) + self.p["wpe"], cfg.dropout, seed=0)
        for l in range(cfg.layers):
            x_bsd = self.block(x_bsd, l)
        x_bsd = self.norm(x_bsd, self.p["lnf"], self.p.get("lnf_b"))
        head = self.p["wte"] if cfg.tied else self.p["lm_head"]
        return {"loss": next_token_loss(x_bsd, head, feeds["labels"])}


# ----------------------------------------------------------------------------- models/moe.py

def route(probs_bsx: torch.Tensor, top_k: int, capacity: int) -> tuple[torch.Tensor, int]:
    """Routing weights [b, s, x] (a token's gate for each expert that kept it, else 0) and the
    number of routings dropped.

    Per sequence, an expert takes tokens first come, first served: every first choice in
    position order, then every second choice; a routing past ``capacity`` is dropped.
    Top-2 gates are the two probabilities renormalised to sum to 1.
    """
    top_p, top_x = probs_bsx.topk(top_k, dim=-1)
    gates = top_p / top_p.sum(-1, keepdim=True) if top_k == 2 else top_p
    num_b, num_s, num_x = probs_bsx.shape
    kept = torch.zeros(num_b, num_s, top_k, dtype=torch.bool)
    for b in range(num_b):
        taken = [0] * num_x
        for choice in range(top_k):
            for s in range(num_s):
                x = int(top_x[b, s, choice])
                if taken[x] < capacity:
                    taken[x] += 1
                    kept[b, s, choice] = True
    chosen = F.one_hot(top_x, num_x).to(probs_bsx.dtype)                      # [b, s, choice, x]
    weights_bsx = (chosen * (gates * kept.to(gates.dtype)).unsqueeze(-1)).sum(2)
    return weights_bsx, int((~kept).sum())


class MoeTwin(Twin):
    """The MoE transformer: pre-norm attention, then a routed mixture of gelu experts.

    Every expert runs on every token here, and the routing weights pick the outputs: a
    routing that was not made (or was dropped) has weight 0, which zeroes its value and its
    gradient alike, so this computes what the DSL's dispatch-to-capacity-slots program
    computes without slots.
    """

    STACKED = ("ln1", "ln1_b", "wq", "wk", "wv", "wo", "ln2", "ln2_b", "w_gate", "w_in", "w_out")

    def moe(self, z_bsd, w: dict[str, torch.Tensor]):
        """The routed MLP with one layer's params ``w``: ``(y_bsd, aux, dropped)``."""
        cfg = self.cfg
        probs_bsx = softmax(z_bsd @ w["w_gate"])
        weights_bsx, dropped = route(probs_bsx, cfg.top_k, cfg.capacity)
        h_bsxf = gelu(torch.einsum("bsd,xdf->bsxf", z_bsd, w["w_in"]))
        y_bsxd = torch.einsum("bsxf,xfd->bsxd", h_bsxf, w["w_out"])
        y_bsd = (weights_bsx.unsqueeze(-1) * y_bsxd).sum(2)
        # Balance loss per sequence: experts * sum_x(first-choice fraction * mean probability).
        first_bsx = F.one_hot(probs_bsx.argmax(-1), cfg.experts).to(probs_bsx.dtype)
        aux = cfg.experts * (first_bsx.mean(1) * probs_bsx.mean(1)).sum(-1).mean()
        return y_bsd, aux, dropped

    def forward(self, feeds):
        cfg, p = self.cfg, self.p
        x_bsd = F.embedding(feeds["ids"], p["wte"]) + p["wpe"]
        aux_total, out = 0.0, {}
        for l in range(cfg.layers):
            w = self.layer(l)
            z_bsd = layer_norm(x_bsd, w["ln1"], w["ln1_b"])
            x_bsd = x_bsd + causal_attention(z_bsd, w["wq"], w["wk"], w["wv"], w["wo"])
            z_bsd = layer_norm(x_bsd, w["ln2"], w["ln2_b"])
            y_bsd, aux, dropped = self.moe(z_bsd, w)
            x_bsd = x_bsd + y_bsd
            aux_total = aux_total + aux
            out[f"moe/dropped/{l}"] = torch.tensor(dropped)
        x_bsd = layer_norm(x_bsd, p["lnf"], p["lnf_b"])
        loss = next_token_loss(x_bsd, p["lm_head"], feeds["labels"]) + cfg.aux_loss_weight * aux_total
        out["moe/dropped"] = torch.tensor(sum(int(v) for v in out.values()))
        return {"loss": loss, "moe/aux_loss": aux_total, **out}


# ----------------------------------------------------------------------------- models/vit.py

def self_attention(z_bnd, wq_dhe, wk_dhe, wv_dhe, wo_hed):
    """Non-causal multi-head attention: every position attends to every position."""
    b, n, d = z_bnd.shape
    _, h, e = wq_dhe.shape
    q_bhne, k_bhme, v_bhme = ((z_bnd @ w.reshape(d, h * e)).view(b, n, h, e).transpose(1, 2)
                              for w in (wq_dhe, wk_dhe, wv_dhe))
    probs_bhnm = softmax((q_bhne @ k_bhme.transpose(-2, -1)) / math.sqrt(e))
    y_bnd = (probs_bhnm @ v_bhme).transpose(1, 2).reshape(b, n, h * e)
    return y_bnd @ wo_hed.reshape(h * e, d)


class VitTwin(Twin):
    """The ViT: patches of ``patch x patch`` pixels in row-major patch order, each flattened
    as (row in patch, column in patch, channel); patch embedding with a bias plus position
    embeddings; pre-norm encoder blocks (LayerNorm eps 1e-5, attention, gelu MLP); final
    LayerNorm, mean over patches, linear head; mean cross-entropy over classes, and the
    accuracy (the label's logit is the largest)."""

    STACKED = ("ln1", "ln1_b", "wq", "wk", "wv", "wo", "ln2", "ln2_b", "w_fc", "w_proj")

    def patches(self, images_byxc):
        """[b, height, width, c] -> [b, patches, patch_feat]."""
        b, height, width, c = images_byxc.shape
        ps = self.cfg.patch
        grid = images_byxc.view(b, height // ps, ps, width // ps, ps, c).permute(0, 1, 3, 2, 4, 5)
        return grid.reshape(b, (height // ps) * (width // ps), ps * ps * c)

    def forward(self, feeds):
        p = self.p
        x_bnd = self.patches(feeds["images"]) @ p["w_patch"] + p["b_patch"] + p["pos"]
        for l in range(self.cfg.layers):
            w = self.layer(l)
            z_bnd = layer_norm(x_bnd, w["ln1"], w["ln1_b"])
            x_bnd = x_bnd + self_attention(z_bnd, w["wq"], w["wk"], w["wv"], w["wo"])
            z_bnd = layer_norm(x_bnd, w["ln2"], w["ln2_b"])
            x_bnd = x_bnd + gelu(z_bnd @ w["w_fc"]) @ w["w_proj"]
        logits_bk = layer_norm(x_bnd, p["lnf"], p["lnf_b"]).mean(1) @ p["w_head"]
        labels_b = feeds["labels"]
        top_b1 = logits_bk.max(-1, keepdim=True).values.detach()
        logsumexp_b = torch.log(torch.exp(logits_bk - top_b1).sum(-1)) + top_b1.squeeze(-1)
        label_logit_b = logits_bk.gather(-1, labels_b.unsqueeze(-1)).squeeze(-1)
        accuracy = (label_logit_b >= logits_bk.max(-1).values).to(logits_bk.dtype).mean()
        return {"loss": (logsumexp_b - label_logit_b).mean(), "accuracy": accuracy}


# ----------------------------------------------------------------------------- models/llama.py

def rotate_half(x_bhse, theta: float):
    """Rotary position embedding of [b, heads, s, e] in the rotate-half form: features ``i`` and
    ``i + e/2`` turned by the angle ``position * theta ** (-2i / e)``."""
    num_s, num_e = x_bhse.shape[-2:]
    inv_freq = 1.0 / theta ** (torch.arange(0, num_e, 2, dtype=torch.float64) / num_e)
    angles_se = torch.outer(torch.arange(num_s, dtype=torch.float64), inv_freq).repeat(1, 2).to(x_bhse.dtype)
    x1, x2 = x_bhse[..., : num_e // 2], x_bhse[..., num_e // 2:]
    return x_bhse * angles_se.cos() + torch.cat((-x2, x1), dim=-1) * angles_se.sin()


class LlamaTwin(Twin):
    """Llama: token embedding, pre-norm blocks (RMSNorm; causal grouped-query attention with
    rotary q and k, each key/value head repeated for the ``group`` query heads it serves;
    RMSNorm; SwiGLU MLP), final RMSNorm, untied LM head."""

    STACKED = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")

    def attention(self, z_bsd, w):
        cfg = self.cfg
        num_b, num_s, num_d = z_bsd.shape
        num_q, e = cfg.kv_heads * cfg.group, cfg.d_head
        q_bhse = (z_bsd @ w["wq"].reshape(num_d, num_q * e)).view(num_b, num_s, num_q, e).transpose(1, 2)
        k_bnse, v_bnse = ((z_bsd @ w[n].reshape(num_d, cfg.kv_heads * e)).view(num_b, num_s, cfg.kv_heads, e)
                          .transpose(1, 2) for n in ("wk", "wv"))
        q_bhse, k_bnse = rotate_half(q_bhse, cfg.rope_theta), rotate_half(k_bnse, cfg.rope_theta)
        # query head h = kv_head * group + g reads key/value head h // group
        k_bhse, v_bhse = (t.repeat_interleave(cfg.group, dim=1) for t in (k_bnse, v_bnse))
        scores_bhsk = (q_bhse @ k_bhse.transpose(-2, -1)) / math.sqrt(e)
        future = torch.ones(num_s, num_s, dtype=torch.bool).triu(1)
        y_bhse = softmax(scores_bhsk.masked_fill(future, float("-inf"))) @ v_bhse
        return y_bhse.transpose(1, 2).reshape(num_b, num_s, num_q * e) @ w["wo"].reshape(num_q * e, num_d)

    def forward(self, feeds):
        cfg, p = self.cfg, self.p
        x_bsd = F.embedding(feeds["ids"], p["tok_emb"])
        for l in range(cfg.layers):
            w = self.layer(l)
            x_bsd = x_bsd + self.attention(rms_norm(x_bsd, w["attn_norm"], cfg.norm_eps), w)
            z_bsd = rms_norm(x_bsd, w["mlp_norm"], cfg.norm_eps)
            gate_bsf = z_bsd @ w["w_gate"]
            x_bsd = x_bsd + (gate_bsf / (1.0 + torch.exp(-gate_bsf)) * (z_bsd @ w["w_up"])) @ w["w_down"]
        x_bsd = rms_norm(x_bsd, p["norm"], cfg.norm_eps)
        return {"loss": next_token_loss(x_bsd, p["lm_head"], feeds["labels"])}


# ----------------------------------------------------------------------------- the table

#: model name -> (twin class, the Config overrides checked: {} is Config.tiny())
TWINS: dict[str, tuple[type[Twin], dict[str, dict]]] = {
    "mlp": (MlpTwin, {"tiny": {}, "small": {"batch": 16, "d_model": 32, "d_ff": 64}}),
    "transformer": (TransformerTwin, {
        "tiny": {},
        "rms": {"norm": "rms"},
        "tied": {"tied": True},
        "dropout": {"dropout": 0.1},
        "rms+tied+dropout": {"norm": "rms", "tied": True, "dropout": 0.2},
        "small": {"vocab": 64, "d_model": 32, "heads": 4, "d_head": 8, "d_ff": 64, "layers": 3, "seq": 16,
                  "batch": 4},
    }),
    "moe": (MoeTwin, {"top2": {}, "top1": {"top_k": 1}, "top1-tight": {"top_k": 1, "capacity_factor": 0.5}}),
    "llama": (LlamaTwin, {
        "tiny": {},
        "multi-query": {"kv_heads": 1, "group": 4},
        "small": {"vocab": 64, "d_model": 32, "kv_heads": 2, "group": 3, "d_head": 8, "d_ff": 48, "layers": 3,
                  "seq": 16, "batch": 4, "rope_theta": 100.0},
    }),
    "vit": (VitTwin, {"tiny": {}, "small": {"size": 12, "channels": 2, "patch": 3, "d_model": 16, "heads": 2,
                                            "d_head": 8, "d_ff": 32, "layers": 3, "classes": 3}}),
}
