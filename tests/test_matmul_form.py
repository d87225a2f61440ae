"""MatmulForm: a two-operand einsum as one mm/bmm, and its fused ``p + alpha * einsum``.

A hypothesis property draws random dims (batch, m, n, k, and dims summed inside one
operand), random operand and output orders, and checks: the form exists unless a dim
is summed within one operand; it is "in order" (fusable with an update) exactly when
the output lists its batch dims first and then one operand's dims before the other's;
and it equals ``torch.einsum`` (fp32, rtol/atol 1e-5: the same products summed by a
BLAS kernel in another blocking), out of place and, in order, added into p in place,
written into a buffer and added into it.
"""
from __future__ import annotations

import string

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshdsl.ops import matmul_form
from meshdsl.ops.matmul_form import ADD_MATMUL, MatmulForm

SIZES = dict(zip(string.ascii_lowercase, (2, 3, 4, 5, 2, 3, 4, 5, 2, 3)))


def _tensor(names, seed):
    return torch.randn([SIZES.get(n, 3) for n in names], generator=torch.Generator().manual_seed(seed))


def _eq(a, b, out):
    return f"{''.join(a)},{''.join(b)}->{''.join(out)}"


@st.composite
def _einsums(draw):
    letters = iter(string.ascii_lowercase)
    groups = {g: [next(letters) for _ in range(draw(st.integers(0, 2), label=g))]
              for g in ("batch", "m", "n", "k")}
    lone = [next(letters)] if draw(st.booleans(), label="summed in one operand") else []
    a = draw(st.permutations(groups["batch"] + groups["m"] + groups["k"] + lone), label="a")
    b = draw(st.permutations(groups["batch"] + groups["k"] + groups["n"]), label="b")
    out = draw(st.permutations(groups["batch"] + groups["m"] + groups["n"]), label="out")
    return tuple(a), tuple(b), tuple(out), groups, bool(lone)


def _in_order(a, b, out, groups) -> bool:
    """The output lists its batch dims first, then one operand's dims, then the other's."""
    nb = len(groups["batch"])
    rest = list(out[nb:])
    if set(out[:nb]) != set(groups["batch"]):
        return False
    first = [d for d in rest if d in a]
    second = [d for d in rest if d in b]
    return rest in (first + second, second + first)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_einsums())
