"""A flat fused qkv weight ``c_attn [d_model, (qkv heads d_head)]`` (GPT-2 / nanoGPT) under
``heads:model``: the implied rule splits the flat dim block-cyclically (lowering/cyclic_dims.py),
so the block runs as Megatron's column- and row-parallel pair, with the collectives of the same
block written with separate per-dim q, k, v weights, and the numbers of the dense program.

Legend: b batch, s seq, k key_seq, d d_model, h heads, e d_head, f d_ff, F = (qkv heads d_head),
l layer.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from conftest import assert_matches_scaled
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.train.checkpoint import load_checkpoint, save_checkpoint

# fp32 through two blocks of matmuls, a softmax and an MLP, values up to ~200: the split program sums
# the heads' and d_ff's partial products in another order than the dense one (rounding ~1e-6 of
# each output's largest magnitude); a lost, doubled or misplaced block is off by O(1) of it
REL = 1e-5


def _block(x, w, heads: int, flat, bounds=None):
    """One pre-LN-less GPT-2 block on ``x [b s d]``: causal attention from c_attn (``flat``: one
    ``[d, F]`` weight and ``[F]`` bias, rearranged, or ``"sliced"``: sliced at ``bounds``, each
    slice rearranged; else per-dim q, k, v weights), c_proj from the flat ``(heads d_head)``, and
    a d_ff MLP."""
    if flat == "sliced":   # nanoGPT: q, k, v = qkv.split(n_embd, dim=2), each viewed as heads
        qkv_bsF = md.einsum("batch seq d_model, d_model F -> batch seq F", x, w["c_attn"]) + w["c_attn_b"]
        n = qkv_bsF.shape.get("F").size // 3
        q, k, v = (md.rearrange(md.slice_(qkv_bsF, "F", a, a + n), "batch seq (heads d_head) -> batch seq heads d_head",
                                heads=heads)
                   for a in bounds or (0, n, 2 * n))
    elif flat:
        qkv_bsF = md.einsum("batch seq d_model, d_model F -> batch seq F", x, w["c_attn"]) + w["c_attn_b"]
        qkv = md.rearrange(qkv_bsF, "batch seq (qkv heads d_head) -> qkv batch seq heads d_head", qkv=3, heads=heads)
        q, k, v = (md.squeeze(md.slice_(qkv, "qkv", i, i + 1), "qkv") for i in range(3))
    else:
        q, k, v = (md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, w[n]) + w[n + "_b"]
                   for n in ("wq", "wk", "wv"))
    k, v = (md.rename(t, {"seq": "key_seq"}) for t in (k, v))
    s_q, s_k = q.shape.get("seq"), k.shape.get("key_seq")
    sc = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
    att = md.softmax(md.where(md.causal_mask(s_q, s_k), sc * 0.5, -1e9), "key_seq")
    o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
    o_flat = md.rearrange(o, "batch seq heads d_head -> batch seq (heads d_head)")
    x = x + md.einsum("batch seq heads_d_head, heads_d_head d_model -> batch seq d_model", o_flat, w["c_proj"])
    u = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", x, w["c_fc"]))
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, w["c_fc_proj"])


def _params(heads: int, flat: bool, layers: int | None):
    d, h, e, f = md.Dim("d_model", 4), md.Dim("heads", heads), md.Dim("d_head", 2), md.Dim("d_ff", 6)
    lead = [md.Dim("layer", layers)] if layers else []
    big_f = md.Dim("F", 3 * heads * 2)
    shapes = {"c_proj": [md.Dim("heads_d_head", heads * 2), d], "c_fc": [d, f], "c_fc_proj": [f, d]}
    if flat:
        shapes.update(c_attn=[d, big_f], c_attn_b=[big_f])
    else:
        shapes.update({n: [d, h, e] for n in ("wq", "wk", "wv")}, **{n + "_b": [h, e] for n in ("wq", "wk", "wv")})
    return {n: md.param(n, lead + s, scale=0.5) for n, s in shapes.items()}


def _model(heads: int, flat, layers: int | None = None, bounds=None):
    """``(outputs, feeds, params)``: the loss ``sum(y * y)`` of one block (or ``layers`` of them in
    a ``md.repeat``) and its gradient for every param, in a fresh graph."""
    torch.manual_seed(0)
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("seq", 3), md.Dim("d_model", 4)])
        p = _params(heads, flat, layers)
        if layers:
            y = md.repeat(lambda h, w: _block(h, w, heads, flat, bounds), x, p, "layer")
        else:
            y = _block(x, p, heads, flat, bounds)
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, p).items()}}
    return outs, {"x": torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))}, p


def _collectives(plan) -> dict:
    return {k: (t["count"], t["bytes"]) for k, t in plan.totals().items()}


CASES = [("model:2", "heads:model", 2), ("model:2", "heads:model; d_ff:model", 2),
         ("model:3", "heads:model", 6), ("model:3", "heads:model; d_ff:model", 6)]


@pytest.mark.parametrize("layers", [None, 2], ids=["block", "repeat"])
@pytest.mark.parametrize("mesh,layout,heads", CASES, ids=[f"{m}|{l}" for m, l, _ in CASES])
def test_a_flat_c_attn_runs_megatron_with_the_dense_numbers(mesh, layout, heads, layers):
    outs, feeds, _ = _model(heads, True, layers)
    plan = md.compile(outs, mesh, layout)
    assert plan.values[plan.params["c_attn"]].sharding.cyclic_blocks == {"F": 3}
    assert plan.values[plan.params["c_attn_b"]].sharding.cyclic_blocks == {"F": 3}
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), f"{mesh} {layout}", REL)
    sep, _, _ = _model(heads, False, layers)
    assert _collectives(plan) == _collectives(md.compile(sep, mesh, layout))


def _step(outs, params, mesh):
    mesh = md.Mesh.parse(mesh) if mesh else md.Mesh(())
    layout = "heads:model" if "model" in mesh.names else None
    return md.TrainStep(outs["loss"], params, mesh, layout, SimulatedComm(mesh), optimizer=md.SGD(lr=0.01))


def _full(step, k):
    return step.executor.to_full_held(step.plan.params[k], step.params[k])


def test_a_flat_c_attn_saved_on_model_2_loads_on_data_1(tmp_path, one_torch_thread):
    """Two SGD steps with c_attn stored block-cyclically (each rank its 3 blocks) give the dense
    params; the checkpoint loads into a one-rank step, which holds the same whole tensors and goes
    on alike (a misplaced block would put another head's rows there).  (SGD, not AdamW: the keys'
    bias has a zero gradient, softmax's shift, whose rounding noise AdamW would scale to lr.)"""
    outs, feeds, params = _model(2, True)
    split, dense = _step(outs, params, "model:2"), _step(outs, params, "")
    assert split.plan.values[split.plan.params["c_attn"]].sharding.cyclic_blocks == {"F": 3}
    for _ in range(2):
        assert split(feeds)[0] == pytest.approx(dense(feeds)[0], rel=REL)
    for k in params:
        assert_matches_scaled({k: _full(split, k)}, {k: _full(dense, k)}, "after 2 SGD steps", REL)
    path = save_checkpoint(tmp_path, 2, split.state(), split.executor.comm)
    loaded = _step(outs, params, "data:1")
    state = loaded.state()
    loaded.load_state(load_checkpoint(path, {k: spec for k, (spec, _) in state.items()}, loaded.plan.mesh,
                                      loaded.executor.comm.ranks))
    for k in split.carried:
        assert torch.equal(_full(loaded, k), _full(split, k)), k
    assert loaded(feeds)[0] == pytest.approx(split(feeds)[0], rel=REL)


def test_collectives_into_the_block_cyclic_dim_keep_its_blocks_in_order():
    """Under ``batch:model; heads:model`` (batch's rule first) the gradients of the flat product
    come split by batch: the bias's sum is reduce-scattered into its blocks and the weight's
    einsum reads them through an alltoall cutting F; each first puts F in the ranks' joined order
    (lowering/cyclic_moves.py), else rank 0 would get heads of rank 1's q."""
    outs, feeds, _ = _model(2, True)
    plan = md.compile(outs, "model:2", "batch:model; heads:model")
    into = [(s.kind, prev.op) for prev, s in zip(plan.steps, plan.steps[1:])
            if s.is_collective and "F" in plan.values[s.outs[0]].sharding.cyclic_blocks]
    assert sorted(into) == [("alltoall", "reorder"), ("reduce_scatter", "reorder")]
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "batch:model; heads:model", REL)


