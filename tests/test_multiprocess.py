"""Models on real gloo processes give the dense program's loss and gradients.

One spawn per process count runs every (model, mesh, layout) case in turn, to
keep process start-up (about 2 s of CPU per rank on this machine) out of the
suite's time.  Each case cross-checks the plan signature across ranks first.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.comm.distributed import TorchComm
from meshdsl.processes.launcher import spawn
from meshdsl.train.model import load_model
from meshdsl.train.jobs import check_job

# (mesh, layout) per family; the tiny configs divide by every axis size used here.
CASES = {
    2: [("data:2", "batch:data"),                                   # DP
        ("model:2", "d_ff:model; heads:model"),                     # Megatron TP
        ("data:2", "batch:data; params.d_model:data"),              # FSDP / ZeRO-3
        ("model:2", "seq:model")],                                  # sequence parallel
    4: [("data:2; model:2", "batch:data; d_ff:model; heads:model"),  # DP + TP
        ("data:2; model:2", "batch:data; params.d_model:data; d_ff:model"),
        ("data:2; model:2", "batch:data; seq:model")],
    8: [("data:2; model:2; extra:2", "batch:(data,extra); d_ff:model; heads:model"),
        ("data:4; model:2", "batch:data; params.d_model:data; heads:model; seq:model")],
}
MODELS = ("mlp", "transformer")
MLP_DIMS = ("batch", "d_model", "d_ff")


def _only(layout: str, dims) -> str:
    """The rules of ``layout`` whose dim the MLP has."""
    return "; ".join(r.strip() for r in layout.split(";") if r.split(":")[0].strip().split(".")[-1] in dims)


def _all_cases(rank: int, cases):
    out = []
    for model, mesh, layout in cases:
        comm = TorchComm(mesh)
        out.append(check_job(comm, model, True, mesh, layout))
    return out


def _dense(model_name: str):
    m = load_model(model_name, tiny=True)
    return md.run_dense({"loss": m.loss, **{f"grad/{k}": g for k, g in m.grads().items()}}, m.feeds(0))


# 8 processes run with -m slow: test_distributed.py's 'a:2; b:2; c:2' runs every collective on 8
# gloo ranks over three axes, and 2 and 4 processes keep the models on gloo.
@pytest.mark.parametrize("nproc", [pytest.param(n, marks=pytest.mark.slow) if n == 8 else n for n in sorted(CASES)])
def test_models_match_dense(nproc):
    cases = []
    for mesh, layout in CASES[nproc]:
        cases.append(("transformer", mesh, layout))
        mlp = _only(layout, MLP_DIMS)
        if mlp and ("mlp", mesh, mlp) not in cases:
            cases.append(("mlp", mesh, mlp))
    results = spawn(_all_cases, nproc, args=(cases,), timeout=240)[0]
    refs = {m: _dense(m) for m in MODELS}
    for (model, mesh, layout), got in zip(cases, results):
        want = refs[model]
        assert set(got) == set(want)
        for k in want:
            # fp32; gloo sums in another order than the dense kernels, and the
            # values are O(1): 1e-5 absolute leaves room for that rounding only.
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5,
                                       msg=lambda s: f"{model} on {mesh} / {layout}, {k}: {s}")
