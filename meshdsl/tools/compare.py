"""How ``meshdsl check`` compares a layout's outputs with the dense program's: per-output allowances and the table."""
from __future__ import annotations

from ..runtime.agreement import allowed_diff
from .cli_common import EXIT_MISMATCH, EXIT_OK, make_console

__all__ = ["allowed_diff", "report_check"]

# Each output's allowance: see meshdsl/runtime/agreement.py.


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
