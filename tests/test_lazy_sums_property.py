"""Property test of lazy partial sums: a base value feeds random branches (Megatron-split
MLPs that end in partial sums, whole elementwise maps, the base itself), their results
are added and subtracted in a random order and read by a random consumer.  Under a
random mesh and a random layout of every dim, the simulated mesh gives the dense
program's outputs and gradients; under the pure Megatron layout (``d_ff`` split, nothing
else) the sum is reduced once forward and the base's cotangent once backward, however
many branches and in whatever order they are added.

Dims: b batch, d d_model, f d_ff, i d_in.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import meshdsl as md
from conftest import MESHES, build_case, check_plan, layout_string, mesh_axes

SIZES = {"batch": 4, "d_in": 4, "d_model": 8, "d_ff": 8}
BRANCHES = ("split_mlp", "split_mlp", "tanh", "base", "scaled_split")
# Consumers that need the whole sum (square, softmax), keep it partial (project) or are the
# loss's own weighting (none).  A softmax rather than a norm: branches such as h - tanh(h)
# may nearly cancel, and a norm would amplify that fp32 cancellation past the tolerance
# in the dense program as much as on the mesh.
CONSUMERS = ("square", "project", "softmax", "none")


def _program(data, log):
    """Draw and build the program in the active graph; returns its outputs."""
    draw = data.draw
    b, i, d, f = (md.Dim(n, SIZES[n]) for n in ("batch", "d_in", "d_model", "d_ff"))
    x_bi = md.param("x", [b, i], scale=1.0)
    h_bd = md.einsum("batch d_in, d_in d_model -> batch d_model", x_bi, md.param("w0", [i, d]))
    terms = []
    for k in range(draw(st.integers(2, 4), label="num_branches")):
        kind = draw(st.sampled_from(BRANCHES), label="branch")
        if kind in ("split_mlp", "scaled_split"):
            u_bf = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h_bd, md.param(f"w{k}a", [d, f])))
            t_bd = md.einsum("batch d_ff, d_ff d_model -> batch d_model", u_bf, md.param(f"w{k}b", [f, d]))
            if kind == "scaled_split":
                t_bd = t_bd * 0.5
        elif kind == "tanh":
            t_bd = md.tanh(h_bd)
        else:
            t_bd = h_bd
        terms.append((kind, t_bd))
    order = draw(st.permutations(range(len(terms))), label="order")
    signs = draw(st.lists(st.booleans(), min_size=len(terms) - 1, max_size=len(terms) - 1), label="subtract")
    y_bd = terms[order[0]][1]
    for j, neg in zip(order[1:], signs):
        y_bd = y_bd - terms[j][1] if neg else y_bd + terms[j][1]
    consumer = draw(st.sampled_from(CONSUMERS), label="consumer")
    if consumer == "square":
        y_bd = y_bd * y_bd
    elif consumer == "project":
        y_bd = md.einsum("batch d_model, d_model d_ff -> batch d_ff", y_bd, md.param("w_out", [d, f]))
    elif consumer == "softmax":
        y_bd = md.softmax(y_bd, "d_model")
    log.append(f"branches {[terms[j][0] for j in order]}, subtract {signs}, consumer {consumer}")
    return {"y": y_bd}, [t[0] for t in terms], consumer


def _allreduces(plan, phase):
    return sum(m for s, m in plan.collectives() if s.kind == "allreduce" and s.phase == phase)


@settings(derandomize=True, deadline=None, max_examples=60,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), mesh=st.sampled_from(list(MESHES.values())))
def test_random_sums_of_partial_branches_match_dense(data, mesh):
    log: list[str] = []
    drawn = {}

    def build():
        outs, drawn["kinds"], drawn["consumer"] = _program(data, log)
        return outs, {}

    case = build_case(build)
    axes = list(mesh_axes(mesh))
    assign = {}
    for dim in sorted(case.sizes):  # d_ff only when some branch is an MLP
        assign[dim] = tuple(data.draw(st.lists(st.sampled_from(axes), unique=True, max_size=2), label=f"axes of {dim}"))
    for names in case.leaves:  # a param puts an axis on one of its dims only
        seen: set = set()
        for n in names:
            assign[n] = tuple(a for a in assign.get(n, ()) if a not in seen)
            seen.update(assign[n])
    layout = layout_string(assign)
    note("\n".join(log))
    note(f"mesh='{mesh}' layout='{layout}'")
    check_plan(case, mesh, layout)

    # Pure Megatron: only the split MLPs' sums are partial, and they are added before any
    # reduction.  (A projection onto d_ff makes y's cotangent partial too, and the split
    # MLPs' backward needs it whole: a second allreduce that is not the sums' doing.)
    if any(k in ("split_mlp", "scaled_split") for k in drawn["kinds"]) and drawn["consumer"] != "project":
        plan = md.compile(case.outputs, "x:2", "d_ff:x", bucket_mb=0)
        assert _allreduces(plan, "forward") == 1
        assert _allreduces(plan, "backward") == 1  # the cotangent of h, before w0's gradient
