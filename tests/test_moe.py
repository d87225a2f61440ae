"""The routed mixture-of-experts transformer (models/moe.py).

* the whole model against a plain-torch reference written token by token (loops and
  index assignment, no cumsum): loss, balance loss, dropped count and every gradient,
  for top-1 and top-2;
* capacity: with a small capacity factor tokens are dropped, the count matches the
  reference, and a dropped token's MoE output is exactly 0 (the residual passes it);
* the simulated mesh against the dense program for data, expert, expert+tensor and
  FSDP layouts, and expert parallelism on two gloo processes;
* the plan: dispatch and combine are alltoalls over the experts' axis, and the gate
  tensors move no data;
* SGD steps under expert parallelism follow the dense loss curve, on the simulated mesh
  and on 2 and 4 gloo processes;
* the blocks stacked in one repeat (the balance loss and drop counts its per-layer outputs)
  pipelined 1F1B over ``stage:2``, with the experts split over ``data`` too, against the
  dense program, simulated and on four gloo processes.

Legend: the tiny config, batch 4, seq 8, d_model 8, heads 2, d_head 4, d_ff 8, vocab 16,
2 layers, experts 4; capacity ceil(1.25 * 8 * k / 4) = 3 (top-1) or 5 (top-2).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md
from conftest import ATOL, RTOL
from meshdsl.processes.launcher import spawn
from meshdsl.train.jobs import train_job
from meshdsl.train.model import find_model_file, load_module

EP = "batch:data; experts:data"
LAYOUTS = [("data:2", "batch:data"), ("data:2", EP), ("model:2", "experts:model"),
           ("data:2; model:2", "batch:data; experts:data; d_ff:model"),
           ("data:2", "batch:data; params.d_model:data")]


def _model(**overrides) -> md.Model:
    return md.load_model("moe", tiny=True, **overrides)


def _outputs(m: md.Model) -> dict:
    return {"loss": m.loss, **m.outputs, **{f"grad/{k}": g for k, g in m.grads().items()}}


def _init(m: md.Model) -> dict[str, torch.Tensor]:
    """The params' initial values (the same seed every executor uses)."""
    return md.run_dense(dict(m.params))


# ----------------------------------------------------------------------------- plain torch reference


def _route(probs: torch.Tensor, top_k: int, capacity: int):
    """Dispatch [b, s, g, c] and combine, filled token by token: all first choices of a
    sequence in position order, then the second choices after them."""
    b_n, s_n, g_n = probs.shape
    dispatch = torch.zeros(b_n, s_n, g_n, capacity)
    combine = torch.zeros(b_n, s_n, g_n, capacity)
    ranked = torch.argsort(probs.detach(), dim=-1, descending=True)[..., :top_k]
    dropped = 0
    for b in range(b_n):
        filled = [0] * g_n
        for k in range(top_k):
            for s in range(s_n):
                e = int(ranked[b, s, k])
                gate = probs[b, s, e]
                if top_k == 2:
                    gate = gate / (probs[b, s, ranked[b, s, 0]] + probs[b, s, ranked[b, s, 1]])
                if filled[e] < capacity:
                    dispatch[b, s, e, filled[e]] = 1.0
                    combine[b, s, e, filled[e]] = gate
                    filled[e] += 1
                else:
                    dropped += 1
    first = F.one_hot(ranked[..., 0], g_n).float()
    aux = sum(g_n * (first[b].mean(0) * probs[b].mean(0)).sum() for b in range(b_n)) / b_n
    return dispatch, combine, aux, dropped


def _torch_moe(z, w_gate, w_in, w_out, top_k, capacity):
    """The MoE MLP, one expert at a time: (y, aux, dropped, dispatch)."""
    probs = torch.softmax(z @ w_gate, -1)
    dispatch, combine, aux, dropped = _route(probs, top_k, capacity)
    y = torch.zeros_like(z)
    for e in range(w_in.shape[0]):
        xin = torch.einsum("bsc,bsd->bcd", dispatch[:, :, e], z)
        out = F.gelu(xin @ w_in[e]) @ w_out[e]
        y = y + torch.einsum("bsc,bcd->bsd", combine[:, :, e], out)
    return y, aux, dropped, dispatch


