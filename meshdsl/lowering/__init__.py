"""Lowering: a graph, a mesh and a layout become an SPMD :class:`~.plan.Plan`.

Importing the package loads every module that registers a lowering rule
(:mod:`.rules`), so :func:`~.compiler.compile` always sees the full table.
"""
from . import repeat, shift  # noqa: F401  (they register their rules on import)
from . import scan  # noqa: F401  (cumsum's rule)
from . import global_sum  # noqa: F401  (scalar_sum's rule: one reduction per axis set)
from . import xent  # noqa: F401  (cross_entropy's rule: fused, or composite when the class dim is split)
