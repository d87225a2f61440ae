"""A Whisper-style audio encoder-decoder, written from the README and docs/ alone (a held-out model).

The encoder reads log-mel frames ``[batch, frames, mels]``: a conv1d stem (kernel 3, GELU)
then a second conv of stride 2 (kernel 3, padding 1, GELU) that halves the time axis, fixed
sinusoidal positions (a constant), pre-LN blocks under ``md.repeat`` over ``enc_layer``. The
decoder embeds tokens with learned positions; its blocks under ``md.repeat`` over ``layer``
have causal self-attention, cross-attention to the encoder's output (read from outside the
repeat) and a GELU MLP; the head is tied to the token embedding.

This model was written when ``md.conv`` ran at stride 1 only, so the stride-2 conv is written the
way its arithmetic reads (``md.conv(..., stride=2)`` is the short form now): ``out[i] = x[2i-1] w[0] + x[2i] w[1] + x[2i+1] w[2]``. A rearrange cuts
the frames into ``(seq two)`` (even and odd frames), the odd stream shifted by one position
gives ``x[2i-1]``, and three einsums over the channels add the taps. Nothing is computed twice
and a split ``seq`` trades one row with its neighbour (``md.shift``).
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    mels: int = 16
    frames: int = 64        # the encoder's input length; its output has frames // 2 positions
    vocab: int = 64
    tgt: int = 16
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    enc_layers: int = 2
    layers: int = 2
    batch: int = 4
    stride_conv: bool = False   # the stride-2 conv as md.conv(..., stride=2) instead of written out

    @classmethod
    def tiny(cls) -> "Config":
        return cls(mels=8, frames=16, vocab=32, tgt=8, d_model=16, heads=2, d_head=8, d_ff=32,
                   enc_layers=2, layers=2, batch=4)


def sinusoids(length: int, channels: int) -> torch.Tensor:
    """Whisper's fixed positions: ``[length, channels]``, sines then cosines."""
    inc = math.log(10000) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


def conv_stride2(x: md.Tensor, w: md.Tensor) -> md.Tensor:
    """Kernel 3, stride 2, padding 1 along ``frames``: ``[batch, frames, c_in] -> [batch, seq, c_out]``."""
    pairs = md.rearrange(x, "batch (seq two) c_in -> batch seq two c_in", two=2)
    even = md.squeeze(md.slice_(pairs, "two", 0, 1), "two")           # x[2i]
    odd = md.squeeze(md.slice_(pairs, "two", 1, 2), "two")            # x[2i+1]
    before = md.shift(odd, "seq", 1)                                  # x[2i-1], zero at i = 0

    def tap(t: int, xs: md.Tensor) -> md.Tensor:
        wt = md.squeeze(md.slice_(w, "tap", t, t + 1), "tap")
        return md.einsum("batch seq c_in, c_in c_out -> batch seq c_out", xs, wt)

    return tap(0, before) + tap(1, even) + tap(2, odd)


def attention(xq: md.Tensor, xkv: md.Tensor, p: dict[str, md.Tensor], pre: str, causal: bool) -> md.Tensor:
    """Multi-head attention of ``xq [batch, q, d_model]`` over ``xkv [batch, key, d_model]``."""
    qd, kd = xq.shape.names[1], xkv.shape.names[1]
    kname = "key_" + kd if kd == qd else kd
    q = md.einsum(f"batch {qd} d_model, d_model heads d_head -> batch {qd} heads d_head", xq, p[pre + "wq"])
    k = md.einsum(f"batch {kd} d_model, d_model heads d_head -> batch {kd} heads d_head", xkv, p[pre + "wk"])
    v = md.einsum(f"batch {kd} d_model, d_model heads d_head -> batch {kd} heads d_head", xkv, p[pre + "wv"])
    if kname != kd:
        k, v = md.rename(k, {kd: kname}), md.rename(v, {kd: kname})
    o = md.attention(q, k, v, qd, kname, "d_head", causal=causal)
    return md.einsum(f"batch {qd} heads d_head, heads d_head d_model -> batch {qd} d_model", o, p[pre + "wo"])


