"""Lowering: a graph, a mesh and a layout become an SPMD :class:`~.plan.Plan`.

Importing the package loads every module that registers a lowering rule
(:mod:`.rules`), so :func:`~.compiler.compile` always sees the full table.
"""
from . import repeat, window  # noqa: F401  (they register their rules on import)
from . import conv  # noqa: F401  (conv's rule and its weight gradient's: halo exchanges on split spatial dims)
from . import scan  # noqa: F401  (cumsum's rule)
from . import global_sum  # noqa: F401  (scalar_sum's rule: one reduction per axis set)
from . import reshape  # noqa: F401  (reshape's and rearrange's rule: splits kept where exact)
from . import xent  # noqa: F401  (cross_entropy's rule: fused, or composite when the class dim is split)
from . import softmax  # noqa: F401  (softmax's rule: fused, or composite when its dim arrives split)
from . import norms  # noqa: F401  (rms_norm's and layer_norm's rules: fused, or composite when the dim arrives split)
from . import attention  # noqa: F401  (attention's rule: fused, or composite when its keys arrive split)
from . import concat  # noqa: F401  (concat's rule: torch.cat, or a sum of pads when its dim arrives split)
from . import argmax  # noqa: F401  (argmax's and argmin's rules: torch's kernel, or reductions when the dim arrives split)
from . import flip  # noqa: F401  (flip's rule: local, or one reversing permute when its dim arrives split)
from . import topk  # noqa: F401  (top_k's rule: torch's kernel, or a top-k of each part's top-k when its dim arrives split)
