"""Mistakes a new user makes on purpose, having read only README.md and docs/guide: each must
be one clear message (what, ``Rule:``, ``Fix:``; a caret under the spot of a string), never an
internal TypeError / AttributeError / RuntimeError from deep inside, and exit code 2 from the CLI.

tests/test_errors.py covers layouts, shapes and feeds; tests/test_catalogue.py the CLI flags.
These are the Python habits (torch functions, ``@``, ``if x:``, indexing), the op calls meshdsl
lacks, arguments of the wrong kind to ops, ``md.repeat``, ``md.fit``, ``TrainStep``,
``Executor`` and ``run_simulated``, and model files that make those mistakes.
"""
from __future__ import annotations

import re

import pytest
import torch

import meshdsl as md
from conftest import run_cli
from meshdsl.errors import GraphError, MeshError, ShapeError

B, D, F, L = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("d_ff", 8), md.Dim("layer", 2)
MLP_EQ = "batch d_model, d_model d_ff -> batch d_ff"


def build(fn):
    """``fn(x, w, a)`` inside a fresh graph with an input x [batch, d_model], a param w
    [d_model, d_ff] and a stacked param a [layer, d_model]."""
    with md.Graph():
        x = md.input("x", [B, D])
        w = md.param("w", [D, F])
        a = md.param("a", [L, D])
        return fn(x, w, a)


def mlp_plan():
    with md.Graph():
        x = md.input("x", [B, D])
        w = md.param("w", [D, F])
        loss = md.reduce_mean(md.einsum(MLP_EQ, x, w) ** 2)
    return loss, md.compile(loss, "data:2", "batch:data")


def _leaked():
    """A tensor made inside a block, kept in a list and used after the repeat."""
    kept = []

    def block(h, p):
        kept.append(h * p["a"])
        return kept[-1]

    def model(x, w, a):
        y = md.repeat(block, x, {"a": a}, "layer")
        return md.reduce_sum(kept[0] + y)

    return build(model)


def _grad_of_layer_slice():
    kept = {}

    def block(h, p):
        kept["a"] = p["a"]
        return h * p["a"]

    return build(lambda x, w, a: md.grad(md.reduce_sum(md.repeat(block, x, {"a": a}, "layer")), [kept["a"]]))


def _step(**kw):
    loss, _ = mlp_plan()
    params = {"w": loss.graph.params["w"]}
    return md.TrainStep(loss, params, "data:2", "batch:data", md.SimulatedComm("data:2"), **kw)


