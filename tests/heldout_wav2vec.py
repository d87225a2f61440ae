"""A wav2vec 2.0-style speech encoder, written from the README and docs/ alone (a held-out model).

A raw waveform ``[batch, time]`` goes through a feature extractor of strided 1-D convs (``md.conv``
with ``stride=2``, gelu, a layer norm over channels) to ``frames``; a projection to ``d_model``;
masked spans (a ``[batch, frames]`` mask fed in) replaced by a learned mask embedding; a
depthwise positional conv added; pre-norm Transformer layers (non-causal). The targets are the
extractor's features QUANTISED: each frame's nearest codebook entry picked by ``md.top_k`` over
``codes`` (k=1) of the logits, as a one-hot, straight-through (``soft + stop_gradient(hard - soft)``).
The loss is contrastive at the masked frames: the context vector of frame ``i`` against the
quantised targets of every frame ``j`` of the same utterance (cosine similarity over a
temperature, cross-entropy for ``j = i``), averaged over masked frames; plus a codebook
diversity term (the entropy of the batch-averaged code distribution).

Legend: b batch, w time, c chan, r frames, d d_model, h heads, e d_head, f d_ff, q codes, o code_dim.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    time: int = 64
    chan: int = 16
    convs: int = 2
    taps: int = 3
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    codes: int = 8
    code_dim: int = 16
    pos_taps: int = 3
    batch: int = 4
    temp: float = 0.5
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(time=32, chan=8, convs=2, taps=3, d_model=16, heads=2, d_head=8, d_ff=32, layers=2,
                   codes=6, code_dim=8, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    nframes = cfg.time // 2 ** cfg.convs
    b, c, r = md.Dim("batch", cfg.batch), md.Dim("chan", cfg.chan), md.Dim("frames", nframes)
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, L = md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    q_, o = md.Dim("codes", cfg.codes), md.Dim("code_dim", cfg.code_dim)
    tap, ptap = md.Dim("tap", cfg.taps), md.Dim("ptap", cfg.pos_taps)
    with md.Graph("heldout_wav2vec") as graph:
        wav = md.input("wav", [b, md.Dim("time", cfg.time)])
        span = md.input("span", [b, r], dtype=torch.bool)
        convs = []
        x = md.rename(md.unsqueeze(wav, "c_in", 2), time="frames")                  # [b, time, 1]
        # the frames dim is renamed 'frames' from the start: each stride-2 conv halves it
        for i in range(cfg.convs):
            cin = 1 if i == 0 else cfg.chan
            w = md.param(f"conv{i}", [tap, md.Dim("c_in", cin), md.Dim("c_out", cfg.chan)], fan_out=["c_out"])
            g, gb = md.param(f"conv{i}_ln", [c], init="ones"), md.param(f"conv{i}_ln_b", [c], init="zeros")
            convs += [w, g, gb]
            y = md.rename(md.conv(x, w, {"frames": "tap"}, stride=2), c_out="chan")
            x = md.gelu(md.layer_norm(y, "chan", g, gb))
            if i < cfg.convs - 1:
                x = md.rename(x, chan="c_in")
        feats = x                                                                      # [b, frames, chan]
        w_in = md.param("w_in", [c, d], fan_out=["d_model"])
        mask_emb = md.param("mask_emb", [d], scale=0.5)
        w_pos = md.param("w_pos", [ptap, d], fan_out=["d_model"])
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
        w_ctx = md.param("w_ctx", [d, o], fan_out=["code_dim"])
        w_code = md.param("w_code", [c, q_], fan_out=["codes"])
        codebook = md.param("codebook", [q_, o], scale=1.0)

        z = md.einsum("batch frames chan, chan d_model -> batch frames d_model", feats, w_in)
        z = md.where(span, mask_emb, z)
        z = z + md.conv(z, w_pos, {"frames": "ptap"})
        z = md.rename(z, frames="seq")

        def block(x, p):
            n = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
            qq = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", n, p["wq"])
            nk = md.rename(n, seq="key_seq")
            k = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", nk, p["wk"])
            v = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", nk, p["wv"])
            a = md.attention(qq, k, v, "seq", "key_seq", "d_head", causal=False)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", a, p["wo"])
            n = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
            y = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", n, p["w1"]))
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", y, p["w2"])

        ctx = md.repeat(block, z, p, "layer", remat=cfg.remat)
        ctx = md.einsum("batch seq d_model, d_model code_dim -> batch seq code_dim", ctx, w_ctx)

        code_logits = md.einsum("batch frames chan, chan codes -> batch frames codes", feats, w_code)
        soft = md.softmax(code_logits, "codes")
        _, idx = md.top_k(code_logits, "codes", 1, new_dim="pick")
        hard = md.one_hot(md.squeeze(idx, "pick"), q_)
        onehot = soft + md.stop_gradient(hard - soft)                                   # straight-through
        tgt = md.einsum("batch frames codes, codes code_dim -> batch frames code_dim", onehot, codebook)

        def unit(t, dim):
            return t * md.rsqrt(md.reduce_sum(t * t, dim) + 1e-6)

        sim = md.einsum("batch seq code_dim, batch frames code_dim -> batch seq frames",
                        unit(ctx, "code_dim"), unit(tgt, "code_dim")) / cfg.temp
        labels = md.broadcast_to(md.rename(md.arange(r), frames="seq"), [b, md.Dim("seq", nframes)])
        per = md.cross_entropy(sim, labels, "frames")                                    # [batch, seq]
        m = md.cast(md.rename(span, frames="seq"), torch.float32)
        contrastive = md.reduce_sum(per * m) / md.reduce_sum(m)
        avg = md.reduce_mean(soft, ["batch", "frames"])                                 # [codes]
        diversity = md.reduce_sum(avg * md.log(avg + 1e-7)) + float(torch.log(torch.tensor(float(cfg.codes))))
        loss = contrastive + 0.1 * diversity

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        t = torch.arange(cfg.time, dtype=torch.float32)
        freq = torch.rand(cfg.batch, 1, generator=g) * 0.5 + 0.1
        wav = torch.sin(freq * t) + 0.1 * torch.randn(cfg.batch, cfg.time, generator=g)
        span = torch.zeros(cfg.batch, nframes, dtype=torch.bool)
        for i in range(cfg.batch):   # one span of 3 frames per utterance
            s0 = int(torch.randint(0, nframes - 2, (1,), generator=g))
            span[i, s0:s0 + 3] = True
        return {"wav": wav, "span": span}

    params = {**{t.name: t for t in convs}, "w_in": w_in, "mask_emb": mask_emb, "w_pos": w_pos, **p,
              "w_ctx": w_ctx, "w_code": w_code, "codebook": codebook}
    return md.Model(graph, loss, params, feeds, cfg)
