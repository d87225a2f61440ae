"""The on-disk format of a sharded checkpoint: its metadata file, directory names, and checks.

A checkpoint root holds committed directories ``step-00000012/`` and a ``latest``
pointer (a text file naming the newest one).  A committed directory holds one
safetensors file per writing rank (``rank-00003.safetensors``) and
``checkpoint.json``::

    {"format": "meshdsl-checkpoint", "version": 1, "step": 12, "mesh": "data:2; model:2",
     "model": "transformer:...", "meta": {...},                       # the caller's JSON
     "tensors": {"w": {"shape": [["d_model", 8], ["d_ff", 16]], "dtype": "float32",
                       "sharding": "{d_ff:model}",
                       "slices": [{"file": "rank-00000.safetensors", "key": "w",
                                   "offsets": [0, 0], "sizes": [8, 8]}, ...]}},
     "files": {"rank-00000.safetensors": {"bytes": 1234, "sha256": "..."}},
     "digest": "..."}                  # sha256 of the rest: see content_digest

Each tensor's slices tile it exactly (checked on read), and ``digest`` catches an
edit of the file after the save (a file without one, from before it existed, is read unchecked).  Directories whose name
starts with ``.tmp-`` are unfinished saves: never read, removed by the next save.
Only JSON and safetensors are ever parsed; nothing is unpickled.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MeshDSLError, message

FORMAT = "meshdsl-checkpoint"
VERSION = 1
META_FILE = "checkpoint.json"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
_STEP_PREFIX = "step-"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


class CheckpointError(MeshDSLError):
    """A checkpoint cannot be saved, or cannot be loaded whole into what was asked for.

    ``problems``: one line per damaged item (a file and what differs) when the
    checkpoint on disk is at fault; empty for other errors.
    """

    def __init__(self, text: str = "", problems=()):
        super().__init__(text)
        self.problems = list(problems)


def content_digest(doc: dict) -> str:
    """The sha256 of ``doc`` without its ``digest`` field, as canonical JSON (sorted keys, no spaces).

    JSON's numbers and strings read back to the same values, so a file that was not
    edited hashes to the digest it holds whatever its indentation.
    """
    rest = {k: v for k, v in doc.items() if k != "digest"}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def step_dir_name(step: int) -> str:
    return f"{_STEP_PREFIX}{step:08d}"


def shard_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, for the dtypes a checkpoint can hold."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointError(message(f"save_checkpoint: dtype {dtype} cannot be saved.",
                                      rule=f"checkpoint dtypes are {sorted(_DTYPES)}",
                                      fix="cast the tensor to one of them"))
    return name


@dataclass(frozen=True)
class SavedSlice:
    """One stored block of a tensor: ``file``'s tensor ``key`` holds ``full[offsets : offsets + sizes]``."""

    file: str
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class SavedTensor:
    """A tensor as saved: global ``shape`` as ``((dim, size), ...)``, dtype, the sharding it had, its slices."""

    shape: tuple[tuple[str, int], ...]
    dtype: torch.dtype
    sharding: str
    slices: tuple[SavedSlice, ...]


@dataclass(frozen=True)
class CheckpointMeta:
    """What ``checkpoint.json`` says, checked: see the module docstring for the fields."""

    path: Path
    step: int
    mesh: str
    model: str | None
    meta: dict
    tensors: dict[str, SavedTensor]
    files: dict[str, dict]


def _bad(path: Path, what: str, fix: str = "save the checkpoint again, or load an older one") -> CheckpointError:
    return CheckpointError(message(f"checkpoint {str(path)!r}: {what}",
                                   rule=f"{META_FILE} is the JSON that save_checkpoint wrote", fix=fix),
                           problems=[what if what.startswith(META_FILE) else f"{META_FILE}: {what}"])


