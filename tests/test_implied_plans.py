"""Plans that send no more than a careful engineer would: an implied split chosen by what the
model's reshapes keep split (lowering/implied.py), an FSDP weight gathered once for every einsum
that reads it (lowering/generic.py).  Each checks the plan's collectives and its numbers against
the dense program (tiny graphs, simulated mesh)."""
from __future__ import annotations

import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, assert_matches_scaled

HELDOUT = "tests/heldout_bigbird.py"


def _blocks_and_one_block():
    """``seq`` cut into blocks of 2 (``blk`` 4) and, once, its first block alone (``blk`` 1)."""
    b, s = md.Dim("batch", 2), md.Dim("seq", 8)
    with md.Graph():
        x = md.input("x", [b, s])
        w = md.param("w", [s])
        h = x * w
        blocks = md.rearrange(h, "batch (blk pos) -> batch blk pos", pos=2)
        first = md.rearrange(md.slice_(h, "seq", 0, 2), "batch (blk pos) -> batch blk pos", pos=2)
        loss = md.reduce_sum(md.tanh(blocks) * md.reduce_sum(first, "blk"))
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    return outs, {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(0))}


def test_a_one_block_reshape_does_not_take_the_split_from_the_block_reshapes():
    outs, feeds = _blocks_and_one_block()
    plan = md.compile(outs, "model:2", "seq:model")
    implied = [n for n in plan.notes if n.startswith("implied")]
    assert len(implied) == 1 and "blk:model" in implied[0], plan.notes
    assert "alltoall" not in plan.totals(), plan.totals()
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "seq:model", 1e-5)


def test_bigbird_blocks_keep_the_sequence_split_without_alltoalls():
    model = md.load_model(HELDOUT, tiny=True)
    outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in md.grad(model.loss, model.params).items()}}
    totals = md.compile(outs, "model:2", "seq:model").totals()
    assert "alltoall" not in totals, totals   # (was 26: every (blk pos) reshape moved blk to pos)
    assert_heldout_case_matches_dense((HELDOUT, {}, "model:2", "seq:model"))


def test_an_fsdp_weight_gathered_for_one_einsum_is_not_reduced_after_the_next():
    """``w`` (FSDP: stored split over ``d``) is gathered for ``x . w``; ``table . w`` (no batch
    dim: DeBERTa's relative keys) reads the gathered copy instead of contracting the shards and
    allreducing its partial result, and ``table``'s gather in the backward is the forward's."""
    b, d, h, r = md.Dim("batch", 4), md.Dim("d", 8), md.Dim("h", 6), md.Dim("rel", 4)
    with md.Graph():
        x = md.input("x", [b, d])
        w, table = md.param("w", [d, h]), md.param("table", [r, d])
        y = md.einsum("batch d, d h -> batch h", x, w)
        kr = md.einsum("rel d, d h -> rel h", table, w)
        loss = md.reduce_sum(md.tanh(md.einsum("batch h, rel h -> batch rel", y, kr)))
        outs = {"loss": loss, **md.grad(loss, {"w": w, "table": table})}
    plan = md.compile(outs, "data:2", "batch:data; params.d:data")
    moved = [(s.kind, s.op, s.phase) for s, _ in plan.collectives()]
    assert ("allreduce", "einsum", "forward") not in moved, moved   # (was: kr's partial sum allreduced)
    # (was 7 collectives, 612 B; w's and table's gathers, both ready at the start, in one buffer:
    # lowering/coalesce.py)
    assert plan.totals() == {"bucket_allgather": {"count": 1, "bytes": 160}, "allreduce": {"count": 2, "bytes": 100},
                             "reduce_scatter": {"count": 1, "bytes": 192}}
    feeds = {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(1))}
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "FSDP", 1e-5)


def test_deberta_relative_keys_under_fsdp_match_dense():
    assert_heldout_case_matches_dense(("tests/heldout_deberta.py", {}, "data:2", "ex:data; params.hid:data"))


def _members(plan, kind: str) -> int:
    """How many values ``plan`` moves by collective ``kind`` a step, one bucket of several made back
    to back (lowering/coalesce.py) counted as its members."""
    return sum(len(s.ins) * mult for s, mult in plan.collectives() if s.kind in (kind, f"bucket_{kind}"))


