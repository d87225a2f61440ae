"""GPT training step, side by side: meshdsl's layouts vs DDP, DTensor, torch pipelining and FSDP2.

Workload: models/transformer.py at its default Config (vocab 256, d_model 256, 8 heads, d_ff 1024,
4 layers, seq 64, batch 16, fp32), one step = forward + backward + SGD, 1 torch thread per process.

  procs  torch                                       meshdsl (mesh / layout)
  1      plain torch (TorchGPT: SDPA attention,      data:1 / ""; and with --compile
         autograd, fused SGD); and through            ("meshdsl 1p compiled")
         torch.compile ("torch compiled")
  2      bound: plain torch on each rank's half of   (none: the ceiling of every 2-process variant
         the batch, no communication at all           on this machine, not a training step)
  2      DDP (each rank B/2); and torch.compile      data:2 / batch:data; and with --compile
         of the DDP module ("DDP compiled")           ("meshdsl DP compiled")
  2      DTensor Megatron TP (q,k,v,fc colwise;      model:2 / heads:model; d_ff:model
         o,proj rowwise)
  2      torch.distributed.pipelining Schedule1F1B,  stage:2 / layer:stage, 1f1b, m=8
         m=8 (embedding + blocks 0-1 | 2-3 + head)    and stage:2 / layer:stage, zbh1, m=8 (ZB-H1)
  2      FSDP2 (fully_shard per block, then root);   data:2 / batch:data; params.d_model:data;
         and each block through torch.compile         and with --compile ("meshdsl FSDP compiled")
         before it is sharded ("FSDP2 compiled")
  4      DTensor TP on a 2x2 device mesh + DP        data:2; model:2 / batch:data; heads:model; d_ff:model
  4      pipelining 1F1B m=8 + DDP per stage         stage:2; data:2 / layer:stage; batch:data, 1f1b, m=8

Every torch side is written as a careful torch engineer would: ``F.scaled_dot_product_attention``
(causal flag, no mask tensor), ``torch.optim.SGD`` fused (foreach over DTensor params, which the
fused kernel does not shard), device meshes built on the CPU explicitly under gloo (so the bench
runs on a host with a GPU too).  The compiled rows compile on their first step, which is untimed
(compile time is not in their figures); their memory jobs are left out (compiling's own memory).

The 4-process torch counterparts: DDP cannot wrap a module whose params are DTensors, and
FSDP2 + TP would change the comparison (sharded params); so "torch DP+TP" runs DTensor TP on
the 'tp' dim of a 2x2 device mesh and all-reduces the gradients over the 'dp' dim in one flat
buffer per step, which is what DDP does with one bucket.  "torch PP+DP" wraps each stage's
module in DDP over its data-parallel group; torch's pipeline stage runs the backward of all
but the last micro-batch under ``no_sync``, so DDP reduces once per step.

Harness (bench/distributed_mlp.py's): every variant runs under meshdsl.processes.launcher.spawn
(``MESHDSL_BIND_CORES=rank`` binds its ranks to cores, the table's title says which);
a round is one 1-process, one 2-process and one 4-process job; inside a job the variants
take rotating turns (one untimed step, a barrier, ``block - 1`` steps back to back; the
turn's sample is their mean, the slowest rank's).  Busy CPU time is the process's
(``time.process_time``).  For meshdsl variants the step splits into compute, exposed
communication (issuing collectives + time blocked on one in flight) and overhead (rank 0,
means).  Peak memory per rank is measured in a separate job per variant: the process's
resident-set high-water mark (``getrusage`` ``ru_maxrss``) after 3 steps, minus the same
mark taken after imports, process-group setup, the model's weights and feeds were made,
so it counts what the variant adds: params, grads, activations and communication buffers.
On GPUs (``--backend nccl``) it is the bytes torch allocated on the GPU instead
(``torch.cuda.max_memory_allocated``, minus what was allocated before the variant was built).
Step-0 losses are checked against plain torch's.  Each meshdsl/torch ratio is given twice:
the ratio of the two medians, and turn by turn (each meshdsl turn over its torch peer's turn
of the same job and round, which ran right beside it): the median and 10-90% range of those
ratios, which the machine's drift from turn to turn does not move.  Each 2-process variant's
share of the bound (the bound's step over its step) is given turn by turn the same way.

    python bench/distributed_gpt.py                      # 3 rounds
    python bench/distributed_gpt.py --quick              # 1 round, 2 turns, no memory jobs
    python bench/distributed_gpt.py --only "DDP,meshdsl DP"
    python bench/distributed_gpt.py --backend nccl       # one GPU per process

With ``--backend nccl`` every process puts its weights and feeds on ``cuda:<local rank>``;
variants needing more processes than there are GPUs are skipped.  Results go to
bench/results/distributed_gpt.json and bench/results/distributed_gpt.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import (machine_end, machine_start, paired_ratio, setup, sgd_optimizer,  # noqa: E402
                     torch_pipe_step, torch_step)
from dense_vs_torch import TorchGPT  # noqa: E402
from distributed_mlp import _cpu_ticks, _interleave, _ms  # noqa: E402  (the shared harness)

RESULTS = ROOT / "bench" / "results" / "distributed_gpt.json"
CHART = RESULTS.with_suffix(".png")
M = 8  # micro-batches of the pipelined variants
# Step-0 losses agree up to fp32 summation order (split sums, micro-batches, other kernels):
# a wrong split or a missing micro-batch moves the loss by O(1) of itself, far above 1e-4.
LOSS_RTOL = 1e-4
#: Each rank steps plain torch on its half of the batch and never communicates: no variant on two
#: processes can beat it on this machine (its step-0 loss, the mean of the halves', is the batch's).
BOUND = "bound (no comm)"
JOBS = {1: ("torch", "torch compiled", "meshdsl 1p", "meshdsl 1p compiled"),
        2: (BOUND, "DDP", "DDP compiled", "meshdsl DP", "meshdsl DP compiled", "DTensor TP", "meshdsl TP",
            "torch 1F1B", "meshdsl 1F1B", "meshdsl ZB-H1", "FSDP2", "FSDP2 compiled", "meshdsl FSDP",
            "meshdsl FSDP compiled"),
        4: ("torch DP+TP", "meshdsl DP+TP", "torch PP+DP", "meshdsl PP+DP")}
VARIANTS = tuple(k for names in JOBS.values() for k in names)
NPROC = {k: n for n, names in JOBS.items() for k in names}
MESHDSL = {"meshdsl 1p": ("data:1", "", 1), "meshdsl DP": ("data:2", "batch:data", 1),
           "meshdsl TP": ("model:2", "heads:model; d_ff:model", 1),
           "meshdsl 1F1B": ("stage:2", "layer:stage", M), "meshdsl ZB-H1": ("stage:2", "layer:stage", M),
           "meshdsl FSDP": ("data:2", "batch:data; params.d_model:data", 1),
           "meshdsl DP+TP": ("data:2; model:2", "batch:data; heads:model; d_ff:model", 1),
           "meshdsl PP+DP": ("stage:2; data:2", "layer:stage; batch:data", M)}
#: meshdsl variants run with ``compile=True`` (``--compile``: each rank's step traced and compiled by
#: inductor), each on its eager twin's mesh and layout
MESHDSL.update({f"{k} compiled": MESHDSL[k] for k in ("meshdsl 1p", "meshdsl DP", "meshdsl FSDP")})
#: variants that go through torch.compile: no memory job (compiling's own memory would count), and
#: no share of the (eager) no-communication bound
COMPILED = ("torch compiled", "DDP compiled", "FSDP2 compiled", "meshdsl 1p compiled", "meshdsl DP compiled",
            "meshdsl FSDP compiled")
#: the pipeline schedule of a pipelined meshdsl variant (1f1b unless named here)
SCHEDULE = {"meshdsl ZB-H1": "zbh1"}
#: (meshdsl variant, its torch counterpart): the ratios the issue asks for; torch's zero-bubble
#: schedules need several stages per rank, so ZB-H1 is set beside torch's 1F1B.  Eager meshdsl
#: beside compiled torch too: what a user who compiles torch would compare against.
PEERS = (("meshdsl 1p", "torch"), ("meshdsl 1p", "torch compiled"), ("meshdsl 1p compiled", "torch compiled"),
         ("meshdsl DP", "DDP"), ("meshdsl DP", "DDP compiled"), ("meshdsl DP compiled", "DDP compiled"),
         ("meshdsl TP", "DTensor TP"), ("meshdsl 1F1B", "torch 1F1B"), ("meshdsl ZB-H1", "torch 1F1B"),
         ("meshdsl FSDP", "FSDP2"), ("meshdsl FSDP", "FSDP2 compiled"), ("meshdsl FSDP compiled", "FSDP2 compiled"),
         ("meshdsl DP+TP", "torch DP+TP"), ("meshdsl PP+DP", "torch PP+DP"))


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    return torch.device("cpu")


def _on(d: dict, dev) -> dict:
    return {k: v.to(dev) for k, v in d.items()}


def _rows(x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    n = x.shape[0] // parts
    return x[index * n:(index + 1) * n].contiguous()


# ----------------------------------------------------------------------------- torch variants

def _linear(w_in_out: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(*w_in_out.shape, bias=False)
    with torch.no_grad():  # nn.Linear keeps [out, in]
        lin.weight.copy_(w_in_out.t())
    return lin


class LinearBlock(nn.Module):
    """TorchGPT's block with its projections as nn.Linear (the form parallelize_module splits)."""

    def __init__(self, cfg, w: dict[str, torch.Tensor]):
        super().__init__()
        d, he = cfg.d_model, cfg.heads * cfg.d_head
        self.cfg = cfg
        self.ln1_w, self.ln1_b = nn.Parameter(w["ln1"].clone()), nn.Parameter(w["ln1_b"].clone())
        self.ln2_w, self.ln2_b = nn.Parameter(w["ln2"].clone()), nn.Parameter(w["ln2_b"].clone())
        self.q, self.k, self.v = (_linear(w[n].reshape(d, he)) for n in ("wq", "wk", "wv"))
        self.o = _linear(w["wo"].reshape(he, d))
        self.fc, self.proj = _linear(w["w_fc"]), _linear(w["w_proj"])

    def forward(self, x):
        B, S, D = x.shape
        E = self.cfg.d_head
        h = F.layer_norm(x, (D,), self.ln1_w, self.ln1_b, eps=1e-5)
        q, k, v = (lin(h).view(B, S, -1, E).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # this rank's heads under TP
        x = x + self.o(y.transpose(1, 2).reshape(B, S, -1))
        h = F.layer_norm(x, (D,), self.ln2_w, self.ln2_b, eps=1e-5)
        return x + self.proj(F.gelu(self.fc(h)))


class LinearGPT(TorchGPT):
    """TorchGPT with LinearBlocks."""

    def __init__(self, cfg, w):
        super().__init__(cfg, w)
        names = ("ln1", "ln1_b", "wq", "wk", "wv", "wo", "ln2", "ln2_b", "w_fc", "w_proj")
        self.blocks = nn.ModuleList(LinearBlock(cfg, {k: w[k][l] for k in names}) for l in range(cfg.layers))


MEGATRON = {"q": "col", "k": "col", "v": "col", "o": "row", "fc": "col", "proj": "row"}


def _tensor_parallel(cfg, w, tp_mesh) -> LinearGPT:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    net = LinearGPT(cfg, w)
    for b in net.blocks:
        parallelize_module(b, tp_mesh, {k: ColwiseParallel() if v == "col" else RowwiseParallel()
                                        for k, v in MEGATRON.items()})
    return net


def module_step(net, ids, labels, lr, after_backward=None):
    """One SGD step of ``net`` (plain, DDP, DTensor or FSDP2, eager or compiled); returns this
    rank's loss."""
    opt = sgd_optimizer(net.parameters(), lr)

    def step():
        loss = net(ids, labels)
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _flat_allreduce(params, group, world):
    """Average the (local) gradients over ``group`` in one flat buffer: DDP with one bucket."""
    def run():
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= world
        for g, piece in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(piece.view_as(g))
    return run


def torch_variant(name, cfg, w, feeds, lr):
    """The step function of torch variant ``name`` on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    dev = _device()
    w, feeds = _on(w, dev), _on(feeds, dev)
    ids, labels = feeds["ids"], feeds["labels"]
    if name in ("torch", "torch compiled"):
        return torch_step(cfg, w, feeds, lr, compile=name == "torch compiled")
    rank, world = (dist.get_rank(), dist.get_world_size())
    if name == BOUND:
        return torch_step(cfg, w, {"ids": _rows(ids, rank, world), "labels": _rows(labels, rank, world)}, lr)
    if name in ("DDP", "DDP compiled"):
        net = nn.parallel.DistributedDataParallel(TorchGPT(cfg, w).to(dev))
        net = torch.compile(net) if name == "DDP compiled" else net   # graph split at DDP's buckets
        return module_step(net, _rows(ids, rank, world), _rows(labels, rank, world), lr)
    if name == "DTensor TP":
        return module_step(_tensor_parallel(cfg, w, init_device_mesh(dev.type, (world,))), ids, labels, lr)
    if name == "torch 1F1B":
        return torch_pipe_step(cfg, w, feeds, lr, "1f1b", M)
    if name in ("FSDP2", "FSDP2 compiled"):
        from torch.distributed.fsdp import fully_shard
        net = TorchGPT(cfg, w)
        if name == "FSDP2 compiled":  # torchtitan's order: compile each block, then shard it
            net.blocks = nn.ModuleList(torch.compile(b) for b in net.blocks)
        # The mesh on this process's device type, explicitly: fully_shard's default mesh is on
        # CUDA whenever a GPU is visible, even under gloo.
        mesh = init_device_mesh(dev.type, (world,))
        for b in net.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return module_step(net, _rows(ids, rank, world), _rows(labels, rank, world), lr)
    if name == "torch DP+TP":
        mesh2 = init_device_mesh(dev.type, (2, 2), mesh_dim_names=("dp", "tp"))
        dp = rank // 2
        net = _tensor_parallel(cfg, w, mesh2["tp"])
        sync = _flat_allreduce(list(net.parameters()), mesh2["dp"].get_group(), 2)
        return module_step(net, _rows(ids, dp, 2), _rows(labels, dp, 2), lr, sync)
    if name == "torch PP+DP":
        # rank = stage * 2 + data index, as meshdsl's "stage:2; data:2"; every rank makes every group
        pipes = [dist.new_group([d, 2 + d]) for d in range(2)]
        dps = [dist.new_group([2 * s, 2 * s + 1]) for s in range(2)]
        stage, d = divmod(rank, 2)
        step = torch_pipe_step(cfg, w, feeds, lr, "1f1b", M, stage_index=stage, group=pipes[d],
                               wrap=lambda mod: nn.parallel.DistributedDataParallel(mod, process_group=dps[stage]))
        sub_ids, sub_labels = _rows(ids, d, 2), _rows(labels, d, 2)
        return lambda: step(sub_ids, sub_labels)
    raise KeyError(name)


# ----------------------------------------------------------------------------- meshdsl variants

def meshdsl_variant(name, model, feeds, lr, seed, stats):
    """A meshdsl TrainStep of variant ``name``; appends each timed step's split to ``stats``."""
    from meshdsl.comm.distributed import TorchComm
    from meshdsl.train.jobs import agree_plan
    from meshdsl.train.step import TrainStep
    mesh, layout, m = MESHDSL[name]
    comm = TorchComm(mesh)
    ts = TrainStep(model.loss, model.params, mesh, layout, comm, lr=lr, seed=seed, microbatches=m,
                   schedule=SCHEDULE.get(name, "1f1b"), compile=name in COMPILED)
    agree_plan(comm, ts.plan)
    dev = _device()
    if dev.type != "cpu":
        ts.params = {k: [None if x is None else x.to(dev) for x in v] for k, v in ts.params.items()}
        feeds = _on(feeds, dev)

    def step(timed=False):
        loss, st = ts(feeds, timed=timed)
        if st is not None:
            stats.append({"total": st.total, "compute": st.compute, "comm": st.comm, "overhead": st.overhead,
                          "in_flight": st.in_flight})
        return loss
    return step


def _build(names, lr, seed):
    model, feeds, w = setup(seed)
    stats = {k: [] for k in names if k in MESHDSL}
    steps = {k: meshdsl_variant(k, model, feeds, lr, seed, stats[k]) if k in MESHDSL
             else torch_variant(k, model.config, w, feeds, lr) for k in names}
    return steps, stats


def time_job(comm, names, warmup, reps, block, lr, seed):
    """One job: the variants ``names`` (all of one process count), interleaved."""
    steps, stats = _build(names, lr, seed)
    sync = dist.barrier if dist.get_world_size() > 1 else None
    loss0, last, times, cpu = _interleave(steps, warmup, reps, block, sync=sync, timed_arg=tuple(stats))
    return {"loss0": loss0, "last": last, "times": times, "cpu": cpu, "stats": stats}


def memory_job(comm, name, lr, seed, steps=3):
    """Peak memory of a process running variant ``name`` only, and the part the variant added:
    its resident set on the CPU; on a GPU, the bytes torch allocated there (weights included)."""
    from meshdsl.train.step import peak_rss
    model, feeds, w = setup(seed)
    dev = _device()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else peak_rss()
    step = _build((name,), lr, seed)[0][name]
    for _ in range(steps):
        step()
    return {"base": base, "peak": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else peak_rss()}


# ----------------------------------------------------------------------------- report

def _loss(values) -> float:
    """The batch loss from every rank's: ranks on part of the batch (or NaN off the last stage)."""
    held = [v for v in values if not math.isnan(v)]
    return sum(held) / len(held) if held else math.nan


def bench(args) -> int:
    from meshdsl.processes.launcher import spawn
    names = args.only or VARIANTS
    gpus = torch.cuda.device_count() if args.backend == "nccl" else None
    skipped = [k for k in names if gpus is not None and NPROC[k] > gpus]
    names = [k for k in names if k not in skipped]
    jobs = {n: [k for k in ks if k in names] for n, ks in JOBS.items()}
    jobs = {n: ks for n, ks in jobs.items() if ks}
    reps, rounds = (2, 1) if args.quick else (args.reps, args.rounds)
    machine = machine_start("cpu" if args.backend == "gloo" else "cuda", threads=1)
    t0, ticks0 = time.perf_counter(), _cpu_ticks()
    times = {k: [] for k in names}
    cpu = {k: [] for k in names}
    per_round = {k: [] for k in names}
    split = {k: [] for k in names if k in MESHDSL}
    loss0, last = {}, {}
    for rnd in range(rounds):
        for n, ks in jobs.items():
            res = spawn(time_job, n, args=(ks, args.warmup, reps, args.block, args.lr, args.seed),
                        mesh=f"data:{n}", backend=args.backend, timeout=3600)
            for k in ks:
                wall = [max(ts) for ts in zip(*(r["times"][k] for r in res))]
                times[k] += wall
                cpu[k] += [max(cs) for cs in zip(*(r["cpu"][k] for r in res))]
                per_round[k].append(_ms(wall))
                if k in split:
                    split[k] += res[0]["stats"][k]
                if rnd == 0:
                    loss0[k] = _loss([r["loss0"][k] for r in res])
                    last[k] = _loss([r["last"][k] for r in res])
    memory = {}
    if not args.quick and not args.no_memory:
        for k in (k for k in names if k != BOUND and k not in COMPILED):
            res = spawn(memory_job, NPROC[k], args=(k, args.lr, args.seed), mesh=f"data:{NPROC[k]}",
                        backend=args.backend, timeout=600)
            memory[k] = {"peak_mib": [r["peak"] / 2 ** 20 for r in res],
                         "added_mib": [(r["peak"] - r["base"]) / 2 ** 20 for r in res]}
    wall_s, ticks1 = time.perf_counter() - t0, _cpu_ticks()
    machine_end(machine)
    steal = (ticks1[0] - ticks0[0]) / max(1, ticks1[1] - ticks0[1]) if ticks0 and ticks1 else None
    out = summarise(args, names, times, cpu, per_round, split, loss0, last, memory)
    out["run"] = {"rounds": rounds, "reps": reps, "block": args.block, "warmup": args.warmup, "quick": args.quick,
                  "backend": args.backend, "skipped": skipped, "wall_s": wall_s, "machine": machine,
                  "loadavg_start": machine["load_start"], "loadavg_end": machine["load_end"],
                  "steal_fraction": steal, "torch": torch.__version__, "python": platform.python_version(),
                  "cpus": os.cpu_count(), "bind_cores": os.environ.get("MESHDSL_BIND_CORES", "none")}
    print_tables(out)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    chart(out)
    print(f"wrote {RESULTS.relative_to(ROOT)} and {CHART.relative_to(ROOT)}")
    return 0 if all(out["loss_step0_ok"].values()) else 1


def summarise(args, names, times, cpu, per_round, split, loss0, last, memory) -> dict:
    """Every figure as plain data (the JSON)."""
    med = {k: _ms(v) for k, v in times.items()}
    base = med.get("torch")
    base_loss = loss0.get("torch", next(iter(loss0.values())))
    mean = {k: {f: sum(s[f] for s in sts) / len(sts) * 1e3 for f in ("total", "compute", "comm", "overhead",
                                                                        "in_flight")}
            for k, sts in split.items() if sts}
    return {
        "workload": {"model": "models/transformer.py default Config", "step": "forward + backward + SGD",
                     "dtype": "float32", "lr": args.lr, "threads_per_process": 1, "microbatches": M},
        "variants": {k: {"procs": NPROC[k], "median_ms": med[k],
                         "round_median_range_ms": [min(per_round[k]), max(per_round[k])],
                         "speedup_vs_torch_1p": base / med[k] if base else None,
                         "cpu_median_ms": _ms(cpu[k]), "loss_step0": loss0[k], "loss_last": last[k],
                         "meshdsl_split_ms": {"compute": mean[k]["compute"], "exposed_comm": mean[k]["comm"],
                                              "overhead": mean[k]["overhead"], "comm_in_flight": mean[k]["in_flight"]}
                         if k in mean else None,
                         "memory": memory.get(k),
                         **({"mesh": MESHDSL[k][0], "layout": MESHDSL[k][1]} if k in MESHDSL else {})}
                     for k in names},
        "ratios": {f"{k} / {p}": med[k] / med[p] for k, p in PEERS if k in med and p in med},
        "paired_ratios": {f"{k} / {p}": paired_ratio(times[k], times[p]) for k, p in PEERS
                          if k in med and p in med},
        # bound / variant, turn by turn: the share of the no-communication bound a 2-process variant
        # reaches (its turns ran beside the bound's, in the same job and round)
        "share_of_bound": {k: paired_ratio(times[BOUND], times[k]) for k in names
                           if BOUND in times and k != BOUND and NPROC[k] == 2 and k not in COMPILED},
        "loss_step0_ok": {k: abs(v - base_loss) <= LOSS_RTOL * abs(base_loss) for k, v in loss0.items()},
        "step_ms": {k: [x * 1e3 for x in v] for k, v in times.items()},
    }


def print_tables(out) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console(width=max(Console().width, 170))
    run = out["run"]
    t = Table(title=f"GPT training step (models/transformer.py default, fp32, SGD), 1 thread/process, "
                    f"{run['rounds']} round(s) x {run['reps']} turns x {run['block']} steps, {run['backend']}, "
                    f"cores bound: {run.get('bind_cores', 'none')}",
              title_justify="left")
    for col in ("variant", "procs", "median ms", "round medians", "speedup vs 1p", "CPU ms", "compute ms",
                "exposed comm ms", "in flight ms", "overhead ms",
                "peak GPU MiB/rank" if run["backend"] == "nccl" else "peak RSS MiB/rank", "added MiB/rank",
                "loss step 0"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for k, v in out["variants"].items():
        sp, mem = v["meshdsl_split_ms"], v["memory"]
        t.add_row(k, str(v["procs"]), f"{v['median_ms']:.1f}",
                  "{:.1f}-{:.1f}".format(*v["round_median_range_ms"]),
                  f"{v['speedup_vs_torch_1p']:.2f}x" if v["speedup_vs_torch_1p"] else "",
                  f"{v['cpu_median_ms']:.1f}",
                  *([f"{sp['compute']:.1f}", f"{sp['exposed_comm']:.1f}", f"{sp['comm_in_flight']:.1f}",
                     f"{sp['overhead']:.1f}"] if sp else [""] * 4),
                  " ".join(f"{x:.0f}" for x in mem["peak_mib"]) if mem else "",
                  " ".join(f"{x:.0f}" for x in mem["added_mib"]) if mem else "",
                  f"{v['loss_step0']:.6f}" + ("" if out["loss_step0_ok"][k] else " MISMATCH"))
    console.print(t)
    console.print("ms per step: median over all samples (slowest rank); round medians: range of the per-round "
                  "medians; CPU ms: busy CPU time of the slowest rank; meshdsl split (rank 0, means): exposed "
                  "comm = issuing collectives + blocked on one in flight, in flight = how long collectives "
                  "ran in all; memory: " + ("torch.cuda.max_memory_allocated" if run["backend"] == "nccl" else "ru_maxrss")
                  + " of a job running the variant alone (added: minus the mark before the variant was built)", highlight=False, soft_wrap=True)
    for name, r in out["ratios"].items():
        p = out["paired_ratios"][name]
        console.print(f"{name} = {r:.3f}; turn by turn: median {p['median']:.3f}, 10-90% {p['p10']:.3f}-"
                      f"{p['p90']:.3f} over {p['turns']} turns", highlight=False)
    for name, p in out["share_of_bound"].items():
        console.print(f"{name} reaches {p['median']:.1%} of the bound (no comm), turn by turn (10-90% "
                      f"{p['p10']:.1%}-{p['p90']:.1%} over {p['turns']} turns)", highlight=False)
    console.print(f"wall {run['wall_s']:.0f} s; load average {run['loadavg_start'][0]:.2f} at start, "
                  f"{run['loadavg_end'][0]:.2f} at end, on {run['cpus']} cores"
                  + (f"; skipped (fewer GPUs than processes): {', '.join(run['skipped'])}" if run["skipped"] else ""),
                  highlight=False)


def chart(out) -> None:
    """One bar chart: median step time per variant, the round medians' range as error bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(out["variants"])
    med = [out["variants"][k]["median_ms"] for k in names]
    lo = [m - out["variants"][k]["round_median_range_ms"][0] for k, m in zip(names, med)]
    hi = [out["variants"][k]["round_median_range_ms"][1] - m for k, m in zip(names, med)]
    colours = ["tab:blue" if k.startswith("meshdsl") else "white" if k == BOUND else "tab:gray" for k in names]
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(names)), 4.5))
    ax.bar(range(len(names)), med, yerr=[[max(0, x) for x in lo], [max(0, x) for x in hi]], color=colours,
           edgecolor="tab:gray", capsize=3)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{k}\n({out['variants'][k]['procs']}p)" for k in names], rotation=45, ha="right",
                       fontsize=8)
    ax.set_ylabel("median step (ms)")
    ax.set_title("GPT training step: meshdsl (blue) vs torch (gray); white: 2 processes, no communication")
    fig.tight_layout()
    fig.savefig(CHART, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of 1-, 2- and 4-process jobs (default 3)")
    p.add_argument("--reps", type=int, default=4, help="turns per variant per round (default 4)")
    p.add_argument("--block", type=int, default=4,
                   help="consecutive steps per turn (at least 2); the first of each is untimed")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="1 round of 2 turns, no memory jobs")
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant memory jobs")
    p.add_argument("--only", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=None,
                   metavar="VARIANT,...", help=f"run only these variants, of: {', '.join(VARIANTS)}")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = p.parse_args(argv)
    if args.block < 2:
        p.error("--block must be at least 2 (a turn's first step is untimed)")
    bad = [k for k in args.only or () if k not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; the variants are: {', '.join(VARIANTS)}")
    if args.only and "torch" not in args.only:
        args.only = ["torch", *args.only]  # the baseline of the speedups and the losses
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