@pytest.mark.parametrize("sliced", [False, True], ids=["rearranged", "also-sliced"])
def test_a_flat_dim_read_by_position_stays_whole(sliced):
    """Where an op reads the flat dim by position (a slice of it, as nanoGPT's ``split(n_embd)``
    would be) a rank's blocks would be the wrong rows: no block-cyclic rule, the weight is whole
    and the plan notes why (the same graph without the slice is block-cyclic)."""
    torch.manual_seed(0)
    with md.Graph():
        x = md.param("x", [md.Dim("batch", 2), md.Dim("d_model", 4)], scale=1.0)
        w = md.param("w", [md.Dim("d_model", 4), md.Dim("F", 12)], scale=1.0)
        flat = md.einsum("batch d_model, d_model F -> batch F", x, w)
        qkv = md.rearrange(flat, "batch (qkv heads d_head) -> batch qkv heads d_head", qkv=3, heads=2)
        q, k, v = (md.squeeze(md.slice_(qkv, "qkv", i, i + 1), "qkv") for i in range(3))
        loss = md.reduce_sum(q * k * v)
        if sliced:
            loss = loss + md.reduce_sum(md.slice_(flat, "F", 0, 5) ** 2)
        outs = {"loss": loss, **{f"grad/{n}": g for n, g in zip("xw", md.grad(loss, [x, w]))}}
    plan = md.compile(outs, "model:2", "heads:model")
    assert plan.values[plan.params["w"]].sharding.split == ({} if sliced else {"F": ("model",)})
    assert any("is an inner part of 'F'" in n for n in plan.notes) == sliced
    # fp32 products of O(1) terms; the loss and grad/x sum over the ranks' heads in another order
    assert_matches_scaled(md.run_simulated(plan, {}), md.run_dense(outs, {}), f"sliced={sliced}", REL)


