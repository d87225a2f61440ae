"""The console script's entry (meshdsl/tools/entry.py) and the package's names on first use:
the forkserver starts before torch is imported, for the commands that start ranks."""
import subprocess
import sys
from pathlib import Path

import pytest

import meshdsl as md
from meshdsl.tools.entry import starts_ranks

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, want", [
    (["run", "mlp", "--mesh", "data:2", "--layout", "batch:data"], True),
    (["run", "mlp", "--mesh=data:2; model:2"], True),
    (["run", "mlp", "--mesh", "data:1"], False),
    (["run", "mlp", "--mesh", "data:2", "--nproc", "1"], False),
    (["train", "--nproc", "2"], True),
    (["train"], False),
    (["check", "mlp", "--mesh", "data:2"], False),
    (["check", "mlp", "--mesh", "data:2", "--nproc", "2"], True),
    (["plan", "mlp", "--mesh", "data:4"], False),
    (["calibrate"], True),
    (["search", "mlp", "--nproc", "4"], False),
    (["search", "mlp", "--nproc", "4", "--measure"], True),
    (["--help"], False),
    ([], False),
    (["run", "mlp", "--nproc", "two"], False),
])
def test_which_commands_start_ranks(argv, want):
    assert starts_ranks(argv) is want


def _fresh(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_package_and_the_entry_import_no_torch():
    out = _fresh("import sys, meshdsl, meshdsl.tools.entry, meshdsl.processes.start\n"
                 "print('torch' in sys.modules)")
    assert out == "False"


def test_every_public_name_loads_on_first_use():
    for name in md._EXPORTS:
        assert getattr(md, name) is not None, name
    assert md.einsum is md.ops.einsum and md.load_calibration.__name__ == "load"
    assert {"fit", "einsum", "Mesh", "search_layouts"} <= set(dir(md))
    assert md.core.graph.Tensor is md.Tensor
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        md.not_a_name


def test_from_import_and_operators_work_in_a_fresh_interpreter():
    # Tensors get their operators when the ops load, whichever name is touched first.
    out = _fresh("from meshdsl import Dim, Graph, input\n"
                 "with Graph():\n"
                 "    x = input('x', [Dim('batch', 2), Dim('d', 3)])\n"
                 "    print(type(x + x).__name__)")
    assert out == "Tensor"



def test_star_import_gives_every_public_name():
    out = _fresh("from meshdsl import *\n"
                 "print(einsum.__name__, fit.__name__, Mesh.__name__, search_layouts.__name__)")
    assert out == "einsum fit Mesh search"
