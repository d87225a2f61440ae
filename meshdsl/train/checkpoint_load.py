"""Loading a sharded checkpoint into any mesh and layout, reading only the bytes each rank needs.

For each wanted local slice, the saved slices that overlap it are found by
interval arithmetic over every dim, and only those regions are read, through
safetensors' lazy ``get_slice`` (memory-mapped: untouched bytes are never read).
Every check runs before the first tensor byte is read (:mod:`.checkpoint_verify`:
sizes, safetensors headers, sha256), so a load is whole or an error.  Nothing is
unpickled.
"""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import message
from ..layout.mesh import Mesh
from .checkpoint_format import CheckpointError, dtype_name, holders_of, read_metadata, tensor_spec
from .checkpoint_verify import check_verify_mode, older_intact_fix, shard_problems


def _overlap(region, sl):
    """(index into the saved slice, index into the wanted region), or None when they do not meet."""
    src, dst = [], []
    for want, o, n in zip(region, sl.offsets, sl.sizes):
        lo, hi = max(want.start, o), min(want.stop, o + n)
        if lo >= hi:
            return None
        src.append(slice(lo - o, hi - o))
        dst.append(slice(lo - want.start, hi - want.start))
    return tuple(src), tuple(dst)


def _within(local, dst):
    """Index ``dst`` (into a region of a rank's part) as an index into the rank's local tensor,
    the region being ``local`` there."""
    return tuple(slice(w.start + d.start, w.start + d.stop) for w, d in zip(local, dst))


def _check_wanted(info, want: dict, mesh: Mesh, model, strict: bool) -> list[str]:
    bad = []
    if model is not None and info.model != model:
        bad.append(f"model: saved {info.model!r}, loading {model!r}")
    missing = sorted(set(want) - set(info.tensors))
    extra = sorted(set(info.tensors) - set(want)) if strict else []
    bad += [f"{n}: wanted but not in the checkpoint" for n in missing]
    bad += [f"{n}: in the checkpoint but not wanted (another model?)" for n in extra]
    for name in sorted(set(want) & set(info.tensors)):
        shape, dtype, sharding = tensor_spec(name, want[name])
        saved = info.tensors[name]
        got = tuple((d.name, d.size) for d in shape)
        if got != saved.shape:
            bad.append(f"{name}: saved shape {_fmt(saved.shape)}, wanted {_fmt(got)}")
        if dtype != saved.dtype:
            bad.append(f"{name}: saved dtype {dtype_name(saved.dtype)}, wanted {dtype_name(dtype)}")
        for axis in {a for _, axes in sharding.dims for a in axes}:
            mesh.check_axis(axis, f"load_checkpoint: sharding of {name!r}")
        if sharding.partial:
            bad.append(f"{name}: a partial sharding {sharding} cannot be loaded into")
    return bad


def _fmt(shape) -> str:
    return "[" + ", ".join(f"{d}:{s}" for d, s in shape) + "]"


def load_checkpoint(path: "str | Path", want: dict, mesh, ranks=None, *, model: str | None = None,
                    verify: str = "sha256", strict: bool = True) -> dict[str, list[torch.Tensor]]:
    """Load ``want``'s tensors from the committed checkpoint ``path``, resharded to ``mesh``.

    Everything is checked before any tensor data is read (names, shapes, dtypes,
    model, every shard file present at its written size, their safetensors
    headers), so the result is whole or an error: never a partial load.

    Args:
      path: a committed directory, e.g. ``latest_checkpoint(root)``.
      want: name -> the spec to load into, as for :func:`save_checkpoint` (any mesh or layout);
        a :class:`~.checkpoint_format.HeldSpec`'s non-holding ranks get ``None``.
      mesh: the mesh to load onto (a Mesh or mesh string).
      ranks: the ranks this process holds (default: all of ``mesh``).
      model: when given, the model id the checkpoint must have been saved with.
      verify: ``"sha256"`` (the default: also hash the files this load opens,
        reading them whole) or ``"size"`` (every shard file's size and header only).
      strict: a saved tensor that is not wanted is an error (another model?);
        ``False`` loads a subset, e.g. the params without the optimizer state.

    Returns:
      name -> one local tensor (or ``None``, see ``want``) per held rank.

    Raises:
      CheckpointError: naming the file and what is wrong.
    """
    mesh = Mesh.parse(mesh)
    ranks = tuple(range(mesh.size)) if ranks is None else tuple(ranks)
    check_verify_mode(verify, "load_checkpoint")
    info = read_metadata(path)
    path = info.path
    bad = _check_wanted(info, want, mesh, model, strict)
    if bad:
        raise _load_error(path, info, mesh, bad)
    reads, opened = {}, {}
    for name, spec in want.items():
        shape, _, sharding = tensor_spec(name, spec)
        held = holders_of(spec)
        for r in ranks:
            if held is not None and r not in held:
                continue
            hits = [(sl, src, _within(local, dst)) for region, local in sharding.regions(shape, mesh, r)
                    for sl in info.tensors[name].slices if (ov := _overlap(region, sl)) for src, dst in (ov,)]
            reads[name, r] = (sharding.local_shape(shape, mesh, r), hits)
            opened.update({sl.file: None for sl, _, _ in hits})
    needed = {s.file for n in want for s in info.tensors[n].slices}
    # Every file the wanted tensors live in is checked; the ones this load reads are hashed too.
    bad = shard_problems(info, opened, verify) + shard_problems(info, needed - set(opened), "size")
    if bad:
        raise _load_error(path, info, mesh, bad, damaged=True)
    with ExitStack() as stack:
        handles = {}
        for f in opened:
            try:
                handles[f] = stack.enter_context(safe_open(str(path / f), framework="pt"))
            except (SafetensorError, OSError) as e:
                raise _load_error(path, info, mesh, [f"{f}: not a readable safetensors file ({e})"], True) from None
        out = {}
        for name, spec in want.items():
            dtype = tensor_spec(name, spec)[1]
            out[name] = []
            for r in ranks:
                if (name, r) not in reads:     # a rank that does not hold it (HeldSpec)
                    out[name].append(None)
                    continue
                local_shape, hits = reads[name, r]
                x = torch.empty(local_shape, dtype=dtype)
                for sl, src, dst in hits:
                    x[dst] = handles[sl.file].get_slice(sl.key)[src]
                out[name].append(x)
    return out


def _load_error(path, info, mesh, bad, damaged: bool = False) -> CheckpointError:
    return CheckpointError(problems=bad if damaged else (), text=message(
        f"load_checkpoint({str(path)!r}): the checkpoint cannot be loaded whole; nothing was loaded.",
        inputs=[f"saved: step {info.step}, mesh {info.mesh}, model {info.model!r}", f"loading onto mesh: {mesh}"],
        bullets=bad, rule="a load matches the saved model's names, shapes and dtypes, and every shard file is intact",
        fix=older_intact_fix(path, info.step) if damaged else "load a checkpoint of this model"))


__all__ = ["load_checkpoint"]