def _ints(x, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(x, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in x) or \
            (n is not None and len(x) != n):
        raise TypeError(f"expected a list of {n if n is not None else ''} ints, got {x!r}")
    return tuple(x)


def _tensor(name: str, t: dict, files: dict) -> SavedTensor:
    shape = tuple((str(d), int(s)) for d, s in t["shape"])
    if t["dtype"] not in _DTYPES:
        raise ValueError(f"tensor {name!r}: unknown dtype {t['dtype']!r}")
    sizes = [s for _, s in shape]
    slices = []
    for s in t["slices"]:
        sl = SavedSlice(str(s["file"]), str(s["key"]), _ints(s["offsets"], len(shape)), _ints(s["sizes"], len(shape)))
        if sl.file not in files:
            raise ValueError(f"tensor {name!r}: slice file {sl.file!r} is not listed under 'files'")
        if any(o < 0 or n < 1 or o + n > full for o, n, full in zip(sl.offsets, sl.sizes, sizes)):
            raise ValueError(f"tensor {name!r}: slice {sl.offsets}+{sl.sizes} is outside its shape {sizes}")
        slices.append(sl)
    _check_tiling(name, sizes, slices)
    return SavedTensor(shape, _DTYPES[t["dtype"]], str(t.get("sharding", "")), tuple(slices))


def _check_tiling(name: str, sizes, slices) -> None:
    """The slices are pairwise disjoint and cover the whole tensor, so every element is read once."""
    for i, a in enumerate(slices):
        for b in slices[i + 1:]:
            if all(max(oa, ob) < min(oa + na, ob + nb)
                   for oa, na, ob, nb in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                raise ValueError(f"tensor {name!r}: slices in {a.file} and {b.file} overlap")
    if sum(math.prod(s.sizes) for s in slices) != math.prod(sizes):
        raise ValueError(f"tensor {name!r}: its slices do not cover its shape {list(sizes)}")


@dataclass(frozen=True)
class HeldSpec:
    """The spec of a tensor only some ranks hold (a pipeline stage's params and their optimizer
    state: :attr:`Plan.holders <meshdsl.lowering.plan.Plan.holders>`).

    Saving, the other ranks give ``None`` and the slices are written by the holders; loading,
    the other ranks get ``None``.  The holders' slices must tile the whole tensor.
    """

    shape: object           # Shape
    dtype: torch.dtype
    sharding: object        # Sharding
    holders: tuple[int, ...]


def holders_of(spec) -> frozenset[int] | None:
    """The ranks that hold a tensor of ``spec`` (None: every rank)."""
    held = getattr(spec, "holders", None)
    return None if held is None else frozenset(held)


def tensor_spec(name: str, spec):
    """``(shape, dtype, sharding)`` of a Plan ``Value``-like object (a :class:`HeldSpec` too) or a 3-tuple."""
    if all(hasattr(spec, a) for a in ("shape", "dtype", "sharding")):
        return spec.shape, spec.dtype, spec.sharding
    if isinstance(spec, tuple) and len(spec) == 3:
        return spec
    raise CheckpointError(message(f"checkpoint tensor {name!r}: {type(spec).__name__} is not a tensor spec.",
                                  rule="a spec is (Shape, dtype, Sharding), or has those attributes (a Plan Value)",
                                  fix="pass plan.values[plan.params[name]]"))


def read_metadata(path: "str | Path") -> CheckpointMeta:
    """Read and check ``path/checkpoint.json`` (reads no tensor data).

    Raises:
      CheckpointError: ``path`` is not a committed checkpoint, the file is not
        JSON, or it is not the format or version this code writes.
    """
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        what = "no such directory" if not path.exists() else f"has no {META_FILE} (not a committed checkpoint)"
        raise _bad(path, what + ".", fix="pass a step directory such as ROOT/step-00000100, "
                                         "or latest_checkpoint(ROOT)")
    try:
        doc = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(path, f"{META_FILE} is not valid JSON ({e}).") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise _bad(path, f"{META_FILE} is not a meshdsl checkpoint (format {found!r}).")
    if doc.get("version") != VERSION:
        raise _bad(path, f"format version {doc.get('version')!r}; this meshdsl reads version {VERSION}.",
                   fix="load it with the meshdsl version that saved it")
    if "digest" in doc and doc["digest"] != (got := content_digest(doc)):
        raise _bad(path, f"{META_FILE} was changed after the save: its content hashes to {got}, "
                         f"its digest field records {doc['digest']}.")
    try:
        files = {str(f): {"bytes": int(v["bytes"]), "sha256": str(v["sha256"])} for f, v in doc["files"].items()}
        outside = [f for f in files if Path(f).name != f or f in (".", "..")]
        if outside:
            raise ValueError(f"file {outside[0]!r} is not a name inside the checkpoint's folder")
        tensors = {str(n): _tensor(n, t, files) for n, t in doc["tensors"].items()}
        step = doc["step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step {step!r} is not an int")
        out = CheckpointMeta(path, step, str(doc["mesh"]), doc.get("model"), dict(doc.get("meta") or {}),
                             tensors, files)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _bad(path, f"{META_FILE} is malformed: {e}.") from None
    return out


def step_dirs(root: "str | Path") -> list[tuple[int, Path]]:
    """``(step, dir)`` of every ``step-N`` folder under ``root``, oldest first (committed or damaged)."""
    root = Path(root)
    out = []
    if root.is_dir():
        for p in root.iterdir():
            tail = p.name.removeprefix(_STEP_PREFIX)
            if p.name.startswith(_STEP_PREFIX) and tail.isdigit() and p.is_dir():
                out.append((int(tail), p))
    return sorted(out)


def committed_steps(root: "str | Path") -> list[tuple[int, Path]]:
    """``(step, dir)`` of every committed checkpoint under ``root`` (a step folder with its
    ``checkpoint.json``), oldest first."""
    return [(s, p) for s, p in step_dirs(root) if (p / META_FILE).is_file()]


def latest_checkpoint(root: "str | Path") -> Path | None:
    """The newest committed checkpoint under ``root``, or ``None`` when there is none.

    A directory is committed once its rename from ``.tmp-...`` happened, so an
    interrupted save is never returned.  The ``latest`` pointer file is written
    after the rename for people and tools; this function trusts the directories.
    """
    steps = committed_steps(root)
    return steps[-1][1] if steps else None


__all__ = ["CheckpointError", "CheckpointMeta", "HeldSpec", "SavedSlice", "SavedTensor", "committed_steps", "content_digest",
           "holders_of", "latest_checkpoint", "read_metadata", "step_dirs", "tensor_spec"]
