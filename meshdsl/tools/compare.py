"""How ``meshdsl check`` compares a layout's outputs with the dense program's: per-output allowances and the table."""
from __future__ import annotations

import math

from ..runtime.agreement import allowed_diff
from ..runtime.check import compare
from .cli_common import EXIT_MISMATCH, EXIT_OK, make_console

__all__ = ["allowed_diff", "report_check"]

# Each output's allowance: see meshdsl/runtime/agreement.py.


def report_check(want: dict, got: dict, tol: float, where: str, grads: dict | None = None,
                 coupled: bool = False) -> int:
    """Print the per-output differences; EXIT_OK when every difference is within its allowance.

    The allowance of an output is ``tol * max(max|dense|, the largest max|dense|
    of its family)`` (every ``grad/*`` at the scale of the largest gradient); an
    all-zero family must match exactly.  An updated param's elements whose dense gradient is
    rounding noise are not counted, and a note says how many (:func:`~meshdsl.runtime.check.compare`,
    ``grads`` and ``coupled`` as there).
    """
    from rich.table import Table

    rows = compare(want, got, tol, grads, coupled)
    t = Table(title=f"check: {where}  (tolerance {tol:g} relative to max|dense| of the output, "
                    f"or of the largest gradient for a gradient)", title_justify="left")
    for col in ("output", "shape", "max |dense|", "max abs diff", "allowed", ""):
        t.add_column(col, justify="left" if col in ("output", "shape") else "right")
    for o in rows:
        t.add_row(o.name, str(o.shape), f"{o.max_dense:.3e}", f"{o.max_diff:.3e}", f"{o.allowed:.1e}",
                  "ok" if o.ok else "[bold red]FAIL[/]")
    console = make_console()
    console.print(t)
    for o in rows:
        if o.excused:
            console.print(f"note: {o.name}: {o.excused} of {math.prod(o.shape)} elements differ by more than allowed "
                          f"where the dense gradient is within its allowance of zero (rounding noise, which an "
                          f"adaptive optimizer's step amplifies to ±lr): "
                          + ("the optimizer scales the whole param's update by them, so no element is counted"
                             if o.whole else "not counted"))
    bad, worst = [o.name for o in rows if not o.ok], max((o.max_diff for o in rows), default=0.0)
    if bad:
        console.print(f"[bold red]FAIL[/]: {len(bad)} of {len(want)} outputs over tolerance "
                      f"({', '.join(bad)}); overall max abs diff {worst:.3e}")
        return EXIT_MISMATCH
    console.print(f"[bold green]OK[/]: {len(want)} outputs match the dense program; "
                  f"overall max abs diff {worst:.3e}")
    return EXIT_OK
