"""Held-out model (round 26d): a Tacotron-lite decoder with location-sensitive attention.

Written from README.md and docs/guide/*.md only. An encoder (embedding, one tanh layer) makes
`memory [batch, enc_seq, d_enc]`; the decoder is an `md.repeat` over `frames` whose carry is the
tuple (state [batch, d_dec], attention weights [batch, enc_seq]). Each step reads the previous
mel frame (teacher forcing) through a prenet, convolves the previous weights along `enc_seq`
(the location features), attends, updates the state (a GRU-like cell) and emits a mel frame and
a stop logit as per-step outputs. Loss: mel MSE + stop-token binary cross-entropy.

Legend: b batch, s enc_seq, f frames, v vocab, e d_enc, d d_dec, i dec_in (the state a matmul
reads), a d_att, n n_mel, p d_pre, k tap, l loc_f (location filters), c loc_in (1 channel).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 4
    enc_seq: int = 16
    frames: int = 12
    vocab: int = 20
    d_enc: int = 16
    d_dec: int = 16
    d_att: int = 8
    n_mel: int = 8
    d_pre: int = 8
    loc_f: int = 4
    taps: int = 5
    remat: str | None = None

    @classmethod
    def tiny(cls):
        return cls(batch=4, enc_seq=6, frames=4, vocab=9, d_enc=5, d_dec=6, d_att=4, n_mel=3, d_pre=4,
                   loc_f=2, taps=3)


def attend(state, prev_w, memory, proc_mem, p):
    """Location-sensitive attention: energies from the state, the memory and a conv of prev_w."""
    loc = md.conv(md.unsqueeze(prev_w, "loc_in"), p["w_loc"], {"enc_seq": "tap"}, padding="same")
    e = md.tanh(md.einsum("batch dec_in, dec_in d_att -> batch d_att", md.rename(state, d_dec="dec_in"), p["w_q"])
                + proc_mem + md.einsum("batch enc_seq loc_f, loc_f d_att -> batch enc_seq d_att", loc, p["w_lf"]))
    w = md.softmax(md.einsum("batch enc_seq d_att, d_att -> batch enc_seq", e, p["v_att"]), "enc_seq")
    return w, md.einsum("batch enc_seq, batch enc_seq d_enc -> batch d_enc", w, memory)


def cell(state, pre, ctx, p):
    """A GRU-like update of the decoder state from the prenet output and the context."""
    def lin(name):
        return (md.einsum("batch dec_in, dec_in d_dec -> batch d_dec", md.rename(state, d_dec="dec_in"), p[f"u_{name}"])
                + md.einsum("batch d_pre, d_pre d_dec -> batch d_dec", pre, p[f"w_{name}"])
                + md.einsum("batch d_enc, d_enc d_dec -> batch d_dec", ctx, p[f"c_{name}"]))
    z, cand = md.sigmoid(lin("z")), md.tanh(lin("h"))
    return (1.0 - z) * state + z * cand


def build(cfg: Config) -> md.Model:
    b, s, f = md.Dim("batch", cfg.batch), md.Dim("enc_seq", cfg.enc_seq), md.Dim("frames", cfg.frames)
    v, e, d, i = md.Dim("vocab", cfg.vocab), md.Dim("d_enc", cfg.d_enc), md.Dim("d_dec", cfg.d_dec), md.Dim("dec_in", cfg.d_dec)
    a, n, pr = md.Dim("d_att", cfg.d_att), md.Dim("n_mel", cfg.n_mel), md.Dim("d_pre", cfg.d_pre)
    k, lf, lc = md.Dim("tap", cfg.taps), md.Dim("loc_f", cfg.loc_f), md.Dim("loc_in", 1)
    with md.Graph() as graph:
        text = md.input("text", [b, s], dtype=torch.int64)
        mel = md.input("mel", [b, f, n])
        stop = md.input("stop", [b, f])
        emb = md.param("emb", [v, e], scale=1.0)
        w_enc = md.param("w_enc", [e, md.Dim("d_enc_out", cfg.d_enc)], fan_out=["d_enc_out"])
        p = {"w_loc": md.param("w_loc", [k, lc, lf], fan_out=["loc_f"]),
             "w_q": md.param("w_q", [i, a], fan_out=["d_att"]), "w_lf": md.param("w_lf", [lf, a], fan_out=["d_att"]),
             "v_att": md.param("v_att", [a], fan_out=[])}
        for g in ("z", "h"):
            p[f"u_{g}"] = md.param(f"u_{g}", [i, d], fan_out=["d_dec"])
            p[f"w_{g}"] = md.param(f"w_{g}", [pr, d], fan_out=["d_dec"])
            p[f"c_{g}"] = md.param(f"c_{g}", [e, d], fan_out=["d_dec"])
        w_pre, w_mem = md.param("w_pre", [n, pr], fan_out=["d_pre"]), md.param("w_mem", [e, a], fan_out=["d_att"])
        w_mel = md.param("w_mel", [d, n], fan_out=["n_mel"])
        w_ctx_mel = md.param("w_ctx_mel", [e, n], fan_out=["n_mel"])
        w_stop = md.param("w_stop", [d], fan_out=[])

        memory = md.rename(md.tanh(md.einsum("batch enc_seq d_enc, d_enc d_enc_out -> batch enc_seq d_enc_out",
                                             md.gather(emb, text, "vocab"), w_enc)), d_enc_out="d_enc")
        proc_mem = md.einsum("batch enc_seq d_enc, d_enc d_att -> batch enc_seq d_att", memory, w_mem)  # once, not per frame
        # teacher forcing: frame t reads the true frame t - 1 (a zero "go" frame first)
        prev = md.pad(md.slice_(mel, "frames", 0, cfg.frames - 1), "frames", 1, 0)
        prev_fbn = md.transpose(prev, ["frames", "batch", "n_mel"])
        w0 = md.constant(1.0 / cfg.enc_seq, [b, s])

        def step(carry, x):
            state, prev_w = carry
            pre = md.relu(md.einsum("batch n_mel, n_mel d_pre -> batch d_pre", x["prev"], w_pre))
            w, ctx = attend(state, prev_w, memory, proc_mem, p)
            state = cell(state, pre, ctx, p)
            out = (md.einsum("batch d_dec, d_dec n_mel -> batch n_mel", state, w_mel)
                   + md.einsum("batch d_enc, d_enc n_mel -> batch n_mel", ctx, w_ctx_mel))
            return (state, w), {"mel": out, "stop": md.einsum("batch d_dec, d_dec -> batch", state, w_stop)}

        zero = md.constant(0.0, [b, d])
        _, per = md.repeat(step, (zero, w0), {"prev": prev_fbn}, "frames", remat=cfg.remat)
        mel_err = md.transpose(per["mel"], ["batch", "frames", "n_mel"]) - mel
        logit = md.transpose(per["stop"], ["batch", "frames"])
        bce = -(stop * md.log_sigmoid(logit) + (1.0 - stop) * md.log_sigmoid(-logit))
        loss = md.reduce_mean(mel_err ** 2) + md.reduce_mean(bce)

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        text = torch.randint(0, cfg.vocab, (cfg.batch, cfg.enc_seq), generator=gen)
        mel = torch.cumsum(0.3 * torch.randn(cfg.batch, cfg.frames, cfg.n_mel, generator=gen), 1)
        ends = torch.randint(cfg.frames // 2, cfg.frames, (cfg.batch, 1), generator=gen)
        return {"text": text, "mel": mel, "stop": (torch.arange(cfg.frames) >= ends).float()}

    return md.Model(graph, loss, graph.params(), make_feeds, cfg)


# ----------------------------------------------------------------------------- torch reference

REF_INPUTS = ["text", "mel", "stop"]


def reference_loss(cfg: Config, p: dict, text, mel, stop):
    """The same decoder in plain torch: a loop over frames, F.conv1d for the location features."""
    F = torch.nn.functional
    memory = torch.tanh(p["emb"][text] @ p["w_enc"])
    proc = memory @ p["w_mem"]
    state = torch.zeros(cfg.batch, cfg.d_dec, dtype=memory.dtype)
    w = torch.full((cfg.batch, cfg.enc_seq), 1.0 / cfg.enc_seq, dtype=memory.dtype)
    prev = torch.cat([torch.zeros_like(mel[:, :1]), mel[:, :-1]], 1)
    conv_w = p["w_loc"].permute(2, 1, 0)                     # [loc_f, 1, tap]
    mels, stops = [], []
    for t in range(cfg.frames):
        pre = torch.relu(prev[:, t] @ p["w_pre"])
        loc = F.conv1d(w[:, None], conv_w, padding=cfg.taps // 2).transpose(1, 2)
        e = torch.tanh((state @ p["w_q"])[:, None] + proc + loc @ p["w_lf"])
        w = torch.softmax(e @ p["v_att"], -1)
        ctx = torch.einsum("bs,bse->be", w, memory)
        z = torch.sigmoid(state @ p["u_z"] + pre @ p["w_z"] + ctx @ p["c_z"])
        cand = torch.tanh(state @ p["u_h"] + pre @ p["w_h"] + ctx @ p["c_h"])
        state = (1 - z) * state + z * cand
        mels.append(state @ p["w_mel"] + ctx @ p["w_ctx_mel"])
        stops.append(state @ p["w_stop"])
    mse = ((torch.stack(mels, 1) - mel) ** 2).mean()
    return mse + F.binary_cross_entropy_with_logits(torch.stack(stops, 1), stop)
