"""A first cost model: seconds for collectives (latency + ring bandwidth) and compute.

The compiler uses it to pick the cheapest compute layout for each op and the
cheaper side of a layout conflict; later, layout search will use it too.  The
constants are rough figures measured on the 2-core CPU/gloo machines this
project is tested on: about 0.9 GB/s for a large allreduce and about
70 GFLOP/s for a large matmul, rounded down for smaller messages and kernels.
Bytes on the wire per byte sent come from each kind's entry in
:data:`meshdsl.collectives.COLLECTIVES`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..collectives import COLLECTIVES


@dataclass(frozen=True)
class CostModel:
    """Latency, link bandwidth and compute rate of the machines a plan is priced for."""

    latency_s: float = 50e-6
    bandwidth_Bps: float = 1.0e9
    flops_per_s: float = 5.0e10

    def collective(self, kind: str, nbytes: int, n: int) -> float:
        """Time of one collective sending ``nbytes`` per rank in a group of ``n``.

        A local ``split`` (a re-layout move that sends nothing) costs nothing.
        """
        if n <= 1 or kind == "split":
            return 0.0
        return self.latency_s + COLLECTIVES[kind].fraction(n) * nbytes / self.bandwidth_Bps

    def compute(self, flops: int) -> float:
        """Time of ``flops`` floating-point operations on one rank."""
        return flops / self.flops_per_s


DEFAULT = CostModel()
