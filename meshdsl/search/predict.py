"""Predicted step time and memory of a compiled plan, from a :class:`~.calibrate.Calibration`.

Each step is priced on its own: a local kernel by its FLOPs (matmul-like ops:
``einsum``, ``gather``, ``scatter_add``) or by the bytes it reads and writes
(everything else), a collective from its kind's measured samples for its group
and job size; each adds the executor's calibrated cost per step.  The first
collective after local compute adds what the calibration measured such a
collective to cost beyond the sweep's (the ranks come to it apart, and a waiting
one is woken late); collectives back to back do not.
The step time then replays the executor's own issue order
(:func:`meshdsl.runtime.executor.issue_order` with the kinds torch.distributed
runs asynchronously): an asynchronous collective occupies the link from its
issue (or when the link frees) and only the step that reads its result
waits, so the prediction overlaps exactly what the runtime overlaps.  A loop
runs its body ``times`` over; a pipeline prices each stage's forward and
backward segment and simulates its program's schedule at those costs
(:meth:`meshdsl.lowering.pipeline_program.PipelineProgram.simulate`), so the bubble is the schedule's; a
B that sends a gradient upstream is split as the runtime splits it, its loops'
weight-gradient matmuls priced as a W after the send.
A process runs its micro-batches one after another, and once what does not vary
per micro-batch (:func:`meshdsl.runtime.steps.representatives`).

Without a spare core per process nothing overlaps (gloo moves and reduces bytes
on the CPU: a collective in flight has no core while its process computes); with
more processes than cores kernels (and the executor's own cost per step, timed in one
process alone) also slow by processes per core, and a
pipeline is charged instead the larger of its
makespan and its stages' busy time over the cores, as a stage in its bubble leaves
its core to the others.
The step time splits into terms that add up to it (:meth:`Prediction.terms`): the
compute on the critical path (without a pipeline, every kernel; with one, the
busiest stage's kernels and those outside the pipeline's stages), the
communication that path waits on, the pipeline bubble, and the time an
oversubscribed pipeline's stages wait for a core.  Kernel time summed over every
stage (:attr:`Prediction.compute_s`) is larger than a pipeline's step and is no term.
Memory per rank is :func:`meshdsl.lowering.memory.memory_report`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..collectives import COLLECTIVES
from ..runtime.executor import issue_order
from ..runtime.deferred import matmul_producer
from ..lowering.fuse import IDENTITY
from ..lowering.memory import memory_report
from ..lowering.pipeline import MB_AXIS, per_microbatch
from ..lowering.pipeline_program import Segment
from ..lowering.plan import Plan, Step
from ..lowering.schedule import BUSY
from .calibrate import Calibration

#: Ops priced by FLOPs (the rest by bytes touched).
MATMUL_OPS = frozenset({"einsum", "gather", "scatter_add", "matmul", "bmm"})
#: Kinds torch.distributed starts asynchronously (the executor issues them early).
ASYNC_KINDS = frozenset(k for k, c in COLLECTIVES.items() if c.asynchronous)


@dataclass
class Prediction:
    """What a plan is predicted to cost per step on one rank.

    ``step_s`` is the sum of :meth:`terms`: ``path_compute_s + exposed_comm_s + bubble_s +
    shared_cores_s``.

    Attributes:
      step_s: predicted wall time of one step.
      compute_s: kernel time summed over every stage (without a pipeline, what the step
        would take with free communication).
      comm_s: collective time summed (exposed or hidden).
      exposed_comm_s: the part of the step spent waiting on communication (the step time
        the other terms leave).
      bubble_s: pipeline idle time on the busiest stage (0 without a pipeline).
      memory: :func:`~meshdsl.lowering.memory.memory_report` of the plan (bytes per rank).
      comm_bytes: bytes per rank sent by collectives between processes per step (:func:`process_totals`).
      by_op: ``(label, op, compute_s, comm_s)`` per step with a cost, sub-plans multiplied out.
      kernel_calls: local steps one run executes (loops and micro-batches counted; a
        pipeline's forward and backward segments for every stage).
    """

    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    memory: dict
    comm_bytes: int
    by_op: list = field(default_factory=list)
    kernel_calls: int = 0
    #: kernel time on the critical path: every kernel without a pipeline; with one, the
    #: busiest stage's and those outside the stages (prologue, final segment)
    path_compute_s: float = 0.0
    #: an oversubscribed pipeline: the time its stages' work over the cores exceeds its makespan
    shared_cores_s: float = 0.0
    #: a pipeline's stages, in order: each one's :class:`StageCost`
    stages: tuple = ()

    @property
    def memory_bytes(self) -> int:
        return sum(self.memory[k] for k in ("params", "grads", "optimizer", "activations_peak"))

    def terms(self) -> list[tuple[str, float]]:
        """``(name, seconds)`` parts of :attr:`step_s`, in order; they sum to it."""
        return [("compute", self.path_compute_s), ("exposed communication", self.exposed_comm_s),
                ("pipeline bubble", self.bubble_s), ("stages waiting for a core", self.shared_cores_s)]


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage's predicted work per micro-batch (its F, B and W segments).

    Attributes:
      layers: layers of the pipelined repeat it runs.
      seconds: its F, B and W time per micro-batch, transfers included.
      layers_s: the part of ``seconds`` its layers take (the rest: what feeds or follows the
        layers there, the embedding on the first stage and the head and loss on the last).
    """

    layers: int
    seconds: float
    layers_s: float
    #: with several pipelined stacks (an encoder-decoder's), each one's ``(layers, layers_s)``
    #: on this stage, in graph order; () for one stack (then ``(layers, layers_s)`` itself)
    stacks: tuple = ()

    @property
    def other_s(self) -> float:
        return self.seconds - self.layers_s

    @property
    def per_stack(self) -> tuple:
        """``(layers, layers_s)`` of each pipelined stack on this stage, in graph order."""
        return self.stacks or ((self.layers, self.layers_s),)


def process_axes(axes) -> tuple[str, ...]:
    """The axes of a collective that cross processes: all but the virtual micro-batch axis, whose
    members one process holds and folds locally (``comm/microbatch.py``, the pipeline's accumulator)."""
    return tuple(a for a in axes if a != MB_AXIS)


def process_totals(plan: Plan) -> dict[str, dict[str, int]]:
    """As :meth:`Plan.totals`, counting only collectives that move bytes between processes."""
    out: dict[str, dict[str, int]] = {}
    for s, mult in plan.collectives():
        if process_axes(s.axes):
            t = out.setdefault(s.kind, {"count": 0, "bytes": 0})
            t["count"] += mult
            t["bytes"] += mult * s.bytes
    return out


def step_seconds(step: Step, plan: Plan, cal: Calibration, serial: int = 1, sharing: int | None = None,
                 dispatch: float | None = None) -> float:
    """Seconds of one kernel or collective step (0 for leaves and splits) on one process.

    ``serial`` is how many micro-batches the process runs this step for, one after another
    (gradient accumulation outside a pipeline; a pipeline's schedule counts its own).
    ``sharing``: how many processes compute at once, sharing the cores (default: all of them).
    ``dispatch``: the runtime's seconds per step (default: the executor's, ``cal.dispatch_s``).
    """
    dispatch = cal.dispatch_s if dispatch is None else dispatch
    mesh = plan.mesh
    nproc = mesh.axis_size(process_axes(mesh.names)) if sharing is None else sharing
    if serial > 1 and not per_microbatch(step, plan.values):
        serial = 1  # the executor runs it on one micro-batch rank (runtime/steps.py: representatives)
    if step.is_collective:
        real = process_axes(step.axes)
        adds = cal.kernel(False, 0, 2 * step.bytes, nproc) * (serial - 1)
        if not real:  # a sum over micro-batches only: each process adds its own, in place
            return adds + dispatch
        n = mesh.axis_size(real)
        job = mesh.axis_size(process_axes(mesh.names))
        once = cal.collective(step.kind, step.bytes, n, job) + (dispatch if n > 1 else 0.0)
        # Over micro-batches too: summed locally, then one collective; otherwise one per micro-batch.
        return adds + once if real != tuple(step.axes) else serial * once
    if step.kind != "local":
        return 0.0
    # Processes share the cores, for the kernel and the executor's own work on it alike; a
    # process's micro-batches (the virtual axis) run one after another.
    share = max(1.0, nproc / cal.cores)
    if step.op in IDENTITY:  # hands its input on (a gradient's name): no kernel runs
        return serial * dispatch * share
    nbytes = sum(plan.values[v].local_bytes(mesh) for v in (*step.ins, *step.outs) if v in plan.values)
    return serial * (cal.kernel(step.op in MATMUL_OPS, step.flops, nbytes, nproc) + dispatch * share)


class _Walk:
    """One pass over a plan, collecting per-op rows and totals."""

    def __init__(self, cal: Calibration, nproc: int, orders: dict | None = None):
        self.cal, self.nproc = cal, nproc
        # each plan's issue order by id (the plan and its sub-plans), shared by walks of one plan
        self.orders = {} if orders is None else orders
        # No spare core: a collective in flight has none to progress on while its process
        # computes (gloo moves and reduces bytes on the CPU, in a thread of that process), so
        # nothing overlaps.
        self.overlap = nproc < cal.cores
        self.sharing: int | None = None   # processes computing at once (None: all)
        self.dispatch: float | None = None  # the runtime's seconds per step (None: the executor's)
        self.kernel_calls = 0               # local steps run, loops and micro-batches counted
        self.rows: list[tuple[str, str, float, float]] = []
        self.compute = self.comm = self.bubble = 0.0
        # The step's terms beside the bubble: kernels on the critical path, and the time an
        # oversubscribed pipeline's stages wait for a core; inside a pipeline's stage segments
        # kernels count per stage (:meth:`_segment`), and only the busiest stage's go on the path.
        self.path = self.shared = 0.0
        self.in_stages = False
        self.computed = False  # a kernel ran since the last collective: the ranks drifted apart
        # A pipeline B's weight-gradient matmuls the runtime puts off to its W (runtime/deferred.py):
        # ids of those steps, their seconds per run, and the runs of the loops around them.
        self.later: frozenset = frozenset()
        self.w, self.w_scale = 0.0, 1
        self.loop_s: dict[int, float] = {}   # in a pipeline's segments: a loop's seconds per run, by id
        self.stages: tuple = ()

    def plan_time(self, plan: Plan, mult: int, stages=None, stage=None, serial: int = 1) -> float:
        """Wall time of one run of ``plan`` (only the steps of ``stage`` when given)."""
        steps = plan.steps
        ready: dict[int, float] = {}
        cpu = link = 0.0
        order = self.orders.get(id(plan))
        if order is None:
            order = self.orders[id(plan)] = issue_order(plan, ASYNC_KINDS)
        for i in order:
            s = steps[i]
            if stages is not None and stage not in stages[i]:
                continue
            start = max([cpu] + [ready[v] for v in s.ins if v in ready])
            if s.subplans:
                w_before = self.w
                dur = self.sub_time(s, plan, mult, serial)
                if self.in_stages:   # with the weight-gradient matmuls it puts off to a W
                    self.loop_s[id(s)] = dur + self.w - w_before
                end = cpu = start + dur
            else:
                dur = step_seconds(s, plan, self.cal, serial, self.sharing, self.dispatch)
                if s.is_collective:
                    n = plan.mesh.axis_size(process_axes(s.axes))
                    if self.computed and n > 1:
                        # the first collective after compute: the ranks come to it apart
                        dur += self.cal.after_compute(n, self.nproc)
                        self.computed = False
                    self.comm += mult * dur
                    self.rows.append((s.label, s.kind, 0.0, mult * dur))
                    begin = max(start, link)
                    end = link = begin + dur
                    if s.kind not in ASYNC_KINDS or not self.overlap:
                        cpu = end
                else:
                    if dur or s.kind == "local":   # an identity costs its dispatch only, maybe 0
                        self.computed = True
                        self.kernel_calls += mult
                        self.compute += mult * dur
                        if not self.in_stages:
                            self.path += mult * dur
                        self.rows.append((s.label, s.op, mult * dur, 0.0))
                    if id(s) in self.later:   # runs in the W, after the B's send: off this path
                        self.w += self.w_scale * dur
                        end = start
                    else:
                        end = cpu = start + dur
            for v in s.outs:
                ready[v] = end
        return max([cpu, link] + list(ready.values()))

    def sub_time(self, s: Step, plan: Plan, mult: int, serial: int) -> float:
        if s.kind == "pipeline":
            return self.pipeline_time(s, mult)
        total, scale = 0.0, self.w_scale
        for k, sub in enumerate(s.subplans):
            self.w_scale = scale * s.runs(k)
            total += s.runs(k) * self.plan_time(sub, mult * s.runs(k), serial=serial)
        self.w_scale = scale
        return total

    def pipeline_time(self, s: Step, mult: int) -> float:
        prog = s.args["program"]
        p, stages = prog.num_stages, prog.stages
        pro, fwd, bwd, fin = s.subplans
        m = s.runs(1)
        # The prologue and the final segment hold all of a process's micro-batches a run: what
        # varies by micro-batch there runs once for each, one after another, as the runtime runs it.
        held = s.held(0, fin.held_microbatches)
        t_pro = self.plan_time(pro, mult, serial=held)
        # Segments priced as if their stage had the cores to itself (the CPU the stages
        # really share is charged below, from the schedule's busy times), at the pipeline
        # runtime's cost per step (its per-action bookkeeping).
        self.sharing, overlap, self.overlap = 1, self.overlap, True
        self.dispatch = self.cal.pipeline_dispatch_s or None
        self.in_stages = True
        fwd_t, fwd_c = zip(*(self._segment(fwd, mult * m, stages[1], st) for st in range(p)))
        # A B that sends its input gradient upstream leaves its weight gradients to a W
        # (the program's split schedule), as the runtime does.
        later = _put_off(s)
        sends = {a.stage for row in prog.schedule.actions for a in row if a.kind == "send_grad"}
        bwd_t, bwd_c, w_t = [], [], []
        for st in range(p):
            self.later, self.w = (later if st in sends else frozenset()), 0.0
            t, c = self._segment(bwd, mult * m, stages[2], st)
            bwd_t.append(t)
            bwd_c.append(c - self.w)   # the W's matmuls are its own action's compute
            w_t.append(self.w)
        self.later, self.in_stages = frozenset(), False
        self.stages = _stage_costs(prog, [f + b + w for f, b, w in zip(fwd_t, bwd_t, w_t)], self.loop_s)
        self.sharing, self.overlap, self.dispatch = None, overlap, None
        t_fin = self.plan_time(fin, mult, serial=held)
        sched = prog.run_schedule(defer=any(w_t))
        # Each stage's segment time already holds its transfers; the schedule adds the waiting.
        cost = {"F": fwd_t, "B": bwd_t, "W": w_t}
        stats = prog.simulate(lambda a: cost[a.kind][a.stage] if a.kind in cost else 0.0, defer=any(w_t))
        makespan = float(stats.makespan)
        busiest = max(range(len(stats.ranks)), key=lambda r: float(stats.ranks[r].busy))
        busy = float(stats.ranks[busiest].busy)
        self.bubble += mult * (makespan - busy)
        # The critical path runs through the busiest rank: its kernels are the step's compute,
        # the rest of its busy time the collectives and transfers it waits on.
        compute = {"F": fwd_c, "B": bwd_c, "W": w_t}
        self.path += mult * sum(compute[a.kind][a.stage] for a in sched.actions[busiest] if a.kind in BUSY)
        # All processes' busy time (kernels and the collectives they wait on inside F and B)
        # over the cores: a stage in its bubble leaves its core to the others, so an
        # oversubscribed pipeline is slowed by its work, not by its process count.
        demand = sum(float(r.busy) for r in stats.ranks) * (self.nproc // prog.num_ranks) / self.cal.cores
        self.shared += mult * max(0.0, demand - makespan)
        return t_pro + max(makespan, demand) + t_fin

    def _segment(self, plan: Plan, mult: int, stages, stage: int) -> tuple[float, float]:
        """Wall time of one run of a stage's segment, and the kernel seconds of one run."""
        before = self.compute
        t = self.plan_time(plan, mult, stages, stage)
        return t, (self.compute - before) / mult


def _stage_costs(prog, seconds: list, loop_s: dict) -> tuple:
    """Each stage's :class:`StageCost` from its F + B + W seconds and the loops' seconds; with
    several stacks, each one's part too (a stack's loops read its stacked params, after its carried
    tensors, as in :meth:`~meshdsl.lowering.pipeline_program.PipelineProgram.layer_offset`)."""
    def stack(step) -> int:
        return step.ins[step.args.get("carries", 1)] if prog.stack_loops else 0
    loops = sorted(prog.pipelined)   # the forward's first, in graph order (the encoder's first)
    order = list(dict.fromkeys(stack(prog.segments[seg].steps[j]) for seg, j in loops))
    out = []
    for st, total in enumerate(seconds):
        parts = {k: [0, 0.0] for k in order}
        for seg, j in loops:
            step = prog.segments[seg].steps[j]
            if st in prog.stages[seg][j]:
                part = parts[stack(step)]
                part[1] += loop_s.get(id(step), 0.0)
                part[0] += step.times if seg == Segment.FORWARD else 0
        per = tuple((n, s) for n, s in parts.values())
        out.append(StageCost(sum(n for n, _ in per), total, sum(s for _, s in per),
                             per if len(per) > 1 else ()))
    return tuple(out)


def _put_off(step: Step) -> frozenset:
    """Ids of the weight-gradient matmuls in a pipeline's backward loops that a B puts off
    to its W: those of the stacked gradients only the final segment reads (runtime/pipeline.py)."""
    bwd, read = step.subplans[2], step.args["program"].read_in_schedule
    out = set()
    for s in bwd.steps:
        if s.kind == "repeat" and s.args["backward"]:
            (block,) = s.subplans
            for name, v in zip(s.args["names"], s.outs[s.args.get("carries", 1):]):
                i = matmul_producer(block, block.outputs[f"d/{name}"])
                if v not in read and i is not None and name not in s.args.get("streamed", ()):
                    out.add(id(block.steps[i]))
    return frozenset(out)


def _walk(plan: Plan, cal: Calibration, orders: dict | None) -> tuple[_Walk, float]:
    """The walk over ``plan`` at ``cal``, and the step time it found."""
    w = _Walk(cal, plan.mesh.axis_size(process_axes(plan.mesh.names)), orders)
    mb = plan.mesh.axis_size((MB_AXIS,)) if MB_AXIS in plan.mesh.names else 1
    # A pipeline or an accumulate step counts its micro-batches itself (its segments' runs).
    segmented = any(s.kind in ("pipeline", "accumulate") for s in plan.steps)
    return w, w.plan_time(plan, 1, serial=1 if segmented else mb)


def predict(plan: Plan, cal: Calibration, orders: dict | None = None) -> Prediction:
    """Predicted step time, memory per rank and communication of ``plan``.

    Args:
      plan: a compiled training plan.
      cal: the calibration (:func:`~.calibrate.load`).
      orders: the issue orders of ``plan`` and its sub-plans by ``id``, read and filled: predictions
        of one plan at several calibrations (:func:`path_compute_s`) work them out once.

    Returns:
      A :class:`Prediction`.
    """
    w, total = _walk(plan, cal, orders)
    comm_bytes = sum(t["bytes"] for t in process_totals(plan).values())
    # What the compute on the critical path, the bubble and the wait for cores leave is waiting
    # on communication (max: a float's rounding below zero).
    exposed = max(0.0, total - w.path - w.bubble - w.shared)
    return Prediction(total, w.compute, w.comm, exposed, w.bubble, memory_report(plan), comm_bytes,
                      w.rows, w.kernel_calls, w.path, w.shared, w.stages)


def path_compute_s(plan: Plan, cal: Calibration, orders: dict | None = None) -> float:
    """``predict(plan, cal).path_compute_s`` (the same walk), without the memory report and
    totals that :func:`predict` works out besides; ``orders`` as there."""
    return _walk(plan, cal, orders)[0].path


def by_op_table(pred: Prediction, top: int | None = None) -> list[tuple[str, str, float, float]]:
    """Rows of :attr:`Prediction.by_op` merged by label, most expensive first."""
    merged: dict[tuple[str, str], list[float]] = {}
    for label, op, comp, comm in pred.by_op:
        acc = merged.setdefault((label, op), [0.0, 0.0])
        acc[0] += comp
        acc[1] += comm
    rows = sorted(((l, o, c, m) for (l, o), (c, m) in merged.items()), key=lambda r: -(r[2] + r[3]))
    return rows if top is None else rows[:top]
