"""Direct Preference Optimization of a GPT-style decoder, written from the README and docs/ alone
(a held-out model).

Dims: ``batch`` (preference pairs), ``pair`` (2: chosen, rejected), ``seq`` (``key_seq``),
``vocab``; the policy's ``layer``, ``d_model``, ``heads``, ``d_head``, ``d_ff``; the frozen
reference's ``ref_layer`` (a layer dim of its own name for the second stack) and the same
widths. Each pair shares a prompt; ``response [batch, pair, seq]`` is 1.0 on the response's
label positions and 0.0 on the prompt and the padding. A sequence's log-probability is the sum
over its response positions of the label's log-softmax (a one-hot contraction for the policy,
``-cross_entropy`` for the reference: the same number). The reference is frozen: its weights
(``ref.*``) are ``md.param``s left out of ``Model.params``, loaded with ``md.fit(init=...)``.
The loss is DPO's ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``, averaged over the
pairs (``softplus(-z)`` written stably as ``max(-z, 0) + log(1 + exp(-|z|))``).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 256
    layers: int = 2
    seq: int = 32
    batch: int = 8
    prompt: int = 8
    beta: float = 0.1

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=24, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, seq=8, batch=4, prompt=3, beta=0.5)


def _stack(prefix: str, layer, d_model, heads, d_head, d_ff) -> dict:
    L = layer.name
    return {
        "ln1": md.param(f"{prefix}ln1", [layer, d_model], init="ones"),
        "wq": md.param(f"{prefix}wq", [layer, d_model, heads, d_head], fan_out=[L, "heads", "d_head"]),
        "wk": md.param(f"{prefix}wk", [layer, d_model, heads, d_head], fan_out=[L, "heads", "d_head"]),
        "wv": md.param(f"{prefix}wv", [layer, d_model, heads, d_head], fan_out=[L, "heads", "d_head"]),
        "wo": md.param(f"{prefix}wo", [layer, heads, d_head, d_model], fan_out=[L, "d_model"]),
        "ln2": md.param(f"{prefix}ln2", [layer, d_model], init="ones"),
        "w_fc": md.param(f"{prefix}w_fc", [layer, d_model, d_ff], fan_out=[L, "d_ff"]),
        "w_proj": md.param(f"{prefix}w_proj", [layer, d_ff, d_model], fan_out=[L, "d_model"]),
    }


def _block(h, p):
    """A pre-norm causal decoder block over ``h [batch, pair, seq, d_model]``."""
    a = md.layer_norm(h, "d_model", p["ln1"])
    proj = lambda w: md.einsum("batch pair seq d_model, d_model heads d_head -> batch pair seq heads d_head", a, w)
    k, v = (md.rename(proj(p[w]), seq="key_seq") for w in ("wk", "wv"))
    o = md.attention(proj(p["wq"]), k, v, "seq", "key_seq", "d_head", causal=True)
    h = h + md.einsum("batch pair seq heads d_head, heads d_head d_model -> batch pair seq d_model", o, p["wo"])
    m = md.gelu(md.einsum("batch pair seq d_model, d_model d_ff -> batch pair seq d_ff",
                          md.layer_norm(h, "d_model", p["ln2"]), p["w_fc"]))
    return h + md.einsum("batch pair seq d_ff, d_ff d_model -> batch pair seq d_model", m, p["w_proj"])


def _softplus(x):
    return md.maximum(x, 0.0) + md.log(1.0 + md.exp(-md.abs(x)))


def build(cfg: Config = Config()) -> md.Model:
    batch, pair, seq = md.Dim("batch", cfg.batch), md.Dim("pair", 2), md.Dim("seq", cfg.seq)
    vocab, d_model = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    widths = (d_model, md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff))
    with md.Graph("heldout_dpo") as g:
        ids = md.input("ids", [batch, pair, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, pair, seq], dtype=torch.int64)
        response = md.input("response", [batch, pair, seq])

        def lm(prefix: str, layer_name: str):
            wte = md.param(f"{prefix}wte", [vocab, d_model], scale=0.1)
            wpe = md.param(f"{prefix}wpe", [seq, d_model], scale=0.02)
            blocks = _stack(prefix, md.Dim(layer_name, cfg.layers), *widths)
            lnf = md.param(f"{prefix}lnf", [d_model], init="ones")
            head = md.param(f"{prefix}head", [d_model, vocab], fan_out=["vocab"])
            h = md.repeat(_block, md.gather(wte, ids, "vocab") + wpe, blocks, layer_name)
            logits = md.einsum("batch pair seq d_model, d_model vocab -> batch pair seq vocab",
                               md.layer_norm(h, "d_model", lnf), head)
            params = {"wte": wte, "wpe": wpe, "lnf": lnf, "head": head, **blocks}
            return logits, {f"{prefix}{k}": v for k, v in params.items()}

        logits, params = lm("", "layer")
        ref_logits, _ = lm("ref.", "ref_layer")              # frozen: left out of the Model's params
        token_logp = md.reduce_sum(md.log_softmax(logits, "vocab") * md.one_hot(labels, vocab), "vocab")
        ref_token_logp = -md.cross_entropy(ref_logits, labels, "vocab")
        logp = md.reduce_sum(token_logp * response, "seq")                     # [batch, pair]
        ref_logp = md.reduce_sum(ref_token_logp * response, "seq")
        margin = logp - ref_logp                                              # the implicit reward / beta
        chosen, rejected = (md.squeeze(md.slice_(margin, "pair", i, i + 1), "pair") for i in (0, 1))
        z = cfg.beta * (chosen - rejected)                                    # [batch]
        loss = md.reduce_mean(_softplus(-z))
        accuracy = md.reduce_mean(md.cast(md.greater(z, 0.0), torch.float32))

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        """Each pair: one prompt, two responses of their own lengths, padded with token 0."""
        idx = range(cfg.batch)[rows or slice(None)]
        ids = torch.zeros(len(idx), 2, cfg.seq + 1, dtype=torch.int64)
        resp = torch.zeros(len(idx), 2, cfg.seq)
        for i, r in enumerate(idx):
            gen = md.row_generator(seed, r)
            prompt = torch.randint(1, cfg.vocab, (cfg.prompt,), generator=gen)
            for j in range(2):
                n = int(torch.randint(2, cfg.seq + 2 - cfg.prompt, (), generator=gen))   # response tokens
                ids[i, j, :cfg.prompt] = prompt
                # chosen responses count up from the prompt's last token, rejected ones are noise
                tail = (prompt[-1] + 1 + torch.arange(n)) % (cfg.vocab - 1) + 1 if j == 0 else \
                    torch.randint(1, cfg.vocab, (n,), generator=gen)
                ids[i, j, cfg.prompt:cfg.prompt + n] = tail
                resp[i, j, cfg.prompt - 1:cfg.prompt - 1 + n] = 1.0     # label positions of the response
        return {"ids": ids[..., :-1], "labels": ids[..., 1:], "response": resp}

    return md.Model(g, loss, params, batches=batches, config=cfg, metrics={"accuracy": accuracy},
                    outputs={"logp": logp, "ref_logp": ref_logp, "logits": logits})
