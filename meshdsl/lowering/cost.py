"""A first cost model: seconds for collectives (latency + ring bandwidth) and compute.

The compiler uses it to pick the cheapest compute layout for each op and the
cheaper side of a layout conflict; later, layout search will use it too.  The
constants are rough figures for the 2-core CPU/gloo machines this project is
tested on (see shared/ANCHORS.md: ~0.9 GB/s allreduce, ~70 GFLOP/s).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    latency_s: float = 50e-6
    bandwidth_Bps: float = 1.0e9
    flops_per_s: float = 5.0e10

    def collective(self, kind: str, nbytes: int, n: int) -> float:
        """Time of one collective sending ``nbytes`` per rank in a group of ``n``."""
        if n <= 1 or kind == "split":
            return 0.0
        frac = {"allreduce": 2 * (n - 1) / n, "allgather": float(n - 1), "reduce_scatter": (n - 1) / n,
                "alltoall": (n - 1) / n, "permute": 1.0}[kind]
        return self.latency_s + frac * nbytes / self.bandwidth_Bps

    def compute(self, flops: int) -> float:
        return flops / self.flops_per_s


DEFAULT = CostModel()
