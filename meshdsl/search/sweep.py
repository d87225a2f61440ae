"""The calibration's measurements: collectives on real processes, kernels in this process.

:func:`sweep_collectives` runs one job of 2, 4, ... N fresh processes per size (one torch
thread each) and times every collective kind over each group and message size, each from a
barrier, then (:func:`_after_compute`) a small allreduce that the ranks reach from compute
instead.  :func:`sweep_kernels` times matmul/bmm and elementwise/reduction kernels with one
thread, and the per-kernel cost on kernels with almost no work.  :mod:`.calibrate` fits them.
"""
from __future__ import annotations

import time

import torch

#: The collective kinds the sweep measures (``send`` stands for the send/recv pair, timed on the
#: path a pipeline's transfers take: shared memory among the ranks of one host, where it can).
KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "send")
#: Message sizes in bytes per rank: full sweep and ``--quick``.
SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 19, 1 << 20, 1 << 22, 1 << 24)
QUICK_SIZES = (1 << 10, 1 << 16, 1 << 20)
#: A job of n processes sweeps the sizes up to this many bytes over n (an allgather's output
#: per rank), so a large job's sweep stays short and small in memory.
MAX_GATHERED = 1 << 26
#: Kernel sweep: square matmul sides and elementwise element counts.
MATMUL_SIDES = (32, 64, 128, 256, 384)
ELEMENTWISE_NUMELS = (1 << 10, 1 << 14, 1 << 17, 1 << 20)
#: Seconds of compute before each collective that :func:`_after_compute` times.
BURST_S = 1e-3