# (id, thunk, exception class, key texts that must all appear)
CASES = [
    # ------------------------------------------------------------ ops meshdsl lacks, torch habits
    ("md_sum", lambda: md.sum, AttributeError, ["no op or name 'sum'", "Fix: write md.reduce_sum(x, 'dim')"]),
    ("md_matmul", lambda: md.matmul, AttributeError, ["'matmul'", "md.einsum("]),
    ("md_op_typo", lambda: md.gelu2, AttributeError, ["no op or name 'gelu2'", "Did you mean 'gelu'?"]),
    ("torch_function_on_tensor", lambda: build(lambda x, w, a: torch.relu(x)), GraphError,
     ["torch.relu was called on a meshdsl Tensor", "md.relu(...)"]),
    ("torch_matmul_on_tensor", lambda: build(lambda x, w, a: torch.matmul(x, w)), GraphError,
     ["torch.matmul was called", "md.einsum("]),
    ("matmul_operator", lambda: build(lambda x, w, a: x @ w), GraphError, ["has no '@'", "md.einsum("]),
    ("if_on_a_tensor", lambda: build(lambda x, w, a: 1 if x > 0 else 0), GraphError,
     ["has no truth value", "md.where(x > 0, a, b)"]),
    ("index_a_tensor", lambda: build(lambda x, w, a: x[0]), GraphError, ["cannot be indexed ([0])", "md.slice_"]),
    ("iterate_a_tensor", lambda: build(lambda x, w, a: list(x)), GraphError, ["cannot be iterated"]),
    ("len_of_a_tensor", lambda: build(lambda x, w, a: len(x)), GraphError, ["has no len()", "x.shape"]),
    ("float_of_a_tensor", lambda: build(lambda x, w, a: float(md.reduce_sum(x))), GraphError,
     ["has no Python value", "md.run_dense"]),
    ("tensor_method", lambda: build(lambda x, w, a: x.sum()), AttributeError,
     ["has no attribute or method 'sum'", "md.reduce_sum(x, 'dim')"]),
    ("tensor_numpy", lambda: build(lambda x, w, a: x.numpy()), AttributeError,
     ["'numpy'", "run the graph first"]),
    # ------------------------------------------------------------ ops given what is not a Tensor
    ("reduce_a_float", lambda: build(lambda x, w, a: md.reduce_sum(3.0)), ShapeError,
     ["reduce_sum: argument 'x' is the Python float 3.0, not a meshdsl Tensor", "md.constant"]),
    ("unary_of_a_float", lambda: build(lambda x, w, a: md.relu(3.0)), ShapeError,
     ["relu: its input is the Python float 3.0"]),
    ("unary_of_a_float_outside_a_graph", lambda: md.exp(2.0), ShapeError, ["exp: its input is the Python float"]),
    ("layer_norm_of_a_float", lambda: build(lambda x, w, a: md.layer_norm(1.0, "d_model")), ShapeError,
     ["layer_norm: argument 'x'"]),
    ("layer_norm_scale_torch", lambda: build(lambda x, w, a: md.layer_norm(x, "d_model", torch.ones(4))),
     ShapeError, ["layer_norm: argument 'scale' is a torch.Tensor of shape (4,)", "md.input"]),
    ("add_a_torch_tensor", lambda: build(lambda x, w, a: x + torch.ones(8, 4)), ShapeError,
     ["add: operand 1 is a torch.Tensor of shape (8, 4), not a meshdsl Tensor", "md.input(", "md.constant("]),
    ("mul_a_list", lambda: build(lambda x, w, a: x * [1.0, 2.0]), ShapeError, ["mul: operand 1 is [1.0, 2.0] (list)"]),
    ("einsum_dtypes_differ", lambda: build(lambda x, w, a: md.einsum(MLP_EQ, md.cast(x, torch.bfloat16), w)),
     ShapeError, ["different dtypes ['bfloat16', 'float32']", "precision='bf16'", "md.cast"]),
    ("rename_onto_a_kept_name", lambda: build(lambda x, w, a: md.rename(x, batch="d_model")), ShapeError,
     ["rename {'batch': 'd_model'}", "['d_model'] would appear twice"]),
    ("param_name_not_a_str", lambda: build(lambda x, w, a: md.param(3, [D])), GraphError,
     ["the name is 3 (int), not a non-empty str"]),
    ("input_dtype_a_string", lambda: build(lambda x, w, a: md.input("q", [D], "float32")), GraphError,
     ["dtype 'float32' (str) is not a torch.dtype", "torch.float32"]),
    # ------------------------------------------------------------ md.repeat
    ("repeat_params_a_list", lambda: build(lambda x, w, a: md.repeat(lambda h, p: h, x, [a], "layer")),
     ShapeError, ["params must be a dict {name: stacked param}", "{'w': w}"]),
    ("repeat_carry_a_float", lambda: build(lambda x, w, a: md.repeat(lambda h, p: h, 1.0, {"a": a}, "layer")),
     ShapeError, ["repeat: the carry x is the Python float 1.0"]),
    ("repeat_block_not_callable", lambda: build(lambda x, w, a: md.repeat(None, x, {"a": a}, "layer")),
     GraphError, ["block is None (NoneType), not a function"]),
    ("repeat_block_one_parameter", lambda: build(lambda x, w, a: md.repeat(lambda h: h, x, {"a": a}, "layer")),
     GraphError, ["cannot be called as block(carry, params)", "give the block two parameters"]),
    ("repeat_carry_has_the_layer_dim", lambda: build(lambda x, w, a: md.repeat(
        lambda h, p: h * p["a"], md.broadcast_to(x, [L, B, D]), {"a": a}, "layer")), ShapeError,
     ["has the layer dim 'layer'", "the carry (what one layer hands the next) does not"]),
    ("repeat_carry_dtype_changes", lambda: build(lambda x, w, a: md.repeat(
        lambda h, p: md.cast(h * p["a"], torch.bfloat16), x, {"a": a}, "layer")), ShapeError,
     ["its dtype changes", "md.cast(y, torch.float32)"]),
    ("repeat_pair_without_dict", lambda: build(lambda x, w, a: md.repeat(
        lambda h, p: (h * p["a"], h), x, {"a": a}, "layer")), ShapeError,
     ["a pair whose second item is a Tensor, not a dict of per-layer outputs", "(carry, {'name': per-layer"]),
    ("repeat_per_layer_output_from_outside", lambda: build(lambda x, w, a: md.repeat(
        lambda h, p: (h * p["a"], {"aux": a}), x, {"a": a}, "layer")), ShapeError,
     ["per-layer output 'aux' is Tensor(a", "made outside the block", "(carry, {'aux': tensor_of_this_layer})"]),
    ("repeat_param_made_in_block", lambda: build(lambda x, w, a: md.repeat(
        lambda h, p: h * md.param("b", [D]), x, {"a": a}, "layer")), GraphError,
     ["param('b') is created inside the repeat block", "create it before the md.repeat call",
      "stack it with Dim('layer', N)"]),
    ("repeat_input_made_in_block", lambda: build(lambda x, w, a: md.repeat(
        lambda h, p: h * md.input("b", [D]), x, {"a": a}, "layer")), GraphError,
     ["input('b') is created inside the repeat block"]),
    ("repeat_block_tensor_used_outside", _leaked, ShapeError,
     ["after its trace ended", "a tensor made inside the block", "return the tensor as a per-layer output"]),
    ("grad_wrt_a_layer_slice", _grad_of_layer_slice, GraphError,
     ["made inside the repeat block", "the stacked param passed to md.repeat"]),
    # ------------------------------------------------------------ running: wrong kinds of arguments
    ("run_simulated_a_tensor", lambda: md.run_simulated(mlp_plan()[0], {}), GraphError,
     ["run_simulated: plan is Tensor(", "not a Plan", "md.compile(outputs, mesh, layout)"]),
    ("run_simulated_feeds_a_list", lambda: md.run_simulated(mlp_plan()[1], [torch.zeros(8, 4)]), GraphError,
     ["feeds is [tensor(", "(list), not a dict", "keyed by the names given to md.input"]),
    ("run_dense_feeds_a_str", lambda: md.run_dense(mlp_plan()[0], "x"), GraphError,
     ["run_dense: feeds is 'x' (str), not a dict"]),
    ("run_dense_params_a_list", lambda: md.run_dense(mlp_plan()[0], {"x": torch.zeros(8, 4)}, [torch.zeros(4, 8)]),
     GraphError, ["run_dense: params is [tensor(", "keyed by the names given to md.param"]),
    ("run_dense_param_of_another_shape", lambda: md.run_dense(mlp_plan()[0], {"x": torch.zeros(8, 4)},
                                                             {"w": torch.zeros(8, 4)}), GraphError,
     ["param 'w' is of shape (8, 4), not of shape (4, 8) ([d_model:4, d_ff:8])"]),
    ("run_dense_output_a_name", lambda: md.run_dense("loss", {}), GraphError,
     ["run_dense: output 'outputs' is 'loss' (str), not a Tensor"]),
    ("run_simulated_params_a_list", lambda: md.run_simulated(mlp_plan()[1], {"x": torch.zeros(8, 4)},
                                                             [torch.zeros(4, 8)]), GraphError,
     ["run_simulated: params is [tensor("]),
    ("executor_comm_a_str", lambda: md.Executor(mlp_plan()[1], "data:2"), GraphError,
     ["Executor: comm is 'data:2' (str), not a Communicator", "md.SimulatedComm(plan.mesh)"]),
    ("executor_plan_a_tensor", lambda: md.Executor(mlp_plan()[0], md.SimulatedComm("data:2")), GraphError,
     ["Executor: plan is Tensor(", "not a Plan"]),
    ("simulated_comm_an_int", lambda: md.SimulatedComm(2), MeshError, ["SimulatedComm: mesh is 2 (int), not a Mesh"]),
    ("train_step_optimizer_a_str", lambda: _step(optimizer="adamw"), GraphError,
     ["optimizer is 'adamw' (str), not a meshdsl optimizer", "md.AdamW(lr=...)"]),
    ("train_step_optimizer_a_class", lambda: _step(optimizer=md.SGD), GraphError,
     ["not a meshdsl optimizer", "make one: optimizer=md.SGD(lr=...)"]),
    ("train_step_torch_optimizer", lambda: _step(optimizer=torch.optim.SGD), GraphError,
     ["torch.optim optimizers do not apply"]),
    ("train_step_feeds_a_list", lambda: _step()([torch.zeros(8, 4)]), GraphError,
     ["TrainStep: feeds is", "not a dict"]),
    # ------------------------------------------------------------ md.fit (all refused before training)
    ("fit_unknown_option", lambda: md.fit("mlp", tiny=True, steps=1, save_evry=2), md.MeshDSLError,
     ["fit: it takes no argument 'save_evry'", "Did you mean 'save_every'?"]),
    ("fit_timeout_in_process", lambda: md.fit("mlp", tiny=True, steps=1, timeout=20), md.MeshDSLError,
     ["timeout= set(s) spawned processes, and this run trains in this process", "nproc=N"]),
    ("fit_timeout_not_positive", lambda: md.fit("mlp", tiny=True, steps=1, nproc=2, job_timeout=0), md.MeshDSLError,
     ["job_timeout=0 is not a positive number of seconds", "job_timeout=900"]),
    ("fit_backend_unknown", lambda: md.fit("mlp", tiny=True, steps=1, nproc=2, backend="mpi"), md.MeshDSLError,
     ["backend='mpi' is not a torch.distributed backend", "'gloo'"]),
    ("fit_steps_a_str", lambda: md.fit("mlp", tiny=True, steps="10"), md.MeshDSLError,
     ["fit: steps='10' (str) is not an int", "steps=10"]),
    ("fit_steps_zero", lambda: md.fit("mlp", tiny=True, steps=0), md.MeshDSLError, ["steps=0 is out of range"]),
    ("fit_lr_a_str", lambda: md.fit("mlp", tiny=True, steps=1, lr="0.1"), md.MeshDSLError,
     ["lr='0.1' (str) is not a number"]),
    ("fit_data_an_int", lambda: md.fit("mlp", tiny=True, steps=1, data=5), md.MeshDSLError,
     ["fit: data is 5 (int)", "a function step -> {input name: full tensor}"]),
    ("fit_optimizer_typo", lambda: md.fit("mlp", tiny=True, steps=1, optimizer="adamm"), md.MeshDSLError,
     ["optimizer='adamm' is not one meshdsl has", "Did you mean 'adamw'?"]),
    ("fit_model_an_int", lambda: md.fit(3, steps=1), md.MeshDSLError,
     ["fit: model is 3 (int)", "md.load_model('transformer', tiny=True)"]),
]


