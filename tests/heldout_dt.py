"""A Decision Transformer, written from the README and docs/ alone (a held-out model).

A trajectory of ``steps`` timesteps: returns-to-go ``[batch, step]``, states ``[batch, step,
state_dim]`` and discrete actions ``[batch, step]``. Each becomes a token (a linear map of the
return, of the state, an action embedding), plus a learned timestep embedding; the three are
interleaved as (return, state, action) per step: stacked on a ``kind`` dim and rearranged into
one ``seq`` of ``3 * steps`` tokens. A causal GPT runs over them; the outputs are rearranged back
to ``[batch, step, kind, d_model]`` and the STATE tokens' outputs (``kind`` 1) predict each step's
action (cross-entropy over ``actions``), so an action is predicted from the return and state of its
step and everything before. ``interleave="concat"`` builds the sequence with a concat over
``kind`` instead of a one-hot placement einsum (``"einsum"``).

Legend: b batch, t step, k kind, s seq, d d_model, h heads, e d_head, f d_ff, a actions.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    steps: int = 8
    state_dim: int = 6
    actions: int = 4
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    batch: int = 8
    interleave: str = "concat"   # or "einsum"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(steps=4, state_dim=3, actions=3, d_model=16, heads=2, d_head=8, d_ff=32, layers=2, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    if cfg.interleave not in ("concat", "einsum"):
        raise ValueError(f"interleave must be 'concat' or 'einsum', not {cfg.interleave!r}")
    b, t, sd = md.Dim("batch", cfg.batch), md.Dim("step", cfg.steps), md.Dim("state_dim", cfg.state_dim)
    a, d, h = md.Dim("actions", cfg.actions), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    e, f, L = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    kind = md.Dim("kind", 3)
    s, ks = md.Dim("seq", 3 * cfg.steps), md.Dim("key_seq", 3 * cfg.steps)
    with md.Graph("heldout_dt") as graph:
        rtg = md.input("rtg", [b, t])
        states = md.input("states", [b, t, sd])
        acts = md.input("acts", [b, t], dtype=torch.int64)
        w_r, b_r = md.param("w_r", [d], scale=0.5), md.param("b_r", [d], scale=0.1)
        w_s = md.param("w_s", [sd, d], fan_out=["d_model"])
        a_emb = md.param("a_emb", [a, d], scale=0.5)
        t_emb = md.param("t_emb", [t, d], scale=0.1)
        p = {
            "ln1": md.param("ln1", [L, d], init="ones"), "ln1_b": md.param("ln1_b", [L, d], init="zeros"),
            "wq": md.param("wq", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [L, h, e, d], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [L, d], init="ones"), "ln2_b": md.param("ln2_b", [L, d], init="zeros"),
            "w1": md.param("w1", [L, d, f], fan_out=["layer", "d_ff"]),
            "w2": md.param("w2", [L, f, d], fan_out=["layer", "d_model"]),
        }
        lnf, lnf_b = md.param("lnf", [d], init="ones"), md.param("lnf_b", [d], init="zeros")
        w_act = md.param("w_act", [d, a], fan_out=["actions"])

        r_tok = rtg * w_r + b_r + t_emb                                                  # [b, t, d]
        s_tok = md.einsum("batch step state_dim, state_dim d_model -> batch step d_model", states, w_s) + t_emb
        a_tok = md.gather(a_emb, acts, "actions") + t_emb
        if cfg.interleave == "concat":
            toks = md.concat([md.unsqueeze(x, "kind", 2) for x in (r_tok, s_tok, a_tok)], "kind")
        else:   # each token kind placed by a one-hot row of the [kind] placement
            place = md.constant(torch.eye(3), [md.Dim("src", 3), kind])
            stacked = md.concat([md.unsqueeze(x, "src", 2) for x in (r_tok, s_tok, a_tok)], "src")
            toks = md.einsum("batch step src d_model, src kind -> batch step kind d_model", stacked, place)
        x0 = md.rearrange(toks, "batch step kind d_model -> batch (step kind) d_model", kind=3)
        x0 = md.rename(x0, **{x0.shape.names[1]: "seq"}) if x0.shape.names[1] != "seq" else x0

        def block(x, p):
            n = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", n, p["wq"])
            nk = md.rename(n, seq="key_seq")
            k = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", nk, p["wk"])
            v = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", nk, p["wv"])
            o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            n = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
            y = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", n, p["w1"]))
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", y, p["w2"])

        x = md.repeat(block, x0, p, "layer", remat=cfg.remat)
        x = md.layer_norm(x, "d_model", lnf, lnf_b)
        per_step = md.rearrange(x, "batch (step kind) d_model -> batch step kind d_model", kind=3)
        state_out = md.squeeze(md.slice_(per_step, "kind", 1, 2), "kind")
        logits = md.einsum("batch step d_model, d_model actions -> batch step actions", state_out, w_act)
        loss = md.reduce_mean(md.cross_entropy(logits, acts, "actions"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        states = torch.randn(cfg.batch, cfg.steps, cfg.state_dim, generator=g)
        acts = (states[..., 0] > 0).long() + (states[..., 1] > 0.5).long()
        rtg = torch.rand(cfg.batch, cfg.steps, generator=g).flip(1).cumsum(1).flip(1)
        return {"rtg": rtg, "states": states, "acts": acts % cfg.actions}

    params = {"w_r": w_r, "b_r": b_r, "w_s": w_s, "a_emb": a_emb, "t_emb": t_emb, **p,
              "lnf": lnf, "lnf_b": lnf_b, "w_act": w_act}
    return md.Model(graph, loss, params, feeds, cfg, logits=logits)