def median_time(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn`` (after one untimed call)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def sweep_kernels(quick: bool = False, tick=lambda: None) -> dict:
    """Time matmul/bmm and elementwise/reduction kernels with one thread; returns the samples."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    reps = 2 if quick else 4
    mm, ew = [], []
    try:
        for side in MATMUL_SIDES[:-1] if quick else MATMUL_SIDES:
            a, b = torch.randn(side, side), torch.randn(side, side)
            mm.append((2 * side ** 3, _time(lambda: a @ b, reps)))
            a3, b3 = torch.randn(4, side // 2, side), torch.randn(4, side, side // 2)
            mm.append((2 * 4 * (side // 2) ** 2 * side, _time(lambda: torch.bmm(a3, b3), reps)))
            tick()
        for numel in ELEMENTWISE_NUMELS:
            x, y = torch.randn(numel), torch.randn(numel)
            ew.append((3 * 4 * numel, _time(lambda: x * y, reps)))
            ew.append((2 * 4 * numel, _time(lambda: torch.exp(x), reps)))
            ew.append((4 * numel, _time(lambda: x.sum(), reps)))
            tick()
        # The per-kernel cost is measured, not extrapolated: a kernel with almost nothing to
        # do (a fit through the large sizes puts its intercept wherever their noise lands).
        a, x = torch.randn(8, 8), torch.randn(16)
        fixed = {"matmul": median_time(lambda: a @ a, 200), "elementwise": median_time(lambda: x * x, 200)}
    finally:
        torch.set_num_threads(threads)
    return {"matmul": mm, "elementwise": ew, "fixed": fixed}


def _collective_job(comm, sizes, reps, progress_file, done):
    """On every rank: time each kind over each group (axes suffix) and size; rank 0 writes
    the running count of samples (from ``done``) to ``progress_file``."""
    import torch.distributed as dist

    axes = comm.mesh.names
    out: dict = {}
    for kind in KINDS:
        for j in range(len(axes)):
            group = tuple(axes[j:])
            n = comm.mesh.axis_size(group)
            if kind == "send" and n != 2:
                continue
            if kind == "send":   # a pipeline's transfer, by the path the pipeline runtime takes
                comm.open_pipe(group, [1])
            for size in sizes:
                numel = size // 4
                x = torch.randn(max(numel, n * 2))
                args = {"allreduce": {"op": "sum"}, "allgather": {"dim": 0},
                        "reduce_scatter": {"dim": 0, "op": "sum"},
                        "alltoall": {"split_dim": 0, "concat_dim": 0}, "send": {"offset": 1, "tag": 7, "pipe": True}}[kind]
                me = comm.mesh.index_along(comm.rank, group)

                def once():
                    if kind == "send":
                        comm.collective("send" if me == 0 else "recv", [x], group, args)
                        comm.drain()
                    else:
                        comm.collective(kind, [x], group, args)

                times = []
                # small messages are cheap and noisy: more repetitions
                for _ in range(reps * max(1, min(4, (1 << 22) // max(size, 1))) + 1):
                    dist.barrier()
                    t0 = time.perf_counter()
                    once()
                    times.append(time.perf_counter() - t0)
                out.setdefault(kind, {}).setdefault(n, []).append((x.numel() * 4, min(times[1:])))
                done += 1
                if comm.rank == 0 and progress_file:
                    with open(progress_file, "w") as f:
                        f.write(str(done))
    return out, _after_compute(comm, reps)


def _after_compute(comm, reps):
    """Per group size: the mean seconds a small allreduce takes when every rank comes to it
    from :data:`BURST_S` of compute (as in a training step), less its least time when the
    ranks come to it from a barrier (what the sweep prices).  The difference is what the
    sweep misses: the ranks arrive apart and a waiting rank is woken late."""
    import torch.distributed as dist

    a = torch.randn(96, 96)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    k = max(1, round(BURST_S / ((time.perf_counter() - t0) / 20)))
    x = torch.randn(256)
    extra = {}
    for j in range(len(comm.mesh.names)):
        group = tuple(comm.mesh.names[j:])
        times = {True: [], False: []}
        for i in range(48 * reps + 2):
            busy = i % 2 == 0
            if busy:
                for _ in range(k):
                    a @ a
            else:
                dist.barrier()
            t0 = time.perf_counter()
            comm.collective("allreduce", [x], group, {"op": "sum"})
            if i >= 2:
                times[busy].append(time.perf_counter() - t0)
        # The sweep prices a collective at its least time; reached from compute it costs on
        # average this much more (sometimes a late wake-up of milliseconds, mostly little).
        busy = times[True]
        extra[comm.mesh.axis_size(group)] = max(0.0, sum(busy) / len(busy) - min(times[False]))
    return extra


def collective_mesh(nproc: int) -> str:
    """A mesh whose axis suffixes give groups of 2, 4, ... ``nproc`` ranks (one axis otherwise)."""
    if nproc >= 2 and nproc & (nproc - 1) == 0:
        return "; ".join(f"g{i}:2" for i in range(nproc.bit_length() - 1))
    return f"g0:{nproc}"


def job_sizes(nproc: int) -> list[int]:
    """The job sizes the sweep runs: 2, 4, ... up to ``nproc``, and ``nproc``."""
    return sorted({1 << k for k in range(1, nproc.bit_length()) if 1 << k <= nproc} | {nproc})


def sizes_for(job: int, quick: bool) -> tuple[int, ...]:
    """The message sizes a job of ``job`` processes sweeps (at least the smallest two)."""
    sizes = QUICK_SIZES if quick else SIZES
    return tuple(b for i, b in enumerate(sizes) if i < 2 or b * job <= MAX_GATHERED)


def num_collective_samples(nproc: int, quick: bool) -> int:
    return sum(len(sizes_for(j, quick)) * (len(collective_mesh(j).split(";")) * (len(KINDS) - 1) + 1)
               for j in job_sizes(nproc))


def sweep_collectives(nproc: int, backend: str = "gloo", quick: bool = False, progress_file: str | None = None,
                      timeout: float = 120.0) -> dict:
    """Run :func:`_collective_job` on 2, 4, ... ``nproc`` fresh processes (one job per size);
    returns job size -> kind -> group size -> samples, and job size -> group size -> the
    extra seconds of a collective reached from compute (:func:`_after_compute`)."""
    from ..processes.launcher import spawn

    out, after, done = {}, {}, 0
    for job in job_sizes(nproc):
        results = spawn(_collective_job, job, args=(sizes_for(job, quick), 2 if quick else 4, progress_file, done),
                        timeout=timeout, backend=backend, mesh=collective_mesh(job))
        # Every rank waited for the slowest in each sample: take the per-sample max.
        merged: dict = {}
        for kind, table in results[0][0].items():
            for n, rows in table.items():
                merged.setdefault(kind, {})[n] = [
                    (b, max(r[0][kind][n][i][1] for r in results)) for i, (b, _) in enumerate(rows)]
                done += len(rows)
        out[job] = merged
        after[job] = {n: max(r[1][n] for r in results) for n in results[0][1]}
    return out, after


def num_kernel_samples(quick: bool) -> int:
    return len(MATMUL_SIDES) - (1 if quick else 0) + len(ELEMENTWISE_NUMELS) + 1
