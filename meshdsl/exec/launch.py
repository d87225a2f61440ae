"""Start a multi-process job on this machine, or join one that torchrun started.

:func:`spawn` is the launcher and the test harness: it starts one process per
rank with the *spawn* start method, rendezvouses them on a TCP store that the
parent hosts on 127.0.0.1, calls ``fn(comm, *args)`` in each, and returns the
results in rank order.  If a rank raises, dies or hangs, the parent kills the
others at once and raises :class:`DistributedError` with that rank's traceback.
Children also die if the parent dies, so nothing is ever left running.

Under torchrun, :func:`init_from_env` joins the job instead; :func:`launch`
picks whichever applies.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import connection, get_context

import torch
import torch.distributed as dist

from ..errors import DistributedError, message
from ..layout.mesh import Mesh
from .distributed import DEFAULT_TIMEOUT_S, TorchComm, check_world_size, resolve_backend

DEFAULT_JOB_TIMEOUT_S = 300.0
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_HOST = "127.0.0.1"
_PORT_TRIES = 8
_SETTLE_S = 0.2  # after a first failure, how long to wait for the others to report theirs


# ------------------------------------------------------------------ torchrun

def in_torchrun() -> bool:
    """True when the torchrun environment (RANK, WORLD_SIZE, ...) is set."""
    return all(k in os.environ for k in _TORCHRUN_ENV)


def init_from_env(backend: str = "auto", timeout: float = DEFAULT_TIMEOUT_S) -> int:
    """Join the process group described by torchrun's environment variables.

    Args:
      backend: ``"auto"`` (nccl with CUDA, else gloo), ``"gloo"`` or ``"nccl"``.
      timeout: seconds before a collective gives up.

    Returns:
      This process's rank.

    Raises:
      DistributedError: a torchrun variable is missing.
    """
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise DistributedError(message(
            "init_from_env: the torchrun environment is incomplete",
            bullets=[f"{k} is not set" for k in missing],
            rule=f"a torchrun job sets {', '.join(_TORCHRUN_ENV)}",
            fix="start with `torchrun --nproc-per-node N script.py`, or use launch.spawn(fn, N)"))
    if not dist.is_initialized():
        backend = resolve_backend(backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, init_method="env://", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=timeout))
    return dist.get_rank()


def launch(fn, mesh, *, nproc: int | None = None, args: tuple = (), backend: str = "auto",
           timeout: float | None = DEFAULT_JOB_TIMEOUT_S,
           collective_timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """Run ``fn(comm, *args)`` on every rank of ``mesh``, under torchrun or by spawning.

    Args:
      fn: a module-level function ``fn(comm, *args)``; its result must pickle.
      mesh: a :class:`Mesh` or mesh string, e.g. ``"data:2; model:2"``.
      nproc: processes to spawn; defaults to the mesh size.  Ignored under torchrun.
      args, backend, timeout, collective_timeout: as for :func:`spawn`.

    Returns:
      Under torchrun, ``[this rank's result]``; otherwise every rank's result.
    """
    mesh = Mesh.parse(mesh)
    if in_torchrun():
        init_from_env(backend, collective_timeout)
        return [fn(TorchComm(mesh, timeout=collective_timeout), *args)]
    return spawn(fn, mesh.size if nproc is None else nproc, args=args, timeout=timeout,
                 backend=resolve_backend(backend), mesh=mesh,
                 collective_timeout=collective_timeout)


# --------------------------------------------------------------------- spawn

def spawn(fn, nproc: int, *, args: tuple = (), timeout: float | None = DEFAULT_JOB_TIMEOUT_S,
          backend: str = "gloo", mesh: "Mesh | str | None" = None,
          collective_timeout: float = DEFAULT_TIMEOUT_S, verbose: bool | None = None) -> list:
    """Run ``fn`` in ``nproc`` fresh processes and return their results in rank order.

    Each child sets one torch thread, joins the process group, and calls
    ``fn(TorchComm(mesh), *args)`` when ``mesh`` is given, else ``fn(rank, *args)``.

    Args:
      fn: a module-level (picklable) function; its result must pickle.
      nproc: number of processes (ranks).
      args: extra arguments for ``fn``, pickled once per child.
      timeout: seconds the whole job may take (``None``: no limit).
      backend: ``"gloo"``, ``"nccl"`` or ``"auto"``.
      mesh: e.g. ``"data:2; model:2"``; its size must be ``nproc``.
      collective_timeout: seconds before a collective gives up inside the children.
      verbose: log every collective (see :class:`TorchComm`).

    Returns:
      ``[result of rank 0, result of rank 1, ...]``.

    Raises:
      MeshError: the mesh size is not ``nproc``.
      DistributedError: a rank raised, died or did not finish in time; the
        message names the rank, its exit code or signal, and its traceback.
    """
    if mesh is not None:
        mesh = Mesh.parse(mesh)
        check_world_size(mesh, nproc)
    ctx = get_context("spawn")
    store, port = _host_store(collective_timeout)
    procs, readers = [], []
    try:
        for rank in range(nproc):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"meshdsl-rank{rank}", args=(
                rank, nproc, port, backend, collective_timeout, mesh, verbose, fn, args,
                writer, os.getpid()))
            p.start()
            writer.close()  # so that the reader sees EOF when the child dies
            procs.append(p)
            readers.append(reader)
        return _supervise(procs, readers, timeout, _describe(fn, nproc, mesh))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for r in readers:
            r.close()
        del store


def _pick_port() -> int:
    """A port that was free a moment ago (bind to 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]


def _host_store(timeout: float):
    """Host the rendezvous store in the parent; retry on a port that got taken."""
    errors = []
    for _ in range(_PORT_TRIES):
        port = _pick_port()
        try:
            store = dist.TCPStore(_HOST, port, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=timeout))
            return store, port
        except RuntimeError as e:  # DistNetworkError: someone else bound the port first
            if "EADDRINUSE" not in str(e) and "in use" not in str(e):
                raise
            errors.append(port)
    raise DistributedError(message(
        f"spawn: no free port for the rendezvous on {_HOST}",
        bullets=[f"port {p} was in use" for p in errors],
        fix="free some local ports, or start the job with torchrun"))