def _torch_model(p, ids, labels, cfg):
    """The whole model: (loss, aux summed over layers, dropped per layer, dispatch per layer)."""
    s_n = ids.shape[1]
    x = p["wte"][ids] + p["wpe"]
    mask = torch.tril(torch.ones(s_n, s_n, dtype=torch.bool))
    aux_total, dropped, dispatches = 0.0, [], []
    for l in range(cfg.layers):
        z = F.layer_norm(x, (cfg.d_model,), p["ln1"][l], p["ln1_b"][l], eps=1e-5)
        q, k, v = (torch.einsum("bsd,dhe->bhse", z, p[w][l]) for w in ("wq", "wk", "wv"))
        att = (q @ k.transpose(-1, -2)) * cfg.d_head ** -0.5
        att = torch.softmax(att.masked_fill(~mask, -1e9), -1)
        x = x + torch.einsum("bhse,hed->bsd", att @ v, p["wo"][l])
        z = F.layer_norm(x, (cfg.d_model,), p["ln2"][l], p["ln2_b"][l], eps=1e-5)
        y, aux, drop, dispatch = _torch_moe(z, p["w_gate"][l], p["w_in"][l], p["w_out"][l], cfg.top_k, cfg.capacity)
        x = x + y
        aux_total = aux_total + aux
        dropped.append(drop)
        dispatches.append(dispatch)
    x = F.layer_norm(x, (cfg.d_model,), p["lnf"], p["lnf_b"], eps=1e-5)
    logits = x @ p["lm_head"].T
    ce = F.cross_entropy(logits.reshape(-1, cfg.vocab), labels.reshape(-1))
    return ce + cfg.aux_loss_weight * aux_total, aux_total, dropped, dispatches


def _reference(m: md.Model, feeds):
    cfg = m.config
    p = {k: v.clone().requires_grad_(True) for k, v in _init(m).items()}
    loss, aux, dropped, dispatches = _torch_model(p, feeds["ids"], feeds["labels"], cfg)
    grads = torch.autograd.grad(loss, list(p.values()))
    want = {"loss": loss.detach(), "moe/aux_loss": aux.detach(),
            **{f"grad/{k}": g for k, g in zip(p, grads)}}
    return want, dropped, dispatches


# ----------------------------------------------------------------------------- dense vs reference


@pytest.mark.parametrize("top_k", [1, 2])
def test_dense_model_matches_plain_torch(top_k):
    m = _model(top_k=top_k)
    assert m.config.capacity == math.ceil(1.25 * 8 * top_k / 4)
    feeds = m.feeds(0)
    want, dropped, _ = _reference(m, feeds)
    got = md.run_dense(_outputs(m), feeds)
    assert got["moe/dropped"].dtype == torch.int64
    assert int(got["moe/dropped"]) == sum(dropped)
    assert [int(got[f"moe/dropped/{l}"]) for l in range(m.config.layers)] == dropped
    assert set(want) == {k for k in got if not k.startswith("moe/dropped")}
    for k in want:
        # fp32 with O(1) values; the two programs sum in different orders (a few ulps).
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=lambda s, k=k: f"{k}: {s}")
    # The balance loss reaches the router; the experts get the tokens' gradient.
    assert float(got["grad/w_gate"].abs().min()) > 0 and float(got["grad/w_in"].abs().sum()) > 0


def test_small_capacity_drops_tokens_and_the_residual_passes_them():
    m = _model(top_k=1, capacity_factor=0.5)  # capacity ceil(0.5 * 8 / 4) = 1 per expert per sequence
    cfg = m.config
    assert cfg.capacity == 1
    feeds = m.feeds(0)
    want, dropped, dispatches = _reference(m, feeds)
    got = md.run_dense(_outputs(m), feeds)
    # Top-1: at most 4 experts x 1 slot of a sequence's 8 tokens are kept, so at least half drop.
    assert all(d >= cfg.batch * cfg.seq // 2 for d in dropped) and int(got["moe/dropped"]) == sum(dropped)
    torch.testing.assert_close(got["loss"], want["loss"], rtol=RTOL, atol=ATOL)

    # The MoE MLP on its own: a dropped token's output is exactly 0, so x + y is x.
    moe = load_module(find_model_file("moe"))
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    g, x, f = md.Dim("gate_experts", cfg.experts), md.Dim("experts", cfg.experts), md.Dim("d_ff", cfg.d_ff)
    with md.Graph():
        z_bsd = md.input("z", [b, s, d])
        p = {"w_gate": md.param("w_gate", [d, g]), "w_in": md.param("w_in", [x, d, f]),
             "w_out": md.param("w_out", [x, f, d])}
        y_bsd, _, num_dropped = moe.moe_mlp(z_bsd, p, cfg)
        out = {"y": y_bsd, "x_plus_y": z_bsd + y_bsd, "dropped": num_dropped}
    z = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=torch.Generator().manual_seed(3))
    vals = md.run_dense(dict(p))
    res = md.run_dense(out, {"z": z})
    y_ref, _, drop_ref, dispatch = _torch_moe(z, vals["w_gate"], vals["w_in"], vals["w_out"], 1, 1)
    gone = dispatch.sum((2, 3)) == 0
    assert int(gone.sum()) == drop_ref == int(res["dropped"]) > 0
    assert torch.equal(res["y"][gone], torch.zeros_like(res["y"][gone]))
    assert torch.equal(res["x_plus_y"][gone], z[gone])
    torch.testing.assert_close(res["y"], y_ref, rtol=RTOL, atol=ATOL)
    assert float(res["y"][~gone].abs().min()) > 0