def mlp(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
    pos = x.shape.names[1]
    h = md.layer_norm(x, "d_model", p["ln_mlp"], p["ln_mlp_b"])
    h = md.gelu(md.einsum(f"batch {pos} d_model, d_model d_ff -> batch {pos} d_ff", h, p["w1"]) + p["b1"])
    return md.einsum(f"batch {pos} d_ff, d_ff d_model -> batch {pos} d_model", h, p["w2"]) + p["b2"]


def _stack(layer: md.Dim, d_model: md.Dim, heads: md.Dim, d_head: md.Dim, d_ff: md.Dim, prefix: str,
           attns: tuple[str, ...]) -> dict[str, md.Tensor]:
    ps = {}
    for a in attns:
        ps[f"ln_{a}"] = md.param(f"{prefix}ln_{a}", [layer, d_model], init="ones")
        ps[f"ln_{a}_b"] = md.param(f"{prefix}ln_{a}_b", [layer, d_model], init="zeros")
        for w in ("wq", "wk", "wv"):
            ps[f"{a}_{w}"] = md.param(f"{prefix}{a}_{w}", [layer, d_model, heads, d_head], fan_out=[layer, heads, d_head])
        ps[f"{a}_wo"] = md.param(f"{prefix}{a}_wo", [layer, heads, d_head, d_model], fan_out=[layer, d_model])
    ps["ln_mlp"] = md.param(f"{prefix}ln_mlp", [layer, d_model], init="ones")
    ps["ln_mlp_b"] = md.param(f"{prefix}ln_mlp_b", [layer, d_model], init="zeros")
    ps["w1"] = md.param(f"{prefix}w1", [layer, d_model, d_ff], fan_out=[layer, d_ff])
    ps["b1"] = md.param(f"{prefix}b1", [layer, d_ff], init="zeros")
    ps["w2"] = md.param(f"{prefix}w2", [layer, d_ff, d_model], fan_out=[layer, d_model])
    ps["b2"] = md.param(f"{prefix}b2", [layer, d_model], init="zeros")
    return ps


def build(cfg: Config = Config()) -> md.Model:
    assert cfg.frames % 2 == 0
    batch, frames, mels = md.Dim("batch", cfg.batch), md.Dim("frames", cfg.frames), md.Dim("mels", cfg.mels)
    seq, tgt, vocab = md.Dim("seq", cfg.frames // 2), md.Dim("tgt", cfg.tgt), md.Dim("vocab", cfg.vocab)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, tap = md.Dim("d_ff", cfg.d_ff), md.Dim("tap", 3)
    enc_layer, layer = md.Dim("enc_layer", cfg.enc_layers), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_whisper") as g:
        audio = md.input("audio", [batch, frames, mels])
        ids = md.input("ids", [batch, tgt], dtype=torch.int64)
        labels = md.input("labels", [batch, tgt], dtype=torch.int64)
        conv1 = md.param("conv1", [tap, mels, d_model], fan_out=[d_model])
        conv1_b = md.param("conv1_b", [d_model], init="zeros")
        conv2 = md.param("conv2", [tap, md.Dim("c_in", cfg.d_model), md.Dim("c_out", cfg.d_model)], fan_out=["c_out"])
        conv2_b = md.param("conv2_b", [d_model], init="zeros")
        enc = _stack(enc_layer, d_model, heads, d_head, d_ff, "enc_", ("self",))
        dec = _stack(layer, d_model, heads, d_head, d_ff, "dec_", ("self", "cross"))
        enc_ln = md.param("enc_ln", [d_model], init="ones")
        enc_ln_b = md.param("enc_ln_b", [d_model], init="zeros")
        wte = md.param("wte", [vocab, d_model], scale=0.02)
        wpe = md.param("wpe", [tgt, d_model], scale=0.01)
        dec_ln = md.param("dec_ln", [d_model], init="ones")
        dec_ln_b = md.param("dec_ln_b", [d_model], init="zeros")

        # the stem: [batch, frames, mels] -> [batch, seq, d_model]
        h = md.gelu(md.conv(audio, conv1, {"frames": "tap"}, padding="same") + conv1_b)
        h = md.rename(h, d_model="c_in")
        if cfg.stride_conv:   # (md.conv's stride=, added after this model was first written)
            h = md.rename(md.conv(h, conv2, {"frames": "tap"}, padding=(1, 1), stride=2), frames="seq")
        else:
            h = conv_stride2(h, conv2)
        h = md.rename(h, c_out="d_model")
        x = md.gelu(h + conv2_b) + md.constant(sinusoids(cfg.frames // 2, cfg.d_model), [seq, d_model])

        def enc_block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.layer_norm(x, "d_model", p["ln_self"], p["ln_self_b"])
            x = x + attention(h, h, p, "self_", causal=False)
            return x + mlp(x, p)

        memory = md.repeat(enc_block, x, enc, "enc_layer")
        memory = md.layer_norm(memory, "d_model", enc_ln, enc_ln_b)

        def dec_block(y: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.layer_norm(y, "d_model", p["ln_self"], p["ln_self_b"])
            y = y + attention(h, h, p, "self_", causal=True)
            h = md.layer_norm(y, "d_model", p["ln_cross"], p["ln_cross_b"])
            y = y + attention(h, memory, p, "cross_", causal=False)
            return y + mlp(y, p)

        y = md.gather(wte, ids, "vocab") + wpe
        y = md.repeat(dec_block, y, dec, "layer")
        y = md.layer_norm(y, "d_model", dec_ln, dec_ln_b)
        logits = md.einsum("batch tgt d_model, vocab d_model -> batch tgt vocab", y, wte)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.tgt + 1), generator=gen)
        return {"audio": torch.randn(cfg.batch, cfg.frames, cfg.mels, generator=gen),
                "ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    params = {"conv1": conv1, "conv1_b": conv1_b, "conv2": conv2, "conv2_b": conv2_b,
              **{f"enc_{k}": v for k, v in enc.items()}, "enc_ln": enc_ln, "enc_ln_b": enc_ln_b,
              "wte": wte, "wpe": wpe, **{f"dec_{k}": v for k, v in dec.items()}, "dec_ln": dec_ln, "dec_ln_b": dec_ln_b}
    return md.Model(g, loss, params, feeds, cfg)