def _describe(fn, nproc, mesh) -> list[str]:
    name = getattr(fn, "__qualname__", repr(fn))
    out = [f"fn: {getattr(fn, '__module__', '?')}.{name}", f"processes: {nproc}"]
    if mesh is not None:
        out.append(f"mesh: {mesh}")
    return out


def _supervise(procs, readers, timeout, inputs) -> list:
    """Wait for every child; on the first failure stop and raise."""
    n = len(procs)
    results: dict[int, object] = {}
    errors: dict[int, tuple[float, str]] = {}   # rank -> (time of failure, traceback)
    exited: set[int] = set()
    open_readers = dict(enumerate(readers))
    deadline = None if timeout is None else time.monotonic() + timeout

    def poll(wait_s):
        """Take in whatever is ready within ``wait_s`` seconds."""
        objs = list(open_readers.values())
        objs += [p.sentinel for i, p in enumerate(procs) if i not in exited]
        for obj in connection.wait(objs, timeout=wait_s):
            for i, r in list(open_readers.items()):
                if obj is r:
                    _receive(i, r, results, errors)
                    del open_readers[i]
            for i, p in enumerate(procs):
                if obj == p.sentinel:
                    p.join()
                    exited.add(i)
                    if i in open_readers and open_readers[i].poll(0):  # a last message
                        _receive(i, open_readers.pop(i), results, errors)

    def failed() -> list[int]:
        bad = set(errors) | {i for i in exited if procs[i].exitcode != 0}
        bad |= {i for i in exited if i not in results and i not in open_readers}
        return sorted(bad)

    while len(exited) < n or open_readers:
        # Short waits so a dead child is noticed within a second even if nothing else moves.
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise _timeout_error(procs, results, timeout, inputs)
        poll(1.0 if left is None else min(1.0, left))
        if failed():
            end = time.monotonic() + _SETTLE_S
            while time.monotonic() < end and (open_readers or len(exited) < n):
                poll(max(0.0, end - time.monotonic()))
            raise _failure_error(procs, exited, results, errors, failed(), inputs)
    return [results[i] for i in range(n)]


