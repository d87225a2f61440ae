"""Collectives through shared memory vs through gloo's sockets, side by side in one job.

Every process runs a TorchComm over ``data:N``; for each collective kind and message size
the two transports take turns (``comm.shm`` on, then off, rotating which goes first): a
barrier, then ``--reps`` back-to-back calls whose mean is the turn's sample, the slowest
rank's.  Per kind and size it reports the median over turns of each transport's time and
busy CPU time per call (the process's, gloo's thread included), and their ratio.  The sizes
are the bytes each rank sends in: 64 KiB, 1 MiB, 4 MiB (one shared-memory slot) and 16 MiB
(in pieces of a slot).  ``sendrecv`` is a pipeline's transfer (comm/shm_pipe.py against gloo's
``isend``/``irecv``): ranks 2i and 2i+1 bounce the tensor, and a call is one round trip (a
send each way).

    python bench/collectives.py                 # 2 processes, 5 turns x 10 calls
    python bench/collectives.py --nproc 4       # 4 processes (on 2 cores: oversubscribed)

Writes bench/results/collectives.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "collectives.json"
SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)
KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "sendrecv")


def _call(comm, kind: str, x: torch.Tensor):
    axes = ("data",)
    if kind == "sendrecv":   # even ranks send first; the pipe when comm.shm is on
        off = 1 if comm.rank % 2 == 0 else -1
        args = {"offset": off, "tag": 0, "pipe": comm.shm}
        if off == 1:
            comm.collective("send", [x], axes, args)
        y = comm.start("recv", [x], axes, {**args, "offset": -off}).wait()
        if off == -1:
            comm.collective("send", [x], axes, args)
        comm.drain()
        return y
    if kind == "allreduce":
        return comm.all_reduce([x], axes, "sum")
    if kind == "allgather":
        return comm.all_gather([x], axes, dim=0)
    if kind == "reduce_scatter":
        return comm.reduce_scatter([x], axes, dim=0, op="sum")
    return comm.all_to_all([x], axes, 0, 0)


def job(comm, turns: int, reps: int):
    """This rank's samples: (kind, bytes, transport) -> [(wall s, cpu s) per call, per turn]."""
    import torch.distributed as dist
    comm.open_pipe(("data",), [1, -1])
    out = {}
    for kind in KINDS:
        for nbytes in SIZES:
            x = torch.randn(nbytes // 4)
            for t in range(turns):
                for shm in ((True, False) if t % 2 == 0 else (False, True)):
                    comm.shm = shm
                    _call(comm, kind, x)
                    dist.barrier()
                    c0, t0 = time.process_time(), time.perf_counter()
                    for _ in range(reps):
                        _call(comm, kind, x)
                    wall, cpu = (time.perf_counter() - t0) / reps, (time.process_time() - c0) / reps
                    out.setdefault(f"{kind}|{nbytes}|{'shm' if shm else 'gloo'}", []).append((wall, cpu))
    comm.shm = True
    return out, [g is not None for g in comm._shm.values()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from rich.console import Console
    from rich.table import Table
    from meshdsl.comm import shm
    from meshdsl.processes.launcher import spawn
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import machine_end, machine_start
    machine = machine_start(threads=1)
    if not shm.supported():
        print("shared-memory collectives need x86-64 Linux with /dev/shm", file=sys.stderr)
        return 2
    res = spawn(job, args.nproc, args=(args.turns, args.reps), mesh=f"data:{args.nproc}", timeout=1800)
    if not all(all(used) and used for _, used in res):
        print("a group did not get a shared-memory segment", file=sys.stderr)
        return 1
    rows, table = [], Table(title=f"collectives on {args.nproc} processes (gloo backend), "
                                  f"{args.turns} turns x {args.reps} calls, median per call", title_justify="left")
    for col in ("kind", "bytes per rank", "shm ms", "gloo ms", "shm / gloo", "shm CPU ms", "gloo CPU ms"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for kind in KINDS:
        for nbytes in SIZES:
            fig = {}
            for tr in ("shm", "gloo"):
                turns = list(zip(*(r[0][f"{kind}|{nbytes}|{tr}"] for r in res)))  # per turn, every rank
                fig[tr] = (statistics.median(max(w for w, _ in ranks) for ranks in turns) * 1e3,
                           statistics.median(max(c for _, c in ranks) for ranks in turns) * 1e3)
            rows.append({"kind": kind, "bytes": nbytes, "shm_ms": fig["shm"][0], "gloo_ms": fig["gloo"][0],
                         "shm_cpu_ms": fig["shm"][1], "gloo_cpu_ms": fig["gloo"][1]})
            size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
            table.add_row(kind, size, f"{fig['shm'][0]:.3f}", f"{fig['gloo'][0]:.3f}",
                          f"{fig['shm'][0] / fig['gloo'][0]:.2f}", f"{fig['shm'][1]:.3f}", f"{fig['gloo'][1]:.3f}")
    Console(width=max(Console().width, 110)).print(table)
    print(f"shared-memory slot: {shm.SLOT_BYTES >> 20} MiB (a larger tensor goes in pieces of a slot)")
    machine_end(machine)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"nproc": args.nproc, "turns": args.turns, "reps": args.reps, "rows": rows,
                                   "machine": machine}, indent=1))
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
