"""RSSM world model (Dreamer-lite), written from the docs alone: a GRU deterministic state scanned
over ``time`` by md.repeat (each step's observation, action and noise as stacked inputs), a prior
from the GRU state and a posterior from it and the observation's embedding, the posterior sampled
by reparameterisation with fed noise, a decoder's reconstruction loss and the KL between posterior
and prior with KL balancing (``alpha`` on the prior side, the posterior stop-gradiented; the rest
on the posterior side, the prior stop-gradiented).

``latent=gauss``: a diagonal Gaussian latent, ``z = mean + std * eps``. ``latent=cat``: ``latent``
categoricals of ``classes`` classes each, sampled by Gumbel-max with the fed noise and passed on
straight-through (``one_hot + probs - stop_gradient(probs)``).

Legend: b batch, t time, k hidden, z latent (x classes), x obs, a act, e embed, f state (carry).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    time: int = 16
    hidden: int = 32
    latent: int = 8
    classes: int = 4
    obs: int = 16
    act: int = 4
    embed: int = 16
    alpha: float = 0.8
    latent_kind: str = "gauss"   # gauss | cat
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(batch=4, time=4, hidden=6, latent=4, classes=3, obs=5, act=2, embed=5)


def _dims(cfg):
    return dict(b=md.Dim("batch", cfg.batch), t=md.Dim("time", cfg.time), k=md.Dim("hidden", cfg.hidden),
                k2=md.Dim("hidden_in", cfg.hidden), z=md.Dim("latent", cfg.latent), c=md.Dim("classes", cfg.classes),
                x=md.Dim("obs", cfg.obs), a=md.Dim("act", cfg.act), e=md.Dim("embed", cfg.embed),
                s=md.Dim("stat", 2))


def _lat(cfg, d):
    return [d["z"], d["c"]] if cfg.latent_kind == "cat" else [d["z"]]


def _params(cfg, d):
    lat, names = _lat(cfg, d), [x.name for x in _lat(cfg, d)]
    stat = [] if cfg.latent_kind == "cat" else [d["s"]]
    names = [x.name for x in stat] + names
    p = {}
    for gate in ("r", "u", "c"):
        p[f"wz_{gate}"] = md.param(f"wz_{gate}", [*lat, d["k"]], fan_out=["hidden"])
        p[f"wa_{gate}"] = md.param(f"wa_{gate}", [d["a"], d["k"]], fan_out=["hidden"])
        p[f"wh_{gate}"] = md.param(f"wh_{gate}", [d["k2"], d["k"]], fan_out=["hidden"])
    p["embed"] = md.param("embed", [d["x"], d["e"]], fan_out=["embed"])
    p["prior"] = md.param("prior", [d["k"], *stat, *lat], fan_out=names)
    p["post_h"] = md.param("post_h", [d["k"], *stat, *lat], fan_out=names)
    p["post_e"] = md.param("post_e", [d["e"], *stat, *lat], fan_out=names)
    p["dec_h"] = md.param("dec_h", [d["k"], d["x"]], fan_out=["obs"])
    p["dec_z"] = md.param("dec_z", [*lat, d["x"]], fan_out=["obs"])
    return p


def _gru(cfg, h, z, act, p):
    zs = " ".join(x for x in ("latent", "classes") if x in z.shape.names)
    h_in = md.rename(h, hidden="hidden_in")

    def pre(gate):
        return (md.einsum(f"batch {zs}, {zs} hidden -> batch hidden", z, p[f"wz_{gate}"])
                + md.einsum("batch act, act hidden -> batch hidden", act, p[f"wa_{gate}"]))

    rh = md.einsum("batch hidden_in, hidden_in hidden -> batch hidden", h_in, p["wh_r"])
    r = md.sigmoid(pre("r") + rh)
    u = md.sigmoid(pre("u") + md.einsum("batch hidden_in, hidden_in hidden -> batch hidden", h_in, p["wh_u"]))
    c = md.tanh(pre("c") + r * md.einsum("batch hidden_in, hidden_in hidden -> batch hidden", h_in, p["wh_c"]))
    return (1 - u) * h + u * c


def _gauss_kl(mq, sq, mp, sp):
    """KL(N(mq, sq) || N(mp, sp)) summed over latent."""
    return md.reduce_sum(md.log(sp / sq) + (sq * sq + (mq - mp) ** 2) / (2 * sp * sp) - 0.5, "latent")


def _stats(cfg, h, emb, p):
    lat = "latent classes" if cfg.latent_kind == "cat" else "stat latent"
    prior = md.einsum(f"batch hidden, hidden {lat} -> batch {lat}", h, p["prior"])
    post = (md.einsum(f"batch hidden, hidden {lat} -> batch {lat}", h, p["post_h"])
            + md.einsum(f"batch embed, embed {lat} -> batch {lat}", emb, p["post_e"]))
    return prior, post


def _latent_step(cfg, prior, post, noise):
    """(sample z, KL balanced) for one step."""
    sg, a = md.stop_gradient, cfg.alpha
    if cfg.latent_kind == "gauss":
        def ms(s):
            return md.squeeze(md.slice_(s, "stat", 0, 1), "stat"), md.softplus(md.squeeze(md.slice_(s, "stat", 1, 2), "stat")) + 0.1
        (mp, sp), (mq, sq) = ms(prior), ms(post)
        z = mq + sq * noise
        kl = a * _gauss_kl(sg(mq), sg(sq), mp, sp) + (1 - a) * _gauss_kl(mq, sq, sg(mp), sg(sp))
        return z, kl
    lp, lq = md.log_softmax(prior, "classes"), md.log_softmax(post, "classes")
    probs = md.exp(lq)
    sample = md.one_hot(md.argmax(post + noise, "classes"), md.Dim("classes", cfg.classes))
    z = sample + probs - sg(probs)

    def kl(lq_, lp_):
        return md.reduce_sum(md.exp(lq_) * (lq_ - lp_), ["latent", "classes"])

    return z, a * kl(sg(lq), lp) + (1 - a) * kl(lq, sg(lp))


def build(cfg: Config) -> md.Model:
    if cfg.latent_kind not in ("gauss", "cat"):
        raise ValueError(f"latent_kind must be gauss or cat, got {cfg.latent_kind!r}")
    d = _dims(cfg)
    lat = _lat(cfg, d)
    k_sz = cfg.hidden
    z_sz = cfg.latent * (cfg.classes if cfg.latent_kind == "cat" else 1)
    f = md.Dim("state", k_sz + z_sz)
    with md.Graph() as g:
        obs = md.input("obs", [d["t"], d["b"], d["x"]])
        act = md.input("act", [d["t"], d["b"], d["a"]])
        noise = md.input("noise", [d["t"], d["b"], *lat])
        p = _params(cfg, d)
        start = md.constant(0.0, [d["b"], f])

        def step(carry, q):
            h = md.rename(md.slice_(carry, "state", 0, k_sz), state="hidden")
            zf = md.rename(md.slice_(carry, "state", k_sz, k_sz + z_sz), state="zflat")
            z = md.rearrange(zf, "batch (latent classes) -> batch latent classes", classes=cfg.classes) \
                if cfg.latent_kind == "cat" else md.rename(zf, zflat="latent")
            h = _gru(cfg, h, z, q["act"], p)
            emb = md.elu(md.einsum("batch obs, obs embed -> batch embed", q["obs"], p["embed"]))
            prior, post = _stats(cfg, h, emb, p)
            z, kl = _latent_step(cfg, prior, post, q["noise"])
            zs = " ".join(x.name for x in lat)
            rec = (md.einsum("batch hidden, hidden obs -> batch obs", h, p["dec_h"])
                   + md.einsum(f"batch {zs}, {zs} obs -> batch obs", z, p["dec_z"]))
            rec_loss = md.reduce_sum((rec - q["obs"]) ** 2, "obs")
            zflat = md.rearrange(z, "batch latent classes -> batch (latent classes)") \
                if cfg.latent_kind == "cat" else md.rename(z, latent="latent_classes")
            new = md.concat([md.rename(h, hidden="state"), md.rename(zflat, latent_classes="state")], "state")
            return new, {"rec": rec_loss, "kl": kl}

        _, per_step = md.repeat(step, start, {"obs": obs, "act": act, "noise": noise}, "time", remat=cfg.remat)
        loss = md.reduce_mean(per_step["rec"]) + 0.5 * md.reduce_mean(per_step["kl"])

    def feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        t, b = cfg.time, cfg.batch
        shape = (t, b, cfg.latent, cfg.classes) if cfg.latent_kind == "cat" else (t, b, cfg.latent)
        u = torch.rand(shape, generator=gen).clamp(1e-6, 1 - 1e-6)
        nz = -torch.log(-torch.log(u)) if cfg.latent_kind == "cat" else torch.randn(shape, generator=gen)
        return {"obs": torch.randn(t, b, cfg.obs, generator=gen), "act": torch.randn(t, b, cfg.act, generator=gen),
                "noise": nz}

    return md.Model(g, loss, g.params(), feeds, cfg)
