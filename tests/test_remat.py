"""Activation checkpointing (meshdsl/ir/remat.py): ``repeat(..., remat=)``, ``grad(..., remat=)``,
``TrainStep(remat=)``, ``md.fit(remat=)`` and ``--remat``.

* The numbers: loss and every gradient are bitwise those of ``none`` for ``full`` and
  ``selective`` (the backward recomputes with the same kernels, in the same order, on the
  same values, with the same dropout salt), densely, on DP, TP+DP and FSDP meshes, under
  gradient accumulation and in a 1F1B pipeline (FSDP inside it), and over SGD steps in
  this process and on two gloo processes.
* The plan: what each layer saves falls (``full``: its input only), the recompute steps
  have phase ``recompute`` with their FLOPs, ``selective`` recomputes no einsum, nothing is
  added to the forward (a partial sum the backward only recomputes from is saved as it is),
  and the memory report's peak falls at a size where activations dominate.
* What ``selective`` saves is a minimum cut: a cheap op's output the backward reads is saved
  in place of the einsum output it is made from when it is no larger, not when it is larger.
  In llama's layer it saves q, k, v, the residual and the SwiGLU gate and up projections, and
  recomputes the fused attention kernel from q, k and v (Megatron's selective recompute):
  bitwise the numbers of ``none`` densely, with the query dim split, on TP+DP and FSDP meshes
  and in a 1F1B pipeline.
* The backward block's steps run in the order that frees early (:mod:`meshdsl.lowering.block_order`):
  its peak falls, and not one number changes.
* ``meshdsl check --remat`` compares the checkpointed program on the mesh with the dense one
  that saves everything.
* Refusals: a policy that names nothing, an unknown word or op, a ``save:`` list the block
  does not compute; from the command line, exit 2.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from meshdsl.ir.remat import parse_remat
from meshdsl.lowering.memory import saved_per_layer
from meshdsl.processes.launcher import spawn
from models.llama import Config as LlamaConfig, build as build_llama
from models.transformer import Config, build

POLICIES = ("selective", "full")
# dropout on, so the recompute must draw the forward's masks again
CFG = dataclasses.replace(Config.tiny(), dropout=0.1)


@pytest.fixture(scope="module")
def model():
    return build(CFG)


def _outputs(model, remat):
    grads = md.grad(model.loss, model.params, remat=remat)
    return {"loss": model.loss, **{f"grad/{k}": g for k, g in grads.items()}}


def _equal(got: dict, want: dict, what: str) -> None:
    # Bitwise: a recompute that ran other kernels, or in another order, shows here.
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what} {k}: max diff {(got[k] - want[k]).abs().max()}"


def _block_steps(plan, backward: bool):
    step = next(s for s in plan.steps if s.kind == "repeat" and s.args["backward"] == backward)
    return step, step.subplans[0].steps


# ----------------------------------------------------------------------------- the numbers

def test_dense_gradients_are_bitwise_those_of_no_remat(model):
    feeds = model.feeds(0)
    want = md.run_dense(_outputs(model, "none"), feeds)
    for policy in POLICIES:
        _equal(md.run_dense(_outputs(model, policy), feeds), want, policy)


@pytest.mark.parametrize("mesh, layout, microbatches, schedule", [
    ("data:2; model:2", "batch:data; heads:model; d_ff:model", 1, "gpipe"),         # DP + TP
    ("data:2", "batch:data; params.d_model:data", 2, "gpipe"),                     # FSDP, accumulating
    ("stage:2; data:2", "layer:stage; batch:data; params.d_model:data", 2, "1f1b"),  # 1F1B with FSDP
])
def test_mesh_gradients_are_bitwise_those_of_no_remat(model, mesh, layout, microbatches, schedule):
    feeds = model.feeds(1)

    def run(policy):
        plan = md.compile(_outputs(model, policy), mesh, layout, microbatches=microbatches, schedule=schedule)
        return md.run_simulated(plan, feeds)
    want = run("none")
    for policy in POLICIES:
        _equal(run(policy), want, f"{policy} on '{mesh}' '{layout}'")


def test_training_steps_follow_the_curve_of_no_remat(model, one_torch_thread):
    def curve(remat):
        step = md.TrainStep(model.loss, model.params, "data:2", "batch:data", md.SimulatedComm(md.Mesh.parse("data:2")),
                            optimizer=md.AdamW(lr=1e-2), remat=remat)
        return torch.tensor([step(model.feeds(i))[0] for i in range(3)])
    want = curve(None)
    for policy in POLICIES:
        assert torch.equal(curve(policy), want), policy


def _pipeline_on_ranks(comm, remat):
    """Child of the gloo test: two SGD steps of a 1F1B pipeline over 'stage'; the losses and
    how many activations each layer of its plan saves."""
    torch.set_num_threads(1)
    m = build(CFG)
    step = md.TrainStep(m.loss, m.params, "stage:2", "layer:stage", comm, lr=0.1, microbatches=2, schedule="1f1b",
                        remat=remat)
    losses = [step(m.feeds(i))[0] for i in range(2)]
    return losses, [r["saved"] for r in saved_per_layer(step.plan)]


def test_a_pipeline_with_full_remat_on_two_gloo_processes():
    (none, saved_none), (full, saved_full) = [spawn(_pipeline_on_ranks, 2, args=(remat,), mesh="stage:2",
                                                    timeout=240)[1] for remat in ("none", "full")]
    assert saved_full == [0] and saved_none[0] > 0
    # rank 1 is the last stage, which holds the loss; gloo moves values exactly and the
    # stages run the same kernels: the same losses bit for bit
    assert full == none and len(full) == 2 and all(x == x for x in full)


def test_a_nested_repeat_differentiates_under_every_policy():
    """A block holding a repeat: its gradient against torch's autograd, the same under each policy
    (the inner repeat's saved activations exist in the backward's re-trace only: recomputed)."""
    b, d, l, s, f = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("layer", 2), md.Dim("sub", 3), md.Dim("f", 4)
    gen = torch.Generator().manual_seed(0)
    params = {"u": torch.randn(4, generator=gen), "w": torch.randn(2, 3, 4, generator=gen),
              "w2": torch.randn(2, 4, 4, generator=gen)}
    x0 = torch.randn(8, 4, generator=gen)
    got = {}
    for policy in ("none", "selective", "full"):
        with md.Graph("nested"):
            x, u = md.input("x", [b, d]), md.param("u", [d])
            w, w2 = md.param("w", [l, s, d]), md.param("w2", [l, d, f])

            def block(h, p):
                inner = md.repeat(lambda c, q: md.tanh(c * q["w"] + u), h, {"w": p["w"]}, "sub")
                return h + md.einsum("batch d_model, d_model f -> batch d_model", md.tanh(inner), p["w2"])
            y = md.repeat(block, x, {"w": w, "w2": w2}, "layer")
            loss = md.reduce_sum(y * y)
            grads = md.grad(loss, {"u": u, "w": w, "w2": w2}, remat=policy)
        got[policy] = md.run_dense({"loss": loss, **grads}, {"x": x0}, params)
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    h = x0
    for i in range(2):
        c = h
        for j in range(3):
            c = torch.tanh(c * p["w"][i, j] + p["u"])
        h = h + torch.einsum("bd,df->bd", torch.tanh(c), p["w2"][i])
    loss = (h * h).sum()
    want = dict(zip(p, torch.autograd.grad(loss, list(p.values()))), loss=loss.detach())
    for k in want:
        # fp32, values O(10): the two programs run the same math in another order
        torch.testing.assert_close(got["none"][k], want[k], rtol=1e-5, atol=1e-5)
    for policy in POLICIES:
        _equal(got[policy], got["none"], policy)


# ----------------------------------------------------------------------------- the plan

def test_each_layer_saves_what_its_policy_says(model):
    rows = {p: saved_per_layer(md.compile(_outputs(model, p), "data:2", "batch:data"))
            for p in ("none", "selective", "full")}
    (none,), (selective,), (full,) = rows["none"], rows["selective"], rows["full"]
    # full: the layer's input only, [batch 2 of 4, seq 8, d_model 8] fp32 on each of 2 ranks
    assert full["saved"] == 0 and full["activations"] == 0 and full["input"] == 2 * 8 * 8 * 4
    assert 0 < selective["activations"] < none["activations"]
    assert none["input"] == selective["input"] == full["input"]


def test_recompute_steps_and_their_flops(model):
    plans = {p: md.compile(_outputs(model, p), "data:2; model:2", "batch:data; heads:model; d_ff:model")
             for p in ("none", "selective", "full")}
    rec = {}
    for p, plan in plans.items():
        fwd, fwd_steps = _block_steps(plan, False)
        _, bwd_steps = _block_steps(plan, True)
        again = [s for s in bwd_steps if s.phase == "recompute"]
        rec[p] = sum(s.flops for s in again)
        # the forward block is the same whatever the policy: no collective is added to save
        assert [s.kind for s in fwd_steps if s.is_collective] == \
            [s.kind for s in _block_steps(plans["none"], False)[1] if s.is_collective]
        if p == "selective":  # the einsums' outputs are saved, not recomputed
            assert "einsum" not in {s.op for s in again}
        if p == "full":       # the layer again, up to what its backward reads
            assert {"einsum", "softmax", "layer_norm"} <= {s.op for s in again}
            assert 0.5 * fwd.subplans[0].flops() < rec[p] <= fwd.subplans[0].flops()
            # TP: the recomputed projections' partial sums are reduced again, in the backward block
            assert any(s.is_collective for s in again)
    assert rec["none"] < rec["selective"] < rec["full"]
    from meshdsl.tools.report import plan_report
    report = plan_report(plans["full"])
    assert report["recompute_flops"] == rec["full"] * CFG.layers
    assert any(e["phase"] == "recompute" and e["op"] == "einsum" for e in report["ops"])


def test_peak_activations_fall_where_activations_dominate():
    big = build(dataclasses.replace(Config.tiny(), layers=8, seq=64, d_model=32, d_ff=128, heads=4, d_head=8,
                                    batch=8))
    peak = {p: md.memory_report(md.compile(_outputs(big, p), "data:2", "batch:data"))["activations_peak"]
            for p in ("none", "selective", "full")}
    assert peak["full"] < peak["selective"] < peak["none"]
    assert peak["none"] > 3 * peak["full"]


def _chain(policy, widen: bool):
    """A block whose second einsum reads a cheap function of the first one's output: the same
    size (``widen=False``), or broadcast over a new dim of 4 (larger).  The block's saved ops
    and, for ``x``, the loss and gradients."""
    b, d, l, e = md.Dim("batch", 4), md.Dim("d", 3), md.Dim("layer", 2), md.Dim("e", 4)
    gen = torch.Generator().manual_seed(1)
    params = {"w1": torch.randn(2, 3, 3, generator=gen), "w2": torch.randn(2, 3, 3, generator=gen)}
    with md.Graph("chain"):
        x = md.input("x", [b, d])
        w1, w2 = md.param("w1", [l, d, md.Dim("f", 3)]), md.param("w2", [l, md.Dim("f", 3), d])

        def block(h, p):
            q = md.einsum("batch d, d f -> batch f", h, p["w1"])
            if widen:   # [batch, f, e]: 4x the bytes of q
                r = md.broadcast_to(q, md.Shape([b, md.Dim("f", 3), e])) * 0.5
                return h + md.einsum("batch f e, f d -> batch d", r, p["w2"])
            return h + md.einsum("batch f, f d -> batch d", q * 0.5, p["w2"])
        y = md.repeat(block, x, {"w1": w1, "w2": w2}, l)
        loss = md.reduce_sum(y * y)
        grads = md.grad(loss, {"w1": w1, "w2": w2}, remat=policy)
        (node,) = [n for n in loss.graph.nodes if n.op.name == "repeat"]
        saved = [t.node.op.name for t in node.attrs["saved"]]
    return saved, md.run_dense({"loss": loss, **grads}, {"x": torch.randn(4, 3, generator=gen)}, params)


def test_selective_saves_the_fewest_bytes_and_recomputes_the_least():
    same, got = _chain("selective", widen=False)
    # q * 0.5 is what the second einsum's gradient reads and no larger than q: saved instead of q
    assert same == ["mul"]
    _equal(got, _chain("none", widen=False)[1], "selective, same size")
    wide, got = _chain("selective", widen=True)
    # the broadcast is 4x q's bytes: q is saved and the broadcast recomputed from it
    assert wide == ["einsum"]
    _equal(got, _chain("none", widen=True)[1], "selective, wider")


@pytest.mark.parametrize("mesh, layout, microbatches, schedule", [
    ("data:1", "", 1, "gpipe"),
    ("model:2", "seq:model", 1, "gpipe"),                                           # the query dim split
    ("data:2; model:2", "batch:data; kv_heads:model; d_ff:model", 1, "gpipe"),      # DP + TP
    ("data:2", "batch:data; params.d_model:data", 2, "gpipe"),                     # FSDP, accumulating
    ("stage:2; data:2", "layer:stage; batch:data; params.d_model:data", 2, "1f1b"),  # 1F1B with FSDP
])
def test_selective_recomputes_llama_s_attention_and_saves_its_projections(mesh, layout, microbatches, schedule):
    cfg = LlamaConfig.tiny()
    feeds = build_llama(cfg).feeds(1)
    got, plans = {}, {}
    for policy in ("none", "selective"):
        m = build_llama(cfg)
        plans[policy] = md.compile(_outputs(m, policy), mesh, layout, microbatches=microbatches, schedule=schedule)
        got[policy] = md.run_simulated(plans[policy], feeds)
    _equal(got["selective"], got["none"], f"selective on '{mesh}' '{layout}'")
    if mesh != "data:1":
        return
    m = build_llama(cfg)
    md.grad(m.loss, m.params, remat="selective")
    (node,) = [n for n in m.loss.graph.nodes if n.op.name == "repeat"]
    # rotated q, k and v (renamed to key_seq), the residual after attention, gate and up:
    # no attention output, no norm output, no SwiGLU product
    assert [t.node.op.name for t in node.attrs["saved"]] == ["reshape", "rename", "rename", "add", "einsum", "einsum"]
    assert all(node.attrs["saved_read"])   # each read by the backward itself, none only to recompute another
    per_token = cfg.kv_heads * cfg.group * cfg.d_head + 2 * cfg.kv_heads * cfg.d_head + cfg.d_model + 2 * cfg.d_ff
    (row,) = saved_per_layer(plans["selective"])
    assert row["activations"] == per_token * cfg.batch * cfg.seq * 4   # fp32
    _, steps = _block_steps(plans["selective"], True)
    again = [s.op for s in steps if s.phase == "recompute"]
    assert again.count("attention") == 1 and "einsum" not in again


def test_the_backward_block_frees_early_and_changes_no_number(monkeypatch):
    """The backward block's steps reordered (:mod:`meshdsl.lowering.block_order`) against the
    order lowering made them in, on a tensor-parallel mesh (its recompute reduces partial sums
    again): every output bitwise the same, a lower peak."""
    import meshdsl.lowering.repeat as lowering_repeat
    feeds = build(CFG).feeds(2)
    got, peaks = {}, {}
    for reorder in (True, False):
        if not reorder:
            monkeypatch.setattr(lowering_repeat, "order_block", lambda plan, recomputes: plan)
        for policy in POLICIES:
            m = build(CFG)   # a graph of its own: the compile cache keeps the plans apart
            plan = md.compile(_outputs(m, policy), "model:2", "heads:model; d_ff:model")
            got[policy, reorder] = md.run_simulated(plan, feeds)
            peaks[policy, reorder] = md.memory_report(plan)["activations_peak"]
    for policy in POLICIES:
        _equal(got[policy, True], got[policy, False], f"{policy} reordered")
        assert peaks[policy, True] < peaks[policy, False], policy


def test_check_compares_a_checkpointed_mesh_with_the_dense_program(capsys):
    from conftest import run_cli
    rc, out, _ = run_cli(capsys, ["check", "llama", "--tiny", "--mesh", "data:2; model:2", "--layout",
                                  "batch:data; kv_heads:model; d_ff:model", "--remat", "selective"])
    assert rc == 0 and "remat selective (dense: none)" in out and "match the dense program" in out
    rc, _, err = run_cli(capsys, ["check", "transformer", "--tiny", "--mesh", "data:2", "--layout", "batch:data",
                                  "--remat", "save:softmax"])
    assert rc == 2 and "names nothing this block computes" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- policies and refusals

def test_policies_parse():
    assert parse_remat(None).save is None and parse_remat("none").save is None
    assert parse_remat("full").save == frozenset()
    assert parse_remat("selective").save == {"einsum", "conv"}
    assert parse_remat(" save:einsum , attention ").text == "save:einsum,attention"


@pytest.mark.parametrize("policy, words", [
    ("save:", "names nothing to save"), ("save: , ", "names nothing to save"),
    ("partial", "unknown remat policy"), ("selctive", "Did you mean 'selective'"),
    ("save:matmul", "does not have"), (3, "not a string")])
def test_bad_policies_are_refused(policy, words):
    with pytest.raises(md.GraphError, match=words):
        parse_remat(policy)


def test_a_policy_naming_nothing_the_block_computes_is_refused(model):
    # the tiny transformer's attention is one fused kernel: there is no softmax to save
    with pytest.raises(md.GraphError, match="names nothing this block computes"):
        md.grad(build(Config.tiny()).loss, remat="save:softmax")
    with pytest.raises(md.GraphError, match="unknown remat policy"):
        md.fit(model, steps=1, remat="most")


def test_the_repeat_s_own_policy_and_the_override():
    b, d, l = md.Dim("batch", 2), md.Dim("d", 4), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, d])
        w = md.param("w", [l, d, md.Dim("f", 4)])
        y = md.repeat(lambda h, p: h + md.einsum("batch d, d f -> batch d", md.tanh(h), p["w"]), x, {"w": w}, l,
                      remat="full")
        loss = md.reduce_sum(y * y)
        md.grad(loss, [w])
        (node,) = [n for n in loss.graph.nodes if n.op.name == "repeat"]
        assert node.attrs["saved"] == []          # the repeat's own policy: full
        md.grad(loss, [w], remat="none")          # the override: the block's tanh is saved
        assert len(node.attrs["saved"]) == 1
    with pytest.raises(md.GraphError, match="unknown remat policy"):
        md.repeat(lambda h, p: h, x, {"w": w}, l, remat="sometimes")


@pytest.mark.parametrize("cmd", ["plan", "train"])
def test_the_command_line_refuses_a_policy_with_exit_2(capsys, no_spawn, cmd):
    from conftest import run_cli
    rc, _, err = run_cli(capsys, [cmd, "transformer", "--tiny", "--mesh", "data:2", "--layout", "batch:data",
                                  "--remat", "save:"])
    assert rc == 2 and "names nothing to save" in err and "Traceback" not in err


def test_plan_prints_the_recompute(capsys):
    from conftest import run_cli
    rc, out, _ = run_cli(capsys, ["plan", "transformer", "--tiny", "--mesh", "data:2", "--layout", "batch:data",
                                  "--remat", "full"])
    assert rc == 0 and "recompute" in out and "saved per layer 512 B" in out
