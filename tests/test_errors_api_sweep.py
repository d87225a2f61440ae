"""An adversarial sweep of the Python model-building API: the mistakes a user writing a model
from docs/guide/api.md makes, each one clear house error (what, ``Rule:``, ``Fix:``), never
Python's TypeError from a call, an internal traceback or a silent wrong answer.

tests/test_errors.py and tests/test_errors_user.py hold the earlier mistakes; these are the
ones a sweep of every op's arguments found (and neighbours of them, kept as guards), and the
Python operators a torch user expects (``abs(x)``, ``round(x)``, ``~mask``, ``a & b``, ``2 ** x``).
"""
from __future__ import annotations

import math

import pytest
import torch

import meshdsl as md
from meshdsl.errors import GraphError, LayoutError, ParseError, ShapeError

B, S, D, F = md.Dim("batch", 8), md.Dim("seq", 6), md.Dim("d_model", 4), md.Dim("d_ff", 8)
H, E, K, V = md.Dim("heads", 2), md.Dim("d_head", 4), md.Dim("key_seq", 6), md.Dim("vocab", 10)
EQ = "batch d_model, d_model d_ff -> batch d_ff"


def g(fn):
    """``fn(x, w, ids)`` in a fresh graph: x [batch, d_model], w [d_model, d_ff], ids [batch] int64."""
    with md.Graph():
        return fn(md.input("x", [B, D]), md.param("w", [D, F]), md.input("ids", [B], torch.int64))


def att(**kw):
    with md.Graph():
        q = md.input("q", [B, S, H, E])
        k, v = md.input("k", [B, K, H, E]), md.input("v", [B, K, H, E])
        return md.attention(q, k, v, **kw)


def mlp():
    with md.Graph():
        x, w = md.input("x", [B, D]), md.param("w", [D, F])
        return md.reduce_mean(md.einsum(EQ, x, w) ** 2)


def _assign(x):
    x[0] = 1.0


