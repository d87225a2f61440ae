"""Training throughput and memory of `meshdsl train` (md.fit) vs a plain-torch AdamW loop.

The meshdsl side is the loop `meshdsl train` runs (``meshdsl.train.trainer.run_rank``: data
feeding, the compiled AdamW step with global-norm clipping, per-step bookkeeping), on 1
process (in this process, as `meshdsl train` does) and on 2 gloo processes with each of the
data-parallel layouts DP, ZeRO-1, ZeRO-2 and FSDP (the fastest is reported as "best").  The
baseline is the same model written in plain torch (``TorchGPT`` of bench/dense_vs_torch.py),
holding meshdsl's initial weights, fed the same batches (``TokenData.batch(step, ...)`` of the
default corpus), with ``torch.optim.AdamW(fused=True)`` (the kernel meshdsl's update runs too)
and ``clip_grad_norm_`` at the same hyperparameters; both run with one torch thread.  Their loss
curves are compared, so both sides train the same model on the same data.  The torch loop runs
twice per round: eager, and with the module through ``torch.compile`` (its first steps, which
compile, are among the untimed ones).

Memory: each rank of each multi-process run reports its peak resident set (VmHWM, reset after
the corpus is loaded, so it covers building, compiling and training), next to what
``lowering/memory.py`` predicts from the plan (params, grads, optimizer state, peak
activations) and the ZeRO arithmetic (the ``d_model`` part of params, grads and AdamW's two
moments divided over N data ranks), for 2 and 4 processes.

CPU: each side's whole step and its forward + backward alone, in thread CPU time (robust to
other jobs' load), so a gap shows whether it lies in the model's math or in what the training
step adds (optimizer update, clipping, data feeding, the loop).

    python bench/train.py                 # 3 rounds x 12 timed steps
    python bench/train.py --quick         # 1 round x 4 timed steps, fewer 4-process steps
    python bench/train.py --rounds 5 --steps 20 --config d_model=512,d_ff=2048

Writes bench/results/train.json.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dense_vs_torch import TorchGPT  # noqa: E402  (the torch twin of models/transformer.py)
from distributed_mlp import _cpu_ticks  # noqa: E402  (steal ticks from /proc/stat)
from _common import machine_end, machine_start  # noqa: E402

import meshdsl as md  # noqa: E402
from meshdsl.processes.launcher import spawn  # noqa: E402
from meshdsl.train.config import parse_config  # noqa: E402
from meshdsl.train.data import TokenData  # noqa: E402
from meshdsl.train.model import load_model  # noqa: E402
from meshdsl.train.trainer import TrainSpec, build_step, run_rank  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOAL_1, GOAL_2 = 0.95, 1.6  # tokens/s over plain torch, 1 and 2 processes (issue 11)
LAYOUTS = {"DP": "batch:data",
           "ZeRO-1": "batch:data; opt.d_model:data",
           "ZeRO-2": "batch:data; grads.d_model:data; opt.d_model:data",
           "FSDP": "batch:data; params.d_model:data"}
HP = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "clip": 1.0}
WARMUP = 2  # untimed first steps of every run (allocations, first-touch caches)
MiB = 2 ** 20


# ----------------------------------------------------------------------------- memory probes

def _reset_peak() -> bool:
    """Reset this process's peak RSS (Linux: ``5`` into clear_refs); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status_bytes(field: str) -> int | None:
    """A ``kB`` line of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _peak_rss() -> int:
    """This process's peak resident set in bytes (VmHWM; ru_maxrss off Linux)."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss() -> int:
    """This process's resident set now, in bytes (VmRSS; off Linux the peak so far)."""
    now = _status_bytes("VmRSS")
    return now if now is not None else _peak_rss()


# ----------------------------------------------------------------------------- the two sides

def make_spec(config: dict, mesh: str, layout: str, steps: int) -> TrainSpec:
    """The run `meshdsl train --optimizer adamw --clip-norm ...` would make (no eval, no samples)."""
    return TrainSpec(model="transformer", config=config, mesh=mesh, layout=layout, steps=steps, lr=HP["lr"],
                     optimizer="adamw", optimizer_args={"betas": HP["betas"], "eps": HP["eps"],
                                                        "weight_decay": HP["weight_decay"]},
                     clip_norm=HP["clip"], eval_batches=0, samples=0)


def meshdsl_rank(comm, spec: TrainSpec, tokens: TokenData | None = None) -> dict:
    """One rank of a meshdsl run: per-step losses and ms (rank 0) and this rank's memory."""
    torch.set_num_threads(1)
    tokens = tokens or TokenData.load(None, seed=spec.seed)  # before the peak reset: not training's memory
    base, reset = _rss(), _reset_peak()
    res = run_rank(comm, spec, data=tokens)
    out = {"rss_base": base, "rss_peak": _peak_rss(), "peak_reset": reset}
    if res is not None:
        out.update(losses=[r["loss"] for r in res.rows], ms=[r["ms"] for r in res.rows])
    return out


