"""Execution: plans run on the simulated mesh or on torch.distributed.

Importing the package registers every step rule (:mod:`.steps`, and the
repeat loop in :mod:`.loop`), so an :class:`~.executor.Executor` can run any
step a plan holds.
"""
from . import loop  # noqa: F401  (registers the repeat step rule)