def test_local_window_layers_beside_a_global_one_trade_halos_under_a_sequence_split():
    """Gemma 3's pattern (``tests/heldout_gemma3.py``: two sliding-window layers and a global one,
    all with keys renamed ``seq`` -> ``key_seq``) under ``seq:model`` alone: the keys keep the
    split (implied ``key_seq:model``), so the local layers trade a halo of ``window - 1`` rows and
    only the global layer gathers its keys and values. The global attention meeting ``key_seq``
    made every layer gather them: 12 allgathers and 12 reduce-scatters (13.5 KiB), now 8 and 4 and
    16 halo permutes (8.0 KiB)."""
    case = ("tests/heldout_gemma3.py", {}, "model:2", "seq:model")
    model = md.load_model(case[0], tiny=True)
    outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in md.grad(model.loss, model.params).items()}}
    plan = md.compile(outs, "model:2", "seq:model")
    assert any("implied by rename: key_seq:model" in n for n in plan.notes), plan.notes
    tot = plan.totals()
    assert _members(plan, "allgather") == 8 and _members(plan, "reduce_scatter") == 4, tot
    assert _members(plan, "permute") == 16, tot
    assert_heldout_case_matches_dense(case)


def test_an_implied_split_does_not_pass_to_keys_that_meet_their_queries():
    """The shipped ViT under ``height:data`` (the README's spatial row): ``patches`` is implied
    split by the patchify, and the rename to the keys' ``key_patches`` no longer passes that on
    (a dim that meets the old one stays whole, as for a written split). The rename gathers the
    keys and values once and the repeat saves them for the backward; split, the attention
    gathered them forward and again backward (8 allgathers, 16 KiB; now 4, 8 KiB)."""
    model = md.load_model("vit", tiny=True)
    outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in md.grad(model.loss, model.params).items()}}
    plan = md.compile(outs, "data:2", "height:data")
    assert not any("key_patches" in n for n in plan.notes), plan.notes
    assert _members(plan, "allgather") == 4, plan.totals()
    # (its numbers: tests/test_models.py checks the README's cell, vit under height:data)


def _decay_matrix_and_window(key: str):
    """A repeat block in Griffin's ``scan=matrix`` form (``tests/heldout_griffin.py``): a causal
    decay matrix over ``[seq, <key>]`` masked by ``md.causal_mask`` (built once, before the block)
    and contracted over ``<key>``, then a sliding-window attention whose keys are ``key_seq``."""
    b, s, e, f, L = md.Dim("batch", 2), md.Dim("seq", 8), md.Dim("d_head", 4), md.Dim("f", 4), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, s, e])
        w = md.param("w", [L, e, f], fan_out=[L, f])

        def block(h, p):
            u = md.rename(md.einsum("batch seq d_head, d_head f -> batch seq f", h, p["w"]), f="d_head")
            pre = md.cumsum(u, "seq")
            keep = md.causal_mask(pre.shape["seq"], md.Dim(key, 8))
            decay = md.exp(md.where(keep, pre - md.rename(pre, seq=key), -1e9))
            r = md.einsum(f"batch seq d_head {key}, batch {key} d_head -> batch seq d_head", decay,
                          md.rename(u, seq=key))
            kv = md.rename(r, seq="key_seq")
            return h + md.attention(u, kv, kv, "seq", "key_seq", "d_head", causal=True, window=3)

        y = md.repeat(block, x, {"w": w}, L)
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    return outs, {"x": torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))}


def test_a_decay_matrix_over_key_seq_keeps_the_window_attentions_halos():
    """The decay matrix's ``[seq, key_seq]`` reuses the attention keys' name: its mask (iotas
    compared, hoisted before the block and read there as a closed-over value) counted as the first
    op of ``key_seq`` and as a leaf whose two dims could not share ``model``, so no ``key_seq:model``
    was implied and the window attention gathered its keys and values (6 reduce-scatters, no
    permute). Now it trades halos (4 and 6 permutes), as with the decay dim named ``src``, whose
    plan differs only in where the contracted operand is gathered: its rename gathers it and the
    repeat saves it whole; split, the block saves its own part and the backward gathers it again."""
    plans = {}
    for key in ("key_seq", "src"):
        outs, feeds = _decay_matrix_and_window(key)
        plans[key] = plan = md.compile(outs, "model:2", "seq:model")
        assert any("implied by rename: key_seq:model" in n for n in plan.notes), plan.notes
        assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), f"decay over {key}", 1e-5)
    got, src = plans["key_seq"].totals(), plans["src"].totals()
    halos = {key: (_members(plan, "permute"),
                   sum(plan.totals().get(k, {}).get("bytes", 0) for k in ("permute", "bucket_permute")))
             for key, plan in plans.items()}
    assert halos["key_seq"] == halos["src"] and halos["key_seq"][0] == 6, (got, src)
    moved = {key: (_members(plan, "reduce_scatter"), _members(plan, "allgather")) for key, plan in plans.items()}
    assert moved["key_seq"][0] == moved["src"][0] == 4, (got, src)
    assert moved["key_seq"][1] <= moved["src"][1] + 2, (got, src)   # (the gather again, per layer)


