"""An einsum of three or more operands is built as a chain of two-operand einsums (ops/einsum.py,
ops/einsum_order.py): its numbers are torch.einsum's, and its gradients move what the pairs
would (round 27b: under heads:model a three-operand einsum's third weight gradient was
allreduced whole, where the same math as two einsums sent one small gather)."""
import pytest
import torch

import meshdsl as md
from meshdsl.ops.einsum_order import EXACT_UP_TO, pairwise_order

EQ3 = "batch heads d_head, heads d_head d_model, d_model embed -> batch embed"


def _pooler(three: bool):
    """The repro's loss and its gradients (CoCa's pooler output projection at toy sizes)."""
    b, h, e = md.Dim("batch", 4), md.Dim("heads", 2), md.Dim("d_head", 4)
    d, em = md.Dim("d_model", 8), md.Dim("embed", 8)
    x, wo, proj = md.param("x", [b, h, e], scale=1.0), md.param("wo", [h, e, d]), md.param("proj", [d, em])
    if three:
        z = md.einsum(EQ3, x, wo, proj)
    else:
        z = md.einsum("batch d_model, d_model embed -> batch embed",
                      md.einsum("batch heads d_head, heads d_head d_model -> batch d_model", x, wo), proj)
    loss = md.reduce_sum(md.tanh(z))
    return {"loss": loss, **md.grad(loss, {"grad/x": x, "grad/wo": wo, "grad/proj": proj})}


def test_a_three_operand_einsums_gradients_move_what_two_einsums_would():
    plans = {}
    for three in (True, False):
        with md.Graph():
            plans[three] = md.compile(_pooler(three), "model:2", "heads:model")
    moved = {k: [(s.kind, s.phase, s.bytes) for s, _ in p.walk() if s.is_collective] for k, p in plans.items()}
    # before the fix: also a backward allreduce of grad/proj [d_model, embed]: each gradient is now a
    # chain of pairs, which contracts heads only where its pair does; like the two einsums', the
    # backward sends nothing (the forward is one op, lowered whole: it gathers where they reduce)
    assert not [m for m in moved[True] if m[1] == "backward"], moved[True]
    assert not [m for m in moved[False] if m[1] == "backward"], moved[False]


def test_a_three_operand_einsum_and_its_gradients_are_torch_einsums():
    with md.Graph():
        outs = _pooler(True)
        gen = torch.Generator().manual_seed(0)
        params = {n: torch.randn(t.shape.sizes, generator=gen) for n, t in outs["loss"].graph.params().items()}
        got = md.run_dense(outs, params=params)
        assert md.check(outs, "model:2", "heads:model", {}, params=params).ok
    ref = {n: v.clone().requires_grad_() for n, v in params.items()}
    loss = torch.tanh(torch.einsum("bhe,hed,dm->bm", ref["x"], ref["wo"], ref["proj"])).sum()
    loss.backward()
    # fp32 sums taken in another order (a chain of two matmuls): a few ulps of values of size ~10
    torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-5)
    for n, v in ref.items():
        torch.testing.assert_close(got[f"grad/{n}"], v.grad, rtol=1e-5, atol=1e-5)


def test_the_chain_contracts_in_the_cheapest_order():
    # matrices [2, 64] [64, 2] [2, 64]: (AB)C costs 2*64*2 + 2*2*64, A(BC) 64*2*64 + 2*64*64
    sizes = {"i": 2, "j": 64, "k": 2, "l": 64}
    assert pairwise_order([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"), sizes) == \
        [(0, 1, ("i", "k")), (3, 2, ("i", "l"))]
    sizes = {"i": 64, "j": 2, "k": 64, "l": 2}
    assert pairwise_order([("i", "j"), ("j", "k"), ("k", "l")], ("i", "l"), sizes) == \
        [(1, 2, ("j", "l")), (0, 3, ("i", "l"))]
    # a dim read by one operand only and not kept is summed in the first pair that holds it
    assert pairwise_order([("a", "s"), ("a", "b"), ("b",)], ("a",), {"a": 3, "s": 5, "b": 4})[-1][2] == ("a",)


@pytest.mark.parametrize("num", [4, EXACT_UP_TO + 1])
def test_a_long_einsum_is_torch_einsum(num):
    # a ring of matrices summed to a scalar (the exact search up to EXACT_UP_TO operands, then greedy)
    names = [f"d{k}" for k in range(num)]
    gen = torch.Generator().manual_seed(num)
    with md.Graph():
        dims = [md.Dim(n, 2 + k % 3) for k, n in enumerate(names)]
        ts = [md.param(f"m{k}", [dims[k], dims[(k + 1) % num]]) for k in range(num)]
        eq = ", ".join(f"{names[k]} {names[(k + 1) % num]}" for k in range(num)) + " -> " + names[0]
        out = md.einsum(eq, *ts)
        params = {t.name: torch.randn(t.shape.sizes, generator=gen) for t in ts}
        got = md.run_dense({"out": out}, params=params)["out"]
    letters = "abcdefghijklmnop"
    want = torch.einsum(",".join(letters[k] + letters[(k + 1) % num] for k in range(num)) + "->a",
                        *params.values())
    # fp32 products of up to 9 factors, summed in another order
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
