"""Tests for the string languages: mesh and layout (meshdsl.layout.parse), einsum and
rearrange (meshdsl.core.equations), and the name rule they share with Dim.

Positive cases check the dataclasses and that every span slices back to its name;
bad cases check the key words of each message and where its caret points.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshdsl.core.equations import Group, parse_einsum, parse_rearrange
from meshdsl.core.names import NAME_PATTERN, Name, is_name
from meshdsl.core.shape import Dim
from meshdsl.errors import ParseError, ShapeError
from meshdsl.layout.mesh import Mesh
from meshdsl.layout.parse import parse_layout, parse_mesh


def _text(source, span):
    return source[span.start:span.end]


def _assert_spans(source, names):
    for n in names:
        assert type(n.name) is str  # a plain str, never a lark Token
        assert _text(source, n.span) == n.name


# ---------------------------------------------------------------- mesh

def test_mesh_basic_and_spans():
    s = "data:2; model:4"
    spec = parse_mesh(s)
    assert [(a.name.name, a.size) for a in spec.axes] == [("data", 2), ("model", 4)]
    assert spec.source == s
    _assert_spans(s, [a.name for a in spec.axes])
    assert [_text(s, a.size_span) for a in spec.axes] == ["2", "4"]


@pytest.mark.parametrize("s", [
    "data:2, model:4", "data:2 model:4", "data:2\nmodel:4", "data:2;model:4;",
    "  data : 2 ;\n model:4 , ", "# a comment\ndata:2  # two-way data parallel\nmodel:4",
])
def test_mesh_separators(s):
    assert [(a.name.name, a.size) for a in parse_mesh(s).axes] == [("data", 2), ("model", 4)]


def test_mesh_without_axes_is_asked_for_from_python():
    # A mesh string must name an axis (the empty strings are in BAD below); the
    # mesh with no axes, one device, is spelled Mesh(()) or Mesh.parse({}).
    assert Mesh(()).axes == () and Mesh.parse({}) == Mesh(())
    assert Mesh(()).size == 1 and str(Mesh(())) == "(no axes)"


def test_parse_is_cached():
    assert parse_mesh("data:8") is parse_mesh("data:8")
    assert parse_layout("batch:data") is parse_layout("batch:data")


# ---------------------------------------------------------------- layout

def test_layout_rules_scopes_and_groups():
    s = "batch:data; params.d_model:fsdp, w1.d_ff:(data, model)"
    spec = parse_layout(s)
    assert spec.source == s
    got = [(r.scope and r.scope.name, r.dim.name, tuple(a.name for a in r.axes))
           for r in spec.rules]
    assert got == [(None, "batch", ("data",)), ("params", "d_model", ("fsdp",)),
                   ("w1", "d_ff", ("data", "model"))]
    assert [_text(s, r.span) for r in spec.rules] == [
        "batch:data", "params.d_model:fsdp", "w1.d_ff:(data, model)"]
    for r in spec.rules:
        _assert_spans(s, [r.dim, *r.axes] + ([r.scope] if r.scope else []))


def test_layout_newlines_comments_whitespace():
    s = ("# data parallel over the batch\n"
         "batch : data   # rows\n"
         "\n"
         "  params . d_model:( data ,fsdp, )  \n"
         "d_ff:model;")
    spec = parse_layout(s)
    assert [r.dim.name for r in spec.rules] == ["batch", "d_model", "d_ff"]
    assert [a.name for a in spec.rules[1].axes] == ["data", "fsdp"]
    assert _text(s, spec.rules[1].span) == "params . d_model:( data ,fsdp, )"
    _assert_spans(s, [n for r in spec.rules for n in (r.dim, *r.axes)])


@pytest.mark.parametrize("s", ["", "\n  # only a comment\n", ";,"])
def test_layout_empty(s):
    assert parse_layout(s).rules == ()


# ---------------------------------------------------------------- einsum

def test_einsum_explicit():
    s = "batch d_model, d_model d_ff -> batch d_ff"
    spec = parse_einsum(s)
    assert [[n.name for n in op] for op in spec.inputs] == [
        ["batch", "d_model"], ["d_model", "d_ff"]]
    assert [n.name for n in spec.output] == ["batch", "d_ff"]
    _assert_spans(s, [n for op in spec.inputs for n in op] + list(spec.output))


def test_einsum_implicit_and_scalars():
    assert parse_einsum("batch d, d").output is None
    spec = parse_einsum("batch, batch ->")
    assert spec.output == () and len(spec.inputs) == 2
    assert parse_einsum(" , d -> d").inputs[0] == ()


# ---------------------------------------------------------------- rearrange

def test_rearrange_groups():
    s = "batch seq (heads d_k) -> batch seq heads d_k"
    spec = parse_rearrange(s)
    assert isinstance(spec.left[2], Group) and _text(s, spec.left[2].span) == "(heads d_k)"
    assert [n.name for n in spec.left[2].names] == ["heads", "d_k"]
    assert all(isinstance(item, Name) for item in spec.right)
    _assert_spans(s, [n for n in spec.left if isinstance(n, Name)] + list(spec.left[2].names))
    assert _text(s, spec.right[3].span) == "d_k"


def test_rearrange_empty_group_and_merge():
    spec = parse_rearrange("a () b -> (b a)")
    assert spec.left[1].names == () and [n.name for n in spec.right[0].names] == ["b", "a"]


# ---------------------------------------------------------------- errors

def _caret(msg: str, source: str, pos: int) -> tuple[int, int]:
    """Column and width of the caret under the source line that holds ``pos``."""
    line_text = source[source.rfind("\n", 0, pos) + 1:].split("\n")[0]
    lines = msg.splitlines()
    for shown, under in zip(lines, lines[1:]):
        if shown.endswith(line_text) and under.strip() and set(under.strip()) == {"^"}:
            return under.index("^") - (len(shown) - len(line_text)), under.count("^")
    raise AssertionError(f"no caret line in:\n{msg}")


M, L, E, R = parse_mesh, parse_layout, parse_einsum, parse_rearrange
# (parser, string, message fragments, caret offset in the string, caret width)
BAD = [
    (M, "data 2; model:4", ["Invalid mesh string: expected ':' after axis name 'data'.",
                            "Rule: a mesh is 'axis:size'", "Fix: write 'data:2'."], 5, 1),
    (M, "data:", ["expected an integer after ':', but the string ended."], 5, 1),
    (M, ":2", ["expected a name at the start."], 0, 1),
    (M, "data:-1", ["expected an integer after ':', found '-'."], 5, 1),
    (M, "data:2.5", ["after size 2, found '.'"], 6, 1),
    (M, "data:2model:4", ["expected ';', ',' or whitespace between 'data:2' and 'model'",
                          "Fix: write 'data:2; model:4'."], 6, 5),
    (M, "data:2; data:4", ["axis 'data' is named twice.", "Rule: each mesh axis has a unique name",
                           "'data:8'"], 8, 4),
    (M, "data:2; model:0", ["axis 'model' has size 0.", "positive integers"], 14, 1),
    (M, "", ["Invalid mesh string: the string names no mesh axis.", "Mesh(())",
             "Fix: name at least one axis, e.g. 'data:1'"], 0, 1),
    (M, "   ", ["the string names no mesh axis."], 0, 3),
    (M, ";;;", ["the string names no mesh axis."], 0, 3),
    (M, ";", ["the string names no mesh axis."], 0, 1),
    (M, "# nothing", ["the string names no mesh axis."], 0, 9),
    (M, "# nothing\n", ["the string names no mesh axis."], 0, 9),
    (M, "\n  # nothing\n", ["the string names no mesh axis.", "line 2:   # nothing"], 3, 9),
    (L, "batch", ["expected ':' or '.' after name 'batch', but the string ended."], 5, 1),
    (L, "batch data", ["expected ':' or '.' after name 'batch'.",
                       "Fix: write 'batch:data'."], 6, 4),
    (L, "batch:(data fsdp)", ["expected ')' or ',' after name 'data'."], 12, 4),
    (L, "a.b.:x", ["expected ':' after name 'b'."], 3, 1),   # a.b.c:x is a dotted scope
    (L, "batch:(,)", ["expected a name or ')' after '('."], 7, 1),   # 'batch:()' keeps batch whole
    (L, "batch:(data, fsdp", ["unbalanced parenthesis: '(' is never closed."], 6, 1),
    (L, "batch:(data;\nd_ff:model", ["'(' is never closed"], 6, 1),
    (L, "batch:data)", ["unbalanced parenthesis: ')' has no matching '('."], 10, 1),
    (L, "batch:(a, (b))", ["parentheses cannot nest."], 10, 1),
    (L, "d_ff:(data, model, data)", ["axis 'data' is listed twice for dim 'd_ff'.",
                                     "list each mesh axis once"], 19, 4),
    (L, "batch:data d_ff:model", ["expected ';', ',' or a newline between rules.",
                                  "Fix: write 'batch:data; d_ff:model'."], 11, 1),
    (L, "batch:data\n# c\nd_ff:model x:y", ["between rules"], 26, 1),
    (E, "a b, b c -> a d", ["output dim 'd' appears in no input."], 14, 1),
    (E, "a b, b c -> a bb", ["output dim 'bb' appears in no input.", "Did you mean 'b'?"], 14, 2),
    (E, "x a a, b", ["dim 'a' appears twice in input 1."], 4, 1),
    (E, "a b -> b b", ["dim 'b' appears twice in the output."], 9, 1),
    (E, "a (b)", ["expected a name, ',' or '->' after dim name 'a', found '('."], 2, 1),
    (E, "a -> b -> c", ["expected the end of the string after dim name 'b'."], 7, 2),
    (R, "b ... -> b", ["'...' is on the left side but not on the right.", "add '...' to the right side"], 2, 3),
    (R, "b (h 64) -> b h", ["numbers are not allowed: '64'."], 5, 2),
    (R, "b 2 -> b", ["numbers are not allowed: '2'."], 2, 1),
    (R, "b (h (d)) -> b h d", ["parentheses cannot nest."], 5, 1),
    (R, "b (h d -> b h d", ["unbalanced parenthesis: '(' is never closed."], 2, 1),
    (R, "b h d) -> b h d", ["')' has no matching '('"], 5, 1),
    (R, "b (h d) h -> b h d", ["dim 'h' appears twice on the left side."], 8, 1),
    (R, "b s -> b s s", ["dim 's' appears twice on the right side."], 11, 1),
    (R, "b seq d -> b d", ["dim 'seq' is on the left side but not on the right.",
                           "Fix: add 'seq' to the right side"], 2, 3),
    (R, "b s -> b s sq", ["dim 'sq' is on the right side but not on the left.",
                          "Did you mean 's'?"], 11, 2),
    (R, "b s", ["expected '->' after dim name 's', but the string ended."], 3, 1),
]


@pytest.mark.parametrize("parse,source,fragments,pos,width", BAD,
                         ids=[f"{p.__name__}:{s!r}" for p, s, *_ in BAD])
def test_bad_strings(parse, source, fragments, pos, width):
    with pytest.raises(ParseError) as info:
        parse(source)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, msg
    assert "Rule: " in msg and "Fix: " in msg, msg
    line_start = source.rfind("\n", 0, pos) + 1
    assert _caret(msg, source, pos) == (pos - line_start, width), msg
    # Raised `from None`: no lark exception is chained to what the user sees.
    assert info.value.__suppress_context__ and info.value.__cause__ is None


def test_multiline_caret_names_the_line():
    with pytest.raises(ParseError) as info:
        parse_layout("batch:data\nd_ff model")
    assert "line 2: d_ff model" in str(info.value)


def test_not_a_string():
    with pytest.raises(ParseError, match="expected a str, got int"):
        parse_mesh(4)


# ---------------------------------------------------------------- properties

_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True)
_mesh_sep = st.sampled_from([";", ",", " ", "\n", "; ", " , ", "  # note\n"])
_rule_sep = st.sampled_from([";", ",", "\n", " ;\n", ",  # why\n", "\n\n"])
_space = st.sampled_from(["", " ", "  "])


@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.data())
def test_generated_meshes_round_trip(data):
    # At least one axis: a mesh string without axes is an error (see BAD).
    names = data.draw(st.lists(_names, min_size=1, max_size=5, unique=True))
    sizes = data.draw(st.lists(st.integers(1, 512), min_size=len(names), max_size=len(names)))
    parts = [f"{n}{data.draw(_space)}:{data.draw(_space)}{k}" for n, k in zip(names, sizes)]
    s = "".join(p + data.draw(_mesh_sep) for p in parts)
    spec = parse_mesh(s)
    assert [(a.name.name, a.size) for a in spec.axes] == list(zip(names, sizes))
    _assert_spans(s, [a.name for a in spec.axes])


_rules = st.tuples(st.one_of(st.none(), st.just("params"), _names), _names,
                   st.lists(_names, min_size=1, max_size=3, unique=True), st.booleans())


@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.lists(_rules, max_size=5), st.data())
def test_generated_layouts_round_trip(rules, data):
    texts = []
    for scope, dim, axes, grouped in rules:
        axes_text = f"({', '.join(axes)})" if grouped or len(axes) > 1 else axes[0]
        prefix = f"{scope}." if scope else ""
        texts.append(f"{prefix}{dim}{data.draw(_space)}:{data.draw(_space)}{axes_text}")
    s = "".join(t + data.draw(_rule_sep) for t in texts)
    spec = parse_layout(s)
    got = [(r.scope and r.scope.name, r.dim.name, [a.name for a in r.axes]) for r in spec.rules]
    assert got == [(scope, dim, axes) for scope, dim, axes, _ in rules]
    assert [_text(s, r.span) for r in spec.rules] == texts


# ---------------------------------------------------------------- line breaks

@pytest.mark.parametrize("brk", ["\n", "\r\n", "\r"])
def test_every_line_break_separates(brk):
    mesh = parse_mesh(f"data:2 # two-way{brk}model:4{brk}")
    assert [(a.name.name, a.size) for a in mesh.axes] == [("data", 2), ("model", 4)]
    s = f"batch:data  # rows{brk}d_ff:model{brk}params.d_model:(data, model)"
    spec = parse_layout(s)
    assert [(r.key, r.axis_names) for r in spec.rules] == [
        ((None, "batch"), ("data",)), ((None, "d_ff"), ("model",)),
        (("params", "d_model"), ("data", "model"))]
    _assert_spans(s, [n for r in spec.rules for n in (r.dim, *r.axes)])


@pytest.mark.parametrize("s,line,shown,col", [
    ("batch:data\rd_ff model", 2, "d_ff model", 5),
    ("batch:data\r\nd_ff model", 2, "d_ff model", 5),
    ("a:x\r\nb:y\rc:z\nd z", 4, "d z", 2),
    ("batch:(data\rd_ff:model", 1, "batch:(data", 6),
])
def test_caret_on_the_right_line(s, line, shown, col):
    with pytest.raises(ParseError) as info:
        parse_layout(s)
    lines = str(info.value).splitlines()
    at = next(i for i, t in enumerate(lines) if t.startswith(f"    line {line}: "))
    assert lines[at] == f"    line {line}: {shown}"
    assert "\r" not in str(info.value)
    assert lines[at + 1].index("^") == len(f"    line {line}: ") + col


# ---------------------------------------------------------------- long strings

_RULES = [f"dim{i}:data" for i in range(10_000)]
_LONG = "; ".join(_RULES)  # about 140 KB


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_long_layout_shows_a_window(where):
    bad = "oops model"
    parts = {"start": f"{bad}; {_LONG}", "middle": "; ".join(_RULES[:5_000] + [bad] + _RULES[5_000:]),
             "end": f"{_LONG}; {bad}"}
    s = parts[where]
    with pytest.raises(ParseError) as info:
        parse_layout(s)
    msg = str(info.value)
    assert len(msg) < 1_000, len(msg)
    shown, under = next((a, b) for a, b in zip(msg.splitlines(), msg.splitlines()[1:])
                        if b.strip() and set(b.strip()) == {"^"})
    assert shown.startswith("    ...") == (where != "start")
    assert shown.endswith("...") == (where != "end")
    assert len(shown) <= len("    ") + 100 + 2 * len("...")
    start = under.index("^")
    assert shown[start:start + under.count("^")] == "model"


def test_caret_without_span_clips_the_source():
    from meshdsl.errors import caret
    assert len(caret(_LONG, None)) < 120 and caret(_LONG, None).endswith("...")


# ---------------------------------------------------------------- one name rule

def test_grammars_mirror_the_name_pattern():
    from meshdsl.core.grammar import parser
    for key in ("mesh", "layout", "einsum", "rearrange"):
        assert parser(key).get_terminal("NAME").pattern.value == NAME_PATTERN, key


def _names_in_every_language(t: str) -> list[bool]:
    """Whether each language reads ``t`` as exactly one name, spelled ``t``."""
    def reads(parse, names_of):
        try:
            return names_of(parse()) == [t]
        except ParseError:
            return False
    return [
        reads(lambda: parse_mesh(f"{t}:2"), lambda m: [a.name.name for a in m.axes]),
        reads(lambda: parse_layout(f"{t}:x"), lambda l: [r.dim.name for r in l.rules]),
        reads(lambda: parse_layout(f"x:{t}"), lambda l: [a.name for r in l.rules for a in r.axes]),
        # '...' parses too, as a Rest, not a Name
        reads(lambda: parse_einsum(f"{t} -> {t}"), lambda e: [n.name for n in e.inputs[0] if isinstance(n, Name)]),
        reads(lambda: parse_rearrange(f"{t} -> {t}"), lambda p: [n.name for n in p.left if isinstance(n, Name)]),
    ]


def _dim_accepts(t: str) -> bool:
    try:
        Dim(t, 2)
    except ShapeError:
        return False
    return True


_candidates = st.one_of(
    st.from_regex(NAME_PATTERN, fullmatch=True),
    st.text(alphabet=st.sampled_from(list("aZ_09 äéßΩ١ℌ.-:;,#()\t")), max_size=6))


@settings(derandomize=True, max_examples=200, deadline=None)
@given(_candidates)
def test_dim_and_grammars_accept_the_same_names(t):
    want = is_name(t)
    assert _dim_accepts(t) == want
    assert _names_in_every_language(t) == [want] * 5
