"""Break each op's gradient rule in turn and report which case of test_op_grads.py catches it.

Run by hand (CI does not), from the repository root::

    python tests/mutation_check.py            # every op with a rule
    python tests/mutation_check.py exp top_k  # some ops

Mutations of one op's ``grad``, each on its own:

* ``double``: every gradient it returns, times 2;
* ``negate``: every gradient it returns, negated;
* ``drop input i``: the gradient of input ``i`` left out (as a rule that forgets a term);
* ``ignore output j``: the rule called without output ``j``'s cotangent (a multi-output op
  whose rule forgets one output's contribution);
* ``pass through``: for ``stop_gradient``, which cuts reverse mode, the gradient let through.

Only the cases whose forward graph holds the op are run (a rule is only called for its
own nodes).  Prints one line per mutation and exits 1 if any mutation went uncaught.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_op_grads as T  # noqa: E402
from meshdsl.ops.registry import OPS, has_gradient  # noqa: E402


def _wrap(rule, mutate):
    def grad(self, node, douts):
        return mutate(rule, self, node, douts)
    return grad


def _double(rule, self, node, douts):
    return [None if g is None else g * 2.0 for g in rule(self, node, douts)]


def _negate(rule, self, node, douts):
    return [None if g is None else -g for g in rule(self, node, douts)]


def _drop(i):
    def mutate(rule, self, node, douts):
        gs = list(rule(self, node, douts))
        gs[i] = None
        return gs
    return mutate


def _ignore(j):
    def mutate(rule, self, node, douts):
        douts = list(douts)
        douts[j] = None
        if all(d is None for d in douts):
            return [None] * len(node.inputs)
        return rule(self, node, douts)
    return mutate


def _pass_through(rule, self, node, douts):
    return [douts[0]]


#: rules whose whole point is to return no gradient: broken, they let it through.
BLOCKING = {"stop_gradient"}


def mutations(op, sample_node, used_outputs):
    if op.name in BLOCKING:
        return [("pass through", _pass_through)]
    out = [("double", _double), ("negate", _negate)]
    out += [(f"drop input {i}", _drop(i)) for i, t in enumerate(sample_node.inputs) if t.dtype.is_floating_point]
    if len(used_outputs) > 1:
        out += [(f"ignore output {j}", _ignore(j)) for j in sorted(used_outputs)]
    return out


def cases_by_op():
    """op name -> (the cases whose forward graph holds it, one node of it, the indices of its
    float outputs that something reads: a case output or another node's input)."""
    found: dict = {}
    for name, c in T.CASES.items():
        b = T.build(name, c.seeds[0])
        nodes = list(_walk(b.nodes))
        read = {id(t) for n in nodes for t in n.inputs} | {id(y) for y in b.outputs}
        for n in nodes:
            cases, _, used = found.setdefault(n.op.name, ([], n, set()))
            if name not in cases:
                cases.append(name)
            used |= {j for j, t in enumerate(n.outputs) if t.dtype.is_floating_point and id(t) in read}
    return found


def _walk(nodes):
    for n in nodes:
        yield n
        for g, _ in n.op.subgraphs(n):
            yield from _walk(g.nodes)


def run_mutation(cls, mutate, cases):
    """The cases that fail with ``cls.grad`` mutated; the rule is restored afterwards."""
    had = "grad" in cls.__dict__
    rule, blocks = cls.grad, cls.__dict__.get("blocks_gradient")
    cls.grad = _wrap(rule, mutate)
    if mutate is _pass_through:  # the op's own cut of reverse mode goes too
        cls.blocks_gradient = False
    caught = []
    try:
        for name in cases:
            try:
                T.check_case(name)
            except AssertionError:
                caught.append(name)
            except Exception as e:  # noqa: BLE001 - a broken rule may crash instead
                caught.append(f"{name} ({type(e).__name__})")
    finally:
        if had:
            cls.grad = rule
        else:
            del cls.grad
        if blocks is not None:
            cls.blocks_gradient = blocks
    return caught


def main(argv) -> int:
    t0 = time.perf_counter()
    found = cases_by_op()
    ops = argv or sorted(n for n, op in OPS.items() if has_gradient(op) and n not in T.LEAVES + tuple(T.NO_INPUTS))
    total = missed = 0
    for name in ops:
        if name not in found:
            print(f"{name:24s} NO CASE (test_every_op_is_checked fails for it)")
            missed += 1
            continue
        cases, node, used = found[name]
        for label, mutate in mutations(OPS[name], node, used):
            caught = run_mutation(type(OPS[name]), mutate, cases)
            total += 1
            missed += not caught
            where = ", ".join(f"test_grad[{c}]" for c in caught[:3]) + (" ..." if len(caught) > 3 else "")
            print(f"{name:24s} {label:16s} {'caught by ' + where if caught else 'NOT CAUGHT'}")
    refused = sorted(n for n, op in OPS.items() if not has_gradient(op) and n not in T.NO_INPUTS)
    print(f"\n{total - missed} of {total} mutations caught in {time.perf_counter() - t0:.1f} s; "
          f"ops without a rule (refusal tested): {', '.join(refused)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
