"""Resuming a run: what a checkpoint keeps of the run's settings, and what a resume may change.

Every checkpoint the training loop saves holds ``run`` in its metadata (:func:`run_settings`):
the optimizer with every hyperparameter (its defaults included), the learning rate, the
schedule and its length (``decay_steps``), clipping, precision, micro-batches and the pipeline
schedule, the seed and the data, the total step count, and the save and eval cadence.  The
data position is the checkpoint's step (a batch is a pure function of seed and step).

:func:`resolve_resume` turns what a resume asks for into the run it continues.  A setting
the caller did not give takes its saved value, so a resume without flags continues the same
run, bit for bit.  A given setting that differs from the saved one is

* applied, with one printed line saying what changes: the total ``steps`` (the schedule
  keeps its saved length, so steps past ``decay_steps`` run at the cosine's floor, unless
  ``decay_steps`` is given too), the learning rate, the schedule, clipping, precision,
  micro-batches, an optimizer hyperparameter, the data path (its content is still checked
  against the checkpoint's fingerprint), the save and eval cadence;
* refused (:class:`ResumeError`, naming the saved and the given value) when the saved state
  or the run cannot continue under it: another optimizer, or SGD momentum turned on or off
  (another set of state tensors), another seed (other batches).

``reset_optimizer`` (``--reset-optimizer``) loads the params only and starts the optimizer
afresh: the optimizer, its hyperparameters, learning rate, schedule and clipping are then
the ones given (or a new run's defaults).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import message
from .checkpoint import CheckpointError, read_metadata
from .checkpoint_verify import check_saves_free, choose_checkpoint
from .config import config_dict
from .lr_schedule import run_schedule
from .optimizers import OPTIMIZERS

#: The settings ``reset_optimizer`` sets afresh: the optimizer and what shapes its updates.
OPTIMIZER_KEYS = ("optimizer", "optimizer_args", "lr", "lr_schedule", "warmup_steps", "decay_steps", "clip_norm")
#: Every setting a checkpoint keeps of its run (``TrainSpec`` fields).
RUN_KEYS = OPTIMIZER_KEYS + ("precision", "microbatches", "schedule", "seed", "data", "steps", "save_every",
                             "keep", "eval_every", "eval_batches")
#: The settings a resume never changes, and why.
REFUSED = {"optimizer": "the saved optimizer state is {was}'s",
           "seed": "another seed draws other batches: another run"}


class ResumeError(CheckpointError):
    """A resume asks for a setting that the saved run cannot continue under."""


def fmt_setting(v) -> str:
    """A setting's value as the lines and errors of a resume show it."""
    if v is None:
        return "none"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ",".join(fmt_setting(x) for x in v)
    return str(v)


def _spell(key: str, value) -> str:
    """How a setting reads in ``md.fit``'s terms (the CLI passes its own: flags)."""
    return f"{key}={fmt_setting(value)}"


def _full_args(optimizer: str, args: dict) -> dict:
    """Every hyperparameter of ``optimizer`` but ``lr`` (its defaults filled in), as JSON."""
    return OPTIMIZERS[optimizer](**args).settings()


def run_settings(spec) -> dict:
    """What a checkpoint keeps of the run of ``spec`` (a ``TrainSpec``): JSON."""
    out = {k: getattr(spec, k) for k in RUN_KEYS}
    out["optimizer_args"] = _full_args(spec.optimizer, spec.optimizer_args)
    out["decay_steps"] = spec.decay_steps if spec.decay_steps is not None else spec.steps
    return out


def saved_run(meta: dict) -> dict:
    """The run settings in a checkpoint's metadata (one saved before they were kept: its
    optimizer, its hyperparameters and lr only)."""
    if "run" in meta:
        return dict(meta["run"])
    return {k: meta[k] for k in ("optimizer", "optimizer_args", "lr") if k in meta}


# ----------------------------------------------------------------- the lines of an applied change

