"""Per-step feeds for a compiled training plan: each rank builds only its own rows.

Three sources of batches, one feeder each:

* :class:`TokenFeeder`: a language model's ``ids`` and ``labels`` (``[batch, seq]``)
  from a :class:`~meshdsl.train.data.TokenData`;
* :class:`BatchFeeder`: a model's own ``batches(seed, rows)`` (:class:`~.model.Model`):
  generated images, masks, tables, any inputs; step ``t`` of a run with seed ``s`` reads
  seed ``s + t`` (:func:`train_seed`), eval batch ``b`` seed ``2**62 + s + b``
  (:func:`eval_seed`), which no step reaches;
* :class:`CallableFeeder`: a user's ``step -> {input: full tensor}`` function, or a
  model's ``make_feeds`` (whole inputs): the executor slices those full tensors.

The first two ask their source for a rank's rows only (:class:`InputSlices`): for
every rank this process holds, an input's sharding gives the rank's slice of the
``batch`` dim (its rows) and of the other dims; the source builds those rows once
per process and the rest is cut from them, so a data-parallel rank never builds the
other ranks' rows.  The global batch is the same on every mesh and layout (batches are
pure functions of ``(seed, step, row)``), so the step is the whole data position a
checkpoint needs.  :func:`make_feeder` picks a training run's feeder.
"""
from __future__ import annotations

import traceback

from ..core.examples import examples_in
from ..errors import MeshDSLError, message
from ..runtime.executor import PerRank
from .data import ByteTokenizer, DataError, TokenData
from .generate import vocab_field

IDS, LABELS = "ids", "labels"
#: The dim whose rows a data rank builds (the one ``batch:data`` splits); a model without it: the
#: examples' dim by the user's name (:func:`~meshdsl.core.examples.examples_in`).
BATCH = "batch"
#: Eval batches read seeds from here on; a run would need 2**62 steps to reach them.
EVAL_SEED = 2**62


def train_seed(seed: int, step: int) -> int:
    """The data seed of 1-based training ``step`` of a run with seed ``seed``."""
    return seed + step


def eval_seed(seed: int, batch: int) -> int:
    """The data seed of eval batch ``batch`` (0-based): one no training step reads."""
    return EVAL_SEED + seed + batch


class InputSlices:
    """Where each held rank's slice of some inputs of a plan lies: the rows it builds, the cut of the rest.

    Args:
      plan: the compiled plan.
      row_dims: input name -> the position of its rows dim, or None for an input that has none
        (it is built whole, the same for any rows).
      ranks: the ranks this process holds (``executor.comm.ranks``).
    """

    def __init__(self, plan, row_dims: dict, ranks):
        self.values = {k: plan.values[plan.inputs[k]] for k in row_dims}
        self.row_dims = row_dims
        # A pipeline holds an input on some stages only: there every held rank gets the full batch.
        # (so no rank's index is needed: an interleaved stack's fed input is cut block-cyclic, in
        # several regions per rank, which the executor cuts from the whole tensor)
        self.full = any(v.id in plan.holders for v in self.values.values())
        self.idx = {} if self.full else {k: [v.sharding.slice_index(v.shape, plan.mesh, r) for r in ranks]
                                         for k, v in self.values.items()}
        self.num_ranks = len(ranks)

    def feeds(self, make) -> dict:
        """``{input: PerRank slices}`` (full tensors in a pipeline) from ``make(rows) -> {input: those
        rows}``, called once per distinct ``rows`` (a ``slice``; None: every row)."""
        if self.full:
            whole = make(None)
            return {k: whole[k] for k in self.values}
        out, made = {k: PerRank() for k in self.values}, {}
        for i in range(self.num_ranks):
            rows = {k: idx[i][self.row_dims[k]] for k, idx in self.idx.items() if self.row_dims[k] is not None}
            first = next(iter(rows.values()), None)   # an input without rows comes with any rows
            for k, idx in self.idx.items():
                r = rows.get(k, first)
                key = None if r is None else (r.start, r.stop)
                if key not in made:
                    made[key] = make(r)
                pos = self.row_dims[k]
                cut = tuple(slice(None) if j == pos else s for j, s in enumerate(idx[i]))
                out[k].append(made[key][k][cut].contiguous())
        return out


