"""What the launcher says when a job fails: which rank, how, and what to do.

A rank that raises reports a :class:`Raised`: its exception's class name, message and
traceback as plain text (JSON), never a pickled object, so the launcher unpickles nothing
a failing rank wrote about its failure.

:func:`failure_error` picks the first cause among the ranks of a failed job
(a rank that died silently, a rank that stopped making progress while the
others timed out waiting for it, or the earliest exception) and formats it in
the house structure; :func:`timeout_error` covers a job over its time limit.
An exception meant for users (a :class:`~meshdsl.errors.MeshDSLError`: a bad
checkpoint, config, feed or data) comes back as that one message, naming the
rank(s) that raised it and printed once when several raised the same, with no
traceback; any other exception is a :class:`RankInternalError` that carries the
rank's traceback.
"""
from __future__ import annotations

import functools
import json
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import DistributedError, MeshDSLError, message

# A rank whose heartbeat is this old is not running (stopped, or stuck holding the GIL):
# five beats, so a loaded machine does not make a healthy rank look dead.
STALE_S = 2.5


class RankInternalError(DistributedError):
    """A rank raised an exception that is not a meshdsl error meant for users: a bug (in
    meshdsl, or in the user's own code), reported with that rank's traceback."""


_TAG = b"E"  # what a rank's error report starts with (a pickled result starts with b"\x80")


@dataclass(frozen=True)
class Raised:
    """What a rank tells the launcher about the exception it raised, as plain text."""

    time: float      # time.time() when it was caught
    kind: str        # the class, "module.QualName"
    user: bool       # a MeshDSLError: one message for the user, no traceback
    text: str        # str() of the exception
    traceback: str

    @classmethod
    def of(cls, exc: BaseException, when: float, traceback: str) -> "Raised":
        kind = type(exc)
        try:
            text = str(exc)
        except Exception:  # noqa: BLE001 - a broken __str__ must not cost the report
            text = f"<{kind.__qualname__} whose str() failed>"
        return cls(when, f"{kind.__module__}.{kind.__qualname__}", isinstance(exc, MeshDSLError), text, traceback)

    def encode(self) -> bytes:
        return _TAG + json.dumps(asdict(self)).encode()

    @staticmethod
    def is_report(data: bytes) -> bool:
        return data[:1] == _TAG

    @classmethod
    def decode(cls, data: bytes) -> "Raised":
        """The report in ``data``; one that does not parse becomes an internal error showing it."""
        try:
            fields = json.loads(data[len(_TAG):].decode())
            return cls(float(fields["time"]), str(fields["kind"]), fields["user"] is True, str(fields["text"]),
                       str(fields["traceback"]))
        except (ValueError, KeyError, TypeError) as e:
            return cls(0.0, "?", False, "", f"an unreadable error report ({e}): {data[:200]!r}")

    @property
    def last_line(self) -> str:
        """The traceback's last line (``Class: message``), or the message's first for a user error."""
        text = self.text if self.user else self.traceback
        lines = text.strip().splitlines()
        return lines[-1 if not self.user else 0] if lines else self.kind


def describe(fn, nproc, mesh) -> list[str]:
    """The inputs lines of a launcher message: fn, process count, mesh."""
    name = getattr(fn, "__qualname__", repr(fn))
    out = [f"fn: {getattr(fn, '__module__', '?')}.{name}", f"processes: {nproc}"]
    if mesh is not None:
        out.append(f"mesh: {mesh}")
    return out


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


def _stopped(p) -> bool:
    """True when the process is stopped by a signal (SIGSTOP, SIGTSTP, a debugger)."""
    try:
        return Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt"
    except (OSError, IndexError):
        return False


def _hung_error(procs, errors, hung, progress, inputs) -> DistributedError:
    """A rank stopped making progress; the ranks that raised timed out waiting for it."""
    first = hung[0]
    age, done, last = progress[first]
    how = "is stopped by a signal" if _stopped(procs[first]) else "is alive but stuck"
    bullets = [f"rank {first} (pid {procs[first].pid}) {how}: its last heartbeat, {age:.1f} s ago, "
               f"showed {done} collectives completed" + (f", the last {last}" if last else "")]
    for i in hung[1:]:
        bullets.append(f"rank {i} also stopped: no heartbeat for {progress[i][0]:.1f} s")
    waiting = sorted(errors)
    counts = sorted({progress[i][1] for i in waiting if i in progress})
    during = f"collective #{counts[-1] + 1}" if counts else "a collective"
    for i in waiting:
        last_line = _clip(errors[i].last_line)
        bullets.append(f"rank {i} failed while waiting for it in {during}: {last_line}")
    return DistributedError(message(
        f"spawn: rank {first} of {len(procs)} stopped making progress; the other ranks waited "
        f"for it in {during}", inputs=inputs, bullets=bullets,
        rule="every collective waits for every rank of its group",
        fix=f"find what rank {first} was doing instead of joining {during} (a debugger "
            f"breakpoint, SIGSTOP, an endless loop); `py-spy dump --pid {procs[first].pid}` "
            f"shows a stuck rank's stack"))


