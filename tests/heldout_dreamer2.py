"""Dreamer-v2-lite world model (RSSM), a held-out model (round 23a).

Legend: batch = sequences, time = steps, d_obs / d_act = fed observations and actions, d_emb = the
observation encoder's width, hidden = the GRU state, groups x classes = the categorical latent,
h_out = the GRU's output features before they are renamed back to hidden. A recurrence over time
(md.repeat, nested in a one-layer block so a layout may split time) carries the GRU state h; each
step: posterior logits from (h, embedded obs), prior logits from h, z = a straight-through one-hot of
argmax(posterior + fed gumbel noise), then h <- GRU(h, [z, action]). Losses: KL balancing
0.8 KL(sg(post) || prior) + 0.2 KL(post || sg(prior)), a reward head and an observation decoder (MSE).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    time: int = 16
    d_obs: int = 16
    d_act: int = 4
    d_emb: int = 32
    hidden: int = 32
    groups: int = 8
    classes: int = 8
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, time=4, d_obs=5, d_act=2, d_emb=6, hidden=6, groups=2, classes=4)


def _gate(x_in, h, p, name: str):
    return x_in + md.rename(md.einsum("batch hidden, hidden h_out -> batch h_out", h, p[f"wh_{name}"]), h_out="hidden")


def _step(cfg: Config, p: dict):
    def step(h, s):
        post = (md.einsum("batch hidden, hidden groups classes -> batch groups classes", h, p["w_post_h"])
                + md.einsum("batch d_emb, d_emb groups classes -> batch groups classes", s["e"], p["w_post_e"]))
        prior = md.einsum("batch hidden, hidden groups classes -> batch groups classes", h, p["w_prior"])
        probs = md.softmax(post, "classes")
        sample = md.one_hot(md.argmax(post + s["g"], "classes"), md.Dim("classes", cfg.classes))
        z = probs + md.stop_gradient(sample - probs)
        x_in = {n: md.einsum("batch groups classes, groups classes hidden -> batch hidden", z, p[f"wz_{n}"])
                + md.einsum("batch d_act, d_act hidden -> batch hidden", s["a"], p[f"wa_{n}"]) for n in "run"}
        r = md.sigmoid(_gate(x_in["r"], h, p, "r"))
        u = md.sigmoid(_gate(x_in["u"], h, p, "u"))
        n = md.tanh(x_in["n"] + r * md.rename(md.einsum("batch hidden, hidden h_out -> batch h_out", h, p["wh_n"]),
                                              h_out="hidden"))
        return (1.0 - u) * n + u * h, {"h": h, "z": z, "post": post, "prior": prior}
    return step


def _kl(p_logits, q_logits):
    """KL(p || q) over classes, summed over groups."""
    lp, lq = md.log_softmax(p_logits, "classes"), md.log_softmax(q_logits, "classes")
    return md.reduce_sum(md.exp(lp) * (lp - lq), ["groups", "classes"])


def build(cfg: Config) -> md.Model:
    B, T = md.Dim("batch", cfg.batch), md.Dim("time", cfg.time)
    O, A, E = md.Dim("d_obs", cfg.d_obs), md.Dim("d_act", cfg.d_act), md.Dim("d_emb", cfg.d_emb)
    H, HO = md.Dim("hidden", cfg.hidden), md.Dim("h_out", cfg.hidden)
    G, C = md.Dim("groups", cfg.groups), md.Dim("classes", cfg.classes)
    with md.Graph() as g:
        obs, act = md.input("obs", [B, T, O]), md.input("act", [B, T, A])
        gumbel, reward = md.input("gumbel", [B, T, G, C]), md.input("reward", [B, T])
        p = {"w_post_h": md.param("w_post_h", [H, G, C]), "w_post_e": md.param("w_post_e", [E, G, C]),
             "w_prior": md.param("w_prior", [H, G, C])}
        for n in "run":
            p[f"wz_{n}"] = md.param(f"wz_{n}", [G, C, H], fan_out=[H])
            p[f"wa_{n}"] = md.param(f"wa_{n}", [A, H], fan_out=[H])
            p[f"wh_{n}"] = md.param(f"wh_{n}", [H, HO], fan_out=[HO])
        e = md.tanh(md.einsum("batch time d_obs, d_obs d_emb -> batch time d_emb", obs,
                              md.param("w_enc", [O, E], fan_out=[E])))
        steps = {"e": md.transpose(e, ["time", "batch", "d_emb"]), "a": md.transpose(act, ["time", "batch", "d_act"]),
                 "g": md.transpose(gumbel, ["time", "batch", "groups", "classes"])}
        h0 = md.constant(0.0, [B, H])
        _, outs = md.repeat(lambda c, _: md.repeat(_step(cfg, p), c, steps, "time"), h0, {}, md.Dim("once", 1),
                            remat=cfg.remat)
        h, z, post, prior = (md.squeeze(outs[k], "once") for k in ("h", "z", "post", "prior"))
        kl = 0.8 * _kl(md.stop_gradient(post), prior) + 0.2 * _kl(post, md.stop_gradient(prior))
        r_hat = (md.einsum("time batch hidden, hidden -> time batch", h, md.param("wr_h", [H]))
                 + md.einsum("time batch groups classes, groups classes -> time batch", z, md.param("wr_z", [G, C])))
        o_hat = (md.einsum("time batch hidden, hidden d_obs -> time batch d_obs", h, md.param("wd_h", [H, O], fan_out=[O]))
                 + md.einsum("time batch groups classes, groups classes d_obs -> time batch d_obs", z,
                             md.param("wd_z", [G, C, O], fan_out=[O])))
        loss = (md.reduce_mean(kl) + md.reduce_mean((r_hat - reward) ** 2)
                + md.reduce_mean(md.reduce_sum((o_hat - obs) ** 2, "d_obs")))

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        u = torch.rand(cfg.batch, cfg.time, cfg.groups, cfg.classes, generator=gen).clamp(1e-6, 1 - 1e-6)
        return {"obs": torch.randn(cfg.batch, cfg.time, cfg.d_obs, generator=gen),
                "act": torch.randn(cfg.batch, cfg.time, cfg.d_act, generator=gen),
                "gumbel": -torch.log(-torch.log(u)), "reward": torch.randn(cfg.batch, cfg.time, generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("obs", "act", "gumbel", "reward")


def _ref_kl(p_logits, q_logits):
    lp, lq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum((-2, -1))


def reference_loss(cfg: Config, p: dict, obs, act, gumbel, reward):
    """The same world model in plain torch: a Python loop over time, .detach() for the stop-gradients."""
    e = torch.tanh(obs @ p["w_enc"])
    h = torch.zeros(cfg.batch, cfg.hidden, dtype=obs.dtype)
    kl = rew = rec = 0.0
    for t in range(cfg.time):
        post = torch.einsum("bh,hgc->bgc", h, p["w_post_h"]) + torch.einsum("be,egc->bgc", e[:, t], p["w_post_e"])
        prior = torch.einsum("bh,hgc->bgc", h, p["w_prior"])
        probs = post.softmax(-1)
        sample = torch.nn.functional.one_hot((post + gumbel[:, t]).argmax(-1), cfg.classes).to(probs.dtype)
        z = probs + (sample - probs).detach()
        kl = kl + (0.8 * _ref_kl(post.detach(), prior) + 0.2 * _ref_kl(post, prior.detach())).mean()
        rew = rew + ((h @ p["wr_h"] + (z * p["wr_z"]).sum((1, 2)) - reward[:, t]) ** 2).mean()
        o_hat = h @ p["wd_h"] + torch.einsum("bgc,gco->bo", z, p["wd_z"])
        rec = rec + ((o_hat - obs[:, t]) ** 2).sum(-1).mean()
        x_in = {n: torch.einsum("bgc,gch->bh", z, p[f"wz_{n}"]) + act[:, t] @ p[f"wa_{n}"] for n in "run"}
        r = torch.sigmoid(x_in["r"] + h @ p["wh_r"])
        u = torch.sigmoid(x_in["u"] + h @ p["wh_u"])
        n = torch.tanh(x_in["n"] + r * (h @ p["wh_n"]))
        h = (1 - u) * n + u * h
    return (kl + rew + rec) / cfg.time
