"""Training text, a byte tokenizer, and deterministic sharded batches.

The default corpus needs no download: it is the Python standard library's own
``.py`` sources, read at run time in sorted path order up to a byte cap.  Its
content therefore depends on the Python version that runs it; :meth:`TokenData.fingerprint`
records that version and a sha256 of the text, so a resume on another Python is
detected (:meth:`TokenData.check_state`).  ``load_text(path)`` reads any UTF-8 file instead.

Batches are pure functions of ``(seed, step, row)``: the start offset of row ``r``
at step ``t`` is a 64-bit hash of the three, so the global batch is the same
whatever the mesh, layout or process count, and a data rank builds only its own
rows (``rows=slice(a, b)``) without computing the others.  The step and seed are
therefore the whole data position a checkpoint needs.  :func:`row_generator` gives a
model's own generated batches the same property (one random stream per row).
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MeshDSLError, message

#: How many bytes of standard-library source the default corpus holds at most.
DEFAULT_CORPUS_BYTES = 2_000_000
#: The held-out fraction at the end of the token stream (its eval split).
DEFAULT_EVAL_FRACTION = 0.05
# Folders of the standard library that are not its own modules (tests, installed packages).
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_MASK64 = (1 << 64) - 1


class DataError(MeshDSLError):
    """The training text cannot be read or cannot fill the batch asked for."""


# ------------------------------------------------------------------ text

def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files in sorted relative-path order (tests and site-packages skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(message(
            f"default corpus: the standard library folder {str(root)!r} does not exist.",
            inputs=[f"python: {sys.version.split()[0]} ({sys.executable})"],
            rule="the default corpus is the standard library's own .py sources",
            fix="pass a UTF-8 text file instead: --data PATH"))
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruned in place, so os.walk never descends into tests or installed packages.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def default_corpus_text(max_bytes: int = DEFAULT_CORPUS_BYTES) -> str:
    """The default corpus: standard-library sources, whole files, until ``max_bytes`` is reached.

    Files are taken in sorted path order, each preceded by a one-line separator
    naming it; a file that is not UTF-8 is skipped (the same ones every run).
    The content depends on the Python version (see the module docstring).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in stdlib_sources():
        try:
            body = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        piece = f"# ==== {path.relative_to(root).as_posix()} ====\n{body}\n"
        size = len(piece.encode("utf-8"))
        if parts and total + size > max_bytes:
            break
        parts.append(piece)
        total += size
    if not parts:
        raise DataError(message("default corpus: no readable .py file in the standard library.",
                                inputs=[f"stdlib: {root}"],
                                fix="pass a UTF-8 text file instead: --data PATH"))
    return "".join(parts)


def load_text(path: "str | os.PathLike | None" = None) -> str:
    """The training text: the UTF-8 file at ``path``, or the default corpus when ``None``.

    Raises:
      DataError: the path is missing or a directory, cannot be read, is not
        UTF-8 (the message gives the byte offset), or is empty.
    """
    if path is None:
        return default_corpus_text()
    p = Path(path)
    called = f"--data {str(p)!r}"
    if not p.exists():
        raise DataError(message(f"{called}: no such file.", rule="--data names a UTF-8 text file",
                                fix="check the path, or leave --data out to train on the default corpus"))
    if p.is_dir():
        raise DataError(message(f"{called}: is a directory, not a file.", rule="--data names a UTF-8 text file",
                                fix="name one text file; concatenate several first if needed"))
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(message(f"{called}: cannot be read ({e.strerror or e}).",
                                fix="check the file's permissions")) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(message(
            f"{called}: not UTF-8 at byte offset {e.start}.",
            inputs=[f"bytes there: {raw[e.start:e.start + 8]!r}", f"file size: {len(raw)} bytes"],
            rule="the training text is UTF-8",
            fix="convert it, e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8`")) from None
    if not text:
        raise DataError(message(f"{called}: the file is empty.", rule="training needs some text",
                                fix="name a non-empty UTF-8 text file"))
    return text


# ------------------------------------------------------------- tokenizer

class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no dependency, every string round-trips."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """``text``'s UTF-8 bytes as an int64 tensor of shape ``[num_bytes]``."""
        data = text.encode("utf-8")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64) if data else \
            torch.zeros(0, dtype=torch.int64)

    def decode(self, ids) -> str:
        """The text of ``ids`` (bytes 0..255); a cut multi-byte character becomes U+FFFD."""
        ids = torch.as_tensor(ids).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) > 255):
            raise DataError(message(f"ByteTokenizer.decode: ids outside 0..255 "
                                    f"(min {int(ids.min())}, max {int(ids.max())}).",
                                    rule="byte tokens are 0..255", fix="decode only byte token ids"))
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


# ------------------------------------------------------------- batching

