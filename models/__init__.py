"""Example models, one per file (nanoGPT-style): ``mlp`` and ``transformer``.

Each file defines a ``Config`` dataclass (with a ``tiny()`` classmethod for
tests) and ``build(cfg) -> meshdsl.Model``.  The tools load them
by name (``meshdsl plan transformer ...``) or by path; this package file only
lets tests and benchmarks ``import models.transformer`` from the repository root.
"""