@pytest.mark.parametrize("thunk, cls, texts", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_mistake(thunk, cls, texts):
    with pytest.raises(cls) as info:
        thunk()
    e = info.value
    msg = str(e)
    # A house message (what, Rule:, Fix:) and one clean one: no internal exception chained to it.
    assert "Rule:" in msg and "Fix:" in msg, msg
    for t in texts:
        assert t in msg, f"{t!r} not in:\n{msg}"
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), repr(e.__context__)
    if not isinstance(e, md.MeshDSLError):  # an unknown name: an AttributeError, so hasattr stays False
        assert isinstance(e, AttributeError)


def test_misuse_keeps_python_protocols():
    """The clear errors change no answer Python or a library asks of a Tensor or of the module:
    hasattr is False for what is missing, and a number, or a one-element torch tensor, still
    combines with a Tensor."""
    assert not hasattr(md, "sum") and not hasattr(md, "_nothing") and hasattr(md, "reduce_sum")

    def check(x, w, a):
        assert not hasattr(x, "numpy") and not hasattr(x, "__array__")
        assert (x * 2.0).dtype == (x * torch.tensor(2.0)).dtype == torch.float32
    build(check)


# ----------------------------------------------------------------------------- carets in einsum strings


def _caret_under(msg: str, source: str) -> str:
    lines = msg.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.strip() == source and "^" in lines[i + 1]:
            m = re.search(r"\^+", lines[i + 1])
            return line[m.start():m.end()]
    raise AssertionError(f"no caret under {source!r} in:\n{msg}")


