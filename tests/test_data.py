"""Training data: the default corpus, the byte tokenizer, and sharded batches that do not depend on the mesh."""
from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshdsl.errors import MeshDSLError
from meshdsl.train.data import (ByteTokenizer, DataError, TokenData, default_corpus_text, load_text,
                                row_offset, stdlib_sources, token_digest)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus() -> TokenData:
    return TokenData.load(None, seed=7)


def _batch_digest(data: TokenData) -> str:
    return token_digest(*(x for step in range(3) for x in data.batch(step, 8, 32)))


# ------------------------------------------------------------------ corpus

def test_default_corpus_is_stdlib_source_in_sorted_order():
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_sources()
    rels = [f.relative_to(root).as_posix() for f in files]
    assert len(rels) > 100 and rels == sorted(rels)
    assert all(f.suffix == ".py" for f in files)
    assert not any(part in ("test", "tests", "site-packages", "__pycache__") for r in rels for part in r.split("/"))
    text = default_corpus_text(200_000)
    assert text.startswith("# ==== ")
    assert 0 < len(text.encode()) <= 200_000
    assert default_corpus_text(200_000) == text                     # same content on a second read
    assert len(default_corpus_text(400_000)) > len(text)            # the cap decides how much


def test_default_corpus_separators_follow_path_order():
    text = default_corpus_text(300_000)
    names = [line[len("# ==== "):-len(" ====")] for line in text.splitlines() if line.startswith("# ==== ")]
    assert len(names) > 3
    assert names == sorted(names)


def test_batches_match_in_another_interpreter(corpus):
    """The global batch is a pure function of (seed, step): a fresh Python gives the same bytes."""
    code = ("from meshdsl.train.data import TokenData, token_digest\n"
            "d = TokenData.load(None, seed=7)\n"
            "print(d.fingerprint()['sha256'], token_digest(*(x for t in range(3) for x in d.batch(t, 8, 32))))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout.split()
    assert out == [corpus.fingerprint()["sha256"], _batch_digest(corpus)]


# --------------------------------------------------------------- batches

def test_same_batch_twice_and_steps_differ(corpus):
    a = corpus.batch(5, 4, 16)
    b = corpus.batch(5, 4, 16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(corpus.batch(6, 4, 16)[0], a[0])
    assert not torch.equal(TokenData(corpus.tokens, seed=8).batch(5, 4, 16)[0], a[0])


def test_labels_are_next_tokens(corpus):
    ids, labels = corpus.batch(2, 6, 24)
    assert ids.shape == labels.shape == (6, 24) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 1:], labels[:, :-1])
    text = bytes(corpus.tokens[:corpus.split].to(torch.uint8).tolist())
    for row_ids, row_labels in zip(ids, labels):
        window = bytes(row_ids.tolist()) + bytes(row_labels[-1:].tolist())
        assert window in text


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_rank_slices_concatenate_to_the_global_batch(corpus, num_ranks):
    batch, seq = 8, 20
    per = batch // num_ranks
    for step in (0, 1, 17, 10_000):
        ids, labels = corpus.batch(step, batch, seq)
        parts = [corpus.batch(step, batch, seq, rows=slice(r * per, (r + 1) * per)) for r in range(num_ranks)]
        assert torch.equal(torch.cat([p[0] for p in parts]), ids)
        assert torch.equal(torch.cat([p[1] for p in parts]), labels)


def test_rank_builds_only_its_rows(monkeypatch, corpus):
    """A data rank hashes only its own rows' offsets."""
    import meshdsl.train.data as data

    seen = []
    real = data.row_offset
    monkeypatch.setattr(data, "row_offset", lambda s, t, r, n: seen.append(r) or real(s, t, r, n))
    corpus.batch(3, 8, 16, rows=slice(6, 8))
    assert seen == [6, 7]


def test_token_digest_is_of_values_not_storage():
    base = torch.arange(10)
    assert token_digest(base[2:5]) == token_digest(torch.tensor([2, 3, 4]))
    assert token_digest(torch.tensor([1], dtype=torch.uint8)) == token_digest(torch.tensor([1]))
    # Little-endian int64: 1 is 01 00 00 00 00 00 00 00.
    assert token_digest(torch.tensor([1])) == hashlib.sha256(b"\x01" + b"\x00" * 7).hexdigest()


def test_row_offset_is_spread_over_the_range():
    starts = [row_offset(0, step, row, 1000) for step in range(50) for row in range(20)]
    assert min(starts) >= 0 and max(starts) < 1000
    assert len(set(starts)) > 600    # 1000 draws of 1000 values: ~632 distinct when uniform


def test_bad_rows_are_refused(corpus):
    for rows in (slice(2, 1), slice(0, 9), slice(0, 8, 2), slice(-1, 8)):
        with pytest.raises(DataError, match="not a contiguous part"):
            corpus.batch(0, 8, 16, rows=rows)


def test_eval_split_is_disjoint_from_train_windows():
    # Token i has value i, so a window's values are its positions.
    data = TokenData(torch.arange(1000), seed=3, eval_fraction=0.1)
    assert data.split == 900 and len(data.eval_tokens) == 100
    last = []
    for step in range(300):
        ids, labels = data.batch(step, 4, 10)
        assert torch.equal(ids, ids[:, :1] + torch.arange(10))      # contiguous windows
        last += labels[:, -1].tolist()
    assert max(last) <= 899            # no label reaches the held-out tail
    assert max(last) >= 880            # and the sampler does reach the end of the train split
    evals = torch.cat([ids.reshape(-1) for ids, _ in data.eval_batches(2, 10)])
    assert int(evals.min()) == 900