def token_digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' values as little-endian int64, the same on every platform."""
    h = hashlib.sha256()
    for t in tensors:
        b = t.to(torch.int64).reshape(-1).clone().view(torch.uint8)
        if sys.byteorder == "big":
            b = b.view(-1, 8).flip(1).reshape(-1)
        b = b.contiguous()
        # Read the contiguous buffer directly: no numpy needed, and no per-element Python loop.
        h.update(ctypes.string_at(b.data_ptr(), b.numel()))
    return h.hexdigest()


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints whose outputs look uniform."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def row_offset(seed: int, step: int, row: int, num_starts: int) -> int:
    """The start offset of ``row`` at ``step``: a hash of ``(seed, step, row)`` mod ``num_starts``.

    Pure Python integer maths, so it is the same on every platform and torch
    version.  The modulo bias is below ``num_starts / 2**64``.
    """
    h = _mix64((seed & _MASK64) ^ 0x9E3779B97F4A7C15)
    h = _mix64(h ^ (step & _MASK64))
    h = _mix64(h ^ (row & _MASK64) ^ 0xD1B54A32D192ED03)
    return h % num_starts


def row_generator(seed: int, row: int) -> torch.Generator:
    """A random stream of its own for ``row`` of the batch drawn from ``seed``: a generator seeded by
    a 64-bit hash of the two, so a rank that builds rows ``a:b`` draws exactly their numbers of the
    whole batch (a model's ``batches``, :class:`meshdsl.Model`).

    Example::

        x = torch.stack([torch.randn(16, generator=row_generator(seed, r)) for r in range(4, 8)])
    """
    return torch.Generator().manual_seed(_mix64(_mix64((seed & _MASK64) ^ 0x2545F4914F6CDD1D) ^ (row & _MASK64)))


def _rows(rows: "slice | None", batch_size: int, called: str) -> range:
    """The row indices of ``rows`` (a contiguous part of ``range(batch_size)``)."""
    if rows is None:
        return range(batch_size)
    start = 0 if rows.start is None else rows.start
    stop = batch_size if rows.stop is None else rows.stop
    if rows.step not in (None, 1) or not 0 <= start <= stop <= batch_size:
        raise DataError(message(f"{called}: rows {rows} is not a contiguous part of 0..{batch_size}.",
                                rule="a data rank asks for slice(start, stop) with 0 <= start <= stop <= batch",
                                fix="pass e.g. slice(rank * n, (rank + 1) * n)"))
    return range(start, stop)


