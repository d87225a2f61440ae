"""Checkpoints verified, and what a resume reads (train/checkpoint_verify.py).

Each kind of damage (bytes flipped, a truncated or missing shard, a huge header length, bad
data_offsets, an edited checkpoint.json) is named with its file and what differs before any
shard is opened for reading; a resume refuses a damaged latest checkpoint and names the older
intact ones; ``meshdsl train`` checks all of it in the launcher, before any rank starts.
"""
from __future__ import annotations

import hashlib
import json
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import meshdsl.train.checkpoint_load as checkpoint_load
from conftest import time_limit
from meshdsl.layout.mesh import Mesh
from meshdsl.tools import cli
from meshdsl.train.checkpoint import CheckpointError, choose_checkpoint, load_checkpoint, verify_checkpoint
from meshdsl.train.checkpoint_format import content_digest
from meshdsl.train.checkpoint_verify import check_saves_free
from meshdsl.train.trainer import fit
from test_checkpoint import _full, _load_error, _save, _specs, _Spy, saved  # noqa: F401 (saved: a fixture)

ROOT = Path(__file__).resolve().parent.parent


# Damage done to a committed checkpoint, each kind as a user or a disk could do it: name ->
# (damage(checkpoint dir, shard file name), what the message must say about it).
def _flip(d, f):
    """64 bytes in the middle of the tensor data flipped (fewer in a smaller file); the size stays."""
    data = bytearray((d / f).read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    lo = max(start, (start + len(data)) // 2 - 32)
    data[lo:lo + 64] = bytes(b ^ 0x5A for b in data[lo:lo + 64])
    (d / f).write_bytes(bytes(data))


def _huge_header(d, f):
    data = bytearray((d / f).read_bytes())
    data[:8] = b"\xff" * 8
    (d / f).write_bytes(bytes(data))


def _reversed_offsets(d, f):
    """The first tensor's data_offsets swapped: the header keeps its length, its range runs backwards."""
    data = (d / f).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = next(k for k in header if k != "__metadata__" and header[k]["data_offsets"][0] < header[k]["data_offsets"][1])
    header[key]["data_offsets"].reverse()
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    (d / f).write_bytes(data[:8] + text.ljust(n) + data[8 + n:])


def _edit_metadata(d, f):
    doc = json.loads((d / "checkpoint.json").read_text())
    doc["files"][f]["sha256"] = "0" * 64          # "fixed" by hand: its digest no longer matches
    (d / "checkpoint.json").write_text(json.dumps(doc, indent=1))


DAMAGES = {
    "flipped": (_flip, r"{f}: sha256 [0-9a-f]{{64}}, checkpoint.json records [0-9a-f]{{64}} \(its bytes changed"),
    "truncated": (lambda d, f: (d / f).write_bytes((d / f).read_bytes()[:-10]),
                  r"{f}: (\d+) bytes, checkpoint.json records (\d+) \(truncated"),
    "huge header": (_huge_header, r"{f}: its header claims 18446744073709551615 bytes, but \d+ follow"),
    "bad offsets": (_reversed_offsets, r"{f}: tensor '.+': data_offsets \[\d+, \d+\] are not a range inside"),
    "missing": (lambda d, f: (d / f).unlink(), r"{f}: missing \(checkpoint.json records \d+ bytes\)"),
    "deleted checkpoint.json": (lambda d, f: (d / "checkpoint.json").unlink(), r"has no checkpoint.json"),
    "edited checkpoint.json": (_edit_metadata, r"checkpoint.json was changed after the save: its content hashes "
                                               r"to [0-9a-f]{{64}}, its digest field records [0-9a-f]{{64}}"),
}


@pytest.mark.parametrize("kind", DAMAGES)
def test_each_damage_is_named_and_nothing_loads(saved, kind, monkeypatch):
    damage, said = DAMAGES[kind]
    f = "rank-00001.safetensors"
    damage(saved, f)
    spy = _Spy(checkpoint_load.safe_open)
    monkeypatch.setattr(checkpoint_load, "safe_open", spy)
    for err in (_load_error(saved), pytest.raises(CheckpointError, verify_checkpoint, saved).value):
        assert re.search(said.format(f=re.escape(f)), str(err)), str(err)
        assert str(saved) in str(err)
    assert spy.opened == []     # found before any shard was opened for reading
    if kind == "truncated":      # the actual size, then the one recorded
        got, want = map(int, re.search(said.format(f=f), str(err)).groups())
        assert (got, want) == ((saved / f).stat().st_size, _doc(saved)["files"][f]["bytes"])


def _doc(path) -> dict:
    """checkpoint.json as written, unchecked."""
    return json.loads((Path(path) / "checkpoint.json").read_text())


def test_the_fast_path_checks_sizes_and_headers_but_not_bytes(saved):
    """verify="size" misses bytes flipped in the data (it reads no data), and still catches the rest."""
    _flip(saved, "rank-00002.safetensors")
    verify_checkpoint(saved, "size")
    out = load_checkpoint(saved, _specs({}), Mesh.parse("data:2"), verify="size")
    assert not torch.equal(out["w"][0], _full("w"))     # wrong numbers: what the default, the hash, is for
    _huge_header(saved, "rank-00003.safetensors")
    with pytest.raises(CheckpointError, match="rank-00003.safetensors: its header claims"):
        verify_checkpoint(saved, "size")


def _replace_shard(path, f, data: bytes) -> None:
    """Put ``data`` in shard ``f`` and record its size and hash, as a save that wrote it would have."""
    (path / f).write_bytes(data)
    doc = _doc(path)
    doc["files"][f] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    doc["digest"] = content_digest(doc)
    (path / "checkpoint.json").write_text(json.dumps(doc))


def test_every_header_entry_is_checked(saved):
    header = {"w": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]},
              "b": {"dtype": "I64", "shape": [3], "data_offsets": [40, 64]},      # overlaps w
              "c": {"dtype": "F32", "shape": [2], "data_offsets": [64, 68]},      # 4 bytes for 8
              "d": {"dtype": "F32", "shape": "two", "data_offsets": [68, 76]}}
    text = json.dumps(header).encode()
    _replace_shard(saved, "rank-00001.safetensors", len(text).to_bytes(8, "little") + text + bytes(76))
    msg = str(pytest.raises(CheckpointError, verify_checkpoint, saved).value)
    assert "rank-00001.safetensors: tensors 'w' and 'b': data_offsets overlap" in msg
    assert "rank-00001.safetensors: tensor 'c': data_offsets [64, 68] hold 4 bytes, F32 [2] needs 8" in msg
    assert "rank-00001.safetensors: tensor 'd': malformed header entry" in msg