class TokenFeeder:
    """Feeds ``ids``/``labels`` of a plan from token data, rows per held rank.

    Args:
      data: the token data.
      plan: the compiled plan (its inputs ``ids`` and ``labels``, ``[batch, seq]``).
      ranks: the ranks this process holds (``executor.comm.ranks``).
      vocab: the model's vocab size (must hold the 256 byte tokens).
      config: the model's Config, whose field for the vocab the error names (``--config V=256``).

    Raises:
      DataError: the plan lacks the inputs, their shapes differ, or the vocab is too small.
    """

    def __init__(self, data: TokenData, plan, ranks, vocab: int | None = None, config=None):
        missing = [k for k in (IDS, LABELS) if k not in plan.inputs]
        if missing:
            raise DataError(message(
                f"training on text: the model has no input {missing[0]!r}.",
                inputs=[f"the model's inputs: {sorted(plan.inputs)}"],
                rule="a language model on token data reads ids [batch, seq] and labels [batch, seq] "
                     "(the next token of each id)",
                fix="name the model's inputs 'ids' and 'labels', or train it from Python with "
                    "data=a function step -> feeds"))
        others = [k for k in data_inputs(plan) if k not in (IDS, LABELS)]
        if others:   # refused here, once, rather than by every rank's first step
            raise DataError(message(
                f"training on text: the model also reads input {others[0]!r}, which text does not make.",
                inputs=[f"the model's inputs: {sorted(data_inputs(plan))}"],
                rule="token data makes ids and labels only; every other input of the model needs a source",
                fix=f"give md.Model batches=(seed, rows) -> every input, {others[0]!r} included (it then "
                    f"trains on its own data), make {others[0]!r} in the graph from ids, or train from "
                    f"Python with data=a function step -> feeds"))
        values = {k: plan.values[plan.inputs[k]] for k in (IDS, LABELS)}
        shapes = {k: tuple(d.size for d in v.shape) for k, v in values.items()}
        if len(set(shapes.values())) != 1 or len(shapes[IDS]) != 2:
            raise DataError(message("training on text: ids and labels must both be [batch, seq].",
                                    inputs=[f"{k}: {v.shape}" for k, v in values.items()],
                                    fix="give both inputs the dims [batch, seq]"))
        if vocab is not None and vocab < ByteTokenizer.vocab_size:
            field = vocab_field(config, vocab)
            raise DataError(message(f"training on text: the model's vocab is {vocab}, smaller than the "
                                    f"{ByteTokenizer.vocab_size} byte tokens.",
                                    rule="text is byte-tokenized: ids 0..255",
                                    fix=f"--config {field}=256 (from Python: md.load_model(..., {field}=256)), or "
                                        "train a model of another vocab on data= a function step -> feeds"))
        self.data, self.batch_size, self.seq = data, *shapes[IDS]
        self.slices = InputSlices(plan, {IDS: 0, LABELS: 0}, ranks)   # rows: the first dim, whatever its name

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one global batch."""
        return self.batch_size * self.seq

    def _feeds(self, make) -> dict:
        return self.slices.feeds(lambda rows: dict(zip((IDS, LABELS), make(rows))))

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


class BatchFeeder:
    """Feeds a model's own ``batches(seed, rows)``: each held rank's rows of the ``batch`` dim.

    Args:
      batches: the model's ``batches`` (:class:`~.model.Model`).
      plan: the training step's plan.
      ranks: the ranks this process holds.
      seed: the run's seed (:func:`train_seed`, :func:`eval_seed`).
      eval_plan: the eval's forward plan (a metric may read an input the loss does not), default ``plan``.

    Raises:
      DataError: (at a call) ``batches`` gives no tensor for an input of the plan, or one whose
        shape or dtype is not the rows asked for.
    """

    def __init__(self, batches, plan, ranks, seed: int, eval_plan=None):
        self.batches, self.seed = batches, seed
        self.train_slices = self._slices(plan, ranks)
        self.eval_slices = self._slices(eval_plan or plan, ranks)

    #: Throughput is counted in tokens, which a model's own batches need not have.
    tokens_per_step = None

    @staticmethod
    def _slices(plan, ranks) -> InputSlices:
        names = data_inputs(plan)
        shapes = {k: plan.values[plan.inputs[k]].shape for k in names}
        held = {d for v in plan.params.values() for d in plan.values[v].shape.names}
        examples = examples_in(list(shapes.values()), held)   # 'batch', or the user's B, N, examples
        return InputSlices(plan, {k: _row_dim(shape, examples.name if examples else BATCH)
                                  for k, shape in shapes.items()}, ranks)

    def _make(self, slices: InputSlices, seed: int, what: str):
        def make(rows):
            called = f"the model's batches(seed={seed}, rows={_fmt(rows)}) of {what}"
            try:
                got = self.batches(seed, rows)
            except MeshDSLError:
                raise
            except Exception as e:  # noqa: BLE001 - an error in the user's batches is the user's to fix
                at = traceback.extract_tb(e.__traceback__)[-1]
                raise DataError(message(f"{called} raised {type(e).__name__}: {e}",
                                        inputs=[f"{at.filename}, line {at.lineno}: {at.line}"],
                                        fix="fix the model's batches at the line shown")) from None
            for k, v in slices.values.items():
                _check_rows(called, k, v, got, rows, slices.row_dims[k])
            return got
        return slices.feeds(make)

    def train(self, step: int) -> dict:
        """The feeds of 1-based training ``step`` for the held ranks."""
        return self._make(self.train_slices, train_seed(self.seed, step), f"step {step}")

    def eval(self, num_batches: int) -> list[dict]:
        """The feeds of eval batches ``0 .. num_batches - 1``."""
        return [self._make(self.eval_slices, eval_seed(self.seed, b), f"eval batch {b}") for b in range(num_batches)]


def data_inputs(plan) -> list[str]:
    """The plan's inputs a batch feeds: all but the optimizer's hyperparameters (``opt/<name>``,
    which :class:`~.step.TrainStep` feeds itself)."""
    return [k for k in plan.inputs if not k.startswith("opt/")]


def _row_dim(shape, examples: str = BATCH) -> int | None:
    return shape.names.index(examples) if examples in shape.names else None


def _fmt(rows) -> str:
    return "None" if rows is None else f"slice({rows.start}, {rows.stop})"


def _check_rows(called: str, name: str, value, got: dict, rows, pos: int | None) -> None:
    """Refuse a tensor of ``batches(seed, rows)`` (``called``) that is missing or is not the rows asked for."""
    if name not in got:
        raise DataError(message(f"{called} gives no input {name!r}.", inputs=[f"it gives: {sorted(got)}"],
                                rule="batches returns a tensor for every input of the model",
                                fix=f"add {name!r} to what batches returns"))
    want = [d.size for d in value.shape]
    if pos is not None and rows is not None:
        want[pos] = len(range(want[pos])[rows])
    x = got[name]
    if tuple(getattr(x, "shape", ())) != tuple(want) or getattr(x, "dtype", None) != value.dtype:
        what = f"shape {tuple(x.shape)}, {x.dtype}" if hasattr(x, "shape") else f"a {type(x).__name__}"
        raise DataError(message(
            f"{called}: input {name!r} is {what}; {tuple(want)}, {value.dtype} was asked for.",
            inputs=[f"{name}: {value.shape}"],
            rule="each input with the examples' dim ('batch', or the model's own name for it) comes with the rows "
                 "asked for only (all of them for rows=None), "
                 "any other input whole",
            fix="return rows range(batch)[rows] of the batch only (every row for rows=None), each "
                "e.g. from md.row_generator(seed, row); cast to the input's dtype"))


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


# ----------------------------------------------------------------- a training run's feeder

def reads_text(model) -> bool:
    """True when the model trains on text: it reads token ids and next-token labels (``ids`` and
    ``labels``, ``[batch, seq]`` each) and makes no batches of its own (``Model.batches``).  Inputs
    of those names and other shapes (a document classifier's ``[batch, sents, words]`` ids and
    ``[batch]`` labels) are the model's own: it trains on its ``make_feeds``."""
    shapes = {n.name: n.outputs[0].shape.sizes for n in model.graph.nodes if n.op.name == "input"}
    if not {IDS, LABELS} <= set(shapes) or model.batches is not None:
        return False
    return len(shapes[IDS]) == 2 and shapes[IDS] == shapes[LABELS]


