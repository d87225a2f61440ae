"""Learning-rate schedules: plain callables from a 0-based step to a learning rate.

A schedule's value is fed to the training step as a runtime input
(``TrainStep(...)(feeds, lr=sched(step))``), so changing it never recompiles.
"""
from __future__ import annotations

import math

from ..errors import MeshDSLError, message


def cosine_schedule(peak_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0):
    """Linear warmup to ``peak_lr``, then cosine decay to ``min_lr`` at ``total_steps``.

    Step ``s`` (0-based) of the warmup has ``peak_lr * (s + 1) / warmup_steps``; after
    it, ``min_lr + (peak_lr - min_lr) * (1 + cos(pi * p)) / 2`` with ``p`` the fraction
    of the decay done; from ``total_steps`` on, ``min_lr``.

    Args:
      peak_lr: the learning rate at the end of the warmup.
      warmup_steps: steps of linear warmup (0: none).
      total_steps: the step at which the decay reaches ``min_lr``.
      min_lr: the floor.

    Returns:
      A function ``step -> lr``.

    Raises:
      MeshDSLError: negative rates or steps, or a warmup longer than the schedule.
    """
    bad = []
    if not (peak_lr >= 0 and min_lr >= 0):
        bad.append(f"peak_lr={peak_lr}, min_lr={min_lr}: rates are >= 0")
    if warmup_steps < 0 or total_steps < 1 or warmup_steps > total_steps:
        bad.append(f"warmup_steps={warmup_steps}, total_steps={total_steps}: need 0 <= warmup <= total, total >= 1")
    if bad:
        raise MeshDSLError(message("cosine_schedule: invalid arguments.", bullets=bad,
                                   rule="a schedule warms up for warmup_steps, then decays until total_steps",
                                   fix="e.g. cosine_schedule(3e-4, warmup_steps=100, total_steps=1000)"))

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return peak_lr * (step + 1) / warmup_steps
        if step >= total_steps:
            return min_lr
        done = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * done))

    return lr_at
