"""Running plans: the plan executor and its step rules.

Importing the package registers every step rule: the plain ones in :mod:`.steps`, the
repeat loop's in :mod:`.layers` and the pipeline's in :mod:`.pipeline`, so an
:class:`~.executor.Executor` can run any step a plan holds.
"""
from . import layers, pipeline  # noqa: F401  (they register their step rules)