def _lr_change(old, new, step: int) -> str:
    a, b = run_schedule(old)(step), run_schedule(new)(step)   # 0-based: the first step the resume runs
    return (f"the learning rate of step {step + 1} goes from {a:g} to {b:g}" if a != b else
            f"the learning rate of step {step + 1} stays {a:g}")


def _steps_change(new, given, spell) -> str:
    what = f"the run goes on to step {new.steps}"
    if new.lr_schedule != "cosine" or "decay_steps" in given:
        return what
    end = new.decay_steps
    if new.steps <= end:
        return what + f"; the cosine schedule keeps its saved length, {end} steps"
    return (what + f"; the cosine schedule keeps its saved length, {end} steps, so steps {end + 1}-{new.steps} "
            f"run at its floor, lr {new.lr / 10:g} ({spell('decay_steps', new.steps)} stretches it instead)")


def _applied(key: str, old, new, step: int, given, spell) -> str:
    """What changing ``key`` does to the resumed run, in a few words."""
    if key in ("lr", "lr_schedule", "warmup_steps", "decay_steps"):
        return _lr_change(old, new, step)
    if key == "steps":
        return _steps_change(new, given, spell)
    if key == "clip_norm":
        return f"the global gradient norm is clipped to {new.clip_norm:g}" if new.clip_norm else "no more clipping"
    if key == "precision":
        return f"steps compute in {new.precision}; the saved fp32 params and optimizer state load as they are"
    if key == "microbatches":
        return "each step is the same sum over the batch, up to fp32 reassociation"
    if key == "data":
        return "its text must be the checkpoint's (the fingerprint is checked)"
    return "applied"


# ----------------------------------------------------------------- resolving a resume

def resolve_resume(spec, saved: dict, given, step: int, spell=_spell):
    """The run a resume continues, and one line per given setting it changes.

    Args:
      spec: the run asked for (a ``TrainSpec``): the given settings, and a new run's defaults
        for the others.
      saved: the checkpoint's run settings (:func:`saved_run`).
      given: names of the settings the caller gave (``RUN_KEYS``; ``optimizer_args`` holds the
        given hyperparameters only); None: every one.
      step: the checkpoint's step.
      spell: ``(setting, value) -> text``, how the caller writes a setting (``--lr 0.1``).

    Returns:
      ``(spec, lines)``: the run to continue, with every setting resolved.

    Raises:
      ResumeError: a given setting the saved run cannot continue under, or no step left to run.
    """
    given = set(RUN_KEYS) if given is None else set(given)
    reset = spec.reset_optimizer
    keys = [k for k in RUN_KEYS if k in saved and k != "optimizer_args"]
    as_saved = {k: saved[k] for k in keys}
    new = dataclasses.replace(spec, **{k: v for k, v in as_saved.items()
                                       if k not in given and not (reset and k in OPTIMIZER_KEYS)})
    old = dataclasses.replace(new, **as_saved)
    if "optimizer" in saved:
        old = dataclasses.replace(old, optimizer_args=_full_args(saved["optimizer"], saved.get("optimizer_args", {})))
        _check_reads(new.optimizer, spec.optimizer_args, spell, continued=not reset and new.optimizer == old.optimizer)
        if not reset and new.optimizer == old.optimizer:
            merged = {**old.optimizer_args, **spec.optimizer_args}
            new = dataclasses.replace(new, optimizer_args=_full_args(new.optimizer, merged))
    lines, bad = [], []
    for k in keys:
        was, now = as_saved[k], getattr(new, k)
        if k not in given or (reset and k in OPTIMIZER_KEYS) or was == now:
            continue
        if k in REFUSED:
            bad.append((k, was, now, REFUSED[k]))
        else:
            what = _applied(k, old, new, step, given, spell)
            lines.append(f"resume: {spell(k, now)} (saved {fmt_setting(was)}): {what}")
    if "optimizer" in saved and not reset and new.optimizer == old.optimizer:
        lines += _optimizer_args(old, new, spec.optimizer_args, bad, step, spell)
    if reset:
        lines.append(f"resume: {spell('reset_optimizer', True)}: the params of step {step} load, and the optimizer "
                     f"starts afresh as {_describe(new)} (saved: {_describe(old)})")
    if bad:
        raise _refused(bad, step, spell)
    if new.steps <= step:
        raise ResumeError(message(
            f"resume: the checkpoint is at step {step}, and the run ends there ({spell('steps', new.steps)}).",
            rule="steps is the run's total step count: resuming at step N runs steps N+1..steps",
            fix=f"pass {spell('steps', step + max(1, step))} (any count greater than {step})"))
    return new, lines