def test_a_shard_that_holds_something_else(saved):
    """A replaced shard file whose size and hash were recorded to match: its header is checked before any read."""
    from safetensors.torch import save as to_bytes

    data = to_bytes({"w": torch.zeros(4, 3, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.int64)})
    _replace_shard(saved, "rank-00001.safetensors", data)
    msg = _load_error(saved)
    assert "rank-00001.safetensors: tensor 'w': F64 [4, 3] in the file, checkpoint.json records F32 [4, 3]" in msg
    assert "rank-00001.safetensors: tensor 'b': I64 [2] in the file, checkpoint.json records I64 [3]" in msg


# ------------------------------------------------------------ what a resume reads

def test_resume_takes_the_latest_and_refuses_it_damaged_naming_the_older_intact_ones(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, "data:2", {})
    assert choose_checkpoint(tmp_path) == tmp_path / "step-00000003"
    _flip(tmp_path / "step-00000003", "rank-00000.safetensors")
    _huge_header(tmp_path / "step-00000002", "rank-00000.safetensors")
    with pytest.raises(CheckpointError) as e:
        choose_checkpoint(tmp_path)
    msg = str(e.value)
    assert f"the latest checkpoint '{tmp_path / 'step-00000003'}' is damaged; nothing was loaded" in msg
    assert "rank-00000.safetensors: sha256" in msg
    # No silent fallback: the older intact one (step 2's header is damaged too) and the flags to use it.
    assert "older checkpoints intact (sizes and headers checked; a resume hashes its files): step 1 (" in msg
    assert "step 2 (" not in msg
    assert "with --resume-from 1 once the damaged" in msg
    assert f"--resume-from {tmp_path / 'step-00000001'} --checkpoint NEW_DIR" in msg
    assert choose_checkpoint(tmp_path, 1) == choose_checkpoint(None, str(tmp_path / "step-00000001"))
    with pytest.raises(CheckpointError, match="rank-00000.safetensors: its header claims"):
        choose_checkpoint(tmp_path, "2")
    _huge_header(tmp_path / "step-00000001", "rank-00000.safetensors")
    with pytest.raises(CheckpointError, match=r"no older checkpoint is intact \(2 damaged\): start afresh"):
        choose_checkpoint(tmp_path)


