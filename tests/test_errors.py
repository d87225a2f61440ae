"""Bad inputs beyond string syntax (that is tests/test_parse.py): each must raise a
:class:`meshdsl.MeshDSLError` (a ValueError) whose message names what was wrong,
never an internal KeyError / AttributeError / AssertionError, and never with an
internal exception chained to it.

Messages follow the house structure (what, inputs, bullets, ``Rule:``, ``Fix:``);
the tests check the key words of each and, for strings, where the caret points.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import meshdsl as md
from meshdsl.errors import GraphError, LayoutError, ShapeError

B, D, F = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("d_ff", 8)
MESH = "data:2; model:2"


def mlp():
    """The MLP every case starts from; returns its tensors by name."""
    with md.Graph() as g:
        x = md.input("x", [B, D])
        ids = md.input("ids", [B], torch.int64)
        w1, w2 = md.param("w1", [D, F]), md.param("w2", [F, D])
        h = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w1))
        y = md.einsum("batch d_ff, d_ff d_model -> batch d_model", h, w2)
        loss = md.reduce_mean(y ** 2)
    return SimpleNamespace(g=g, x=x, ids=ids, w1=w1, w2=w2, h=h, y=y, loss=loss)


def _adamw_outputs(m):
    from meshdsl.train.step import optimizer_outputs
    return optimizer_outputs(m.loss, {"w1": m.w1, "w2": m.w2}, md.AdamW(), clip=False)


def repeat_model(block=None, params=None):
    l, d, f = md.Dim("layer", 2), md.Dim("d_model", 4), md.Dim("d_ff", 8)
    with md.Graph():
        x = md.input("x", [B, d])
        a, b = md.param("a", [l, d, f]), md.param("b", [l, f, d])

        def default(h, p):
            u = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["a"]))
            return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", u, p["b"])

        y = md.repeat(block or default, x, params(a, b) if params else {"a": a, "b": b}, "layer")
        return md.reduce_sum(y * y)


def _caret_target(msg: str, source: str) -> str:
    """The text the caret line of ``msg`` underlines in its copy of ``source``."""
    lines = msg.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.strip() == source.strip() and "^" in lines[i + 1]:
            m = re.search(r"\^+", lines[i + 1])
            return line[m.start():m.end()]
    raise AssertionError(f"no caret under {source!r} in:\n{msg}")


def _in_graph(m, fn):
    with m.g:
        return fn()


def _two_stacks(depth_u: int, depth_v: int):
    """Two stacks in one graph, both over a dim named 'layer'."""
    with md.Graph():
        h = md.input("x", [B, D])
        for name, depth in (("u", depth_u), ("v", depth_v)):
            w = md.param(name, [md.Dim("layer", depth), D])
            h = md.repeat(lambda c, p, k=name: c * p[k], h, {name: w}, "layer")
    return h


def _feeds():
    return {"x": torch.randn(8, 4), "ids": torch.randint(0, 8, (8,))}


# Each case: (id, thunk, exception class, key texts that must all appear).
CASES = [
    # --------------------------------------------------------------- layout vs model and mesh
    ("layout_unknown_dim", lambda: md.compile(mlp().loss, MESH, "bacth:data"), LayoutError,
     ["names dim 'bacth'", "Did you mean 'batch'?", "model dims: batch, d_ff, d_model", "Rule:", "Fix:"]),
    ("layout_unknown_axis", lambda: md.compile(mlp().loss, MESH, "batch:dta"), LayoutError,
     ["unknown mesh axis 'dta'", "Did you mean 'data'?", "mesh: data:2; model:2", "Fix:"]),
    ("layout_unknown_axis_in_tuple", lambda: md.compile(mlp().loss, MESH, "d_ff:(data,modle)"), LayoutError,
     ["unknown mesh axis 'modle'", "Did you mean 'model'?"]),
    ("layout_not_divisible", lambda: md.compile(mlp().loss, "data:3", "batch:data", strict_splits=True), LayoutError,
     ["dim 'batch' of size 8", "not divisible", "data:3", "tensor shape: [batch:8, d_model:4]", "Rule:"]),
    ("layout_not_divisible_multi_axis",
     lambda: md.compile(mlp().loss, "data:2; model:3", "batch:(data,model)", strict_splits=True),
     LayoutError, ["dim 'batch' of size 8", "data:2 x model:3 (= 6)"]),
    ("layout_not_divisible_intermediate",
     lambda: md.compile(md.slice_(mlp().x, "batch", 0, 3), MESH, "batch:data", strict_splits=True), LayoutError,
     ["Tensor 'slice'", "dim 'batch' of size 3", "not divisible"]),
    ("param_two_dims_one_axis", lambda: md.compile(mlp().loss, MESH, "d_model:data; d_ff:data"), LayoutError,
     ["Tensor 'w1'", "mesh axis 'data' is used by dims ['d_model', 'd_ff']", "'w1.d_ff:()'", "'w1.d_ff:model'", "Rule:"]),
    ("opt_state_two_dims_one_axis",   # the example scope is one a rule can name (not 'opt/w1/exp_avg')
     lambda: md.compile(_adamw_outputs(mlp()), MESH, "d_ff:data; opt.d_model:data"), LayoutError,
     ["Tensor 'opt/w1/exp_avg'", "mesh axis 'data' is used by dims ['d_model', 'd_ff']", "'w1.d_model:()'"]),
    ("input_two_dims_one_axis", lambda: md.compile(mlp().loss, MESH, "x.batch:model; d_model:model"), LayoutError,
     ["Tensor 'x'", "mesh axis 'model' is used by dims"]),
    ("contradicting_rules", lambda: md.compile(mlp().loss, MESH, "batch:data; batch:model"), LayoutError,
     ["Contradicting layout rules for 'batch'", "'batch:data' and 'batch:model'", "Fix:"]),
    ("contradicting_scoped_rules", lambda: md.compile(mlp().loss, MESH, "params.d_ff:data; params.d_ff:model"),
     LayoutError, ["Contradicting layout rules for 'params.d_ff'"]),
    ("bad_scope_name", lambda: md.compile(mlp().loss, MESH, "w11.d_ff:model"), LayoutError,
     ["scope 'w11' is neither 'params' nor the name of a tensor", "Did you mean 'w1'?", "named tensors: w1, w2, x"]),
    ("layout_dict_bad_value", lambda: md.compile(mlp().loss, MESH, {"batch": 3}), LayoutError,
     ["Layout dict entry 'batch'", "not a mesh axis"]),
    ("layout_dict_repeated_axis", lambda: md.compile(mlp().loss, MESH, {"batch": ("data", "data")}),
     LayoutError, ["tuple of distinct axes"]),
    # 'layer:<axis>' makes <axis> a pipeline axis (tests/test_pipeline.py); it may split nothing else.
    ("pipeline_axis_splits_another_dim", lambda: md.compile(repeat_model(), MESH, "layer:data; batch:data"),
     LayoutError, ["layout rule 'batch:data' uses the pipeline axis 'data'", "Rule:", "Fix:"]),
    ("pipeline_axis_by_params_rule_splits_another_dim",
     lambda: md.compile(repeat_model(), MESH, "params.layer:model; batch:model"),
     LayoutError, ["layout rule 'batch:model' uses the pipeline axis 'model'"]),
    # --------------------------------------------------------------- building graphs
    ("einsum_operand_names", lambda: md.einsum("batch d_ff, d_model d_ff -> batch", mlp().x, mlp().w1),
     ShapeError, ["operand 0 names 'd_ff'", "write operand 0 as 'batch d_model'"]),
    # a [src_seq, d_model] table added to the [batch, d_model] stream broadcast it to 3-D: the
    # error names that add and fixes it there, never suggesting to keep the dim
    ("einsum_dim_from_a_broadcast", lambda: (lambda m: md.einsum(
        "batch d_model, d_model d_ff -> batch d_ff",
        md.tanh(m.x + _in_graph(m, lambda: md.param("pos", [md.Dim("src_seq", 8), D]))), m.w1))(mlp()), ShapeError,
     ["omits dim(s) ['src_seq']", "dim 'src_seq' entered at add 'add'", "pos [src_seq:8, d_model:4] over x",
      "fix add 'add'", "md.rename(pos, src_seq='batch')", "keeps [batch, d_model]"]),
    ("einsum_operand_omits_a_dim_of_its_leaf", lambda: md.einsum("batch -> batch", mlp().x), ShapeError,
     ["operand 0 omits dim(s) ['d_model']", "write operand 0 as 'batch d_model'"]),
    ("einsum_operand_count", lambda: (lambda m: md.einsum("batch d_model -> batch", m.x, m.w1))(mlp()),
     ShapeError, ["1 operand(s) but 2 tensor(s)"]),
    ("einsum_non_tensor", lambda: md.einsum("batch d_model -> batch", 3.0), ShapeError,
     ["operand 3.0 (float) is not a Tensor"]),
    ("einsum_sizes_disagree", lambda: (lambda m: md.einsum(
        "batch d_model, batch -> d_model", m.x, _in_graph(m, lambda: md.param("v", [md.Dim("batch", 4)]))))(mlp()),
     ShapeError, ["dim 'batch' has size 8 in one operand and 4"]),
    ("broadcast_sizes_disagree", lambda: (lambda m: m.x + _in_graph(m, lambda: md.param(
        "v", [md.Dim("batch", 4)])))(mlp()), ShapeError,
     ["add: dim 'batch' has size 8 in one operand and 4 in another", "operand shapes"]),
    ("mixed_dtypes", lambda: (lambda m: m.x + md.cast(m.x, torch.float64))(mlp()), ShapeError,
     ["operands have different dtypes", "meshdsl.cast"]),
    ("where_condition_not_bool", lambda: (lambda m: md.where(m.x, m.x, 0.0))(mlp()), ShapeError,
     ["condition", "not bool"]),
    ("exp_of_integers", lambda: md.exp(mlp().ids), ShapeError, ["exp: input", "int64, not floating point"]),
    ("pow_bad_exponent", lambda: md.pow(mlp().x, "2"), ShapeError, ["exponent '2' (str) is not a number"]),
    ("cast_not_a_dtype", lambda: md.cast(mlp().x, "float32"), ShapeError, ["'float32' is not a torch.dtype"]),
    ("reshape_element_count", lambda: md.reshape(mlp().x, [md.Dim("a", 5), md.Dim("b", 7)]), ShapeError,
     ["32 elements cannot become 35"]),
    ("reshape_same_name_new_size",
     lambda: md.compile(md.reshape(mlp().x, [md.Dim("batch", 4), md.Dim("d_model", 8)]), MESH, ""), ShapeError,
     ["'batch' changes size but keeps its name"]),
    ("rearrange_bad_split", lambda: md.rearrange(mlp().x, "batch (heads d_k) -> batch heads d_k", heads=3),
     ShapeError, ["cannot split dim d_model:4 into (heads d_k)", "multiply to its size"]),
    ("rearrange_wrong_left_name", lambda: md.rearrange(mlp().x, "batch d_modl -> batch d_modl"), ShapeError,
     ["left side names 'd_modl'", "write 'd_model' there"]),
    ("rearrange_wrong_left_count", lambda: md.rearrange(mlp().x, "batch -> batch"), ShapeError,
     ["left side has 1 entries", "start the pattern with 'batch d_model ->'"]),
    ("transpose_not_permutation", lambda: md.transpose(mlp().x, ["batch"]), ShapeError,
     ["is not a permutation of ['batch', 'd_model']"]),
    ("broadcast_to_drops_dim", lambda: md.broadcast_to(mlp().x, [B]), ShapeError, ["is not in target"]),
    ("rename_unknown_dim", lambda: md.rename(mlp().x, bacth="b"), ShapeError,
     ["has no dim 'bacth'", "Did you mean 'batch'?"]),
    ("reduce_unknown_dim", lambda: md.reduce_sum(mlp().x, "bacth"), ShapeError,
     ["reduce_sum: dim 'bacth' is not a dim", "Did you mean 'batch'?"]),
    ("reduce_dim_twice", lambda: md.reduce_max(mlp().x, ["batch", "batch"]), ShapeError, ["listed twice"]),
    ("slice_out_of_range", lambda: md.slice_(mlp().x, "batch", 2, 9), ShapeError,
     ["[2:9] is out of range for dim 'batch' of size 8"]),
    ("pad_negative", lambda: md.pad(mlp().x, "batch", -1, 0), ShapeError, ["negative padding"]),
    ("concat_dims_out_of_order", lambda: (lambda m: md.concat([m.x, md.transpose(m.x, ["d_model", "batch"])],
                                                                "batch"))(mlp()), ShapeError,
     ["operand 1 [d_model:4, batch:8] does not line up with operand 0", "in the same order"]),
    ("concat_empty", lambda: md.concat([], "batch"), ShapeError, ["non-empty list of Tensors"]),
    ("shift_unknown_dim", lambda: md.shift(mlp().x, "bacth", 1), ShapeError, ["'bacth'", "Did you mean 'batch'?"]),
    ("top_k_too_big", lambda: md.top_k(mlp().x, "d_model", 5), ShapeError,
     ["k=5 is out of range for dim 'd_model' of size 4"]),
    ("top_k_new_dim_size", lambda: md.top_k(mlp().x, "d_model", 2, md.Dim("top", 3)), ShapeError,
     ["new_dim top:3 must have size k=2"]),
    ("dropout_rate_one", lambda: md.dropout(mlp().x, 1.0), ShapeError, ["rate 1.0 is not in [0, 1)"]),
    ("dropout_rate_negative", lambda: md.dropout(mlp().x, -0.1), ShapeError, ["rate -0.1"]),
    ("dropout_integers", lambda: md.dropout(mlp().ids, 0.5), ShapeError, ["not floating point"]),
    ("gather_float_ids", lambda: (lambda m: md.gather(m.w1, m.x, "d_model"))(mlp()), ShapeError,
     ["ids", "are torch.float32", "integers"]),
    ("gather_shared_dims", lambda: (lambda m: md.gather(m.x, m.ids, "d_model"))(mlp()), ShapeError,
     ["share dim(s) ['batch']"]),
    ("one_hot_float_ids", lambda: md.one_hot(mlp().x, md.Dim("v", 3)), ShapeError, ["indices are integers"]),
    ("cross_entropy_labels", lambda: (lambda m: md.cross_entropy(m.x, m.ids, "batch"))(mlp()), ShapeError,
     ["labels [batch:8] must have the logits' dims minus 'batch'"]),
    ("causal_mask_same_dim", lambda: _in_graph(mlp(), lambda: md.causal_mask(B, B)), ShapeError,
     ["two Dims with different names"]),
    ("iota_not_a_dim", lambda: _in_graph(mlp(), lambda: md.iota("seq")), ShapeError, ["'seq' is not a Dim"]),
    ("layer_norm_scale_dims", lambda: (lambda m: md.layer_norm(m.x, "d_model", m.w1))(mlp()), ShapeError,
     ["scale", "has dim(s) ['d_ff']"]),
    ("dim_bad_name", lambda: md.Dim("1x", 3), ShapeError, ["bad name"]),
    ("dim_bad_size", lambda: md.Dim("x", 0), ShapeError, ["size must be a positive int"]),
    ("shape_duplicate_dim", lambda: md.Shape([B, B]), ShapeError, ["['batch'] appear twice"]),
    ("duplicate_param_name", lambda: _in_graph(mlp(), lambda: md.param("w1", [D])), GraphError,
     ["param('w1'): the name is already used"]),
    ("input_named_like_param", lambda: _in_graph(mlp(), lambda: md.input("w2", [D])), GraphError,
     ["input('w2'): the name is already used"]),
    ("param_unknown_init", lambda: _in_graph(mlp(), lambda: md.param("p", [D], init="xavier")), GraphError,
     ["unknown init 'xavier'"]),
    ("no_active_graph", lambda: md.param("p", [D]), GraphError, ["No active graph"]),
    ("mixing_graphs", lambda: mlp().x + mlp().x, GraphError, ["belongs to graph", "one graph"]),
    ("compile_mixing_graphs", lambda: md.compile({"a": mlp().loss, "b": mlp().loss}, MESH, ""), GraphError,
     ["outputs 'a' and 'b' belong to different graphs"]),
    ("compile_non_tensor", lambda: md.compile({"a": 3}, MESH, ""), GraphError, ["output 'a' is 3 (int)"]),
    ("compile_nothing", lambda: md.compile({}, MESH, ""), GraphError, ["no outputs given"]),
    # --------------------------------------------------------------- repeat
    ("repeat_carry_mismatch", lambda: repeat_model(
        lambda h, p: md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["a"])), ShapeError,
     ["the block maps carry [batch:8, d_model:4] to [batch:8, d_ff:8]", "keeps its dims"]),
    ("repeat_block_returns_non_tensor", lambda: repeat_model(lambda h, p: 3.0), ShapeError,
     ["the block returned 3.0"]),
    ("repeat_unknown_layer_param", lambda: repeat_model(lambda h, p: h * p["c"]), ShapeError,
     ["reads param 'c', which was not passed", "params passed: ['a', 'b']"]),
    ("repeat_param_lacks_layer_dim", lambda: repeat_model(params=lambda a, b: {"a": a, "w": md.reduce_sum(b, "layer")}),
     ShapeError, ["stacked param 'w' [d_ff:8, d_model:4] has no 'layer' dim"]),
    ("repeat_stacks_share_a_dim_name", lambda: repeat_model(params=lambda a, b: {"a": a, "b": b, "c": md.param(
        "c", [md.Dim("layer", 3), D])}), ShapeError, ["disagree on (or lack) the size of 'layer'"]),
    ("repeat_two_stacks_one_name_two_depths", lambda: _two_stacks(2, 3), ShapeError,
     ["this stack has layer:3, but stack 'repeat'", "params ['u'], 2 layers", "params ['v'], 3 layers",
      "Dim('enc_layer', 2) and Dim('dec_layer', 3)"]),
    # --------------------------------------------------------------- autodiff
    ("grad_of_non_scalar", lambda: (lambda m: md.grad(m.h, [m.w1]))(mlp()), GraphError, ["is not a scalar"]),
    ("grad_of_integer_loss", lambda: md.grad(md.reduce_sum(mlp().ids)), GraphError, ["int64, not floating point"]),
    ("grad_wrt_other_graph", lambda: md.grad(mlp().loss, [mlp().w1]), GraphError,
     ["belongs to another graph than the loss"]),
    ("grad_wrt_integer_input", lambda: (lambda m: md.grad(m.loss, [m.ids]))(mlp()), GraphError,
     ["only floating-point tensors have gradients"]),
    ("grad_wrt_name", lambda: md.grad(mlp().loss, {"w1": "w1"}), GraphError, ["'w1' (str), not a Tensor"]),
    ("vjp_cotangent_shape", lambda: (lambda m: md.vjp([m.h], [m.x], [m.w1]))(mlp()), GraphError,
     ["cotangent Tensor(x", "does not match output", "[batch:8, d_ff:8]"]),
    ("vjp_counts", lambda: (lambda m: md.vjp([m.h, m.loss], [m.h], [m.w1]))(mlp()), GraphError,
     ["2 output(s) but 1 cotangent(s)"]),
    # --------------------------------------------------------------- running
    ("feed_wrong_dtype_dense", lambda: md.run_dense(mlp().loss, {"x": torch.zeros(8, 4, dtype=torch.int64)}),
     GraphError, ["feed 'x': dtype torch.int64 does not match torch.float32"]),
    ("feed_wrong_dtype_simulated", lambda: md.run_simulated(md.compile(mlp().loss, MESH, "batch:data"),
                                                            {"x": torch.zeros(8, 4, dtype=torch.float64)}),
     GraphError, ["dtype torch.float64 does not match torch.float32"]),
    ("feed_wrong_shape", lambda: md.run_simulated(md.compile(mlp().loss, MESH, "batch:data"), {"x": torch.zeros(4, 8)}),
     GraphError, ["feed 'x': shape (4, 8) does not match [batch:8, d_model:4]"]),
    ("feed_not_a_tensor", lambda: md.run_dense(mlp().loss, {"x": [[0.0] * 4] * 8}), GraphError,
     ["expected a torch.Tensor, got list"]),
    ("feed_missing_dense", lambda: md.run_dense(mlp().loss, {}), GraphError, ["no value fed for input 'x'"]),
    ("feed_missing_simulated", lambda: md.run_simulated(md.compile(mlp().loss, MESH, ""), {}), GraphError,
     ["no value fed for input 'x'", "add 'x' to the feeds"]),
    ("feed_per_rank_count", lambda: md.run_simulated(md.compile(mlp().loss, MESH, "batch:data"),
                                                     {"x": md.PerRank([torch.zeros(4, 4)])}), GraphError,
     ["1 slices for 4 rank(s)"]),
    ("feed_per_rank_shape", lambda: md.run_simulated(md.compile(mlp().loss, MESH, "batch:data"),
                                                     {"x": md.PerRank([torch.zeros(8, 4)] * 4)}), GraphError,
     ["local slice shape (8, 4) != (4, 4)"]),
    ("gather_ids_out_of_range", lambda: (lambda m: md.run_dense(md.gather(m.w1, m.ids, "d_model"), {
        "ids": torch.full((8,), 9)}))(mlp()), GraphError,
     ["outside dim 'd_model' of size 4"]),
]


@pytest.mark.parametrize("thunk, cls, texts", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(thunk, cls, texts):
    with pytest.raises(md.MeshDSLError) as info:
        thunk()
    e = info.value
    assert isinstance(e, ValueError) and isinstance(e, cls), type(e)
    msg = str(e)
    for t in texts:
        assert t in msg, f"{t!r} not in:\n{msg}"
    assert "Rule:" in msg and "Fix:" in msg, msg
    # One clean message: no internal exception chained to it.
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), repr(e.__context__)


def test_there_are_enough_distinct_cases():
    assert len({c[0] for c in CASES}) == len(CASES) >= 25


def test_two_stacks_of_one_depth_may_share_a_name():
    assert _two_stacks(2, 2).shape == md.Shape([B, D])


# ----------------------------------------------------------------------------- carets

@pytest.mark.parametrize("layout, under", [
    ("batch:dta", "dta"),
    ("batch:data; d_ff:(model,dat)", "dat"),
    ("bacth:data", "bacth"),
    ("w3.d_ff:model", "w3"),
    ("batch:data; batch:model", "batch:model"),
    ("d_model:data; d_ff:data", "d_ff:data"),
])
def test_caret_points_at_the_culprit(layout, under):
    with pytest.raises(md.MeshDSLError) as info:
        md.compile(mlp().loss, MESH, layout)
    assert _caret_target(str(info.value), layout) == under


def test_non_divisible_caret_and_numbers():
    layout = "d_model:data; batch:(data,model)"
    with pytest.raises(LayoutError) as info:
        md.compile(mlp().loss, "data:2; model:3", layout, strict_splits=True)
    msg = str(info.value)
    assert "dim 'batch' of size 8" in msg and "data:2 x model:3 (= 6)" in msg
    assert _caret_target(msg, layout) == "batch:(data,model)"


def test_multiline_layout_caret_names_the_line():
    layout = "batch:data\nd_ff:modl"
    with pytest.raises(LayoutError) as info:
        md.compile(mlp().loss, MESH, layout)
    assert "line 2: d_ff:modl" in str(info.value)


# ----------------------------------------------------------------------------- integer arithmetic


def test_integer_tensors_keep_their_dtype_or_refuse():
    """A scalar with an integer tensor: integral scalars keep the dtype (the value computed is
    the one declared); a fractional scalar, a bool tensor in arithmetic, or an integer div is
    refused instead of silently becoming float."""
    n = md.Dim("n", 3)
    with md.Graph():
        m = md.input("m", [n], torch.int64)
        y, z = 1 - m, m * 2
        assert y.dtype == z.dtype == torch.int64
        got = md.run_dense({"y": y, "z": z}, {"m": torch.tensor([0, 1, 2])})
        assert got["y"].dtype == torch.int64 and got["y"].tolist() == [1, 0, -1] and got["z"].tolist() == [0, 2, 4]
        assert (m > 0.5).dtype == torch.bool
        for bad in (lambda: m * 0.5, lambda: m / m, lambda: md.greater(m, 0) * 1):
            with pytest.raises(ShapeError, match="Fix: cast"):
                bad()