@pytest.mark.parametrize("overrides, words", [({"top_k": 3}, "use 1 or 2"), ({"top_k": 2, "experts": 1}, "at most"),
                                              ({"capacity_factor": 0.0}, "use a number > 0")])
def test_bad_configs_are_refused(overrides, words):
    with pytest.raises(md.MeshDSLError) as e:
        _model(**overrides)
    assert words in str(e.value)


# ----------------------------------------------------------------------------- layouts vs dense


@pytest.mark.parametrize("top_k", [1, 2])
def test_layouts_match_the_dense_program(top_k):
    m = _model(top_k=top_k)
    outs, feeds = _outputs(m), m.feeds(1)
    want = md.run_dense(outs, feeds)
    assert int(want["moe/dropped"]) > 0  # the comparison covers dropped routings too
    for mesh, layout in LAYOUTS:
        got = md.run_simulated(md.compile(outs, mesh, layout), feeds)
        assert torch.equal(got["moe/dropped"], want["moe/dropped"]), layout
        for k in want:
            # fp32; split reductions sum their shards in another order than the dense program.
            torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda s, k=k: f"mesh='{mesh}' layout='{layout}' {k}: {s}")


# ----------------------------------------------------------------------------- pipelined

PIPELINES = [("stage:2", "layer:stage"), ("stage:2; data:2", "layer:stage; batch:data; experts:data")]


@pytest.mark.parametrize("mesh, layout", PIPELINES)
def test_pipelined_blocks_match_the_dense_program(mesh, layout):
    """The blocks in one repeat, pipelined 1F1B over 'stage' (experts split over 'data' too):
    loss, balance loss, drop counts and every gradient as the dense program's."""
    m = _model()
    outs, feeds = _outputs(m), m.feeds(1)
    want = md.run_dense(outs, feeds)
    plan = md.compile(outs, mesh, layout, microbatches=2, schedule="1f1b")
    assert any(s.kind == "pipeline" for s in plan.steps)
    got = md.run_simulated(plan, feeds)
    for k in want:
        # fp32; the micro-batches and split reductions sum in another order than the dense program.
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=lambda s, k=k: f"{layout} {k}: {s}")


def _pipelined_on_ranks(comm, mesh, layout):
    """Child of the gloo test: the pipelined model's outputs, in full on rank 0."""
    from meshdsl.comm.microbatch import for_plan
    from meshdsl.runtime.pipeline import outputs_to_first_rank
    torch.set_num_threads(1)
    m = _model()
    plan = md.compile(_outputs(m), mesh, layout, microbatches=2, schedule="1f1b")
    ex = md.Executor(plan, for_plan(comm, plan))
    full = outputs_to_first_rank(comm, plan, ex.full_outputs(ex.run(m.feeds(1), ex.init_params(0))))
    return {k: v.detach() for k, v in full.items()} if comm.ranks[0] == 0 else None


@pytest.mark.slow   # 4 processes; by default its plan runs simulated (test_pipelined_blocks_match_the_dense_program
# [stage:2; data:2-...]), expert parallelism on gloo in test_expert_parallel_on_two_gloo_processes and
# pipelines on gloo in tests/test_pipeline_dist.py
def test_pipelined_with_expert_parallelism_on_four_gloo_processes():
    mesh, layout = PIPELINES[1]
    got = spawn(_pipelined_on_ranks, 4, args=(mesh, layout), mesh=mesh, timeout=240)[0]
    m = _model()
    want = md.run_dense(_outputs(m), m.feeds(1))
    assert set(got) == set(want) and torch.equal(got["moe/dropped"], want["moe/dropped"])
    for k in want:
        # gloo sums in its own order: fp32 rounding only.
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=lambda s, k=k: f"{k}: {s}")


# ----------------------------------------------------------------------------- the plan


def _collectives(plan, mult=1):
    """Every collective of ``plan`` and its sub-plans (the blocks' layers), once per run: (step, input shape)."""
    for s in plan.steps:
        for k, sub in enumerate(s.subplans):
            yield from _collectives(sub, mult * s.runs(k))
        if s.is_collective:
            yield from [(s, plan.values[s.ins[0]].shape)] * mult


