"""Code the benchmarks share: the machine they ran on, and the torch sides of the transformer.

* :func:`machine_start` / :func:`machine_end`: every bench prints the machine (cores, CPU,
  torch version, device, torch threads) and its load average when it starts and when it ends,
  and keeps both in its JSON: on a shared machine a figure means little without the load;
* :func:`setup`: a meshdsl model, its feeds and its initial weights as full tensors (every
  variant of every bench starts from them, so step-0 losses can be compared);
* :func:`sgd_optimizer`: ``torch.optim.SGD`` as a careful torch engineer sets it up (the fused
  kernel, or foreach where the params are DTensors, which the fused kernel does not shard);
* :func:`paired_ratio`: two variants' per-turn samples compared turn by turn;
* :func:`torch_step`: plain torch on one process (``dense_vs_torch.TorchGPT``), eager or
  through ``torch.compile``;
* :class:`First` / :class:`Last` and :func:`torch_pipe_step`: the transformer cut into two
  ``torch.distributed.pipelining`` stages, optionally with each stage's module wrapped
  (DDP over a data-parallel group, for pipeline + data parallelism).
* :class:`Chunk` and :func:`torch_interleaved_step`: the transformer cut into ``p * v``
  chunks, rank r holding chunks r, r + p, ..., run by ``ScheduleInterleaved1F1B``.

The timing harness itself (turns, rounds, CPU ticks) is ``distributed_mlp._interleave``.
"""
from __future__ import annotations

import math
import os
import platform
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

GPT = str(ROOT / "models" / "transformer.py")


# ----------------------------------------------------------------------------- the machine

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_start(device: str = "cpu", say=print, threads: int | None = None) -> dict:
    """Print the machine and its load now; return both as a dict for the bench's JSON (pass it
    to :func:`machine_end` when the bench is done).

    Args:
      device: where the bench runs its torch work (``cpu``, ``cuda``, ``cuda:1``).
      say: how to print a line (``print``, or a rich console's ``print``).
      threads: torch threads per process of the bench's work, where that is not this process
        (spawned ranks); default this process's ``torch.get_num_threads()``.
    """
    dev = torch.device(device)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {"cores": os.cpu_count(), "usable_cores": usable, "cpu": _cpu_model(), "torch": torch.__version__,
            "python": platform.python_version(),
            "device": f"cuda ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else dev.type,
            "torch_threads": torch.get_num_threads() if threads is None else threads, "load_start": _load()}
    say(f"machine: {info['cores']} cores ({usable} usable), {info['cpu']}; torch {info['torch']}, "
        f"device {info['device']}, {info['torch_threads']} torch thread(s) per process")
    say(f"load average at start: {_load_text(info['load_start'])}")
    return info


def machine_end(info: dict, say=print) -> dict:
    """Print the load average now and add it to ``info`` (as ``load_end``); returns ``info``."""
    info["load_end"] = _load()
    say(f"load average at end: {_load_text(info['load_end'])} (at start: {_load_text(info['load_start'])}; "
        f"{info['cores']} cores)")
    return info


