"""Sharded checkpoints: save on one mesh and layout, load on any other; atomic commits; clear errors.

The oracle is the full tensor: every rank's loaded slice must equal the slice
of the full tensor its new sharding gives, bit for bit (a checkpoint copies
bytes, so there is no tolerance).
"""
from __future__ import annotations

import json
import os
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import meshdsl.train.checkpoint_load as checkpoint_load
from conftest import kill_when_marked
from meshdsl.core.shape import Dim, Shape
from meshdsl.errors import MeshDSLError
from meshdsl.exec.launch import spawn
from meshdsl.exec.simulated import SimulatedComm
from meshdsl.layout.mesh import Mesh
from meshdsl.layout.sharding import Sharding
from meshdsl.train.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, read_metadata,
                                      save_checkpoint)

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"w": Shape([Dim("d_model", 4), Dim("d_ff", 12)]),
          "emb": Shape([Dim("vocab", 6), Dim("d_model", 4)]),
          "b": Shape([Dim("d_ff", 12)])}
DTYPES = {"w": torch.float32, "emb": torch.bfloat16, "b": torch.int64}

# (mesh, {dim: axes}) pairs; the same split applies to every tensor that has the dim.
CONFIGS = [
    ("", {}),                                                          # one process, no axes
    ("data:2", {}),                                                    # replicated everywhere
    ("data:2; model:2", {"d_ff": ("model",)}),                         # tensor parallel
    ("data:2; model:2", {"d_model": ("data",), "d_ff": ("model",)}),   # FSDP + TP
    ("x:4", {"d_ff": ("x",), "vocab": ()}),
    ("a:2; b:3", {"vocab": ("b",), "d_ff": ("a", "b")}),               # two axes on one dim
]


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    x = torch.randn(SHAPES[name].sizes, generator=g)
    return (x * 100).to(DTYPES[name]) if DTYPES[name] != torch.float32 else x


def _mesh(text: str) -> Mesh:
    return Mesh(()) if not text else Mesh.parse(text)


def _specs(split: dict, names=tuple(SHAPES)) -> dict:
    return {n: (SHAPES[n], DTYPES[n], Sharding.of(SHAPES[n], split)) for n in names}


def _save(root, step: int, mesh_text: str, split: dict, **kw) -> Path:
    """Save every tensor of SHAPES from all ranks of ``mesh_text`` (one simulated process)."""
    mesh = _mesh(mesh_text)
    comm = SimulatedComm(mesh)
    tensors = {}
    for n, (shape, dtype, sh) in _specs(split).items():
        tensors[n] = ((shape, dtype, sh), [_full(n)[sh.slice_index(shape, mesh, r)].contiguous() for r in comm.ranks])
    kw.setdefault("model", "toy")
    return save_checkpoint(root, step, tensors, comm, **kw)


def _check_load(path, mesh_text: str, split: dict, ranks=None, **kw) -> None:
    """Load onto ``mesh_text`` / ``split`` and compare every held rank with the full tensor's slice."""
    mesh = _mesh(mesh_text)
    specs = _specs(split)
    out = load_checkpoint(path, specs, mesh, ranks, **kw)
    ranks = range(mesh.size) if ranks is None else ranks
    for n, (shape, dtype, sharding) in specs.items():
        full = _full(n)
        assert len(out[n]) == len(ranks)
        for r, x in zip(ranks, out[n]):
            assert x.dtype == dtype
            assert torch.equal(x, full[sharding.slice_index(shape, mesh, r)]), (n, mesh_text, split, r)


# ------------------------------------------------------------ resharding

@pytest.mark.parametrize("saved", CONFIGS, ids=lambda c: f"{c[0] or 'one'}|{c[1]}")
def test_load_on_every_mesh_and_layout(tmp_path, saved):
    path = _save(tmp_path, 1, *saved)
    assert latest_checkpoint(tmp_path) == path
    for mesh_text, split in CONFIGS:
        _check_load(path, mesh_text, split)


def test_replicated_slices_are_written_once(tmp_path):
    path = _save(tmp_path, 1, "data:2; model:2", {"d_ff": ("model",)})
    info = read_metadata(path)
    # emb is replicated: one slice, written by rank 0.  w and b are split over model: ranks 0 and 1.
    assert [s.file for s in info.tensors["emb"].slices] == ["rank-00000.safetensors"]
    assert [s.file for s in info.tensors["w"].slices] == ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert sorted(p.name for p in path.iterdir()) == ["checkpoint.json", "rank-00000.safetensors",
                                                      "rank-00001.safetensors"]
    assert info.tensors["w"].slices[1].offsets == (0, 6) and info.tensors["w"].slices[1].sizes == (4, 6)
    assert info.mesh == "data:2; model:2" and info.model == "toy" and info.step == 1


