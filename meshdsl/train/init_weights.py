"""Starting a run from given weights: full tensors by param name, checked against a graph's params.

Weights are a ``{param name: full (unsharded) tensor}`` dict, or a safetensors file of one
(read with ``safetensors.torch.load_file``; a pickle file is never read).  :func:`check_weights`
refuses, in one message with a bullet each, a name that is no param of the graph, a tensor of
the wrong shape, and one whose dtype is of another kind (an integer for a float); a float of
another precision is cast to the param's dtype, as torch's ``load_state_dict`` copies.  A graph's
params are its trainable ones (``Model.params``) and its frozen ones (``md.param``s left out of
them): both load.  :meth:`meshdsl.train.step.TrainStep.set_params` puts each rank's slice in place.

:func:`export_params` writes a checkpoint's params (frozen ones too) as such a file, so a trained
run is the start of another (``meshdsl export``, then ``meshdsl train --init``).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..core.shape import Dim, Shape
from ..errors import MeshDSLError, did_you_mean, message
from ..layout.sharding import Sharding
from .checkpoint_format import META_FILE, CheckpointError, latest_checkpoint, read_metadata
from .checkpoint_load import load_checkpoint

#: How many bad items one message lists.
_SHOWN = 8


class WeightsError(MeshDSLError):
    """Given weights cannot start this graph's params: a file that is not safetensors, an
    unknown name, a wrong shape or dtype."""


def graph_params(plan) -> dict:
    """The params of ``plan``'s graph by name: trainable and frozen ones, not optimizer state
    (``opt/<param>/<slot>``)."""
    return {s.args["name"]: s.args["tensor"] for s in plan.steps
            if s.kind == "param" and not s.args["name"].startswith("opt/")}


def read_weights(source, where: str) -> dict[str, torch.Tensor]:
    """``source``'s tensors by name: a dict as given, or a safetensors file's (on the CPU).

    Raises:
      WeightsError: no such file, not a safetensors file, or neither a path nor a dict.
    """
    if isinstance(source, dict):
        return source
    if not isinstance(source, (str, Path)):
        raise WeightsError(message(
            f"{where}: the weights are {type(source).__name__}, not a path or a dict.",
            rule="weights are a safetensors file of full tensors by param name, or a dict {name: tensor}",
            fix="pass a path, e.g. 'weights.safetensors', or a dict such as step.full_params(frozen=True)"))
    path = Path(source)
    if path.is_dir():
        raise WeightsError(message(
            f"{where}: {str(path)!r} is a directory, not a safetensors file.",
            rule="the weights are one safetensors file of full tensors by param name",
            fix=f"for a checkpoint, write its params to one file first: `meshdsl export {path} --out FILE`, "
                "then pass FILE (--resume continues a run from its checkpoint instead)"))
    if not path.is_file():
        raise WeightsError(message(
            f"{where}: no such file {str(path)!r}.",
            rule="the weights are one safetensors file of full tensors by param name",
            fix="write one with `meshdsl export CHECKPOINT --out FILE` (a checkpoint's params) or "
                "safetensors.torch.save_file({name: tensor}, FILE)"))
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise WeightsError(message(
            f"{where}: {str(path)!r} is not a safetensors file ({str(e).splitlines()[0] if str(e) else e!r}).",
            rule="weights are read with safetensors.torch.load_file: a torch.save (pickle) file is never "
                 "read, since loading one can run code",
            fix="convert it once where you trust it: safetensors.torch.save_file(torch.load(F), FILE)")) from None


def _dims(t) -> str:
    return "[" + ", ".join(f"{d.name}:{d.size}" for d in t.shape) + "]"


def _problem(name: str, value, t) -> str | None:
    """What is wrong with ``value`` as param ``t``'s full tensor (None: it fits)."""
    if not isinstance(value, torch.Tensor):
        return f"'{name}': a {type(value).__name__}, not a torch.Tensor"
    if tuple(value.shape) != t.shape.sizes:
        return (f"'{name}': shape {tuple(value.shape)}, the param is {_dims(t)} = {t.shape.sizes} "
                f"(full, unsharded, in this dim order)")
    if value.dtype != t.dtype and not (value.dtype.is_floating_point and t.dtype.is_floating_point):
        return f"'{name}': dtype {value.dtype}, the param is {t.dtype} (only floats are cast to another float)"
    return None


def check_weights(params: dict, weights: dict, where: str) -> dict[str, torch.Tensor]:
    """``weights`` checked against ``params`` (name -> graph param Tensor), floats cast to the
    params' dtypes; returns name -> full tensor (on the CPU, a copy: a step may overwrite it).

    Raises:
      WeightsError: naming every bad item: a name that is no param (with the closest one), a
        tensor of another shape (the param's dims named) or of another dtype kind.
    """
    bad = []
    for name, value in weights.items():
        if name not in params:
            why = (" (optimizer state: a new run starts it at zero)" if isinstance(name, str)
                   and name.startswith("opt/") else "")
            bad.append(f"{name!r}: no param of the model has this name{why}.{did_you_mean(str(name), params)}")
        elif (p := _problem(name, value, params[name])) is not None:
            bad.append(p)
    if bad:
        more = [f"... and {len(bad) - _SHOWN} more"] if len(bad) > _SHOWN else []
        raise WeightsError(message(
            f"{where}: {len(bad)} of {len(weights)} given tensor(s) cannot start the model's params.",
            inputs=[f"params: {', '.join(f'{k} {_dims(t)}' for k, t in list(params.items())[:_SHOWN])}"
                    + (f", ... ({len(params)} in all)" if len(params) > _SHOWN else "")],
            bullets=bad[:_SHOWN] + more,
            rule="weights are full (unsharded) tensors named as the model's params, trainable and frozen, each "
                 "of its param's shape; a float is cast to the param's float dtype; a param not given keeps "
                 "meshdsl's seeded init",
            fix="rename or reshape them to the params above, or drop the ones the model does not have"))
    return {k: v.detach().to(device="cpu", dtype=params[k].dtype, copy=True) for k, v in weights.items()}


def export_params(checkpoint, path) -> dict[str, tuple[int, ...]]:
    """Write the params (frozen ones too) of ``checkpoint`` (a committed step folder, or a
    checkpoint folder: its latest) as one safetensors file of full tensors by param name at
    ``path``; returns each param's shape.  Every shard file is checked (sha256) before use.

    Raises:
      CheckpointError: no committed checkpoint there, or a damaged one (nothing is written).
    """
    root = Path(checkpoint)
    step = root if (root / META_FILE).is_file() else latest_checkpoint(root) if root.is_dir() else None
    if step is None:
        raise CheckpointError(message(
            f"export: no committed checkpoint in {str(root)!r}.",
            rule="export reads a step folder (ROOT/step-N, with its checkpoint.json) or a checkpoint folder's "
                 "latest step",
            fix="pass the folder a run saved into with --checkpoint (md.fit: checkpoint=), or one of its steps"))
    info = read_metadata(step)
    want = {}
    for name, saved in info.tensors.items():
        if name.startswith("param/"):
            shape = Shape([Dim(d, n) for d, n in saved.shape])
            want[name] = (shape, saved.dtype, Sharding.replicated(shape))
    full = load_checkpoint(step, want, "data:1", strict=False)   # one rank: every tensor whole
    tensors = {name[len("param/"):]: xs[0].contiguous() for name, xs in full.items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"meshdsl": f"params of {info.model} at step {info.step}"})
    return {k: tuple(v.shape) for k, v in tensors.items()}


__all__ = ["WeightsError", "check_weights", "export_params", "graph_params", "read_weights"]
