"""Coalescing FSDP's param gathers and a window's halos (lowering/coalesce.py): neighbours sent as one.

Under ``params.d_model:data`` every param is gathered before its reader: outside a loop all are
ready at the start, inside one a layer's are fed (and prefetched, runtime/prefetch.py) together,
so they go as one ``bucket_allgather`` where the plan's activation peak stays what the separate
gathers hold at once (runtime memory: lowering/memory.py).  A sliding window over a split ``seq``
sends its keys' and values' halo rows to the same neighbour, and their gradients back: one
``bucket_permute`` each way, a rank without a sender getting nothing, as a permute's does.  The
numbers are the dense program's, and bit for bit those of the separate collectives (the same
elements moved), on the simulated mesh and (``-m slow``) on two gloo processes.

Legend: b batch, s seq (split for the window), k key_seq, h heads, e d_head, d d_model (split for
FSDP), f d_ff, L layer.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import pytest
import torch

import meshdsl as md
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.layout.mesh import Mesh
from meshdsl.lowering import coalesce, compiler
from meshdsl.lowering.coalesce import PACKED
from meshdsl.lowering.memory import memory_report
from meshdsl.lowering.plan import step_args
from meshdsl.processes import launcher as launch
from meshdsl.runtime.executor import Executor
from meshdsl.runtime.prefetch import prefetchable

FSDP = ("data:2", "batch:data; params.d_model:data")
WINDOW = ("model:3", "seq:model; key_seq:model")
UNPACKED = {v: k for k, v in PACKED.items()}


def _mlp(num_layers: int = 0, d: int = 8, f: int = 16, batch: int = 4, grads: bool = True) -> dict:
    """``x @ w_in -> relu -> @ w_out`` scaled by ``g`` (every param split over d_model under FSDP),
    once or as the block of ``num_layers`` layers; the loss and, with ``grads``, its gradients."""
    b, dd, ff = md.Dim("batch", batch), md.Dim("d_model", d), md.Dim("d_ff", f)
    with md.Graph():
        x = md.input("x", [b, dd])
        lead = [md.Dim("layer", num_layers)] if num_layers else []
        p = {"w_in": md.param("w_in", [*lead, dd, ff]), "w_out": md.param("w_out", [*lead, ff, dd]),
             "g": md.param("g", [*lead, dd])}

        def block(h_bd, q):
            h_bf = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h_bd, q["w_in"]))
            return md.einsum("batch d_ff, d_ff d_model -> batch d_model", h_bf, q["w_out"]) * q["g"] + h_bd

        y = md.repeat(block, x, p, lead[0]) if num_layers else block(x, p)
        loss = md.reduce_sum(y * y)
        return {"loss": loss, **({f"d/{k}": t for k, t in md.grad(loss, p).items()} if grads else {"y": y})}


def _window(n: int = 12) -> dict:
    """Causal window-3 attention of ``x`` to its scaled copies (keys and values) over ``seq``."""
    b, s, h, e = md.Dim("batch", 2), md.Dim("seq", n), md.Dim("heads", 2), md.Dim("d_head", 4)
    with md.Graph():
        x = md.input("x", [b, s, h, e])
        p = {"wk": md.param("wk", [h, e]), "wv": md.param("wv", [h, e])}
        k, v = md.rename(x * p["wk"], seq="key_seq"), md.rename(x * p["wv"], seq="key_seq")
        y = md.attention(x, k, v, "seq", "key_seq", "d_head", window=3)
        loss = md.reduce_sum(md.tanh(y))
        return {"loss": loss, **{f"d/{k}": t for k, t in md.grad(loss, p).items()}}


def _feeds(shape) -> dict:
    return {"x": torch.randn(*shape, generator=torch.Generator().manual_seed(3))}


def _separate(plan):
    """``plan`` with each packed step sent as its members again (sub-plans included)."""
    steps = []
    for s in plan.steps:
        if s.kind in UNPACKED and not s.kind.startswith("bucket_reduce"):
            kind, dims = UNPACKED[s.kind], s.args.get("dims") or (None,) * len(s.ins)
            for i, o, dim in zip(s.ins, s.outs, dims):
                args = {**{k: v for k, v in s.args.items() if k != "dims"}, **({"dim": dim} if dim is not None else {})}
                steps.append(replace(s, kind=kind, ins=(i,), outs=(o,), args=step_args(kind, args),
                                     bytes=plan.values[i].local_bytes(plan.mesh)))
        else:
            steps.append(replace(s, subplans=tuple(_separate(sub) for sub in s.subplans)))
    return replace(plan, steps=tuple(steps))


def _sent(plan, kinds=("allgather", "bucket_allgather")) -> list[tuple[str, str, int]]:
    """(kind, phase, members) of every collective of ``kinds``, once each (sub-plans included)."""
    return sorted((s.kind, s.phase, len(s.ins)) for s, _ in plan.walk() if s.kind in kinds)


def _assert_dense(got: dict, want: dict) -> None:
    for k in want:
        # fp32 sums in another order than the dense einsums (a split d_model summed in halves,
        # softmax over halo rows): ~1e-7 relative; a member cut at the wrong place is O(1) off
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5 * max(1.0, float(want[k].abs().max())),
                                   msg=lambda m, k=k: f"{k}: {m}")


def _assert_bitwise(got: dict, want: dict) -> None:
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: packed and separate collectives differ"


def _peak(plan) -> int:
    return memory_report(plan)["activations_peak"]


def _unpacked_peak(outs: dict, monkeypatch) -> int:
    """The activations' peak of ``outs``' plan under FSDP compiled with no collective packed."""
    with monkeypatch.context() as m:
        m.setattr(coalesce, "_member", lambda *args: False)
        m.setattr(compiler, "_CACHE", OrderedDict())
        return _peak(md.compile(outs, *FSDP))


def test_fsdp_gathers_of_the_params_outside_a_loop_go_as_one(monkeypatch):
    outs = _mlp()
    plan = md.compile(outs, *FSDP)
    # was 3 allgathers, one a param: all ready at the start, so one buffer
    assert _sent(plan) == [("bucket_allgather", "forward", 3)], plan.totals()
    assert _peak(plan) <= _unpacked_peak(outs, monkeypatch)
    feeds = _feeds((4, 8))
    got = md.run_simulated(plan, feeds)
    _assert_dense(got, md.run_dense(outs, feeds))
    _assert_bitwise(got, md.run_simulated(_separate(plan), feeds))


class _Async(SimulatedComm):
    """Starts gathers, packed or not, as TorchComm does (so a loop prefetches them)."""

    async_kinds = frozenset({"allgather", "bucket_allgather"})


def test_a_layers_param_gathers_go_as_one_and_the_loop_prefetches_it(monkeypatch):
    outs = _mlp(num_layers=2)
    plan = md.compile(outs, *FSDP)
    forward = next(s for s in plan.steps if s.kind == "repeat" and not s.args["backward"]).subplans[0]
    (i, names, _), = prefetchable(Executor(forward, _Async(plan.mesh)))   # one start: the layer's params
    assert forward.steps[i].kind == "bucket_allgather" and sorted(names) == ["g", "w_in", "w_out"]
    # the block's own peak rises by what the plan's (the backward's) leaves above it, no more
    assert _peak(plan) <= _unpacked_peak(outs, monkeypatch)
    feeds = _feeds((4, 8))
    got = md.run_simulated(plan, feeds)
    _assert_dense(got, md.run_dense(outs, feeds))
    _assert_bitwise(got, md.run_simulated(_separate(plan), feeds))


def test_a_packed_gather_never_raises_the_peak(monkeypatch):
    """Forward only, weights 16 times the activations: each gathered weight is freed after its
    reader; packed with the first, the later ones would be held from the start (the three in one
    buffer: twice the peak), so no two are."""
    outs = _mlp(d=64, f=64, batch=2, grads=False)
    plan = md.compile(outs, *FSDP)
    assert _sent(plan) == [("allgather", "forward", 1)] * 3, plan.totals()
    assert _peak(plan) <= _unpacked_peak(outs, monkeypatch)
    feeds = _feeds((2, 64))
    _assert_dense(md.run_simulated(plan, feeds), md.run_dense(outs, feeds))


def test_a_windows_key_and_value_halos_go_as_one_each_way():
    outs = _window()
    plan = md.compile(outs, *WINDOW)
    kinds = ("permute", "bucket_permute")
    # k's and v's 2 rows to the next rank; dk's and dv's folded back to the rank before
    assert _sent(plan, kinds) == [("bucket_permute", "backward", 2), ("bucket_permute", "forward", 2)]
    assert [s.args["offset"] for s, _ in plan.walk() if s.kind in kinds] == [1, -1]
    feeds = _feeds((2, 12, 2, 4))
    got = md.run_simulated(plan, feeds)   # (rank 0 gets no rows forward, rank 2 none backward)
    _assert_dense(got, md.run_dense(outs, feeds))
    _assert_bitwise(got, md.run_simulated(_separate(plan), feeds))


def _on_ranks(comm):
    """Child side: the window's plan run packed and separate on real ranks."""
    torch.set_num_threads(1)
    plan = md.compile(_window(8), "model:2", WINDOW[1])
    got = []
    for p in (plan, _separate(plan)):
        ex = Executor(p, comm)
        got.append(ex.full_outputs(ex.run(_feeds((2, 8, 2, 4)), ex.init_params(0))))
    return got, _sent(plan, ("permute", "bucket_permute"))


@pytest.mark.slow   # by default: the packing, unpacking and a sender-less rank's None on the simulated mesh in
# test_a_windows_key_and_value_halos_go_as_one_each_way (gloo runs the flat buffer through the permute's own code)
@pytest.mark.timeout(120)
def test_packed_halos_on_two_gloo_processes_are_the_separate_ones_bitwise():
    results = launch.spawn(_on_ranks, 2, mesh=Mesh.parse("model:2"), timeout=100)
    want = md.run_dense(_window(8), _feeds((2, 8, 2, 4)))
    for (packed, separate), sent in results:
        assert sent == [("bucket_permute", "backward", 2), ("bucket_permute", "forward", 2)]
        _assert_bitwise(packed, separate)
        _assert_dense(packed, want)
