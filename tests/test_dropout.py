"""Dropout (meshdsl/ops/nn.py ``dropout``): the fraction it keeps, the values it keeps and drops,
its gradient, and its mask: the same on every layout, in every layer of a loop, and on a resumed run.

The mask is a hash of each element's global index, the seed and the kernel's salt
(``LocalCtx.salt``: the layer index inside a ``repeat``, else 0), so it is a fixed function of
those: the statistical bounds below are checked on fixed seeds and cannot flake, and a mask
compares bitwise wherever it is drawn.

Legend: batch (b), seq (s), feat (f); tensors are named by their dims (x_bsf = [batch, seq, feat]).
"""
from __future__ import annotations

import functools
import math
import zlib

import pytest
import torch

import meshdsl as md
from conftest import MESHES, dim_options, enumerate_layouts, layout_string, mesh_axes

#: sigmas of a binomial bound: a fair coin per element leaves it with probability ~2e-9, so a
#: fixed hash that breaks it is biased, and none that is fair fails it by chance.
SIGMAS = 6.0


def _dense(fn, feeds=None):
    """Build ``fn() -> outputs dict`` in a fresh graph and run the dense program."""
    with md.Graph():
        outs = fn()
        return md.run_dense(outs, feeds or {})


def _mask(dims, rate: float, seed: int) -> torch.Tensor:
    """Dropout's keep mask on ``dims``: where it leaves an input of ones non-zero."""
    def fn():
        return {"y": md.dropout(md.input("ones", dims), rate, seed=seed)}
    return _dense(fn, {"ones": torch.ones([d.size for d in dims])})["y"] != 0


def _within(count: int, n: int, p: float, what: str) -> None:
    """``count`` of ``n`` trials within SIGMAS binomial sigmas of ``n * p``."""
    sigma = math.sqrt(n * p * (1.0 - p))
    assert abs(count - n * p) <= SIGMAS * sigma, \
        f"{what}: {count} of {n} ({count / n:.4f}), want {p:.4f} +- {SIGMAS * sigma / n:.4f} ({SIGMAS:g} sigma)"


# ----------------------------------------------------------------------------- statistics

BIG = [md.Dim("batch", 64), md.Dim("seq", 64), md.Dim("feat", 64)]  # 262,144 elements: 6 sigma <= 0.6%
SEEDS = (0, 1, 12345)


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.9])
def test_kept_fraction_is_one_minus_rate(rate):
    masks = {seed: _mask(BIG, rate, seed) for seed in SEEDS}
    for seed, m in masks.items():
        _within(int(m.sum()), m.numel(), 1.0 - rate, f"rate {rate}, seed {seed}: kept")
        # every slice too (4,096 elements, 6 sigma <= 4.7%), so no index along any dim is favoured
        for pos, d in enumerate(BIG):
            for i, kept in enumerate(m.sum([j for j in range(m.dim()) if j != pos]).tolist()):
                _within(kept, m.numel() // d.size, 1.0 - rate, f"rate {rate}, seed {seed}, {d.name}={i}: kept")
    # Seeds draw independent masks: two agree where both keep or both drop.
    both = (1.0 - rate) ** 2 + rate ** 2
    for a, b in [(0, 1), (1, 12345)]:
        _within(int((masks[a] == masks[b]).sum()), masks[a].numel(), both, f"rate {rate}, seeds {a} and {b}: agree")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.75])
def test_kept_values_are_x_over_one_minus_rate_and_dropped_are_zero(rate, dtype):
    # Exact equalities: the mask multiplies by exactly 0 or 1, and the scale is one multiply of x
    # by 1/(1-rate) rounded to x's dtype (as torch's dropout scales).  Where 1/(1-rate) is a power
    # of two (0.5, 0.75) that is exactly x/(1-rate); elsewhere it is within one ulp of it.
    dims = [md.Dim("batch", 16), md.Dim("seq", 32)]
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1), dtype=dtype)
    x = torch.where(x == 0, 1.0, x).to(dtype)  # no zeros: a kept element reads non-zero

    def fn():
        return {"y": md.dropout(md.input("x", dims, dtype), rate, seed=4)}
    y = _dense(fn, {"x": x})["y"]
    keep = _mask(dims, rate, seed=4)
    assert 0 < int(keep.sum()) < keep.numel()
    assert torch.equal(y != 0, keep), "the values keep other elements than the mask of ones"
    assert torch.equal(y[~keep], torch.zeros_like(y[~keep]))
    scale = torch.tensor(1.0 / (1.0 - rate), dtype=dtype)
    assert torch.equal(y[keep], x[keep] * scale)
    exact = (x.double() / (1.0 - rate)).to(dtype)
    if rate in (0.5, 0.75):
        assert torch.equal(y[keep], exact[keep])
    else:  # one rounding of the scale, one of the product: within one ulp of the exact quotient
        torch.testing.assert_close(y[keep], exact[keep], rtol=torch.finfo(dtype).eps, atol=0.0)


