"""``meshdsl export``: a checkpoint's params as one safetensors file of full tensors by name.

The file is what ``meshdsl train --init`` (``md.fit(init=)``, ``TrainStep.set_params``) starts a
new run from: a trained run's weights, frozen params included, for a fine-tune on any mesh and
layout (:mod:`meshdsl.train.init_weights`).
"""
from __future__ import annotations

import argparse
import math

from ..train.init_weights import export_params
from ..train.trained import trained_step_dir
from .cli_common import EXIT_CODES


def add_export(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's params as one safetensors file (for train --init)",
                       description="Write the params (frozen ones too) of a checkpoint as full tensors by param "
                                   "name into one safetensors file: what `meshdsl train --init` starts a new run "
                                   "from. The checkpoint's files are hashed (sha256) before use.",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a run's --out folder (as for eval and generate), a checkpoint folder (--checkpoint "
                        "DIR of a run: its latest step) or one step folder")
    p.add_argument("--out", required=True, metavar="FILE", help="the safetensors file to write")
    p.set_defaults(run=cmd_export)


def cmd_export(args) -> int:
    shapes = export_params(trained_step_dir(args.checkpoint, "export"), args.out)
    elements = sum(math.prod(s) for s in shapes.values())
    print(f"meshdsl export: {len(shapes)} params ({elements:,} elements) -> {args.out}")
    return 0


__all__ = ["add_export", "cmd_export"]