def _receive(rank, reader, results, errors) -> None:
    try:
        msg = pickle.loads(reader.recv_bytes())
    except (EOFError, OSError):
        return
    if msg[0] == "ok":
        results[rank] = msg[1]
    else:
        errors[rank] = (msg[1], msg[2])


def _how(p) -> str:
    code = p.exitcode
    if code is None:
        return "was still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"was killed by signal {-code} (exit code {code})"
    return f"exited with code {code}"


def _failure_error(procs, exited, results, errors, bad, inputs) -> DistributedError:
    # The first cause is a rank that died without a traceback (a signal, os._exit),
    # else the earliest exception: later ones are usually peers losing their connection.
    silent = [i for i in bad if i not in errors]
    first = silent[0] if silent else min(bad, key=lambda i: errors[i][0])
    p = procs[first]
    what = "raised an exception" if first in errors else _how(p)
    if first in errors and first in exited:
        what += f" and {_how(p)}"
    elif first not in errors and p.exitcode == 0:
        what = "exited without sending a result"
    bullets = []
    for i, q in enumerate(procs):
        if i == first:
            continue
        if i in errors:
            last = errors[i][1].strip().splitlines()[-1]
            bullets.append(f"rank {i} also failed: {_clip(last)}")
        elif i in bad:
            bullets.append(f"rank {i} also failed: it {_how(q)}")
        elif i not in results:
            bullets.append(f"rank {i} was stopped by the launcher")
    if first in errors:
        fix = f"see rank {first}'s traceback below"
    elif p.exitcode is not None and p.exitcode < 0:
        fix = ("a SIGKILL often means the out-of-memory killer, SIGSEGV or SIGABRT a crash in "
               "native code: rerun with fewer processes or smaller inputs")
    else:
        fix = ("the child stopped before or outside fn (see its stderr above): with the spawn "
               "start method fn must be importable and the main script a file guarded by "
               "`if __name__ == '__main__':`; fn must return, not exit")
    text = message(f"spawn: rank {first} of {len(procs)} {what}", inputs=inputs,
                   bullets=bullets, fix=fix)
    if first in errors:
        text += f"\nTraceback of rank {first}:\n{errors[first][1]}"
    return DistributedError(text)


def _clip(line: str, width: int = 160) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def _timeout_error(procs, results, timeout, inputs) -> DistributedError:
    late = [i for i in range(len(procs)) if i not in results]
    return DistributedError(message(
        f"spawn: rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} of "
        f"{len(procs)} did not finish within {timeout:g} s",
        inputs=inputs,
        bullets=[f"rank {i} finished" for i in sorted(results)],
        rule="every rank must call the same collectives in the same order",
        fix="look for a rank that skipped or reordered a collective, or raise timeout="))


# --------------------------------------------------------------------- child

def _child(rank, nproc, port, backend, collective_timeout, mesh, verbose, fn, args, conn,
           parent_pid):
    """Body of one spawned rank: join the group, run ``fn``, send back the result."""
    _die_with_parent(parent_pid)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=_HOST, MASTER_PORT=str(port))
    if os.path.exists("/sys/class/net/lo"):
        # All ranks are on this machine; gloo otherwise resolves the hostname, which
        # fails in sandboxes without a hosts entry.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        backend = resolve_backend(backend)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        limit = timedelta(seconds=collective_timeout)
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=limit)
        dist.init_process_group(backend, store=store, rank=rank, world_size=nproc, timeout=limit)
        target = rank if mesh is None else TorchComm(mesh, timeout=collective_timeout,
                                                     verbose=verbose)
        payload = pickle.dumps(("ok", fn(target, *args)))
    except BaseException:
        # Exit at once: a clean shutdown could block on peers that are stuck.
        conn.send_bytes(pickle.dumps(("error", time.time(), traceback.format_exc())))
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    conn.send_bytes(payload)
    conn.close()
    dist.destroy_process_group()


def _die_with_parent(parent_pid: int) -> None:
    """Make sure this child does not outlive the launcher."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    threading.Thread(target=watch, name="meshdsl-parent-watch", daemon=True).start()