def test_expert_parallel_dispatch_and_combine_are_alltoalls():
    m = _model()
    cfg = m.config
    plan = md.compile(m.train_step(), "data:2", EP, bucket_mb=0)  # one allreduce per gradient, named below
    coll = list(_collectives(plan))
    # Per layer: dispatch and combine forward, their transposes backward, over 'data'.
    a2a = [(s, shape) for s, shape in coll if s.kind == "alltoall"]
    assert [s.phase for s, _ in a2a].count("forward") == 2 * cfg.layers
    assert [s.phase for s, _ in a2a].count("backward") == 2 * cfg.layers
    dispatched = 4 * cfg.experts * cfg.batch * cfg.capacity * cfg.d_model // 2  # fp32, half per rank
    for s, shape in a2a:
        assert s.axes == ("data",) and s.bytes == dispatched
        assert set(shape.names) == {"gate_experts", "batch", "capacity", "d_model"}
    # The dispatched tokens are never gathered and the gate tensors move nothing: the other
    # collectives are the loss (the balance loss's mean over groups folds into its one
    # allreduce) and the gradients of the replicated params.
    assert {s.kind for s, _ in coll} == {"alltoall", "allreduce"}
    fwd = [shape.names for s, shape in coll if s.kind == "allreduce" and s.phase == "forward"]
    assert fwd == [()]
    bwd = {s.note.split("'")[1] for s, _ in coll if s.kind == "allreduce" and s.phase == "backward"}
    assert bwd == {f"grad/{k}" for k in m.params if k not in ("w_in", "w_out")}


def test_experts_split_alone_needs_no_alltoall():
    # With the batch whole, the rename onto 'experts' is a local slice; only the combine gathers.
    m = _model()
    plan = md.compile(m.train_step(), "model:2", "experts:model")
    kinds = [s.kind for s, _ in _collectives(plan)]
    assert "alltoall" not in kinds and kinds.count("allgather") == 2 * m.config.layers


# ----------------------------------------------------------------------------- training and processes


def _dense_curve(num_steps: int) -> torch.Tensor:
    m = _model()
    step = md.TrainStep(m.loss, m.params, "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")), lr=0.1)
    return torch.tensor([step(m.feeds(0))[0] for _ in range(num_steps)])


def test_sgd_under_expert_parallelism_follows_the_dense_curve():
    m = _model()
    want = _dense_curve(5)
    assert want[-1] < want[0]
    for mesh, layout in (("data:2", EP), ("data:2; model:2", "batch:data; experts:data; d_ff:model")):
        step = md.TrainStep(m.loss, m.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)), lr=0.1)
        got = torch.tensor([step(m.feeds(0))[0] for _ in range(5)])
        # Five fp32 SGD steps in another summation order: the routing stays the same, so the
        # curves agree to rounding.
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda s: f"{layout}: {s}")


def _ep_on_ranks(comm, top_k):
    """Child of the gloo test: loss, counts and gradients under EP, in full (rank 0 returns them)."""
    m = _model(top_k=top_k)
    plan = md.compile(_outputs(m), comm.mesh, EP)
    ex = md.Executor(plan, comm)
    got = ex.full_outputs(ex.run(m.feeds(2), ex.init_params(0)))
    return {k: v.detach() for k, v in got.items()} if comm.ranks[0] == 0 else None


def test_expert_parallel_on_two_gloo_processes():
    got = spawn(_ep_on_ranks, 2, args=(2,), mesh="data:2", timeout=180)[0]
    m = _model(top_k=2)
    want = md.run_dense(_outputs(m), m.feeds(2))
    assert torch.equal(got["moe/dropped"], want["moe/dropped"])
    for k in want:
        # gloo's alltoall moves values exactly; its allreduce sums in its own order.
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=lambda s, k=k: f"{k}: {s}")


# data:4 (4 processes) with -m slow: by default the same job runs on data:2, and one expert per rank
# simulated in tests/test_moe_adamw.py (test_expert_parallel_adamw_is_the_dense_curve[ep/4])
@pytest.mark.parametrize("nproc, mesh, layout", [(2, "data:2", EP),
                                                 pytest.param(4, "data:4", EP, marks=pytest.mark.slow)])
def test_sgd_on_gloo_processes_follows_the_dense_curve(nproc, mesh, layout):
    # experts 4 over data:4 is one expert per rank; batch 4 is one sequence per rank.
    steps = spawn(train_job, nproc, args=("moe", True, mesh, layout, 3, 0.1, 0, 1), mesh=mesh, timeout=240)[0]
    got = torch.tensor([loss for loss, _, _ in steps])
    want = _dense_curve(4)[1:]  # the job's first step is a warm-up
    # gloo sums in its own order: fp32 rounding only over four steps.
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
