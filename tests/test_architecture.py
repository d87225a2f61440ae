"""The package's shape: imports only go down the rooms, rooms form no cycle, files stay small.

The rooms, bottom to top (see ARCHITECTURE.md)::

    errors -> core -> ops -> ir -> layout -> collectives -> lowering -> exec -> train -> search -> tools

A module may import its own room and the rooms below it, at module level or
inside a function alike.  ``meshdsl/__init__.py`` and ``__main__.py`` sit on top.
"""
from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "meshdsl"
ROOMS = ["errors", "core", "ops", "ir", "layout", "collectives", "lowering", "exec", "train", "search", "tools"]
TOP = {"__init__", "__main__"}
MAX_LINES = 400


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


def _room(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """Every meshdsl module ``module`` imports, anywhere in the file."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "meshdsl"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "meshdsl":
                continue
            # "from pkg import mod" imports a module; "from mod import name" imports mod.
            subs = {f"{target}.{a.name}" for a in node.names} & set(MODULES)
            out |= subs or {target}
    return out


def _edges() -> list[tuple[str, str, str, str]]:
    """(importer module, imported module, importer room, imported room) for every import."""
    return [(m, t, _room(m), _room(t)) for m, p in MODULES.items() for t in _imports(m, p)]


@pytest.mark.parametrize("module", sorted(set(MODULES) - {"meshdsl.__main__"}))  # that one runs the CLI
def test_every_module_imports(module):
    importlib.import_module(module)


def test_every_file_is_in_a_room():
    assert {_room(m) for m in MODULES} <= set(ROOMS) | TOP


def test_imports_only_go_down():
    bad = [f"{m} imports {t} ({a} -> {b})" for m, t, a, b in _edges()
           if a not in TOP and b not in TOP and ROOMS.index(b) > ROOMS.index(a)]
    bad += [f"{m} imports the package root {t}" for m, t, a, b in _edges() if a not in TOP and b == "__init__"]
    assert not bad, "imports going up the rooms:\n" + "\n".join(sorted(bad))


def test_rooms_form_no_cycle():
    graph: dict[str, set[str]] = {}
    for _, _, a, b in _edges():
        if a != b and a not in TOP:
            graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}

    def visit(room, path):
        if state.get(room) == 1:
            raise AssertionError("import cycle between rooms: " + " -> ".join(path + [room]))
        if state.get(room) == 2:
            return
        state[room] = 1
        for nxt in sorted(graph.get(room, ())):
            visit(nxt, path + [room])
        state[room] = 2

    for room in sorted(graph):
        visit(room, [])


def test_files_stay_small():
    long = {str(p.relative_to(ROOT.parent)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The import parser itself: a function-level relative import going up is found."""
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    from ..lowering.generic import lower_generic\n    from .. import exec\n")
    got = _imports("meshdsl.ops.mod", f)
    assert got == {"meshdsl.lowering.generic", "meshdsl.exec"}
