"""Plausible mistakes with md.flip, md.batch_norm(running=, momentum=), md.load_trained(config=) /
``meshdsl eval --config`` and md.grad twice: each a MeshDSLError (a CLI exit 2 with one message)
that says what was wrong, the rule and the fix; never a raw Python error or a silent wrong result.

Legend: batch 2, height 4 (normalised over), c 3 (the features), words 6, d 4.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.tools import cli
from meshdsl.train.checkpoint_format import CheckpointError
from meshdsl.train.trained import TrainedError

B, H, C, W, D = md.Dim("batch", 2), md.Dim("height", 4), md.Dim("c", 3), md.Dim("words", 6), md.Dim("d", 4)


def _clean(e) -> str:
    """The message, checked for the house structure (what, rule, fix)."""
    text = str(e.value)
    assert "\nRule: " in text and "\nFix: " in text, text
    return text


@pytest.mark.parametrize("dim, says", [
    (1, "dims are named, not numbered"),
    ("word", "Did you mean 'words'?"),
    (["words", "words"], r"\['words'\] listed twice"),
    (md.Dim("words", 5), "its 'words' has size 6"),
    ({"words", "d"}, r"\(set\) names no dim"),
])
def test_flip_of_a_dim_it_cannot_name(dim, says):
    with md.Graph():
        x = md.input("x", [B, W, D])
        with pytest.raises(md.ShapeError, match=says) as e:
            md.flip(x, dim)
    _clean(e)


def test_flip_of_the_micro_batched_batch_dim_is_a_layout_error():
    """Flipping the batch needs every micro-batch's rows at once: refused, not flipped per micro-batch."""
    L = md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 4), W, D])
        w = md.param("w", [L, D])
        h = md.repeat(lambda h, p: h * p["w"], x, {"w": w}, L)
        with pytest.raises(md.LayoutError, match="'flip' cannot be micro-batched") as e:
            md.compile({"loss": md.reduce_sum(md.flip(h, "batch"))}, "stage:2", "layer:stage", microbatches=2)
    _clean(e)


@pytest.mark.parametrize("case, says", [
    ("momentum_str", r"momentum='0\.1' is not a number in \(0, 1\]"),
    ("momentum_str_without_running", r"momentum='x' is not a number"),
    ("same_param_twice", "gives one param as both the running mean and the running variance"),
    ("other_graph", "is a param of another graph"),
    ("int_param", "must be a float param of x's features"),
    ("eps_negative", r"eps=-1\.0 is not a finite number >= 0"),
])
def test_batch_norm_running_mistakes(case, says):
    with md.Graph("other"):
        elsewhere = md.param("elsewhere", [C], init="zeros")
    with md.Graph():
        x = md.input("x", [B, H, C])
        rm, rv = md.param("rm", [C], init="zeros"), md.param("rv", [C], init="ones")
        ri = md.param("ri", [C], init="zeros", dtype=torch.int32)
        kwargs = {"momentum_str": dict(running=(rm, rv), momentum="0.1"),
                  "momentum_str_without_running": dict(momentum="x"),
                  "same_param_twice": dict(running=(rm, rm)),
                  "other_graph": dict(running=(elsewhere, rv)),
                  "int_param": dict(running=(ri, rv)),
                  "eps_negative": dict(eps=-1.0)}[case]
        with pytest.raises(md.ShapeError, match=says) as e:
            md.batch_norm(x, ["batch", "height"], **kwargs)
    _clean(e)


def test_running_params_closed_over_by_a_repeat_block_are_refused_with_the_way_out():
    """A block reads an outer param through the repeat's closure (one copy for every layer): the
    step could not set it per layer, so running= there is refused as for a stacked param's slice."""
    L = md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [B, H, C])
        rm, rv = md.param("rm", [C], init="zeros"), md.param("rv", [C], init="ones")
        w = md.param("w", [L, C])

        def block(h, p):
            return md.batch_norm(h * p["w"], ["batch", "height"], running=(rm, rv))
        with pytest.raises(md.ShapeError, match="inside md.repeat") as e:
            md.repeat(block, x, {"w": w}, L)
    _clean(e)
    assert "stats=True" in str(e.value)


def test_grad_twice_points_to_vjp():
    with md.Graph():
        w, x = md.param("w", [D]), md.input("x", [D])
        (gw,) = md.grad(md.reduce_sum(md.square(w * x)), [w])
        with pytest.raises(md.GraphError, match="only through 'grad/w', the result of an earlier md.grad") as e:
            md.grad(md.reduce_sum(gw * gw), [w])
    assert "md.vjp" in _clean(e)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("errsweep")
    before = torch.get_num_threads()
    md.fit("mlp", tiny=True, steps=1, checkpoint=str(root / "ck"), samples=0)
    torch.set_num_threads(before)
    return root / "ck"


@pytest.mark.parametrize("kwargs, error, says", [
    (dict(config="d_model=16"), CheckpointError, r"config \{'d_model': 16\} changes the model's params"),
    (dict(config=["d_model=8"]), TrainedError, r"config=\['d_model=8'\] \(list\) is not Config fields"),
    (dict(config={1: 2}), TrainedError, r"is not Config fields"),
    (dict(config="batch=3", batch=5), TrainedError, "batch=5 and config's batch=3 disagree"),
])
def test_load_trained_config_mistakes(ckpt, kwargs, error, says):
    with pytest.raises(error, match=says) as e:
        md.load_trained(ckpt, **kwargs)
    text = _clean(e)
    if "d_model=16" in str(kwargs):
        assert "saved shape [d_model:8, d_ff:16], wanted [d_model:16, d_ff:16]" in text and "drop d_model" in text


def test_eval_config_that_reshapes_the_params_exits_2_with_one_message(ckpt, capsys):
    rc = cli.main(["eval", str(ckpt), "--config", "d_model=16"])
    err = capsys.readouterr().err
    assert rc == 2 and "eval: config {'d_model': 16} changes the model's params" in err and "Traceback" not in err
