"""Execution: plans run on the simulated mesh or on torch.distributed.

Importing the package registers every step rule (:mod:`.steps`, and the
repeat loop in :mod:`.loop`, the pipeline in :mod:`.pipeline`), so an :class:`~.executor.Executor` can run any
step a plan holds.
"""
from . import loop, pipeline  # noqa: F401  (register the repeat and pipeline step rules)