def test_a_pipeline_keeps_the_flat_dim_whole_and_says_so():
    """A pipeline's stages store only the layers block-cyclically (interleaved): the flat dim is
    lowered without its block-cyclic rule, which the plan's notes say, with the dense numbers."""
    outs, feeds, _ = _model(2, True, layers=2)
    plan = md.compile(outs, "stage:2; model:2", "layer:stage; heads:model", microbatches=2)
    assert "F" not in plan.values[plan.params["c_attn"]].sharding.split
    assert "'F' whole, not block-cyclic: a pipeline's stages store no block-cyclic dim but the layers" in plan.notes
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "pipelined", REL)


SLICED = [(None, "model:2", "heads:model", 2, False), (None, "model:3", "heads:model; d_ff:model", 6, False),
          (2, "model:2", "heads:model; d_ff:model", 2, False),
          (2, "data:2; model:2", "batch:data; heads:model", 2, False),
          (2, "data:2; model:2", "batch:data; heads:model; params.d_model:data", 2, True)]


@pytest.mark.parametrize("layers,mesh,layout,heads,fsdp", SLICED,
                         ids=[f"{l or 'block'}|{m}|{y}" for l, m, y, _, _ in SLICED])
def test_nanogpt_split_by_slices_stays_split(layers, mesh, layout, heads, fsdp):
    """nanoGPT's ``q, k, v = qkv.split(n_embd, dim=2)`` written as three ``slice_`` of the flat
    ``F``, each rearranged ``(heads d_head)``: the slices fall on the block-cyclic split's groups,
    so each is the rank's own block, forward and (as a pad) backward, and the plan moves what the
    unfused q, k, v weights' plan moves (under FSDP, where the weights' count differs, what the
    flat rearranged form moves), with the dense numbers.  Before, each slice traded halos."""
    outs, feeds, _ = _model(heads, "sliced", layers)
    plan = md.compile(outs, mesh, layout)
    assert plan.values[plan.params["c_attn"]].sharding.cyclic_blocks == {"F": 3}
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), f"{mesh} {layout}", REL)
    peer, _, _ = _model(heads, fsdp, layers)
    assert _collectives(plan) == _collectives(md.compile(peer, mesh, layout))
    if not fsdp and mesh == "model:2":   # Megatron's allreduces only: the activations' rows, forward and back
        assert {k for k in _collectives(plan)} == {"allreduce"}


def test_slices_off_the_grouping_keep_the_contiguous_split():
    """k sliced half a group off (``[n/2, 3n/2)``): no rank's blocks are its rows, so ``F`` is
    split plainly as the rearranges imply and each slice trades halos; the numbers stay dense."""
    outs, feeds, _ = _model(2, "sliced", bounds=(0, 2, 8))
    plan = md.compile(outs, "model:2", "heads:model")
    assert plan.values[plan.params["c_attn"]].sharding.split == {"F": ("model",)}
    assert not plan.values[plan.params["c_attn"]].sharding.cyclic_blocks
    assert _collectives(plan)["permute"][0] > 0
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "k off the grouping", REL)


def test_uneven_heads_keep_the_flat_weight_whole_and_say_why():
    """4 heads over ``model:3`` (parts 2, 1, 1): a block-cyclic split cuts each of q, k, v into
    equal blocks, so the flat weight is whole (gathered where it was split), the note names the
    uneven split as the reason beside the per-dim fix, and the numbers are the dense ones."""
    outs, feeds, _ = _model(4, True)
    plan = md.compile(outs, "model:3", "heads:model")
    assert plan.values[plan.params["c_attn"]].sharding.split == {}
    assert any("is an inner part of 'F'" in n and "not block-cyclic either: 'heads' (4) over model (3) is uneven" in n
               for n in plan.notes)
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "4 heads over model:3", REL)
