"""Where values live: params made and feeds moved to the communicator's device, kernels
allocating beside their inputs, the device and backend checks.

The CPU tests run everywhere.  ``test_kernels_allocate_beside_their_inputs`` sets torch's
default device to ``meta`` while the steps run on the CPU: a kernel that makes a tensor
without naming a device (instead of following its inputs or the run's device) gets a meta
tensor, and mixing it with the CPU values fails.  That is the bug a GPU run would hit, found
without a GPU.  The ``cuda`` tests run only where torch sees a GPU: the simulated mesh on
the GPU against the dense program on the CPU, forward and gradients (tolerance as
``meshdsl check``'s, relative to each output's magnitude).
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.errors import DistributedError, MeshDSLError
from meshdsl.comm import distributed
from meshdsl.comm.communicator import as_device
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.runtime.simulated import run_simulated
from meshdsl.layout.mesh import Mesh
from meshdsl.tools import cli
from meshdsl.tools.compare import allowed_diff
from meshdsl.train.model import load_model
from meshdsl.train.optimizers import SGD, Adafactor, AdamW
from meshdsl.train.step import TrainStep

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no GPU here (runs where torch sees one)")

#: (model, config overrides, mesh, layout, micro-batches, optimizer, precision): one per family
CASES = [
    ("transformer", {"dropout": 0.1}, "data:2", "batch:data", 1, None, "fp32"),
    ("transformer", {}, "model:2", "heads:model; d_ff:model; vocab:model", 1, "adamw", "fp32"),
    ("transformer", {}, "data:2; model:2", "batch:data; d_ff:model; seq:model", 1, "adafactor", "bf16"),
    ("transformer", {}, "stage:2", "layer:stage", 4, "adamw", "fp32"),
    ("transformer", {}, "data:2", "batch:data; params.d_model:data", 1, "adamw", "fp32"),
    ("moe", {}, "data:2", "batch:data; experts:data", 1, "adamw", "fp32"),
    ("mlp", {}, "model:2", "d_ff:model", 1, "sgd", "fp32"),
    # uneven splits (vocab 17, heads 6, batch 10 on 2 x 2): their collectives pad and trim parts
    ("transformer", {"vocab": 17, "heads": 6, "batch": 10}, "data:2; model:2",
     "batch:(data,model); vocab:model; heads:(model,data)", 1, "adamw", "fp32"),
]
OPTIMIZERS = {None: None, "sgd": lambda: SGD(lr=0.1), "adamw": lambda: AdamW(lr=1e-3),
              "adafactor": lambda: Adafactor(lr=1e-3)}


def _step(case, device=None):
    name, over, mesh, layout, mb, opt, precision = case
    model = load_model(name, tiny=True, **over)
    kw = {"schedule": "1f1b"} if mb > 1 else {}
    opt = OPTIMIZERS[opt]() if opt else None
    ts = TrainStep(model.loss, model.params, mesh, layout, SimulatedComm(Mesh.parse(mesh), device=device),
                   optimizer=opt, clip_norm=1.0 if opt else None, microbatches=mb, precision=precision, **kw)
    return model, ts


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[3]}")
def test_kernels_allocate_beside_their_inputs(case):
    model, ts = _step(case)
    feeds = model.feeds(0)
    hyper = ts.hyper_feeds

    def cpu_hyper(lr=None):  # the step's learning-rate feeds, made as a user's loop makes them
        torch.set_default_device(None)
        try:
            return hyper(lr)
        finally:
            torch.set_default_device("meta")
    ts.hyper_feeds = cpu_hyper
    torch.set_default_device("meta")
    try:
        losses = [ts(feeds)[0] for _ in range(2)]
    finally:
        torch.set_default_device(None)
    assert all(x == x and x > 0 for x in losses), losses   # real numbers: nothing ran on meta
    for xs in ts.params.values():
        assert all(x is None or x.device.type == "cpu" for x in xs)


def test_dense_program_runs_where_its_feeds_are():
    model = load_model("transformer", tiny=True)
    prog = md.DenseProgram({"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}})
    want = prog(model.feeds(0))
    feeds = model.feeds(0)
    torch.set_default_device("meta")
    try:
        got = prog(feeds)  # params made by the program itself, beside the feeds
    finally:
        torch.set_default_device(None)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_device_names_are_checked():
    assert as_device(None) == torch.device("cpu") == as_device("cpu")
    with pytest.raises(MeshDSLError, match="unknown device 'gpu'") as e:
        as_device("gpu")
    assert "Rule:" in str(e.value) and "Fix:" in str(e.value)
    if not CUDA:
        with pytest.raises(MeshDSLError, match="needs CUDA, and CUDA is not available"):
            SimulatedComm(Mesh.parse("data:2"), device="cuda")


def test_nccl_needs_a_gpu_per_process(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert distributed.resolve_backend("auto", 1) == "nccl"
    assert distributed.resolve_backend("auto", 2) == "gloo"   # auto never asks for more GPUs than there are
    with pytest.raises(DistributedError, match="backend 'nccl' with 2 processes on a machine with 1 GPU") as e:
        distributed.resolve_backend("nccl", 2)
    assert "Fix: run at most 1 process(es) here, or use --backend gloo" in str(e.value)


def test_check_device_flag(capsys):
    rc = cli.main(["check", "transformer", "--tiny", "--mesh", "data:2", "--layout", "batch:data",
                   "--device", "gpu"])
    assert rc == 2 and "unknown device 'gpu'" in capsys.readouterr().err
    rc = cli.main(["check", "mlp", "--tiny", "--mesh", "data:2", "--layout", "batch:data", "--nproc", "2",
                   "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and "--device places a run in this process" in err and "drop --device" in err


# ----------------------------------------------------------------------------- on a GPU

@needs_cuda
@pytest.mark.parametrize("mesh,layout", [("data:2; model:2", "batch:data; d_ff:model; heads:model"),
                                         ("data:2; model:2", "batch:data; seq:model; vocab:model"),
                                         ("data:4", "batch:data; params.d_model:data")])
def test_simulated_mesh_on_gpu_matches_dense_cpu(mesh, layout):
    model = load_model("transformer", tiny=True)
    outputs = {"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}
    want = md.run_dense(outputs, model.feeds(0))
    got = run_simulated(md.compile(outputs, mesh, layout), model.feeds(0), device="cuda")
    allowed = allowed_diff(want, 1e-4)
    for k, ref in want.items():
        assert got[k].device.type == "cuda"
        assert (got[k].cpu().double() - ref.double()).abs().max().item() <= allowed[k], k


@needs_cuda
@pytest.mark.parametrize("case", [c for c in CASES if c[6] == "fp32" and not c[1]], ids=lambda c: f"{c[0]}-{c[3]}")
def test_train_steps_on_gpu_match_cpu(case):
    losses = {}
    for dev in ("cpu", "cuda"):
        model, ts = _step(case, dev)
        losses[dev] = [ts(model.feeds(0))[0] for _ in range(3)]
        assert all(x is None or x.device.type == dev for xs in ts.params.values() for x in xs)
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-4)


def test_train_device_flag(capsys, tmp_path):
    rc = cli.main(["train", "--tiny", "--steps", "1", "--out", str(tmp_path), "--device", "gpu"])
    assert rc == 2 and "unknown device 'gpu'" in capsys.readouterr().err
    rc = cli.main(["train", "--tiny", "--steps", "1", "--out", str(tmp_path), "--mesh", "data:2", "--nproc", "2",
                   "--device", "cuda"])
    assert rc == 2 and "train --device cuda with processes" in capsys.readouterr().err


@needs_cuda
def test_fit_on_gpu_matches_cpu(tmp_path):
    """``md.fit(..., device="cuda")``: the training loop, its eval and its feeds on the GPU."""
    results = {}
    for dev in ("cpu", "cuda"):
        model = load_model("transformer", tiny=True)
        results[dev] = md.fit(model, mesh="data:1", steps=4, data=lambda step, m=model: m.feeds(step),
                              eval_data=[model.feeds(100)], eval_every=2, out=str(tmp_path / dev), samples=0,
                              device=dev)
    assert results["cuda"].final_eval_loss == pytest.approx(results["cpu"].final_eval_loss, rel=1e-4)


@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,n_q,tol", [(torch.float32, 64, 1e-5), (torch.float32, 40, 1e-5),
                                           (torch.bfloat16, 64, 2e-2)])
def test_gpu_attention_kernels_match_the_cpu_kernel(causal, dtype, n_q, tol):
    """The GPU's attention (CUDA's fused kernel, or the math form where it declines) against the
    CPU's fused kernel: out, logsumexp and the three gradients, for a query slice at 0 too."""
    from meshdsl.ops.attention import _BWD, _FWD, _backward, _forward
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 64, generator=g).to(dtype) for n in (n_q, 64, 64))
    dout = torch.randn(2, 4, n_q, 64, generator=g).to(dtype)
    out, lse = _FWD(q, k, v, 0.0, causal, scale=None)
    want = _BWD(dout, q, k, v, out, lse, 0.0, causal, scale=None)
    cu = [x.cuda() for x in (q, k, v, dout)]
    g_out, g_lse = _forward(*cu[:3], causal, None, None)
    got = _backward(cu[3], *cu[:3], g_out, g_lse, causal, None, None)
    torch.testing.assert_close(g_out.cpu(), out, rtol=tol, atol=tol)
    torch.testing.assert_close(g_lse.cpu(), lse, rtol=tol, atol=tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=tol, atol=tol)


