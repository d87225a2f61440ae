"""How ``meshdsl check`` compares a layout's outputs with the dense program's: per-output allowances and the table."""
from __future__ import annotations

from .cli_common import EXIT_MISMATCH, EXIT_OK, make_console

# An output that is zero in exact math (a bias gradient cancelled by a following
# norm) comes out as rounding noise on both sides, so a tolerance relative to its
# own magnitude fails it.  Its rounding error scales with the magnitudes summed
# into it, and the backward pass sums the same activation gradients into every
# param gradient: so each output is allowed tol * max(its own magnitude, the
# largest magnitude of its family), where a family is the outputs sharing a
# prefix ("grad/*", "new/*"; "loss" is its own).  A wrong layout is off by O(1) of
# an output's magnitude; in a gradient far smaller than its family's largest,
# such an error is caught only above tol * that largest.


def _family(name: str) -> str:
    return name.split("/", 1)[0] if "/" in name else name


def allowed_diff(want: dict, tol: float) -> dict[str, float]:
    """Per output, the largest max-abs-difference ``check`` accepts (see the comment above)."""
    mags = {k: (v.abs().max().item() if v.numel() else 0.0) for k, v in want.items()}
    top: dict[str, float] = {}
    for k, m in mags.items():
        top[_family(k)] = max(top.get(_family(k), 0.0), m)
    return {k: tol * max(m, top[_family(k)]) for k, m in mags.items()}


def report_check(want: dict, got: dict, tol: float, where: str) -> int:
    """Print the per-output differences; EXIT_OK when every difference is within its allowance.

    The allowance of an output is ``tol * max(max|dense|, the largest max|dense|
    of its family)`` (every ``grad/*`` at the scale of the largest gradient); an
    all-zero family must match exactly.
    """
    from rich.table import Table

    allowed = allowed_diff(want, tol)
    t = Table(title=f"check: {where}  (tolerance {tol:g} relative to max|dense| of the output, "
                    f"or of the largest gradient for a gradient)", title_justify="left")
    for col in ("output", "shape", "max |dense|", "max abs diff", "allowed", ""):
        t.add_column(col, justify="left" if col in ("output", "shape") else "right")
    worst, bad = 0.0, []
    for k, ref in want.items():
        diff = (got[k].double().cpu() - ref.double().cpu()).abs().max().item() if ref.numel() else 0.0
        scale = ref.abs().max().item() if ref.numel() else 0.0
        worst = max(worst, diff)
        ok = diff <= allowed[k]  # False for nan
        if not ok:
            bad.append(k)
        t.add_row(k, str(tuple(ref.shape)), f"{scale:.3e}", f"{diff:.3e}", f"{allowed[k]:.1e}",
                  "ok" if ok else "[bold red]FAIL[/]")
    console = make_console()
    console.print(t)
    if bad:
        console.print(f"[bold red]FAIL[/]: {len(bad)} of {len(want)} outputs over tolerance "
                      f"({', '.join(bad)}); overall max abs diff {worst:.3e}")
        return EXIT_MISMATCH
    console.print(f"[bold green]OK[/]: {len(want)} outputs match the dense program; "
                  f"overall max abs diff {worst:.3e}")
    return EXIT_OK
