"""Execution: plans run on the simulated mesh or on torch.distributed.

Importing :mod:`.executor` registers every step rule (:mod:`.steps`, and the
repeat loop in :mod:`.loop`, the pipeline in :mod:`.pipeline`), so an
:class:`~.executor.Executor` can run any step a plan holds.  The package itself
imports nothing: :mod:`.start` (how ranks start) stays free of torch.
"""