def _check_reads(optimizer: str, given_args: dict, spell, continued: bool) -> None:
    """Refuse a given hyperparameter that ``optimizer`` (``continued``: the checkpoint's) does not read."""
    unread = [k for k in given_args if k not in _full_args(optimizer, {})]
    if unread:
        whose = f"{optimizer}, the checkpoint's optimizer," if continued else optimizer
        raise ResumeError(message(
            f"resume: {', '.join(spell(k, given_args[k]) for k in unread)}: {whose} does not read it.",
            rule="an optimizer takes its own hyperparameters; a resume continues the saved optimizer",
            fix=f"drop it, or add {spell('reset_optimizer', True)} and the optimizer that reads it"
            if continued else "drop it, or pick the optimizer that reads it"))


def _optimizer_args(old, new, given_args: dict, bad: list, step: int, spell) -> list[str]:
    """Lines for the changed hyperparameters; a change of state tensors goes into ``bad``."""
    before, after = _full_args(old.optimizer, old.optimizer_args), _full_args(new.optimizer, new.optimizer_args)
    changed = [k for k in given_args if before.get(k) != after.get(k)]
    cls = OPTIMIZERS[new.optimizer]
    if cls(**before).state_key() != cls(**after).state_key():
        bad += [(k, before[k], after[k], f"{new.optimizer} would keep other state tensors than the saved ones")
                for k in changed]
        return []
    return [f"resume: {spell(k, after[k])} (saved {fmt_setting(before[k])}): applied from step {step + 1}; the "
            f"optimizer state continues" for k in changed]


def _describe(s) -> str:
    args = ", ".join(f"{k} {fmt_setting(v)}" for k, v in _full_args(s.optimizer, s.optimizer_args).items())
    return (f"{s.optimizer} lr {fmt_setting(s.lr)} ({args}), {s.lr_schedule} schedule"
            + (f", clip {fmt_setting(s.clip_norm)}" if s.clip_norm else ""))


def _refused(bad, step: int, spell) -> ResumeError:
    fixes = []
    if any(k != "seed" for k, *_ in bad):
        fixes.append(f"drop the optimizer flag(s) to continue the saved optimizer, or add "
                     f"{spell('reset_optimizer', True)} to keep the params and start the given one afresh")
    if any(k == "seed" for k, *_ in bad):
        fixes.append("drop the seed to continue with the saved one; another seed is a new run "
                     "(in another checkpoint folder)")
    return ResumeError(message(
        f"resume: {len(bad)} setting(s) differ from the checkpoint's (step {step}), and the saved run cannot "
        f"continue under them.",
        bullets=[f"{spell(k, now)}: saved {fmt_setting(was)}; {why.format(was=fmt_setting(was))}"
                 for k, was, now, why in bad],
        rule="a resume continues the saved run: its optimizer state belongs to its optimizer, its batches "
             "to its seed", fix="; ".join(fixes)))


def whose_option(note: str, spec, saved: dict) -> str:
    """A plan's note on an option that changes nothing (``schedule '1f1b' has no effect: ...``),
    saying so when the option is the checkpoint's: a resume keeps the saved schedule, which a
    resumed run on a layout that pipelines nothing was never given."""
    name = f"schedule '{spec.schedule}'"
    if note.startswith(name) and saved.get("schedule") == spec.schedule:
        return name + " (the checkpoint's: a resume keeps the saved run's settings)" + note[len(name):]
    return note