def _load_text(load: list[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load) + " (1 / 5 / 15 min)"


# ----------------------------------------------------------------------------- torch sides

def setup(seed: int, model_file: str = GPT, **config):
    """(meshdsl model, feeds, initial weights by name as full tensors); ``config``: load_model's
    ``tiny`` and Config overrides."""
    from meshdsl.ops.leaf import init_value
    from meshdsl.train.model import load_model
    model = load_model(model_file, **config)
    return model, model.feeds(seed), {k: init_value(t, seed) for k, t in model.params.items()}


def sgd_optimizer(params, lr: float) -> torch.optim.SGD:
    """Plain SGD (``p -= lr * g``) in one kernel call over all params: ``fused=True``, or
    ``foreach=True`` where some params are DTensors (FSDP2, tensor parallelism), for which torch
    registers no sharding rule of the fused kernel.  DTensors and plain tensors (tensor
    parallelism splits the blocks only) go in two param groups: one foreach call never mixes them."""
    from torch.distributed.tensor import DTensor
    params = list(params)
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return torch.optim.SGD(params, lr=lr, fused=True)
    plain = [p for p in params if not isinstance(p, DTensor)]
    return torch.optim.SGD([g for g in ({"params": plain}, {"params": sharded}) if g["params"]], lr=lr,
                           foreach=True)


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """``a[i] / b[i]`` over the turns two variants of one job took side by side (the harness's
    samples line up: same round, same turn, minutes apart at most): their median and the
    10th-90th percentile range.  Drift of the machine's speed between turns, which on these
    VMs moves a step by tens of percent, cancels in each ratio; a ratio of the two medians
    keeps it, so the two can differ by more than the effect being measured."""
    import statistics
    r = sorted(x / y for x, y in zip(a, b))
    lo, hi = (statistics.quantiles(r, n=10, method="inclusive")[::8] if len(r) > 1 else (r[0], r[0]))
    return {"median": statistics.median(r), "p10": lo, "p90": hi, "turns": len(r)}


def torch_step(cfg, w, feeds, lr, m: int = 1, compile: bool = False):
    """Plain torch on one process: TorchGPT (SDPA attention), autograd, fused SGD; with
    ``compile`` the module goes through ``torch.compile`` (inductor; the first step compiles).
    With ``m`` > 1 the batch goes through in ``m`` micro-batches whose gradients accumulate (each
    loss scaled by 1/m), as a pipeline stage runs it, on one process: what cutting the batch
    alone costs."""
    from dense_vs_torch import TorchGPT
    net = TorchGPT(cfg, w)
    model = torch.compile(net) if compile else net
    opt = sgd_optimizer(net.parameters(), lr)
    chunks = list(zip(feeds["ids"].chunk(m), feeds["labels"].chunk(m)))

    def step():
        total = 0.0
        for ids, labels in chunks:
            loss = model(ids, labels)
            (loss / m if m > 1 else loss).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / m
    return step


class First(nn.Module):
    """Stage 0: token + position embedding, blocks 0 .. L/2-1."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.wte, self.wpe = net.wte, net.wpe
        self.blocks = nn.ModuleList(net.blocks[: len(net.blocks) // 2])

    def forward(self, ids):
        x = F.embedding(ids, self.wte) + self.wpe
        for b in self.blocks:
            x = b(x)
        return x


class Last(nn.Module):
    """Stage 1: blocks L/2 .., the final norm and the LM head (logits)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.cfg = net.cfg
        self.blocks = nn.ModuleList(net.blocks[len(net.blocks) // 2:])
        self.lnf, self.lnf_b, self.lm_head = net.lnf, net.lnf_b, net.lm_head

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        x = F.layer_norm(x, (self.cfg.d_model,), self.lnf, self.lnf_b, eps=1e-5)
        return x @ self.lm_head.t()


def torch_pipe_step(cfg, w, feeds, lr, schedule: str, m: int, stage_index: int | None = None,
                    group=None, wrap=None):
    """torch.distributed.pipelining on this rank's half of the model; returns the step's loss
    on the last stage (NaN on the first).

    Args:
      stage_index: this rank's stage (default: its rank, for a 2-process job).
      group: the process group of the two stages (default: the world).
      wrap: ``wrap(module) -> module``, e.g. DDP over this stage's data-parallel group;
        torch's stages run the backward of all but the last micro-batch under ``no_sync``.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from dense_vs_torch import TorchGPT
    stage_index = dist.get_rank() if stage_index is None else stage_index
    net = TorchGPT(cfg, w)
    module = First(net) if stage_index == 0 else Last(net)
    if wrap is not None:
        module = wrap(module)
    stage = PipelineStage(module, stage_index, 2, torch.device("cpu"), group=group)
    vocab = cfg.vocab

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
    # scale_grads (the default) divides the summed micro-batch gradients by m: the full batch's mean.
    sched = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(stage, m, loss_fn=loss_fn)
    opt = sgd_optimizer(module.parameters(), lr)

    def step(ids=feeds["ids"], labels=feeds["labels"]):
        if stage_index == 0:
            sched.step(ids)
            loss = math.nan
        else:
            losses: list = []
            sched.step(target=labels, losses=losses)
            loss = torch.stack(losses).mean().item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


class Chunk(nn.Module):
    """Logical stage ``index`` of ``num_stages``: its ``layers / num_stages`` blocks, with the
    embedding before them on the first and the final norm and the LM head after them on the last."""

    def __init__(self, net: nn.Module, index: int, num_stages: int):
        super().__init__()
        self.cfg, self.first, self.last = net.cfg, index == 0, index == num_stages - 1
        k = len(net.blocks) // num_stages
        self.blocks = nn.ModuleList(net.blocks[index * k:(index + 1) * k])
        if self.first:
            self.wte, self.wpe = net.wte, net.wpe
        if self.last:
            self.lnf, self.lnf_b, self.lm_head = net.lnf, net.lnf_b, net.lm_head

    def forward(self, x):
        if self.first:
            x = F.embedding(x, self.wte) + self.wpe
        for b in self.blocks:
            x = b(x)
        if self.last:
            x = F.layer_norm(x, (self.cfg.d_model,), self.lnf, self.lnf_b, eps=1e-5)
            x = x @ self.lm_head.t()
        return x


def torch_interleaved_step(cfg, w, feeds, lr, m: int, v: int = 2):
    """torch.distributed.pipelining's ``ScheduleInterleaved1F1B`` over the world's p ranks, each
    holding ``v`` chunks (rank r: chunks r, r + p, ..., as Megatron places them, the same split
    as meshdsl's ``interleaved:v``); returns the step's loss on the rank with the last chunk
    (NaN elsewhere)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from dense_vs_torch import TorchGPT
    p, rank = dist.get_world_size(), dist.get_rank()
    n = p * v
    if cfg.layers % n:
        raise ValueError(f"{cfg.layers} layers do not cut into {n} chunks of equal size")
    net = TorchGPT(cfg, w)
    chunks = [Chunk(net, c, n) for c in range(rank, n, p)]
    stages = [PipelineStage(c, i, n, torch.device("cpu")) for c, i in zip(chunks, range(rank, n, p))]
    vocab = cfg.vocab

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
    # scale_grads (the default) divides the summed micro-batch gradients by m, as torch_pipe_step's.
    sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    opt = sgd_optimizer([q for c in chunks for q in c.parameters()], lr)
    first, last = rank == 0, rank == (n - 1) % p

    def step(ids=feeds["ids"], labels=feeds["labels"]):
        losses: list = []
        kwargs = {"target": labels, "losses": losses} if last else {}
        sched.step(*((ids,) if first else ()), **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().item() if last else math.nan
    return step


def stacked_block_grads(blocks, d: int, h: int, e: int) -> dict:
    """The gradients of a torch twin's blocks (packed ``w_qkv``, ``wo``, norms, MLP) stacked over
    the layers in meshdsl's param shapes: ``wq``/``wk``/``wv`` ``[layer, d, h, e]``, ``wo``
    ``[layer, h, e, d]``, the rest as they are."""
    import torch
    per_layer: dict[str, list] = {k: [] for k in ("ln1", "ln1_b", "wq", "wk", "wv", "wo", "ln2", "ln2_b",
                                                   "w_fc", "w_proj")}
    for b in blocks:
        for k, g in zip(("wq", "wk", "wv"), b.w_qkv.grad.split(h * e, dim=1)):
            per_layer[k].append(g.reshape(d, h, e))
        per_layer["wo"].append(b.wo.grad.reshape(h, e, d))
        for k in ("ln1", "ln1_b", "ln2", "ln2_b", "w_fc", "w_proj"):
            per_layer[k].append(getattr(b, k).grad)
    return {k: torch.stack(v) for k, v in per_layer.items()}
