"""State updated in the compiled step without a gradient: a frozen param set after each
optimizer step to a tensor of the graph (an EMA target network: MoCo, BYOL, DINO).

``md.Model(updates={"k_w": m * k_w + (1 - m) * q_w})`` and ``TrainStep(updates=...)`` add a
``new/<name>`` output per update, laid out by the param's own layout scopes, so the step
carries it like a trained param's next value (:class:`~meshdsl.train.step.TrainStep`).

A batch norm with ``running=(mean, var)`` implies two such updates (:func:`running_updates`):
torch's ``(1 - m) * running + m * batch``, the variance made unbiased (``* n / (n - 1)``);
:func:`with_running` adds them to the given ones wherever a step is built.
"""
from __future__ import annotations

from ..core.graph import Tensor, topo_nodes
from ..core.lru import Lru
from ..errors import GraphError, LayoutError, did_you_mean, message
from ..lowering.partition import program_of
from ..ops.registry import apply
from ..ops.shape_ops import transpose


def check_updates(updates, params: dict[str, Tensor], graph, where: str, error=GraphError) -> dict:
    """``updates`` checked: each key a frozen param of ``graph`` (an ``md.param`` left out of
    ``params``), each value a Tensor of that graph with the param's dims and dtype.

    Raises:
      ``error`` (GraphError, or ModelError from ``md.Model``): naming each bad item.
    """
    if not updates:
        return {}
    if not isinstance(updates, dict):
        raise error(message(f"{where}: updates is a {type(updates).__name__}, not a dict.",
                            rule="updates maps a frozen param's name to the tensor it takes after each step",
                            fix='pass updates={"target_w": 0.99 * target_w + 0.01 * w}'))
    bad = []
    for k, t in updates.items():
        p = graph.params.get(k) if isinstance(k, str) else None
        if p is None:
            bad.append(f"'{k}': no param of graph '{graph.name}' has this name."
                       f"{did_you_mean(str(k), list(graph.params))}")
        elif k in params:
            bad.append(f"'{k}': a trained param (in params): the optimizer updates it")
        elif not isinstance(t, Tensor) or t.graph is not graph:
            bad.append(f"'{k}': {t!r} is not a Tensor of graph '{graph.name}'")
        elif _dims(t) != _dims(p) or t.dtype != p.dtype:
            bad.append(f"'{k}': the param is {p.shape} {p.dtype}, the update {t.shape} {t.dtype}")
    if bad:
        raise error(message(
            f"{where}: {len(bad)} bad update(s).", bullets=bad,
            inputs=[f"frozen params: {', '.join(k for k in graph.params if k not in params) or '(none)'}"],
            rule="updates maps a frozen param (an md.param left out of the Model's params) to a tensor of its "
                 "dims and dtype, computed in the graph from this step's params; the param takes it after "
                 "each optimizer step (an EMA target: m * target + (1 - m) * online)",
            fix="key updates by a frozen param's name, leave that param out of params, and give a tensor "
                "of its dims (md.rename a stacked dim to the param's own)"))
    return dict(updates)


def running_updates(loss: Tensor) -> dict[str, Tensor]:
    """The updates the batch norms ``loss`` reads imply: each ``running=(mean, var)`` pair's
    next values, built once per graph and norm (a second call returns the same tensors)."""
    norms = [n for n in topo_nodes([loss]) if n.op.name == "batch_norm" and "running" in n.attrs]
    if not norms:
        return {}
    key = (loss.graph.uid, tuple(id(n) for n in norms))
    return dict(_RUNNING.get_or_make(key, lambda: (_build_running(norms, loss.graph), norms))[0])


def _build_running(norms, graph) -> dict[str, Tensor]:
    from ..ops.elementwise import cast
    out = {}
    with graph.in_phase("update"):
        for n in norms:
            m, count = n.attrs["momentum"], n.attrs["count"]
            for name, stat, unbias in zip(n.attrs["running"], n.outputs[1:], (1.0, count / max(count - 1, 1))):
                p = graph.params[name]
                stat = cast(transpose(stat, p.shape.names), p.dtype) if stat.dtype != p.dtype else \
                    transpose(stat, p.shape.names)
                out[name] = (1.0 - m) * p + (m * unbias) * stat
    return out


