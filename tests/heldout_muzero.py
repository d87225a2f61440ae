"""Held-out model (round 21a): MuZero-lite, the learned model unrolled over fed actions.

Written from the user docs alone. A representation net maps an observation to a hidden
state; a dynamics net, unrolled ``unroll`` steps by ``md.repeat`` over the fed actions (one
per step, the stacked per-step input), maps (state, action) to the next state and a reward;
prediction heads read each state for a policy and a value. Each step's loss is a per-layer
output of the repeat:

- policy: cross-entropy against the fed visit distribution (``-sum pi log softmax``);
- value and reward: mean squared error against fed targets;
- between steps MuZero scales the hidden state's gradient by 0.5:
  ``h * 0.5 + stop_gradient(h) * 0.5`` (the forward unchanged);
- the hidden state is min-max normalised to [0, 1] over ``hidden`` after each net, as MuZero does.

The dynamics weights are shared by every step (read from outside the repeat, ALBERT-style), so
``unroll:stage`` pipelines the unroll. Legend: b batch, o d_obs, h hidden, g hidden2 (the
dynamics net's inner width), a actions, u unroll.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    d_obs: int = 32
    hidden: int = 64
    hidden2: int = 64
    actions: int = 8
    unroll: int = 5
    batch: int = 32
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(d_obs=6, hidden=8, hidden2=12, actions=4, unroll=4, batch=6)


def _normalise(h):
    """Min-max over ``hidden`` to [0, 1] (MuZero's scaled hidden state)."""
    lo, hi = md.reduce_min(h, "hidden"), md.reduce_max(h, "hidden")
    return (h - lo) / (hi - lo + 1e-5)


def _predict(h, w_pi, w_v, pi_target, v_target):
    """The policy cross-entropy and value MSE of state ``h`` (each [batch])."""
    logits = md.einsum("batch hidden, hidden actions -> batch actions", h, w_pi)
    ce = -md.reduce_sum(pi_target * md.log_softmax(logits, "actions"), "actions")
    value = md.einsum("batch hidden, hidden -> batch", h, w_v)
    return ce + (value - v_target) ** 2


def build(cfg: Config = Config()) -> md.Model:
    B, O, H = md.Dim("batch", cfg.batch), md.Dim("d_obs", cfg.d_obs), md.Dim("hidden", cfg.hidden)
    G, A, U = md.Dim("hidden2", cfg.hidden2), md.Dim("actions", cfg.actions), md.Dim("unroll", cfg.unroll)
    with md.Graph("muzero") as g:
        obs = md.input("obs", [B, O])
        actions = md.input("actions", [U, B], torch.int64)
        pi0 = md.input("pi0", [B, A])                    # visit distribution at the root
        v0 = md.input("v0", [B])
        pis, vals = md.input("pis", [U, B, A]), md.input("values", [U, B])
        rewards = md.input("rewards", [U, B])
        w_rep = md.param("w_rep", [O, H], fan_out=["hidden"])
        w_dh = md.param("w_dh", [H, G], fan_out=["hidden2"])
        w_da = md.param("w_da", [A, G], fan_out=["hidden2"], scale=1.0)
        w_dout = md.param("w_dout", [G, H], fan_out=["hidden"])
        w_r = md.param("w_r", [G])
        w_pi = md.param("w_pi", [H, A], fan_out=["actions"])
        w_v = md.param("w_v", [H])

        h0 = _normalise(md.relu(md.einsum("batch d_obs, d_obs hidden -> batch hidden", obs, w_rep)))
        loss0 = md.reduce_mean(_predict(h0, w_pi, w_v, pi0, v0))

        def step(h, p):
            h = h * 0.5 + md.stop_gradient(h) * 0.5      # halve the gradient into the past
            a = md.one_hot(p["action"], A)               # [batch, actions]
            inner = md.relu(md.einsum("batch hidden, hidden hidden2 -> batch hidden2", h, w_dh)
                            + md.einsum("batch actions, actions hidden2 -> batch hidden2", a, w_da))
            reward = md.einsum("batch hidden2, hidden2 -> batch", inner, w_r)
            h_next = _normalise(md.einsum("batch hidden2, hidden2 hidden -> batch hidden", inner, w_dout))
            per = _predict(h_next, w_pi, w_v, p["pi"], p["value"]) + (reward - p["reward"]) ** 2
            return h_next, {"loss": md.reduce_mean(per)}

        stacked = {"action": actions, "pi": pis, "value": vals, "reward": rewards}
        _, per_step = md.repeat(step, h0, stacked, "unroll", remat=None if cfg.remat == "none" else cfg.remat)
        loss = loss0 + md.reduce_sum(per_step["loss"], "unroll") / cfg.unroll

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        visits = torch.rand(cfg.unroll + 1, cfg.batch, cfg.actions, generator=gen) ** 3
        visits = visits / visits.sum(-1, keepdim=True)
        return {"obs": torch.randn(cfg.batch, cfg.d_obs, generator=gen),
                "actions": torch.randint(0, cfg.actions, (cfg.unroll, cfg.batch), generator=gen),
                "pi0": visits[0], "v0": torch.randn(cfg.batch, generator=gen),
                "pis": visits[1:].contiguous(), "values": torch.randn(cfg.unroll, cfg.batch, generator=gen),
                "rewards": torch.randn(cfg.unroll, cfg.batch, generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("obs", "actions", "pi0", "v0", "pis", "values", "rewards")


def reference_loss(cfg: Config, params: dict, obs, actions, pi0, v0, pis, values, rewards):
    """The same loss in plain torch (float64), the unroll a Python loop."""
    p = {k: v.double() for k, v in params.items()}

    def norm(h):
        lo, hi = h.min(-1, keepdim=True).values, h.max(-1, keepdim=True).values
        return (h - lo) / (hi - lo + 1e-5)

    def predict(h, pi, v):
        ce = -(pi.double() * torch.log_softmax(h @ p["w_pi"], -1)).sum(-1)
        return ce + (h @ p["w_v"] - v.double()) ** 2

    h = norm(torch.relu(obs.double() @ p["w_rep"]))
    loss = predict(h, pi0, v0).mean()
    total = 0.0
    for t in range(cfg.unroll):
        a = torch.nn.functional.one_hot(actions[t], cfg.actions).double()
        inner = torch.relu(h @ p["w_dh"] + a @ p["w_da"])
        h = norm(inner @ p["w_dout"])
        total = total + (predict(h, pis[t], values[t]) + (inner @ p["w_r"] - rewards[t].double()) ** 2).mean()
    return loss + total / cfg.unroll
