"""The order in which an einsum of three or more operands contracts them, two at a time.

An n-ary einsum is built as a chain of two-operand einsums (:mod:`meshdsl.ops.einsum`), so
that its gradients are the gradients of those pairs and each pair gets the lowering's own
choice between gathering its inputs and reducing its partial result.  One n-ary einsum
differentiated as a whole would contract every other operand for each gradient, a split dim
included where a pair would not need it (a three-operand einsum's third weight gradient
allreduced instead of the small pair before it gathered).

The order is the one that needs the fewest multiply-adds over the dense sizes, as
opt_einsum's optimal path finds it: a dynamic program over subsets of operands (3^n pairs of
subsets), and above :data:`EXACT_UP_TO` operands a greedy choice of the cheapest pair.
"""
from __future__ import annotations

import math

#: Operands up to which the order is searched exactly (3^8 = 6561 subset pairs).
EXACT_UP_TO = 8


def pairwise_order(terms: list[tuple[str, ...]], out: tuple[str, ...],
                   sizes: dict[str, int]) -> list[tuple[int, int, tuple[str, ...]]]:
    """Each step of the chain: ``(i, j, dims)`` contracts operands ``i`` and ``j`` (ids: the
    operands ``0..n-1``, then each step's result gets the next id) into a tensor with ``dims``.
    The last step's dims are ``out``.

    >>> pairwise_order([("b", "h"), ("h", "d"), ("d", "e")], ("b", "e"), {"b": 2, "h": 8, "d": 256, "e": 256})
    [(0, 1, ('b', 'd')), (3, 2, ('b', 'e'))]
    >>> pairwise_order([("b", "h"), ("h", "d"), ("d", "e")], ("b", "e"), {"b": 64, "h": 8, "d": 256, "e": 256})
    [(1, 2, ('h', 'e')), (0, 3, ('b', 'e'))]
    """
    n = len(terms)
    if n > EXACT_UP_TO:
        return _greedy(terms, out, sizes)
    kept = {s: _kept(terms, out, s) for s in range(1, 1 << n)}
    best: dict[int, tuple[int, int]] = {1 << k: (0, 0) for k in range(n)}   # subset -> (cost, left part)
    for s in sorted(kept, key=lambda s: (bin(s).count("1"), s)):
        if s in best:
            continue
        low = s & -s
        for a in _parts(s):
            if not a & low:
                continue   # each split once: the left part holds the lowest operand
            b = s ^ a
            cost = best[a][0] + best[b][0] + math.prod(sizes[d] for d in set(kept[a]) | set(kept[b]))
            if s not in best or cost < best[s][0]:
                best[s] = (cost, a)
    steps: list[tuple[int, int, tuple[str, ...]]] = []
    _emit((1 << n) - 1, best, kept, n, steps, out)
    return steps


def _kept(terms, out, s: int) -> tuple[str, ...]:
    """The dims of the operands in subset ``s`` that the output or an operand outside it reads."""
    inside = [t for k, t in enumerate(terms) if s >> k & 1]
    outside = {d for k, t in enumerate(terms) if not s >> k & 1 for d in t} | set(out)
    return tuple(d for d in dict.fromkeys(d for t in inside for d in t) if d in outside)


def _parts(s: int):
    """The nonempty proper subsets of bit set ``s``."""
    a = (s - 1) & s
    while a:
        yield a
        a = (a - 1) & s


def _emit(s: int, best, kept, n: int, steps: list, out) -> int:
    """Append the steps that make subset ``s`` (left part first); return the id of its tensor."""
    if s & (s - 1) == 0:
        return s.bit_length() - 1
    a = best[s][1]
    i = _emit(a, best, kept, n, steps, out)
    j = _emit(s ^ a, best, kept, n, steps, out)
    steps.append((i, j, out if s == (1 << n) - 1 else kept[s]))
    return n + len(steps) - 1


def _greedy(terms, out, sizes) -> list[tuple[int, int, tuple[str, ...]]]:
    """Contract the pair whose product is smallest, until one tensor is left."""
    live = dict(enumerate(terms))
    steps: list[tuple[int, int, tuple[str, ...]]] = []
    while len(live) > 1:
        ids = sorted(live)
        i, j = min(((i, j) for i in ids for j in ids if i < j),
                   key=lambda p: math.prod(sizes[d] for d in set(live[p[0]]) | set(live[p[1]])))
        rest = {d for k, t in live.items() if k not in (i, j) for d in t} | set(out)
        dims = out if len(live) == 2 else tuple(d for d in dict.fromkeys(live[i] + live[j]) if d in rest)
        del live[i], live[j]
        live[len(terms) + len(steps)] = dims
        steps.append((i, j, dims))
    return steps
