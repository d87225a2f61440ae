"""Start a multi-process job on this machine, or join one that torchrun started.

:func:`spawn` is the launcher and the test harness: it starts one process per
rank, rendezvouses them on a TCP store that the parent hosts on 127.0.0.1,
calls ``fn(comm, *args)`` in each, and returns the results in rank order.  If a
rank raises, dies or hangs, the parent kills the others at once and raises
:class:`DistributedError` naming that rank (see :mod:`.failures`: an error meant for
users comes back as its one message, any other exception with the rank's traceback).
Children also die if the parent dies, so nothing is ever left running.

Ranks start from a *forkserver* that has imported torch and meshdsl once (see
:mod:`.start`), so a job starts in a fraction of a second instead of paying
torch's import in every rank; each rank still gets the launcher's environment,
working directory, ``sys.path``, stdout and stderr as a spawned one would.
``MESHDSL_START_METHOD=spawn`` starts every rank as a fresh interpreter instead.

Under torchrun, :func:`init_from_env` joins the job instead; :func:`launch`
picks whichever applies.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import connection

import torch
import torch.distributed as dist

from ..errors import DistributedError, message
from ..layout.mesh import Mesh
from . import cores, malloc
from ..comm.distributed import DEFAULT_TIMEOUT_S, TorchComm, check_world_size, resolve_backend
from .failures import STALE_S, Raised, describe, failure_error, timeout_error
from .start import (TORCHRUN_ENV, adopt_stdio, context, die_with_parent, in_torchrun, launcher_stdio,
                    name_process, sigint_blocked, start_process)

DEFAULT_JOB_TIMEOUT_S = 300.0
_HOST = "127.0.0.1"
_SETTLE_S = 0.2  # after a first failure, how long to wait for the others to report theirs
# After a first user error (a bad feed or checkpoint: usually raised by every rank at the same
# point), longer, so that one message can say which ranks raised it.
_SETTLE_USER_S = 1.0
_BEAT_S = 0.5    # how often a rank publishes its progress
_PROGRESS_KEY = "meshdsl/progress/"


# ------------------------------------------------------------------ torchrun

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
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise DistributedError(message(
            "init_from_env: the torchrun environment is incomplete",
            bullets=[f"{k} is not set" for k in missing],
            rule=f"a torchrun job sets {', '.join(TORCHRUN_ENV)}",
            fix="start with `torchrun --nproc-per-node N script.py`, or use launch.spawn(fn, N)"))
    if not dist.is_initialized():
        backend = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        try:
            dist.init_process_group(backend, init_method="env://", rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=timedelta(seconds=timeout))
        except RuntimeError as e:  # DistNetworkError and friends
            raise _rendezvous_error(e, timeout) from None
    return dist.get_rank()


def _rendezvous_error(e: RuntimeError, timeout: float) -> DistributedError:
    addr = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    text = str(e)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        what = f"the rendezvous port {addr} is already in use by another process"
        fix = ("pick a free port (torchrun --master-port PORT, or MASTER_PORT=PORT), or stop the "
               "process that holds it (`ss -ltnp | grep PORT`)")
    else:
        what = f"could not join the process group at {addr}"
        fix = (f"check that MASTER_ADDR/MASTER_PORT reach rank 0 and that every rank starts within "
               f"--timeout ({timeout:g} s)")
    return DistributedError(message(
        f"init_from_env: {what}", inputs=[f"rank {os.environ.get('RANK')} of "
                                          f"{os.environ.get('WORLD_SIZE')}",
                                          f"torch.distributed said: {text.strip().splitlines()[0]}"],
        fix=fix))


def launch(fn, mesh, *, nproc: int | None = None, args: tuple = (), backend: str = "auto",
           timeout: float | None = DEFAULT_JOB_TIMEOUT_S,
           collective_timeout: float = DEFAULT_TIMEOUT_S, rdzv_host: str = _HOST) -> list:
    """Run ``fn(comm, *args)`` on every rank of ``mesh``, under torchrun or by spawning.

    Args:
      fn: a module-level function ``fn(comm, *args)``; its result must pickle.
      mesh: a :class:`Mesh` or mesh string, e.g. ``"data:2; model:2"``.
      nproc: processes to spawn; defaults to the mesh size.  Ignored under torchrun.
      args, backend, timeout, collective_timeout, rdzv_host: as for :func:`spawn`.

    Returns:
      Under torchrun, ``[this rank's result]``; otherwise every rank's result.
    """
    mesh = Mesh.parse(mesh)
    if in_torchrun():
        init_from_env(backend, collective_timeout)
        return [fn(TorchComm(mesh, timeout=collective_timeout), *args)]
    return spawn(fn, mesh.size if nproc is None else nproc, args=args, timeout=timeout,
                 backend=resolve_backend(backend, mesh.size if nproc is None else nproc), mesh=mesh,
                 collective_timeout=collective_timeout, rdzv_host=rdzv_host)


# --------------------------------------------------------------------- spawn

def spawn(fn, nproc: int, *, args: tuple = (), timeout: float | None = DEFAULT_JOB_TIMEOUT_S,
          backend: str = "gloo", mesh: "Mesh | str | None" = None,
          collective_timeout: float = DEFAULT_TIMEOUT_S, verbose: bool | None = None,
          rdzv_host: str = _HOST) -> list:
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
      rdzv_host: the address the rendezvous store listens on.  The default,
        127.0.0.1, is reachable from this machine only; any other address
        (``"0.0.0.0"``) lets every host that reaches it join or disturb the job.

    Returns:
      ``[result of rank 0, result of rank 1, ...]``.

    Raises:
      MeshError: the mesh size is not ``nproc``.
      MeshDSLError: a rank raised a meshdsl error meant for users (a bad feed, checkpoint,
        config): that message, naming the rank(s), no traceback; the error is of the
        rank's own class (e.g. ``CheckpointError``) and a ``DistributedError``.
      RankInternalError: a rank raised any other exception (a ``DistributedError``
        carrying that rank's traceback).
      DistributedError: a rank died, stopped making progress (found by
        its heartbeat, with ``mesh``) or did not finish in time; the message
        names the rank and its exit code or signal; also when
        ``rdzv_host`` is not an address of this machine.
    """
    if mesh is not None:
        mesh = Mesh.parse(mesh)
        check_world_size(mesh, nproc)
    backend = resolve_backend(backend, nproc)  # before any process starts: every rank gets this one
    malloc.mode(), cores.mode()  # what each rank sets for itself: a bad setting fails here, before any starts
    ctx = context()
    store, port = _host_store(collective_timeout, rdzv_host)
    connect = _HOST if rdzv_host in ("0.0.0.0", "::", "") else rdzv_host
    procs, readers = [], []
    # Every child holds the read end of this pipe; only the parent holds the write end,
    # so the children see EOF the moment the parent is gone, however it went.
    alive_r, alive_w = ctx.Pipe(duplex=False)
    stdio = launcher_stdio()
    try:
        # Children start with SIGINT blocked: only the parent acts on a Ctrl-C, by stopping them.
        try:
            with sigint_blocked():
                for rank in range(nproc):
                    reader, writer = ctx.Pipe(duplex=False)
                    p = start_process(ctx, lambda: ctx.Process(
                        target=_child, name=f"meshdsl-rank{rank}", args=(
                            rank, nproc, connect, port, backend, collective_timeout, mesh, verbose,
                            fn, args, writer, alive_r, dict(os.environ), stdio)))
                    writer.close()  # so that the reader sees EOF when the child dies
                    procs.append(p)
                    readers.append(reader)
        finally:
            alive_r.close()
        # A heartbeat older than the collective timeout cannot be a rank that waits in a
        # collective (it would have timed out); a floor of several beats absorbs load.
        stale_s = max(4 * _BEAT_S, min(STALE_S, 0.8 * collective_timeout))
        return _supervise(procs, readers, timeout, describe(fn, nproc, mesh),
                          lambda: (_progress(store, nproc), stale_s))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for r in readers:
            r.close()
        alive_w.close()
        del store


def _host_store(timeout: float, host: str = _HOST):
    """Host the rendezvous store in the parent on a socket bound and listening on ``host``.

    Binding port 0 and handing the listening socket to the store leaves no
    window in which another process could take the port.

    Returns:
      ``(store, port)``.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise DistributedError(message(
            f"spawn: cannot listen for the rendezvous on '{host}': {e.strerror or e}",
            rule="the rendezvous host is an address of this machine",
            fix="use the default 127.0.0.1, or an address shown by `ip addr`")) from None
    port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it with itself
    return store, port


def _progress(store, nproc: int) -> dict[int, tuple[float, int, str]]:
    """Each rank's last heartbeat: rank -> (seconds since, collectives done, the last one)."""
    out = {}
    now = time.time()
    for rank in range(nproc):
        key = f"{_PROGRESS_KEY}{rank}"
        try:
            if not store.check([key]):
                continue
            t, n, last = store.get(key).decode().split(" ", 2)
        except (RuntimeError, ValueError):
            continue
        out[rank] = (now - float(t), int(n), last)
    return out


def _supervise(procs, readers, timeout, inputs, progress=lambda: ({}, 0.0)) -> list:
    """Wait for every child; on the first failure stop and raise."""
    n = len(procs)
    results: dict[int, object] = {}
    errors: dict[int, Raised] = {}   # rank -> what it raised
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
            raise timeout_error(procs, results, timeout, inputs)
        poll(1.0 if left is None else min(1.0, left))
        if failed():
            user = errors and all(r.user for r in errors.values()) and len(errors) == len(failed())
            end = time.monotonic() + (_SETTLE_USER_S if user else _SETTLE_S)
            while time.monotonic() < end and (open_readers or len(exited) < n):
                poll(max(0.0, end - time.monotonic()))
            raise failure_error(procs, exited, results, errors, failed(), inputs, *progress())
    return [results[i] for i in range(n)]


def _receive(rank, reader, results, errors) -> None:
    """Take a rank's one message: its error report (plain text, see :class:`Raised`) or its
    pickled result."""
    try:
        data = reader.recv_bytes()
    except (EOFError, OSError):
        return
    if Raised.is_report(data):
        errors[rank] = Raised.decode(data)
    else:
        results[rank] = pickle.loads(data)


# --------------------------------------------------------------------- child

def _child(rank, nproc, host, port, backend, collective_timeout, mesh, verbose, fn, args, conn,
           alive, environ, stdio):
    """Body of one spawned rank: join the group, run ``fn``, send back the result, exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C by stopping us
    die_with_parent(alive)
    adopt_stdio(*stdio)
    os.environ.clear()
    os.environ.update(environ)
    name_process(f"meshdsl-rank{rank}")
    cores.bind_rank(rank, nproc)   # first: the threads this rank starts from here on inherit its cores
    torch.set_num_threads(1)
    malloc.tune_malloc()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=host, MASTER_PORT=str(port),
                      # Every group's creation ends with a store barrier, so no rank leaves (a job
                      # with no collective may end at once) while a peer is still connecting gloo to
                      # it: that peer would fail with "Connection closed by peer" on a loaded machine.
                      TORCH_DIST_INIT_BARRIER="1")
    if os.path.exists("/sys/class/net/lo"):
        # All spawned ranks are on this machine, whatever the store's address: gloo
        # listens on loopback only (and does not resolve the hostname, which fails in
        # sandboxes without a hosts entry).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        backend = resolve_backend(backend)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        limit = timedelta(seconds=collective_timeout)
        store = dist.TCPStore(host, port, is_master=False, timeout=limit)
        dist.init_process_group(backend, store=store, rank=rank, world_size=nproc, timeout=limit)
        target = rank
        if mesh is not None:
            target = TorchComm(mesh, timeout=collective_timeout, verbose=verbose)
            _start_heartbeat(host, port, rank, target)
        payload = pickle.dumps(fn(target, *args))
    except BaseException as e:
        # Exit at once: a clean shutdown could block on peers that are stuck.
        conn.send_bytes(Raised.of(e, time.time(), traceback.format_exc()).encode())
        _exit(conn, 1, clean=False)
    conn.send_bytes(payload)
    _exit(conn, 0, clean=True)


def _exit(conn, code: int, clean: bool) -> None:
    """End the rank: close the pipe, flush, leave the process group, ``os._exit``.

    ``os._exit`` skips interpreter teardown: C++ static destructors would
    otherwise run while gloo or store threads are alive, which aborts with
    "terminate called without an active exception" (SIGABRT) at random.
    """
    conn.close()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None: the launcher started without it
            stream.flush()
    if clean and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(code)


def _start_heartbeat(host, port, rank, comm) -> None:
    """Publish ``time collectives-done last-collective`` in the store every :data:`_BEAT_S`.

    A thread of its own, on a store client of its own, so the beat goes on while
    the main thread is blocked in a collective, and stops when the process does.
    """
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    key = f"{_PROGRESS_KEY}{rank}"

    def beat():
        while True:
            try:
                store.set(key, f"{time.time()} {comm.num_done} {comm.last_done}")
            except RuntimeError:  # the parent is gone; die_with_parent ends us
                return
            time.sleep(_BEAT_S)

    beat_thread = threading.Thread(target=beat, name="meshdsl-heartbeat", daemon=True)
    beat_thread.start()