def _carries_joined_by_concat():
    """A repeat whose two carries ``p`` (4) and ``q`` (6) travel as one ``s`` (10) joined by
    ``md.concat`` (as the docs advise), each part's matmul on its own weight."""
    b, p, q = md.Dim("batch", 4), md.Dim("p", 4), md.Dim("q", 6)
    with md.Graph():
        x = md.input("x", [b, p])
        w = md.param("w", [p, md.Dim("p2", 4)], fan_out=["p2"])
        u = md.param("u", [q, md.Dim("q2", 6)], fan_out=["q2"])
        s = md.concat([md.rename(x, p="s"), md.rename(md.broadcast_to(md.constant(1.0), [b, q]), q="s")], "s")

        def block(s, prm):
            a = md.tanh(md.einsum("batch p, p p2 -> batch p2", md.rename(md.slice_(s, "s", 0, 4), s="p"), w))
            c = md.tanh(md.einsum("batch q, q q2 -> batch q2", md.rename(md.slice_(s, "s", 4, 10), s="q"), u))
            return md.concat([md.rename(a, p2="s"), md.rename(c, q2="s")], "s")

        loss = md.reduce_sum(md.tanh(md.repeat(block, s, {}, md.Dim("layer", 2))))
        outs = {"loss": loss, **md.grad(loss, {"w": w, "u": u})}
    return outs, {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(0))}


def _a_split_concat_dim_renamed():
    """``C`` implied split by a rearrange of ``C_G``, joined with itself by a concat, renamed ``K``."""
    b, o = md.Dim("batch", 4), md.Dim("o", 6)
    with md.Graph():
        x = md.input("x", [b, md.Dim("C_G", 8)])
        v, w = md.param("v", [md.Dim("C_G", 8)]), md.param("w", [md.Dim("K", 8), o])
        h = md.reduce_sum(md.rearrange(x * v, "batch (C G) -> batch C G", G=2), "G")
        k = md.rename(md.concat([h, md.tanh(h)], "C"), C="K")
        loss = md.reduce_sum(md.tanh(md.einsum("batch K, K o -> batch o", k, w)))
        outs = {"loss": loss, **md.grad(loss, {"v": v, "w": w})}
    return outs, {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))}


def test_a_split_of_one_part_of_a_concat_does_not_spread_to_the_concat_or_its_other_parts():
    """A part sits at an offset of the joined dim, so a part's even split is not the joined dim's.
    Under ``p:model`` the rename implied ``s:model (from p)``, then ``q:model (from s)``: 10
    permutes, 5 allreduces, 2 allgathers a step (now 3 allgathers, 2 allreduces). An
    implied ``C`` joined by a concat no longer passes on to ``K`` (SD-UNet's skip: 4 permutes and an
    allreduce, now 2 permutes and an allgather).  Tolerance: fp32 sums in another order only."""
    outs, feeds = _carries_joined_by_concat()
    plan = md.compile(outs, "model:2", "p:model")
    assert not any(n.startswith("implied") for n in plan.notes), plan.notes
    assert "permute" not in plan.totals(), plan.totals()
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "p:model", 1e-5)
    outs, feeds = _a_split_concat_dim_renamed()
    plan = md.compile(outs, "model:2", "C_G:model")
    assert [n for n in plan.notes if n.startswith("implied")] == [
        "implied by rearrange: C:model (from C_G)"], plan.notes
    assert plan.totals()["permute"]["count"] == 2 and "allreduce" not in plan.totals(), plan.totals()
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "C_G:model", 1e-5)
