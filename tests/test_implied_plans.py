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
    assert plan.totals() == {"allgather": {"count": 2, "bytes": 160}, "allreduce": {"count": 2, "bytes": 100},
                             "reduce_scatter": {"count": 1, "bytes": 192}}   # (was 7 collectives, 612 B)
    feeds = {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(1))}
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "FSDP", 1e-5)


def test_deberta_relative_keys_under_fsdp_match_dense():
    assert_heldout_case_matches_dense(("tests/heldout_deberta.py", {}, "data:2", "ex:data; params.hid:data"))


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
    assert tot["allgather"]["count"] == 8 and tot["reduce_scatter"]["count"] == 4, tot
    assert tot["permute"]["count"] == 16, tot
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
    assert plan.totals()["allgather"]["count"] == 4, plan.totals()
    # (its numbers: tests/test_models.py checks the README's cell, vit under height:data)