@pytest.mark.parametrize("rate", [0.3, 0.5])
def test_gradient_is_the_same_mask_scaled(rate):
    # d/dx sum(dropout(x) * w) = w where x was kept, times 1/(1-rate), and exactly 0 where dropped:
    # the gradient rule redraws the forward's mask (dropout of the cotangent, same seed and dims).
    dims = [md.Dim("batch", 16), md.Dim("seq", 32)]
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))

    def fn():
        x = md.param("x", dims, scale=1.0)
        y = md.dropout(x, rate, seed=9)
        (gx,) = md.grad(md.reduce_sum(y * md.input("w", dims)), [x])
        return {"y": y, "gx": gx}
    out = _dense(fn, {"w": w})
    keep = _mask(dims, rate, seed=9)
    assert torch.equal(out["y"] != 0, keep)
    want = torch.where(keep, w * torch.tensor(1.0 / (1.0 - rate)), torch.zeros(()))
    assert torch.equal(out["gx"], want)  # both: w times the float32 scale, or exactly 0


# ----------------------------------------------------------------------------- the same mask on every layout

B, S, F = md.Dim("batch", 8), md.Dim("seq", 8), md.Dim("feat", 4)
L = md.Dim("layer", 3)
X = torch.randn(8, 8, 4, generator=torch.Generator().manual_seed(3))


def _layouts(mesh: str, names, leaves, cap: int) -> list[str]:
    """Every layout of ``names`` on ``mesh`` (or a sample of ``cap``) that the leaves accept."""
    axes = mesh_axes(mesh)
    options = dim_options({n: {s} for n, s in names.items()}, axes)
    return [layout_string(a) for a in enumerate_layouts(options, leaves, cap, seed=zlib.crc32(mesh.encode()))]


def _same_on_layouts(outs, feeds, mesh: str, layouts) -> None:
    """Every output of the simulated mesh equals the dense program's bitwise (each element is
    computed from its own inputs alone: no sum whose order a layout could change)."""
    want = md.run_dense(outs, feeds)
    bad = []
    for lay in layouts:
        got = md.run_simulated(md.compile(outs, mesh, lay), feeds)
        bad += [f"mesh '{mesh}' layout '{lay}': '{k}'" for k in want if not torch.equal(got[k], want[k])]
    assert not bad, "masks that differ from the dense program's:\n  " + "\n  ".join(bad[:8])


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_layout_draws_the_dense_mask(mesh):
    # a dim split over one axis or several (either order) must give the same global mask
    with md.Graph():
        x = md.input("x", [B, S, F])
        outs = {"r3": md.dropout(x, 0.3, seed=3), "r5": md.dropout(x, 0.5, seed=8)}
        layouts = _layouts(MESHES[mesh], {"batch": 8, "seq": 8, "feat": 4}, [("batch", "seq", "feat")], cap=24)
        assert len(layouts) >= 4
        _same_on_layouts(outs, {"x": X}, MESHES[mesh], layouts)


def _loops():
    """Two loops of ``L`` layers over [batch, seq, feat]:

    * ``code``: h <- 4 h + dropout(1) from h = 0 at rate 0.5, which adds 2 per kept element,
      so ``code / 2`` holds layer l's mask in base-4 digit ``L - 1 - l``;
    * ``chain``: h <- dropout(h) from a param x; its gradient (``gx``) passes the backward
      loop, which must redraw each layer's forward mask.
    """
    def add_mask(h, p):
        return h * 4.0 + md.dropout(h * 0.0 + 1.0, 0.5, seed=7) * p["one"]

    def drop(h, p):
        return md.dropout(h, 0.5, seed=7) * p["one"]

    ones = {"one": md.param("one", [L], init="ones")}
    code = md.repeat(add_mask, md.input("zeros", [B, S, F]), ones, "layer")
    x = md.param("x", [B, S, F], scale=1.0)
    chain = md.repeat(drop, x, {"one": md.param("one_b", [L], init="ones")}, "layer")
    (gx,) = md.grad(md.reduce_sum(chain * md.input("w", [B, S, F])), [x])
    return {"code": code, "chain": chain, "gx": gx}


