"""TabNet (Arik & Pfister), a held-out model written from the docs alone: sequential attention
over tabular features with sparsemax masks.

Each decision step reads the features through a mask made by the attentive transformer (a
linear map of the previous step's attention features, scaled by the prior, then sparsemax over
the features), runs the feature transformer (two GLU blocks with a residual scaled by sqrt(0.5))
and splits its output into a decision part (summed over the steps, through a relu) and the
attention part the next step reads. The prior scale ``prior <- prior * (gamma - mask)`` makes a
feature used early less likely later; the sparsity regulariser is the mean entropy of the masks.

sparsemax(z) = relu(z - tau), tau = (sum of the support's z - 1) / |support|, the support being
the k largest z with 1 + k * z_(k) > z_(1) + .. + z_(k): the sort is ``md.top_k`` with k = all
features, the running sum ``md.cumsum`` over the ranks.

Forms (``--config form=...``):
  repeat:   the decision steps under ``md.repeat`` over ``step``, the carry being the prior, the
            attention features and the running decision sum joined by ``md.concat`` along
            ``state`` (and sliced apart in the block); each step's entropy is a per-step output.
  unrolled: the same steps as a Python loop over per-step params.

Legend: b batch, f features, d decision width, a attention width, c classes, s step.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 32
    features: int = 16
    d_dec: int = 8
    d_att: int = 8
    classes: int = 4
    steps: int = 2
    gamma: float = 1.3
    sparsity: float = 1e-3
    form: str = "repeat"
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(batch=8, features=6, d_dec=4, d_att=4, classes=3, steps=2)


def sparsemax(z, dim: str):
    """Sparsemax of ``z`` over ``dim`` (Martins & Astudillo), from top_k (a full sort) and cumsum."""
    n = z.shape[dim]
    zs, _ = md.top_k(z, dim, n.size, new_dim="rank")                 # z sorted, largest first
    k = md.cast(md.arange(md.Dim("rank", n.size)), torch.float32) + 1.0
    support = md.cast(md.greater(1.0 + k * zs, md.cumsum(zs, "rank")), torch.float32)
    tau = (md.reduce_sum(zs * support, "rank") - 1.0) / md.reduce_sum(support, "rank")
    return md.relu(z - tau)


def glu(x, w, src: str, out: str):
    """A GLU block: the linear map to 2x ``out`` wide, value times sigmoid(gate)."""
    y = md.einsum(f"batch {src}, {src} two {out} -> batch two {out}", x, w)
    return md.squeeze(md.slice_(y, "two", 0, 1), "two") * md.sigmoid(md.squeeze(md.slice_(y, "two", 1, 2), "two"))


def decision_step(x, prior, att, p, cfg):
    """One step: the mask from ``att`` and ``prior``, the features through it, the transformer.
    Returns (decision [batch, d_dec], new attention [batch, d_att], new prior, mask entropy)."""
    logits = md.einsum("batch d_att, d_att features -> batch features", att, p["w_att"]) * prior
    mask = sparsemax(md.layer_norm(logits, "features", p["ln"], p["ln_b"]), "features")
    h = glu(x * mask, p["w_glu1"], "features", "hid")
    h = (h + md.rename(glu(h, p["w_glu2"], "hid", "hid2"), hid2="hid")) * 0.5 ** 0.5
    dec = md.relu(md.rename(md.slice_(h, "hid", 0, cfg.d_dec), hid="d_dec"))
    new_att = md.rename(md.slice_(h, "hid", cfg.d_dec, cfg.d_dec + cfg.d_att), hid="d_att")
    entropy = md.reduce_mean(md.reduce_sum(-mask * md.log(mask + 1e-10), "features"))
    return dec, new_att, prior * (cfg.gamma - mask), entropy


def _params(cfg, S, suffix=""):
    """The step params: stacked over ``S`` (the repeat form), or one step's (``S`` None, names
    ending in ``suffix``)."""
    F, A, H = md.Dim("features", cfg.features), md.Dim("d_att", cfg.d_att), md.Dim("hid", cfg.d_dec + cfg.d_att)
    two, H2 = md.Dim("two", 2), md.Dim("hid2", cfg.d_dec + cfg.d_att)
    lead, fo = ([S], ["step"]) if S is not None else ([], [])
    return {
        "w_att": md.param(f"w_att{suffix}", lead + [A, F], fan_out=fo + ["features"]),
        "ln": md.param(f"ln{suffix}", lead + [F], init="ones"),
        "ln_b": md.param(f"ln_b{suffix}", lead + [F], init="zeros"),
        "w_glu1": md.param(f"w_glu1{suffix}", lead + [F, two, H], fan_out=fo + ["two", "hid"]),
        "w_glu2": md.param(f"w_glu2{suffix}", lead + [H, two, H2], fan_out=fo + ["two", "hid2"]),
    }


def _steps_repeat(x, att0, cfg, S, stacked):
    F, A, D = cfg.features, cfg.d_att, cfg.d_dec
    prior0 = md.broadcast_to(md.constant(1.0), [att0.shape["batch"], md.Dim("features", F)])
    acc0 = md.broadcast_to(md.constant(0.0), [att0.shape["batch"], md.Dim("d_dec", D)])
    state = md.concat([md.rename(prior0, features="state"), md.rename(att0, d_att="state"),
                       md.rename(acc0, d_dec="state")], "state")

    def block(s, p):
        prior = md.rename(md.slice_(s, "state", 0, F), state="features")
        att = md.rename(md.slice_(s, "state", F, F + A), state="d_att")
        acc = md.rename(md.slice_(s, "state", F + A, F + A + D), state="d_dec")
        dec, att, prior, ent = decision_step(x, prior, att, p, cfg)
        new = md.concat([md.rename(prior, features="state"), md.rename(att, d_att="state"),
                         md.rename(acc + dec, d_dec="state")], "state")
        return new, {"entropy": ent}

    s, per_step = md.repeat(block, state, stacked, S, remat=cfg.remat)
    out = md.rename(md.slice_(s, "state", F + A, F + A + D), state="d_dec")
    return out, md.reduce_mean(per_step["entropy"], "step")


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("repeat", "unrolled"):
        raise md.ModelError(f"tabnet: form={cfg.form!r}; expected 'repeat' or 'unrolled'")
    B, F, C = md.Dim("batch", cfg.batch), md.Dim("features", cfg.features), md.Dim("classes", cfg.classes)
    A, D = md.Dim("d_att", cfg.d_att), md.Dim("d_dec", cfg.d_dec)
    with md.Graph() as g:
        x = md.input("x", [B, F])
        labels = md.input("labels", [B], dtype=torch.int64)
        w_init = md.param("w_init", [F, A], fan_out=["d_att"])
        w_out = md.param("w_out", [D, C], fan_out=["classes"])
        att0 = md.einsum("batch features, features d_att -> batch d_att", x, w_init)
        params = {"w_init": w_init, "w_out": w_out}
        if cfg.form == "repeat":
            S = md.Dim("step", cfg.steps)
            stacked = _params(cfg, S)
            params.update(stacked)
            out, ent = _steps_repeat(x, att0, cfg, S, stacked)
        else:
            prior, att, out, ents = md.broadcast_to(md.constant(1.0), [B, F]), att0, None, []
            for t in range(cfg.steps):
                p = _params(cfg, None, str(t))
                params.update({f"{k}{t}": v for k, v in p.items()})
                dec, att, prior, e = decision_step(x, prior, att, p, cfg)
                out, ents = dec if out is None else out + dec, ents + [e]
            ent = sum(ents[1:], ents[0]) * (1.0 / cfg.steps)
        logits = md.einsum("batch d_dec, d_dec classes -> batch classes", out, w_out)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes")) + cfg.sparsity * ent

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        xs = torch.randn(cfg.batch, cfg.features, generator=gen)
        return {"x": xs, "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, params, make_feeds, cfg)