# ----------------------------------------------------------------- which checkpoint, and whose

def model_id(model) -> str:
    """The id a checkpoint records: the model graph's name."""
    return model.graph.name


def resume_path(spec, spell=_spell) -> Path | None:
    """The checkpoint a resume starts from, checked intact with ``spec.verify``: the latest in
    ``spec.checkpoint``, or ``spec.resume_from`` (None when not resuming).

    Raises:
      CheckpointError: no checkpoint to resume from, or it is damaged (:func:`.checkpoint_verify.choose_checkpoint`).
    """
    if not spec.resume and spec.resume_from is None:
        return None
    return choose_checkpoint(spec.checkpoint, spec.resume_from, spec.verify, spell)


def pinned(spec, path: Path | None):
    """``spec`` as the ranks get it: resuming from ``path``, which this process chose and verified
    whole, so each rank checks sizes and headers only (a resume hashes its files once)."""
    return spec if path is None else dataclasses.replace(spec, resume_from=str(path), verify="size")


def saved_steps(spec, start: int) -> list[int]:
    """The steps after ``start`` at which the run of ``spec`` saves a checkpoint."""
    if not spec.checkpoint:
        return []
    return [t for t in range(start + 1, spec.steps + 1) if (spec.save_every and t % spec.save_every == 0)
            or t == spec.steps]


def resume_from(spec, model, spell=_spell) -> Path | None:
    """The checkpoint to resume from, after checking it is this model's (None when not resuming);
    ``spell`` writes a setting as the caller does (:func:`resolve_resume`).

    Raises:
      CheckpointError: no checkpoint to resume from, or it belongs to another model or Config.
    """
    path = resume_path(spec, spell)
    if path is None:
        return None
    info = read_metadata(path)
    saved, now = info.meta.get("config"), config_dict(model.config)
    same = info.model == model_id(model)
    # Another model's Config has other fields: comparing them one by one would list each as "saved None".
    changed = {k: v for k, v in (now or {}).items() if same and saved is not None and saved.get(k, ...) != v}
    diff = [f"{k}: saved {saved[k]!r}, now {v!r}" if k in saved else f"{k}: not in the saved Config, now {v!r}"
            for k, v in changed.items()]
    if not same or diff:
        was = {k: saved[k] for k in changed if k in saved}
        raise CheckpointError(message(
            f"{spell('resume', True)}: checkpoint {str(path)!r} is of " + (
                "this model with another Config." if same else "another model."),
            inputs=[f"saved model: {info.model!r}, this model: {model_id(model)!r}"], bullets=diff,
            rule="a run resumes from a checkpoint of the same model and Config",
            fix=(f"resume with the Config it was saved with ({spell('config', was)}), " if same and was else
                 "resume with the model and Config it was saved with, ")
            + f"or use another checkpoint folder ({spell('checkpoint', 'NEW_DIR')})"))
    return path


def resume_spec(spec, path, given, spell=_spell):
    """``(spec, lines)``: :func:`resolve_resume` against the checkpoint ``path`` a resume starts
    from (:func:`resume_path`; None: not resuming, ``spec`` unchanged and no lines), after
    checking that the run's saves meet no step folder; the spec returned is :func:`pinned`."""
    if path is None:
        return spec, []
    info = read_metadata(path)
    spec, lines = resolve_resume(spec, saved_run(info.meta), given, info.step, spell)
    check_saves_free(spec.checkpoint, info.step, saved_steps(spec, info.step), spell)
    return pinned(spec, path), lines


__all__ = ["OPTIMIZER_KEYS", "REFUSED", "RUN_KEYS", "ResumeError", "fmt_setting", "model_id", "pinned",
           "resolve_resume", "resume_from", "resume_path", "resume_spec", "run_settings", "saved_run", "saved_steps",
           "whose_option"]