def test_attention_form_is_checked(monkeypatch):
    from meshdsl.ops.attention import attention_mode
    assert attention_mode() in ("fused", "math")
    monkeypatch.setenv("MESHDSL_ATTENTION", "flash")
    with pytest.raises(MeshDSLError, match="MESHDSL_ATTENTION='flash' is not an attention form meshdsl knows") as e:
        attention_mode()
    assert "fused, math" in str(e.value) and "Fix: unset MESHDSL_ATTENTION" in str(e.value)


def test_torchrun_backend_check_counts_local_processes(monkeypatch):
    """Under torchrun the preflight knows LOCAL_WORLD_SIZE: nccl with more local processes
    than GPUs is refused before the model loads; auto is left to pick gloo."""
    import argparse

    from meshdsl.tools.dist_cli import preflight_processes
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    mesh = Mesh.parse("data:2")
    preflight_processes(argparse.Namespace(backend="auto", nproc=None, max_procs=None), mesh)
    with pytest.raises(DistributedError, match="backend 'nccl' with 2 processes on a machine with 1 GPU"):
        preflight_processes(argparse.Namespace(backend="nccl", nproc=None, max_procs=None), mesh)


@needs_cuda
@pytest.mark.parametrize("mesh,layout", [("data:1", ""), ("model:2", "heads:model; d_ff:model")])
def test_compiled_whole_step_on_gpu_is_one_cuda_graph(mesh, layout):
    """``--compile`` on a GPU: the whole step is captured as a CUDA graph; its numbers are the
    eager executor's within ``check``'s tolerance (inductor reorders sums), every call reads its
    own inputs, and what an earlier call returned is not overwritten by a later replay."""
    model = load_model("transformer", tiny=True)
    outputs = {"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}
    plan = md.compile(outputs, mesh, layout)
    comm = SimulatedComm(plan.mesh, device="cuda")
    eager, graphed = md.Executor(plan, comm), md.Executor(plan, comm, compile=True)
    runs = []
    for seed in (0, 1, 2):
        params = eager.init_params(seed)
        feeds = {k: v.cuda() for k, v in model.feeds(seed).items()}
        runs.append((graphed.run(feeds, params), eager.run(feeds, params)))
    stats = graphed.compiling.stats
    assert (stats.whole, stats.cuda_graphs, stats.fallbacks) == (1, 1, []), stats.summary()
    for got, want in runs:   # checked after the last replay: the kept outputs are the caller's own
        allowed = allowed_diff({k: v[0] for k, v in want.items()}, 1e-4)
        for k in want:
            for g, w in zip(got[k], want[k]):
                assert (g.double() - w.double()).abs().max().item() <= allowed[k], k
    assert runs[0][0]["loss"][0].item() != runs[1][0]["loss"][0].item()