def failure_error(procs, exited, results, errors: "dict[int, Raised]", bad, inputs, progress=None,
                  stale_s: float = STALE_S) -> DistributedError:
    """The error that says why a job failed (see the module docstring); ``errors`` holds the
    reports of the ranks that raised, ``bad`` every rank that failed."""
    # The first cause is a rank that died without a traceback (a signal, os._exit),
    # else a rank whose heartbeat stopped while others failed (they timed out waiting
    # for it), else the earliest exception: later ones are usually peers losing their
    # connection.
    silent = [i for i in bad if i not in errors]
    running = [i for i in range(len(procs)) if i not in exited and i not in errors
               and i not in results]
    hung = [i for i in running if i in (progress or {}) and progress[i][0] > stale_s]
    if not silent and hung:
        return _hung_error(procs, errors, hung, progress, inputs)
    first = silent[0] if silent else min(bad, key=lambda i: errors[i].time)
    if first in errors and errors[first].user:
        return user_error(errors, first, len(procs))
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
            bullets.append(_also_failed(i, errors[i], first))
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
        fix = ("the child stopped before or outside fn (see its stderr above): a rank gets fn "
               "by name, so fn must be importable and the main script a file guarded by "
               "`if __name__ == '__main__':`; fn must return, not exit")
    text = message(f"spawn: rank {first} of {len(procs)} {what}", inputs=inputs,
                   bullets=bullets, fix=fix)
    if first in errors:
        return RankInternalError(f"{text}\nTraceback of rank {first}:\n{errors[first].traceback}")
    return DistributedError(text)


def user_error(errors: "dict[int, Raised]", first: int, nproc: int) -> MeshDSLError:
    """Rank ``first``'s error meant for users, as the one message it is: the ranks that raised
    it first (the same class and text: said once), then a line per rank that failed otherwise.

    The error is of the rank's own class where this process has it loaded (``except
    CheckpointError`` works around a launch) and also a :class:`DistributedError`."""
    raised = errors[first]
    same = sorted(i for i, r in errors.items() if (r.kind, r.text) == (raised.kind, raised.text))
    who = (f"rank {first} of {nproc} raised an exception" if len(same) == 1 else
           f"ranks {_ranges(same)} of {nproc} raised the same exception")
    text = f"{who}: {raised.text}"
    others = [f"  * {_also_failed(i, r, first)}" for i, r in sorted(errors.items()) if i not in same]
    if others:
        text += "\nOther ranks:\n" + "\n".join(others)
    try:
        return _as_raised_in_rank(raised.kind)(text)
    except TypeError:  # a class whose __init__ wants more than a message
        return DistributedError(text)


#: What a rank's error says when a peer it was talking to went away (gloo, NCCL, sockets):
#: a consequence of the first failure, not a second one.
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
              "socket closed", "ncclremoteerror")


def _also_failed(i: int, raised: "Raised", first: int) -> str:
    """A bullet for rank ``i``, which failed after rank ``first``: a lost connection says so."""
    line = _clip(raised.last_line)
    if any(k in line.lower() for k in _LOST_PEER):
        return f"rank {i} lost its connection when rank {first} stopped (a consequence): {line}"
    return f"rank {i} also failed: {line}"


def _ranges(ranks: list[int]) -> str:
    """``0-3, 5, 7-8`` for ``[0, 1, 2, 3, 5, 7, 8]``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)


def _as_raised_in_rank(kind: str) -> type:
    """The class to raise for a rank's user error of class ``kind`` ("module.QualName"): that
    class joined with :class:`DistributedError`, when it is a MeshDSLError this process has
    loaded; else DistributedError.  Only classes already loaded are looked up: a report never
    makes the launcher import anything."""
    todo = [MeshDSLError]
    while todo:
        cls = todo.pop()
        if f"{cls.__module__}.{cls.__qualname__}" == kind:
            return cls if issubclass(cls, DistributedError) else _joined(cls)
        todo.extend(cls.__subclasses__())
    return DistributedError


@functools.lru_cache(maxsize=None)
def _joined(cls: type) -> type:
    """``cls`` that is also a :class:`DistributedError` (one class per ``cls``)."""
    return type(cls.__name__, (cls, DistributedError), {"__module__": cls.__module__, "__doc__": cls.__doc__})


def _clip(line: str, width: int = 160) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def timeout_error(procs, results, timeout, inputs) -> DistributedError:
    late = [i for i in range(len(procs)) if i not in results]
    return DistributedError(message(
        f"spawn: rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} of "
        f"{len(procs)} did not finish within {timeout:g} s",
        inputs=inputs,
        bullets=[f"rank {i} finished" for i in sorted(results)],
        rule="every rank must call the same collectives in the same order",
        fix="look for a rank that skipped or reordered a collective, or raise timeout="))