def test_form_matches_einsum(case):
    a_names, b_names, out, groups, lone = case
    form = MatmulForm.of(a_names, b_names, out)
    assert (form is None) == lone, form
    if form is None:
        return
    assert form.in_order == _in_order(a_names, b_names, out, groups), form
    x, y = _tensor(a_names, 1), _tensor(b_names, 2)
    want = torch.einsum(_eq(a_names, b_names, out), x, y)
    got = form.matmul(x, y)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if not form.in_order:
        return
    p = _tensor(out, 3)
    torch.testing.assert_close(form.add_matmul(p, x, y, -0.5), p - 0.5 * want, rtol=1e-5, atol=1e-5)
    q = p.clone()
    ptr = q.data_ptr()
    res = ADD_MATMUL.compute_inplace(None, {"form": form, "alpha": -0.5}, q, x, y)
    assert res.data_ptr() == ptr and torch.equal(res, q), "in place means into p's own buffer"
    torch.testing.assert_close(q, p - 0.5 * want, rtol=1e-5, atol=1e-5)
    # written into a buffer (a stacked gradient's layer slice), then added into it (a running sum)
    buf = torch.full(want.shape, float("nan"))
    assert form.matmul_into(x, y, buf, accumulate=False) is buf
    torch.testing.assert_close(buf, want, rtol=1e-5, atol=1e-5)
    assert form.matmul_into(x, y, buf, accumulate=True) is buf
    torch.testing.assert_close(buf, 2 * want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("a, b, out, swap", [
    ("bd", "df", "bf", False),        # forward matmul
    ("bf", "bd", "df", True),         # weight gradient: the output starts with the 2nd operand's dims
    ("hbd", "hdf", "hbf", False),     # batched over h
    ("bd", "fd", "bf", False),        # contraction over the last dims of both (B transposed)
    ("b", "b", "", False),            # a dot product
    ("mk", "kn", "nm", True),         # n before m: the transposed product
])
def test_known_forms(a, b, out, swap):
    form = MatmulForm.of(tuple(a), tuple(b), tuple(out))
    assert form is not None and form.swap == swap


@pytest.mark.parametrize("a, b, out", [
    ("xmk", "kn", "mnx"),     # m dims split around n
    ("bmk", "bkn", "mbn"),    # batch dim not leading
    ("bshd", "bthd", "stbh"), # attention scores laid out [seq, seq', batch, heads]
])
def test_permuted_output(a, b, out):
    form = MatmulForm.of(tuple(a), tuple(b), tuple(out))
    assert form is not None and not form.in_order
    x, y = _tensor(a, 1), _tensor(b, 2)
    torch.testing.assert_close(form.matmul(x, y), torch.einsum(_eq(a, b, out), x, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("a, b, out, skips", [
    ("mk", "kn", "mn", "permute reshape"),      # already (M, K) @ (K, N)
    ("hmk", "hkn", "hmn", "permute reshape"),   # already (B, M, K) @ (B, K, N)
    ("bsd", "df", "bsf", "permute"),            # rows over two dims: a reshape, no permute
    ("bd", "fd", "bf", "reshape"),              # B transposed: a permute, no reshape
    ("b", "b", "", "permute"),                  # a dot product: rows of one, a reshape
])
def test_identity_work_is_skipped(a, b, out, skips):
    """A call skips a permute that keeps dim order and a reshape of operands one dim per group;
    what it still does gives the einsum's numbers."""
    form = MatmulForm.of(tuple(a), tuple(b), tuple(out))
    assert (not form._permute_a and not form._permute_b) == ("permute" in skips)
    assert (form._flat_a and form._flat_b) == ("reshape" in skips)
    x, y = _tensor(a, 1), _tensor(b, 2)
    torch.testing.assert_close(form.matmul(x, y), torch.einsum(_eq(a, b, out), x, y), rtol=1e-5, atol=1e-5)


def test_no_form_when_a_dim_is_summed_within_one_operand():
    assert MatmulForm.of(tuple("mkz"), tuple("kn"), tuple("mn")) is None


def test_non_contiguous_param_is_not_written_in_place():
    form = MatmulForm.of(("b", "d"), ("b", "f"), ("d", "f"))
    x, y = _tensor("bd", 1), _tensor("bf", 2)
    p = _tensor("fd", 3).t()  # a transposed view: no (d, f) row-major buffer to write into
    before = p.clone()
    res = form.add_matmul(p, x, y, -1.0, inplace=True)
    assert torch.equal(p, before)
    torch.testing.assert_close(res, before - torch.einsum("bd,bf->df", x, y), rtol=1e-5, atol=1e-5)


def test_matmul_into_a_buffer_that_cannot_take_it_returns_the_product():
    """A buffer of another dtype, or not row-major, is left alone: the caller copies."""
    form = MatmulForm.of(("b", "d"), ("b", "f"), ("d", "f"))
    x, y = _tensor("bd", 1), _tensor("bf", 2)
    want = torch.einsum("bd,bf->df", x, y)
    for buf in (torch.zeros(SIZES["f"], SIZES["d"]).t(), torch.zeros(SIZES["d"], SIZES["f"], dtype=torch.float64)):
        before = buf.clone()
        got = form.matmul_into(x, y, buf, accumulate=True)
        assert got is not buf and torch.equal(buf, before)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("a, b, out", [
    ("bsd", "dhe", "bshe"),   # q's projection: rows folded, the weight reshaped
    ("bshe", "dhe", "bsd"),   # the output projection: F.linear on the weight as it is
    ("bshe", "bsd", "dhe"),   # a weight gradient (swapped operands, A permuted)
    ("hbd", "hdf", "hbf"),    # batched
    ("bshd", "bthd", "stbh"), # a permuted output
])
def test_the_generated_call_is_the_traced_paths_numbers(a, b, out, monkeypatch):
    """Eager calls run the form's generated function for their shapes; a traced call (--compile)
    runs the generic steps: the same kernels on the same operands, so bitwise the same."""
    form = MatmulForm.of(tuple(a), tuple(b), tuple(out))
    x, y = _tensor(a, 1), _tensor(b, 2)
    eager = form.matmul(x, y)
    buf = torch.empty(eager.shape) if form.in_order else None
    if buf is not None:
        form.matmul_into(x, y, buf, accumulate=False)
    monkeypatch.setattr(matmul_form, "_compiling", lambda: True)
    torch.testing.assert_close(eager, form.matmul(x, y), rtol=0, atol=0)
    if buf is not None:
        traced = torch.empty(eager.shape)
        form.matmul_into(x, y, traced, accumulate=False)
        torch.testing.assert_close(buf, traced, rtol=0, atol=0)


def test_calls_for_shapes_is_the_call_for_tensors_of_them():
    """The program binds ``calls_for(shapes)`` per step: the very function a call with tensors of
    those shapes looks up."""
    form = MatmulForm.of(tuple("bsd"), tuple("dhe"), tuple("bshe"))
    x, y = _tensor("bsd", 1), _tensor("dhe", 2)
    assert form.calls_for(tuple(x.shape), tuple(y.shape)) is form._calls(x, y)