@dataclass(frozen=True, eq=False)
class TokenData:
    """Tokens with a held-out tail, and batches that are pure functions of ``(seed, step)``.

    Args:
      tokens: int64 token ids, shape ``[num_tokens]``.
      seed: the data seed; batches depend on it and on the step only.
      eval_fraction: the share of tokens at the end held out for eval loss.
      source: where the text came from (a path, or ``"stdlib"``), for :meth:`fingerprint`.

    Example::

        data = TokenData.load(None, seed=0)          # the default corpus
        ids, labels = data.batch(step=3, batch_size=8, seq=64, rows=slice(4, 8))
    """

    tokens: torch.Tensor
    seed: int = 0
    eval_fraction: float = DEFAULT_EVAL_FRACTION
    source: str = "tensor"

    def __post_init__(self):
        if not 0.0 < self.eval_fraction < 1.0:
            raise DataError(message(f"TokenData: eval_fraction {self.eval_fraction} is not in (0, 1).",
                                    rule="some tokens train and some are held out",
                                    fix=f"use e.g. {DEFAULT_EVAL_FRACTION}"))
        object.__setattr__(self, "tokens", torch.as_tensor(self.tokens, dtype=torch.int64).reshape(-1))

    @classmethod
    def load(cls, path=None, *, seed: int = 0, eval_fraction: float = DEFAULT_EVAL_FRACTION) -> "TokenData":
        """Byte tokens of :func:`load_text` ``(path)`` (the default corpus when ``None``)."""
        tokens = ByteTokenizer().encode(load_text(path))
        return cls(tokens, seed, eval_fraction, "stdlib" if path is None else str(path))

    @property
    def split(self) -> int:
        """The first held-out token index: tokens before it train, from it on they evaluate."""
        return len(self.tokens) - max(1, math.ceil(len(self.tokens) * self.eval_fraction))

    @property
    def train_tokens(self) -> torch.Tensor:
        """The tokens batches are drawn from (before :attr:`split`)."""
        return self.tokens[:self.split]

    @property
    def eval_tokens(self) -> torch.Tensor:
        """The held-out tokens eval batches tile (from :attr:`split` on)."""
        return self.tokens[self.split:]

    def _check_fits(self, part: str, num_tokens: int, seq: int, needed: int, called: str,
                    batch_size: int) -> None:
        for what, n in (("batch_size", batch_size), ("seq", seq)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise DataError(message(f"{called}: {what} must be an int >= 1, got {n!r}.",
                                        fix=f"pass a positive {what}"))
        if num_tokens < needed:
            raise DataError(message(
                f"{called}: the {part} split has {num_tokens} tokens; {needed} are needed.",
                inputs=[f"source: {self.source}", f"tokens: {len(self.tokens)}, eval_fraction: {self.eval_fraction}"],
                rule=f"a row of seq {seq} reads seq + 1 tokens (inputs and next-token labels)",
                fix="use a shorter seq or a longer text"))

    def batch(self, step: int, batch_size: int, seq: int, rows: "slice | None" = None):
        """Next-token pairs ``(ids, labels)`` of rows ``rows`` of the global batch at ``step``.

        Args:
          step: the training step; with the seed it fixes the batch.
          batch_size: rows in the global batch.
          seq: tokens per row.
          rows: ``slice(start, stop)`` of the rows this data rank builds (all when ``None``);
            e.g. the batch dim's entry of ``sharding.slice_index(shape, mesh, rank)``.

        Returns:
          Two int64 tensors of shape ``[len(rows), seq]``; ``labels`` is ``ids`` shifted by one.
          Every token read lies in the train split.
        """
        called = f"TokenData.batch(step={step}, batch_size={batch_size}, seq={seq})"
        self._check_fits("train", self.split, seq, seq + 1, called, batch_size)
        num_starts = self.split - seq   # starts 0..split-seq-1 keep the last label inside the split
        starts = [row_offset(self.seed, step, r, num_starts) for r in _rows(rows, batch_size, called)]
        return self._windows(self.tokens, starts, seq)

    @staticmethod
    def _windows(tokens: torch.Tensor, starts: list[int], seq: int):
        if not starts:
            empty = torch.zeros(0, seq, dtype=torch.int64)
            return empty, empty.clone()
        idx = torch.tensor(starts, dtype=torch.int64)[:, None] + torch.arange(seq + 1)
        win = tokens[idx]
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()

    def num_eval_batches(self, batch_size: int, seq: int) -> int:
        """How many whole eval batches the held-out split tiles into."""
        return (len(self.eval_tokens) - 1) // seq // batch_size

    def eval_batches(self, batch_size: int, seq: int, num_batches: int | None = None,
                     rows: "slice | None" = None) -> list:
        """A fixed set of eval batches: consecutive, non-overlapping windows of the held-out split.

        Batch ``b`` row ``r`` is window ``b * batch_size + r``, starting at token
        ``split + window * seq``.  The same on every mesh and at every step.

        Args:
          num_batches: how many (default: every whole batch that fits).
          rows: as for :meth:`batch`.
        """
        called = f"TokenData.eval_batches(batch_size={batch_size}, seq={seq})"
        self._check_fits("eval", len(self.eval_tokens), seq, seq + 1, called, batch_size)
        want = self.num_eval_batches(batch_size, seq) if num_batches is None else num_batches
        self._check_fits("eval", len(self.eval_tokens), seq, max(1, want) * batch_size * seq + 1, called, batch_size)
        out = []
        for b in range(want):
            starts = [self.split + (b * batch_size + r) * seq for r in _rows(rows, batch_size, called)]
            out.append(self._windows(self.tokens, starts, seq))
        return out

    def unigram_entropy(self) -> float:
        """Entropy in nats of the train split's byte frequencies (a bigram-free loss baseline)."""
        counts = torch.bincount(self.train_tokens, minlength=256).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())

    def fingerprint(self) -> dict:
        """What identifies this data: source, Python version, sizes, sha256 of the tokens, seed."""
        return {"source": self.source, "python": sys.version.split()[0], "num_tokens": len(self.tokens),
                "sha256": token_digest(self.tokens), "eval_fraction": self.eval_fraction, "seed": self.seed}

    def state(self, step: int) -> dict:
        """The data position to save: the next step and :meth:`fingerprint` (JSON-able).

        Batches are pure functions of ``(seed, step)``, so nothing else is needed to resume.
        """
        return {"step": int(step), **self.fingerprint()}

    def check_state(self, state: dict) -> int:
        """The step to resume at from a saved :meth:`state`, after checking it is the same data.

        Raises:
          DataError: the saved data differs (another file, another Python's stdlib, another seed).
        """
        now = self.fingerprint()
        bad = [f"{k}: saved {state.get(k)!r}, now {now[k]!r}" for k in ("sha256", "num_tokens", "seed",
                                                                         "eval_fraction")
               if state.get(k) != now[k]]
        if bad:
            if state.get("python") != now["python"] and state.get("source") == "stdlib":
                bad.append(f"python: saved {state.get('python')}, now {now['python']} (the default "
                           "corpus is this Python's standard library)")
            raise DataError(message("resume: the training data differs from the checkpoint's.",
                                    inputs=[f"source: saved {state.get('source')!r}, now {now['source']!r}"],
                                    bullets=bad, rule="a resumed run sees the same batches as an unbroken one",
                                    fix="resume with the same --data, seed and Python, or start a new run"))
        return int(state["step"])


__all__ = ["DEFAULT_CORPUS_BYTES", "DEFAULT_EVAL_FRACTION", "ByteTokenizer", "DataError", "TokenData",
           "default_corpus_text", "load_text", "row_generator", "row_offset", "stdlib_sources", "token_digest"]
