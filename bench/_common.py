"""Code the distributed benchmarks share: the torch sides of the transformer, as one place.

* :func:`setup`: a meshdsl model, its feeds and its initial weights as full tensors (every
  variant of every bench starts from them, so step-0 losses can be compared);
* :func:`sgd`: the manual SGD update the torch variants use (``p - g * lr``, meshdsl's rounding);
* :func:`paired_ratio`: two variants' per-turn samples compared turn by turn;
* :func:`torch_step`: plain torch on one process (``dense_vs_torch.TorchGPT``);
* :class:`First` / :class:`Last` and :func:`torch_pipe_step`: the transformer cut into two
  ``torch.distributed.pipelining`` stages, optionally with each stage's module wrapped
  (DDP over a data-parallel group, for pipeline + data parallelism).

The timing harness itself (turns, rounds, CPU ticks) is ``distributed_mlp._interleave``.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from dense_vs_torch import TorchGPT  # noqa: E402  (the torch twin of models/transformer.py)

GPT = str(ROOT / "models" / "transformer.py")


def setup(seed: int, model_file: str = GPT, **config):
    """(meshdsl model, feeds, initial weights by name as full tensors); ``config``: load_model's
    ``tiny`` and Config overrides."""
    from meshdsl.ops.leaf import init_value
    from meshdsl.train.model import load_model
    model = load_model(model_file, **config)
    return model, model.feeds(seed), {k: init_value(t, seed) for k, t in model.params.items()}


def sgd(params, lr):
    """``p -= g * lr`` for every param with a gradient, then drop the gradients."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.sub_(p.grad * lr)
                p.grad = None


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


def torch_step(cfg, w, feeds, lr, m: int = 1):
    """Plain torch on one process: TorchGPT, autograd, manual SGD; with ``m`` > 1 the batch goes
    through in ``m`` micro-batches whose gradients accumulate (each loss scaled by 1/m), as a
    pipeline stage runs it, on one process: what cutting the batch alone costs."""
    net = TorchGPT(cfg, w)
    params = list(net.parameters())
    chunks = list(zip(feeds["ids"].chunk(m), feeds["labels"].chunk(m)))

    def step():
        total = 0.0
        for ids, labels in chunks:
            loss = net(ids, labels)
            (loss / m if m > 1 else loss).backward()
            total += loss.item()
        sgd(params, lr)
        return total / m
    return step


class First(nn.Module):
    """Stage 0: token + position embedding, blocks 0 .. L/2-1."""

    def __init__(self, net: TorchGPT):
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

    def __init__(self, net: TorchGPT):
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
    params = list(module.parameters())

    def step(ids=feeds["ids"], labels=feeds["labels"]):
        if stage_index == 0:
            sched.step(ids)
            loss = math.nan
        else:
            losses: list = []
            sched.step(target=labels, losses=losses)
            loss = torch.stack(losses).mean().item()
        sgd(params, lr)
        return loss
    return step
