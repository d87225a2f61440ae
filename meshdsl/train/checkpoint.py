"""Sharded checkpoints: each rank writes its own slices; any mesh and layout loads them.

Saving (:func:`save_checkpoint`) writes safetensors files, one per rank that
owns a slice (a replicated slice is owned by the lowest rank holding it, so it
is written once), plus ``checkpoint.json`` (format: :mod:`.checkpoint_format`).
A rank whose part is several regions of the full tensor (a block-cyclic dim, an
interleaved pipeline's layer chunks: ``Sharding.regions``) writes one slice per
region, keyed ``name#j``, so the saved slices are always in the global order.
Loading (:func:`load_checkpoint`) reshards: for each wanted local slice it reads
only the overlapping regions of the saved slices, through safetensors' lazy
``get_slice``, so a rank touches only the bytes it needs.  Nothing is unpickled.

The commit protocol, the same for one process holding every rank (the simulated
mesh) and for one process per rank (torch.distributed); ``comm.agree`` is the
only synchronisation, and the process holding rank 0 is the committer:

1. The committer removes leftover ``.tmp-*`` directories and creates
   ``ROOT/.tmp-step-N/``.  Every process checks its own inputs; all agree on success.
2. Every process writes its owned slices into the temporary directory (fsynced)
   and agrees its files' sizes and sha256s.
3. The committer writes ``checkpoint.json``, fsyncs, renames the directory to
   ``ROOT/step-N/`` (the commit), updates ``latest`` and deletes the oldest
   committed checkpoints beyond ``keep``; all agree on success.

A crash before the rename leaves only a ``.tmp-`` directory, which readers
ignore: the previous checkpoint stays the latest.  One save at a time per root.
Every file is created new (``O_EXCL``: never through a link or over a file) inside
the save's own directory, or, for the ``latest`` pointer, as a ``tempfile`` in the root.

Fault injection, for tests only: with ``MESHDSL_CHECKPOINT_KILL_AT=<point>`` set, a
process SIGKILLs itself when its save reaches ``<point>``, one of :data:`KILL_POINTS`
(``:R`` names the rank whose shard it is; ``<point>@N`` only in the save of step N),
so a test can stop the protocol anywhere and check that the previous checkpoint
still loads.  Unset, a point costs one environment lookup.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import tempfile
from pathlib import Path

from safetensors.torch import save as safetensors_bytes

from ..errors import message
from ..layout.mesh import Mesh
from .checkpoint_format import (FORMAT, LATEST_FILE, META_FILE, TMP_PREFIX, VERSION, CheckpointError,
                                committed_steps, content_digest, dtype_name, holders_of, latest_checkpoint,
                                read_metadata, shard_file_name, step_dir_name, tensor_spec)
from .checkpoint_load import load_checkpoint
from .checkpoint_verify import choose_checkpoint, verify_checkpoint

KILL_ENV = "MESHDSL_CHECKPOINT_KILL_AT"
#: The points of the protocol where :data:`KILL_ENV` can stop a save, in order.
KILL_POINTS = (
    "begin",            # nothing done yet
    "prepared",         # the committer made .tmp-step-N (leftovers removed)
    "before-shard:R",   # rank R's shard is about to be written
    "mid-shard:R",      # half of rank R's shard is written
    "after-shard:R",    # rank R's shard is written and fsynced, not yet agreed
    "written",          # checkpoint.json is written and fsynced: the rename is next
    "renamed",          # the rename (the commit) is done: the folder is not yet fsynced, latest not updated
    "latest-written",   # the new latest pointer is written beside the old one, not yet replaced
    "latest-replaced",  # latest names the new checkpoint; old ones beyond keep not yet deleted
    "mid-delete",       # an old checkpoint is renamed .tmp-del-..., not yet removed
)


def _armed(point: str, step: int) -> bool:
    """True when a test asked this process to die at ``point`` of the save of ``step``."""
    return os.environ.get(KILL_ENV) in (point, f"{point}@{step}")


def _reached(point: str, step: int) -> None:
    """Die here if a test asked to (see :data:`KILL_POINTS`)."""
    if _armed(point, step):
        os.kill(os.getpid(), signal.SIGKILL)


def _slices(shape, sharding, mesh: Mesh, holders=None) -> dict[int, tuple]:
    """Owner rank -> the distinct part it owns, as ``(index in the full tensor, index in the
    local one)`` regions (one, or one per block of a block-cyclic dim: ``Sharding.regions``):
    the lowest rank holding each part (of ``holders``, the ranks that hold the tensor at all;
    None: every rank).  A region with no elements (a pipelined stack's empty part on a stage
    outside its run) is not a part."""
    owners: dict[tuple, int] = {}
    parts: dict[int, tuple] = {}
    for r in range(mesh.size) if holders is None else sorted(holders):
        regions = tuple((g, loc) for g, loc in sharding.regions(shape, mesh, r) if all(s.stop > s.start for s in g))
        if not regions:
            continue
        key = tuple((s.start, s.stop) for g, _ in regions for s in g)
        if key not in owners:
            owners[key] = r
            parts[r] = regions
    return parts


def _keys(name: str, regions) -> list[str]:
    """The shard file's key of each region of a tensor's part: its name, or one per block."""
    return [name] if len(regions) == 1 else [f"{name}#{j}" for j in range(len(regions))]


def _owned_tensors(plan: dict, i: int, r: int) -> dict:
    """Shard file key -> the tensor held rank ``r`` (the ``i``-th this process holds) writes:
    each region of each part it owns (see :func:`_slices`), on the CPU."""
    return {key: p[4][i][local].detach().contiguous().to("cpu", copy=True) for n, p in plan.items() if r in p[3]
            for key, (_, local) in zip(_keys(n, p[3][r]), p[3][r])}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes, die_midway: bool = False) -> None:
    """Write ``data`` into the new file ``path`` and fsync it (``die_midway``: SIGKILL after half of it)."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as f:
        if die_midway:
            f.write(data[:len(data) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync(comm, text: str) -> list[str]:
    """Every process's ``text`` (one per process; a process holding all ranks needs no exchange)."""
    return [text] if len(comm.ranks) == comm.mesh.size else sorted(set(comm.agree(text)))


def _check_all(comm, err: Exception | None) -> None:
    """Agree on success; every process raises the first failure any process reported."""
    texts = _sync(comm, "" if err is None else f"ERR {err}")
    bad = [t[4:] for t in texts if t.startswith("ERR ")]
    if err is not None:
        raise err
    if bad:
        raise CheckpointError(bad[0])


def _check_inputs(step, tensors, comm, meta, keep) -> dict:
    """Checked ``{name: (shape, dtype, sharding, owned slices, locals)}``; raises CheckpointError."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(message(f"save_checkpoint: step {step!r} is not an int >= 0.", fix="pass the step"))
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise CheckpointError(message(f"save_checkpoint: keep={keep!r}.", rule="keep is None (all) or an int >= 1",
                                      fix="pass --keep 1 or more"))
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(message(f"save_checkpoint: meta is not JSON ({e}).",
                                      rule="checkpoint metadata is plain JSON: no pickle is ever written or read",
                                      fix="store tensors (RNG, optimizer state) as tensors; the rest as "
                                          "str/int/float/list/dict")) from None
    out, bad = {}, []
    for name, (spec, xs) in tensors.items():
        shape, dtype, sharding = tensor_spec(name, spec)
        dtype_name(dtype)
        if sharding.partial:
            bad.append(f"{name}: partial over {sharding.partial}; reduce it before saving")
        elif len(xs) != len(comm.ranks):
            bad.append(f"{name}: {len(xs)} local tensor(s) for {len(comm.ranks)} held rank(s)")
        else:
            bad += _local_problems(name, shape, dtype, sharding, holders_of(spec), comm, xs)
        owned = _slices(shape, sharding, comm.mesh, holders_of(spec))
        if sum(math.prod(b.stop - b.start for b in g) for regions in owned.values() for g, _ in regions) \
                != math.prod(shape.sizes):
            bad.append(f"{name}: its holders {sorted(holders_of(spec))} hold only part of it")
        out[name] = (shape, dtype, sharding, owned, xs)
    if bad:
        raise CheckpointError(message(f"save_checkpoint(step={step}): local tensors do not match their specs.",
                                      inputs=[f"mesh: {comm.mesh}", f"ranks held: {list(comm.ranks)}"],
                                      bullets=bad, rule="each held rank gives its local slice: shape and dtype "
                                      "as the sharding gives them", fix="pass the executor's per-rank params"))
    return out


def _local_problems(name, shape, dtype, sharding, holders, comm, xs) -> list[str]:
    """What is wrong with the held ranks' local tensors ``xs`` of one tensor: each rank that
    holds it (``holders``; None: every rank) gives its slice, the others ``None``."""
    bad = []
    for r, x in zip(comm.ranks, xs):
        if holders is not None and r not in holders:
            if x is not None:
                bad.append(f"{name} on rank {r}: a tensor where the rank does not hold it (give None)")
            continue
        want = sharding.local_shape(shape, comm.mesh, r)   # an uneven split differs by rank
        if x is None:
            bad.append(f"{name} on rank {r}: None, expected its local slice {want} {dtype}"
                       + ("" if holders is None else f" (held by ranks {sorted(holders)})"))
        elif tuple(x.shape) != want or x.dtype != dtype:
            bad.append(f"{name} on rank {r}: local {tuple(x.shape)} {x.dtype}, expected {want} {dtype}")
    return bad


def save_checkpoint(root: "str | Path", step: int, tensors: dict, comm, *, model: str | None = None,
                    meta: dict | None = None, keep: int | None = None, mesh: str | None = None) -> Path:
    """Save the held ranks' slices of ``tensors`` as ``root/step-N/``, atomically.

    Every process of the job calls it with the same names and specs (see the
    module docstring for the protocol).

    Args:
      root: the checkpoint folder (created if missing).
      step: the training step (the directory name and ``checkpoint.json``'s ``step``).
      tensors: name -> ``(spec, [local tensor per held rank])``; a spec is a Plan
        ``Value`` or ``(Shape, dtype, Sharding)``, or a :class:`HeldSpec` for a tensor only some
        ranks hold (a pipeline stage's params: the others give ``None``).  Optimizer state goes here too.
      comm: the communicator: ``mesh``, ``ranks`` held, and ``agree`` (a SimulatedComm or TorchComm).
      model: an id of the model; :func:`load_checkpoint` refuses another.
      meta: JSON-able: layout string, config, data position, RNG seeds, ...
      keep: how many committed checkpoints to keep (``None``: all).
      mesh: the mesh to record (default ``comm``'s; a run's is the user's, without the micro-batch axis).

    Returns:
      The committed directory.

    Raises:
      CheckpointError: bad inputs, ``step-N`` already exists, or any process failed to write.
    """
    root = Path(root)
    final, committer = root / step_dir_name(step), 0 in comm.ranks
    tmp = root / f"{TMP_PREFIX}{final.name}"
    meta = {} if meta is None else meta
    err, plan = None, None
    _reached("begin", step)
    try:
        plan = _check_inputs(step, tensors, comm, meta, keep)
        if committer:
            root.mkdir(parents=True, exist_ok=True)
            if final.exists():
                raise CheckpointError(message(f"save_checkpoint: {str(final)!r} already exists.",
                                              rule="a committed checkpoint is never overwritten",
                                              fix="delete it first, or save into another folder"))
            for old in root.glob(f"{TMP_PREFIX}*"):     # unfinished saves and deletes, a stale pointer
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)
            tmp.mkdir()     # exclusive, as O_EXCL: fails on anything there, a link included
            _reached("prepared", step)
    except Exception as e:     # every process must reach the agreement below, whatever went wrong
        err = e if not isinstance(e, OSError) else CheckpointError(message(
            f"save_checkpoint: cannot prepare {str(tmp)!r}: {e}.", fix="check the folder's permissions"))
    _check_all(comm, err)

    files, err = {}, None
    try:
        for i, r in enumerate(comm.ranks):
            owned = _owned_tensors(plan, i, r)
            if owned:
                data = safetensors_bytes(owned, metadata={"format": FORMAT, "rank": str(r)})
                _reached(f"before-shard:{r}", step)
                _write_file(tmp / shard_file_name(r), data, die_midway=_armed(f"mid-shard:{r}", step))
                _reached(f"after-shard:{r}", step)
                files[shard_file_name(r)] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    except Exception as e:     # reported to every process below, so none waits for this one
        err = CheckpointError(message(f"save_checkpoint: writing into {str(tmp)!r} failed: {e}.",
                                      fix="check free space and permissions"))
    texts = _sync(comm, json.dumps({"files": files, "error": None if err is None else str(err)}))
    reports = [json.loads(t) for t in texts]
    if err is not None or any(r["error"] for r in reports):
        if committer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise err or CheckpointError(next(r["error"] for r in reports if r["error"]))

    err = None
    if committer:
        try:
            _commit(root, tmp, final, step, plan, comm.mesh if mesh is None else mesh, model, meta, reports, keep)
        except Exception as e:
            err = CheckpointError(message(f"save_checkpoint: committing {str(final)!r} failed: {e}.",
                                          fix="check free space and permissions; committed checkpoints stay loadable"))
    _check_all(comm, err)
    return final


def _commit(root, tmp, final, step, plan, mesh, model, meta, reports, keep) -> None:
    files = {f: v for r in reports for f, v in r["files"].items()}
    doc = {"format": FORMAT, "version": VERSION, "step": step, "mesh": str(mesh), "model": model, "meta": meta,
           "tensors": {}, "files": files}
    for name, (shape, dtype, sharding, owned, _) in plan.items():
        doc["tensors"][name] = {
            "shape": [[d.name, d.size] for d in shape], "dtype": dtype_name(dtype), "sharding": str(sharding),
            "slices": [{"file": shard_file_name(r), "key": key, "offsets": [s.start for s in idx],
                        "sizes": [s.stop - s.start for s in idx]}
                       for r, regions in sorted(owned.items()) for key, (idx, _) in zip(_keys(name, regions), regions)]}
    missing = sorted({s["file"] for t in doc["tensors"].values() for s in t["slices"]} - set(files))
    assert not missing, f"no process reported writing {missing}"
    doc["digest"] = content_digest(doc)
    _write_file(tmp / META_FILE, json.dumps(doc, indent=1).encode("utf-8"))
    _fsync_dir(tmp)
    _reached("written", step)
    os.rename(tmp, final)      # the commit: atomic on one filesystem
    _reached("renamed", step)
    _fsync_dir(root)
    fd, pointer = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{LATEST_FILE}-", dir=root)
    with os.fdopen(fd, "wb") as f:
        # The newest committed step, which is what latest_checkpoint returns too.
        f.write((committed_steps(root)[-1][1].name + "\n").encode())
        f.flush()
        os.fsync(f.fileno())
    os.chmod(pointer, 0o644)   # mkstemp makes it 0600; latest is for people and tools
    _reached("latest-written", step)
    os.replace(pointer, root / LATEST_FILE)
    _fsync_dir(root)
    _reached("latest-replaced", step)
    if keep is not None:
        # The new checkpoint always stays, with the newest keep - 1 others.
        others = [p for _, p in committed_steps(root) if p != final]
        for old in others[:max(0, len(others) - (keep - 1))]:
            # Renamed first, so a crash mid-delete leaves a .tmp- folder, not a broken checkpoint.
            doomed = root / f"{TMP_PREFIX}del-{old.name}"
            os.rename(old, doomed)
            _reached("mid-delete", step)
            shutil.rmtree(doomed, ignore_errors=True)


__all__ = ["CheckpointError", "KILL_ENV", "KILL_POINTS", "choose_checkpoint", "latest_checkpoint", "load_checkpoint",
           "read_metadata", "save_checkpoint", "verify_checkpoint"]