def with_running(loss: Tensor, params: dict, updates: dict | None, where: str, error=GraphError) -> dict:
    """``updates`` and the running statistics' updates ``loss``'s batch norms imply.

    Raises:
      ``error``: a running statistic that is trained (in ``params``) or given another update."""
    implied = running_updates(loss)
    bad = [f"'{k}': batch_norm(running=...) keeps it; " + ("it is in params (trained)" if k in params
                                                            else "updates= gives it another tensor")
           for k, t in implied.items() if k in params or (updates or {}).get(k, t) is not t]
    if bad:
        raise error(message(f"{where}: {len(bad)} running statistic(s) set twice.", bullets=bad,
                            rule="a batch norm's running=(mean, var) params are frozen and set by the step "
                                 "(torch's running statistics); nothing else trains or updates them",
                            fix="leave them out of params and updates="))
    return {**(updates or {}), **implied} if implied else dict(updates or {})


#: (graph uid, ids of the batch norm nodes) -> their running statistics' next values
_RUNNING = Lru(64)


def _dims(t: Tensor) -> list:
    return sorted((d.name, d.size) for d in t.shape)


#: (graph uid, (name, id(tensor)) of each update) -> the ``new/<name>`` outputs; an entry holds
#: its tensors, so no id in a live key is reused
_UPDATE_OUTPUTS = Lru(64)


def update_outputs(updates: dict, graph) -> dict[str, Tensor]:
    """``new/<k>`` for each checked update: the tensor in the param's dim order, laid out by
    the param's own layout scopes, so each rank's slice of it is the param's next slice (the
    update is computed there too, not gathered to an activation's layout: lowering/update_values.py).

    Built once per (graph, updates): a second call returns the same tensors, so the compile
    cache sees the same outputs and the graph does not grow a second copy."""
    key = (graph.uid, tuple((k, id(t)) for k, t in updates.items()))
    return dict(_UPDATE_OUTPUTS.get_or_make(key, lambda: (_build_update_outputs(updates, graph), updates))[0])


def with_updates(outputs: dict, updates: dict | None, graph) -> dict[str, Tensor]:
    """``outputs`` and the ``new/<k>`` of each of ``updates`` it lacks (a copy when any is added):
    the training step a Model's ``updates=`` belong to, whoever builds, prices or measures it."""
    missing = {k: t for k, t in (updates or {}).items() if f"new/{k}" not in outputs}
    return {**outputs, **update_outputs(missing, graph)} if missing else outputs


def _build_update_outputs(updates: dict, graph) -> dict[str, Tensor]:
    outs = {}
    with graph.in_phase("update"):
        for k, t in updates.items():
            p = graph.params[k]
            t = transpose(t, p.shape.names)
            new = apply("stop_gradient", [t], name=f"new/{k}")
            new.scopes = p.scopes
            outs[f"new/{k}"] = new
    return outs


def check_held_where_updated(plan, carried, updates, mesh, layout) -> None:
    """Each carried param's next value is made on every rank that holds the param.

    A pipeline holds a param on the stages that read it and makes its next value where its
    update runs; an update read on another stage (an EMA target's, from an online param updated
    on stage 0) would leave the param missing there from the second step on.

    Raises:
      LayoutError: naming each param held on more ranks than make its next value.
    """
    pipe = next((s for s in plan.steps if s.kind == "pipeline"), None)
    axis = program_of(pipe).axis if pipe is not None else None

    def where(v: int) -> str:
        ranks = plan.holders.get(v, ())
        if axis is None:
            return f"ranks {tuple(ranks)}"
        return f"stages {tuple(sorted({plan.mesh.coords(r)[axis] for r in ranks}))}"
    bad = [f"'{k}': held on {where(plan.params[k])}, its next value made on {where(plan.outputs[f'new/{k}'])}"
           for k in carried
           if set(plan.holders.get(plan.params[k], ())) - set(plan.holders.get(plan.outputs[f"new/{k}"], ()))]
    if bad:
        raise LayoutError(message(
            f"TrainStep: the updates ({', '.join(updates)}) read params on pipeline stages that do not "
            f"update them.", inputs=[f"mesh: {mesh}", f"layout: {layout}"], bullets=bad,
            rule="under a pipeline a param's next value is made only on the stages that update it, and a "
                 "param an update reads on another stage is not sent there each step",
            fix="train a model with updates without a stage axis (data, model and FSDP layouts apply them in "
                "the step), or keep the EMA outside the step (TrainStep.full_params / set_params)"))
