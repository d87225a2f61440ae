"""What the launcher reports when ranks raise (processes/failures.py).

A meshdsl error meant for users comes back from the ranks as its one message, naming the
rank(s) (once when several raised the same), with no traceback, and the CLI exits with 2;
any other exception is an internal error carrying the rank's traceback (exit 3).  Ranks
report errors as plain text: the launcher unpickles nothing they wrote about a failure.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import time_limit
from meshdsl.errors import DistributedError, GraphError
from meshdsl.processes.failures import Raised, RankInternalError, failure_error, user_error
from meshdsl.tools import cli
from meshdsl.train.checkpoint_format import CheckpointError

ROOT = Path(__file__).resolve().parents[1]


class _Proc:
    """What failure_error reads of a process: its pid and exit code."""

    def __init__(self, pid: int, exitcode: int | None):
        self.pid, self.exitcode = pid, exitcode


def _raised(exc: BaseException, when: float = 1.0) -> Raised:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - the report of any exception
        import traceback
        return Raised.of(e, when, traceback.format_exc())


def _fail(errors: dict[int, Raised], nproc: int):
    procs = [_Proc(100 + i, 1 if i in errors else None) for i in range(nproc)]
    return failure_error(procs, set(errors), {}, errors, sorted(errors), ["fn: f", f"processes: {nproc}"])


def test_a_report_is_plain_text_and_round_trips():
    r = _raised(GraphError("run: no value fed for input 'target'.\nFix: add 'target' to the feeds"))
    data = r.encode()
    assert Raised.is_report(data) and b"GraphError" in data
    assert Raised.decode(data) == r
    assert r.user and r.kind == "meshdsl.errors.GraphError"
    assert not _raised(ValueError("boom")).user  # a ValueError, but not meshdsl's


def test_an_unreadable_report_is_an_internal_error_that_shows_it():
    r = Raised.decode(b"E{not json")
    assert not r.user and "unreadable error report" in r.traceback


def test_the_same_user_error_on_every_rank_is_said_once_without_a_traceback():
    text = "run: no value fed for input 'target'.\n  fed: ['x']\nFix: add 'target' to the feeds"
    err = _fail({0: _raised(GraphError(text), 1.0), 1: _raised(GraphError(text), 1.1)}, 2)
    assert str(err) == f"ranks 0, 1 of 2 raised the same exception: {text}"
    # Still the rank's own class (and a failed job): `except GraphError` works around a launch.
    assert isinstance(err, GraphError) and isinstance(err, DistributedError)
    assert not isinstance(err, RankInternalError)


def test_the_earliest_user_error_leads_and_other_ranks_get_a_line_each():
    bad = _raised(CheckpointError("checkpoint step-10: rank-00001.safetensors is truncated\nnothing was loaded"), 1.0)
    lost = _raised(RuntimeError("Connection closed by peer"), 2.0)
    err = _fail({0: lost, 1: bad, 2: bad, 3: _raised(CheckpointError("another"), 1.5)}, 5)
    lines = str(err).splitlines()
    assert lines[0] == "ranks 1, 2 of 5 raised the same exception: checkpoint step-10: rank-00001.safetensors " \
                       "is truncated"
    assert lines[2:] == ["Other ranks:", "  * rank 0 lost its connection when rank 1 stopped (a consequence): "
                         "RuntimeError: Connection closed by peer",
                         "  * rank 3 also failed: another"]
    assert isinstance(err, CheckpointError) and "Traceback" not in str(err)


def test_rank_ranges_are_compact():
    r = _raised(GraphError("bad feed"))
    err = user_error({i: r for i in (0, 1, 2, 3, 5, 7, 8)}, 0, 9)
    assert str(err).startswith("ranks 0-3, 5, 7, 8 of 9 raised the same exception: bad feed")


def test_a_class_the_launcher_does_not_know_comes_back_as_a_distributed_error():
    r = Raised(1.0, "some.plugin.PluginError", True, "plugin says no", "")
    err = user_error({0: r}, 0, 2)
    assert type(err) is DistributedError and str(err) == "rank 0 of 2 raised an exception: plugin says no"


def test_any_other_exception_is_internal_with_the_rank_traceback():
    err = _fail({1: _raised(KeyError("w1"))}, 2)
    assert isinstance(err, RankInternalError)
    assert "spawn: rank 1 of 2 raised an exception" in str(err) and "Traceback of rank 1:" in str(err)
    assert "KeyError: 'w1'" in str(err)


def test_the_cli_exits_3_with_the_rank_traceback_for_an_internal_error(monkeypatch, capsys):
    def crash(args):
        raise _fail({0: _raised(KeyError("w1"))}, 2)

    monkeypatch.setattr(cli, "cmd_plan", crash)
    assert cli.main(["plan", "mlp", "--tiny", "--mesh", "data:1"]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.startswith("meshdsl plan: internal error, please report it") and "Traceback of rank 0:" in err


@pytest.mark.timeout(240)
def test_a_missing_feed_on_two_processes_is_one_clean_message(tmp_path, capsys):
    model = (ROOT / "models" / "mlp.py").read_text()
    feeds = '"target": torch.randn(cfg.batch, cfg.d_model, generator=gen)}'
    assert feeds in model
    path = tmp_path / "nofeed.py"
    path.write_text(model.replace(feeds, "}"))  # feeds() gives 'x' only
    start = time.monotonic()
    code = cli.main(["run", str(path), "--tiny", "--mesh", "data:2", "--layout", "batch:data", "--steps", "1",
                     "--warmup", "0", "--timeout", "120", "--job-timeout", "200"])
    out = capsys.readouterr()
    assert code == cli.EXIT_USAGE, out.err
    assert "Traceback" not in out.err and "File \"" not in out.err
    assert out.err.count("no value fed for input 'target'") == 1
    first = out.err.splitlines()[0]
    # Both ranks raise it at the same step; under load one may report after the launcher stopped it.
    assert first in ("meshdsl run: error: ranks 0, 1 of 2 raised the same exception: run: no value fed for input "
                     "'target'.",
                     "meshdsl run: error: rank 0 of 2 raised an exception: run: no value fed for input 'target'.",
                     "meshdsl run: error: rank 1 of 2 raised an exception: run: no value fed for input 'target'.")
    assert "Fix: add 'target' to the feeds" in out.err
    # Reported as the ranks raised it (about 2.5 s with the start, idle), not at a survivor's collective timeout.
    assert time.monotonic() - start < time_limit(20.0)