def model_vocab(model) -> int | None:
    """The vocab size a language model's ids index: its logits' last dim (whatever the Config
    calls it: ``vocab``, a user's ``V``), else its Config's ``vocab``; None when it has neither."""
    if model.logits is not None and len(model.logits.shape):
        return model.logits.shape.sizes[-1]
    return getattr(model.config, "vocab", None)


def make_feeder(model, step, spec, data=None, eval_data=None, eval_plan=None):
    """``(TokenData or None, feeder)`` for the run.

    ``data`` None and no text file (``spec.data``): a model with ``batches`` trains on them,
    each rank building its rows (:class:`BatchFeeder`; ``eval_plan``: the eval's forward plan);
    one that reads ``ids``/``labels`` on the default corpus; any other on its own
    ``make_feeds``.  Both kinds of own data take one seed per step and evaluate on
    ``spec.eval_batches`` seeds no step uses (:func:`train_seed`, :func:`eval_seed`).
    """
    if data is None and spec.data is None and not reads_text(model):
        if model.batches is not None:
            ranks = step.executor.comm.ranks
            return None, BatchFeeder(model.batches, step.plan, ranks, spec.seed, eval_plan)
        evals = [model.feeds(eval_seed(spec.seed, b)) for b in range(spec.eval_batches)]
        return None, CallableFeeder(lambda t: model.feeds(train_seed(spec.seed, t)), evals)
    tokens = data if isinstance(data, TokenData) else None
    if data is None:
        tokens = TokenData.load(spec.data, seed=spec.seed)
    if tokens is not None:
        return tokens, TokenFeeder(tokens, step.plan, step.executor.comm.ranks, model_vocab(model), model.config)
    return None, CallableFeeder(data, eval_data)


__all__ = ["BATCH", "BatchFeeder", "CallableFeeder", "EVAL_SEED", "IDS", "InputSlices", "LABELS", "TokenFeeder",
           "data_inputs", "eval_seed", "make_feeder", "model_vocab", "reads_text", "train_seed"]
