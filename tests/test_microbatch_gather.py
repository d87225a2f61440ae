"""A value cut over the micro-batches put back into one tensor (comm/microbatch.py, comm/real_parts.py).

Under ``microbatches=m`` the examples' dim is split over the virtual axis ``_mb`` first, so an
output holding ``batch`` (per-example logits), a per-example gradient or param is gathered over
``_mb`` at the end.  The simulated mesh refused that gather ("a real rank ... folds only sums")
and :class:`MicrobatchComm` raised: a real rank holding all its micro-batches now joins them
locally, in the simulated mesh's group order, and the rows come back in the dense order.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.comm.microbatch import MicrobatchComm
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.layout.mesh import Mesh
from meshdsl.lowering.pipeline import MB_AXIS

X = torch.arange(24.0).reshape(8, 3) / 24


def _per_example():
    """A 2-layer stack whose per-example result ``y`` [batch, d_model] is an output beside the loss."""
    b, d, layer = md.Dim("batch", 8), md.Dim("d_model", 3), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, d])
        w = md.param("w", [layer, d, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])

        def block(h, p):
            return md.tanh(md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]),
                                     d_out="d_model"))

        y = md.repeat(block, x, {"w": w}, "layer")
        loss = md.reduce_sum(y ** 2)
        return {"loss": loss, "y": y, **md.grad(loss, {"w": w})}


@pytest.mark.parametrize("mesh, layout", [
    ("stage:2", "layer:stage"),                         # a pipeline: y on the last stage
    ("data:1", ""),                                     # plain gradient accumulation
    ("stage:2; data:2", "layer:stage; batch:data"),     # gathered over (_mb, data)
])
def test_a_per_example_output_of_a_micro_batched_plan_matches_dense(mesh, layout):
    outs = _per_example()
    got = md.run_simulated(md.compile(outs, mesh, layout, microbatches=2), {"x": X})
    want = md.run_dense(outs, {"x": X})
    for k in want:   # float32 default tolerances; a misplaced micro-batch moves whole rows
        torch.testing.assert_close(got[k], want[k])


class _TwoRankReal:
    """A real communicator holding rank 0 of ``data:2``; the other rank's part is its own + 100."""

    def __init__(self):
        self.ranks, self.async_kinds, self.device = (0,), (), torch.device("cpu")

    def collective(self, kind, xs, axes, args):
        assert kind == "allgather" and tuple(axes) == ("data",)
        return [torch.cat([xs[0], xs[0] + 100], dim=args["dim"])]


@pytest.mark.parametrize("axes", [(MB_AXIS, "data"), ("data", MB_AXIS)])
def test_a_real_rank_joins_its_micro_batches_in_the_simulated_group_order(axes):
    mesh = Mesh((("data", 2), (MB_AXIS, 2)))
    parts = [torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]])]   # micro-batches 0 and 1 of data 0
    want = SimulatedComm(mesh).collective("allgather", parts + [p + 100 for p in parts], axes, {"dim": 0})[0]
    got = MicrobatchComm(_TwoRankReal(), mesh).collective("allgather", parts, axes, {"dim": 0})
    assert len(got) == 2
    for g in got:
        assert torch.equal(g, want), (g.flatten(), want.flatten())


def _gathered_on_real_ranks(rank):
    from meshdsl.comm.distributed import TorchComm
    from meshdsl.comm.microbatch import for_plan
    torch.set_num_threads(1)
    comm = TorchComm("data:2")
    plan = md.compile(_per_example(), "data:2", "batch:data", microbatches=2)
    ex = md.Executor(plan, for_plan(comm, plan))
    out = ex.full_outputs(ex.run({"x": X}))
    comm.drain()
    return out["y"]


@pytest.mark.slow   # ~2 s: two gloo processes (the unit test above checks the join's order)
@pytest.mark.timeout(120)
def test_a_per_example_output_gathers_on_two_processes_as_dense():
    from meshdsl.processes import launcher as launch
    want = md.run_dense(_per_example(), {"x": X})["y"]
    for y in launch.spawn(_gathered_on_real_ranks, 2, timeout=100):
        torch.testing.assert_close(y, want)