@pytest.mark.parametrize("eq, under, words", [
    ("batch d_modl, d_model d_ff -> batch d_ff", "d_modl", ["names 'd_modl'", "write operand 0 as 'batch d_model'"]),
    ("batch d_model, d_model d_ff -> batch d_fff", "d_fff", ["output dim 'd_fff' appears in no input",
                                                            "Did you mean 'd_ff'?"]),
    ("batch batch, d_model d_ff -> batch d_ff", "batch", ["'batch' appears twice in input"]),
    ("batch d_model, d_model d-ff -> batch", "-", ["found '-'"]),
])
def test_einsum_mistakes_point_at_the_spot(eq, under, words):
    with pytest.raises(md.MeshDSLError) as info:
        build(lambda x, w, a: md.einsum(eq, x, w))
    msg = str(info.value)
    assert _caret_under(msg, eq) == under and "Rule:" in msg and "Fix:" in msg
    for t in words:
        assert t in msg, f"{t!r} not in:\n{msg}"


def test_einsum_size_mismatch_points_at_the_operand():
    eq = MLP_EQ
    with pytest.raises(ShapeError) as info:
        build(lambda x, w, a: md.einsum(eq, x, md.param("w5", [md.Dim("d_model", 5), F])))
    msg = str(info.value)
    assert "dim 'd_model' has size 4 in one operand and 5 in operand 1" in msg
    # the caret is under the second operand's 'd_model', not the first's
    lines = msg.splitlines()
    i = [line.strip() for line in lines].index(eq)
    assert lines[i + 1].index("^") == lines[i].index(eq) + eq.index("d_model", eq.index(","))


