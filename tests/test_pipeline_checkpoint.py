"""Checkpoints of a pipelined layout (``layer:stage``): the params one stage holds only (the
embedding on the first, the head on the last) and their optimizer state.

:meth:`TrainStep.state` gives them a :class:`HeldSpec` and ``None`` on the ranks of the other
stages; the holders write them, and they load on any other mesh (dense, ``data:2``) with the
same numbers.  A run resumed from such a checkpoint continues bit for bit on the same plan, for
1F1B, the interleaved schedule and unequal stages, on the simulated mesh in one process.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import meshdsl as md
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.core.shape import Shape
from meshdsl.layout.sharding import Sharding
from meshdsl.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from meshdsl.train.checkpoint_format import META_FILE, CheckpointError, HeldSpec

# Micro-batch sums fold in another order than the dense program's single batch: fp32 rounding
# only (as tests/test_balanced_stages.py).
REL = 1e-5

PIPELINES = {"1f1b": dict(schedule="1f1b"), "interleaved": dict(schedule="interleaved:2"),
             "unequal": dict(schedule="1f1b", stage_layers=(3, 1))}


def _model():
    return md.load_model("transformer", tiny=True, layers=4, batch=8)


def _step(model, mesh, layout, **kw):
    return md.TrainStep(model.loss, model.params, mesh, layout, SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=md.AdamW(lr=0.01), **kw)


def _full_state(step) -> dict[str, torch.Tensor]:
    """Every carried tensor whole, by its state() name, gathered from the ranks that hold it."""
    out = {}
    for k in step.carried:
        out[k if k.startswith("opt/") else f"param/{k}"] = step.executor.to_full_held(step.plan.params[k],
                                                                                       step.params[k])
    return out


def _load_into(step, path) -> None:
    state = step.state()
    step.load_state(load_checkpoint(path, {k: spec for k, (spec, _) in state.items()}, step.plan.mesh,
                                    step.executor.comm.ranks))


@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_a_pipelined_state_saves_and_loads_on_other_meshes(tmp_path, kind, one_torch_thread):
    model = _model()
    pipe = _step(model, "stage:2", "layer:stage", microbatches=2, **PIPELINES[kind])
    for t in range(2):
        pipe(model.feeds(t))
    state = pipe.state()
    # The head is the last stage's: its ranks (the micro-batch axis is minor) hold it, the first
    # stage's give None; AdamW's moments of it likewise.
    for name in ("param/lm_head", "opt/lm_head/exp_avg"):
        spec, xs = state[name]
        assert isinstance(spec, HeldSpec) and spec.holders == (2, 3), name
        assert xs[0] is None and xs[1] is None and xs[2] is not None, name
    path = save_checkpoint(tmp_path, 2, state, pipe.executor.comm)
    saved = _full_state(pipe)
    for mesh, layout in (((), None), ("data:2", "batch:data")):
        other = _step(model, md.Mesh(mesh) if mesh == () else mesh, layout)
        _load_into(other, path)
        assert other.step_count == 2
        got = _full_state(other)
        assert set(got) == set(saved)
        for k in saved:
            assert torch.equal(got[k], saved[k]), (mesh, k)   # the saved bytes, resharded
    # The next step from the loaded state is the pipeline's next step (dense: sums in another order).
    want_loss = pipe(model.feeds(2))[0]
    torch.testing.assert_close(other(model.feeds(2))[0], want_loss, rtol=REL, atol=REL)


@pytest.mark.parametrize("counts", [None, (1, 3, 3, 1)])
def test_an_interleaved_state_is_saved_in_global_layer_order(tmp_path, one_torch_thread, counts):
    """Each rank stores its chunks in place (``layer:stage[cyclic 2]``, of the given layers per
    virtual stage with ``counts``): its part of a stacked param is one block per chunk of the
    full tensor, written as one slice each, and a dense step loads them in the global layer
    order and continues the run; so does an interleaved step of equal chunks on another mesh."""
    model = md.load_model("transformer", tiny=True, layers=8, batch=8)
    pipe = _step(model, "stage:2; data:2", "layer:stage; batch:data", microbatches=2, schedule="interleaved:2",
                 stage_layers=counts)
    pipe(model.feeds(0))
    path = save_checkpoint(tmp_path, 1, pipe.state(), pipe.executor.comm)
    slices = json.loads((path / META_FILE).read_text())["tensors"]["param/wq"]["slices"]
    by_file = {}
    for sl in slices:
        by_file.setdefault(sl["file"], []).append((sl["key"], sl["offsets"][0], sl["sizes"][0]))
    # equal: stage 0 holds layers 0-1 and 4-5 (chunks 0 and 2), stage 1 layers 2-3 and 6-7;
    # (1, 3, 3, 1): stage 0 layers 0 and 4-6, stage 1 layers 1-3 and 7
    want = ([[("param/wq#0", 0, 2), ("param/wq#1", 4, 2)], [("param/wq#0", 2, 2), ("param/wq#1", 6, 2)]]
            if counts is None else
            [[("param/wq#0", 0, 1), ("param/wq#1", 4, 3)], [("param/wq#0", 1, 3), ("param/wq#1", 7, 1)]])
    assert sorted(by_file.values()) == want
    dense = _step(model, md.Mesh(()), None)
    _load_into(dense, path)
    saved = _full_state(pipe)
    # and an interleaved step on another mesh reads each of its chunks' blocks back
    other = _step(model, "stage:2", "layer:stage", microbatches=2, schedule="interleaved:2")
    _load_into(other, path)
    for got in (_full_state(dense), _full_state(other)):
        assert set(got) == set(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    torch.testing.assert_close(dense(model.feeds(1))[0], pipe(model.feeds(1))[0], rtol=REL, atol=REL)


@pytest.mark.parametrize("kind", ["interleaved", "unequal"])
def test_a_resumed_pipelined_run_continues_bit_for_bit(tmp_path, kind):
    model = _model()
    run = dict(mesh="stage:2", layout="layer:stage", microbatches=2, optimizer="adamw", lr=1e-2, clip_norm=1.0,
               warmup_steps=1, data=lambda step: model.feeds(step), eval_data=[model.feeds(10**6)], samples=0,
               **PIPELINES[kind])
    whole = md.fit(model, steps=4, checkpoint=str(tmp_path / "ck"), save_every=2, **run)
    shutil.copytree(tmp_path / "ck" / "step-00000002", tmp_path / "at2" / "step-00000002")
    resumed = md.fit(model, steps=4, checkpoint=str(tmp_path / "at2"), resume=True, **run)
    keys = ("step", "loss", "lr", "grad_norm", "eval_loss")
    assert resumed.start_step == 2
    # the same plan on the same mesh reads the same params, moments, step count and batches
    assert [[r.get(k) for k in keys] for r in resumed.rows] == [[r.get(k) for k in keys] for r in whole.rows[2:]]
    # and the params it ends with are the uninterrupted run's
    want, got = _full_state(whole.step), _full_state(resumed.step)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_held_specs_are_checked_when_saving(tmp_path):
    mesh = md.Mesh.parse("stage:2")
    comm = SimulatedComm(mesh)
    shape = Shape([md.Dim("d", 4)])
    spec = HeldSpec(shape, torch.float32, Sharding.replicated(shape), (1,))
    x = torch.arange(4.0)
    path = save_checkpoint(tmp_path, 1, {"w": (spec, [None, x])}, comm)
    # rank 1 wrote it (the lowest rank holding it); a load gives the non-holders None
    assert [p.name for p in path.glob("*.safetensors")] == ["rank-00001.safetensors"]
    got = load_checkpoint(latest_checkpoint(tmp_path), {"w": spec}, mesh)["w"]
    assert got[0] is None and torch.equal(got[1], x)
    for xs, why in (([x, x], "a tensor where the rank does not hold it"), ([None, None], "None, expected")):
        with pytest.raises(CheckpointError, match=why):
            save_checkpoint(tmp_path, 2, {"w": (spec, xs)}, comm)
    # holders that hold only one stage's half of a tensor split over the stages
    split = Sharding.of(shape, {"d": ("stage",)})
    with pytest.raises(CheckpointError, match="hold only part of it"):
        save_checkpoint(tmp_path, 3, {"w": (HeldSpec(shape, torch.float32, split, (0,)), [x[:2], None])}, comm)


@pytest.mark.timeout(180)
def test_two_gloo_processes_save_a_pipelined_run_that_resumes_dense_in_this_process(tmp_path):
    # Each process holds one stage (and its micro-batches): the first writes the embedding, the
    # second the head, and a resume on one device in this process continues the run.
    run = dict(tiny=True, config={"vocab": 256, "layers": 4}, samples=0, eval_batches=1, optimizer="adamw",
               lr=1e-2, seed=3)
    piped = dict(mesh="stage:2", layout="layer:stage", microbatches=2, schedule="1f1b")
    ck = tmp_path / "ck"
    saved = md.fit("transformer", nproc=2, steps=2, checkpoint=str(ck), **piped, **run)
    assert sorted(p.name for p in (ck / "step-00000002").glob("*.safetensors")) == \
        ["rank-00000.safetensors", "rank-00002.safetensors"]
    whole = md.fit("transformer", steps=3, **piped, **run)    # the same run uninterrupted, simulated
    resumed = md.fit("transformer", mesh="data:1", steps=3, checkpoint=str(ck), resume=True, **run)
    assert resumed.start_step == 2
    losses = [r["loss"] for r in saved.rows] + [r["loss"] for r in resumed.rows]
    # gloo and the simulated mesh run the same kernels; the dense step sums the micro-batches in
    # another order: fp32 rounding only
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([r["loss"] for r in whole.rows]),
                               rtol=REL, atol=REL)