def test_load_only_some_ranks(tmp_path):
    path = _save(tmp_path, 1, "x:4", {"d_ff": ("x",)})
    _check_load(path, "data:2; model:2", {"d_model": ("data",), "d_ff": ("model",)}, ranks=[3])
    _check_load(path, "data:2; model:2", {"d_ff": ("data", "model")}, ranks=[1, 2])


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_shardings_round_trip(data):
    """Any sharding saved on any mesh loads into any other, element for element."""
    def draw_config():
        sizes = data.draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
        axes = [(f"ax{i}", s) for i, s in enumerate(sizes)]
        split: dict[str, tuple] = {}
        for name, _ in axes:
            dim = data.draw(st.sampled_from([None, "d_model", "d_ff", "vocab"]))
            if dim is not None:
                split[dim] = split.get(dim, ()) + (name,)
        mesh = Mesh(tuple(axes))
        for shape in SHAPES.values():
            for d in shape:
                assume(d.size % mesh.axis_size(split.get(d.name, ())) == 0)
        return mesh, split

    (mesh_a, split_a), (mesh_b, split_b) = draw_config(), draw_config()
    fulls = {n: _full(n) for n in SHAPES}
    with tempfile.TemporaryDirectory() as root:
        comm = SimulatedComm(mesh_a)
        tensors = {}
        for n in SHAPES:
            sh = Sharding.of(SHAPES[n], split_a)
            tensors[n] = ((SHAPES[n], DTYPES[n], sh),
                          [fulls[n][sh.slice_index(SHAPES[n], mesh_a, r)].contiguous() for r in comm.ranks])
        path = save_checkpoint(root, 0, tensors, comm)
        specs = {n: (SHAPES[n], DTYPES[n], Sharding.of(SHAPES[n], split_b)) for n in SHAPES}
        out = load_checkpoint(path, specs, mesh_b)
        for n, (shape, _, sh) in specs.items():
            for r, x in enumerate(out[n]):
                assert torch.equal(x, fulls[n][sh.slice_index(shape, mesh_b, r)])


class _Spy:
    """Wraps safetensors.safe_open: records the files opened and the elements each get_slice read."""

    def __init__(self, real):
        self.real, self.opened, self.read = real, [], []

    def __call__(self, path, framework):
        spy, handle = self, self.real(path, framework=framework)
        self.opened.append(Path(path).name)

        class Handle:
            def __enter__(self):
                self.h = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.h.keys()

            def get_slice(self, key):
                sl = self.h.get_slice(key)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def get_dtype(self):
                        return sl.get_dtype()

                    def __getitem__(self, idx):
                        x = sl[idx]
                        spy.read.append((Path(path).name, key, x.numel()))
                        return x
                return Slice()
        return Handle()


def test_a_rank_reads_only_the_slices_it_needs(tmp_path, monkeypatch):
    path = _save(tmp_path, 1, "x:4", {"d_ff": ("x",)})
    spy = _Spy(checkpoint_load.safe_open)
    monkeypatch.setattr(checkpoint_load, "safe_open", spy)
    # Rank 1 of "y:2" with d_ff split over y wants d_ff 6..11: saved by ranks 2 and 3 of x:4 (3 each).
    specs = _specs({"d_ff": ("y",)}, names=("w", "b"))
    out = load_checkpoint(path, specs, Mesh.parse("y:2"), ranks=[1], strict=False)   # no emb: a subset
    assert sorted(spy.opened) == ["rank-00002.safetensors", "rank-00003.safetensors"]
    assert sum(n for f, k, n in spy.read if k == "w") == out["w"][0].numel() == 4 * 6
    assert sum(n for f, k, n in spy.read if k == "b") == out["b"][0].numel() == 6
    assert torch.equal(out["w"][0], _full("w")[:, 6:])


# ------------------------------------------------------------- atomicity

_KILLED_SAVE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    import meshdsl.train.checkpoint as ck
    import test_checkpoint as t

    root = Path({root!r})
    t._save(root, 1, "x:4", {{"d_ff": ("x",)}})
    real = ck._write_file
    def slow(path, data):
        real(path, data)
        (root / "MARKER").write_text(path.name)   # one shard is on disk: the parent may kill us now
        time.sleep(120)
    ck._write_file = slow
    t._save(root, 2, "x:4", {{"d_ff": ("x",)}})