def test_eval_batches_tile_the_held_out_split():
    data = TokenData(torch.randint(0, 256, (2000,), generator=torch.Generator().manual_seed(0)), eval_fraction=0.2)
    assert data.split == 1600
    batches = data.eval_batches(batch_size=3, seq=10)
    assert len(batches) == data.num_eval_batches(3, 10) == 399 // 30
    flat = torch.cat([ids.reshape(-1) for ids, _ in batches])
    assert torch.equal(flat, data.tokens[1600:1600 + len(flat)])
    for ids, labels in batches:
        assert torch.equal(ids[:, 1:], labels[:, :-1])
    halves = [data.eval_batches(3, 10, 2, rows=slice(a, b)) for a, b in ((0, 1), (1, 3))]
    for b in range(2):
        assert torch.equal(torch.cat([halves[0][b][0], halves[1][b][0]]), batches[b][0])
    with pytest.raises(DataError, match="eval split has 400 tokens; 601 are needed"):
        data.eval_batches(3, 10, num_batches=20)


def test_too_short_text_is_a_clear_error():
    data = TokenData(ByteTokenizer().encode("tiny text"), eval_fraction=0.5)
    with pytest.raises(DataError, match=r"train split has \d+ tokens; 17 are needed") as e:
        data.batch(0, 2, 16)
    assert "Fix: use a shorter seq" in str(e.value)
    for bad in ({"batch_size": 0, "seq": 4}, {"batch_size": 2, "seq": 0}, {"batch_size": 2.0, "seq": 4}):
        with pytest.raises(DataError, match="must be an int >= 1"):
            data.batch(0, **bad)


# ----------------------------------------------------------- tokenizer

@pytest.mark.parametrize("text", ["hello", "", "naïve café — 日本語 🚀\n\ttabs", "\x00\x7f"])
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.numel() == len(text.encode("utf-8"))
    assert tok.vocab_size == 256 and (ids.numel() == 0 or int(ids.max()) < 256)
    assert tok.decode(ids) == text


def test_tokenizer_decode_replaces_a_cut_character_and_refuses_non_bytes():
    tok = ByteTokenizer()
    ids = tok.encode("é")
    assert tok.decode(ids[:1]) == "\ufffd"
    with pytest.raises(DataError, match="outside 0..255"):
        tok.decode(torch.tensor([65, 256]))


# ---------------------------------------------------------- load_text

def test_load_text_reads_utf8(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("ünïcode text\n", encoding="utf-8")
    assert load_text(p) == "ünïcode text\n"
    data = TokenData.load(p)
    assert data.source == str(p) and ByteTokenizer().decode(data.tokens) == "ünïcode text\n"


def test_load_text_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_text(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="is a directory"):
        load_text(tmp_path)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("abc déf".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8 at byte offset 5") as e:
        load_text(bad)
    assert "iconv" in str(e.value)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="the file is empty"):
        load_text(empty)
    assert issubclass(DataError, MeshDSLError)


def test_bad_eval_fraction():
    with pytest.raises(DataError, match="eval_fraction 1.0 is not in"):
        TokenData(torch.zeros(10, dtype=torch.int64), eval_fraction=1.0)


# ------------------------------------------------------------- entropy

def test_unigram_entropy_of_known_strings():
    tok = ByteTokenizer()
    # "abab...": two bytes, equally often: ln 2.  The eval tail is cut off first, so build it long.
    data = TokenData(tok.encode("ab" * 500), eval_fraction=0.1)
    assert data.unigram_entropy() == pytest.approx(math.log(2), abs=1e-12)
    data = TokenData(tok.encode("aaaa" * 100), eval_fraction=0.1)
    assert data.unigram_entropy() == 0.0
    # a:1/2, b:1/4, c:1/4 in the train split (the last 10% "dddd" is held out): 1.5 ln 2.
    data = TokenData(tok.encode("aabc" * 90 + "d" * 40), eval_fraction=0.1)
    assert data.split == 360
    assert data.unigram_entropy() == pytest.approx(1.5 * math.log(2), abs=1e-12)


# -------------------------------------------------------------- state

def test_state_round_trip_and_mismatch(tmp_path):
    data = TokenData(ByteTokenizer().encode("some text " * 50), seed=4)
    state = data.state(12)
    assert data.check_state(state) == 12
    other = TokenData(ByteTokenizer().encode("other text " * 50), seed=4)
    with pytest.raises(DataError, match="training data differs") as e:
        other.check_state(state)
    assert "sha256" in str(e.value) and "num_tokens" in str(e.value)
    with pytest.raises(DataError, match="seed: saved 4, now 5"):
        TokenData(data.tokens, seed=5).check_state(state)
    stdlib_state = {**state, "source": "stdlib", "python": "3.0.0", "sha256": "x"}
    with pytest.raises(DataError, match="python: saved 3.0.0"):
        data.check_state(stdlib_state)
