"""Learning-rate schedules: plain callables from a 0-based step to a learning rate.

A schedule's value is fed to the training step as a runtime input
(``TrainStep(...)(feeds, lr=sched(step))``), so changing it never recompiles.
:func:`make_schedule` builds the ones a training run names (``constant``, ``cosine``), and
:func:`run_schedule` a run's own from its settings.
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


#: The schedules a training run can name (``--lr-schedule``).
SCHEDULES = ("constant", "cosine")


def make_schedule(kind: str, peak_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0):
    """The schedule ``kind``: ``"cosine"`` (:func:`cosine_schedule`) or ``"constant"`` (a linear
    warmup over ``warmup_steps``, then ``peak_lr``; ``total_steps`` and ``min_lr`` unused).

    Raises:
      MeshDSLError: an unknown kind, or arguments :func:`cosine_schedule` refuses.
    """
    if kind not in SCHEDULES:
        raise MeshDSLError(message(f"learning-rate schedule {kind!r} is unknown.",
                                   rule=f"a schedule is one of {', '.join(SCHEDULES)}",
                                   fix="pass e.g. lr_schedule='cosine' (--lr-schedule cosine)"))
    if kind == "cosine":
        return cosine_schedule(peak_lr, warmup_steps, total_steps, min_lr)
    if warmup_steps < 0:
        raise MeshDSLError(message(f"constant schedule: warmup_steps={warmup_steps}.",
                                   rule="a warmup is 0 or more steps", fix="pass warmup_steps=0 for none"))
    return lambda step: peak_lr * (step + 1) / warmup_steps if step < warmup_steps else peak_lr


def run_schedule(spec):
    """The schedule of a training run (a :class:`~meshdsl.train.trainer.TrainSpec`): its
    ``lr_schedule`` peaking at ``lr`` after ``warmup_steps``; a cosine reaches ``lr / 10`` at
    ``decay_steps`` (default: the run's ``steps``) and stays there."""
    total = spec.decay_steps if spec.decay_steps is not None else spec.steps
    return make_schedule(spec.lr_schedule, spec.lr, spec.warmup_steps, total, spec.lr / 10)
