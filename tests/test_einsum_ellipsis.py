"""``...`` in md.einsum and md.rearrange (meshdsl/core/equations.py parses it, meshdsl/ops/einsum.py
and meshdsl/ops/shape_ops.py resolve it): it stands for the dims of a tensor its term does not name.

The oracle is the same program with the equations spelled out: ``...`` resolves to names before
the op is built, so the dense results agree bit for bit, and a layout that splits a dim ``...``
stands for matches the dense spelled-out program as any layout matches the dense program.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.errors import ParseError, ShapeError

B, S, D, F, G = md.Dim("batch", 4), md.Dim("seq", 6), md.Dim("d_model", 4), md.Dim("d_ff", 8), md.Dim("gate", 4)

# (with '...', spelled out): a batch-agnostic MLP, a '...' an operand shares only in part
# (g has no seq: broadcast by name), an implicit output, and rearrange splitting and merging.
EQUATIONS = {
    "up": ("... d_model, d_model d_ff -> ... d_ff", "batch seq d_model, d_model d_ff -> batch seq d_ff"),
    "down": ("... d_ff, d_ff d_model", "batch seq d_ff, d_ff d_model"),
    "vec": ("... d_model, d_model -> d_model", "d_model, d_model -> d_model"),
    "mix": ("... d_model, ... d_model -> ...", "batch seq d_model, batch d_model -> batch seq"),
    "split": ("... (heads d_k) -> ... heads d_k", "batch seq (heads d_k) -> batch seq heads d_k"),
    "merge": ("batch ... d_k -> batch (... d_k)", "batch seq heads d_k -> batch (seq heads d_k)"),
}


def _program(spelled: bool):
    eq = {k: v[spelled] for k, v in EQUATIONS.items()}
    with md.Graph():
        x = md.input("x", [B, S, D])
        g = md.input("g", [B, D])
        w1 = md.param("w1", [D, F], fan_out=[F])
        w2 = md.param("w2", [F, D], fan_out=[D])
        v = md.param("v", [D])
        h = md.gelu(md.einsum(eq["up"], x, w1))
        y = md.einsum(eq["down"], h, w2)                   # [batch, seq, d_model] (implicit output)
        y = y + md.einsum(eq["vec"], v, v)                 # '...' of a 1-d tensor stands for nothing
        m = md.einsum(eq["mix"], y, g)                     # [batch, seq]
        r = md.rearrange(md.rearrange(y, eq["split"], heads=2), eq["merge"])   # [batch, seq_heads_d_k]
        loss = md.reduce_mean(m ** 2) + md.reduce_mean(md.tanh(r))
        grads = md.grad(loss, {"w1": w1, "w2": w2, "v": v})
    assert m.shape.names == ("batch", "seq") and r.shape.names == ("batch", "seq_heads_d_k")
    return {"loss": loss, "y": y, **{f"grad/{k}": t for k, t in grads.items()}}


def _data():
    gen = torch.Generator().manual_seed(0)
    feeds = {"x": torch.randn(4, 6, 4, generator=gen), "g": torch.randn(4, 4, generator=gen)}
    params = {"w1": torch.randn(4, 8, generator=gen), "w2": torch.randn(8, 4, generator=gen) / 3,
              "v": torch.randn(4, generator=gen)}
    return feeds, params


def test_ellipsis_is_the_spelled_out_program_forward_and_gradients():
    feeds, params = _data()
    got = md.run_dense(_program(spelled=False), feeds, params=params)
    want = md.run_dense(_program(spelled=True), feeds, params=params)
    assert list(got) == list(want)
    for k in want:
        # '...' resolves to the same names before the op is built: the same kernels, bit for bit
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def test_a_batch_agnostic_layer_takes_any_leading_dims():
    with md.Graph():
        w = md.param("w", [D, F])
        for k, dims in enumerate(([D], [B, D], [B, S, D], [S, B, D])):
            y = md.einsum("... d_model, d_model d_ff -> ... d_ff", md.input(f"x{k}", dims), w)
            assert y.shape.names == (*[d.name for d in dims[:-1]], "d_ff")


@pytest.mark.parametrize("layout", ["batch:data; seq:model", "batch:model; seq:data; d_ff:model"])
def test_a_split_dim_under_the_ellipsis_matches_the_dense_spelled_out_program(layout):
    feeds, params = _data()
    want = md.run_dense(_program(spelled=True), feeds, params=params)
    plan = md.compile(_program(spelled=False), "data:2; model:2", layout)
    got = md.run_simulated(plan, feeds, params=params)
    for k in want:
        # fp32 sums over split dims added in another order: a few ulps of the largest terms
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


# ---------------------------------------------------------------- errors, with a caret

def _caret_at(msg: str, source: str) -> tuple[int, int]:
    """Column and width of the caret under the shown ``source`` line."""
    lines = msg.splitlines()
    for shown, under in zip(lines, lines[1:]):
        if shown.endswith(source) and under.strip() and set(under.strip()) == {"^"}:
            return under.index("^") - (len(shown) - len(source)), under.count("^")
    raise AssertionError(f"no caret line in:\n{msg}")


def _x_w():
    return md.input("x", [B, S, D]), md.param("w", [D, F])


@pytest.mark.parametrize("equation,error,fragments,at", [
    ("... seq ..., d_model d_ff -> ... d_ff", ParseError,
     ["'...' appears twice in input 1.", "a term holds it once at most", "keep one '...'"], (8, 3)),
    ("batch seq d_model, d_model d_ff -> ... d_ff", ParseError,
     ["'...' is in the output but in no input.", "add '...' to the input(s)"], (35, 3)),
    ("... d_model, d_model d_ff -> ... ...", ParseError, ["'...' appears twice in the output."], (33, 3)),
    ("... d_model, d_model d_ff -> batch ... d_ff", ShapeError,
     ["output dim 'batch' is named in the output and is also one of the dims its '...' stands for "
      "['batch', 'seq']", "the output lists each dim once", "name 'batch' in the term of operand(s) [0]"],
     (29, 5)),
    ("... d_model, d_model d_ff -> batc d_ff", ShapeError,
     ["output dim 'batc' is in no operand. Did you mean 'batch'?", "operand 0: ['batch', 'seq', 'd_model']"],
     (29, 4)),
    ("... d_model, d_model d_ff heads -> ... d_ff", ShapeError,
     ["operand 1 names 'heads', which tensor 1", "write operand 1 as 'd_model d_ff'"], (26, 5)),
])
def test_einsum_ellipsis_errors(equation, error, fragments, at):
    with md.Graph():
        x, w = _x_w()
        with pytest.raises(error) as info:
            md.einsum(equation, x, w)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, msg
    assert "Rule: " in msg and "Fix: " in msg, msg
    assert _caret_at(msg, equation) == at, msg


def test_a_dim_under_two_ellipses_has_one_size_and_the_caret_is_under_the_ellipsis():
    with md.Graph():
        x, y = md.input("x", [B, S, D]), md.input("y", [md.Dim("seq", 5), D])
        with pytest.raises(ShapeError) as info:
            md.einsum("... d_model, ... d_model -> ...", x, y)
    msg = str(info.value)
    assert "dim 'seq' has size 6 in one operand and 5 in operand 1." in msg, msg
    assert _caret_at(msg, "... d_model, ... d_model -> ...") == (13, 3), msg


@pytest.mark.parametrize("pattern,fragments,at", [
    ("batch ... -> batch", ["'...' is on the left side but not on the right.", "add '...' to the right side"],
     (6, 3)),
    ("batch seq d_model -> batch ...", ["'...' is on the right side but not on the left."], (27, 3)),
    ("... seq ... -> seq ...", ["'...' appears twice on the left side."], (8, 3)),
    ("(... d_model) -> ... d_model", ["'...' is inside a group on the left side.", "write '...' outside it"],
     (1, 3)),
])
def test_rearrange_ellipsis_errors(pattern, fragments, at):
    with md.Graph():
        x, _ = _x_w()
        with pytest.raises(ParseError) as info:
            md.rearrange(x, pattern)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, msg
    assert "Rule: " in msg and "Fix: " in msg, msg
    assert _caret_at(msg, pattern) == at, msg


def test_rearrange_ellipsis_takes_the_unnamed_dims_around_its_groups():
    # groups before '...' split the first unnamed dims, groups after it the last (einops'
    # positions, counted among the dims no plain name names)
    with md.Graph():
        x = md.input("x", [B, S, D])
        y = md.rearrange(x, "(b2 b1) ... seq -> seq ... b1 b2", b1=2)
        z = md.rearrange(x, "... (h d) -> d ... h", h=2)
        assert y.shape.names == ("seq", "d_model", "b1", "b2") and y.shape.sizes == (6, 4, 2, 2)
        assert z.shape.names == ("d", "batch", "seq", "h") and z.shape.sizes == (2, 4, 6, 2)
        got = md.run_dense({"y": y, "z": z}, {"x": torch.arange(96.0).reshape(4, 6, 4)})
    x_t = torch.arange(96.0).reshape(4, 6, 4)
    torch.testing.assert_close(got["y"], x_t.reshape(2, 2, 6, 4).permute(2, 3, 1, 0), rtol=0, atol=0)
    torch.testing.assert_close(got["z"], x_t.reshape(4, 6, 2, 2).permute(3, 0, 1, 2), rtol=0, atol=0)
