"""md.flip (meshdsl/ops/flip.py) and its lowering (meshdsl/lowering/flip.py).

The dense program and torch.flip are the oracles.  Under a split of the flipped dim the
forward and the gradient each send ONE reversing permute (a rank's block to the mirrored rank),
never an allgather; an uneven split gathers the dim and still gives the dense numbers.

Legend: batch 2, words 6 (7 for the uneven split), d 4; layer 2 under md.repeat.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

import meshdsl as md
from meshdsl.comm.distributed import TorchComm
from meshdsl.errors import ShapeError
from meshdsl.processes import launcher

from conftest import assert_ranks_match_dense, held_outputs_on_this_rank

B, D = 2, 4


def _graph(words: int = 6, dims=("words",)):
    """``y = flip(tanh(x) * x, dims)`` and the gradient of ``sum(y * cot)`` by x."""
    x = md.input("x", [md.Dim("batch", B), md.Dim("words", words), md.Dim("d", D)])
    y = md.flip(md.tanh(x) * x, list(dims))
    cot = md.input("cot", y.shape)
    (gx,) = md.grad(md.reduce_sum(y * cot), [x])
    return {"y": y, "gx": gx}


def _feeds(words: int = 6) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(B, words, D, generator=gen), "cot": torch.randn(B, words, D, generator=gen)}


def _kinds(plan) -> list[tuple[str, str, tuple]]:
    return [(s.kind, s.label, s.axes) for s, _ in plan.collectives()]


def test_dense_forward_and_gradient_are_torch_flips():
    with md.Graph():
        outs = _graph(dims=("words", "d"))
        feeds = _feeds()
        got = md.run_dense(outs, feeds)
    x = feeds["x"].clone().requires_grad_()
    y = torch.flip(torch.tanh(x) * x, [1, 2])
    (gx,) = torch.autograd.grad((y * feeds["cot"]).sum(), [x])
    # the same kernels in the same order: equal up to fp32 rounding of the autograd sum order
    torch.testing.assert_close(got["y"], y.detach(), rtol=0, atol=0)
    torch.testing.assert_close(got["gx"], gx, rtol=1e-6, atol=1e-6)


def test_any_dtype_and_rank_and_no_dims():
    with md.Graph():
        i = md.input("i", [md.Dim("n", 5)], dtype=torch.int64)
        m = md.input("m", [md.Dim("r", 2), md.Dim("c", 3)], dtype=torch.bool)
        f = md.input("f", [md.Dim("r", 2), md.Dim("c", 3)])
        outs = {"i": md.flip(i, "n"), "m": md.flip(m, [m.shape["c"]]), "f": md.flip(f, [])}
        feeds = {"i": torch.arange(5), "m": torch.tensor([[True, False, False], [False, True, True]]),
                 "f": torch.randn(2, 3)}
        got = md.run_dense(outs, feeds)
    assert got["i"].dtype == torch.int64 and torch.equal(got["i"], torch.arange(4, -1, -1))
    assert torch.equal(got["m"], torch.flip(feeds["m"], [1]))
    assert torch.equal(got["f"], feeds["f"])
    assert outs["f"].node.op.name == "input"   # an empty list: x itself, no node


@pytest.mark.parametrize("mesh, layout, words, kinds", [
    # an even split of the flipped dim: one reversing permute forward, one for the gradient
    ("model:2", "words:model", 6, [("permute", "flip", ("model",)), ("permute", "grad_flip/flip", ("model",))]),
    # three ranks: the middle one keeps its own block
    ("model:3", "words:model", 6, [("permute", "flip", ("model",)), ("permute", "grad_flip/flip", ("model",))]),
    # 7 over 3 (3, 2, 2): the reversed blocks straddle ranks, so the dim is gathered
    ("model:3", "words:model", 7, [("allgather", "flip", ("model",)), ("allgather", "grad_flip/flip", ("model",))]),
    # split along another dim: local
    ("model:2", "d:model", 6, []),
    ("data:2; model:2", "batch:data, words:model", 6,
     [("permute", "flip", ("model",)), ("permute", "grad_flip/flip", ("model",))]),
])
def test_split_layouts_match_the_dense_program(mesh, layout, words, kinds):
    with md.Graph():
        outs = _graph(words)
        plan = md.compile(outs, mesh, layout)
        feeds = _feeds(words)
        got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    assert _kinds(plan) == kinds
    for k in want:
        # a flip moves values and adds nothing: bit-equal to the dense program
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_one_permute_per_flip_of_two_split_dims_and_totals_count_it():
    """words over a, d over b: reversing the group index over (a, b) reverses both blocks' indices,
    so one permute of a rank's block (batch 2 x words 3 x d 2 fp32 = 48 B) serves both dims."""
    with md.Graph():
        outs = _graph(dims=("words", "d"))
        plan = md.compile(outs, "a:2; b:2", "words:a, d:b")
        feeds = _feeds()
        got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    assert plan.totals() == {"permute": {"count": 2, "bytes": 2 * B * 3 * 2 * 4}}
    assert all(s.args["reverse"] and set(s.axes) == {"a", "b"} for s, _ in plan.collectives())
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_inside_a_repeat_and_a_pipeline():
    """A bidirectional-style block (h + tanh(flip(h) @ w)) over 2 layers, words split over model:
    each layer's forward and backward each send one permute; under stage:2 it pipelines."""
    L, W = md.Dim("layer", 2), md.Dim("words", 6)
    for mesh, layout, options in (("model:2", "words:model", {}),
                                  ("stage:2; model:2", "layer:stage, words:model", {"microbatches": 2})):
        with md.Graph():
            x = md.input("x", [md.Dim("batch", B), W, md.Dim("d", D)])
            w = md.param("w", [L, md.Dim("d", D), md.Dim("e", D)])

            def block(h, p):
                return h + md.rename(md.tanh(md.einsum("batch words d, d e -> batch words e",
                                                       md.flip(h, "words"), p["w"])), {"e": "d"})
            loss = md.reduce_sum(md.repeat(block, x, {"w": w}, L) ** 2)
            outs = {"loss": loss, **{f"d{k}": g for k, g in md.grad(loss, {"x": x, "w": w}).items()}}
            plan = md.compile(outs, mesh, layout, **options)
            feeds, params = {"x": _feeds()["x"]}, {"w": torch.randn(2, D, D, generator=torch.Generator().manual_seed(1))}
            got, want = md.run_simulated(plan, feeds, params), md.run_dense(outs, feeds, params)
        for k in want:
            # fp32: the loss and w's gradient sum the model ranks' rows in another order; values O(10)
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{mesh} {k}: {m}")
        kinds = {s.kind for s, _ in plan.collectives() if s.op == "flip"}
        assert kinds == {"permute"}, (mesh, kinds)


def test_errors_name_the_dim_and_the_fix():
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("words", 3)])
        with pytest.raises(ShapeError, match=r"flip: dim 'word' is not a dim .* Did you mean 'words'\?"):
            md.flip(x, "word")
        with pytest.raises(ShapeError, match=r"names no dim: dims are named, not numbered"):
            md.flip(x, 1)
        with pytest.raises(ShapeError, match=r"listed twice"):
            md.flip(x, ["words", "words"])
        with pytest.raises(ShapeError, match=r"its 'words' has size 3"):
            md.flip(x, md.Dim("words", 4))


def _gloo_case(rank: int):
    torch.set_num_threads(1)
    comm = TorchComm("model:3")
    with md.Graph():
        plan = md.compile(_graph(), "model:3", "words:model")
        return held_outputs_on_this_rank(comm, plan, _feeds())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_reversing_permute_on_three_gloo_processes_matches_dense():
    results = launcher.spawn(_gloo_case, 3, timeout=100)
    assert multiprocessing.active_children() == []
    with md.Graph():
        want = md.run_dense(_graph(), _feeds())
    # a flip adds nothing: tanh(x) * x and its gradient as the dense program rounds them
    assert_ranks_match_dense(results, want, 1e-6)
