"""Held-out model (round 16a): Double DQN's TD loss, written from the docs alone.

A Q-network (an MLP over a state vector, its hidden layers under ``md.repeat``) scores the
actions of a batch of transitions ``(s, a, r, s', done)``. Double DQN picks the next action with
the online network (``argmax_a Q(s', a)``) and values it with the target network; the TD target
``r + gamma * (1 - done) * Q_target(s', a*)`` carries no gradient, and the loss is the Huber loss
of ``Q(s, a) - target``, written from ops. ``target=frozen``: the target network is a second set
of params left out of the Model (frozen); ``target=stopgrad``: the online params through
``md.stop_gradient`` (DQN without a separate target copy: Q(s') of the online net, unchanged).

Legend: p = pair (s and s'), b = batch, s = d_state, h = hidden, a = actions, l = layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 64
    d_state: int = 16
    hidden: int = 64
    actions: int = 6
    layers: int = 2
    gamma: float = 0.99
    target: str = "frozen"       # frozen | stopgrad
    remat: str = "none"          # none | full | selective (the layer stack)

    @classmethod
    def tiny(cls):
        return cls(batch=12, d_state=6, hidden=8, actions=4, layers=2)


def _q_net(s_bs, w, layer="layer", remat=None):
    """Q-values [pair, batch, actions] of states [pair, batch, d_state] under the weights ``w``
    (their layer stack scans ``layer``)."""
    h_bh = md.relu(md.einsum("pair batch d_state, d_state hidden -> pair batch hidden", s_bs, w["w_in"]) + w["b_in"])

    def block(h, p):
        y = md.einsum("pair batch hidden, hidden hidden_out -> pair batch hidden_out", h, p["w"])
        return h + md.relu(md.rename(y, {"hidden_out": "hidden"}) + p["b"])

    h_bh = md.repeat(block, h_bh, {"w": w["w_h"], "b": w["b_h"]}, layer, remat=remat)
    return md.einsum("pair batch hidden, hidden actions -> pair batch actions", h_bh, w["w_out"]) + w["b_out"]


def _weights(prefix, cfg, dims):
    S, H, A, L = dims
    stack = L.name
    return {
        "w_in": md.param(f"{prefix}w_in", [S, H], fan_out=[H]),
        "b_in": md.param(f"{prefix}b_in", [H], init="zeros"),
        "w_h": md.param(f"{prefix}w_h", [L, H, md.Dim("hidden_out", cfg.hidden)], fan_out=[stack, "hidden_out"]),
        "b_h": md.param(f"{prefix}b_h", [L, H], init="zeros"),
        "w_out": md.param(f"{prefix}w_out", [H, A], fan_out=[A]),
        "b_out": md.param(f"{prefix}b_out", [A], init="zeros"),
    }


def _huber(d):
    ad = md.abs(d)
    return md.where(md.less(ad, 1.0), 0.5 * d * d, ad - 0.5)


def build(cfg: Config) -> md.Model:
    if cfg.target not in ("frozen", "stopgrad"):
        raise ValueError(f"target must be 'frozen' or 'stopgrad', not {cfg.target!r}")
    B, S = md.Dim("batch", cfg.batch), md.Dim("d_state", cfg.d_state)
    H, A, L = md.Dim("hidden", cfg.hidden), md.Dim("actions", cfg.actions), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        s, s2 = md.input("s", [B, S]), md.input("s_next", [B, S])
        act = md.input("action", [B], dtype=torch.int64)
        r, done = md.input("reward", [B]), md.input("done", [B])
        online = _weights("", cfg, (S, H, A, L))
        # s and s' through one stack of the online net (a pipeline takes one repeat per stack)
        pair = md.concat([md.unsqueeze(s, "pair", 0), md.unsqueeze(s2, "pair", 0)], "pair")
        q_pba = _q_net(pair, online, remat=None if cfg.remat == "none" else cfg.remat)
        q_ba, q2_ba = md.squeeze(md.slice_(q_pba, "pair", 0, 1), "pair"), md.squeeze(md.slice_(q_pba, "pair", 1, 2), "pair")
        a_star = md.argmax(q2_ba, "actions")                           # chosen by the online net
        if cfg.target == "frozen":   # valued by the target net, a stack of its own
            target = _weights("target_", cfg, (S, H, A, md.Dim("target_layer", cfg.layers)))
            q2_ba = md.squeeze(_q_net(md.unsqueeze(s2, "pair", 0), target, "target_layer"), "pair")
        q_sa = md.reduce_sum(q_ba * md.one_hot(act, A), "actions")
        q_next = md.reduce_sum(q2_ba * md.one_hot(a_star, A), "actions")
        td = md.stop_gradient(r + cfg.gamma * (1.0 - done) * q_next)
        loss = md.reduce_mean(_huber(q_sa - td))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        return {"s": torch.randn(cfg.batch, cfg.d_state, generator=gen),
                "s_next": torch.randn(cfg.batch, cfg.d_state, generator=gen),
                "action": torch.randint(0, cfg.actions, (cfg.batch,), generator=gen),
                "reward": 3.0 * torch.randn(cfg.batch, generator=gen),
                "done": (torch.rand(cfg.batch, generator=gen) < 0.3).float()}

    return md.Model(g, loss, online, make_feeds, cfg, outputs={"q": q_ba})
