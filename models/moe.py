"""A decoder-only transformer whose MLP is a routed mixture of experts (Switch / GShard style).

Dims (the legend for tensor names below, e.g. ``x_bsd`` = [batch, seq, d_model]):
  b  batch         sequences in the batch; each sequence is one routing *group*
  s  seq           positions (a group's tokens)
  k  key_seq       key positions of attention
  d  d_model       residual stream width
  h  heads         attention heads
  e  d_head        features per head
  v  vocab         token ids
  l  layer         blocks (params stacked along it)
  g  gate_experts  the experts as the router sees them: never laid out
  x  experts       the experts as the expert weights hold them: ``experts:AXIS`` is expert parallelism
  n  expert_batch  the batch as the experts see it (the dispatched tokens' batch dim)
  c  capacity      slots per expert per group
  f  d_ff          expert hidden width

Each block: pre-norm causal attention, then a pre-norm MoE MLP.  The router
picks the top ``top_k`` (1 or 2) experts of every token; the second choice
excludes the first, and top-2 gates are renormalised to sum to 1.  Each expert
takes at most ``capacity = ceil(capacity_factor * seq * top_k / experts)``
tokens of a group (a sequence), first-choice routings before second-choice
ones, in position order: a ``cumsum`` over ``seq`` gives each token its place
in its expert's queue.  A routing past capacity is dropped: it dispatches
nothing and its output is 0, so the residual passes the token through.
Because a group is one sequence, capacity and drops do not depend on the layout.

The expert-parallel move is a rename, as in Mesh-TensorFlow's MoE layer.  The
gate tensors name the experts ``gate_experts``, a dim no layout rule names, so
with ``"batch:data; experts:data"`` they stay split by ``batch`` only.  The
dispatched tokens [gate_experts, batch, capacity, d_model] are renamed to
[experts, expert_batch, capacity, d_model] in one go: ``data`` moves from
``batch`` to ``experts``, one alltoall; the expert outputs go back the same way.

The loss is the next-token cross-entropy plus ``aux_loss_weight`` times the sum
over layers of the load-balancing loss ``experts * sum_g(f_g * P_g)`` (f_g: the
fraction of a group's tokens whose first choice is g; P_g: the group's mean
router probability of g), averaged over the groups.  ``Model.outputs`` holds ``moe/aux_loss``
(that sum) and ``moe/dropped`` (int64: (token, choice) routings dropped past
capacity, all layers) with ``moe/dropped/L`` per layer: compile them with the
loss, e.g. ``md.run_simulated(md.compile({"loss": m.loss, **m.outputs}, ...))``.

``Model.logits`` (the LM head's output) lets ``md.generate`` sample text from a trained
model.  Routing is per sequence, and second choices queue after every first choice of
their sequence, so with ``top_k=2`` a position's output can depend on later positions
(as in Switch/GShard with per-group capacity): the samples read the padding after the
prompt through the second choices' capacity.

The blocks run in one ``md.repeat`` over the stacked params (so ``layer:<axis>``
pipelines them): each block returns, besides its carry, its balance loss and its drop
count, which the repeat stacks over ``layer``; the loss sums the stacked balance losses,
and their gradient flows back into each layer's router.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import meshdsl as md
from meshdsl import Model


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 256
    heads: int = 8
    d_head: int = 32
    d_ff: int = 512
    layers: int = 4
    seq: int = 64
    batch: int = 16
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_weight: float = 0.01

    @property
    def capacity(self) -> int:
        """Slots per expert per group (one sequence)."""
        return math.ceil(self.capacity_factor * self.seq * self.top_k / self.experts)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=2, d_head=4, d_ff=8, layers=2, seq=8, batch=4, experts=4)


PROJ = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
SCORES = "batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq"
MIX = "batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head"
OUT = "batch seq heads d_head, heads d_head d_model -> batch seq d_model"


def attention(z_bsd, p, cfg: Config):
    """Causal multi-head self-attention of the normed residual ``z_bsd``."""
    s = z_bsd.shape.get("seq")
    q_bshe = md.einsum(PROJ, z_bsd, p["wq"])
    k_bkhe = md.rename(md.einsum(PROJ, z_bsd, p["wk"]), seq="key_seq")
    v_bkhe = md.rename(md.einsum(PROJ, z_bsd, p["wv"]), seq="key_seq")
    att_bhsk = md.einsum(SCORES, q_bshe, k_bkhe) * (cfg.d_head ** -0.5)
    att_bhsk = md.softmax(md.where(md.causal_mask(s, md.Dim("key_seq", s.size)), att_bhsk, -1e9), "key_seq")
    return md.einsum(OUT, md.einsum(MIX, att_bhsk, v_bkhe), p["wo"])


def route(z_bsd, w_gate, cfg: Config):
    """Top-k routing with capacity: the dispatch and combine tensors, the aux loss, the drop count.

    Returns:
      ``(dispatch_bsgc, combine_bsgc, aux, dropped)``: dispatch is 1.0 where token (b, s) takes
      slot c of expert g (no gradient); combine is dispatch times the gate (the router's
      gradient flows through it); aux is this layer's load-balancing loss; dropped is the
      int64 count of routings past capacity.
    """
    g_dim, c_dim = md.Dim("gate_experts", cfg.experts), md.Dim("capacity", cfg.capacity)
    probs_bsg = md.softmax(md.einsum("batch seq d_model, d_model gate_experts -> batch seq gate_experts",
                                     z_bsd, w_gate), "gate_experts")
    remaining_bsg, filled_bg = probs_bsg, None
    dispatch = combine = dropped = None
    gates, masks = [], []
    for choice in range(cfg.top_k):
        if choice:  # this choice excludes the earlier ones (probs are > 0: a zeroed expert never wins)
            remaining_bsg = remaining_bsg * md.cast(1 - masks[-1], probs_bsg.dtype)
        top_p, top_i = md.top_k(remaining_bsg, "gate_experts", 1, "top")
        gates.append(md.squeeze(top_p, "top"))
        masks.append(md.one_hot(md.squeeze(top_i, "top"), g_dim, torch.int64))           # [b, s, g]
    if cfg.top_k == 2:
        total = gates[0] + gates[1]
        gates = [gates[0] / total, gates[1] / total]
    for gate_bs, mask_bsg in zip(gates, masks):
        # This token's place in its expert's queue: earlier tokens of the group that chose the
        # same expert, after the slots the previous choice filled.
        before_bsg = md.cumsum(mask_bsg, "seq", exclusive=True)
        if filled_bg is not None:
            before_bsg = before_bsg + filled_bg
        position_bs = md.reduce_sum(before_bsg * mask_bsg, "gate_experts")
        over_bs = md.greater_equal(position_bs, c_dim.size)
        kept_bs = md.cast(md.logical_not(over_bs), torch.int64)
        kept_bsg = mask_bsg * kept_bs
        filled_now_bg = md.reduce_sum(kept_bsg, "seq")
        filled_bg = filled_now_bg if filled_bg is None else filled_bg + filled_now_bg
        slot_bsgc = md.cast(kept_bsg * md.one_hot(position_bs, c_dim, torch.int64), probs_bsg.dtype)
        drop = md.reduce_sum(md.cast(over_bs, torch.int64))
        dispatch = slot_bsgc if dispatch is None else dispatch + slot_bsgc
        combine = slot_bsgc * gate_bs if combine is None else combine + slot_bsgc * gate_bs
        dropped = drop if dropped is None else dropped + drop
    # Switch-style balance loss per group, as Mesh-TF computes it: f (first choices, no gradient)
    # times P (mean router probability), then the mean over groups.  Per group, the product
    # is local to a batch shard, and the mean stays a lazy partial sum into the loss's one
    # allreduce; over the whole batch, f and P would each need an allreduce per layer.
    frac_bg = md.reduce_mean(md.cast(masks[0], probs_bsg.dtype), "seq")
    balance_bg = frac_bg * md.reduce_mean(probs_bsg, "seq")
    aux = md.reduce_mean(md.reduce_sum(balance_bg, "gate_experts"), "batch") * float(cfg.experts)
    return dispatch, combine, aux, dropped


def moe_mlp(z_bsd, p, cfg: Config):
    """The routed expert MLP of the normed residual ``z_bsd``: ``(y_bsd, aux, dropped)``."""
    dispatch_bsgc, combine_bsgc, aux, dropped = route(z_bsd, p["w_gate"], cfg)
    xin_gbcd = md.einsum("batch seq gate_experts capacity, batch seq d_model -> "
                         "gate_experts batch capacity d_model", dispatch_bsgc, z_bsd)
    # The expert-parallel move: the tokens leave their batch shard for their expert's shard.
    xin_xncd = md.rename(xin_gbcd, gate_experts="experts", batch="expert_batch")
    h_xncf = md.gelu(md.einsum("experts expert_batch capacity d_model, experts d_model d_ff -> "
                               "experts expert_batch capacity d_ff", xin_xncd, p["w_in"]))
    y_xncd = md.einsum("experts expert_batch capacity d_ff, experts d_ff d_model -> "
                       "experts expert_batch capacity d_model", h_xncf, p["w_out"])
    y_gbcd = md.rename(y_xncd, experts="gate_experts", expert_batch="batch")
    y_bsd = md.einsum("batch seq gate_experts capacity, gate_experts batch capacity d_model -> "
                      "batch seq d_model", combine_bsgc, y_gbcd)
    return y_bsd, aux, dropped


def block(x_bsd, p, cfg: Config):
    """One pre-norm block: ``(x_bsd, {"aux": balance loss, "dropped": drop count})``;
    ``p`` holds this layer's params."""
    g = x_bsd.graph
    with g.scope("attn"):
        x_bsd = x_bsd + attention(md.layer_norm(x_bsd, "d_model", p["ln1"], p["ln1_b"]), p, cfg)
    with g.scope("moe"):
        y_bsd, aux, dropped = moe_mlp(md.layer_norm(x_bsd, "d_model", p["ln2"], p["ln2_b"]), p, cfg)
    return x_bsd + y_bsd, {"aux": aux, "dropped": dropped}


