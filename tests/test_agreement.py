"""meshdsl/runtime/agreement.py: the per-output allowance ``check`` and ``--compile`` share."""
from __future__ import annotations

import pytest
import torch

from meshdsl.runtime.agreement import allowed_diff, disagreement


def test_each_output_is_allowed_tol_times_its_familys_largest_magnitude():
    want = {"loss": torch.tensor(2.0), "grad/a": torch.tensor([1e-6]), "grad/b": torch.tensor([-3.0])}
    assert allowed_diff(want, 1e-4) == pytest.approx({"loss": 2e-4, "grad/a": 3e-4, "grad/b": 3e-4}, rel=1e-12)


def test_disagreement_names_the_worst_output():
    want = {"loss": [torch.tensor(2.0)], "grad/w": [torch.ones(3), torch.ones(3)]}
    close = {"loss": [torch.tensor(2.0001)], "grad/w": [torch.ones(3), torch.ones(3) + 5e-5]}
    assert disagreement(close, want) is None
    off = {"loss": [torch.tensor(2.0)], "grad/w": [torch.ones(3), torch.tensor([1.0, 1.5, 1.0])]}
    assert disagreement(off, want) == "grad/w by 0.5 where 0.0001 is allowed"


def test_nans_agree_only_where_both_have_them():
    nan = torch.tensor([float("nan"), 1.0])
    assert disagreement({"y": [nan.clone()]}, {"y": [nan]}) is None
    assert disagreement({"y": [torch.tensor([0.0, 1.0])]}, {"y": [nan]}) == "y by inf where 0.0001 is allowed"
    assert disagreement({"y": [torch.ones(3)]}, {"y": [torch.ones(2)]}) is not None   # a shape differs
