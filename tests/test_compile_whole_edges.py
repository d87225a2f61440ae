"""Whole-step ``--compile`` edges met training held-out models.

A windowed ``md.attention`` compiles as one whole-step graph: its mask was built with an in-place ``&=`` (``aten::__iand__``), which torch.compile's
functionalization refuses: the whole step fell back to compiled segments with a notice
(a Gemma-3-style model under ``meshdsl train --compile``).  A feed with gaps between its rows
(``ids = t[:, :-1]``, as a model's own ``feeds`` slices a token stream) was traced on a contiguous
``clone()``, so the real call raised "view size is not compatible" (a Mistral-style model).  As in tests/test_compile_whole.py
the step compiles with ``aot_eager``: torch's own kernels in the eager order, bitwise equal.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md


def _windowed_attention_plan():
    b, s, k, e = md.Dim("batch", 2), md.Dim("seq", 6), md.Dim("key_seq", 6), md.Dim("d_head", 4)
    with md.Graph("window_mask"):
        x = md.input("x", [b, s, e])
        wq = md.param("wq", [e, md.Dim("d2", 4)])
        q = md.rename(md.einsum("batch seq d_head, d_head d2 -> batch seq d2", x, wq), {"d2": "d_head"})
        kv = md.rename(x, {"seq": "key_seq"})
        y = md.attention(q, kv, kv, "seq", "key_seq", "d_head", causal=True, window=3)
        loss = md.reduce_mean(y * y)
    return md.compile({"loss": loss, **md.grad(loss, {"grad/wq": wq})}, "data:1", ""), k


@pytest.mark.parametrize("gaps", [False, True], ids=["contiguous_feed", "feed_with_gaps"])
def test_a_windowed_attention_step_compiles_whole_with_the_eager_numbers(gaps):
    plan, _ = _windowed_attention_plan()
    comm = md.SimulatedComm(plan.mesh)
    eager, compiled = md.Executor(plan, comm), md.Executor(plan, comm, compile="aot_eager")
    params = eager.init_params(0)
    x = torch.randn(2, 7 if gaps else 6, 4, generator=torch.Generator().manual_seed(0))
    feeds = {"x": x[:, :-1] if gaps else x}     # [2, 6, 4], rows 28 apart: not contiguous
    assert feeds["x"].is_contiguous() is not gaps
    got, want = compiled.run(feeds, params), eager.run(feeds, params)
    for name in want:
        torch.testing.assert_close(got[name][0], want[name][0], rtol=0, atol=0)
    stats = compiled.compiling.stats
    assert (stats.whole, stats.segments, stats.fallbacks) == (1, 0, []), stats.summary()
