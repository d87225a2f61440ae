"""Held-out models of round 16a (written from the README and docs alone): Double DQN, a GRU
encoder-decoder with additive attention, a Temporal Fusion Transformer (lite), the RNN-T loss and
an Instant-NGP hash encoding.

``tests/heldout_dqn.py`` (an MLP Q-network whose stack runs s and s' at once, Double DQN's
argmax by the online net, a frozen target network or ``md.stop_gradient``, a Huber loss from
ops, actions by ``md.one_hot``); ``tests/heldout_gruattn.py`` (GRU cells as an inner ``md.repeat``
over the source in a layer stack, or one outer scan; additive scores over ``[batch, tq, tk,
d_att]``; teacher forcing); ``tests/heldout_tft.py`` (variable selection by per-variable GRNs and
a softmax over ``vars``, GLU-gated residual networks, a causal conv or GRU encoder, interpretable
attention with a shared V, the quantile loss); ``tests/heldout_rnnt.py`` (a joint network's
``[batch, t, u, vocab]`` log-probs and the forward variable over the lattice, an outer repeat
over ``t``, along ``u`` a masked logsumexp or an inner repeat); ``tests/heldout_ngp.py``
(multiresolution hashed grid corners by floor, integer multiply and modulo, ``md.gather`` or a
one-hot contraction per level, bilinear weights, an MLP). Each runs under data, Megatron,
sequence/feature splits (2-way, uneven 3-way), FSDP, pipelines (1f1b, zbh1, interleaved) and remat
against the dense program. Findings: /work/notes/heldout-16a.md.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id,
                      run_cli)

HERE = Path(__file__).parent
DQN, GRUATTN, TFT, RNNT, NGP = (str(HERE / f"heldout_{n}.py") for n in ("dqn", "gruattn", "tft", "rnnt", "ngp"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
STOPGRAD, SCAN_ENC, GRU_ENC, SCAN_ALPHA, ONEHOT = ({"target": "stopgrad"}, {"enc": "scan"}, {"enc": "gru"},
                                                  {"alpha": "scan"}, {"lookup": "onehot"})
SUM_HASH = {"hash": "sum"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (RNNT, {}, "model:3", "u:model"),                         # the lattice's label dim, uneven
    (NGP, ONEHOT, "model:3", "levels:model"),                 # per-level tables, uneven
    (NGP, {}, "model:2", "corner:model"),                     # the xor hash of split corners
]

# more of the same kinds, with -m slow
SLOW_CASES = [
    (DQN, {}, "data:2", "batch:data"),
    (DQN, {}, "model:2", "hidden:model"),
    (DQN, STOPGRAD, "model:2", "hidden:model"),
    (DQN, {}, "model:3", "actions:model"),
    (DQN, {}, "data:3", "batch:data"),
    (DQN, {}, "data:2; model:2", "batch:data; hidden:model"),
    (DQN, {}, "model:2", "pair:model"),
    (DQN, {}, "data:2", "batch:data; params.hidden:data"),
    (DQN, {}, "stage:2", "layer:stage; target_layer:stage", PIPE),
    (DQN, STOPGRAD, "stage:2", "layer:stage", ZBH1),
    (DQN, {"layers": 4}, "stage:2", "layer:stage; target_layer:stage", INTERLEAVED),
    (DQN, {"remat": "full"}, "stage:2; data:2", "layer:stage; batch:data", PIPE),
    (DQN, {"remat": "selective"}, "model:2", "hidden:model"),
    (GRUATTN, {}, "data:2", "batch:data"),
    (GRUATTN, {}, "model:2", "hidden:model"),
    (GRUATTN, {}, "model:2", "d_att:model"),
    (GRUATTN, {}, "model:2", "tk:model"),
    (GRUATTN, {}, "model:3", "tk:model"),
    (GRUATTN, SCAN_ENC, "model:3", "hidden:model"),
    (GRUATTN, {}, "data:2; model:2", "batch:data; d_att:model"),
    (GRUATTN, {}, "model:2", "vocab:model"),
    (GRUATTN, {}, "data:2", "batch:data; params.hidden:data"),
    (GRUATTN, {}, "stage:2", "layer:stage", PIPE),
    (GRUATTN, {}, "stage:2", "layer:stage", ZBH1),
    (GRUATTN, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (GRUATTN, {"remat": "full"}, "stage:2; data:2", "layer:stage; batch:data", PIPE),
    (TFT, {}, "data:2", "batch:data"),
    (TFT, {}, "model:2", "heads:model; d_hid:model"),
    (TFT, {}, "model:2", "vars:model"),
    (TFT, {}, "model:3", "vars:model"),
    (TFT, {}, "model:2", "seq:model"),
    (TFT, {}, "model:3", "seq:model"),
    (TFT, GRU_ENC, "model:2", "d_model:model"),
    (TFT, GRU_ENC, "model:3", "seq:model"),                   # the GRU's inner repeat gathers seq
    (TFT, {}, "data:2; model:2", "batch:data; heads:model; d_hid:model"),
    (TFT, {}, "data:2", "batch:data; params.d_model:data"),
    (TFT, GRU_ENC, "stage:2", "layer:stage", PIPE),
    (TFT, {}, "stage:2", "layer:stage", ZBH1),
    (TFT, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (TFT, {"remat": "selective"}, "model:2", "heads:model"),
    (RNNT, {}, "data:2", "batch:data"),
    (RNNT, SCAN_ALPHA, "data:3", "batch:data"),
    (RNNT, {}, "model:2", "vocab:model"),
    (RNNT, SCAN_ALPHA, "model:3", "vocab:model"),
    (RNNT, SCAN_ALPHA, "model:2", "u:model"),
    (RNNT, {}, "data:2; model:2", "d_joint:data; d_ff:model"),
    (RNNT, {}, "data:2; model:2", "batch:data; vocab:model"),
    (RNNT, {}, "data:2", "batch:data; params.d_joint:data"),
    (RNNT, {"batch": 4}, "stage:2", "layer:stage", PIPE),
    (RNNT, {"batch": 4}, "stage:2", "t:stage", ZBH1),
    (RNNT, {"batch": 4, "layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (RNNT, {"remat": "full"}, "model:2", "vocab:model"),
    (NGP, {}, "data:2", "points:data"),
    (NGP, SUM_HASH, "model:2", "coord:model"),
    (NGP, {}, "model:2", "coord:model"),
    (NGP, {}, "data:3", "points:data"),
    (NGP, {}, "model:2", "feat:model"),
    (NGP, ONEHOT, "model:2", "feat:model"),
    (NGP, {}, "model:2", "levels:model"),
    (NGP, {}, "model:3", "entries:model"),
    (NGP, {}, "data:2; model:2", "points:data; feat:model"),
    (NGP, ONEHOT, "data:2; model:2", "points:data; levels:model"),
    (NGP, {}, "data:2", "points:data; params.entries:data"),
    (NGP, {}, "stage:2", "layer:stage", PIPE),
    (NGP, ONEHOT, "stage:2", "layer:stage", ZBH1),
    (NGP, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (NGP, {"remat": "full"}, "stage:2; data:2", "layer:stage; points:data", PIPE),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _rnnt_brute_force(lp, targets, num_t: int, num_u: int):
    """log P(labels | frames) by the transducer lattice's DP, one cell at a time, in float64."""
    out = []
    for b in range(lp.shape[0]):
        alpha = torch.full((num_t, num_u + 1), -math.inf, dtype=torch.float64)
        alpha[0, 0] = 0.0
        for t in range(num_t):
            for u in range(num_u + 1):
                ways = ([alpha[t - 1, u] + lp[b, t - 1, u, 0]] if t else []) + \
                       ([alpha[t, u - 1] + lp[b, t, u - 1, targets[b, u - 1]]] if u else [])
                if ways:
                    alpha[t, u] = torch.logsumexp(torch.stack(ways), 0)
        out.append(alpha[num_t - 1, num_u] + lp[b, num_t - 1, num_u, 0])
    return torch.stack(out)


