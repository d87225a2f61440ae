"""Per-step feeds for a compiled training plan: each rank builds only its own rows.

:class:`TokenFeeder` feeds a language model's ``ids`` and ``labels`` inputs
(``[batch, seq]``) from a :class:`~meshdsl.train.data.TokenData`.  For every
rank this process holds, the input's sharding gives the rank's slice of the
batch dim (its rows, first dim of the input) and of the other dims; the rank
asks the data for those rows only and cuts the rest, so a data-parallel rank
never builds the other ranks' rows.  The global batch is the same on every
mesh and layout (batches are pure functions of ``(seed, step, row)``).

:class:`CallableFeeder` wraps a user's ``step -> {input: full tensor}``
function; the executor slices those full tensors.
"""
from __future__ import annotations

from ..errors import message
from ..exec.executor import PerRank
from .data import ByteTokenizer, DataError, TokenData

IDS, LABELS = "ids", "labels"


class TokenFeeder:
    """Feeds ``ids``/``labels`` of a plan from token data, rows per held rank.

    Args:
      data: the token data.
      plan: the compiled plan (its inputs ``ids`` and ``labels``, ``[batch, seq]``).
      ranks: the ranks this process holds (``executor.comm.ranks``).
      vocab: the model's vocab size (must hold the 256 byte tokens).

    Raises:
      DataError: the plan lacks the inputs, their shapes differ, or the vocab is too small.
    """

    def __init__(self, data: TokenData, plan, ranks, vocab: int | None = None):
        missing = [k for k in (IDS, LABELS) if k not in plan.inputs]
        if missing:
            raise DataError(message(
                f"training on text: the model has no input {missing[0]!r}.",
                inputs=[f"the model's inputs: {sorted(plan.inputs)}"],
                rule="a language model on token data reads ids [batch, seq] and labels [batch, seq] "
                     "(the next token of each id)",
                fix="name the model's inputs 'ids' and 'labels', or train it from Python with "
                    "data=a function step -> feeds"))
        self.values = {k: plan.values[plan.inputs[k]] for k in (IDS, LABELS)}
        shapes = {k: tuple(d.size for d in v.shape) for k, v in self.values.items()}
        if len(set(shapes.values())) != 1 or len(shapes[IDS]) != 2:
            raise DataError(message("training on text: ids and labels must both be [batch, seq].",
                                    inputs=[f"{k}: {v.shape}" for k, v in self.values.items()],
                                    fix="give both inputs the dims [batch, seq]"))
        if vocab is not None and vocab < ByteTokenizer.vocab_size:
            raise DataError(message(f"training on text: the model's vocab is {vocab}, smaller than the "
                                    f"{ByteTokenizer.vocab_size} byte tokens.",
                                    rule="text is byte-tokenized: ids 0..255",
                                    fix="--config vocab=256"))
        self.data, self.batch_size, self.seq = data, *shapes[IDS]
        # A pipeline holds an input on some stages only: there every held rank gets the full batch.
        self.full = any(v.id in plan.holders for v in self.values.values())
        self.idx = {k: [v.sharding.slice_index(v.shape, plan.mesh, r) for r in ranks]
                    for k, v in self.values.items()}

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one global batch."""
        return self.batch_size * self.seq

    def _feeds(self, make) -> dict:
        if self.full:
            ids, labels = make(None)
            return {IDS: ids, LABELS: labels}
        out = {IDS: PerRank(), LABELS: PerRank()}
        for i in range(len(self.idx[IDS])):
            cache = {}
            for k in (IDS, LABELS):
                rows, cols = self.idx[k][i]
                key = (rows.start, rows.stop)
                if key not in cache:
                    cache[key] = make(rows)
                out[k].append(cache[key][0 if k == IDS else 1][:, cols].contiguous())
        return out

    def train(self, step: int) -> dict:
        """The feeds of training step ``step`` for the held ranks."""
        return self._feeds(lambda rows: self.data.batch(step, self.batch_size, self.seq, rows=rows))

    def eval(self, num_batches: int) -> list[dict]:
        """The feeds of the first ``num_batches`` eval batches (fewer if the held-out split is short)."""
        n = min(num_batches, self.data.num_eval_batches(self.batch_size, self.seq))
        out = []
        for b in range(n):
            out.append(self._feeds(lambda rows, b=b: self.data.eval_batches(
                self.batch_size, self.seq, num_batches=b + 1, rows=rows)[b]))
        return out


class CallableFeeder:
    """Feeds from a user's function ``step -> {input name: full tensor}`` (and optional eval feeds)."""

    def __init__(self, fn, eval_feeds: list[dict] | None = None, tokens_per_step: int | None = None):
        self.fn, self.eval_feeds, self.tokens = fn, list(eval_feeds or []), tokens_per_step

    @property
    def tokens_per_step(self) -> int | None:
        return self.tokens

    def train(self, step: int) -> dict:
        return self.fn(step)

    def eval(self, num_batches: int) -> list[dict]:
        return self.eval_feeds[:num_batches]


__all__ = ["CallableFeeder", "IDS", "LABELS", "TokenFeeder"]
