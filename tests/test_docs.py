"""The README and docs/ show real commands with their real output: this file runs them.

A fenced block is *runnable* when the line before its opening fence is a marker comment:

    <!-- run -->                the block's output must match, line for line
    <!-- run: shape -->         ... with every number a wildcard (timings, machine figures)
    <!-- run: slow -->          only with ``-m slow`` (real processes; too slow for the suite)
    <!-- run: tail=12 -->       the block shows ``...`` and then the last 12 lines (head=N: the first N)
    <!-- run: columns=160 -->   the terminal width the command sees (default 160)
    <!-- run: process -->       run ``python FILE.py`` as a process of its own (a script that
                                starts ranks, which import it again as their main module)

Options combine (``<!-- run: shape slow -->``).  In a runnable block, a line that starts with
``$ `` is a command and the lines after it are what it printed; a line ``...`` stands for any
number of lines.  Whitespace runs count as one space and a run of box-drawing rules as one
rule, so a table whose columns widen still matches in shape.  Commands are ``meshdsl ...``
(or ``python -m meshdsl ...``, both run in this process), ``python FILE.py`` and ``cat FILE``,
optionally after ``NAME=value`` environment settings.

    <!-- file: my_model.py -->  writes the block that follows into the page's working folder

Each page runs in a fresh folder of its own (with ``tests/`` and ``models/`` linked in), in page
order, so a later block sees the files and checkpoints of an earlier one; that folder's path
is printed as ``/tmp/docs``.

``python tests/test_docs.py PAGE.md ...`` reruns every runnable block of the pages and writes
their fresh output into them (``--skip-slow`` leaves the slow ones as they are): outputs are
pasted by this script, never edited by hand.

Besides, every relative link of README.md, ARCHITECTURE.md and docs/ must point at a file
(and heading) that exists, README.md stays within 400 lines and ARCHITECTURE.md within 80, and
a guide command that shows output is either runnable here or a dated measurement in
docs/benchmarks.md.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SHOWN_TMP = "/tmp/docs"
DEFAULT_COLUMNS = 160

MARKER = re.compile(r"^<!--\s*run(?::\s*(?P<opts>[^>]*?))?\s*-->\s*$")
FILE_MARKER = re.compile(r"^<!--\s*file:\s*(?P<name>\S+)\s*-->\s*$")
FENCE = re.compile(r"^(?P<fence>```+)(?P<lang>[\w+-]*)\s*$")


# ----------------------------------------------------------------------------- reading pages


@dataclass
class Block:
    page: Path
    line: int                        # 1-based line of the opening fence
    lang: str
    body: list[str]                  # the lines between the fences
    run_opts: dict | None = None     # the run marker's options; None: not runnable
    file_name: str | None = None     # a file marker's name

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """Every fenced block of a markdown page, with the marker on the line before it."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == m["fence"]), None)
        assert end is not None, f"{page}:{i + 1}: unclosed fence"
        block = Block(page, i + 1, m["lang"], lines[i + 1:end])
        before = lines[i - 1] if i > 0 else ""
        if (r := MARKER.match(before)):
            block.run_opts = parse_opts(r["opts"] or "", f"{page}:{i}")
        elif (f := FILE_MARKER.match(before)):
            block.file_name = f["name"]
        out.append(block)
        i = end + 1
    return out


def parse_opts(text: str, where: str) -> dict:
    opts = {"shape": False, "slow": False, "tail": None, "head": None, "columns": DEFAULT_COLUMNS,
            "process": False}
    for word in text.split():
        key, _, value = word.partition("=")
        assert key in opts, f"{where}: unknown run option {key!r} (known: {sorted(opts)})"
        opts[key] = int(value) if value else True
    return opts


