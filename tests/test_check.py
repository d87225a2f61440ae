"""md.check (meshdsl/runtime/check.py): a layout's outputs against the dense program's, from Python."""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.runtime.check import compare


def _mlp():
    B, D, F = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("d_ff", 6)
    with md.Graph():
        x = md.input("x", [B, D])
        w1 = md.param("w1", [D, F], fan_out=[F])
        w2 = md.param("w2", [F, D], fan_out=[D])
        h = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w1))
        y = md.einsum("batch d_ff, d_ff d_model -> batch d_model", h, w2)
        loss = md.reduce_mean(y ** 2)
        grads = md.grad(loss, {"w1": w1, "w2": w2})
    return {"loss": loss, **{f"grad/{k}": v for k, v in grads.items()}}, {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(0))}


@pytest.mark.parametrize("mesh,layout", [("data:2; model:2", "batch:data; d_ff:model"),
                                         ("model:4", "d_ff:model"),          # 6 split 4 ways: uneven
                                         ("data:2", "batch:data; params.d_model:data")])
def test_a_valid_layout_matches_and_the_table_says_so(mesh, layout):
    outputs, feeds = _mlp()
    r = md.check(outputs, mesh, layout, feeds)
    assert r.ok and r.failed == [] and [o.name for o in r.outputs] == list(outputs)
    text = str(r)
    assert text.splitlines()[0] == f"check: mesh '{mesh}', layout '{layout}' (tolerance 0.0001)"
    assert text.splitlines()[-1].startswith("OK: 3 outputs match the dense program")


def test_given_params_and_compile_options_reach_both_sides():
    outputs, feeds = _mlp()
    params = {"w1": torch.ones(4, 6), "w2": torch.full((6, 4), 0.5)}
    r = md.check(outputs, "data:2", "batch:data", feeds, params=params, microbatches=2)
    want = md.run_dense(outputs, feeds, params=params)
    assert r.ok and r.outputs[0].max_dense == pytest.approx(want["loss"].abs().item())


def test_compare_flags_an_output_off_by_more_than_its_allowance():
    want = {"loss": torch.tensor(2.0), "grad/a": torch.tensor([1.0, -4.0]), "grad/b": torch.zeros(2)}
    # grad/b is zero: allowed 1e-4 x the largest gradient (4.0), so 3e-4 passes and 5e-4 fails
    near = compare(want, {**want, "grad/b": torch.tensor([3e-4, 0.0])}, 1e-4)
    far = compare(want, {**want, "grad/b": torch.tensor([5e-4, 0.0])}, 1e-4)
    assert all(o.ok for o in near)
    assert [o.name for o in far if not o.ok] == ["grad/b"] and far[2].allowed == pytest.approx(4e-4)
    assert not compare(want, {**want, "loss": torch.tensor(float("nan"))}, 1e-4)[0].ok


def test_a_result_with_a_mismatch_is_not_ok_and_names_it():
    outputs, feeds = _mlp()
    r = md.check(outputs, "data:2", "batch:data", feeds)
    bad = md.CheckResult(r.mesh, r.layout, r.tol, (*r.outputs[:2], type(r.outputs[2])("grad/w2", (6, 4), 1.0, 1.0, 1e-4)))
    assert not bad.ok and bad.failed == ["grad/w2"]
    assert str(bad).splitlines()[-1].startswith("FAIL: 1 of 3 outputs over tolerance (grad/w2)")


def test_a_bad_layout_is_the_compilers_error():
    outputs, feeds = _mlp()
    with pytest.raises(md.LayoutError, match="d_fff"):
        md.check(outputs, "model:2", "d_fff:model", feeds)


def test_a_schedule_that_changes_nothing_is_noted_as_the_cli_notes_it(capsys):
    """``schedule=`` for a layout that pipelines nothing: one ``note:`` line, the words of
    ``meshdsl check`` and ``md.fit``; none where the schedule is used or not given."""
    outputs, feeds = _mlp()
    assert md.check(outputs, "data:2", "batch:data", feeds, microbatches=2, schedule="1f1b").ok
    out = capsys.readouterr().out
    assert out.count("note: schedule '1f1b' has no effect: the layout pipelines no repeat") == 1, out
    assert md.check(outputs, "data:2", "batch:data", feeds, microbatches=2).ok
    assert "note:" not in capsys.readouterr().out
