"""Optimizer flags shared by ``plan``, ``check`` and ``run``.

``--optimizer sgd|adamw|adafactor`` with ``--lr``, ``--momentum``, ``--betas B1,B2``,
``--weight-decay``, ``--clip-norm`` and ``--precision fp32|bf16`` (the compute precision
of the training step, :mod:`meshdsl.ops.precision`).  Without ``--optimizer`` (and without an
optimizer-only flag) a command keeps the plain SGD step of ``--lr``; a flag that
the chosen optimizer does not read is a usage error, not silently ignored.
"""
from __future__ import annotations

import argparse
import math

from ..errors import MeshDSLError, message
from ..ops.precision import PRECISIONS
from ..train.optimizers import OPTIMIZERS, Optimizer
from .preflight import UsageError, float_in

#: flag -> the optimizers that read it
READERS = {"momentum": ("sgd",), "betas": ("adamw",), "weight_decay": ("sgd", "adamw", "adafactor")}


def _betas(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        b = tuple(float(x) for x in parts)
    except ValueError:
        b = ()
    if len(b) != 2 or not all(math.isfinite(x) and 0.0 <= x < 1.0 for x in b):
        raise argparse.ArgumentTypeError(f"'{text}' is not two numbers in [0, 1) separated by a comma; "
                                         f"fix: pass e.g. --betas 0.9,0.95")
    return b


def add_optimizer_args(p, precision: bool = True) -> None:
    """Declare the optimizer flags on parser ``p`` (``--lr`` is declared by the command);
    ``precision``: ``--precision`` listed in the help (``check`` compares in fp32 only: it parses the
    flag to say so, and does not offer it)."""
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=None,
                   help="the optimizer of the training step (default: plain SGD of --lr with its fused "
                        "gradient-update kernel)")
    p.add_argument("--momentum", type=float_in(0.0, fix="pass a momentum such as --momentum 0.9"), default=None,
                   help="SGD momentum (default 0)")
    p.add_argument("--betas", type=_betas, default=None, metavar="B1,B2",
                   help="AdamW moment decay rates (default 0.9,0.95)")
    p.add_argument("--weight-decay", type=float_in(0.0, fix="pass e.g. --weight-decay 0.1"), default=None,
                   help="weight decay (AdamW/Adafactor: decoupled; SGD: added to the gradient)")
    p.add_argument("--clip-norm", type=float_in(0.0, fix="pass e.g. --clip-norm 1.0, or 0 for none"), default=None,
                   help="clip the global gradient norm (exact under any layout) to this (0: no clipping)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32 (default) or bf16: bfloat16 matmuls with fp32 master weights, optimizer "
                        "state, loss and gradient sums" if precision else argparse.SUPPRESS)


def optimizer_from_args(args) -> tuple[Optimizer | None, float | None]:
    """The optimizer and clip norm the flags ask for; (None, None) for the plain SGD step.

    Raises:
      UsageError: a flag the chosen optimizer does not read.
    """
    name = args.optimizer
    given = {k: getattr(args, k) for k in READERS if getattr(args, k) is not None}
    clip = args.clip_norm or None     # 0: no clipping
    if name is None and not given and clip is None:
        return None, None
    if name is None:
        name = "sgd" if "betas" not in given else "adamw"
    check_readers(name, given)
    kw = {"lr": args.lr, **given}
    try:
        return OPTIMIZERS[name](**kw), clip
    except TypeError as e:  # an internal mismatch between READERS and the classes
        raise MeshDSLError(f"--optimizer {name}: {e}") from None


def check_readers(name: str, given) -> None:
    """Refuse an optimizer flag (a name in :data:`READERS`) that optimizer ``name`` does not read.

    Raises:
      UsageError: naming the flags.
    """
    bad = [k for k in given if name not in READERS[k]]
    if bad:
        flags = ", ".join("--" + k.replace("_", "-") for k in bad)
        raise UsageError(message(f"{flags} given with --optimizer {name}, which does not read it.",
                                 rule="--momentum is SGD's, --betas AdamW's; --weight-decay and --clip-norm "
                                      "work with every optimizer",
                                 fix=f"drop {flags}, or pick the optimizer that reads it"))


def describe(opt: Optimizer | None, clip: float | None) -> str:
    """One line naming the optimizer and its settings, for reports."""
    if opt is None:
        return "plain SGD (fused gradient-update kernel)"
    return f"{opt!r}" + (f", clip_norm={clip:g}" if clip is not None else "")


def train_outputs(model, args, with_grads: bool = True) -> tuple[dict, dict]:
    """The training step's outputs for ``plan``/``check``/``search`` and the hyperparameter feeds
    they read: the step ``run`` and ``train`` run, the Model's ``updates`` included.

    ``with_grads=False``: the outputs a rank's ``TrainStep`` runs (``run``'s memory figures
    are those of that plan, which keeps no gradient as an output)."""
    from ..ir.precision import mixed_precision
    from ..train.step import step_outputs

    opt, clip = optimizer_from_args(args)
    loss = mixed_precision(model.loss, getattr(args, "precision", "fp32"))
    remat = getattr(args, "remat", None)
    if opt is None and loss is model.loss and with_grads and remat is None:
        return model.train_step(args.lr), {}
    outs = step_outputs(loss, model.params, args.lr, opt, clip is not None, remat,
                        with_grads=with_grads and opt is None, updates=model.updates)
    if opt is None:
        return outs, {}
    feeds = opt.feeds(0)
    if clip is not None:
        import torch
        feeds["opt/clip_norm"] = torch.tensor(float(clip))
    return outs, feeds
