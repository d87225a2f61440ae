"""Sharded checkpoints: save on one mesh and layout, load on any other; atomic commits (a save killed
at every point of its protocol); clear errors.  Damaged files and what a resume reads: test_checkpoint_verify.py.

The oracle is the full tensor: every rank's loaded slice must equal the slice
of the full tensor its new sharding gives, bit for bit (a checkpoint copies
bytes, so there is no tolerance).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import meshdsl.train.checkpoint_load as checkpoint_load
from meshdsl.core.shape import Dim, Shape
from meshdsl.errors import DistributedError, MeshDSLError
from meshdsl.processes.launcher import spawn
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.layout.mesh import Mesh
from meshdsl.layout.sharding import Sharding
from meshdsl.train.checkpoint import (KILL_ENV, KILL_POINTS, CheckpointError, choose_checkpoint, latest_checkpoint,
                                      load_checkpoint, read_metadata, save_checkpoint)
from meshdsl.train.checkpoint_format import content_digest

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

# One interpreter (torch imported once) forks a child per kill point; each child saves step 3
# into its own root, a copy of one holding steps 1 and 2, with keep=2, and SIGKILLs itself at
# its point (MESHDSL_CHECKPOINT_KILL_AT).  The parent prints each child's wait status.
_KILL_EVERY_POINT = textwrap.dedent("""
    import json, os, shutil, sys
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)   # no thread pool: safe to fork
    from pathlib import Path
    import meshdsl.train.checkpoint as ck
    import test_checkpoint as t

    base = Path({base!r})
    t._save(base / "template", 1, "data:2", {{}})
    t._save(base / "template", 2, "data:2", {{"d_model": ("data",)}})
    status = {{}}
    for point in {points!r}:
        root = base / point.replace(":", "-")
        shutil.copytree(base / "template", root)
        pid = os.fork()
        if pid == 0:
            os.environ[ck.KILL_ENV] = point
            t._save(root, 3, "x:2", {{"d_ff": ("x",)}}, keep=2)
            os._exit(0)
        status[point] = os.waitpid(pid, 0)[1]
    print(json.dumps(status))
""")


def _kill_points(num_ranks: int) -> list[str]:
    """Every point of the save protocol, each rank's shard points for ``num_ranks`` ranks."""
    return [p.replace(":R", f":{r}") for p in KILL_POINTS for r in (range(num_ranks) if ":R" in p else [0])]


def test_a_save_killed_at_every_point_of_the_protocol_leaves_a_loadable_checkpoint(tmp_path):
    points = _kill_points(2)     # x:2 with d_ff split: both ranks write a shard
    code = _KILL_EVERY_POINT.format(tests=str(ROOT / "tests"), points=points, base=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout.strip().splitlines()[-1])
    committed_from = KILL_POINTS.index("renamed")
    for point in points:
        assert os.WIFSIGNALED(status[point]) and os.WTERMSIG(status[point]) == signal.SIGKILL, point
        root = tmp_path / point.replace(":", "-")
        committed = KILL_POINTS.index(re.sub(r":\d+$", ":R", point)) >= committed_from
        want = root / ("step-00000003" if committed else "step-00000002")
        # Readers trust the folders: the latest one is the new step only once the rename happened.
        assert latest_checkpoint(root) == want and choose_checkpoint(root) == want, point
        _check_load(want, "data:2", {"d_model": ("data",)})
        # The previous checkpoint always loads, whatever happened to the new one.
        _check_load(root / "step-00000002", "x:4", {"d_ff": ("x",)})
        pointer = (root / "latest").read_text()
        assert pointer == ("step-00000003\n" if point in ("latest-replaced", "mid-delete") else "step-00000002\n")
        assert (root / "step-00000001").is_dir() == (point != "mid-delete"), point    # keep=2 deletes step 1 last
        # The next save cleans every leftover up and commits.
        path = _save(root, 4, "data:2", {})
        assert not any(p.name.startswith(".tmp-") for p in root.iterdir()), point
        assert latest_checkpoint(root) == path and (root / "latest").read_text() == "step-00000004\n"


def test_a_save_killed_on_one_rank_of_two_processes_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    previous = _save(tmp_path, 7, "data:2", {"d_model": ("data",)})
    monkeypatch.setenv(KILL_ENV, "after-shard:1")    # rank 1's process dies with its shard on disk
    with pytest.raises(DistributedError, match="rank 1 .*SIGKILL"):
        spawn(_save_on_rank, 2, args=(str(tmp_path), 8), mesh="data:2", timeout=120)
    assert (tmp_path / ".tmp-step-00000008" / "rank-00001.safetensors").is_file()
    assert latest_checkpoint(tmp_path) == previous and (tmp_path / "latest").read_text() == "step-00000007\n"
    _check_load(choose_checkpoint(tmp_path), "x:4", {"d_ff": ("x",)})


def test_a_save_never_writes_through_a_planted_link(tmp_path):
    root, victim = tmp_path / "ck", tmp_path / "victim"
    victim.mkdir()
    (victim / "rank-00000.safetensors").write_text("mine")
    root.mkdir()
    for name in (".tmp-step-00000002", ".tmp-latest"):      # names a save could be guessed to use
        os.symlink(victim, root / name)
    path = _save(root, 2, "data:2", {})
    assert [p.name for p in victim.iterdir()] == ["rank-00000.safetensors"]
    assert (victim / "rank-00000.safetensors").read_text() == "mine"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"]
    _check_load(path, "x:4", {"d_ff": ("x",)})


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
    doc["digest"] = content_digest(doc)      # an edit that kept the digest right: the slices are still checked
    (saved / "checkpoint.json").write_text(json.dumps(doc))
    assert "its slices do not cover its shape [4, 12]" in _load_error(saved)
    assert "has no checkpoint.json" in _load_error(tmp_path)
    doc["version"] = 99
    (saved / "checkpoint.json").write_text(json.dumps(doc))
    assert "format version 99" in _load_error(saved)
    del doc["digest"]        # a checkpoint from before digests: read unchecked
    doc["version"] = 1
    (saved / "checkpoint.json").write_text(json.dumps(doc))
    assert "its slices do not cover its shape [4, 12]" in _load_error(saved)
    doc["files"]["../elsewhere.safetensors"] = {"bytes": 1, "sha256": ""}
    (saved / "checkpoint.json").write_text(json.dumps(doc))
    assert "file '../elsewhere.safetensors' is not a name inside the checkpoint's folder" in _load_error(saved)


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

def _save_on_rank(comm, root, step=7):
    fulls = {n: _full(n) for n in SHAPES}
    tensors = {}
    for n, (shape, dtype, sh) in _specs({"d_model": ("data",)}).items():
        tensors[n] = ((shape, dtype, sh), [fulls[n][sh.slice_index(shape, comm.mesh, r)].contiguous()
                                           for r in comm.ranks])
    path = save_checkpoint(root, step, tensors, comm, model="toy", meta={"rank_count": 2})
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