def commands_of(block: Block) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown after it) for every ``$ `` line of a runnable block."""
    out: list[tuple[str, list[str]]] = []
    for ln in block.body:
        if ln.startswith("$ "):
            out.append((ln[2:], []))
        else:
            assert out, f"{block.where}: a runnable block starts with a '$ ' command"
            out[-1][1].append(ln)
    return out


# ----------------------------------------------------------------------------- running commands


def _normal(line: str) -> str:
    line = re.sub(r"[ \t]+", " ", line.rstrip())
    return re.sub(r"([━─═])\1+", r"\1", line)


NUMBER = r"\d+(?:[.,]\d+)*(?:e[+-]?\d+)?"


def _line_pattern(line: str, shape: bool) -> str:
    line = _normal(line)
    if not shape:
        return re.escape(line)
    parts = re.split(f"({NUMBER})", line)
    return "".join(NUMBER if k % 2 else re.escape(p) for k, p in enumerate(parts))


def output_matches(shown: list[str], got: list[str], shape: bool) -> bool:
    """Whether ``got`` is what ``shown`` shows: line for line, ``...`` any number of lines."""
    pattern = "".join(r"(?:[^\n]*\n)*?" if ln.strip() == "..." else _line_pattern(ln, shape) + r"\n"
                      for ln in _trim(shown))
    return re.fullmatch(pattern, "".join(_normal(ln) + "\n" for ln in _trim(got))) is not None


def _trim(lines: list[str]) -> list[str]:
    lines = [ln.rstrip() for ln in lines]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@contextlib.contextmanager
def _environment(env: dict[str, str], cwd: Path):
    saved_env = {k: os.environ.get(k) for k in env}
    saved_cwd, saved_path = os.getcwd(), list(sys.path)
    saved_modules = set(sys.modules)
    os.environ.update(env)
    os.chdir(cwd)
    sys.path.insert(0, str(cwd))
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for name in set(sys.modules) - saved_modules:   # a page's own modules (my_model, ...)
            mod_file = getattr(sys.modules[name], "__file__", None) or ""
            if mod_file.startswith(str(cwd)):
                del sys.modules[name]


def run_command(command: str, cwd: Path, opts: dict) -> list[str]:
    """Runs one documented command (in this process unless ``opts["process"]``); returns what
    it printed (stdout and stderr, in order), with the page's folder shown as /tmp/docs."""
    words = shlex.split(command)
    env = {"COLUMNS": str(opts["columns"])}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    if opts["process"]:
        assert words[:1] == ["python"], f"run: process is for python scripts, not {command!r}"
        done = subprocess.run([sys.executable, *words[1:]], cwd=cwd, env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        return _trim(done.stdout.replace(str(cwd), SHOWN_TMP).splitlines())
    buf = io.StringIO()
    with _environment(env, cwd), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        if words[:1] == ["meshdsl"] or words[:3] == ["python", "-m", "meshdsl"]:
            from meshdsl.tools import cli
            try:
                cli.main(words[1:] if words[0] == "meshdsl" else words[3:])
            except SystemExit:
                pass
        elif words[:1] == ["python"] and len(words) == 2 and words[1].endswith(".py"):
            try:
                runpy.run_path(str(cwd / words[1]), run_name="__main__")
            except Exception:  # printed as python prints it, so that the page's output differs
                traceback.print_exc(file=sys.stdout)
        elif words[:1] == ["cat"] and len(words) == 2:
            print((cwd / words[1]).read_text(), end="")
        else:
            raise AssertionError(f"a runnable block cannot run {command!r}: use meshdsl, "
                                 "python FILE.py or cat FILE")
    text = buf.getvalue().replace(str(cwd), SHOWN_TMP)
    return _trim(text.splitlines())


def cut(lines: list[str], opts: dict) -> list[str]:
    """The part of an output a block shows (tail=N / head=N)."""
    if opts["tail"] and len(lines) > opts["tail"]:
        return ["..."] + lines[-opts["tail"]:]
    if opts["head"] and len(lines) > opts["head"]:
        return lines[:opts["head"]] + ["..."]
    return lines


@dataclass
class PageRun:
    """A page's working folder: its file blocks are written there, its commands run there."""
    page: Path
    folder: Path = field(init=False)

    def __post_init__(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="meshdsl-docs-")
        self.folder = Path(self._tmp.name)
        for name in ("tests", "models"):
            (self.folder / name).symlink_to(ROOT / name)

    def close(self):
        self._tmp.cleanup()

    def write(self, block: Block):
        (self.folder / block.file_name).write_text("\n".join(block.body) + "\n")


def check_page(page: Path, slow: bool) -> list[str]:
    """Runs a page's runnable blocks in order; returns one message per output that differs."""
    problems = []
    run = PageRun(page)
    try:
        for block in blocks_of(page):
            if block.file_name:
                run.write(block)
            if block.run_opts is None or (block.run_opts["slow"] and not slow):
                continue
            for command, shown in commands_of(block):
                got = run_command(command, run.folder, block.run_opts)
                if not output_matches(shown, got, block.run_opts["shape"]):
                    problems.append(f"{block.where}: `{command}` printed\n" + "\n".join(got) +
                                    "\n--- but the page shows ---\n" + "\n".join(shown))
    finally:
        run.close()
    return problems


def update_page(page: Path, skip_slow: bool) -> int:
    """Reruns a page's runnable blocks and writes their fresh output into it; returns how many
    outputs changed."""
    lines = page.read_text().splitlines()
    blocks, new_bodies, changed = blocks_of(page), {}, 0
    run = PageRun(page)
    try:
        for block in blocks:
            if block.file_name:
                run.write(block)
            if block.run_opts is None or (block.run_opts["slow"] and skip_slow):
                continue
            body = []
            for command, shown in commands_of(block):
                got = cut(run_command(command, run.folder, block.run_opts), block.run_opts)
                body += ["$ " + command] + got
                changed += not output_matches(shown, got, block.run_opts["shape"])
            new_bodies[block.line] = body
    finally:
        run.close()
    out, i = [], 0
    for block in blocks:
        out += lines[i:block.line]
        out += new_bodies.get(block.line, block.body)
        i = block.line + len(block.body)
    out += lines[i:]
    page.write_text("\n".join(out) + "\n")
    return changed


# ----------------------------------------------------------------------------- the pages


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted(DOCS.rglob("*.md"))]