def torch_run(config: dict, tokens: TokenData, steps: int, compile: bool = False) -> dict:
    """The plain-torch loop: same model, init, batches, AdamW and clipping; per-step loss and ms.
    With ``compile`` the module goes through ``torch.compile`` (the first step compiles)."""
    torch.set_num_threads(1)
    model = load_model("transformer", **config)
    cfg = model.config
    net = TorchGPT(cfg, md.DenseProgram(dict(model.params)).init_params(0))
    fn = torch.compile(net) if compile else net
    opt = torch.optim.AdamW(net.parameters(), lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                            weight_decay=HP["weight_decay"], fused=True)
    losses, ms = [], []
    for t in range(1, steps + 1):
        t0 = time.perf_counter()
        ids, labels = tokens.batch(t, cfg.batch, cfg.seq)
        opt.zero_grad(set_to_none=True)
        loss = fn(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), HP["clip"])
        opt.step()
        losses.append(float(loss.detach()))
        ms.append((time.perf_counter() - t0) * 1e3)
    return {"losses": losses, "ms": ms}


# ----------------------------------------------------------------------------- predictions

def predicted(config: dict, mesh: str, layout: str) -> dict:
    """``md.memory_report`` of the training plan, and the ZeRO arithmetic for it."""
    model = load_model("transformer", **config)
    spec = make_spec(config, mesh, layout, 1)
    rep = md.memory_report(build_step(model, spec, md.SimulatedComm(md.Mesh.parse(mesh))).plan)
    n = md.Mesh.parse(mesh).size
    full = sum(math.prod(t.shape.sizes) * 4 for t in model.params.values())
    split = sum(math.prod(t.shape.sizes) * 4 for t in model.params.values() if "d_model" in t.shape)
    shard = full - split + split // n  # a rule on d_model splits that part over N ranks
    p, g, o = {"DP": (full, full, 2 * full), "ZeRO-1": (full, full, 2 * shard),
               "ZeRO-2": (full, shard, 2 * shard), "FSDP": (shard, shard, 2 * shard)}[_name(layout)]
    return {**rep, "zero_params": p, "zero_grads": g, "zero_optimizer": o}


def _name(layout: str) -> str:
    return next(k for k, v in LAYOUTS.items() if v == layout)


# ----------------------------------------------------------------------------- CPU breakdown

