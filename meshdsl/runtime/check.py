"""``md.check``: a layout's outputs against the dense program's, from Python.

The same comparison as ``meshdsl check``: the graph is compiled for the mesh and layout, run
with every rank simulated in this process, and each output is compared with the dense
program's (:func:`~.dense.run_dense`, one device, no mesh) within the allowance
:func:`~.agreement.allowed_diff` gives it: ``tol`` times the output's largest magnitude, or its
family's (every ``grad/*`` at the scale of the largest gradient).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import GraphError, did_you_mean, message
from ..ir.interpret import feeds_dict
from ..lowering.compiler import compile as compile_plan, ignored_options
from .agreement import allowed_diff
from .dense import check_given_params, run_dense
from .simulated import declared_params, run_simulated


@dataclass(frozen=True)
class OutputCheck:
    """One output: its largest dense magnitude, the largest difference, and the allowance."""

    name: str
    shape: tuple[int, ...]
    max_dense: float
    max_diff: float
    allowed: float
    excused: int = 0        # elements not counted: an update where the dense gradient is rounding noise
    whole: bool = False     # ... and with them the whole param's (an optimizer coupling its elements)

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.allowed   # False for NaN


@dataclass(frozen=True)
class CheckResult:
    """Every output's :class:`OutputCheck`; ``ok`` when all are within their allowance.
    ``str()`` is a table, one row per output."""

    mesh: str
    layout: str
    tol: float
    outputs: tuple[OutputCheck, ...]

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def failed(self) -> list[str]:
        return [o.name for o in self.outputs if not o.ok]

    @property
    def max_diff(self) -> float:
        return max((o.max_diff for o in self.outputs), default=0.0)

    def __str__(self) -> str:
        width = max([len("output"), *(len(o.name) for o in self.outputs)])
        lines = [f"check: mesh '{self.mesh}', layout '{self.layout}' (tolerance {self.tol:g})",
                 f"{'output':<{width}}  {'max |dense|':>11}  {'max abs diff':>12}  {'allowed':>9}"]
        lines += [f"{o.name:<{width}}  {o.max_dense:11.3e}  {o.max_diff:12.3e}  {o.allowed:9.1e}  "
                  f"{'ok' if o.ok else 'FAIL'}" for o in self.outputs]
        verdict = (f"OK: {len(self.outputs)} outputs match the dense program" if self.ok else
                   f"FAIL: {len(self.failed)} of {len(self.outputs)} outputs over tolerance ({', '.join(self.failed)})")
        return "\n".join([*lines, f"{verdict}; overall max abs diff {self.max_diff:.3e}"])


def compare(want: dict, got: dict, tol: float, grads: dict | None = None,
            coupled: bool = False) -> tuple[OutputCheck, ...]:
    """Each output of ``want`` (the dense program's) against the same name in ``got``.

    An element of an updated param ``new/NAME`` over its allowance is not counted where the dense
    gradient ``grad/NAME`` (in ``grads``, else in ``want``) is within its own allowance of zero:
    there the gradient is rounding noise (zero in exact math, as a key bias cancelled by the
    softmax), and an adaptive optimizer's first step is about ``lr * sign(noise)``, which no two
    summation orders agree on.  With ``coupled`` (an optimizer that scales a param's whole update
    by statistics of all its elements: Adafactor's factored moments, its clipping by the update's
    RMS) such noise moves every element of that param, so none of its elements is counted then.
    The gradients themselves are compared in full.
    """
    allowed = allowed_diff(want, tol)
    rows = []
    for k, ref in want.items():
        ref64, got64 = ref.detach().double().cpu(), got[k].detach().double().cpu()
        gap = (got64 - ref64).abs()
        noise = _noise_gradient(k, want, grads or want, tol)
        excused = None if noise is None else noise & (gap > allowed[k])
        count = 0 if excused is None else int(excused.sum())
        if count:
            gap = gap.masked_fill(torch.ones_like(excused) if coupled else excused, 0.0)
        diff = gap.max().item() if ref.numel() else 0.0
        scale = ref64.abs().max().item() if ref.numel() else 0.0
        rows.append(OutputCheck(k, tuple(ref.shape), scale, diff, allowed[k], count, bool(count) and coupled))
    return tuple(rows)


def _noise_gradient(name: str, want: dict, grads: dict, tol: float):
    """For an updated param ``new/NAME`` whose dense gradient ``grads["grad/NAME"]`` is known, the
    elements where that gradient is within its allowance of zero (bool, shaped like it); else None."""
    g = f"grad/{name[4:]}"
    if not name.startswith("new/") or g not in grads or grads[g].shape != want[name].shape:
        return None
    return grads[g].detach().double().cpu().abs() <= allowed_diff(grads, tol)[g]


def _check_options(options: dict) -> None:
    """A keyword :func:`check` was given that is no option of :func:`~meshdsl.compile`: one user
    error naming it and the options there are (``remat=`` belongs where the gradients are built)."""
    import inspect

    known = [p for p in inspect.signature(compile_plan).parameters if p not in ("outputs", "mesh", "layout")]
    bad = sorted(k for k in options if k not in known)
    if not bad:
        return
    remat = "remat" in bad
    raise GraphError(message(
        f"check: {', '.join(f'{k}=' for k in bad)} is no option of check or md.compile.",
        inputs=[f"check's own: params=, tol=, seed=; md.compile's: {', '.join(f'{k}=' for k in known)}"],
        bullets=[f"{k}={did_you_mean(k, known)}" for k in bad if did_you_mean(k, known)],
        rule="check compiles the outputs it is given; what they compute (remat, precision) is fixed when "
             "they are built",
        fix=("build the gradients with it, md.grad(loss, params, remat=...) (or md.repeat(..., remat=...)), "
             "and check those outputs" if remat else "drop it, or pass one of the options above")))


def check(outputs, mesh, layout=None, feeds: dict | None = None, *, params: dict | None = None,
          tol: float = 1e-4, seed: int = 0, **compile_options) -> CheckResult:
    """Compare the layout's outputs with the dense program's, every rank simulated here.

    Args:
      outputs: a Tensor, a list of Tensors, or a dict name -> Tensor (a loss and its
        ``md.grad`` gradients, typically).
      mesh, layout: as for :func:`~meshdsl.compile` (strings, dicts, or the parsed objects).
      feeds: input name -> full torch tensor.
      params: param name -> full tensor; defaults to the deterministic init (``seed``), the
        same on both sides.  Any param of the outputs' graph may be given (all of a model's,
        from a checkpoint): one the outputs do not read is checked, then ignored.
      tol: each output's allowance relative to its magnitude (see the module docstring);
        1e-4, ``meshdsl check``'s default, covers fp32 sums added in another order.  Outputs named
        ``grad/<param>`` share one scale, the largest gradient's (a gradient that is exactly zero
        on the dense side passes within it); any other output is held to its own magnitude, so
        name gradients ``grad/...`` for that allowance.
      compile_options: passed to :func:`~meshdsl.compile` (``microbatches``, ``schedule``,
        ``stage_layers``, ``strict_splits``, ...).

    Returns:
      A :class:`CheckResult`: ``.ok``, ``.failed``, one :class:`OutputCheck` per output, and a
      table as ``str()``.  An option given that changes nothing (a ``schedule`` of a layout that
      pipelines nothing) is said on stdout, one ``note:`` line each, as ``meshdsl check`` says it.

    Raises:
      the errors of :func:`~meshdsl.compile`, :func:`~meshdsl.run_dense` and
      :func:`~meshdsl.run_simulated` for a bad graph, mesh, layout or feed.
    """
    _check_options(compile_options)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < float("inf"):
        raise GraphError(message(f"check: tol={tol!r} ({type(tol).__name__}) is not a positive number.",
                                 rule="tol is each output's allowance relative to its magnitude, a float > 0",
                                 fix="pass e.g. tol=1e-4 (the default) or tol=1e-3"))
    plan = compile_plan(outputs, mesh, layout, **compile_options)
    for note in ignored_options(plan):   # as `meshdsl check` and md.fit say them
        print(f"note: {note}", flush=True)
    # (said once, as check's: a param run_dense and run_simulated would each refuse)
    check_given_params("check", feeds_dict("check", params, "params"), declared_params(plan))
    want = run_dense(outputs, feeds, params=params, seed=seed)
    got = run_simulated(plan, feeds, params=params, seed=seed)
    with torch.no_grad():
        rows = compare(want, got, tol)
    return CheckResult(str(mesh), str(layout or ""), tol, rows)