""")


def test_a_save_killed_midway_leaves_the_last_checkpoint(tmp_path):
    code = _KILLED_SAVE.format(tests=str(ROOT / "tests"), root=str(tmp_path))
    kill_when_marked(code, tmp_path / "MARKER", "the second save")
    assert (tmp_path / ".tmp-step-00000002").is_dir()            # the unfinished save
    assert (tmp_path / "latest").read_text() == "step-00000001\n"
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    assert not (tmp_path / "step-00000002").exists()
    _check_load(latest_checkpoint(tmp_path), "data:2", {"d_model": ("data",)})
    # The next save cleans the leftover up and commits.
    path = _save(tmp_path, 2, "data:2", {})
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    assert latest_checkpoint(tmp_path) == path and (tmp_path / "latest").read_text() == "step-00000002\n"


def test_keep_n_deletes_the_oldest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, "data:2", {"d_model": ("data",)}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004", "step-00000005"]
    _save(tmp_path, 6, "data:2", {}, keep=None)
    _save(tmp_path, 7, "data:2", {}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000007"]
    _check_load(tmp_path / "step-00000007", "x:4", {"d_ff": ("x",)})


def test_a_committed_step_is_never_overwritten(tmp_path):
    _save(tmp_path, 3, "data:2", {})
    with pytest.raises(CheckpointError, match="step-00000003' already exists"):
        _save(tmp_path, 3, "data:2", {})
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000003"
    assert latest_checkpoint(tmp_path / "nothing-here") is None


# ---------------------------------------------------------------- errors

@pytest.fixture
def saved(tmp_path) -> Path:
    return _save(tmp_path, 1, "x:4", {"d_ff": ("x",)}, meta={"layout": "d_ff:x", "data": {"step": 1}})


def _load_error(path, specs=None, **kw) -> str:
    specs = specs or _specs({})
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, specs, Mesh.parse("data:2"), **kw)
    assert isinstance(e.value, MeshDSLError)
    return str(e.value)


def test_meta_round_trips(saved):
    assert read_metadata(saved).meta == {"layout": "d_ff:x", "data": {"step": 1}}


def test_missing_shard(saved):
    (saved / "rank-00002.safetensors").unlink()
    msg = _load_error(saved)
    assert "rank-00002.safetensors: missing" in msg and str(saved) in msg and "nothing was loaded" in msg


def test_truncated_shard_reads_nothing(saved, monkeypatch):
    f = saved / "rank-00001.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    spy = _Spy(checkpoint_load.safe_open)
    monkeypatch.setattr(checkpoint_load, "safe_open", spy)
    msg = _load_error(saved)
    assert "rank-00001.safetensors" in msg and "truncated" in msg
    assert spy.read == [] and spy.opened == []      # checked before any file was opened


def test_corrupt_bytes_caught_by_sha256_and_header(saved):
    f = saved / "rank-00003.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    assert "rank-00003.safetensors: sha256 differs" in _load_error(saved, verify="sha256")
    data[:8] = b"\xff" * 8                           # a header length that points past the end
    f.write_bytes(bytes(data))
    assert "rank-00003.safetensors: not a readable safetensors file" in _load_error(saved)


def test_a_shard_that_holds_something_else(saved):
    """A replaced shard file whose size was made to match: its header is checked before any read."""
    from safetensors.torch import save as to_bytes

    data = to_bytes({"w": torch.zeros(4, 3, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.int64)})
    (saved / "rank-00001.safetensors").write_bytes(data)
    doc = json.loads((saved / "checkpoint.json").read_text())
    doc["files"]["rank-00001.safetensors"]["bytes"] = len(data)
    (saved / "checkpoint.json").write_text(json.dumps(doc))
    msg = _load_error(saved)
    assert "rank-00001.safetensors: tensor 'w' missing or not float32 of shape [4, 3]" in msg
    assert "rank-00001.safetensors: tensor 'b' missing or not int64 of shape [3]" in msg


def test_wrong_shape_and_dtype_wanted(saved):
    specs = _specs({})
    bigger = Shape([Dim("d_model", 4), Dim("d_ff", 16)])
    specs["w"] = (bigger, torch.float32, Sharding.of(bigger, {}))
    specs["b"] = (SHAPES["b"], torch.float32, Sharding.of(SHAPES["b"], {}))
    msg = _load_error(saved, specs)
    assert "w: saved shape [d_model:4, d_ff:12], wanted [d_model:4, d_ff:16]" in msg
    assert "b: saved dtype int64, wanted float32" in msg


def test_another_model(saved):
    assert "model: saved 'toy', loading 'gpt'" in _load_error(saved, model="gpt")
    specs = _specs({}, names=("w", "b"))
    specs["head"] = (SHAPES["b"], torch.float32, Sharding.of(SHAPES["b"], {}))
    msg = _load_error(saved, specs)
    assert "head: wanted but not in the checkpoint" in msg and "emb: in the checkpoint but not wanted" in msg


def test_metadata_not_json(saved):
    (saved / "checkpoint.json").write_text('{"format": "meshdsl-checkpoint", "vers')
    msg = _load_error(saved)
    assert "checkpoint.json is not valid JSON" in msg and str(saved) in msg


def test_metadata_malformed_or_missing(saved, tmp_path):
    doc = json.loads((saved / "checkpoint.json").read_text())
    doc["tensors"]["w"]["slices"].pop()
    (saved / "checkpoint.json").write_text(json.dumps(doc))
    assert "its slices do not cover its shape [4, 12]" in _load_error(saved)
    assert "has no checkpoint.json" in _load_error(tmp_path)
    doc["version"] = 99
    (saved / "checkpoint.json").write_text(json.dumps(doc))
    assert "format version 99" in _load_error(saved)


def test_save_errors(tmp_path):
    mesh = Mesh.parse("data:2")
    comm = SimulatedComm(mesh)
    spec = (SHAPES["w"], torch.float32, Sharding.of(SHAPES["w"], {"d_ff": ("data",)}))
    with pytest.raises(CheckpointError, match=r"w on rank 1: local \(4, 12\) torch.float32, expected \(4, 6\)"):
        save_checkpoint(tmp_path, 0, {"w": (spec, [torch.zeros(4, 6), torch.zeros(4, 12)])}, comm)
    with pytest.raises(CheckpointError, match="meta is not JSON"):
        save_checkpoint(tmp_path, 0, {"w": (spec, [torch.zeros(4, 6)] * 2)}, comm, meta={"rng": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="keep=0"):
        save_checkpoint(tmp_path, 0, {"w": (spec, [torch.zeros(4, 6)] * 2)}, comm, keep=0)
    assert latest_checkpoint(tmp_path) is None


# --------------------------------------------------------- two processes

def _save_on_rank(comm, root):
    fulls = {n: _full(n) for n in SHAPES}
    tensors = {}
    for n, (shape, dtype, sh) in _specs({"d_model": ("data",)}).items():
        tensors[n] = ((shape, dtype, sh), [fulls[n][sh.slice_index(shape, comm.mesh, r)].contiguous()
                                           for r in comm.ranks])
    path = save_checkpoint(root, 7, tensors, comm, model="toy", meta={"rank_count": 2})
    return str(path), os.getpid()


def test_two_gloo_processes_save_one_loads_resharded(tmp_path):
    results = spawn(_save_on_rank, 2, args=(str(tmp_path),), mesh="data:2", timeout=120)
    assert results[0][0] == results[1][0] == str(tmp_path / "step-00000007")
    assert results[0][1] != results[1][1]
    path = latest_checkpoint(tmp_path)
    assert sorted(p.name for p in path.iterdir()) == ["checkpoint.json", "rank-00000.safetensors",
                                                      "rank-00001.safetensors"]
    info = read_metadata(path)
    # b has no d_model: replicated, so written once, by rank 0.
    assert [s.file for s in info.tensors["b"].slices] == ["rank-00000.safetensors"]
    _check_load(path, "", {})
    _check_load(path, "a:2; b:3", {"vocab": ("b",), "d_ff": ("a", "b")})


def _save_with_a_bad_rank(comm, root):
    """Rank 1 passes a local slice of the wrong shape; every process must fail, none may hang."""
    shape, dtype, sh = _specs({"d_model": ("data",)}, names=("w",))["w"]
    local = torch.zeros(2, 12) if comm.ranks == (0,) else torch.zeros(3, 12)
    try:
        save_checkpoint(root, 1, {"w": ((shape, dtype, sh), [local])}, comm)
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_a_failing_rank_fails_every_process(tmp_path):
    results = spawn(_save_with_a_bad_rank, 2, args=(str(tmp_path),), mesh="data:2", timeout=120)
    for msg in results:
        assert "w on rank 1: local (3, 12) torch.float32, expected (2, 12)" in msg
    assert latest_checkpoint(tmp_path) is None