@pytest.mark.parametrize("alpha", ["cumsum", "scan"])
def test_rnnt_log_likelihood_is_the_lattice_dp(alpha):
    """Both forms of the forward variable give a brute-force DP's log-likelihood of the model's own
    log-probs (T=6, U=4)."""
    model = md.load_model(RNNT, tiny=True, alpha=alpha)
    feeds = model.feeds(0)
    got = md.run_dense({"ll": model.outputs["loglik"], "lp": model.outputs["log_probs"]}, feeds)
    want = _rnnt_brute_force(got["lp"].double(), feeds["targets"], model.config.t, model.config.labels)
    # fp32 logsumexps over ~10 lattice steps of values ~10: ~1e-6 absolute; a wrong move is O(1)
    torch.testing.assert_close(got["ll"].double(), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("hash_", ["xor", "sum"])
def test_ngp_hash_encoding_matches_torch(hash_):
    """The hashed multiresolution encoding, written again in plain torch: the bilinear mix of the
    four hashed corners' rows of each level's table (gather form) gives the model's colours."""
    model = md.load_model(NGP, tiny=True, hash=hash_)
    cfg, feeds = model.config, model.feeds(0)
    prog = md.DenseProgram({"rgb": model.outputs["rgb"]})
    params = prog.init_params(0)
    got = prog(feeds, params)["rgb"]
    xy, table, feats = feeds["xy"], params["table"], []
    for level in range(cfg.levels):
        scaled = xy * float(cfg.base_res * cfg.growth ** level)
        cell, frac = scaled.floor().long(), scaled - scaled.floor()
        mix = 0.0
        for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
            hx, hy = (cell[:, 0] + dx) * 1, (cell[:, 1] + dy) * 2654435761
            h = ((hx ^ hy) if hash_ == "xor" else (hx + hy)) % cfg.table + level * cfg.table
            w = (frac[:, 0] if dx else 1 - frac[:, 0]) * (frac[:, 1] if dy else 1 - frac[:, 1])
            mix = mix + w[:, None] * table[h]
        feats.append(mix)
    enc = torch.stack(feats, 1)                                          # [points, levels, feat]
    h = torch.relu(torch.einsum("plf,lfh->ph", enc, params["w_in"]) + params["b_in"])
    for i in range(cfg.layers):
        h = torch.relu(h @ params["w_h"][i] + params["b_h"][i])
    want = torch.sigmoid(h @ params["w_out"])
    # the same fp32 ops in another order: ~1e-7; a wrong corner or hash is O(1e-2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_bitwise_xor_is_torchs_and_refuses_floats():
    """``md.bitwise_xor`` (Instant-NGP's hash had no xor to use): torch's numbers on int64, split or
    not; a float operand is a ShapeError naming it."""
    n = md.Dim("n", 6)
    with md.Graph():
        a, b = md.input("a", [n], dtype=torch.int64), md.input("b", [n], dtype=torch.int64)
        y = md.bitwise_xor(a * 2654435761, b) % 11
        feeds = {"a": torch.tensor([0, 1, 2, 3, 40, 5]), "b": torch.tensor([7, 7, 9, 1000, 3, 12])}
        want = (feeds["a"] * 2654435761 ^ feeds["b"]) % 11
        torch.testing.assert_close(md.run_dense({"y": y}, feeds)["y"], want)       # integers: exact
        torch.testing.assert_close(md.run_simulated(md.compile({"y": y}, "x:4", "n:x"), feeds)["y"], want)
        with pytest.raises(md.ShapeError, match=r"(?s)not an integer tensor.*float32.*cast first"):
            md.bitwise_xor(md.input("f", [n]), a)


def test_double_dqn_loss_matches_torch():
    """Double DQN's TD loss written again in torch (online argmax, target value, done mask,
    Huber): the model's loss."""
    model = md.load_model(DQN, tiny=True)
    cfg, feeds = model.config, model.feeds(0)
    prog = md.DenseProgram({"loss": model.loss})
    p = prog.init_params(0)

    def q(s, pre):
        h = torch.relu(s @ p[f"{pre}w_in"] + p[f"{pre}b_in"])
        for i in range(cfg.layers):
            h = h + torch.relu(h @ p[f"{pre}w_h"][i] + p[f"{pre}b_h"][i])
        return h @ p[f"{pre}w_out"] + p[f"{pre}b_out"]

    a_star = q(feeds["s_next"], "").argmax(1)
    q_next = q(feeds["s_next"], "target_").gather(1, a_star[:, None])[:, 0]
    td = feeds["reward"] + cfg.gamma * (1 - feeds["done"]) * q_next
    q_sa = q(feeds["s"], "").gather(1, feeds["action"][:, None])[:, 0]
    want = F.huber_loss(q_sa, td, delta=1.0)
    # the same fp32 ops in another order: ~1e-7 relative; a wrong target or action is O(1)
    torch.testing.assert_close(prog(feeds, p)["loss"], want, rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (DQN, "model:2", "hidden:model"),
    (GRUATTN, "model:2", "tk:model"),
    (TFT, "model:2", "seq:model"),
    (RNNT, "model:2", "vocab:model"),
    (NGP, "model:2", "levels:model"),
], ids=["dqn", "gruattn", "tft", "rnnt", "ngp"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [DQN, GRUATTN, TFT, RNNT, NGP], ids=["dqn", "gruattn", "tft", "rnnt", "ngp"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (DQN, "data:2; model:2", "batch:data; hidden:model"),
    (GRUATTN, "data:2; model:2", "batch:data; tk:model"),
    (TFT, "data:2; model:2", "batch:data; seq:model"),
    (RNNT, "data:2; model:2", "batch:data; vocab:model"),
    (NGP, "data:2; model:2", "points:data; feat:model"),
], ids=["dqn", "gruattn", "tft", "rnnt", "ngp"])
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    from conftest import adamw_dense_curve
    model = md.load_model(path, tiny=True)
    opt = md.AdamW(lr=0.01, weight_decay=0.1)
    want, _ = adamw_dense_curve(model, opt, 1.0, 3)
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=opt, clip_norm=1.0)
    got = [step(model.feeds(i), lr=0.01)[0] for i in range(3)]
    # fp32 sums in another order over three steps: ~1e-6 relative; a wrong update is O(1e-2)
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    assert want[0] != pytest.approx(want[-1], rel=1e-4)      # the steps moved the loss
