"""A cheap estimate of what splitting some dims over one mesh axis costs, read off the graph.

The layout search may split any dim of the model (:mod:`.dims`); compiling every
split of every dim on every mesh would cost seconds per dim, so the search first
ranks dims by this estimate and compiles only the best few.  :func:`profile` walks
the training step's graph once (a ``repeat``'s block counted once per layer) and
keeps, per node, its compute dims (the op's :class:`~meshdsl.ops.registry.ComputeSpec`),
its work and the dims and bytes of its inputs and outputs.  :func:`estimate` then
prices a set of dims split ``k`` ways the way the generic lowering rule would move
them, without compiling:

* a node computes split along the first split dim it may split (not ``fixed``): its
  kernel does ``1/k`` of the work (the largest part's share, ``ceil(n/k)/n``, where ``k``
  does not divide the dim's size ``n``: an uneven split), else all of it;
* an input stored split along a dim the node does not compute split along is
  allgathered first (a ``fixed`` dim: layer norm's features, attention's keys);
* a split dim the node sums or maximises over leaves an allreduce of each output;
* an output made split along a dim the layout does not split it along (a ``rename`` of
  a split dim) is allgathered (an alltoall where it wants another split).

Lazy partial sums, fused rules (the cross-entropy over a split class dim) and
relayouts the compiler avoids make the real plan cheaper: the figure ranks dims
against each other, :func:`~.predict.predict` prices the candidates the search keeps.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.examples import examples_dim
from ..core.graph import topo_nodes
from ..lowering.fuse import IDENTITY
from .calibrate import Calibration
from .predict import MATMUL_OPS

#: Nodes that compute nothing (values given to the plan, or handed on).
NO_WORK = frozenset({"input", "param", "placeholder", "constant"}) | IDENTITY


@dataclass(frozen=True)
class Work:
    """One node's figures for :func:`estimate`, per run of the step.

    Attributes:
      runs: how often it runs per step (the layers of the ``repeat`` blocks around it).
      dims: its compute dims; ``fixed`` must stay whole, ``reduce`` are summed (or maxed) over.
      matmul: priced by FLOPs (else by bytes touched).
      flops: FLOPs of one whole (unsplit) run.
      ins: ``(dims, bytes)`` of each input.
      outs: ``(dims, compute dims, bytes)`` of each output, the dims in order (a ``rename``
        computes an output dim under another name).
    """

    runs: int
    dims: frozenset
    fixed: frozenset
    reduce: frozenset
    matmul: bool
    flops: int
    ins: tuple
    outs: tuple


@dataclass(frozen=True)
class Profile:
    """What :func:`estimate` needs of a training step's graph.

    Attributes:
      works: one :class:`Work` per node that computes.
      dims: every dim of the graph (params, inputs, activations, blocks), name -> size.
      layer_dims: the dims the repeats outside any block scan over (a pipeline's).
      tensors: the dim names of each distinct tensor shape -> the first tensor's name (who
        holds two dims together, for conflicts).
      batch_like: the examples' dim and the dims a ``rename`` made of it (they carry the
        micro-batches).
      examples: the examples' dim (:func:`~meshdsl.core.examples.examples_dim`: ``batch``, or
        the user's name for it read off the graph), None where the graph has none.
    """

    works: tuple
    dims: dict
    layer_dims: tuple
    tensors: dict
    batch_like: frozenset = frozenset({"batch"})
    examples: str | None = "batch"

    def together(self, a: str, b: str) -> str | None:
        """A tensor holding dims ``a`` and ``b`` both (``"name [dims]"``, the one with the fewest
        dims), or None."""
        both = [(len(dims), name) for dims, name in self.tensors.items() if a in dims and b in dims]
        return min(both)[1] if both else None


@dataclass(frozen=True)
class Estimate:
    """A split's estimated seconds per step on one rank: kernels and collectives."""

    compute_s: float
    comm_s: float
    comm_bytes: int

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    def describe(self) -> str:
        return (f"est. {self.total_s * 1e3:.2f} ms: {self.compute_s * 1e3:.2f} ms kernels, "
                f"{self.comm_s * 1e3:.2f} ms moving {_kib(self.comm_bytes)}")


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def _bytes(t) -> int:
    return t.shape.numel * t.dtype.itemsize


