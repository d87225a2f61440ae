"""cumsum, squeeze and unsqueeze (meshdsl/ops/scan.py, meshdsl/lowering/scan.py).

* the dense kernel against torch, for float and integer dtypes, every flag and dim position;
* gradients against torch.autograd;
* the simulated mesh against the dense program on every layout of meshes x:2, x:4 and x:2;y:2
  (the equivalence harness of conftest.py), and a Hypothesis property over random programs;
* the plan: one allgather of the per-rank totals over the scanned dim's axes, none when it is whole;
* a Mesh-TF-style capacity-limited top-1 dispatch written in the DSL, against plain torch,
  on layouts that split the batch and the experts, and on real gloo processes.

Legend: batch (b) 4, seq (s) 8, feat (f) 2 (3 in the dense-kernel test, 4 in the plan test);
in the MoE test batch 8 tokens, experts (e) 4, capacity (c) 2, d_model (d) 4, d_hidden (h) 4.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import meshdsl as md
from conftest import ATOL, MESHES, RTOL, axis_tuples, build_case, check_layouts, check_plan, layout_string
from meshdsl.errors import ShapeError
from meshdsl.processes.launcher import spawn

B, S, F2 = md.Dim("batch", 4), md.Dim("seq", 8), md.Dim("feat", 2)
MODES = {"inc": {}, "exc": {"exclusive": True}, "rev": {"reverse": True},
         "exc_rev": {"exclusive": True, "reverse": True}}


def _torch_cumsum(x: torch.Tensor, dim: int, exclusive: bool, reverse: bool) -> torch.Tensor:
    """A reference built differently from the kernel: reverse as total minus the forward sum,
    exclusive by subtracting x (exact for integers, a rounding apart for floats)."""
    inc = torch.cumsum(x, dim, dtype=x.dtype)
    if reverse:
        inc = x.sum(dim, keepdim=True, dtype=x.dtype) - inc + x
    return inc - x if exclusive else inc


def _random(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


# ----------------------------------------------------------------------------- dense kernel


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64, torch.int32])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("dim", ["batch", "seq", "feat"])
def test_dense_matches_torch(dtype, mode, dim):
    with md.Graph():
        x = md.input("x", [B, S, md.Dim("feat", 3)], dtype)
        y = md.cumsum(x, dim, **MODES[mode])
    assert y.shape == x.shape and y.dtype == dtype
    feed = _random((4, 8, 3), dtype)
    got = md.run_dense({"y": y}, {"x": feed})["y"]
    want = _torch_cumsum(feed, x.shape.index(dim), **{"exclusive": False, "reverse": False, **MODES[mode]})
    assert got.dtype == dtype
    if dtype.is_floating_point:
        # The reference subtracts where the kernel shifts: a few ulps of sums of O(1) terms.
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    else:
        assert torch.equal(got, want)


def test_exclusive_sum_does_not_cancel_against_a_large_element():
    # Subtracting x from the inclusive sum would give (1 + 1e8) - 1e8 = 0 in fp32; the
    # exclusive sum before 1e8 is 1, and the shifted inclusive scan has exactly that.
    with md.Graph():
        x = md.input("x", [md.Dim("seq", 3)])
        y = md.cumsum(x, "seq", exclusive=True)
        r = md.cumsum(x, "seq", exclusive=True, reverse=True)
    got = md.run_dense({"y": y, "r": r}, {"x": torch.tensor([1.0, 1e8, 1.0])})
    assert got["y"].tolist() == [0.0, 1.0, 1e8]
    assert got["r"].tolist() == [1e8, 1.0, 0.0]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("dim", ["batch", "seq"])
def test_gradient_matches_autograd(mode, dim):
    with md.Graph():
        x = md.input("x", [B, S], torch.float64)
        ct = md.input("ct", [B, S], torch.float64)
        y = md.tanh(md.cumsum(x, dim, **MODES[mode]))
        (gx,) = md.vjp([y], [ct], [x])
    xv, cv = _random((4, 8), torch.float64, 1), _random((4, 8), torch.float64, 2)
    got = md.run_dense({"gx": gx}, {"x": xv, "ct": cv})["gx"]
    xt = xv.clone().requires_grad_(True)
    yt = torch.tanh(_torch_cumsum(xt, ("batch", "seq").index(dim),
                                  **{"exclusive": False, "reverse": False, **MODES[mode]}))
    (want,) = torch.autograd.grad(yt, xt, cv)
    # float64: only summation order differs between the two backward passes.
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_integer_cumsum_has_no_gradient_and_bool_is_refused():
    with md.Graph():
        x = md.param("x", [B, S])
        counts = md.cumsum(md.cast(md.greater(x, 0.0), torch.int64), "seq")
        loss = md.reduce_sum(x * md.cast(counts, torch.float32))
        (gx,) = md.grad(loss, [x])
        with pytest.raises(ShapeError) as e:
            md.cumsum(md.greater(x, 0.0), "seq")
    assert "Fix: count in an integer dtype" in str(e.value)
    xv = md.run_dense({"x": x})["x"]
    want = torch.cumsum((xv > 0).to(torch.int64), 1).to(torch.float32)  # d/dx of x * c(x) is c: c is constant
    torch.testing.assert_close(md.run_dense({"gx": gx})["gx"], want, rtol=0, atol=0)


def test_errors_name_the_call_the_dims_and_the_fix():
    with md.Graph():
        x = md.input("x", [B, S])
        with pytest.raises(ShapeError) as e:
            md.cumsum(x, "sq")
        assert "cumsum" in str(e.value) and "Did you mean 'seq'?" in str(e.value)
        with pytest.raises(ShapeError) as e:
            md.cumsum(x, md.Dim("seq", 4))
        assert "does not match dim seq:8" in str(e.value)
        with pytest.raises(ShapeError) as e:
            md.squeeze(x, "seq")
        assert "size 8, not 1" in str(e.value) and "Fix:" in str(e.value)
        with pytest.raises(ShapeError) as e:
            md.unsqueeze(x, md.Dim("one", 2))
        assert "broadcast_to" in str(e.value)
        with pytest.raises(ShapeError) as e:
            md.unsqueeze(x, "one", 3)
        assert "-3 <= position <= 2" in str(e.value)
        with pytest.raises(ShapeError) as e:
            md.unsqueeze(x, "batch")
        assert "already has a dim 'batch'" in str(e.value)


# ----------------------------------------------------------------------------- squeeze / unsqueeze


@pytest.mark.parametrize("position, names", [(0, ("one", "batch", "seq")), (1, ("batch", "one", "seq")),
                                             (None, ("batch", "seq", "one")), (-1, ("batch", "seq", "one")),
                                             (-3, ("one", "batch", "seq"))])
def test_unsqueeze_then_squeeze_round_trips(position, names):
    with md.Graph():
        x = md.input("x", [B, S], torch.int64)
        u = md.unsqueeze(x, "one", position)
        back = md.squeeze(u, "one")
    assert u.shape.names == names and u.shape.get("one").size == 1
    feed = _random((4, 8), torch.int64)
    got = md.run_dense({"u": u, "back": back}, {"x": feed})
    assert torch.equal(got["u"], feed.unsqueeze(names.index("one")))
    assert torch.equal(got["back"], feed) and back.shape == x.shape


# ----------------------------------------------------------------------------- equivalence harness

def _outer(name, dims):
    """An activation with ``dims``: the outer product of a 1-D param per dim.  Unlike a param
    it may have two dims on one mesh axis (only leaves reject that), so every layout applies."""
    out = None
    for d in dims:
        v = md.param(f"{name}_{d.name}", [d], scale=1.0)
        out = v if out is None else out * v
    return out


def _cumsum_float():
    # Three dims, so the scanned dim is in every position and the others are batch dims of the scan.
    x = _outer("x_bsf", [B, S, F2]) + _outer("z_bsf", [B, S, F2]) * 0.5
    return {f"{d}/{m}": md.cumsum(x, d, **kw) for d in ("batch", "seq", "feat") for m, kw in MODES.items()}, {}


def _cumsum_int():
    # Integers computed in the graph (truncated, of both signs), not fed: an input is a leaf,
    # which would keep batch and seq off a shared axis.
    ids = md.cast(md.stop_gradient(_outer("u_bs", [B, S]) * 8.0), torch.int64)
    out = {f"{d}/{m}": md.cumsum(ids, d, **kw) for d in ("batch", "seq") for m, kw in MODES.items()}
    # a float result that depends on the counts, so the loss sees them
    out["weighted"] = md.cast(out["seq/exc"] + out["batch/rev"], torch.float32) * _outer("w_bs", [B, S])
    return out, {}


def _cumsum_partial():
    # p is a lazy partial sum over the axes of 'seq' when that is split: cumsum keeps it partial.
    x, w = _outer("x_bs", [B, S]), md.param("w_sf", [S, F2], scale=1.0)
    p = md.einsum("batch seq, seq feat -> batch feat", x, w)
    return {"b": md.cumsum(p, "batch"), "f_exc_rev": md.cumsum(p, "feat", exclusive=True, reverse=True),
            "twice": md.cumsum(md.cumsum(p, "batch", exclusive=True), "feat")}, {}


def _squeeze_unsqueeze():
    # top-1 leaves a size-1 dim; squeeze drops it, unsqueeze puts one back between the others.
    x = _outer("x_bs", [B, S]) + _outer("z_bs", [B, S])
    vals, idx = md.top_k(x, "seq", 1, "top")
    u = md.unsqueeze(md.tanh(x), md.Dim("one", 1), 1)
    return {"v": md.squeeze(vals, "top"), "i": md.squeeze(idx, "top"), "u": u * 2.0,
            "uu": md.squeeze(u, "one") * x}, {}


HARNESS = {"float": _cumsum_float, "int": _cumsum_int, "partial": _cumsum_partial,
           "squeeze_unsqueeze": _squeeze_unsqueeze}
_BUILT: dict = {}


# (2x2 for the two largest harnesses with -m slow: about 11 s; their (2) and (4) layouts and the
# other harnesses' 2x2 run always)
@pytest.mark.parametrize("name, mesh", [pytest.param(n, m, marks=pytest.mark.slow)
                                        if m == "2x2" and n in ("float", "squeeze_unsqueeze") else (n, m)
                                        for n in sorted(HARNESS) for m in ("2", "4", "2x2")])
def test_every_layout_matches_dense(name, mesh):
    if name not in _BUILT:
        _BUILT[name] = build_case(HARNESS[name])
    # Exhaustive: every assignment of axis tuples to every dim (scanned or not) these meshes allow.
    assert check_layouts(_BUILT[name], MESHES[mesh]) >= 3


# ----------------------------------------------------------------------------- property

POOL = {"i": 4, "j": 8, "k": 6, "n": 3}


@settings(derandomize=True, deadline=None, max_examples=100,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), mesh=st.sampled_from([MESHES["2"], MESHES["4"], MESHES["2x2"]]))
def test_random_cumsums_match_dense(data, mesh):
    log = []

    def program():
        names = data.draw(st.lists(st.sampled_from(sorted(POOL)), min_size=1, max_size=3, unique=True))
        dims = [md.Dim(n, POOL[n]) for n in names]
        floating = data.draw(st.booleans(), label="float")
        feeds = {}
        if floating:
            x = md.param("x", dims, scale=1.0)
            if data.draw(st.booleans(), label="partial"):  # a lazy partial sum over the contracted dim's axes
                c = md.Dim("c", 4)
                x = md.einsum(f"{' '.join(names)} c, c -> {' '.join(names)}",
                              md.param("xc", dims + [c], scale=1.0), md.param("v", [c], scale=1.0))
        else:
            x = md.input("x", dims, torch.int64)
            feeds["x"] = _random(tuple(d.size for d in dims), torch.int64, 5)
        outs = {}
        for k in range(data.draw(st.integers(1, 2), label="num_scans")):
            dim = data.draw(st.sampled_from(names), label="dim")
            excl, rev = data.draw(st.booleans(), label="exclusive"), data.draw(st.booleans(), label="reverse")
            x = md.cumsum(x, dim, exclusive=excl, reverse=rev)
            outs[f"y{k}"] = x
            log.append(f"y{k} = cumsum(..., {dim}, exclusive={excl}, reverse={rev}) on {names}")
        return outs, feeds

    case = build_case(program)
    axes = md.Mesh.parse(mesh)
    assign = {}
    for d in sorted(case.sizes):
        # unsplit listed last, so Hypothesis' simplest choice still splits
        opts = [t for t in axis_tuples(dict(axes.axes))[1:] + [()]
                if all(s % axes.axis_size(t) == 0 for s in case.sizes[d])]
        assign[d] = data.draw(st.sampled_from(opts), label=f"axes of {d}")
    for names in case.leaves:  # no leaf may put two of its dims on one axis: drop the repeat
        seen: set = set()
        for n in names:
            assign[n] = tuple(a for a in assign.get(n, ()) if a not in seen)
            seen.update(assign[n])
    layout = layout_string(assign)
    note("\n".join(log) + f"\nmesh='{mesh}' layout='{layout}'")
    check_plan(case, mesh, layout)


# ----------------------------------------------------------------------------- the plan


def _collectives(plan):
    return [(s.kind, s.axes, s.bytes, s.phase) for s, _ in plan.collectives()]


@pytest.mark.parametrize("mesh, layout, axes, num_slices, nbytes", [
    # nbytes: the totals as one rank holds them (x without 'seq', [batch 4, feat 4] locally
    # split by the other rules), int64; a 1/8 of the local input here.
    ("x:4", "seq:x", ("x",), 4, 4 * 4 * 8),
    ("x:2; y:2", "seq:(x,y)", ("x", "y"), 4, 4 * 4 * 8),
    ("x:2; y:2", "seq:(y,x)", ("y", "x"), 4, 4 * 4 * 8),
    ("x:2; y:2", "seq:y; feat:x", ("y",), 2, 4 * 2 * 8),  # another split dim: a batch dim of the scan
    ("x:2; y:2", "seq:y; batch:x", ("y",), 2, 2 * 4 * 8),
    ("x:2; y:2", "batch:y; feat:x", None, 1, 0),           # seq whole: no communication at all
    ("x:4", "", None, 1, 0),
    ("x:2; z:1", "seq:z; batch:x", None, 1, 0),            # an axis of size 1 splits nothing
])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_plan_has_one_allgather_of_the_totals(mesh, layout, axes, num_slices, nbytes, mode):
    f = md.Dim("feat", 4)
    with md.Graph():
        x = md.input("x", [B, S, f], torch.int64)
        y = md.cumsum(x, "seq", **MODES[mode])
    plan = md.compile({"y": y}, mesh, layout)
    if axes is None:
        assert _collectives(plan) == []
    else:
        assert _collectives(plan) == [("allgather", axes, nbytes, "forward")]
        step = next(s for s in plan.steps if s.kind == "allgather")
        assert plan.values[step.outs[0]].shape.get("seq").size == num_slices
    feed = _random((4, 8, 4), torch.int64, 9)
    got = md.run_simulated(plan, {"x": feed})["y"]
    assert torch.equal(got, md.run_dense({"y": y}, {"x": feed})["y"])



@pytest.mark.parametrize("mesh, layout, axes", [
    ("x:3", "seq:x", ("x",)),                   # 7 over 3: parts 3, 2, 2
    ("x:2; y:2", "seq:(x,y)", ("x", "y")),      # over two axes: 4 and 3, each halved: 2, 2, 2, 1
])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_uneven_split_scans_its_slices_and_gathers_only_the_totals(mesh, layout, axes, mode):
    """Slices of unequal lengths scan where they are, as equal ones do: one allgather of the
    per-rank totals each way (x without 'seq', [batch 4, feat 4] int64 here), not the whole dim."""
    f, s7 = md.Dim("feat", 4), md.Dim("seq", 7)
    with md.Graph():
        x = md.input("x", [B, s7, f], torch.int64)
        y = md.cumsum(x, "seq", **MODES[mode])
    plan = md.compile({"y": y}, mesh, layout)
    assert _collectives(plan) == [("allgather", axes, 4 * 4 * 8, "forward")]
    feed = _random((4, 7, 4), torch.int64, 3)
    got = md.run_simulated(plan, {"x": feed})["y"]
    assert torch.equal(got, md.run_dense({"y": y}, {"x": feed})["y"])


def test_backward_scans_the_other_way_with_one_more_allgather():
    with md.Graph():
        x = md.param("x", [B, S])
        loss = md.reduce_sum(md.tanh(md.cumsum(x, "seq")))
        (gx,) = md.grad(loss, [x])
    plan = md.compile({"loss": loss, "gx": gx}, "x:2; y:2", "seq:y; batch:x")
    gathers = [c for c in _collectives(plan) if c[0] == "allgather"]
    assert [(k, a, p) for k, a, _, p in gathers] == [("allgather", ("y",), "forward"),
                                                     ("allgather", ("y",), "backward")]
    scans = [n for n in plan.steps if n.op == "cumsum" and n.kind == "local"]
    assert {n.args["attrs"]["reverse"] for n in scans} == {False, True}
    got, want = md.run_simulated(plan), md.run_dense({"loss": loss, "gx": gx})
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL)


def test_partial_sum_stays_partial_through_the_scan():
    # seq is contracted on x (a partial sum over x), batch is scanned on y: one allgather
    # of the totals over y, and the one allreduce over x comes after the scan, not before.
    with md.Graph():
        a = md.input("a", [B, S])
        w = md.input("w", [S, F2])
        p = md.einsum("batch seq, seq feat -> batch feat", a, w)
        y = md.cumsum(p, "batch")
    plan = md.compile({"y": y}, "x:2; y:2", "seq:x; batch:y")
    kinds = [(k, ax) for k, ax, _, _ in _collectives(plan)]
    assert sorted(kinds) == [("allgather", ("y",)), ("allreduce", ("x",))]
    order = [s.kind for s in plan.steps if s.kind in ("allgather", "allreduce")]
    assert order == ["allgather", "allreduce"]
    feeds = {"a": _random((4, 8), torch.float32, 1), "w": _random((8, 2), torch.float32, 2)}
    torch.testing.assert_close(md.run_simulated(plan, feeds)["y"], md.run_dense({"y": y}, feeds)["y"],
                               rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- MoE dispatch

T, E, C = md.Dim("batch", 8), md.Dim("experts", 4), md.Dim("capacity", 2)
D, H = md.Dim("d_model", 4), md.Dim("d_hidden", 4)


def _moe_values():
    """Feeds and params; the router is scaled so tokens crowd some experts past capacity."""
    g = torch.Generator().manual_seed(21)
    feeds = {"x": torch.randn(8, 4, generator=g)}
    params = {"w_router": 2.0 * torch.randn(4, 4, generator=g), "w_expert": torch.randn(4, 4, 4, generator=g)}
    return feeds, params


def _moe_graph():
    """Capacity-limited top-1 (Switch / Mesh-TF) routing and a one-matmul expert layer, in the DSL."""
    x = md.input("x", [T, D])
    w_router, w_expert = md.param("w_router", [D, E]), md.param("w_expert", [E, D, H])
    probs = md.softmax(md.einsum("batch d_model, d_model experts -> batch experts", x, w_router), "experts")
    top_p, top_i = md.top_k(probs, "experts", 1, "top")
    gate, expert = md.squeeze(top_p, "top"), md.squeeze(top_i, "top")         # [batch]
    chosen = md.one_hot(expert, E, torch.int64)                                 # [batch, experts]
    # How many earlier tokens chose the same expert: this token's place in its expert's queue.
    position = md.reduce_sum(md.cumsum(chosen, "batch", exclusive=True) * chosen, "experts")
    kept = md.cast(md.less(position, C.size), torch.int64)                      # 0 past capacity
    dispatch = chosen * kept * md.one_hot(position, C, torch.int64)             # [batch, experts, capacity]
    mask = md.cast(dispatch, torch.float32)
    combine = mask * gate                                                       # carries the gradient
    expert_in = md.einsum("batch experts capacity, batch d_model -> experts capacity d_model", mask, x)
    expert_out = md.tanh(md.einsum("experts capacity d_model, experts d_model d_hidden -> "
                                   "experts capacity d_hidden", expert_in, w_expert))
    y = md.einsum("batch experts capacity, experts capacity d_hidden -> batch d_hidden", combine, expert_out)
    loss = md.reduce_sum(y * y)
    grads = md.grad(loss, {"x": x, "w_router": w_router, "w_expert": w_expert})
    return {"dispatch": dispatch, "combine": combine, "loss": loss, **{f"grad/{k}": v for k, v in grads.items()}}


def _moe_torch(x, w_router, w_expert, capacity):
    """The same layer in plain torch, the dispatch filled token by token."""
    probs = torch.softmax(x @ w_router, -1)
    gate, expert = probs.max(-1)
    dispatch = torch.zeros(x.shape[0], w_router.shape[1], capacity, dtype=torch.int64)
    filled = [0] * w_router.shape[1]
    for t, e in enumerate(expert.tolist()):
        if filled[e] < capacity:
            dispatch[t, e, filled[e]] = 1
        filled[e] += 1
    combine = dispatch.float() * gate[:, None, None]
    expert_in = torch.einsum("tec,td->ecd", dispatch.float(), x)
    y = torch.einsum("tec,ech->th", combine, torch.tanh(torch.einsum("ecd,edh->ech", expert_in, w_expert)))
    return dispatch, combine, (y * y).sum()


def _moe_reference():
    feeds, params = _moe_values()
    x = feeds["x"].clone().requires_grad_(True)
    wr, we = (params[k].clone().requires_grad_(True) for k in ("w_router", "w_expert"))
    dispatch, combine, loss = _moe_torch(x, wr, we, C.size)
    gx, gwr, gwe = torch.autograd.grad(loss, [x, wr, we])
    return {"dispatch": dispatch, "combine": combine.detach(), "loss": loss.detach(), "grad/x": gx,
            "grad/w_router": gwr, "grad/w_expert": gwe}


def test_moe_dispatch_in_the_dsl_matches_plain_torch():
    want = _moe_reference()
    kept = int(want["dispatch"].sum())
    assert 0 < kept < T.size, "the routing should drop some tokens and keep others"
    with md.Graph():
        outs = _moe_graph()
    feeds, params = _moe_values()
    got = md.run_dense(outs, feeds, params)
    assert got["dispatch"].dtype == torch.int64 and torch.equal(got["dispatch"], want["dispatch"])
    for k in ("combine", "loss", "grad/x", "grad/w_router", "grad/w_expert"):
        # fp32, O(1) values; the two programs sum in different orders.
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")
    assert float(got["grad/w_router"].abs().sum()) > 0  # the gate carries a gradient to the router


def _axes_of(layout: str, dim: str) -> tuple[str, ...]:
    """The axes a simple layout string (no scopes) gives ``dim``."""
    for rule in filter(None, (r.strip() for r in layout.split(";"))):
        name, axes = rule.split(":")
        if name.strip() == dim:
            return tuple(axes.strip("() ").split(","))
    return ()


MOE_LAYOUTS = {
    "x:4": ["batch:x", "experts:x", "batch:x; experts:x", "d_hidden:x; batch:x"],
    "x:2; y:2": ["batch:x", "batch:(x,y)", "batch:(y,x)", "batch:x; experts:y", "batch:y; experts:x",
                 "experts:(x,y)", "batch:x; experts:x", "batch:(x,y); experts:(y,x)",
                 "batch:x; capacity:y; d_hidden:y", "batch:y; experts:x; d_hidden:y", "batch:x; d_model:y"],
}


@pytest.mark.parametrize("mesh", sorted(MOE_LAYOUTS))
def test_moe_dispatch_on_layouts_that_split_batch_and_experts(mesh):
    with md.Graph():
        outs = _moe_graph()
    feeds, params = _moe_values()
    want = md.run_dense(outs, feeds, params)
    for layout in MOE_LAYOUTS[mesh]:
        plan = md.compile(outs, mesh, layout)
        batch_axes = _axes_of(layout, "batch")
        totals = [s for s, _ in plan.collectives() if s.note == "per-rank totals of 'batch'"]
        # The position count scans over the batch: where the batch is split it costs one allgather
        # of the totals, forward only (the counts are integers: no backward scan).  When batch and
        # experts want one axis, the [batch, experts] counts may take it for experts and scan whole.
        assert [s.axes for s in totals] in ([batch_axes], []), layout
        if batch_axes and not set(batch_axes) & set(_axes_of(layout, "experts")):
            assert len(totals) == 1, layout
        got = md.run_simulated(plan, feeds, params)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k: f"mesh='{mesh}' layout='{layout}' {k}: {m}")


def _moe_on_ranks(comm, layouts):
    """Child of the gloo test: the MoE layer's outputs on this rank, in full (rank 0 returns them)."""
    with md.Graph():
        outs = _moe_graph()
    feeds, params = _moe_values()
    results = []
    for layout in layouts:
        plan = md.compile(outs, comm.mesh, layout)
        ex = md.Executor(plan, comm)
        local = {k: ex.local_slices(plan.values[plan.params[k]], v) for k, v in params.items()}
        results.append({k: v.detach() for k, v in ex.full_outputs(ex.run(feeds, local)).items()})
    return results if comm.ranks[0] == 0 else None


def test_moe_dispatch_on_gloo_processes():
    # TorchComm runs the totals' allgather for real; the counts must be exact on every rank.
    layouts = ["batch:(x,y)", "batch:x; experts:y", "batch:y; experts:x; d_hidden:y"]
    results = spawn(_moe_on_ranks, 4, args=(layouts,), mesh="x:2; y:2", timeout=180)[0]
    with md.Graph():
        outs = _moe_graph()
    feeds, params = _moe_values()
    want = md.run_dense(outs, feeds, params)
    for layout, got in zip(layouts, results):
        assert torch.equal(got["dispatch"], want["dispatch"]), layout
        for k in want:
            # gloo's allreduce sums in its own order: fp32 rounding only.
            torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k: f"layout='{layout}' {k}: {m}")
