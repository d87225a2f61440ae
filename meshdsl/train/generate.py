"""Sample text from a trained language model, on the dense program with full params.

The model exposes its next-token logits as :attr:`Model.logits`, shaped
``[batch, seq, vocab]``, and reads one integer input ``[batch, seq]`` (the
token ids).  The model must be causal: the logits at position ``p`` depend on
the tokens at ``0..p`` only, so a context shorter than ``seq`` is written at
the start of its row (the rest padded) and its next token read at its last
position.  A context longer than ``seq`` keeps its last ``seq`` tokens.  Up to
``batch`` prompts are continued at once, one per row.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import message
from ..ir.eval_mode import eval_mode
from ..ir.interpret import DenseProgram
from .data import ByteTokenizer
from .model import Model, ModelError

#: Torch threads of sampling: one, as ``md.fit`` and ``meshdsl train`` run.  Each token is a
#: small program run; on a loaded 2-core machine a user's model made 60 tokens in 24 s with torch's default
#: threads and 1.2 s with one (docs/guide/training.md).
SAMPLE_THREADS = 1


def _program(model: Model):
    if model.logits is None:
        raise ModelError(message(
            "generate: the model exposes no logits.",
            inputs=[f"model graph: {model.graph.name}"],
            rule="generation samples from Model.logits, the [batch, seq, vocab] next-token logits",
            fix="return md.Model(..., logits=logits_bsv) from the model file's build()"))
    prog = DenseProgram(eval_mode({"logits": model.logits}))   # sampled as in eval: no dropout masks
    ids = [(k, t) for k, t in prog.inputs.items() if not t.dtype.is_floating_point]
    shape = model.logits.shape
    if len(ids) != 1 or len(prog.inputs) != 1 or len(shape) != 3:
        raise ModelError(message(
            "generate: the logits must be [batch, seq, vocab] and read one integer input of token ids.",
            inputs=[f"logits: {shape}", f"inputs the logits read: {sorted(prog.inputs)}"],
            rule="a causal language model: ids [batch, seq] -> logits [batch, seq, vocab]",
            fix="expose the LM head's output as Model.logits"))
    return prog, ids[0][0], [d.size for d in shape]


def samplable(model: Model) -> bool:
    """Whether :func:`generate_many` can sample text from ``model``: logits ``[batch, seq, vocab]``
    made from one integer input of ids, over at least the 256 byte tokens.  A model trained on its
    own data (an encoder-decoder's logits also read the source; a vocab of its own) is not."""
    if model.logits is None or len(model.logits.shape) != 3:
        return False
    inputs = DenseProgram({"logits": model.logits}).inputs
    return (len(inputs) == 1 and not next(iter(inputs.values())).dtype.is_floating_point
            and model.logits.shape.sizes[-1] >= ByteTokenizer.vocab_size)


def vocab_field(config, vocab: int) -> str:
    """The name of the ``Config`` field that sets the vocab size ``vocab``: ``vocab`` where the
    Config has it, else its one int field of that value (a user's ``V``), preferring a name
    that starts with ``v`` or says ``vocab`` where several hold it; ``vocab`` when none does."""
    if not dataclasses.is_dataclass(config):
        return "vocab"
    names = [f.name for f in dataclasses.fields(config)]
    if "vocab" in names:
        return "vocab"
    equal = [n for n in names if type(getattr(config, n)) is int and getattr(config, n) == vocab]
    named = [n for n in equal if n.lower().startswith("v") or "vocab" in n.lower()]
    return equal[0] if len(equal) == 1 else named[0] if len(named) == 1 else "vocab"


@torch.no_grad()
def generate_many(model: Model, params: dict, prompts: list[str], max_new_tokens: int = 200,
                  temperature: float = 0.8, seed: int = 0, threads: int | None = None, top_k: int | None = None) -> list[str]:
    """Continue each prompt with ``max_new_tokens`` sampled byte tokens.

    Args:
      model: a built model with :attr:`Model.logits` (e.g. ``models/transformer.py``).
      params: param name -> full tensor, e.g. ``TrainStep.full_params()``.
      prompts: the texts to continue (UTF-8, byte-tokenized); one may be empty.
      max_new_tokens: tokens to add to each.
      temperature: softmax temperature; ``0`` takes the most likely token.
      seed: the sampling seed (the same seed gives the same text).
      top_k: sample among the ``top_k`` most likely tokens only (None: all of them).
      threads: torch threads while sampling (default :data:`SAMPLE_THREADS`, 1; the count
        before is restored at the end).

    Each new token runs the whole ``[batch, seq]`` program (no key/value cache): a model
    built with ``batch=1`` (``md.load_model(..., batch=1)``; the params do not depend on
    ``batch``) samples one prompt ``batch`` times faster than one built for training.

    Returns:
      The generated continuations (without their prompts), one per prompt.

    Raises:
      ModelError: the model has no logits, or a vocab smaller than the 256 byte tokens.
    """
    prog, ids_name, (batch, seq, vocab) = _program(model)
    if vocab < ByteTokenizer.vocab_size:
        field = vocab_field(model.config, vocab)
        raise ModelError(message(f"generate: the model's vocab is {vocab}, smaller than the 256 byte tokens.",
                                 rule="text is byte-tokenized: ids 0..255",
                                 fix=f"build the model with {field}=256 (--config {field}=256)"))
    if temperature < 0:
        raise ModelError(message(f"generate: temperature {temperature} < 0.", fix="use 0 (greedy) or more"))
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
        raise ModelError(message(f"generate: top_k {top_k!r} is not a positive int.",
                                 fix="pass top_k=1 or more (None: sample among all tokens)"))
    before = torch.get_num_threads()
    torch.set_num_threads(SAMPLE_THREADS if threads is None else threads)
    try:
        return _sample(prog, ids_name, (batch, seq), params, prompts, max_new_tokens, temperature, seed, top_k)
    finally:
        torch.set_num_threads(before)


def _sample(prog, ids_name: str, size: tuple[int, int], params: dict, prompts: list[str], max_new_tokens: int,
            temperature: float, seed: int, top_k: int | None) -> list[str]:
    """:func:`generate_many`'s loop: ``batch`` prompts at a time, one program run per new token."""
    (batch, seq), tok = size, ByteTokenizer()
    gen = torch.Generator().manual_seed(seed)   # sampled on the CPU: the same text on any device
    dev = next((v.device for v in params.values()), torch.device("cpu"))
    out = []
    for lo in range(0, len(prompts), batch):
        rows = [tok.encode(p).tolist() for p in prompts[lo:lo + batch]]
        new = [[] for _ in rows]
        for _ in range(max_new_tokens):
            ids = torch.zeros(batch, seq, dtype=torch.int64)
            last = []
            for r, toks in enumerate(rows):
                ctx = toks[-seq:] or [ord("\n")]   # an empty prompt starts from a newline
                ids[r, :len(ctx)] = torch.tensor(ctx)
                last.append(len(ctx) - 1)
            logits = prog({ids_name: ids.to(dev)}, params)["logits"]
            step = logits[torch.arange(len(rows), device=dev), torch.tensor(last, device=dev), :tok.vocab_size].cpu()
            if top_k is not None and top_k < step.shape[-1]:
                step = step.masked_fill(step < step.topk(top_k, -1).values[:, -1:], float("-inf"))
            if temperature == 0:
                nxt = step.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(step.double() / temperature, -1), 1, generator=gen)[:, 0]
            for r, t in enumerate(nxt.tolist()):
                rows[r].append(t)
                new[r].append(t)
        out += [tok.decode(n) for n in new]
    return out


def generate(model: Model, params: dict, prompt: str = "", max_new_tokens: int = 200,
             temperature: float = 0.8, seed: int = 0, threads: int | None = None, top_k: int | None = None) -> str:
    """Continue ``prompt`` with ``max_new_tokens`` sampled tokens (see :func:`generate_many`).

    Example::

        step = md.TrainStep(model.loss, model.params, "data:1", "", comm)  # ... trained
        print(md.generate(model, step.full_params(), "def ", max_new_tokens=100))
    """
    return generate_many(model, params, [prompt], max_new_tokens, temperature, seed, threads, top_k)[0]


__all__ = ["SAMPLE_THREADS", "generate", "generate_many"]
