"""The package's shape: imports only go down the rooms, no circle of imports, functions stay short.

The rooms, bottom to top (see ARCHITECTURE.md)::

    errors -> core -> ops -> ir -> layout -> collectives -> lowering -> comm -> runtime -> processes -> train
    -> search -> tools

A module may import its own room and the rooms below it, at module level or
inside a function alike.  ``meshdsl/__init__.py`` and ``__main__.py`` sit on top.

No files import each other in a circle, within a room or across rooms: every import
counts (inside a function too), ``from pkg import mod`` imports ``mod``, and a package's
``__init__.py`` importing its modules is an edge like any other (a module is not taken to
import its own package's ``__init__.py``, which Python runs first whatever the module
names).  A function is at most
:data:`MAX_FUNCTION_LINES` lines long, its ``def`` line to its last (nested functions
inside it count in its length, and are checked on their own too); the few longer ones
are listed in :data:`LONG_FUNCTIONS` with the reason, and leave it once they are split.
"""
from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "meshdsl"
ROOMS = ["errors", "core", "ops", "ir", "layout", "collectives", "lowering", "comm", "runtime", "processes", "train", "search", "tools"]
TOP = {"__init__", "__main__"}
MAX_FUNCTION_LINES = 80

#: Functions over :data:`MAX_FUNCTION_LINES` lines, by "path under meshdsl/:qualified name", and
#: why they may be for now.  An entry that is no longer needed fails the test: the list only shrinks.
LONG_FUNCTIONS: dict[str, str] = {}


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
            # "from pkg import mod" imports the module mod; "from mod import name" imports mod.
            names = {f"{target}.{a.name}" for a in node.names}
            out |= names & set(MODULES)
            if names - set(MODULES):
                out.add(target)
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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> modules it imports): each strongly connected
    component of more than one module, and each module that imports itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _cycle_text(cycle: list[str], graph: dict[str, set[str]]) -> str:
    files = ", ".join(str(MODULES[m].relative_to(ROOT.parent)) if m in MODULES else m for m in cycle)
    edges = [f"    {a} imports {b}" for a in cycle for b in sorted(graph.get(a, set()) & set(cycle))]
    return f"a circle of {len(cycle)} file(s): {files}\n" + "\n".join(edges)


def test_files_form_no_import_cycle():
    graph = {m: _imports(m, p) & set(MODULES) for m, p in MODULES.items()}
    cycles = _cycles(graph)
    assert not cycles, ("files that import each other in a circle (imports inside functions count; move "
                        "what they share to a module both import):\n"
                        + "\n".join(_cycle_text(c, graph) for c in cycles))


def test_the_cycle_finder_finds_circles_and_self_imports_only():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"f"}, "g": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"], ["f"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _function_lengths(path: pathlib.Path) -> dict[str, int]:
    """Lines of every function in ``path``, ``def`` line to last line, by qualified name
    (``Class.method``, ``outer.inner`` for a nested one)."""
    out = {}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + child.name] = child.end_lineno - child.lineno + 1
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    with warnings.catch_warnings():   # an invalid escape in a string (a docstring's ``\ ``) is an error
        warnings.simplefilter("error")
        tree = ast.parse(path.read_text(), str(path))
    walk(tree, "")
    return out


@functools.cache
def _long_functions() -> dict[str, int]:
    return {f"{p.relative_to(ROOT).as_posix()}:{name}": n for p in MODULES.values()
            for name, n in _function_lengths(p).items() if n > MAX_FUNCTION_LINES}


def test_functions_stay_short():
    long = {k: n for k, n in _long_functions().items() if k not in LONG_FUNCTIONS}
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (split them where their passes meet): "
                      + ", ".join(f"{k} ({n} lines)" for k, n in sorted(long.items())))


def test_the_long_function_allow_list_only_shrinks():
    stale = sorted(set(LONG_FUNCTIONS) - set(_long_functions()))
    assert not stale, f"no longer over {MAX_FUNCTION_LINES} lines (or gone): remove from LONG_FUNCTIONS: {stale}"


def test_the_function_measure_counts_nested_and_methods(tmp_path):
    f = tmp_path / "mod.py"
    f.write_text("class C:\n    def m(self):\n        def inner():\n            return 1\n\n"
                 "        return inner\n\n\n@decorated\ndef top(\n    x,\n):\n    return x\n")
    assert _function_lengths(f) == {"C.m": 5, "C.m.inner": 2, "top": 4}


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The import parser itself: a function-level relative import going up is found."""
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    from ..lowering.generic import lower_generic\n    from .. import runtime\n")
    got = _imports("meshdsl.ops.mod", f)
    assert got == {"meshdsl.lowering.generic", "meshdsl.runtime"}


def test_the_checker_sees_a_module_and_a_name_from_one_package(tmp_path):
    """``from pkg import mod, name`` imports both the module and the package's ``__init__``."""
    f = tmp_path / "mod.py"
    f.write_text("from . import registry, OPS\nfrom .registry import apply\n")
    assert _imports("meshdsl.ops.mod", f) == {"meshdsl.ops.registry", "meshdsl.ops"}