# (id, thunk, exception class, key texts: what was wrong and the fix)
CASES = [
    # ------------------------------------------------------------ an op called with the wrong argument list
    ("softmax_without_dim", lambda: g(lambda x, w, i: md.softmax(x)), GraphError,
     ["md.softmax was called with arguments that do not fit it", "missing a required argument: 'dim'",
      "md.softmax(x: 'Tensor', dim)", "call it as md.softmax(x, dim) with a dim name"]),
    ("argmax_without_dim", lambda: g(lambda x, w, i: md.argmax(x)), GraphError,
     ["md.argmax was called", "'dim'", "call it as md.argmax(x, dim)"]),
    ("attention_mask_of_floats", lambda: g(lambda x, w, i: att(mask=x)), ShapeError,
     ["mask is torch.float32, not torch.bool", "is not one of q's batch dims", "md.cast(m, torch.bool)"]),
    ("mish_takes_no_parameter", lambda: g(lambda x, w, i: md.mish(x, 1.0)), GraphError,
     ["md.mish was called", "too many positional arguments", "call it as md.mish(x)"]),
    ("round_with_decimals", lambda: g(lambda x, w, i: md.round(x, decimals=2)), GraphError,
     ["md.round was called", "'decimals'", "call it as md.round(x)"]),
    ("ceil_of_two", lambda: g(lambda x, w, i: md.ceil(x, x)), GraphError, ["md.ceil was called", "md.ceil(x)"]),
    ("clamp_keyword_typo", lambda: g(lambda x, w, i: md.clamp(x, minimum=0.0)), GraphError,
     ["unexpected keyword argument 'minimum'", "Did you mean 'min'?"]),
    # ------------------------------------------------------------ md.<a submodule> is no op
    ("md_embed_is_no_op", lambda: md.embed, AttributeError, ["meshdsl has no op or name 'embed'"]),
    ("md_scan_is_no_op", lambda: md.scan, AttributeError, ["meshdsl has no op or name 'scan'"]),
    ("md_reduce_is_no_op", lambda: md.reduce, AttributeError, ["no op or name 'reduce'", "Did you mean 'reduce_sum'?"]),
    # ------------------------------------------------------------ dims by position, shapes as strings
    ("reduce_over_a_position", lambda: g(lambda x, w, i: md.reduce_sum(x, 0)), ShapeError,
     ["reduce_sum: dims=0", "dims are named, not numbered", "reduce_sum(x, 'd_model')"]),
    ("softmax_over_minus_one", lambda: g(lambda x, w, i: md.softmax(x, -1)), ShapeError,
     ["softmax: dims=-1", "named, not numbered", "softmax(x, 'd_model')"]),
    ("reduce_over_a_dim_of_another_size", lambda: g(lambda x, w, i: md.reduce_sum(x, md.Dim("batch", 3))),
     ShapeError, ["batch:3 is not a dim of", "has size 8", "x.shape['batch']"]),
    ("concat_along_a_position", lambda: g(lambda x, w, i: md.concat([x, x], 0)), ShapeError,
     ["dim 0 (int) is no dim of shape", "named, not numbered", "['batch', 'd_model']"]),
    ("top_k_k_a_string", lambda: g(lambda x, w, i: md.top_k(x, "d_model", "2")), ShapeError,
     ["top_k: k='2' (str) is not an int", "pick k in 1..4"]),
    ("cross_entropy_integer_logits", lambda: g(lambda x, w, i: md.cross_entropy(
        md.cast(md.einsum(EQ, x, w), torch.int64), i, "d_ff")), ShapeError,
     ["cross_entropy: logits", "int64, not floating point", "md.cast(logits, torch.float32)"]),
    ("argmax_over_a_position", lambda: g(lambda x, w, i: md.argmax(x, -1)), ShapeError,
     ["argmax: dim=-1 is not one dim", "argmax(x, 'd_model')"]),
    ("reshape_to_a_string", lambda: g(lambda x, w, i: md.reshape(x, "batch d_model")), ShapeError,
     ["shape 'batch d_model' is a str, not a list of Dims", "md.Dim('batch', 8)"]),
    ("rename_given_a_string", lambda: g(lambda x, w, i: md.rename(x, "batch")), ShapeError,
     ["rename: the mapping", "is 'batch' (str), not a dict", "md.rename(x, {'batch': 'new_name'})"]),
    ("rearrange_size_a_string", lambda: g(lambda x, w, i: md.rearrange(
        x, "batch (heads d_k) -> batch heads d_k", heads="2")), ShapeError,
     ["rearrange: the size(s) {'heads': '2'}", "not positive ints", "heads=2"]),
    ("einsum_numpy_letters", lambda: g(lambda x, w, i: md.einsum("ij,jk->ik", x, w)), ParseError,
     ["'ik' is one dim, not i and k", "'batch d_model, d_model d_ff -> batch d_ff'"]),
    ("einsum_two_arrows", lambda: g(lambda x, w, i: md.einsum("batch d_model -> d_model -> batch", x)), ParseError,
     ["expected the end of the string"]),
    ("einsum_ellipsis_only_in_the_output", lambda: g(lambda x, w, i: md.einsum(
        "batch d_model, d_model d_ff -> ... d_ff", x, w)), ParseError,
     ["'...' is in the output but in no input", "add '...' to the input(s)"]),
    # ------------------------------------------------------------ offsets, rates and options of the wrong kind
    ("slice_at_a_float", lambda: g(lambda x, w, i: md.slice_(x, "batch", 0.5, 2)), ShapeError,
     ["slice_: start=0.5 (float) along dim 'batch'", "is not an int", "start=0"]),
    ("pad_by_a_float", lambda: g(lambda x, w, i: md.pad(x, "batch", 1.5, 1)), ShapeError,
     ["pad: before=1.5 (float)", "before=1"]),
    ("roll_by_a_float", lambda: g(lambda x, w, i: md.roll(x, "batch", 1.5)), ShapeError, ["roll: offset=1.5"]),
    ("shift_by_a_string", lambda: g(lambda x, w, i: md.shift(x, "batch", "1")), ShapeError,
     ["shift: offset='1' (str)", "offset=1"]),
    ("dropout_rate_a_string", lambda: g(lambda x, w, i: md.dropout(x, "0.1")), ShapeError,
     ["dropout: rate '0.1' (str) is not a number", "rate such as 0.1"]),
    ("dropout_seed_a_string", lambda: g(lambda x, w, i: md.dropout(x, 0.1, seed="a")), ShapeError,
     ["dropout: seed 'a' (str) is not an int", "seed=0"]),
    ("one_hot_dtype_a_string", lambda: g(lambda x, w, i: md.one_hot(i, V, dtype="float32")), ShapeError,
     ["one_hot: dtype='float32'", "is not a torch.dtype", "dtype=torch.float32"]),
    ("one_hot_dim_a_name", lambda: g(lambda x, w, i: md.one_hot(i, "vocab")), ShapeError,
     ["one_hot: dim='vocab' (str)", "is not a Dim", "md.Dim('vocab', 100)"]),
    ("attention_scale_a_string", lambda: g(lambda x, w, i: att(scale="0.5")), ShapeError,
     ["attention: scale='0.5' (str)", "scale=0.125"]),
    ("attention_causal_a_string", lambda: g(lambda x, w, i: att(causal="no")), ShapeError,
     ["attention: causal='no' (str)", "causal=False"]),
    ("softplus_beta_zero", lambda: g(lambda x, w, i: md.softplus(x, beta=0)), ShapeError,
     ["softplus: beta=0 divides by zero", "beta=1.0"]),
    ("param_fan_out_a_string", lambda: g(lambda x, w, i: md.param("p", [D, F], fan_out="d_ff")), GraphError,
     ["param('p'): fan_out='d_ff' is a str, not a list", "fan_out=['d_ff']"]),
    ("param_fan_out_names_no_dim", lambda: g(lambda x, w, i: md.param("p", [D], fan_out=["d_ff"])), GraphError,
     ["fan_out=['d_ff'] names ['d_ff'], not dims of the param ['d_model']", "fan_out=['d_model']"]),
    ("placeholder_dtype_a_string", lambda: g(lambda x, w, i: md.placeholder("p", [D], dtype="int")), GraphError,
     ["placeholder('p'): dtype 'int' (str) is not a torch.dtype", "torch.float32"]),
    ("check_tol_a_string", lambda: md.check(mlp(), "data:2", "batch:data", {"x": torch.zeros(8, 4)}, tol="1e-3"),
     GraphError, ["check: tol='1e-3' (str) is not a positive number", "tol=1e-4"]),
    ("compile_keyword_typo", lambda: md.compile(mlp(), "data:2", "batch:data", micro_batches=2), GraphError,
     ["md.compile was called", "'micro_batches'", "Did you mean 'microbatches'?", "call it as md.compile(outputs"]),
    ("compile_schedule_typo", lambda: md.compile(mlp(), "stage:2", "", microbatches=2, schedule="1fb1"),
     md.MeshDSLError, ["schedule '1fb1': unknown schedule", "Did you mean '1f1b'?"]),
    # ------------------------------------------------------------ Python operators with no meaning here
    ("round_to_digits", lambda: g(lambda x, w, i: round(x, 2)), GraphError,
     ["has no round(x, 2)", "md.round(x * 10 ** 2) / 10 ** 2"]),
    ("invert_a_float_tensor", lambda: g(lambda x, w, i: ~x), GraphError,
     ["has no '~'", "boolean masks only", "md.not_equal(x, 0)"]),
    ("and_with_a_number", lambda: g(lambda x, w, i: (x > 0) & 1), GraphError, ["has no '&' with 1", "md.logical_and"]),
    ("negative_base_power", lambda: g(lambda x, w, i: (-2) ** x), GraphError,
     ["is the exponent of -2 (int)", "md.exp(x * math.log(b))"]),
    ("assign_into_a_tensor", lambda: g(lambda x, w, i: _assign(x)), GraphError,
     ["cannot be assigned to ([0] = ...)", "md.where(mask, value, x)"]),
    ("equals_is_identity", lambda: g(lambda x, w, i: md.where(x == 0, x, 0.0)), ShapeError,
     ["where: argument 'cond' is the Python bool False", "md.equal(x, y)"]),
    # ------------------------------------------------------------ compile / check: layouts the model does not fit
    ("layout_names_a_dim_the_model_lacks", lambda: md.compile(mlp(), "data:2", "seq:data"), LayoutError,
     ["names dim 'seq', which no tensor of the model has"]),
    ("check_microbatches_do_not_divide", lambda: md.check(mlp(), "data:2", "batch:data", {"x": torch.zeros(8, 4)},
                                                          microbatches=3), md.MeshDSLError,
     ["batch 8 is not divisible by 3 micro-batches x 2"]),
]


