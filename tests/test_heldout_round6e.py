"""Round 6e: the layouts ``meshdsl search --tiny --nproc 4`` itself proposes for held-out models,
run against the dense program.

The round ran the search's top layouts (and its best pipeline) of 24 held-out models on 4 real
gloo processes (``meshdsl check ... --nproc 4``), trained on several of them (``meshdsl train``,
with AdamW, ``--compile --compile-backend aot_eager``, ``--no-shm``, a resume onto another layout)
and compared each step's loss with a dense run; it also ran the top layouts `search --nproc 3`
proposes (uneven splits) on 3 processes. Every one matched. What is kept here: a few of the
proposed layouts whose mix the other rounds' cases do not have (a pipeline beside expert
parallelism, and beside the routed experts' own dim; four pipeline stages under zbh1 in a
user-written model; tensor parallelism over two dims of a user-written ViT, and over its 48
pixel features cut 3 ways), on the simulated mesh, and one of them on 2 real processes.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import assert_heldout_case_matches_dense, heldout_case_id, run_cli

HERE = Path(__file__).parent
DEEPSEEK, USERLLAMA, USERVIT = (str(HERE / f"heldout_{n}.py") for n in ("deepseek", "userllama", "uservit"))

# (model, config overrides, mesh, layout, compile keywords): each as `meshdsl search` ranked it
CASES = [
    (DEEPSEEK, {}, "pipe:2; model:2", "layer:pipe; experts:model", {"microbatches": 2, "schedule": "gpipe"}),
    (DEEPSEEK, {}, "pipe:2; model:2", "layer:pipe; expert_ff:model", {"microbatches": 2, "schedule": "gpipe"}),
    (USERLLAMA, {}, "pipe:4", "depth:pipe", {"microbatches": 2, "schedule": "zbh1"}),
    (USERLLAMA, {}, "pipe:2; model:2", "depth:pipe; n_heads:model; mlp:model", {"microbatches": 2, "schedule": "zbh1"}),
    (USERVIT, {}, "data:2; model:2", "batch:data; pixels:model; ph_pw_channels:model"),
    (USERVIT, {}, "model:3", "pixels:model"),                             # `search --nproc 3`'s best
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_a_search_proposed_layout_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.slow   # by default: its plan with a model axis besides, simulated (CASES' first two), an MoE pipeline on
# gloo (tests/test_local_parts.py::test_moe_on_unequal_stages_on_two_gloo_processes) and `check --nproc` of a pipeline
# (tests/test_pipeline_cli.py::test_check_pipelined_on_processes)
@pytest.mark.timeout(300)
def test_a_search_proposed_moe_pipeline_on_real_processes(capsys):
    """deepseek's dense first block and MoE blocks on two gloo stages of 2 micro-batches under
    gpipe: the search's best candidate for 4 processes ('pipe:2; model:2', 'layer:pipe') without
    its idle model axis, so that it runs on 2."""
    rc, out, err = run_cli(capsys, ["check", DEEPSEEK, "--tiny", "--mesh", "pipe:2", "--layout", "layer:pipe",
                                    "--microbatches", "2", "--schedule", "gpipe", "--nproc", "2"])
    assert rc == 0 and "OK: 26 outputs match the dense program" in out, (out, err)