# ----------------------------------------------------------------------------- the CLI: exit 2, no traceback


MODEL = """from dataclasses import dataclass
import torch
import meshdsl as md


@dataclass(frozen=True)
class Config:
    d: int = 4


def build(cfg: Config = Config()) -> md.Model:
    b, d = md.Dim("batch", 8), md.Dim("d", cfg.d)
    with md.Graph() as g:
        x = md.input("x", [b, d])
        w = md.param("w", [d])
        loss = {loss}
    return md.Model(graph=g, loss=loss, params={{"w": w}}, make_feeds=lambda seed=0: {{"x": torch.ones(8, cfg.d)}})
"""


@pytest.mark.parametrize("loss, words", [
    ("md.sum(x * w)", ["no op or name 'sum'", "md.reduce_sum(x, 'dim')", "line 16"]),
    ("md.reduce_sum(x * torch.ones(8, 4))", ["mul: operand 1 is a torch.Tensor of shape (8, 4)", "line 16"]),
    ("md.reduce_sum(torch.tanh(x * w))", ["torch.tanh was called on a meshdsl Tensor", "md.tanh(...)"]),
    ("md.reduce_sum(x * w) if x > 0 else 0.0", ["has no truth value", "md.where"]),
])
def test_a_model_file_with_a_mistake_exits_2(tmp_path, capsys, loss, words):
    f = tmp_path / "my_model.py"
    f.write_text(MODEL.format(loss=loss))
    rc, _, err = run_cli(capsys, ["plan", str(f), "--mesh", "data:2", "--layout", "batch:data"])
    assert rc == 2, err
    assert "Traceback (most recent call last)" not in err and "internal error" not in err
    for t in words:
        assert t in err, f"{t!r} not in:\n{err}"


def test_a_schedule_typo_exits_2_with_the_closest_name(capsys):
    rc, _, err = run_cli(capsys, ["plan", "transformer", "--tiny", "--mesh", "stage:2", "--layout", "layer:stage",
                                  "--schedule", "1fb1"])
    assert rc == 2 and "invalid choice: '1fb1'" in err and "Did you mean '1f1b'?" in err, err
