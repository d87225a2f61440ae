"""Whether two runs' outputs agree: the allowance ``meshdsl check`` gives each output, and the
check a compiled whole step passes against the eager executor before it is used.

An output that is zero in exact math (a bias gradient cancelled by a following norm) comes
out as rounding noise on both sides, so a tolerance relative to its own magnitude fails it.
Its rounding error scales with the magnitudes summed into it, and the backward pass sums
the same activation gradients into every param gradient: so each output is allowed
``tol * max(its own magnitude, the largest magnitude of its family)``, where a family is the
outputs sharing a prefix ("grad/*", "new/*"; "loss" is its own).  A wrong layout or a wrong
compiled kernel is off by O(1) of an output's magnitude; in a gradient far smaller than its
family's largest, such an error is caught only above ``tol`` times that largest.
"""
from __future__ import annotations

import torch

#: the tolerance a compiled step is held to, by the lowest precision among its outputs: fp32
#: rounding of reordered sums (``check``'s default), and a few bf16/fp16 units in the last place
TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def family(name: str) -> str:
    return name.split("/", 1)[0] if "/" in name else name


def allowed_diff(want: dict, tol: float) -> dict[str, float]:
    """Per output, the largest max-abs-difference ``check`` accepts (see the module docstring)."""
    mags = {k: (v.abs().max().item() if v.numel() else 0.0) for k, v in want.items()}
    top: dict[str, float] = {}
    for k, m in mags.items():
        top[family(k)] = max(top.get(family(k), 0.0), m)
    return {k: tol * max(m, top[family(k)]) for k, m in mags.items()}


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want|, a NaN or infinity where both have it counting as equal; inf where only one has."""
    if got.shape != want.shape:
        return float("inf")
    g, w = got.detach().double(), want.detach().double()
    same = (g == w) | (g.isnan() & w.isnan())
    if bool((~same & ~(g.isfinite() & w.isfinite())).any()):
        return float("inf")
    return (g - w).masked_fill(same, 0).abs().max().item() if g.numel() else 0.0


def disagreement(got: dict, want: dict) -> str | None:
    """None where every output of ``got`` (name -> a tensor per held rank, as the executor returns
    them) is within its allowance of ``want``'s; else the worst output, its difference and allowance."""
    flat_w = {f"{k}#{j}": w for k, ws in want.items() if ws is not None for j, w in enumerate(ws)}
    flat_g = {f"{k}#{j}": g for k, gs in got.items() if gs is not None for j, g in enumerate(gs)}
    if flat_g.keys() != flat_w.keys():
        return f"outputs {sorted(flat_g)} against {sorted(flat_w)}"
    finite = {k: torch.nan_to_num(w.detach().double(), nan=0.0, posinf=0.0, neginf=0.0) for k, w in flat_w.items()}
    dtypes = [w.dtype for w in flat_w.values() if w.is_floating_point()]
    tol = max((TOLERANCE.get(d, 1e-4) for d in dtypes), default=1e-4)
    allowed = allowed_diff(finite, tol)
    diffs = {k: _max_diff(flat_g[k], w) for k, w in flat_w.items()}
    over = [k for k, d in diffs.items() if d > allowed[k]]
    if not over:
        return None
    k = max(over, key=lambda k: diffs[k] / allowed[k] if allowed[k] else float("inf"))
    return f"{k.split('#')[0]} by {diffs[k]:.3g} where {allowed[k]:.3g} is allowed"
