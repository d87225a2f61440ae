"""Uneven splits: dims their mesh axes do not divide, split as ``torch.tensor_split`` cuts.

The oracle is the dense program.  Every op family (embedding lookup, matmuls over a split
contracted or free dim, sum/max/mean, the softmax family and the cross-entropy over a split
vocab, layer norm, reshape, cumsum, broadcasting, windows, top-k, dropout) gives its numbers and
gradients with vocab 257, batch 10 and heads 6 on ``(4)`` and ``(2, 2)`` meshes; the parts tile
each dim and nest axis by axis (a property over sizes and meshes); a training run through the CLI on 4
gloo processes with uneven vocab, heads and batch splits matches the dense run step for step;
a checkpoint saved with an uneven split resumes on another mesh; strict splits refuse with
exit 2.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import meshdsl as md
from meshdsl.layout.sharding import Sharding, chunk, part_sizes
from meshdsl.train.checkpoint import latest_checkpoint, load_checkpoint
from meshdsl.train.data import default_corpus_text
from meshdsl.train.run_outputs import read_metrics

from conftest import run_cli

B, V, H, E, D = md.Dim("batch", 10), md.Dim("vocab", 257), md.Dim("heads", 6), md.Dim("e", 2), md.Dim("d", 4)
PARAMS = ("x", "table", "bias", "gain", "w_h")

# fp32 on both sides; a split sum adds its parts in another order, and a value's rounding
# grows with its size: 1e-5 of the output's own scale leaves room for that reordering only.
RTOL = 1e-5


def _assert_close(got, want, what):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * max(1.0, want.abs().max().item()), msg=what)


def _families():
    """One output per op family, over the uneven dims, and the gradient of their weighted sum."""
    with md.Graph():
        ids = md.input("ids", [B], dtype=torch.int64)
        labels = md.input("labels", [B], dtype=torch.int64)
        x, table, bias = md.param("x", [B, D]), md.param("table", [V, D]), md.param("bias", [V])
        gain, w_h = md.param("gain", [V]), md.param("w_h", [D, H, E])
        emb = md.gather(table, ids, "vocab")                                       # lookup, split vocab
        h = x + emb
        logits = md.einsum("batch d, vocab d -> batch vocab", h, table) + bias    # free split dim, broadcast add
        probs = md.softmax(logits, "vocab")
        heads = md.einsum("batch d, d heads e -> batch heads e", h, w_h)
        outs = {
            "embed": emb, "logits": logits, "softmax": probs, "log_softmax": md.log_softmax(logits, "vocab"),
            "logsumexp": md.logsumexp(logits, "vocab"), "xent": md.cross_entropy(logits, labels, "vocab"),
            "sum": md.reduce_sum(logits, "vocab"), "max": md.reduce_max(logits, "vocab"),
            "mean": md.reduce_mean(logits),
            "contract": md.einsum("batch vocab, vocab d -> batch d", probs, table),    # contracted split dim
            "norm": md.layer_norm(logits, "vocab", scale=gain),
            "heads": heads, "heads_max": md.reduce_max(heads, "heads"),
            "merged": md.rearrange(heads, "batch heads e -> batch (heads e)"),
            "cumsum": md.cumsum(logits, "vocab"), "cumsum_batch": md.cumsum(logits, "batch"),
            "shift": md.shift(logits, "batch", 1), "roll": md.roll(logits, "vocab", 3),       # windows
            "pad_slice": md.slice_(md.pad(logits, "batch", 1, 1), "batch", 0, B.size),
            "top_k": md.top_k(logits, "vocab", 2)[0],
            "dropout": md.dropout(logits, 0.25, seed=1),          # its mask hashes global positions
        }
        loss = sum(md.reduce_sum(v * (0.1 * (i + 1))) for i, v in enumerate(outs.values()))
        grads = md.grad(loss, [x, table, bias, gain, w_h])
    return {"loss": loss, **outs, **{f"grad/{k}": g for k, g in zip(PARAMS, grads)}}


def _feeds():
    gen = torch.Generator().manual_seed(0)
    return {"ids": torch.randint(0, V.size, (B.size,), generator=gen),
            "labels": torch.randint(0, V.size, (B.size,), generator=gen)}


@pytest.fixture(scope="module")
def families():
    outs = _families()
    return outs, md.run_dense(outs, _feeds())


@pytest.mark.parametrize("mesh, layout", [
    ("model:4", "vocab:model; heads:model"),                               # 65,64,64,64 and 2,2,1,1
    ("data:4", "batch:data"),                                              # 3,3,2,2
    ("data:4", "batch:data; params.vocab:data"),                           # params gathered and scattered
    ("data:2; model:2", "batch:(data,model); vocab:model; heads:(model,data)"),
    ("data:2; model:2", "vocab:(data,model); heads:(model,data)"),
    ("data:2; model:2", "batch:data; params.vocab:(data,model); heads:model"),
])
def test_every_family_matches_dense_forward_and_gradients(families, mesh, layout):
    outs, want = families
    plan = md.compile(outs, mesh, layout)
    assert any(n.startswith("uneven split:") for n in plan.notes), plan.notes
    got = md.run_simulated(plan, _feeds())
    for k, ref in want.items():
        _assert_close(got[k], ref, f"{k} on {mesh} / {layout}")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(2, 40), st.lists(st.integers(1, 3), min_size=1, max_size=3))
def test_parts_tile_the_dim_and_join_into_the_parts_above(size, sizes):
    mesh = md.Mesh(tuple((f"a{i}", s) for i, s in enumerate(sizes)))
    axes = mesh.names
    n = mesh.size
    assume(size >= n)   # an empty part is refused (below)
    parts = [chunk(size, mesh, r, axes) for r in mesh.group(0, axes)]
    assert [o for o, _ in parts] == [sum(k for _, k in parts[:i]) for i in range(n)]   # in order, no gap
    assert sum(k for _, k in parts) == size and {k for _, k in parts} <= {size // n, -(-size // n)}
    if size % n == 0:
        assert parts == [(i * size // n, size // n) for i in range(n)]                  # the even split
    # Joining the parts of the minor axis gives the part of the axes above it (an allgather),
    # cutting a part by the next axis gives the parts below it (a local split): both exact.
    above = axes[:-1]
    for r in range(n):
        off, length = chunk(size, mesh, r, above)
        group = mesh.group(r, axes[-1:])
        assert sum(part_sizes(size, mesh, group, axes)) == length
        assert chunk(size, mesh, group[0], axes)[0] == off
        local_off, local = chunk(length, mesh, r, axes[-1:])
        assert (off + local_off, local) == chunk(size, mesh, r, axes)


def test_strict_splits_refuse_with_the_dim_its_size_and_the_axes(families):
    outs, _ = families
    with pytest.raises(md.LayoutError) as info:
        md.compile(outs, "model:4", "vocab:model", strict_splits=True)
    msg = str(info.value)
    assert "dim 'vocab' of size 257 is not divisible by mesh axes model:4 (= 4)" in msg
    assert "parts: 65 x 1, 64 x 3" in msg and "^^^" in msg and "Fix:" in msg
    md.compile(outs, "model:4", "d:model", strict_splits=True)   # an even layout compiles


def test_a_part_with_nothing_in_it_is_refused(families):
    with pytest.raises(md.LayoutError) as info:
        md.compile(families[0], "model:8", "vocab:model; d:model")
    msg = str(info.value)
    assert "dim 'd' of size 4 is not divisible by mesh axes model:8 (= 8), and too small to split unevenly" in msg


def test_a_repeats_layers_split_unevenly_are_refused():
    m = md.load_model("transformer", tiny=True, layers=3)
    with pytest.raises(md.LayoutError) as info:
        md.compile(m.loss, "stage:2", "layer:stage", microbatches=2)
    assert "repeat 'repeat' has 3 layers (dim 'layer'), which mesh axes stage:2 (= 2) do not divide" in str(info.value)


def test_plan_notes_the_parts_and_strict_splits_exit_2(capsys):
    argv = ["plan", "transformer", "--tiny", "--mesh", "model:4", "--layout", "vocab:model", "--config", "vocab=257"]
    rc, out, err = run_cli(capsys, argv)
    assert rc == 0, err
    assert "uneven split: 'vocab' (257) over model:4: parts 65, 64, 64, 64" in out
    rc, out, err = run_cli(capsys, argv + ["--strict-splits"])
    assert rc == 2 and out == ""
    assert "dim 'vocab' of size 257 is not divisible by mesh axes model:4 (= 4)" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(default_corpus_text(20_000), encoding="utf-8")
    return str(path)


@pytest.mark.usefixtures("one_torch_thread")
def test_train_on_4_gloo_processes_with_uneven_splits_matches_dense(capsys, tmp_path, corpus):
    # vocab 257 on model (129 | 128), heads 6 on (model, data) (2, 1 | 2, 1), batch 10 on (data, model)
    # (3, 2 | 3, 2): every collective kind joins or cuts parts of unequal length, padded on gloo.
    common = ["train", "--tiny", "--config", "vocab=257,heads=6,batch=10", "--steps", "3", "--samples", "0",
              "--data", corpus, "--eval-every", "3"]
    rc, _, err = run_cli(capsys, common + ["--mesh", "data:1", "--out", str(tmp_path / "dense")])
    assert rc == 0, err
    rc, out, err = run_cli(capsys, common + ["--mesh", "data:2; model:2", "--layout",
                                             "batch:(data,model); vocab:model; heads:(model,data)",
                                             "--out", str(tmp_path / "mesh")])
    assert rc == 0, err
    assert all(k in out for k in ("allgather", "reduce_scatter", "alltoall"))
    dense, mesh = read_metrics(tmp_path / "dense"), read_metrics(tmp_path / "mesh")
    for key in ("loss", "eval_loss"):
        # AdamW on reordered fp32 sums: three steps stay within 1e-5 of the dense run.
        _assert_close(torch.tensor([r[key] for r in mesh if key in r]),
                      torch.tensor([r[key] for r in dense if key in r]), key)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_checkpoint_saved_uneven_resumes_and_loads_on_other_meshes(tmp_path, corpus):
    opts = dict(tiny=True, config={"vocab": 257}, samples=0, eval_batches=1, data=corpus, lr=0.5)
    losses = lambda r: torch.tensor([x["loss"] for x in r.rows])   # noqa: E731
    whole = md.fit("transformer", mesh="data:1", steps=6, **opts)
    ck = tmp_path / "ck"
    first = md.fit("transformer", mesh="model:4", layout="vocab:model", steps=3, checkpoint=str(ck),
                   save_every=3, **opts)                                               # 65, 64, 64, 64
    _assert_close(losses(first), losses(whole)[:3], "the uneven run's losses")
    saved = latest_checkpoint(ck)
    shutil.copytree(ck, tmp_path / "other")
    again = md.fit("transformer", mesh="data:2; model:2", layout="batch:data; vocab:(model,data)", steps=6,
                   checkpoint=str(tmp_path / "other"), resume=True, **opts)         # 65, 64 | 64, 64
    _assert_close(losses(again), losses(whole)[3:], "the resumed run's losses")
    # Loaded whole, and on a third uneven split (86, 86, 85), the table is the same tensor.
    table = md.Shape([md.Dim("vocab", 257), md.Dim("d_model", 8)])
    name = "param/wte"
    full = load_checkpoint(saved, {name: (table, torch.float32, Sharding.replicated(table))}, md.Mesh(()),
                           strict=False)[name][0]
    split = Sharding.of(table, {"vocab": ("model",)})
    parts = load_checkpoint(saved, {name: (table, torch.float32, split)}, "model:3", strict=False)[name]
    assert [p.shape[0] for p in parts] == [86, 86, 85]
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=0)