def runnable_pages() -> list[Path]:
    return [p for p in pages() if any(b.run_opts for b in blocks_of(p))]


def _page_id(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("page", runnable_pages(), ids=_page_id)
def test_every_runnable_block_prints_what_the_page_shows(page, one_torch_thread):
    problems = check_page(page, slow=False)
    assert not problems, "\n\n".join(problems) + "\n\n(rerun `python tests/test_docs.py PAGE` to paste the new output)"


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in runnable_pages()
                                  if any(b.run_opts and b.run_opts["slow"] for b in blocks_of(p))], ids=_page_id)
def test_every_runnable_block_with_the_slow_ones(page, one_torch_thread):
    problems = check_page(page, slow=True)
    assert not problems, "\n\n".join(problems)


def test_a_command_that_shows_output_is_runnable_or_a_dated_measurement():
    """A ``$ `` line followed by output lines is a claim about what the command prints: it is
    run by this file, or it is a measurement dated in docs/benchmarks.md."""
    unchecked = []
    for page in pages():
        if page == DOCS / "benchmarks.md":
            continue
        previous = None
        for block in blocks_of(page):
            shows = any(ln.startswith("$ ") for ln in block.body) and not all(
                ln.startswith("$ ") or not ln.strip() for ln in block.body)
            output_after_code = previous is not None and previous.lang == "python" and not block.lang \
                and previous.line + len(previous.body) + 2 >= block.line - 1
            if block.run_opts is None and (shows or output_after_code):
                unchecked.append(block.where)
            previous = block
    assert not unchecked, ("these blocks show output that no test checks; mark them <!-- run -->, "
                           f"or move the measurement to docs/benchmarks.md: {unchecked}")


def test_the_shape_matcher_sees_a_changed_line_and_ignores_numbers():
    shown = ["│ step │ ms │", "│    0 │ 9.36 │", "...", "median 9.29 ms"]
    assert output_matches(shown, ["│ step │ ms │", "│ 0 │ 12.5 │", "a", "b", "median 10.01 ms"], shape=True)
    assert not output_matches(shown, ["│ step │ ms │", "│ 0 │ 12.5 │", "medium 10.01 ms"], shape=True)
    assert not output_matches(["count 1"], ["count 2"], shape=False)
    assert output_matches(["┏━━━┓", "count  1"], ["┏━━━━━━┓", "count 1   "], shape=False)


# ----------------------------------------------------------------------------- links and sizes

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip().lstrip("#").strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    inside, out = False, set()
    for ln in page.read_text().splitlines():
        if FENCE.match(ln):
            inside = not inside
        elif not inside and ln.startswith("#"):
            out.add(slug(ln))
    return out


def _links(page: Path):
    inside = False
    for n, ln in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(ln):
            inside = not inside
        elif not inside:
            for target in LINK.findall(re.sub(r"`[^`]*`", "", ln)):
                yield n, target


@pytest.mark.parametrize("page", pages(), ids=_page_id)
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page):
    broken = []
    for n, target in _links(page):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme_or_the_docs_index():
    linked = set()
    for page in pages():
        for _, target in _links(page):
            path = target.partition("#")[0]
            if path and not re.match(r"[a-z]+:", path):
                linked.add((page.parent / path).resolve())
    orphans = [str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md") if p.resolve() not in linked]
    assert not orphans, f"no page links to {orphans}"


def test_every_public_name_is_in_the_api_guide():
    """Each name of ``md.__all__`` appears in docs/guide/api.md, as ``md.NAME`` or `` `NAME` ``."""
    import meshdsl as md
    text = (DOCS / "guide" / "api.md").read_text()
    missing = [n for n in md.__all__
               if not re.search(rf"md\.{re.escape(n)}\b|`{re.escape(n)}[`(]", text)]
    assert not missing, f"docs/guide/api.md does not mention {missing} (add them to 'Every public name')"


def test_the_front_pages_fit():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400, "README.md: at most 400 lines"
    assert len((ROOT / "ARCHITECTURE.md").read_text().splitlines()) <= 80, "ARCHITECTURE.md: at most 80 lines"


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="rerun the runnable blocks of pages and paste their output")
    ap.add_argument("pages", nargs="+", type=Path)
    ap.add_argument("--skip-slow", action="store_true", help="leave the slow blocks as they are")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    for p in args.pages:
        n = update_page(p.resolve(), args.skip_slow)
        print(f"{p}: {n} output(s) changed")
