"""``--stage-layers``: the pipeline's layers per stage, given (``3,5``) or balanced (``auto``).

``auto`` is resolved once, before compiling, by :func:`meshdsl.search.stage_balance.balance_stages`
(the cost model's split); ``args.stage_layers`` then holds the counts, which the processes of
``run`` and ``check --nproc`` compile with.
"""
from __future__ import annotations

import argparse


def stage_layers_type(text: str):
    """The argparse type of ``--stage-layers``: ``"auto"`` or a tuple of counts."""
    from ..search.stage_balance import parse_stage_layers

    try:
        return parse_stage_layers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (e.g. --stage-layers 3,5, or auto)") from None


def stage_layers_arg(p) -> None:
    p.add_argument("--stage-layers", type=stage_layers_type, default=None, metavar="N,N,..|auto",
                   help="layers of the pipelined repeat per stage, e.g. 3,5 on 'stage:2' (each >= 1, summing "
                        "to the layers; with interleaved:V one per virtual stage in layer order, e.g. 1,2,2,1 "
                        "on 'stage:2' with V = 2), or auto: the split that balances the stages' predicted "
                        "cost, the embedding on the first stage and the head and loss on the last included "
                        "(default: equal)")


def resolve_stage_layers(args, outputs) -> tuple | None:
    """``args.stage_layers`` as counts (``auto`` balanced by the cost model), stored back in ``args``."""
    given = getattr(args, "stage_layers", None)
    if given == "auto":
        from ..search.stage_balance import balance_stages

        args.stage_layers = balance_stages(outputs, args.mesh, args.layout, microbatches=args.microbatches,
                                           schedule=args.schedule, bucket_mb=args.bucket_mb,
                                           strict_splits=args.strict_splits)
    return args.stage_layers if given is not None else None


def stage_lines(plan) -> list[str]:
    """``meshdsl plan --stage-layers``: each stage's layers and predicted seconds per micro-batch
    (F + B + W)."""
    from ..search.calibrate import load
    from ..search.predict import predict

    stages = predict(plan, load()).stages
    if not stages:
        return []
    cells = [f"stage {i}: {c.layers} layers, {c.seconds * 1e3:.3f} ms ({c.layers_s * 1e3:.3f} ms layers, "
             f"{c.other_s * 1e3:.3f} ms other)" for i, c in enumerate(stages)]
    return ["stages, predicted per micro-batch (F + B + W, transfers included): " + "; ".join(cells)]


def with_stage_layers(args, spec, outputs):
    """``train``: the run's :class:`~meshdsl.train.trainer.TrainSpec` with ``--stage-layers``
    (``auto`` balanced on its mesh, layout and schedule)."""
    import dataclasses

    given = getattr(args, "stage_layers", None)
    if given is None:
        return spec
    if given == "auto":
        from ..search.stage_balance import balance_stages

        given = balance_stages(outputs, spec.mesh, spec.layout, microbatches=spec.microbatches,
                               schedule=spec.schedule, bucket_mb=spec.bucket_mb, strict_splits=args.strict_splits)
    return dataclasses.replace(spec, stage_layers=tuple(given))