def build(cfg: Config = Config()) -> Model:
    """Build the MoE transformer; its loss is cross-entropy plus the weighted balance loss."""
    if cfg.top_k not in (1, 2) or cfg.top_k > cfg.experts:
        raise md.GraphError(f"moe: Config.top_k is {cfg.top_k} with {cfg.experts} experts; "
                            "use 1 or 2, at most the number of experts.")
    if not cfg.capacity_factor > 0:
        raise md.GraphError(f"moe: Config.capacity_factor is {cfg.capacity_factor}; use a number > 0 "
                            "(1.0 gives each expert an even share of a sequence's routings).")
    b, s = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, v, l = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    g_dim, x_dim = md.Dim("gate_experts", cfg.experts), md.Dim("experts", cfg.experts)

    with md.Graph("moe") as graph:
        ids_bs = md.input("ids", [b, s], torch.int64)
        labels_bs = md.input("labels", [b, s], torch.int64)
        wte_vd = md.param("wte", [v, d], scale=0.02)
        wpe_sd = md.param("wpe", [s, d], scale=0.02)
        # Stacked along 'layer'; fan_out lists every dim that is not an input feature.
        blocks = {
            "ln1": md.param("ln1", [l, d], init="ones"),
            "ln1_b": md.param("ln1_b", [l, d], init="zeros"),
            "wq": md.param("wq", [l, d, h, e], fan_out=[l, h, e]),
            "wk": md.param("wk", [l, d, h, e], fan_out=[l, h, e]),
            "wv": md.param("wv", [l, d, h, e], fan_out=[l, h, e]),
            "wo": md.param("wo", [l, h, e, d], fan_out=[l, d]),
            "ln2": md.param("ln2", [l, d], init="ones"),
            "ln2_b": md.param("ln2_b", [l, d], init="zeros"),
            "w_gate": md.param("w_gate", [l, d, g_dim], fan_out=[l, g_dim]),
            "w_in": md.param("w_in", [l, x_dim, d, f], fan_out=[l, x_dim, f]),
            "w_out": md.param("w_out", [l, x_dim, f, d], fan_out=[l, x_dim, d]),
        }
        lnf, lnf_b = md.param("lnf", [d], init="ones"), md.param("lnf_b", [d], init="zeros")
        lm_head_vd = md.param("lm_head", [v, d], fan_out=[v])

        x_bsd = md.gather(wte_vd, ids_bs, "vocab") + wpe_sd
        x_bsd, per_layer = md.repeat(lambda x, p: block(x, p, cfg), x_bsd, blocks, l)
        aux_total = md.reduce_sum(per_layer["aux"], "layer")
        dropped_l = per_layer["dropped"]
        # Layer i's count picked by a mask over 'layer' (not a slice): a sum over a pipeline's
        # stages, wherever layer i runs.
        layer_l = md.iota(l)
        outputs = {"moe/aux_loss": aux_total, "moe/dropped": md.reduce_sum(dropped_l, "layer"),
                   **{f"moe/dropped/{i}": md.reduce_sum(dropped_l * md.cast(md.equal(layer_l, i), torch.int64))
                      for i in range(cfg.layers)}}
        x_bsd = md.layer_norm(x_bsd, "d_model", lnf, lnf_b)
        logits_bsv = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x_bsd, lm_head_vd)
        loss = md.reduce_mean(md.cross_entropy(logits_bsv, labels_bs, "vocab")) + cfg.aux_loss_weight * aux_total

    params = {"wte": wte_vd, "wpe": wpe_sd, **blocks, "lnf": lnf, "lnf_b": lnf_b, "lm_head": lm_head_vd}

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        # Random tokens; the labels are the ids shifted by one (next-token prediction).
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return Model(graph, loss, params, feeds, cfg, outputs=outputs, logits=logits_bsv)