def test_resume_from_names_one_checkpoint(tmp_path):
    _save(tmp_path, 2, "data:2", {})
    _save(tmp_path, 4, "data:2", {})
    with pytest.raises(CheckpointError, match=r"--resume-from 3: no checkpoint .*\n  steps in .*: 2, 4"):
        choose_checkpoint(tmp_path, 3)
    with pytest.raises(CheckpointError, match="a folder of checkpoints, not one checkpoint"):
        choose_checkpoint(None, str(tmp_path))
    with pytest.raises(CheckpointError, match="--resume-from 2: a step needs --checkpoint DIR"):
        choose_checkpoint(None, 2)
    with pytest.raises(CheckpointError, match=r"verify='md5'"):
        choose_checkpoint(tmp_path, verify="md5")
    # The resumed run of step 2 would save step 4 again: refused before it starts.
    with pytest.raises(CheckpointError, match="would save step 4 into .*, where it exists"):
        check_saves_free(tmp_path, 2, [3, 4, 5])
    check_saves_free(tmp_path, 4, [5, 6])


# ------------------------------------------------------------ meshdsl train and md.fit

TRAIN = ["train", "--tiny", "--samples", "0", "--seed", "7"]
RESUME_ON_2 = ["--mesh", "data:2", "--layout", "batch:data", "--nproc", "2", "--steps", "4", "--resume"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run's checkpoints of steps 1 and 2 (one process, in this process)."""
    root = tmp_path_factory.mktemp("trained")
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)    # as each spawned rank has
    try:
        rc = cli.main([*TRAIN, "--mesh", "data:1", "--steps", "2", "--save-every", "1", "--checkpoint",
                       str(root / "ck"), "--out", str(root / "out")])
    finally:
        torch.set_num_threads(torch_threads)
    assert rc == 0
    return root / "ck"


@pytest.mark.parametrize("kind", DAMAGES)
def test_meshdsl_train_refuses_a_damaged_checkpoint_before_any_rank_starts(trained, tmp_path, capsys, kind):
    ck, out = tmp_path / "ck", tmp_path / "out"
    shutil.copytree(trained, ck)
    DAMAGES[kind][0](ck / "step-00000002", "rank-00000.safetensors")
    t0 = time.perf_counter()
    rc = cli.main([*TRAIN, *RESUME_ON_2, "--checkpoint", str(ck), "--out", str(out)])
    took = time.perf_counter() - t0
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("meshdsl train: error:") == 1 and "Traceback" not in err, err
    assert re.search(DAMAGES[kind][1].format(f="rank-00000.safetensors"), err), err
    assert "step-00000002' is damaged; nothing was loaded" in err and "--resume-from 1" in err
    assert not out.exists()      # no rank started: rank 0 makes --out
    assert took < time_limit(3.0), took


def test_flipped_bytes_stop_meshdsl_train_within_3_s_of_cpu(trained, tmp_path):
    """The issue's case end to end, as a user runs it: a fresh interpreter, two processes asked for."""
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    _flip(ck / "step-00000002", "rank-00000.safetensors")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run([sys.executable, "-m", "meshdsl", *TRAIN, *RESUME_ON_2, "--checkpoint", str(ck),
                          "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "rank-00000.safetensors: sha256" in run.stderr and "--resume-from 1" in run.stderr
    assert not (tmp_path / "out").exists()
    # CPU time, which other work on the machine does not stretch as it does wall time; this
    # path is single-threaded, so on an idle machine its wall time is about the same (2.4 s
    # measured on an idle 2-core machine, most of it importing torch).
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert cpu < time_limit(3.0), cpu


def test_md_fit_resumes_from_a_given_checkpoint(tmp_path, one_torch_thread):
    run = dict(tiny=True, config={"vocab": 256}, mesh="data:1", samples=0, seed=3, lr=0.01)
    first = fit("transformer", steps=4, save_every=2, checkpoint=str(tmp_path / "ck"), **run)
    _flip(tmp_path / "ck" / "step-00000004", "rank-00000.safetensors")
    with pytest.raises(CheckpointError, match=r"is damaged(.|\n)*with resume_from=2 once the damaged"):
        fit("transformer", steps=4, resume=True, checkpoint=str(tmp_path / "ck"), **run)
    again = fit("transformer", steps=4, resume_from=str(tmp_path / "ck" / "step-00000002"),
                checkpoint=str(tmp_path / "ck2"), **run)
    # One process on the same mesh both times: the resumed steps are the same computation.
    assert [(r["step"], r["loss"]) for r in again.rows] == [(r["step"], r["loss"]) for r in first.rows[2:]]


def test_resume_from_a_path_that_does_not_exist_says_so(tmp_path):
    """--resume-from PATH of no folder: what takes its place, not checkpoint.json's format rule."""
    with pytest.raises(CheckpointError) as e:
        choose_checkpoint(None, str(tmp_path / "step-00000009"))
    text = str(e.value)
    assert "no such checkpoint directory" in text and "checkpoint.json is the JSON" not in text, text
    assert "Rule: a resume from a given checkpoint takes its step directory" in text, text
