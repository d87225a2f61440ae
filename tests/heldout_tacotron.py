"""Held-out model (round 20a): Tacotron-lite, written from the docs alone.

Encoder: character embedding + two 'same' convs over ``enc_seq`` (relu), a linear memory
projection for the attention. Decoder: a recurrence over mel ``frames`` (the outermost
``md.repeat`` scans it; teacher forcing: each step reads the previous target frame, a stacked
input): a relu prenet, a tanh RNN cell on [prenet, previous context], location-sensitive
attention (a conv over the previous attention weights and their running sum feeds the
energies ``v . tanh(W q + V memory + U f)``, masked beyond each text's fed length), the context,
a mel frame and a stop logit per step. The carry is one tensor: the decoder state, the
context, the attention weights and their running sum, each renamed to ``state`` and joined.
Loss: mel L1 + the stop token's binary cross-entropy (written with ``md.log_sigmoid``).

Legend: b batch, n enc_seq, c channels, a att, d d_dec, m n_mels, p d_pre, f frames.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 4
    enc_seq: int = 24
    frames: int = 16
    chars: int = 32
    channels: int = 32
    att: int = 16
    d_dec: int = 32
    d_pre: int = 16
    n_mels: int = 8
    loc_filters: int = 4
    loc_taps: int = 5
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, enc_seq=7, frames=4, chars=9, channels=6, att=4, d_dec=5, d_pre=3, n_mels=3,
                   loc_filters=2, loc_taps=3)


def _encoder(ids, lengths, w):
    e = md.gather(w["emb"], ids, "chars")
    for n in range(2):
        e = md.rename(md.relu(md.conv(e, w[f"conv{n}"], {"enc_seq": "tap"}) + w[f"conv{n}_b"]), c_out="channels")
    keep = md.less(md.arange(e.shape["enc_seq"]), lengths)          # [enc_seq, batch]
    return e * md.cast(keep, torch.float32), keep


def _split_state(s, cfg):
    sizes = [("d_dec", cfg.d_dec), ("channels", cfg.channels), ("enc_seq", cfg.enc_seq), ("enc_seq", cfg.enc_seq)]
    parts, at = [], 0
    for name, size in sizes:
        parts.append(md.rename(md.slice_(s, "state", at, at + size), state=name))
        at += size
    return parts


def _join_state(parts):
    return md.concat([md.rename(t, {t.shape.names[-1]: "state"}) for t in parts], "state")


def _step(s, p, w, enc, cfg):
    h, ctx, align, cum = _split_state(s, cfg)
    memory, keys, keep = enc
    pre = md.relu(md.einsum("batch n_mels, n_mels d_pre -> batch d_pre", p["prev"], w["prenet"]))
    h = md.tanh(md.einsum("batch d_pre, d_pre d_dec -> batch d_dec", pre, w["rnn_x"])
                + md.einsum("batch channels, channels d_dec -> batch d_dec", ctx, w["rnn_c"])
                + md.rename(md.einsum("batch d_dec, d_dec d_out -> batch d_out", h, w["rnn_h"]), d_out="d_dec"))
    loc_in = md.concat([md.unsqueeze(align, md.Dim("loc_in", 1)), md.unsqueeze(cum, md.Dim("loc_in", 1))], "loc_in")
    loc = md.conv(loc_in, w["loc_conv"], {"enc_seq": "tap"})                           # [batch, enc_seq, loc_f]
    energy_in = md.einsum("batch d_dec, d_dec att -> batch att", h, w["query"]) + keys \
        + md.einsum("batch enc_seq loc_f, loc_f att -> batch enc_seq att", loc, w["loc_proj"])
    energy = md.einsum("batch enc_seq att, att -> batch enc_seq", md.tanh(energy_in), w["v"])
    align = md.softmax(md.where(keep, energy, -1e9), "enc_seq")
    ctx = md.einsum("batch enc_seq, batch enc_seq channels -> batch channels", align, memory)
    mel = md.einsum("batch d_dec, d_dec n_mels -> batch n_mels", h, w["mel_h"]) \
        + md.einsum("batch channels, channels n_mels -> batch n_mels", ctx, w["mel_c"])
    stop = md.einsum("batch d_dec, d_dec -> batch", h, w["stop_h"]) + md.einsum("batch channels, channels -> batch", ctx, w["stop_c"])
    return _join_state([h, ctx, align, cum + align]), {"mel": mel, "stop": stop}


def _weights(cfg):
    c, a, d = md.Dim("channels", cfg.channels), md.Dim("att", cfg.att), md.Dim("d_dec", cfg.d_dec)
    m, pr, ch = md.Dim("n_mels", cfg.n_mels), md.Dim("d_pre", cfg.d_pre), md.Dim("chars", cfg.chars)
    tap, co, d_out = md.Dim("tap", 3), md.Dim("c_out", cfg.channels), md.Dim("d_out", cfg.d_dec)
    lt, li, lf = md.Dim("tap", cfg.loc_taps), md.Dim("loc_in", 2), md.Dim("loc_f", cfg.loc_filters)
    w = {"emb": md.param("emb", [ch, c], scale=0.5)}
    for n in range(2):
        w[f"conv{n}"] = md.param(f"conv{n}", [tap, c, co], fan_out=["c_out"])
        w[f"conv{n}_b"] = md.param(f"conv{n}_b", [co], init="zeros")
    for name, dims, fan in [("memory", [c, a], ["att"]), ("prenet", [m, pr], ["d_pre"]), ("rnn_x", [pr, d], ["d_dec"]),
                            ("rnn_c", [c, d], ["d_dec"]), ("rnn_h", [d, d_out], ["d_out"]), ("loc_conv", [lt, li, lf], ["loc_f"]),
                            ("query", [d, a], ["att"]), ("loc_proj", [lf, a], ["att"]), ("v", [a], []),
                            ("mel_h", [d, m], ["n_mels"]), ("mel_c", [c, m], ["n_mels"]), ("stop_h", [d], []),
                            ("stop_c", [c], [])]:
        w[name] = md.param(name, dims, fan_out=fan)
    return w


def build(cfg: Config = Config()) -> md.Model:
    b, n, f = md.Dim("batch", cfg.batch), md.Dim("enc_seq", cfg.enc_seq), md.Dim("frames", cfg.frames)
    m = md.Dim("n_mels", cfg.n_mels)
    with md.Graph("tacotron") as g:
        ids = md.input("text", [b, n], dtype=torch.int64)
        lengths = md.input("text_len", [b], dtype=torch.int64)
        mels = md.input("mels", [f, b, m])
        prev = md.input("prev_mels", [f, b, m])
        stop_target = md.input("stop", [f, b])
        w = _weights(cfg)
        memory, keep = _encoder(ids, lengths, w)
        keys = md.einsum("batch enc_seq channels, channels att -> batch enc_seq att", memory, w["memory"])
        first = md.concat([md.constant(1.0, [b, md.Dim("enc_seq", 1)]), md.constant(0.0, [b, md.Dim("enc_seq", cfg.enc_seq - 1)])], "enc_seq")
        s0 = _join_state([md.constant(0.0, [b, md.Dim("d_dec", cfg.d_dec)]), md.constant(0.0, [b, md.Dim("channels", cfg.channels)]),
                          first, first])
        _, out = md.repeat(lambda s, p: _step(s, p, w, (memory, keys, keep), cfg), s0, {"prev": prev}, "frames",
                           remat=cfg.remat)
        mel_l1 = md.reduce_mean(md.abs(out["mel"] - mels))
        bce = -md.reduce_mean(stop_target * md.log_sigmoid(out["stop"]) + (1 - stop_target) * md.log_sigmoid(-out["stop"]))
        loss = mel_l1 + bce

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        text = torch.randint(1, cfg.chars, (cfg.batch, cfg.enc_seq), generator=gen)
        length = torch.randint(cfg.enc_seq // 2, cfg.enc_seq + 1, (cfg.batch,), generator=gen)
        text = torch.where(torch.arange(cfg.enc_seq) < length[:, None], text, 0)
        # A mel frame per step: a smooth function of the character under a monotonic read head.
        head = (torch.arange(cfg.frames)[:, None] * length[None, :] / cfg.frames).long()   # [frames, batch]
        char = torch.gather(text.T, 0, head.clamp(max=cfg.enc_seq - 1))
        mel = torch.sin(char[..., None] * (1 + torch.arange(cfg.n_mels)) / cfg.chars * 3.0)
        prev_ = torch.cat([torch.zeros(1, cfg.batch, cfg.n_mels), mel[:-1]])
        n_frames = torch.clamp((length * cfg.frames + cfg.enc_seq - 1) // cfg.enc_seq, max=cfg.frames)
        stop_ = (torch.arange(cfg.frames)[:, None] >= n_frames[None, :] - 1).float()
        return {"text": text, "text_len": length, "mels": mel.float(), "prev_mels": prev_, "stop": stop_}

    return md.Model(g, loss, g.params(), feeds, cfg)