def cpu_breakdown(config: dict, tokens: TokenData, steps: int) -> dict:
    """CPU ms per step (this thread's time, so other jobs' load does not count) of each side's
    whole training step and of its forward + backward alone, the four taking turns step by step.

    The difference of the two is what the step adds to the model's math: the optimizer update,
    clipping, data feeding and the loop.  meshdsl's whole step is ``trainer.run_step`` on the
    feeds ``TokenFeeder`` builds (the calls ``run_rank`` makes); its forward + backward is the
    dense program of the loss and every gradient.
    """
    from meshdsl.train.feeder import TokenFeeder
    from meshdsl.train.trainer import run_step

    torch.set_num_threads(1)
    model = load_model("transformer", **config)
    cfg, spec = model.config, make_spec(config, "data:1", "", steps + WARMUP)
    step = build_step(model, spec, md.SimulatedComm(md.Mesh.parse("data:1")))
    feeder = TokenFeeder(tokens, step.plan, [0], cfg.vocab)
    fwd_bwd = md.DenseProgram({"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}})
    params = fwd_bwd.init_params(0)
    net = TorchGPT(cfg, md.DenseProgram(dict(model.params)).init_params(0))
    opt = torch.optim.AdamW(net.parameters(), lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                            weight_decay=HP["weight_decay"], fused=True)

    def torch_step(t, update=True):
        ids, labels = tokens.batch(t, cfg.batch, cfg.seq)
        opt.zero_grad(set_to_none=True)
        net(ids, labels).backward()
        if update:
            torch.nn.utils.clip_grad_norm_(net.parameters(), HP["clip"])
            opt.step()

    def meshdsl_fwd_bwd(t):
        ids, labels = tokens.batch(t, cfg.batch, cfg.seq)
        fwd_bwd({"ids": ids, "labels": labels}, params)

    sides = {"torch step": torch_step, "torch fwd+bwd": lambda t: torch_step(t, False),
             "meshdsl step": lambda t: run_step(step, feeder.train(t), spec, t), "meshdsl fwd+bwd": meshdsl_fwd_bwd}
    cpu = {k: [] for k in sides}
    for t in range(1, steps + WARMUP + 1):
        for k, fn in sides.items():
            c0 = time.thread_time()
            fn(t)
            if t > WARMUP:
                cpu[k].append((time.thread_time() - c0) * 1e3)
    return {k: statistics.median(v) for k, v in cpu.items()}


# ----------------------------------------------------------------------------- the bench

def _timed(ms: list[float]) -> list[float]:
    return ms[WARMUP:] or ms


def bench(args) -> int:
    console = Console(width=max(Console().width, 140))
    torch.set_num_threads(1)
    # Both 1-process sides share this process (and every spawned rank tunes its own): both run
    # on the allocator settings meshdsl's processes use, as `meshdsl train` does.
    console.print(f"malloc: {'tuned' if md.tune_malloc() else 'as is'} for both sides (meshdsl.tune_malloc)")
    config = parse_config(args.config, load_model("transformer").config.__class__)
    cfg = load_model("transformer", **config).config
    tokens_per_step = cfg.batch * cfg.seq
    steps = WARMUP + args.steps
    machine = machine_start(threads=1, say=lambda s: console.print(s, highlight=False))
    t_start, ticks0 = time.perf_counter(), _cpu_ticks()
    tokens = TokenData.load(None)
    runs: dict[str, list] = {"torch": [], "torch compiled": [], "meshdsl/1": [], **{f"{k}/2": [] for k in LAYOUTS}}
    mem: dict[str, list] = {}
    for rnd in range(args.rounds):
        console.print(f"round {rnd + 1}/{args.rounds}: plain torch, meshdsl 1 process", style="dim")
        runs["torch"].append(torch_run(config, tokens, steps))
        runs["torch compiled"].append(torch_run(config, tokens, steps, compile=True))
        runs["meshdsl/1"].append(meshdsl_rank(md.SimulatedComm(md.Mesh.parse("data:1")),
                                              make_spec(config, "data:1", "", steps), tokens))
        for nproc in (2, 4):
            if nproc == 4 and rnd:  # memory on 4 processes needs one run; its steps are not timed
                continue
            for name, layout in LAYOUTS.items():
                console.print(f"round {rnd + 1}/{args.rounds}: {name} on {nproc} processes", style="dim")
                mesh = f"data:{nproc}"
                n = steps if nproc == 2 else WARMUP + args.steps4
                got = spawn(meshdsl_rank, nproc, args=(make_spec(config, mesh, layout, n),), mesh=mesh,
                            timeout=args.timeout)
                if nproc == 2:
                    runs[f"{name}/2"].append(got[0])
                mem.setdefault(f"{name}/{nproc}", []).append(
                    [{k: r[k] for k in ("rss_base", "rss_peak", "peak_reset")} for r in got])

    # ---- throughput
    def tps(run) -> float:
        return tokens_per_step / statistics.median(_timed(run["ms"])) * 1e3

    per = {k: [tps(r) for r in v] for k, v in runs.items()}
    base = statistics.median(per["torch"])
    # per-round ratios: both sides of a ratio ran minutes apart at most, under the same load
    ratio = {k: statistics.median(a / b for a, b in zip(v, per["torch"])) for k, v in per.items()}
    best2 = max(LAYOUTS, key=lambda k: ratio[f"{k}/2"])
    drift = max(abs(a - b) / abs(b) for a, b in zip(runs["meshdsl/1"][0]["losses"], runs["torch"][0]["losses"]))

    t = Table(title=f"meshdsl train vs plain torch: transformer {cfg.batch}x{cfg.seq} tokens/step, d_model "
                    f"{cfg.d_model}, d_ff {cfg.d_ff}, {cfg.layers} layers, AdamW + clipping, "
                    f"{args.rounds} round(s) x {args.steps} timed steps", title_justify="left")
    for col in ("variant", "processes", "tokens/s (median)", "range over rounds", "x plain torch", "goal"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    t.add_row("plain torch (torch.optim.AdamW)", "1", f"{base:,.0f}",
              f"{min(per['torch']):,.0f}-{max(per['torch']):,.0f}", "1.00", "")
    t.add_row("plain torch, torch.compile (the same loop)", "1", f"{statistics.median(per['torch compiled']):,.0f}",
              f"{min(per['torch compiled']):,.0f}-{max(per['torch compiled']):,.0f}",
              f"{ratio['torch compiled']:.2f}", "")
    goal = f">= {GOAL_1}: " + ("met" if ratio["meshdsl/1"] >= GOAL_1 else "MISSED")
    t.add_row("meshdsl (md.fit)", "1", f"{statistics.median(per['meshdsl/1']):,.0f}",
              f"{min(per['meshdsl/1']):,.0f}-{max(per['meshdsl/1']):,.0f}", f"{ratio['meshdsl/1']:.2f}", goal)
    for name, layout in LAYOUTS.items():
        k = f"{name}/2"
        goal = (f">= {GOAL_2}: " + ("met" if ratio[k] >= GOAL_2 else "MISSED")) if name == best2 else ""
        t.add_row(f"meshdsl {name} '{layout}'" + ("  (best)" if name == best2 else ""), "2",
                  f"{statistics.median(per[k]):,.0f}", f"{min(per[k]):,.0f}-{max(per[k]):,.0f}",
                  f"{ratio[k]:.2f}", goal)
    console.print(t)
    console.print(f"loss curves: meshdsl (1 process) vs plain torch, largest relative difference over "
                  f"{steps} steps: {drift:.1e} (same model, init and batches)")

    # ---- memory
    m = Table(title="peak memory per rank (MiB): measured resident set vs the plan's prediction and the ZeRO "
                    "arithmetic", title_justify="left")
    for col in ("layout", "processes", "ZeRO arithmetic: params + grads + AdamW state", "plan: p + g + opt",
                "plan: peak activations", "plan total", "measured: peak RSS - RSS at start (max over ranks)"):
        m.add_column(col, justify="left" if col == "layout" else "right")
    memory = {}
    for key, samples in mem.items():
        name, nproc = key.split("/")
        pred = predicted(config, f"data:{nproc}", LAYOUTS[name])
        measured = max(r["rss_peak"] - r["rss_base"] for s in samples for r in s)
        zero = pred["zero_params"] + pred["zero_grads"] + pred["zero_optimizer"]
        plan_state = pred["params"] + pred["grads"] + pred["optimizer"]
        memory[key] = {**pred, "measured_peak_delta": measured,
                       "ranks": [[{**r} for r in s] for s in samples]}
        m.add_row(name, nproc, f"{zero / MiB:.1f}", f"{plan_state / MiB:.1f}",
                  f"{pred['activations_peak'] / MiB:.1f}", f"{(plan_state + pred['activations_peak']) / MiB:.1f}",
                  f"{measured / MiB:.1f}")
    console.print(m)
    cpu = cpu_breakdown(config, tokens, args.steps)
    c = Table(title="CPU ms per step (thread time, median): where each side's step goes", title_justify="left")
    for col in ("side", "whole step", "forward + backward", "the rest: update, clipping, data, loop"):
        c.add_column(col, justify="left" if col == "side" else "right")
    for side in ("torch", "meshdsl"):
        whole, fb = cpu[f"{side} step"], cpu[f"{side} fwd+bwd"]
        c.add_row(side, f"{whole:.1f}", f"{fb:.1f}", f"{whole - fb:.1f}")
    c.add_row("meshdsl / torch", f"{cpu['meshdsl step'] / cpu['torch step']:.2f}",
              f"{cpu['meshdsl fwd+bwd'] / cpu['torch fwd+bwd']:.2f}", "")
    console.print(c)
    ticks1 = _cpu_ticks()
    steal = (ticks1[0] - ticks0[0]) / max(1, ticks1[1] - ticks0[1]) if ticks0 and ticks1 else None
    machine_end(machine, say=lambda s: console.print(s, highlight=False))
    console.print((f"CPU stolen by the hypervisor {steal:.1%}; " if steal is not None else "")
                  + f"{time.perf_counter() - t_start:.0f} s in all")

    out = ROOT / "bench" / "results" / "train.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "config": dict(vars(cfg)), "hyperparameters": HP, "rounds": args.rounds, "timed_steps": args.steps,
        "tokens_per_step": tokens_per_step, "tokens_per_s": per, "ratio_to_torch": ratio, "best_2proc": best2,
        "goals": {"1proc": GOAL_1, "2proc": GOAL_2}, "loss_max_rel_diff": drift,
        "runs": {k: [{"losses": r["losses"], "ms": r["ms"]} for r in v] for k, v in runs.items()},
        "memory_bytes": memory, "cpu_ms_per_step": cpu, "load_average": [machine["load_start"][0], machine["load_end"][0]],
        "machine": machine, "steal": steal,
        "python": platform.python_version(), "torch": torch.__version__}, indent=1))
    console.print(f"wrote {out.relative_to(ROOT)}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of every variant (default 3)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per run, after 2 untimed (default 12)")
    p.add_argument("--steps4", type=int, default=3, help="steps of the 4-process memory runs (default 3)")
    p.add_argument("--config", default="", help="transformer Config overrides, e.g. d_model=512,d_ff=2048")
    p.add_argument("--timeout", type=float, default=600, help="seconds one multi-process run may take")
    p.add_argument("--quick", action="store_true", help="1 round of 4 timed steps, 2 steps on 4 processes")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.steps4 = 1, 4, 1
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
