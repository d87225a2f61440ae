"""The ``meshdsl`` console script and ``python -m meshdsl``: start the ranks' forkserver
early, then run the command line.

A command that will start local ranks (``run``, ``train`` or ``check`` on a mesh of
several devices or with ``--nproc N``, ``calibrate``, ``search --measure``) has the
forkserver (:mod:`meshdsl.processes.start`) import torch in its own process while this
one imports torch and validates the job, instead of after: the ranks' start then
costs nothing on top of the command's own start.  This module imports no torch
before that; ``meshdsl`` itself loads its names on first use.
"""
from __future__ import annotations

import re
import sys

_MESH_COMMANDS = ("run", "train", "check")


def _option(argv: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``argv`` (the last one), else None."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _mesh_size(mesh: str) -> int:
    """Devices of a mesh string as written (``"data:2; model:2"`` -> 4); 0 if it does not read."""
    sizes = re.findall(r":\s*(\d+)", mesh)
    if not sizes:
        return 0
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def starts_ranks(argv: list[str]) -> bool:
    """Whether the command ``argv`` will start local ranks (a guess from the words alone; a
    wrong guess costs a forkserver that goes unused, or one started later, never a result)."""
    words = [a for a in argv if not a.startswith("-")]
    if not words:
        return False
    command = words[0]
    if command == "calibrate":
        return True
    if command == "search":
        return "--measure" in argv
    if command not in _MESH_COMMANDS:
        return False
    nproc = _option(argv, "--nproc")
    if nproc is not None:
        return nproc.isdigit() and int(nproc) >= 2
    if command == "check":
        return False  # without --nproc, check runs the simulated mesh in this process
    mesh = _option(argv, "--mesh")
    # train without --mesh picks one from the model's size (tools/train_cli.py auto_mesh):
    # one process for its default model, so no guess of several.
    return mesh is not None and _mesh_size(mesh) >= 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not starts_ranks(argv):
        from .cli import main as cli_main
        return cli_main(argv)
    from ..processes.start import prestart, stop_forkserver
    prestart()
    try:
        from .cli import main as cli_main
        return cli_main(argv)
    finally:
        stop_forkserver()