@pytest.mark.parametrize("thunk, cls, texts", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_mistake(thunk, cls, texts):
    with pytest.raises(cls) as info:
        thunk()
    e = info.value
    msg = str(e)
    assert "Rule:" in msg and "Fix:" in msg, msg
    for t in texts:
        assert t in msg, f"{t!r} not in:\n{msg}"
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), repr(e.__context__)
    assert isinstance(e, md.MeshDSLError) or isinstance(e, AttributeError)


def test_logical_not_of_numbers_is_a_mask():
    """md.logical_not of a float tensor is torch's: a bool mask, declared bool (it declared float32)."""
    with md.Graph():
        x = md.input("x", [B, D])
        y = md.logical_not(x)
    assert y.dtype == torch.bool
    xv = torch.tensor([[0.0, 1.0, -2.0, 0.0]] * 8)
    assert torch.equal(md.run_dense({"y": y}, {"x": xv})["y"], torch.logical_not(xv))


def test_python_operators_compute_as_torch():
    """``abs``, ``round``, ``+x``, ``~``, ``&``, ``|`` and ``b ** x`` on Tensors are torch's
    (round halves to even, as torch.round), and ``2 ** x`` has the gradient ln 2 * 2 ** x."""
    with md.Graph():
        x = md.input("x", [B, D])
        outs = {"abs": abs(x), "round": round(x), "pos": +x, "pow2": 2 ** x,
                "not": md.cast(~(x > 0), torch.float32),
                "and": md.cast((x > 0) & (x < 1), torch.float32), "or": md.cast((x > 1) | (x < -1), torch.float32)}
        grad = md.grad(md.reduce_sum(outs["pow2"]), {"x": x})["x"]
    xv = torch.tensor([[-2.5, -1.5, -0.5, 0.5], [1.5, 2.5, 0.25, -0.75]] * 4)
    got = md.run_dense({**outs, "grad": grad}, {"x": xv})
    want = {"abs": xv.abs(), "round": torch.round(xv), "pos": xv, "pow2": 2.0 ** xv,
            "not": (~(xv > 0)).float(), "and": ((xv > 0) & (xv < 1)).float(), "or": ((xv > 1) | (xv < -1)).float(),
            "grad": math.log(2.0) * 2.0 ** xv}
    for k in want:
        # exp(x ln 2) against torch's pow: a few float32 ulps apart
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=k)
