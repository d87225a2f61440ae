"""The graph interpreter: a graph's outputs flattened into a list of kernel calls.

:class:`DenseProgram` evaluates whole tensors on one device.  It is the dense
oracle every layout is compared to (:func:`meshdsl.runtime.dense.run_dense`), and
the way an op that holds a sub-graph (a repeat's block) computes it densely.
"""
from __future__ import annotations

from collections.abc import Mapping
from itertools import chain

import torch

from ..core.graph import Tensor, topo_nodes
from ..errors import GraphError, clip, message
from ..ops.inplace import Operand, add_kernel
from ..ops.leaf import init_value
from ..ops.registry import DENSE_CTX, LocalCtx, run_device, running_on


def _operand(n, i: int, readers: dict, kept: set) -> Operand:
    """What the in-place rule needs to know about input ``i`` of add node ``n``."""
    a, src = n.inputs[i], n.inputs[i].node
    return Operand(src.op.name, len(src.inputs), readers.get(id(a), 0), id(a) in kept,
                   a.dtype == n.outputs[0].dtype and a.shape == n.outputs[0].shape)


def outputs_dict(outputs) -> dict:
    """Outputs as given to ``run_dense``, ``compile`` and ``DenseProgram`` by name: a Tensor is
    ``{"out": t}``, a list or tuple ``{"out0": ..., "out1": ...}``, a dict itself (a copy);
    anything else is ``{"out": outputs}``, for the caller's type check to name."""
    if isinstance(outputs, dict):
        return dict(outputs)
    if isinstance(outputs, (list, tuple)):
        return {f"out{i}": t for i, t in enumerate(outputs)}
    return {"out": outputs}


def feeds_dict(caller: str, feeds, what: str = "feeds") -> dict:
    """``feeds`` (None: none) if it is a mapping {name: value}; else a GraphError.  ``what``:
    ``"feeds"`` (keyed by md.input names) or ``"params"`` (by md.param names)."""
    if feeds is None:
        return {}
    if not isinstance(feeds, Mapping):
        leaf = "md.input" if what == "feeds" else "md.param"
        raise GraphError(message(
            f"{caller}: {what} is {clip(repr(feeds), 80)} ({type(feeds).__name__}), not a dict.",
            rule=f"{what} map each {leaf[3:]}'s name to its value, e.g. {{'x': torch.randn(8, 4)}}",
            fix=f"pass a dict keyed by the names given to {leaf}"))
    return feeds


def check_feed(t: Tensor, value, full: bool = True) -> None:
    """Raise a GraphError unless ``value`` is a tensor fit to feed input ``t`` (its full shape when ``full``)."""
    if not isinstance(value, torch.Tensor):
        raise GraphError(message(f"feed '{t.name}': expected a torch.Tensor, got {type(value).__name__}.",
                                 rule="inputs are fed as tensors", fix="pass torch.tensor(...)"))
    if full and tuple(value.shape) != t.shape.sizes:
        raise GraphError(message(
            f"feed '{t.name}': shape {tuple(value.shape)} does not match {t.shape} = {t.shape.sizes}.",
            rule="a full feed has the input's global shape, dims in its order",
            fix=f"pass a tensor of shape {t.shape.sizes}"))
    if value.dtype != t.dtype:
        raise GraphError(message(f"feed '{t.name}': dtype {value.dtype} does not match {t.dtype}.",
                                 rule="feeds have the dtype the input was declared with",
                                 fix=f"convert with .to({t.dtype})"))


class DenseProgram:
    """A graph's outputs, flattened for repeated dense evaluation."""

    def __init__(self, outputs, ctx: LocalCtx = DENSE_CTX, given: dict | None = None):
        """``given`` maps feed names to inner tensors whose values are fed, not computed:
        the nodes only they need are left out."""
        self.outputs = outputs_dict(outputs)
        given = dict(given or {})
        self.nodes = topo_nodes(list(self.outputs.values()), {id(t) for t in given.values()})
        self.ctx = ctx
        self.params = {n.name: n.outputs[0] for n in self.nodes if n.op.name == "param"}
        self.inputs = {n.name: n.outputs[0] for n in self.nodes if n.op.name in ("input", "placeholder")}
        slot: dict[int, int] = {}
        for n in self.nodes:
            for t in n.outputs:
                slot[id(t)] = len(slot)
        for k, t in given.items():
            slot.setdefault(id(t), len(slot))
            self.inputs[k] = t
        self._slot = slot
        self._keep = [t for n in self.nodes for t in n.outputs] + list(given.values())
        self.code = []
        used = {id(t) for n in self.nodes for t in n.inputs} | {id(t) for t in self.outputs.values()}
        readers: dict[int, int] = {}
        for n in self.nodes:
            for t in n.inputs:
                readers[id(t)] = readers.get(id(t), 0) + 1
        kept = {id(t) for t in self.outputs.values()} | {id(t) for t in given.values()}
        for n in self.nodes:
            outs = tuple(slot[id(t)] for t in n.outputs)
            if n.op.name in ("param", "input", "placeholder"):
                continue
            attrs = n.attrs
            trimmed = n.op.drop_unused_outputs(n, [id(t) in used for t in n.outputs])
            if trimmed is not None:  # e.g. a repeat with no backward here keeps no activations
                attrs, num_outs = trimmed
                outs = outs[:num_outs]
            fn = n.op.compute
            if n.op.name == "add":  # accumulate in place, as autograd's gradient sums do
                fn = add_kernel(attrs, (_operand(n, 0, readers, kept), _operand(n, 1, readers, kept))) or fn
            self.code.append((fn, attrs, tuple(slot[id(t)] for t in n.inputs), outs))
        self.out_slots = {k: slot[id(t)] for k, t in self.outputs.items()}

    def init_params(self, seed: int = 0, device=None) -> dict[str, torch.Tensor]:
        """Every param's deterministic initial value (made on the CPU, then moved to ``device``)."""
        return {k: init_value(t, seed).to(device or "cpu") for k, t in self.params.items()}

    def __call__(self, feeds: dict | None = None, params: dict | None = None, seed: int = 0,
                 salt: int = 0) -> dict[str, torch.Tensor]:
        feeds = feeds_dict("run", feeds)
        env: list = [None] * len(self._slot)
        for k, t in self.inputs.items():
            if k not in feeds:
                raise GraphError(message(f"run: no value fed for input '{k}' {t.shape}.",
                                         inputs=[f"fed: {sorted(feeds)}"], rule="every input the outputs need is fed",
                                         fix=f"add '{k}' to the feeds"))
            if t.node.op.name == "input":
                check_feed(t, feeds[k])
            env[self._slot[id(t)]] = feeds[k]
        # The program runs where its values are: the first fed or given tensor's device.
        device = next((x.device for x in chain(feeds.values(), (params or {}).values())
                       if isinstance(x, torch.Tensor)), None)
        for k, t in self.params.items():
            env[self._slot[id(t)]] = params[k] if params is not None and k in params else \
                init_value(t, seed).to(device or "cpu")
        ctx = self.ctx if not salt else self.ctx.with_salt(salt)
        if device is None or device == run_device():
            self._run(ctx, env)
        else:
            with running_on(device):
                self._run(ctx, env)
        return {k: env[s] for k, s in self.out_slots.items()}

    def _run(self, ctx, env) -> None:
        for fn, attrs, ins, outs in self.code:
            r = fn(ctx, attrs, *[env[i] for i in ins])
            if len(outs) == 1:
                env[outs[0]] = r
            else:
                for o, x in zip(outs, r):
                    env[o] = x
