"""processes/malloc.py: meshdsl's processes keep a step's memory instead of faulting it in again."""
from __future__ import annotations

import multiprocessing
import os
import platform
import subprocess
import sys

import pytest

from meshdsl.errors import DistributedError
from meshdsl.processes import launcher as launch
from meshdsl.processes import malloc

GLIBC = platform.libc_ver()[0] == "glibc"

# A child that says whether a fresh 24 MiB buffer (a d_ff activation's size class) comes from
# the heap, below the program break, where a freed block is reused, or from a mapping of its
# own, which glibc hands back to the kernel on free (and the next step faults in again).
_WHERE = """
import ctypes
from meshdsl.processes.malloc import tune_malloc
tuned = tune_malloc()
libc = ctypes.CDLL("libc.so.6")
libc.sbrk.restype = libc.malloc.restype = ctypes.c_void_p
x = libc.malloc(24 << 20)
print(tuned, "heap" if x < libc.sbrk(0) else "mapped")
"""


def _where(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _WHERE], env={**os.environ, malloc.ENV: mode},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_a_tuned_process_serves_a_step_sized_buffer_from_its_heap():
    assert _where("tuned") == ["True", "heap"]
    # The control: glibc as it is maps a first block of this size on its own.
    assert _where("default") == ["False", "mapped"]


def test_tune_malloc_is_idempotent_and_default_leaves_malloc_alone(monkeypatch):
    monkeypatch.setattr(malloc, "_done", None)
    monkeypatch.setenv(malloc.ENV, "default")
    assert malloc.tune_malloc() is False
    monkeypatch.setattr(malloc, "_done", None)
    monkeypatch.delenv(malloc.ENV)
    assert malloc.tune_malloc() is GLIBC
    assert malloc.tune_malloc() is GLIBC


@pytest.mark.parametrize("bad", ["off", "TUNED", "1"])
def test_an_unknown_setting_is_a_clear_error_before_any_rank_starts(bad, monkeypatch):
    monkeypatch.setenv(malloc.ENV, bad)
    monkeypatch.setattr(malloc, "_done", None)
    with pytest.raises(DistributedError) as e:
        malloc.tune_malloc()
    text = str(e.value)
    assert f"MESHDSL_MALLOC={bad!r}" in text and "tuned, default" in text
    assert "Fix: unset MESHDSL_MALLOC" in text
    with pytest.raises(DistributedError, match="MESHDSL_MALLOC"):
        launch.spawn(print, 1)
    assert multiprocessing.active_children() == []


def test_the_cli_names_a_bad_setting_and_exits_2(monkeypatch, capsys):
    from meshdsl.tools import cli
    monkeypatch.setenv(malloc.ENV, "off")
    monkeypatch.setattr(malloc, "_done", None)
    assert cli.main(["plan", "mlp", "--mesh", "data:2", "--layout", "batch:data"]) == 2
    err = capsys.readouterr().err
    assert "meshdsl plan: error: MESHDSL_MALLOC='off'" in err and "Traceback" not in err
