"""What a repeat's backward block moved when lowered once, told to its second lowering.

The generic rule (:mod:`.generic`) chooses each op's sharding from its inputs as they are and its
outputs' layout targets: it cannot see what a later reader will do with a value.  A backward
block is lowered again knowing what its first lowering moved (:func:`.repeat._lower_block`):

* a value read both as it was made and moved is priced free at the shardings it was moved to,
  as if already held: DeBERTa's relative projections ``k_r``, recomputed from an FSDP weight
  whose gradients gather that weight anyway; Soft MoE's gradient of the dispatched tokens ``dt``,
  moved experts -> batch for the router's gradient, is then read there by the tokens' gradient;
* a value that every reader moved to one sharding (a product made in its input's layout, then
  moved for the sum that reads it) is priced where it is made with that move, so it is made
  there when that costs less: the tokens' gradient ``dt * r`` made batch-split, nothing moves it.

The second lowering is kept only where it is cheaper and sends no more bytes: it prices as free
what it merely forecasts.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..layout.sharding import Sharding
from .plan import Plan


@dataclass(frozen=True)
class Foresight:
    """By ``id`` of a block's tensor: ``held``, the shardings it will be brought to anyway;
    ``wanted``, the one sharding every reader of it moved it to."""

    held: Mapping[int, frozenset]
    wanted: Mapping[int, Sharding]

    def __bool__(self) -> bool:
        return bool(self.held or self.wanted)


NONE = Foresight({}, {})


def foresee(sub, plan: Plan) -> Foresight:
    """What lowerer ``sub`` moved in making block sub-plan ``plan`` (see the module docstring): the
    block's inputs read as given and moved; a value made in the block, read as made and moved,
    where an op reading it makes a value that every reader moved one way (only then may the
    second lowering differ: each further lowering costs compile time).  A partial sum is left out
    of ``wanted``: where its reduction goes is the partial-sum modes' choice (:mod:`.generic`)."""
    read_as_is = {v for s in plan.steps if not s.is_collective and s.kind != "input" for v in s.ins}
    given = {v for s in plan.steps if s.kind == "input" for v in s.outs}
    moved: dict[int, frozenset] = {}   # value -> the shardings a collective moved it to
    for s in plan.steps:
        if s.is_collective and len(s.ins) == 1 and s.ins[0] in read_as_is:
            moved[s.ins[0]] = moved.get(s.ins[0], frozenset()) | {plan.values[s.outs[0]].sharding}
    read = read_as_is | set(plan.outputs.values())
    tensors = {id(t): t for t in sub.keep}
    wanted = {}
    for tid, vid in sub.env.items():
        to = sub.held(vid)
        if len(to) == 1 and vid not in read and tid in tensors and not sub.sharding(vid).partial:
            (to,) = to
            if not to.partial and any(sub.env.get(id(x)) in moved for x in tensors[tid].node.inputs):
                wanted[tid] = to
    read_for = {id(x) for tid in wanted for x in tensors[tid].node.inputs}
    held = {tid: moved[vid] for tid, vid in sub.env.items() if vid in moved and (vid in given or tid in read_for)}
    return Foresight(held, wanted)
