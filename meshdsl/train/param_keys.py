"""The trained params dict of a Model or a TrainStep: each key is its param's own name.

A step writes each trained param's next value as the output ``new/<key>`` and carries it into
the graph param named ``<key>``.  A key that is not its param's name (``{"w1": w}`` for
``md.param("layer0.w1", ...)``, or one short key reused per level, which keeps only the last
level's param) would leave the param frozen, or give it another param's update (two keys
swapped), silently; so every such key is refused here, naming the key and the param.
"""
from __future__ import annotations

from ..core.graph import Tensor
from ..errors import GraphError, message


def check_params(params, graph, where: str, error=GraphError) -> dict:
    """``params`` checked: a dict whose every key is the name of its value, an ``md.param`` of
    ``graph`` (optimizer state excepted).  Returns a copy, so that the graph's own table
    (``graph.params``, which a stateful optimizer grows) is never the trained set.

    Raises:
      ``error`` (GraphError, or ModelError from ``md.Model``): naming each bad key.
    """
    if not isinstance(params, dict):
        raise error(message(f"{where}: params is a {type(params).__name__}, not a dict.",
                            rule="params maps each trained param's name to its md.param tensor",
                            fix="pass params=g.params() (every param of graph g), or {p.name: p for p in [w1, w2]}"))
    bad = [b for b in (_bad_item(k, t, graph) for k, t in params.items()) if b]
    if bad:
        raise error(message(
            f"{where}: {len(bad)} params item(s) would not train their param.",
            bullets=bad,
            rule="params maps each trained param's own name (md.param(NAME, ...)) to that param: the step "
                 "writes new/KEY and carries it into the param named KEY, so under another key a param would "
                 "not train, or take another param's update, silently (a param left out of params is frozen "
                 "on purpose)",
            fix="key each param by its name: params = {p.name: p for p in [w1, w2]}, or g.params() for every "
                "param of graph g"))
    return dict(params)


def _bad_item(k, t, graph) -> str | None:
    """Why the item ``k: t`` cannot be a trained param, or None when it can."""
    if not isinstance(t, Tensor):
        return f"{k!r}: a {type(t).__name__}, not a meshdsl Tensor"
    if t.graph is not graph:
        return f"{k!r}: {t!r} belongs to another graph '{t.graph.name}', not to the model's graph '{graph.name}'"
    if graph.params.get(t.name) is not t:
        return f"{k!r}: {t!r} is made by op '{t.node.op.name}', not by md.param: only a param trains"
    if t.name.startswith("opt/"):
        return f"{k!r}: param '{t.name}' is optimizer state (the step updates it itself)"
    if k != t.name:
        return f"{k!r}: holds param '{t.name}'; key it as '{t.name}'"
    return None