def profile(outputs) -> Profile:
    """Walk the graph of ``outputs`` (a dict or list of tensors) and its ``repeat`` blocks."""
    outs = list(outputs.values()) if isinstance(outputs, dict) else list(outputs)
    works: list[Work] = []
    dims: dict[str, int] = {}
    layers: list[str] = []
    tensors: dict[frozenset, str] = {}

    def see(t) -> None:
        names = frozenset(t.shape.names)
        for d in t.shape:
            dims.setdefault(d.name, d.size)
        if len(names) > 1:
            tensors.setdefault(names, f"'{t.name}' [{' '.join(t.shape.names)}]")

    def walk(nodes, runs: int, nested: bool = False) -> None:
        for n in nodes:
            for t in (*n.inputs, *n.outputs):
                see(t)
            subs = n.op.subgraphs(n)
            if subs:   # a repeat's block: once per layer
                layer = n.attrs.get("layer")
                # (a repeat inside a block, a recurrence over seq, is no pipeline: its scanned dim splits
                # as any other, gathered at the repeat, lowering/repeat.py)
                if layer is not None and layer.name not in layers and not nested:
                    layers.append(layer.name)
                for graph, _ in subs:
                    walk(graph.nodes, runs * (layer.size if layer is not None else 1), True)
                continue
            if n.op.name not in NO_WORK:
                works.append(_work(n, runs))

    walk(topo_nodes(outs), 1)
    examples = examples_dim(outs)
    batch_like = {examples} if examples else set()
    for w in works:   # in graph order, so a rename of a rename follows
        batch_like |= {name for names, computed, _ in w.outs for name, comp in zip(names, computed)
                       if comp in batch_like}
    return Profile(tuple(works), dims, tuple(layers), tensors, frozenset(batch_like), examples)


def _work(n, runs: int) -> Work:
    spec = n.op.spec(n)
    rename = spec.out_rename
    outs = tuple((t.shape.names, tuple(rename.get(d, d) for d in t.shape.names), _bytes(t)) for t in n.outputs)
    return Work(runs, frozenset(spec.dims), frozenset(spec.fixed), frozenset(spec.reduce),
                n.op.name in MATMUL_OPS, n.op.flops(n, {}),
                tuple((frozenset(t.shape.names), _bytes(t)) for t in n.inputs), outs)


def estimate(prof: Profile, split: tuple[str, ...], k: int, cal: Calibration, job: int) -> Estimate:
    """Seconds per step of the graph with the dims ``split`` over one axis of ``k`` ranks.

    Args:
      prof: the graph's :func:`profile`.
      split: the dims, in priority order (a tensor holding two of them splits the first).
      k: the axis size.
      cal: prices kernels (their rate, not their fixed cost: a split runs as many) and collectives.
      job: processes of the job (the collectives' calibration).
    """
    compute = comm = 0.0
    moved = 0
    for w in prof.works:
        c = next((d for d in split if d in w.dims and d not in w.fixed), None)
        sends: list[tuple[str, int]] = []
        for names, nbytes in w.ins:
            stored = next((d for d in split if d in names), None)
            if stored is not None and stored != c:
                sends.append(("allgather", nbytes // k))
        if c in w.reduce:
            sends += [("allreduce", nbytes) for _, _, nbytes in w.outs]
        elif c is not None:
            for names, computed, nbytes in w.outs:
                # made split along the output dim computed as ``c``; stored split as the layout wants
                made = next((name for name, comp in zip(names, computed) if comp == c), None)
                stored = next((d for d in split if d in names), None)
                if made is not None and made != stored:
                    sends.append(("allgather" if stored is None else "alltoall", nbytes // k))
        # An uneven split (k not dividing the dim) runs its largest part on every rank: the others wait.
        share = prof.dims.get(c, k) / -(-prof.dims.get(c, k) // k) if c is not None else 1
        if w.matmul:
            compute += w.runs * w.flops / share / cal.matmul.rate
        else:
            touched = sum(b for _, b in w.ins) + sum(b for _, _, b in w.outs)
            compute += w.runs * touched / share / cal.elementwise.rate
        for kind, nbytes in sends:
            comm += w.runs * cal.collective(kind, nbytes, k, job)
            moved += w.runs * nbytes
    return Estimate(compute, comm, moved)
