"""Property test, in the spirit of JAX's shard_map tests: for a random small graph
(a few op kinds chained), a random mesh shape and a random layout of the graph's
dims, the simulated mesh gives the dense program's outputs and gradients.

Hypothesis draws the program and the layout from a fixed seed (``derandomize``),
so a failure is reproducible; its falsifying example prints the ops, the mesh
and the layout string.  The loss and gradients come from
:func:`conftest.build_case` (outputs weighed by fixed random weights).
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import meshdsl as md
from conftest import MESHES, axis_tuples, build_case, check_plan, layout_string, mesh_axes

# Dims by name; a rename only swaps names of equal size, so a name has one size.
POOL = {"i": 4, "j": 8, "k": 4, "m": 8}
SAME_SIZE = {n: [o for o, s in POOL.items() if s == POOL[n] and o != n] for n in POOL}
KINDS = ("unary", "binary", "einsum", "reduce", "transpose", "rename", "shift", "softmax", "norm", "dropout",
         "pad_slice", "where")
UNARY = {"tanh": md.tanh, "sigmoid": md.sigmoid, "relu": md.relu, "gelu": md.gelu,
         "exp_tanh": lambda x: md.exp(md.tanh(x)), "square": lambda x: x * x}
BINARY = {"add": md.add, "sub": md.sub, "mul": md.mul, "maximum": md.maximum}


def _program(data, log):
    """Draw and build a small program in the active graph; returns every op's result."""
    draw = data.draw
    tensors = []
    for n in range(draw(st.integers(1, 2), label="num_leaves")):
        names = draw(st.lists(st.sampled_from(sorted(POOL)), min_size=1, max_size=3, unique=True), label="leaf dims")
        tensors.append(md.param(f"p{n}", [md.Dim(d, POOL[d]) for d in names], scale=1.0))
        log.append(f"p{n} = param({names})")
    for step in range(draw(st.integers(2, 5), label="num_ops")):
        kind = draw(st.sampled_from(KINDS), label="op")
        x = draw(st.sampled_from(tensors), label="x")
        names = list(x.shape.names)
        if kind in ("reduce", "transpose", "shift", "softmax", "rename", "norm", "pad_slice") and not names:
            kind = "unary"
        if kind == "unary":
            fn = draw(st.sampled_from(sorted(UNARY)))
            y, what = UNARY[fn](x), f"{fn}({x.name})"
        elif kind == "binary":
            other = draw(st.sampled_from(tensors))
            fn = draw(st.sampled_from(sorted(BINARY)))
            y, what = BINARY[fn](x, other), f"{fn}({x.name}, {other.name})"
        elif kind == "einsum":
            other = draw(st.sampled_from(tensors))
            if other is x:
                other = md.tanh(x)
            shared = [n for n in names if n in other.shape]
            summed = draw(st.lists(st.sampled_from(shared), unique=True), label="summed") if shared else []
            out = [n for n in names + list(other.shape.names) if n not in summed]
            out = list(dict.fromkeys(out))
            eq = f"{' '.join(names)}, {' '.join(other.shape.names)} -> {' '.join(out)}"
            y, what = md.einsum(eq, x, other), f"einsum('{eq}')"
        elif kind == "reduce":
            dims = draw(st.lists(st.sampled_from(names), min_size=1, unique=True), label="reduced")
            fn = draw(st.sampled_from(["reduce_sum", "reduce_max", "logsumexp", "reduce_mean"]))
            y, what = getattr(md, fn)(x, dims), f"{fn}({x.name}, {dims})"
        elif kind == "transpose":
            perm = draw(st.permutations(names))
            y, what = md.transpose(x, perm), f"transpose({x.name}, {perm})"
        elif kind == "rename":
            d = draw(st.sampled_from(names))
            free = [o for o in SAME_SIZE[d] if o not in names]
            if not free:
                y, what = md.neg(x), f"neg({x.name})"
            else:
                to = draw(st.sampled_from(free))
                y, what = md.rename(x, {d: to}), f"rename({x.name}, {d}->{to})"
        elif kind == "shift":
            d = draw(st.sampled_from(names))
            k = draw(st.integers(-5, 5))
            wrap = draw(st.booleans())
            y, what = md.shift(x, d, k, wrap=wrap), f"shift({x.name}, {d}, {k}, wrap={wrap})"
        elif kind == "softmax":
            d = draw(st.sampled_from(names))
            y, what = md.softmax(x, d), f"softmax({x.name}, {d})"
        elif kind == "norm":
            d = draw(st.sampled_from(names))
            fn = draw(st.sampled_from([md.layer_norm, md.rms_norm]))
            y, what = fn(x, d), f"{fn.__name__}({x.name}, {d})"
        elif kind == "dropout":
            rate, seed = draw(st.sampled_from([0.25, 0.5])), draw(st.integers(0, 3))
            y, what = md.dropout(x, rate, seed), f"dropout({x.name}, {rate}, seed={seed})"
        elif kind == "pad_slice":
            # Same size afterwards, so the name keeps one size; needs the dim whole in between.
            d = draw(st.sampled_from(names))
            total = draw(st.sampled_from([2, 4, 8]))  # even, so the padded dim may still split
            before = draw(st.integers(0, total))
            after = total - before
            start = draw(st.integers(0, total))
            y = md.slice_(md.pad(x, d, before, after), d, start, start + POOL[d])
            what = f"slice(pad({x.name}, {d}, {before}, {after}), {start})"
        else:
            other = draw(st.sampled_from(tensors))
            y, what = md.where(md.greater(x, other), x, other * 0.5), f"where({x.name} > {other.name}, ...)"
        log.append(f"{y.name} = {what}")
        tensors.append(y)
    results = [t for t in tensors if t.node.op.name != "param"] or tensors[-1:]
    return {f"t{i}": t for i, t in enumerate(dict.fromkeys(results))}


def _layout(data, sizes, leaves, mesh):
    """A random layout of every dim, repaired so no param has two dims on one axis.

    Unsplit is listed last, so Hypothesis' simplest choice still splits.
    """
    axes = mesh_axes(mesh)
    assign = {}
    for d in sorted(sizes):
        opts = [t for t in axis_tuples(axes)[1:] + [()]
                if all(s % md.Mesh.parse(mesh).axis_size(t) == 0 for s in sizes[d])]
        assign[d] = data.draw(st.sampled_from(opts), label=f"axes of {d}")
    for names in leaves:  # drop a repeated axis from the later dim (still divisible)
        seen: set = set()
        for n in names:
            assign[n] = tuple(a for a in assign.get(n, ()) if a not in seen)
            seen.update(assign[n])
    return layout_string(assign)


@settings(derandomize=True, deadline=None, max_examples=200,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), mesh=st.sampled_from(list(MESHES.values())))
def test_random_program_matches_dense(data, mesh):
    log: list[str] = []
    case = build_case(lambda: (_program(data, log), {}))
    layout = _layout(data, case.sizes, case.leaves, mesh)
    note("\n".join(log))
    note(f"mesh='{mesh}' layout='{layout}'")
    check_plan(case, mesh, layout)
