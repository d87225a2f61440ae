"""Is a checkpoint intact, and which one does a resume read?

A committed checkpoint is *intact* when ``checkpoint.json`` reads and matches its
digest, and every shard file it lists

* is there, at the size recorded at the save;
* has a sound safetensors header: its length fits the file, each tensor's
  ``data_offsets`` lie inside the data, do not overlap, and hold exactly its
  dtype and shape, and the slices ``checkpoint.json`` maps to the file are
  there with their dtype and shape;
* with ``verify="sha256"`` (the default), hashes to the sha256 recorded at the save.

``verify="size"`` is the fast path: everything but the hash (a few reads per
file).  :func:`verify_checkpoint` checks one checkpoint; :func:`choose_checkpoint`
picks what a resume reads (the latest committed one, or a given step or path)
and refuses a damaged one, naming the older intact ones and the flag that
resumes from one: there is no silent fallback.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from ..errors import message
from .checkpoint_format import (META_FILE, CheckpointError, CheckpointMeta, committed_steps, read_metadata,
                                step_dir_name, step_dirs)

VERIFY_MODES = ("sha256", "size")
# torch dtype -> the dtype string in a safetensors header.
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
_ITEMSIZE = {code: dtype.itemsize for dtype, code in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = 100 * 2**20   # safetensors refuses a longer header
_MAX_BULLETS = 4            # per file: the first few problems say enough


def check_verify_mode(verify: str, where: str) -> None:
    """Refuse a ``verify`` other than :data:`VERIFY_MODES` (``where``: the caller, for the message)."""
    if verify not in VERIFY_MODES:
        raise CheckpointError(message(f"{where}: verify={verify!r}.", rule='verify is "sha256" or "size"',
                                      fix='pass "sha256" (the default: hash every shard file) or "size" '
                                          "(sizes and headers only, the fast path)"))


def _wanted_slices(info: CheckpointMeta) -> dict[str, dict[str, tuple[str, list[int]]]]:
    """file -> {key: (safetensors dtype, sizes)} of the slices checkpoint.json maps to it."""
    out: dict[str, dict] = {f: {} for f in info.files}
    for saved in info.tensors.values():
        for sl in saved.slices:
            out[sl.file][sl.key] = (SAFETENSORS_DTYPES[saved.dtype], list(sl.sizes))
    return out


def _entry(key: str, entry) -> tuple[str, list[int], int, int]:
    """``(dtype, shape, begin, end)`` of one header entry; raises ValueError when malformed."""
    if not isinstance(entry, dict) or entry.get("dtype") not in _ITEMSIZE:
        raise ValueError(f"tensor {key!r}: malformed header entry {json.dumps(entry)[:80]}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2 or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in shape + offsets):
        raise ValueError(f"tensor {key!r}: malformed header entry {json.dumps(entry)[:80]}")
    return entry["dtype"], shape, offsets[0], offsets[1]


def _header_problems(fh, size: int, wanted: dict) -> list[str]:
    """What is wrong with the safetensors header of open file ``fh`` of ``size`` bytes."""
    head = fh.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else None
    if n is None:
        return [f"{size} bytes are too few for a safetensors header"]
    if n > size - 8:
        return [f"its header claims {n} bytes, but {size - 8} follow its 8-byte length"]
    if n > _MAX_HEADER:
        return [f"its header claims {n} bytes, more than safetensors reads ({_MAX_HEADER})"]
    try:
        header = json.loads(fh.read(n))
    except (UnicodeDecodeError, ValueError) as e:
        return [f"its {n}-byte header is not JSON ({e})"]
    if not isinstance(header, dict):
        return [f"its header is a JSON {type(header).__name__}, not an object"]
    data, bad, spans = size - 8 - n, [], []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, lo, hi = _entry(key, entry)
        except ValueError as e:
            bad.append(str(e))
            continue
        need = math.prod(shape) * _ITEMSIZE[dtype]
        if not 0 <= lo <= hi <= data:
            bad.append(f"tensor {key!r}: data_offsets [{lo}, {hi}] are not a range inside its {data} data bytes")
        elif hi - lo != need:
            bad.append(f"tensor {key!r}: data_offsets [{lo}, {hi}] hold {hi - lo} bytes, {dtype} {shape} "
                       f"needs {need}")
        else:
            spans.append((lo, hi, key))
    spans.sort()
    bad += [f"tensors {a[2]!r} and {b[2]!r}: data_offsets overlap" for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    for key, (dtype, sizes) in wanted.items():
        entry = header.get(key)
        if not isinstance(entry, dict):
            bad.append(f"tensor {key!r}: not in the file, where {META_FILE} puts it")
        elif entry.get("dtype") != dtype or entry.get("shape") != sizes:
            bad.append(f"tensor {key!r}: {entry.get('dtype')} {entry.get('shape')} in the file, "
                       f"{META_FILE} records {dtype} {sizes}")
    return bad


def _sha256(fh) -> str:
    h, block = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(block)
    fh.seek(0)
    while n := fh.readinto(block):
        h.update(view[:n])
    return h.hexdigest()


def shard_problems(info: CheckpointMeta, files=None, verify: str = "sha256") -> list[str]:
    """One line per problem of the shard ``files`` of ``info`` (default: all it lists), each naming its file.

    An empty list means they are intact (see the module docstring).
    """
    wanted, bad = _wanted_slices(info), []
    for f in sorted(info.files if files is None else files):
        p, rec = info.path / f, info.files[f]
        if not p.is_file():
            bad.append(f"{f}: missing ({META_FILE} records {rec['bytes']} bytes)")
            continue
        size = p.stat().st_size
        if size != rec["bytes"]:
            bad.append(f"{f}: {size} bytes, {META_FILE} records {rec['bytes']} (truncated or replaced)")
            continue
        with open(p, "rb") as fh:
            mine = _header_problems(fh, size, wanted[f])
            if verify == "sha256" and (got := _sha256(fh)) != rec["sha256"]:
                mine.append(f"sha256 {got}, {META_FILE} records {rec['sha256']} (its bytes changed after the save)")
        more = [f"... and {len(mine) - _MAX_BULLETS} more"] if len(mine) > _MAX_BULLETS else []
        bad += [f"{f}: {b}" for b in mine[:_MAX_BULLETS] + more]
    return bad


def verify_checkpoint(path: "str | Path", verify: str = "sha256") -> CheckpointMeta:
    """Check that the committed checkpoint ``path`` is intact; returns its metadata.

    Args:
      path: a committed directory, e.g. ``ROOT/step-00000100``.
      verify: ``"sha256"`` hashes every shard file (reads it whole); ``"size"``
        checks sizes and headers only.

    Raises:
      CheckpointError: naming each damaged file and what differs (``problems``
        holds one line each); nothing was loaded.
    """
    check_verify_mode(verify, "verify_checkpoint")
    info = read_metadata(path)
    bad = shard_problems(info, verify=verify)
    if bad:
        raise CheckpointError(message(
            f"checkpoint {str(info.path)!r} (step {info.step}) is damaged; nothing was loaded.", bullets=bad,
            rule=f"a checkpoint is used only when its files are as the save wrote them ({META_FILE}'s sizes, "
                 f"safetensors headers" + (", sha256)" if verify == "sha256" else ")"),
            fix=older_intact_fix(info.path, info.step)), problems=bad)
    return info


def older_intact_fix(path: Path, step: int) -> str:
    """The fix of the damaged checkpoint ``path`` (of ``step``): the older intact ones beside it."""
    root = Path(path).parent
    intact = intact_steps([(s, p) for s, p in committed_steps(root) if s < step])
    if not intact:
        return f"no older checkpoint in {str(root)!r} is intact: save this step again"
    return ("use an older intact checkpoint (sizes and headers checked; using it hashes its files): "
            + ", ".join(f"step {s} ({str(p)!r})" for s, p in intact[:5])
            + " (a resume: from its step; eval, generate, export, load_trained: its step folder, ROOT/step-N), "
              "or save this step again")


def flag_spell(key: str, value) -> str:
    """How ``meshdsl train`` writes a setting: as its flag (``--resume-from 6``); md.fit passes its own."""
    flag = "--" + key.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


def _given_path(root, given, spell) -> Path:
    """The checkpoint directory of ``given``: a step of ``root`` (an int or digits), or a path."""
    if isinstance(given, int) or (isinstance(given, str) and given.isdigit()):
        if not root:
            raise CheckpointError(message(
                f"{spell('resume_from', given)}: a step needs {spell('checkpoint', 'DIR')} to look in.",
                rule="a step to resume from is DIR/step-N of the checkpoint folder; a path names any step folder",
                fix=f"add {spell('checkpoint', 'DIR')}, or pass the checkpoint's path"))
        return Path(root) / step_dir_name(int(given))
    path = Path(given)
    if not (path / META_FILE).is_file() and committed_steps(path):
        steps = committed_steps(path)
        raise CheckpointError(message(
            f"{spell('resume_from', given)}: a folder of checkpoints, not one checkpoint.",
            inputs=[f"it holds steps {', '.join(str(s) for s, _ in steps[-5:])}"],
            rule="a resume names one checkpoint: a step of the checkpoint folder, or a step folder",
            fix=f"pass {spell('resume_from', steps[-1][1])}, or {spell('checkpoint', given)} "
                f"{spell('resume', True)} for its latest"))
    return path


def intact_steps(steps: list[tuple[int, Path]]) -> list[tuple[int, Path]]:
    """Those of ``steps`` (``(step, folder)``, oldest first) whose files are intact by sizes and
    headers (no hashing), newest first."""
    return [(s, p) for s, p in reversed(steps) if not _quick_problems(p)]


def _damaged_latest(path: Path, err: CheckpointError, older: list[tuple[int, Path]], spell) -> CheckpointError:
    """The error for a damaged latest checkpoint: what is wrong, and the older ones that are intact."""
    intact = intact_steps(older)
    if intact:
        s, p = intact[0]
        fix = ("older checkpoints intact (sizes and headers checked; a resume hashes its files): "
               + ", ".join(f"step {t} ({str(q)!r})" for t, q in intact[:5])
               + f". Resume from the newest with {spell('resume_from', s)} once the damaged "
                 f"{str(path)!r} is moved aside (the run saves its step again), or with "
                 f"{spell('resume_from', p)} {spell('checkpoint', 'NEW_DIR')}")
    else:
        fix = ("no older checkpoint is intact" + (f" ({len(older)} damaged)" if older else "")
               + f": start afresh, without {spell('resume', True)}, into another checkpoint folder")
    return CheckpointError(message(
        f"{spell('resume', True)}: the latest checkpoint {str(path)!r} is damaged; nothing was loaded.",
        bullets=err.problems or [str(err).splitlines()[0]],
        rule="a resume reads the latest committed checkpoint only if it is intact, never an older one silently",
        fix=fix), problems=err.problems)


def _quick_problems(path: Path) -> list[str]:
    try:
        return shard_problems(read_metadata(path), verify="size")
    except CheckpointError as e:
        return e.problems or [str(e)]


def choose_checkpoint(root, given=None, verify: str = "sha256", spell=flag_spell) -> Path:
    """The checkpoint a resume reads, checked intact (see :func:`verify_checkpoint`).

    Args:
      root: the run's checkpoint folder (``--checkpoint``), or None.
      given: None for the latest committed checkpoint in ``root``; a step (an int,
        or digits) of ``root``; or a checkpoint directory's path (``--resume-from``).
      verify: ``"sha256"`` or ``"size"``.
      spell: ``(setting, value) -> text``, how the caller writes ``resume``, ``resume_from`` and
        ``checkpoint`` in its messages (default: the CLI's flags; md.fit: ``resume_from=6``).

    Raises:
      CheckpointError: nothing to resume from, or the checkpoint is damaged (for
        the latest, the message lists the older intact ones and the flag to use one).
    """
    check_verify_mode(verify, "resume")
    if given is not None:
        path = _given_path(root, given, spell)
        if not path.is_dir() and root and (steps := committed_steps(root)):
            raise CheckpointError(message(
                f"{spell('resume_from', given)}: no checkpoint {str(path)!r}.",
                inputs=[f"steps in {str(root)!r}: {', '.join(str(s) for s, _ in steps[-8:])}"],
                fix=f"pass one of those steps, e.g. {spell('resume_from', steps[-1][0])}"))
        if not path.exists():
            raise CheckpointError(message(
                f"{spell('resume_from', given)}: no such checkpoint directory {str(path)!r}.",
                rule="a resume from a given checkpoint takes its step directory (DIR/step-00000100), "
                     "or a step number of the checkpoint folder DIR",
                fix=f"check the path; {spell('resume', True)} {spell('checkpoint', 'DIR')} resumes from the "
                    f"latest checkpoint in DIR"))
        verify_checkpoint(path, verify)
        return path
    steps = committed_steps(root) if root else []
    newest = step_dirs(root)[-1:] if root else []
    if newest and newest[0][1] != (steps[-1][1] if steps else None):
        # Only a save's rename makes a step folder, after writing checkpoint.json into it.
        gone = f"has no {META_FILE}: it was removed after the save"
        raise _damaged_latest(newest[0][1], CheckpointError(problems=[gone]), steps, spell)
    resume, folder = spell("resume", True), spell("checkpoint", "DIR")
    if not steps:
        raise CheckpointError(message(
            f"{resume}: no committed checkpoint in {str(root)!r}." if root else f"{resume} needs {folder}.",
            rule="a resume continues from the latest checkpoint in the run's checkpoint folder",
            fix=f"drop {resume} to start afresh, or pass the folder a run saved into: {folder}"))
    try:
        verify_checkpoint(steps[-1][1], verify)
    except CheckpointError as e:
        raise _damaged_latest(steps[-1][1], e, steps[:-1], spell) from None
    return steps[-1][1]


def check_saves_free(root, start: int, saves, spell=flag_spell) -> None:
    """Refuse a resumed run whose saves into ``root`` would meet a step folder that exists.

    Args:
      root: the folder the run saves into (None: it saves nothing).
      start: the step resumed from.
      saves: the steps the run will save.
      spell: how the caller writes a setting (see :func:`choose_checkpoint`).
    """
    if not root:
        return
    taken = [s for s in sorted(set(saves)) if s > start and (Path(root) / step_dir_name(s)).exists()]
    if taken:
        raise CheckpointError(message(
            f"resume from step {start}: the run would save step {taken[0]} into {str(root)!r}, where it exists.",
            inputs=[f"step folders in the way: {', '.join(step_dir_name(s) for s in taken[:5])}"],
            rule="a committed checkpoint is never overwritten",
            fix=f"save the continued run into another folder ({spell('checkpoint', 'NEW_DIR')} with "
                f"{spell('resume_from', 'PATH')}), or move the newer step folders aside"))


__all__ = ["SAFETENSORS_DTYPES", "VERIFY_MODES", "check_saves_free", "check_verify_mode", "choose_checkpoint",
           "flag_spell", "intact_steps", "older_intact_fix", "shard_problems", "verify_checkpoint"]
