"""How the launcher starts a rank's process, and what the process takes from it.

A fresh interpreter per rank (the *spawn* start method) pays torch's import,
seconds of CPU, in every rank of every job.  Ranks therefore start from a
*forkserver*: one helper process per launcher that imports torch and meshdsl
once and forks a rank off itself on demand, in tens of milliseconds.

A forked rank would otherwise see the forkserver's world, frozen when it
started; the launcher hands each rank what a spawned child would have had
(the environment as it is now, and stdout/stderr) and the forkserver's own
machinery hands over the working directory and ``sys.path``.
``MESHDSL_START_METHOD=spawn`` (or a platform without forkserver) gives the
fresh-interpreter start instead.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing import reduction

from ..errors import DistributedError, env_choice, message

ENV = "MESHDSL_START_METHOD"
METHODS = ("forkserver", "spawn")
# What the forkserver imports once, before it forks any rank: torch, the rank's side of
# the launcher, and what the command line's jobs and the training loop run.
PRELOAD = ["torch", "torch.distributed", "meshdsl.processes.launcher", "meshdsl.train.jobs", "meshdsl.train.trainer"]
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

_START_TRIES = 4
_RETRY_S = 0.25
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def method() -> str:
    """The start method for ranks: ``$MESHDSL_START_METHOD``, else forkserver where it exists."""
    chosen = env_choice(ENV, METHODS, "a start method", "set it to spawn for a fresh interpreter per rank",
                        DistributedError)
    if chosen == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    return chosen


def context():
    """The multiprocessing context that starts ranks (see :func:`method`)."""
    ctx = multiprocessing.get_context(method())
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    return ctx


@contextlib.contextmanager
def sigint_blocked():
    """Block SIGINT in this thread meanwhile: ranks, and a forkserver, started inside inherit
    the mask (it survives exec and fork), so a Ctrl-C that reaches the whole foreground group
    is acted on by the launcher alone, which stops them."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def in_torchrun() -> bool:
    """True when the torchrun environment (RANK, WORLD_SIZE, ...) is set."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def prestart() -> None:
    """Start the forkserver now, so that the next job's ranks find it ready.

    The server imports torch in a process of its own, while this one goes on (the
    command line calls this before it imports torch itself, when its command will
    start ranks).  Nothing happens under torchrun, with the spawn start method, or
    with a start method that is not valid (the job reports that when it starts).
    """
    if in_torchrun():
        return
    try:
        ctx = context()
    except DistributedError:
        return
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver
    with sigint_blocked():
        forkserver.ensure_running()


def stop_forkserver() -> None:
    """End this process's forkserver now, if it has one.

    For the command line once its command is done (every rank has ended by
    then): a server it started early and never used would otherwise go on
    importing torch, and outlive the command by a second or two.
    """
    from multiprocessing import forkserver
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if not pid:
        return
    try:
        # Not reaped here: multiprocessing reaps it, and starts a new one if a job follows.
        os.kill(pid, signal.SIGKILL)
    except OSError:  # already gone
        pass


def start_process(ctx, make):
    """Start the process ``make()`` returns, and return it.

    A forkserver that died since the last job (killed by the out-of-memory
    killer, say) can still look alive for a moment and refuse the request;
    multiprocessing starts a new server once the old one is reaped, so the start
    is tried again a few times before it is an error.

    Raises:
      DistributedError: the process could not be started.
    """
    tries = _START_TRIES if ctx.get_start_method() == "forkserver" else 1
    for attempt in range(1, tries + 1):
        process = make()
        try:
            process.start()
            return process
        except (EOFError, OSError) as e:
            if attempt == tries:
                raise DistributedError(message(
                    f"cannot start a rank's process ({ctx.get_start_method()}): "
                    f"{type(e).__name__}: {e or 'the server closed the connection'}",
                    rule="each rank is a process of this machine",
                    fix=f"see the error above; with a broken forkserver, set {ENV}=spawn")) from None
        time.sleep(_RETRY_S)


class InheritedFd:
    """A descriptor of the launcher that a rank receives as a duplicate when it starts.

    Pickled only while a process is being started: multiprocessing sends the
    descriptor itself along (over the forkserver's socket, or to the spawned
    interpreter), and :func:`adopt_stdio` puts it in place in the rank.
    """

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup) -> int:
    return dup.detach()


def launcher_stdio() -> tuple:
    """The launcher's stdout and stderr, to hand each rank (None for one that is closed)."""
    out = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
            out.append(InheritedFd(fd))
        except OSError:
            out.append(None)
    return tuple(out)


def adopt_stdio(out: "int | None", err: "int | None") -> None:
    """Point this process's stdout and stderr where the launcher's are now (to /dev/null
    where the launcher's is closed)."""
    for fd, target in ((out, 1), (err, 2)):
        if fd is None:
            fd = os.open(os.devnull, os.O_WRONLY)
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _prctl(option: int, arg) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(option, arg)
        except (OSError, AttributeError):
            pass


def name_process(name: str) -> None:
    """Show ``name`` for this process in ``ps -o comm``, top and /proc (Linux; 15 bytes)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def die_with_parent(alive) -> None:
    """Make sure this rank does not outlive the launcher.

    ``alive`` is the read end of a pipe whose only write end the launcher holds:
    reading it returns (EOF) exactly when the launcher is gone, whether it exited
    or was killed, and whether this process is its child (spawn) or the
    forkserver's.  The parent-death signal is a second, immediate line on Linux:
    the parent is the launcher or the forkserver, which exits with the launcher.
    """
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch():
        try:
            alive.recv_bytes()  # nothing is ever sent: this returns at EOF only
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="meshdsl-parent-watch", daemon=True).start()