def _digits(code: torch.Tensor) -> list[torch.Tensor]:
    v = (code / 2).to(torch.int64)
    return [(v // 4 ** (L.size - 1 - l)) % 4 == 1 for l in range(L.size)]


def test_each_layer_of_a_loop_draws_its_own_mask_on_every_layout():
    feeds = {"zeros": torch.zeros(8, 8, 4), "w": X}
    with md.Graph():
        outs = _loops()
        want = md.run_dense(outs, feeds)
        masks = _digits(want["code"])
        n = masks[0].numel()
        for l, m in enumerate(masks):
            _within(int(m.sum()), n, 0.5, f"layer {l}: kept")
        for a in range(L.size):  # the salt: each layer its own mask
            for b in range(a):
                _within(int((masks[a] == masks[b]).sum()), n, 0.5, f"layers {a} and {b}: agree")
        # The chain draws the same masks (same seed, dims and layers): x survives where every
        # layer kept it, and the backward loop drops what the forward dropped: w * 2**L there, else 0.
        alive = want["chain"] != 0
        assert torch.equal(alive, masks[0] & masks[1] & masks[2])
        assert torch.equal(want["gx"], torch.where(alive, X * 2.0 ** L.size, torch.zeros(())))
        for mesh in ("2x2", "2x2x2"):
            layouts = _layouts(MESHES[mesh], {"batch": 8, "seq": 8, "feat": 4}, [("batch", "seq", "feat")], cap=6)
            _same_on_layouts(outs, feeds, MESHES[mesh], layouts)


# ----------------------------------------------------------------------------- the same mask on resume

RESUME_MESH, RESUME_LAYOUT = "x:2; y:2", "batch:x; seq:y"
STEPS = 4


def _train_step():
    """A TrainStep whose SGD update shows the step's mask: loss = sum(dropout(x) * c), c >= 1 and
    lr 0.5, so a kept element of x moves by c >= 1 and a dropped one keeps its value exactly."""
    with md.Graph():
        x = md.param("x", [B, S], scale=1.0)
        loss = md.reduce_sum(md.dropout(x, 0.5, seed=3) * md.input("c", [B, S]))
        return md.TrainStep(loss, {"x": x}, RESUME_MESH, RESUME_LAYOUT,
                            md.SimulatedComm(md.Mesh.parse(RESUME_MESH)), lr=0.5)


def _feeds(t: int) -> dict:
    return {"c": 1.0 + torch.rand(8, 8, generator=torch.Generator().manual_seed(100 + t))}


def _run(step, first: int, last: int) -> list[torch.Tensor]:
    """The masks of steps ``first`` .. ``last - 1`` (0-based), run on ``step``."""
    masks = []
    for t in range(first, last):
        before = step.full_params()["x"]
        step(_feeds(t))
        masks.append(step.full_params()["x"] != before)
    return masks


@functools.cache
def _uninterrupted() -> tuple[torch.Tensor, ...]:
    return tuple(_run(_train_step(), 0, STEPS))


def test_a_resumed_run_draws_the_masks_of_an_uninterrupted_one():
    want = _uninterrupted()
    first = _train_step()
    _run(first, 0, 2)
    state = first.state()  # what a checkpoint holds: params, optimizer state and the step count
    # Another process history before the resume: other kernels ran, torch's global generator
    # moved (forked, so the tests after this one see it as it was).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(999)
        torch.rand(1000)
        _mask([B, S], 0.5, seed=3)
        resumed = _train_step()
        resumed.load_state(state)
        assert resumed.step_count == 2
        got = _run(resumed, 2, STEPS)
    for t, (g, w) in enumerate(zip(got, want[2:]), start=2):
        assert torch.equal(g, w), f"step {t}: the resumed run drops other elements than the uninterrupted one"


def test_each_step_draws_a_new_mask():
    """TrainStep salts its run by the step (ops.nn.step_salt): dropout is not a fixed mask."""
    masks = _uninterrupted()
    for t in range(1, STEPS):
        assert not torch.equal(masks[t], masks[0]), f"step {t} drops the elements step 0 dropped"


def test_every_step_draws_the_same_masks_on_every_layout():
    """Three training steps of the transformer with dropout, at lr 0 on one batch, so only
    the masks move the loss: the step's salt (ops.nn.step_salt) reaches the layers of a
    loop, of a pipeline stage and of accumulated micro-batches as it reaches the dense
    program's repeat, and each step draws new masks."""
    from meshdsl.ops.nn import step_salt
    from meshdsl.train.model import load_model

    model = load_model("transformer", tiny=True, dropout=0.3)
    feeds = model.feeds(0)
    dense = md.DenseProgram({"loss": model.loss})
    params = dense.init_params()
    want = torch.stack([dense(feeds, params, salt=step_salt(t))["loss"] for t in range(3)])
    assert len(set(want.tolist())) == 3, "every step draws new masks"
    runs = {"data:2": ("data:2", "batch:data", 1, "gpipe"), "1f1b": ("stage:2", "layer:stage", 2, "1f1b"),
            "accumulate": ("data:1", "", 2, "gpipe")}
    for name, (mesh, layout, m, schedule) in runs.items():
        ts = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                          lr=0.0, microbatches=m, schedule=schedule)
        got = torch.tensor([float(ts(feeds)[0]) for _ in range(3)], dtype=want.dtype)
        # fp32 sums in another order (micro-batches, shards): rounding of a loss of ~4.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=name)
