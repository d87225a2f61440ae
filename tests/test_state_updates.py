"""Non-gradient state updates in the compiled step (``md.Model(updates=...)``, ``TrainStep(updates=)``).

The oracle is the dense run with the EMA done by hand in torch between steps (full params
read, ``set_params`` back: the loop users wrote before updates existed).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.train.model import ModelError

HERE = Path(__file__).parent
M = 0.9  # the EMA momentum
STEPS = 3

# A small BYOL-like model: online w1/w2 trained; target t1/t2 frozen, read by the loss
# through stop_gradient and EMA-updated from the online params.
MODEL_SRC = '''
from dataclasses import dataclass
import torch
import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 4
    d_in: int = 4
    d_ff: int = 4
    momentum: float = 0.9
    ema: bool = True

    @classmethod
    def tiny(cls):
        return cls()


def build(cfg=Config()):
    B, I, F = md.Dim("batch", cfg.batch), md.Dim("d_in", cfg.d_in), md.Dim("d_ff", cfg.d_ff)
    with md.Graph("ema") as g:
        x = md.input("x", [B, I])
        w1, w2 = md.param("w1", [I, F], fan_out=["d_ff"]), md.param("w2", [F, I], fan_out=["d_in"])
        t1, t2 = md.param("t1", [I, F], fan_out=["d_ff"]), md.param("t2", [F, I], fan_out=["d_in"])

        def net(a, b):
            h = md.tanh(md.einsum("batch d_in, d_in d_ff -> batch d_ff", x, a))
            return md.einsum("batch d_ff, d_ff d_in -> batch d_in", h, b)

        diff = net(w1, w2) - md.stop_gradient(net(t1, t2)) - x
        loss = md.reduce_mean(diff * diff)
    m = cfg.momentum
    updates = {"t1": m * t1 + (1 - m) * w1, "t2": m * t2 + (1 - m) * w2} if cfg.ema else {}

    def feeds(seed=0):
        return {"x": torch.randn(cfg.batch, cfg.d_in, generator=torch.Generator().manual_seed(seed))}

    return md.Model(g, loss, {"w1": w1, "w2": w2}, feeds, cfg, updates=updates)
'''


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("ema") / "ema_model.py"
    p.write_text(MODEL_SRC)
    return p


def _optimizer(kind):
    return md.SGD(lr=0.1) if kind == "sgd" else md.AdamW(lr=0.05, weight_decay=0.01)


def _dense_by_hand(model_file, kind):
    """Losses and full params of a dense run whose EMA is computed in torch between steps."""
    model = md.load_model(str(model_file), ema=False)
    step = md.TrainStep(model.loss, model.params, "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")),
                        optimizer=_optimizer(kind))
    losses = []
    for t in range(STEPS):
        # cloned: on data:1 a full param is the live buffer, which the step updates in place
        before = {k: v.clone() for k, v in step.full_params(frozen=True).items()}
        losses.append(step(model.feeds(t))[0])
        step.set_params({k: M * before[k] + (1 - M) * before[f"w{k[1]}"] for k in ("t1", "t2")})
    return losses, step.full_params(frozen=True)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("mesh,layout", [
    ("data:2", "batch:data"),
    ("model:2", "d_ff:model"),
    ("data:2", "batch:data; params.d_in:data"),   # FSDP: each param and its update split over data
])
def test_frozen_params_after_3_steps_are_the_ema_of_the_dense_run(model_file, kind, mesh, layout):
    want_losses, want = _dense_by_hand(model_file, kind)
    model = md.load_model(str(model_file))
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=_optimizer(kind), updates=model.updates)
    losses = [step(model.feeds(t))[0] for t in range(STEPS)]
    got = step.full_params(frozen=True)
    # fp32 on a few-element sums: layouts only reorder partial sums, so a few ulps of 1e-5
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    for k in ("w1", "w2", "t1", "t2"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{k} on {mesh} / {layout}")
    # the targets moved (the test would not see a frozen-at-init target otherwise)
    assert not torch.equal(got["t1"], md.TrainStep(model.loss, model.params, "data:1", "",
                                                   md.SimulatedComm(md.Mesh.parse("data:1"))
                                                   ).full_params(frozen=True)["t1"])
    # no whole tensor is gathered for the update: the FSDP plan has the same collectives with or without it
    plain = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                         optimizer=_optimizer(kind))
    # (counted by their members: the gathers made back to back may pack otherwise, lowering/coalesce.py)
    assert _moved(step.plan) == _moved(plain.plan)


def _moved(plan) -> tuple[list[str], int]:
    """Each collective's kind once per member (a packed one's members as its plain kind), and the bytes."""
    colls = [s for s in plan.steps if s.is_collective]
    kinds = sorted(s.kind.removeprefix("bucket_") for s in colls for _ in s.ins)
    return kinds, sum(s.bytes for s in colls)


def test_fit_saves_the_updated_targets_and_resume_reproduces_the_run(model_file, tmp_path):
    full = md.fit(str(model_file), mesh="data:2", layout="batch:data", steps=4, lr=0.1)
    ck = tmp_path / "ck"
    md.fit(str(model_file), mesh="data:2", layout="batch:data", steps=2, lr=0.1, checkpoint=str(ck), save_every=2)
    rest = md.fit(str(model_file), mesh="data:2", layout="batch:data", steps=4, lr=0.1, checkpoint=str(ck),
                  resume=True)
    # a resumed run reads the saved targets: the same numbers as the uninterrupted run (fp32, same order)
    assert [r["loss"] for r in rest.rows] == pytest.approx([r["loss"] for r in full.rows[2:]], rel=1e-6)
    a, b = full.step.full_params(frozen=True), rest.step.full_params(frozen=True)
    torch.testing.assert_close(a["t1"], b["t1"], rtol=1e-6, atol=1e-7)


def test_fit_on_two_processes_updates_the_targets(model_file):
    one = md.fit(str(model_file), mesh="data:2", layout="batch:data; params.d_in:data", steps=3, lr=0.1)
    two = md.fit(str(model_file), mesh="data:2", layout="batch:data; params.d_in:data", steps=3, lr=0.1,
                 nproc=2, job_timeout=120)
    # gloo and the simulated mesh sum the same two halves: equal to fp32 rounding
    assert [r["loss"] for r in two.rows] == pytest.approx([r["loss"] for r in one.rows], rel=1e-5)
    frozen_at_init = md.fit(str(model_file), mesh="data:2", layout="batch:data", steps=3, lr=0.1,
                            config={"ema": False})
    assert [r["loss"] for r in one.rows][-1] != pytest.approx(frozen_at_init.rows[-1]["loss"], rel=1e-6)


def _graph():
    with md.Graph() as g:
        d = md.Dim("d", 3)
        w, t = md.param("w", [d]), md.param("t", [d])
        u = md.param("u", [md.Dim("e", 3)])
        loss = md.reduce_sum(w * w) + md.reduce_sum(md.stop_gradient(t * u))
    return g, loss, w, t, u


@pytest.mark.parametrize("updates,said", [
    (lambda w, t, u: {"tt": t}, "Did you mean 't'"),
    (lambda w, t, u: {"w": w * 0.5}, "a trained param"),
    (lambda w, t, u: {"t": u}, "the param is"),
    (lambda w, t, u: {"t": 1.0}, "not a Tensor"),
])
def test_a_bad_update_is_a_model_error_naming_it(updates, said):
    g, loss, w, t, u = _graph()
    with pytest.raises(ModelError) as e:
        md.Model(g, loss, {"w": w}, lambda s: {}, updates=updates(w, t, u))
    text = str(e.value)
    assert said in text and "frozen param" in text and "Traceback" not in text


def _moco_steps(mesh, layout, microbatches, names):
    model = md.load_model(str(HERE / "heldout_moco.py"), tiny=True)
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=md.AdamW(lr=0.05), microbatches=microbatches,
                        updates={k: model.updates[k] for k in names})
    return [step(model.feeds(t))[0] for t in range(STEPS)], step.full_params(frozen=True)


def test_a_pipelined_online_stacks_ema_matches_dense():
    """MoCo's key stack (its own layer dim, not pipelined) follows the query stack pipelined
    over layer:stage: the update reads the query params gathered over the stages."""
    names = ["k_w1", "k_w2", "k_ln"]
    want, want_p = _moco_steps("data:1", "", 1, names)
    got, got_p = _moco_steps("stage:2", "layer:stage", 2, names)
    # micro-batch sums in another order, three AdamW steps: ~1e-6 of the loss, 1e-5 of a weight
    assert got == pytest.approx(want, rel=1e-5)
    for k in names + ["q_w1"]:
        torch.testing.assert_close(got_p[k], want_p[k], rtol=0, atol=1e-5)


def test_an_update_reading_a_param_on_another_stage_matches_dense():
    """k_w_in's EMA reads q_w_in on the key encoder's stage, while q_w_in's gradient is made on
    stage 0: the pipeline updates q_w_in on every stage that holds it (lowering/partition.py's
    update_where_held), so every update applies from the second step on as densely."""
    names = sorted(md.load_model(str(HERE / "heldout_moco.py"), tiny=True).updates)
    want, want_p = _moco_steps("data:1", "", 1, names)
    got, got_p = _moco_steps("stage:2", "layer:stage", 2, names)
    assert got == pytest.approx(want, rel=1e-5)
    for k in names + ["q_w_in", "q_w1"]:
        torch.testing.assert_close(got_p[k], want_p[k], rtol=0, atol=1e-5)
