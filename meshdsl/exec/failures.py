"""What the launcher says when a job fails: which rank, how, and what to do.

:func:`failure_error` picks the first cause among the ranks of a failed job
(a rank that died silently, a rank that stopped making progress while the
others timed out waiting for it, or the earliest exception) and formats it in
the house structure; :func:`timeout_error` covers a job over its time limit.
"""
from __future__ import annotations

import signal
from pathlib import Path

from ..errors import DistributedError, message

# A rank whose heartbeat is this old is not running (stopped, or stuck holding the GIL):
# five beats, so a loaded machine does not make a healthy rank look dead.
STALE_S = 2.5


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
        last_line = _clip(errors[i][1].strip().splitlines()[-1])
        bullets.append(f"rank {i} failed while waiting for it in {during}: {last_line}")
    return DistributedError(message(
        f"spawn: rank {first} of {len(procs)} stopped making progress; the other ranks waited "
        f"for it in {during}", inputs=inputs, bullets=bullets,
        rule="every collective waits for every rank of its group",
        fix=f"find what rank {first} was doing instead of joining {during} (a debugger "
            f"breakpoint, SIGSTOP, an endless loop); `py-spy dump --pid {procs[first].pid}` "
            f"shows a stuck rank's stack"))


def failure_error(procs, exited, results, errors, bad, inputs, progress=None,
                   stale_s: float = STALE_S) -> DistributedError:
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
        fix = ("the child stopped before or outside fn (see its stderr above): a rank gets fn "
               "by name, so fn must be importable and the main script a file guarded by "
               "`if __name__ == '__main__':`; fn must return, not exit")
    text = message(f"spawn: rank {first} of {len(procs)} {what}", inputs=inputs,
                   bullets=bullets, fix=fix)
    if first in errors:
        text += f"\nTraceback of rank {first}:\n{errors[first][1]}"
    return DistributedError(text)


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


