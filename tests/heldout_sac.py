"""Soft Actor-Critic, a held-out model (round 27b): an actor, twin Q networks, EMA targets, a learned alpha.

Legend: batch = transitions from a replay buffer, obs = observation features, act = action
features, hidden = every network's hidden width. One loss trains everything at once, with
``md.stop_gradient`` where SAC's separate losses need it:

- critic: ``(Q_i(s, a) - y)^2`` for both Q nets, the target ``y = r + gamma (1 - done)
  (min_i Qt_i(s', a') - alpha log pi(a'|s'))`` a constant (``a'`` sampled from the actor at ``s'``);
  the target nets ``Qt_i`` are frozen params that follow the Q nets by an EMA
  (``md.Model(updates=)``, ``tau``);
- actor: ``alpha log pi(a~|s) - min_i Q_i(s, a~)``, ``a~ = tanh(mu + sigma eps)`` (the
  reparameterised sample with the tanh correction of its log-density), reading the Q nets through
  stopped weights (the actor's loss trains the actor only) and alpha stopped;
- temperature: ``-log_alpha (log pi(a~|s) + target_entropy)``, the log-density stopped.

The Gaussian noises ``eps``, ``eps_next`` are inputs (the replay's sampled noise), so the dense
program and the reference agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    obs: int = 6
    act: int = 3
    hidden: int = 16
    gamma: float = 0.99
    tau: float = 0.05
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=6, obs=4, act=2, hidden=8)


Q_NAMES = ("w_s", "w_a", "b1", "w2", "b2", "w_o", "b_o")


def _q(p, s, a):
    """A Q network: [obs] + [act] -> hidden -> hidden -> a value per transition."""
    h = md.relu(md.einsum("batch obs, obs hidden -> batch hidden", s, p["w_s"])
                + md.einsum("batch act, act hidden -> batch hidden", a, p["w_a"]) + p["b1"])
    h = md.relu(md.einsum("batch hidden, hidden hidden2 -> batch hidden2", h, p["w2"]) + p["b2"])
    return md.einsum("batch hidden2, hidden2 -> batch", h, p["w_o"]) + p["b_o"]


def _actor(p, s, eps):
    """The squashed Gaussian policy: an action in (-1, 1) and its log-density."""
    h = md.relu(md.einsum("batch obs, obs hidden -> batch hidden", s, p["pi_w1"]) + p["pi_b1"])
    mu = md.einsum("batch hidden, hidden act -> batch act", h, p["pi_mu"])
    log_std = md.clamp(md.einsum("batch hidden, hidden act -> batch act", h, p["pi_ls"]), -5.0, 2.0)
    u = mu + md.exp(log_std) * eps
    a = md.tanh(u)
    # log N(u; mu, std) - log(1 - tanh(u)^2), the latter as 2 (log 2 - u - softplus(-2u)) for stability
    logp = -0.5 * eps * eps - log_std - 0.5 * math.log(2 * math.pi) - 2.0 * (math.log(2.0) - u - md.softplus(-2.0 * u))
    return a, md.reduce_sum(logp, "act")


def build(cfg: Config) -> md.Model:
    B, O, A = md.Dim("batch", cfg.batch), md.Dim("obs", cfg.obs), md.Dim("act", cfg.act)
    Hd, H2 = md.Dim("hidden", cfg.hidden), md.Dim("hidden2", cfg.hidden)
    with md.Graph() as g:
        s, s2 = md.input("obs", [B, O]), md.input("next_obs", [B, O])
        a_buf, r, done = md.input("action", [B, A]), md.input("reward", [B]), md.input("done", [B])
        eps, eps2 = md.input("eps", [B, A]), md.input("eps_next", [B, A])

        def q_params(prefix):
            return {"w_s": md.param(f"{prefix}_w_s", [O, Hd], fan_out=["hidden"]),
                    "w_a": md.param(f"{prefix}_w_a", [A, Hd], fan_out=["hidden"]),
                    "b1": md.param(f"{prefix}_b1", [Hd], init="zeros"),
                    "w2": md.param(f"{prefix}_w2", [Hd, H2], fan_out=["hidden2"]),
                    "b2": md.param(f"{prefix}_b2", [H2], init="zeros"),
                    "w_o": md.param(f"{prefix}_w_o", [H2]), "b_o": md.param(f"{prefix}_b_o", [], init="zeros")}

        pi = {"pi_w1": md.param("pi_w1", [O, Hd], fan_out=["hidden"]), "pi_b1": md.param("pi_b1", [Hd], init="zeros"),
              "pi_mu": md.param("pi_mu", [Hd, A], fan_out=["act"]), "pi_ls": md.param("pi_ls", [Hd, A], fan_out=["act"])}
        q1, q2 = q_params("q1"), q_params("q2")
        log_alpha = md.param("log_alpha", [], init=-1.0)
        trained = g.params()
        t1, t2 = q_params("tq1"), q_params("tq2")          # frozen: left out of the Model's params
        alpha = md.exp(log_alpha)

        # critic: the soft Bellman target is a constant
        a2, logp2 = _actor(pi, s2, eps2)
        q_next = md.minimum(_q(t1, s2, a2), _q(t2, s2, a2)) - alpha * logp2
        y = md.stop_gradient(r + cfg.gamma * (1.0 - done) * q_next)
        critic = md.reduce_mean(md.square(_q(q1, s, a_buf) - y) + md.square(_q(q2, s, a_buf) - y))
        # actor: the Q nets' weights stopped, so only the policy moves
        a_pi, logp = _actor(pi, s, eps)
        frozen = [{k: md.stop_gradient(v) for k, v in q.items()} for q in (q1, q2)]
        q_pi = md.minimum(_q(frozen[0], s, a_pi), _q(frozen[1], s, a_pi))
        actor = md.reduce_mean(md.stop_gradient(alpha) * logp - q_pi)
        # temperature: push the entropy towards -|act|
        temp = -md.reduce_mean(log_alpha * md.stop_gradient(logp - float(cfg.act)))
        loss = critic + actor + temp
        updates = {t[k].name: (1 - cfg.tau) * t[k] + cfg.tau * q[k] for t, q in ((t1, q1), (t2, q2)) for k in Q_NAMES}

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        n = cfg.batch
        return {"obs": torch.randn(n, cfg.obs, generator=gen), "next_obs": torch.randn(n, cfg.obs, generator=gen),
                "action": torch.rand(n, cfg.act, generator=gen) * 2 - 1, "reward": torch.randn(n, generator=gen),
                "done": (torch.rand(n, generator=gen) < 0.2).float(),
                "eps": torch.randn(n, cfg.act, generator=gen), "eps_next": torch.randn(n, cfg.act, generator=gen)}

    return md.Model(g, loss, trained, feeds, cfg, updates=updates,
                    outputs={"critic": critic, "actor": actor, "alpha": alpha})


REF_INPUTS = ("obs", "next_obs", "action", "reward", "done", "eps", "eps_next")


def _ref_q(p, pre, s, a):
    h = torch.relu(s @ p[f"{pre}_w_s"] + a @ p[f"{pre}_w_a"] + p[f"{pre}_b1"])
    return torch.relu(h @ p[f"{pre}_w2"] + p[f"{pre}_b2"]) @ p[f"{pre}_w_o"] + p[f"{pre}_b_o"]


def _ref_actor(p, s, eps):
    h = torch.relu(s @ p["pi_w1"] + p["pi_b1"])
    mu, log_std = h @ p["pi_mu"], (h @ p["pi_ls"]).clamp(-5.0, 2.0)
    dist = torch.distributions.Normal(mu, log_std.exp())
    u = mu + log_std.exp() * eps
    a = torch.tanh(u)
    return a, (dist.log_prob(u) - torch.log1p(-a.pow(2))).sum(-1)


def reference_loss(cfg: Config, p: dict, obs, next_obs, action, reward, done, eps, eps_next):
    """SAC's three losses in plain torch, each with its own graph cut (``detach``), summed; ``p``
    holds the frozen target nets too (``tq1_*``, ``tq2_*``), read under no_grad."""
    alpha = p["log_alpha"].exp()
    with torch.no_grad():
        a2, logp2 = _ref_actor(p, next_obs, eps_next)
        q_next = torch.min(_ref_q(p, "tq1", next_obs, a2), _ref_q(p, "tq2", next_obs, a2)) - alpha * logp2
        y = reward + cfg.gamma * (1 - done) * q_next
    critic = ((_ref_q(p, "q1", obs, action) - y) ** 2 + (_ref_q(p, "q2", obs, action) - y) ** 2).mean()
    a_pi, logp = _ref_actor(p, obs, eps)
    pd = {k: v.detach() for k, v in p.items()}
    q_pi = torch.min(_ref_q(pd, "q1", obs, a_pi), _ref_q(pd, "q2", obs, a_pi))
    actor = (alpha.detach() * logp - q_pi).mean()
    temp = -(p["log_alpha"] * (logp - cfg.act).detach()).mean()     # target entropy -|act|
    return critic + actor + temp
