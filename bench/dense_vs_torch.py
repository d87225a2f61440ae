"""One training step of models/transformer.py: meshdsl's dense executor vs plain torch.

The torch side is the same model written by hand, nanoGPT-style (nn.Module,
torch autograd, the same math), holding copies of meshdsl's initial weights,
so both compute the same loss.  Both sides run in this process, on the allocator
settings meshdsl's own processes use (``meshdsl.tune_malloc``).  Steps alternate between the two, and the
table reports median times and the ratio meshdsl / torch (target <= 1.05).
With ``--rounds N`` the whole measurement runs N times and the ratios' median
and range are reported.  Results go to bench/results/dense_vs_torch[_update].json.

    python bench/dense_vs_torch.py                 # forward + backward
    python bench/dense_vs_torch.py --update        # ... + the SGD update
    python bench/dense_vs_torch.py --rounds 3 --reps 7
    python bench/dense_vs_torch.py --profile       # where meshdsl's time goes
    python bench/dense_vs_torch.py --plan          # the plan executor (mesh data:1) instead
    python bench/dense_vs_torch.py --device cuda   # both sides on the GPU (times after a synchronize)
    python bench/dense_vs_torch.py --config d_model=512,layers=2   # another size of the model
    python bench/dense_vs_torch.py --model llama   # models/llama.py against bench/torch_llama.py
    python bench/dense_vs_torch.py --model vit     # models/vit.py against bench/torch_vit.py

With ``--plan`` meshdsl's side is the compiled plan on mesh ``data:1`` run by the
plan executor, the path ``meshdsl run``/``train`` and every per-rank program take.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import meshdsl as md
from meshdsl.train.model import load_model
from meshdsl.train.step import training_outputs

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.05
RESULTS = ROOT / "bench" / "results"


# ----------------------------------------------------------------------------- plain torch

class Block(nn.Module):
    """Pre-norm block; weights are one layer's slices of meshdsl's stacked params."""

    def __init__(self, cfg, w: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        d, he = cfg.d_model, cfg.heads * cfg.d_head
        self.ln1 = nn.Parameter(w["ln1"].clone())
        self.ln1_b = nn.Parameter(w["ln1_b"].clone())
        self.wq = nn.Parameter(w["wq"].reshape(d, he).clone())       # [d_model, heads*d_head]
        self.wk = nn.Parameter(w["wk"].reshape(d, he).clone())
        self.wv = nn.Parameter(w["wv"].reshape(d, he).clone())
        self.wo = nn.Parameter(w["wo"].reshape(he, d).clone())       # [heads*d_head, d_model]
        self.ln2 = nn.Parameter(w["ln2"].clone())
        self.ln2_b = nn.Parameter(w["ln2_b"].clone())
        self.w_fc = nn.Parameter(w["w_fc"].clone())                  # [d_model, d_ff]
        self.w_proj = nn.Parameter(w["w_proj"].clone())              # [d_ff, d_model]
        self.register_buffer("causal", torch.tril(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool,
                                                             device=w["ln1"].device)))

    def forward(self, x):
        cfg = self.cfg
        B, S, D = x.shape
        H, E = cfg.heads, cfg.d_head
        h = F.layer_norm(x, (D,), self.ln1, self.ln1_b, eps=1e-5)
        q = (h @ self.wq).view(B, S, H, E).transpose(1, 2)           # [B, H, S, E]
        k = (h @ self.wk).view(B, S, H, E).transpose(1, 2)
        v = (h @ self.wv).view(B, S, H, E).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * E ** -0.5
        att = att.masked_fill(~self.causal, -1e9).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, S, H * E)
        x = x + y @ self.wo
        h = F.layer_norm(x, (D,), self.ln2, self.ln2_b, eps=1e-5)
        return x + F.gelu(h @ self.w_fc) @ self.w_proj


class TorchGPT(nn.Module):
    def __init__(self, cfg, w: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Parameter(w["wte"].clone())                    # [vocab, d_model]
        self.wpe = nn.Parameter(w["wpe"].clone())                    # [seq, d_model]
        names = ("ln1", "ln1_b", "wq", "wk", "wv", "wo", "ln2", "ln2_b", "w_fc", "w_proj")
        self.blocks = nn.ModuleList(Block(cfg, {k: w[k][l] for k in names}) for l in range(cfg.layers))
        self.lnf = nn.Parameter(w["lnf"].clone())
        self.lnf_b = nn.Parameter(w["lnf_b"].clone())
        self.lm_head = nn.Parameter(w["lm_head"].clone())            # [vocab, d_model]

    def forward(self, ids, labels):
        x = F.embedding(ids, self.wte) + self.wpe
        for block in self.blocks:
            x = block(x)
        x = F.layer_norm(x, (self.cfg.d_model,), self.lnf, self.lnf_b, eps=1e-5)
        logits = x @ self.lm_head.t()
        return F.cross_entropy(logits.view(-1, self.cfg.vocab), labels.view(-1))

    def stacked_grads(self) -> dict[str, torch.Tensor]:
        """Gradients in meshdsl's param shapes, for comparison."""
        cfg = self.cfg
        out = {k: getattr(self, k).grad for k in ("wte", "wpe", "lnf", "lnf_b", "lm_head")}
        shapes = {"wq": (cfg.d_model, cfg.heads, cfg.d_head), "wk": (cfg.d_model, cfg.heads, cfg.d_head),
                  "wv": (cfg.d_model, cfg.heads, cfg.d_head), "wo": (cfg.heads, cfg.d_head, cfg.d_model)}
        for k in ("ln1", "ln1_b", "wq", "wk", "wv", "wo", "ln2", "ln2_b", "w_fc", "w_proj"):
            out[k] = torch.stack([getattr(b, k).grad.reshape(shapes.get(k, getattr(b, k).shape))
                                  for b in self.blocks])
        return out


# ----------------------------------------------------------------------------- steps

def _plan_program(wanted, device):
    """``wanted`` compiled for mesh ``data:1`` and run by the plan executor, called like a
    DenseProgram (one rank holds every value whole)."""
    plan = md.compile(wanted, "data:1", "")
    ex = md.Executor(plan, md.SimulatedComm(plan.mesh, device=device))

    def run(feeds, params):
        return {k: xs[0] for k, xs in ex.run(feeds, {k: [v] for k, v in params.items()}).items()}
    return run


def _gpt_peer(cfg, params):
    if cfg.dropout or cfg.norm != "layer" or cfg.tied:
        raise SystemExit("the torch twin implements dropout=0, norm='layer', tied=False only")
    return TorchGPT(cfg, params)


def _llama_peer(cfg, params):
    sys.path.insert(0, str(ROOT / "bench"))
    from torch_llama import TorchLlama
    return TorchLlama(cfg, params)


def _vit_peer(cfg, params):
    sys.path.insert(0, str(ROOT / "bench"))
    from torch_vit import TorchViT
    return TorchViT(cfg, params)


#: --model NAME -> its torch peer, from (Config, meshdsl's initial params)
PEERS = {"transformer": _gpt_peer, "llama": _llama_peer, "vit": _vit_peer}


def make_steps(update: bool, lr: float, plan: bool = False, device: str = "cpu", config: str = "",
               name: str = "transformer"):
    from meshdsl.tools.train_cli import config_overrides
    path = str(ROOT / "models" / f"{name}.py")
    model = load_model(path, **config_overrides(path, config))
    cfg = model.config
    outs = training_outputs(model.loss, model.params, lr, with_grads=True)
    wanted = {k: v for k, v in outs.items() if k == "loss" or k.startswith("new/" if update else "grad/")}
    dense = md.DenseProgram(wanted)
    params = dense.init_params(seed=0, device=device)
    prog = _plan_program(wanted, device) if plan else dense
    feeds = {k: v.to(device) for k, v in model.feeds(0).items()}
    net = PEERS[name](cfg, params).to(device)
    state = {"params": params}

    def meshdsl_step():
        r = prog(feeds, state["params"])
        if update:
            state["params"] = {k: r[f"new/{k}"] for k in params}
        return r

    def torch_step():
        for p in net.parameters():
            p.grad = None
        loss = net(**feeds)   # each peer's forward takes the model's inputs by name
        loss.backward()
        if update:
            with torch.no_grad():
                for p in net.parameters():
                    p.sub_(lr * p.grad)
        return loss

    return cfg, prog, params, feeds, net, meshdsl_step, torch_step


def verify(prog, params, feeds, net, update: bool) -> tuple[float, float, float]:
    """Loss of each side and the largest gradient difference, from the same initial weights."""
    if update:  # compare on a fresh fwd+bwd program from the same weights
        return float("nan"), float("nan"), float("nan")
    r = prog(feeds, params)
    for p in net.parameters():
        p.grad = None
    loss = net(**feeds)
    loss.backward()
    tg = net.stacked_grads()
    gdiff = max((r[f"grad/{k}"] - tg[k]).abs().max().item() for k in tg)
    return r["loss"].item(), loss.item(), gdiff


def bench(args) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    console = Console()
    # Both sides share this process, so both run on the allocator meshdsl's own processes use.
    console.print(f"malloc: {'tuned' if md.tune_malloc() else 'as is'} for both sides (meshdsl.tune_malloc; "
                  "MESHDSL_MALLOC=default leaves it as is)")
    cfg, prog, params, feeds, net, md_step, th_step = make_steps(args.update, args.lr, args.plan, args.device, args.config,
                                                                 args.model)
    if args.device != "cpu":  # a step's time ends when its kernels have run, not when they were queued
        md_step, th_step = _synced(md_step), _synced(th_step)
    md_loss, th_loss, gdiff = verify(prog, params, feeds, net, args.update)
    if args.update:  # the update variant checks the loss of the first step instead
        md_loss, th_loss = md_step()["loss"].item(), th_step().item()

    if args.profile:
        return profile(md_step, th_step, console)

    for _ in range(args.warmup):
        md_step()
        th_step()
    rounds = [_round(md_step, th_step, args.reps) for _ in range(args.rounds)]
    times, cpu = rounds[-1]
    ratios = [statistics.median(t["meshdsl"]) / statistics.median(t["torch"]) for t, _ in rounds]
    cpu_ratios = [statistics.median(c["meshdsl"]) / statistics.median(c["torch"]) for _, c in rounds]
    ratio, cpu_ratio = statistics.median(ratios), statistics.median(cpu_ratios)

    what = "forward + backward + SGD update" if args.update else "forward + backward"
    where = f"on {torch.cuda.get_device_name()}" if args.device != "cpu" else f"{torch.get_num_threads()} thread(s)"
    t = Table(title=f"{args.model} training step ({what}), {where}, "
                    f"{args.reps} interleaved reps", title_justify="left")
    for col in ("", "median ms", "min ms", "max ms", "median CPU ms", "loss"):
        t.add_column(col, justify="right" if col else "left")
    for name, key, loss in (("meshdsl plan" if args.plan else "meshdsl dense", "meshdsl", md_loss), ("plain torch", "torch", th_loss)):
        v = times[key]
        t.add_row(name, f"{statistics.median(v) * 1e3:.1f}", f"{min(v) * 1e3:.1f}", f"{max(v) * 1e3:.1f}",
                  f"{statistics.median(cpu[key]) * 1e3:.1f}", f"{loss:.6f}")
    console.print(f"config: {cfg}")
    console.print(t)
    ok = ratio <= TARGET
    console.print(f"ratio meshdsl / torch = [bold {'green' if ok else 'red'}]{ratio:.3f}[/] wall, "
                  f"{cpu_ratio:.3f} CPU (target <= {TARGET})")
    if args.rounds > 1:
        console.print(f"over {args.rounds} rounds: wall ratio median {ratio:.3f} "
                      f"[{min(ratios):.3f}, {max(ratios):.3f}], CPU ratio [{min(cpu_ratios):.3f}, "
                      f"{max(cpu_ratios):.3f}]; the table shows the last round")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / (f"dense_vs_torch{'' if args.model == 'transformer' else '_' + args.model}"
                     f"{'_update' if args.update else ''}{'_plan' if args.plan else ''}"
                     f"{'_' + args.device.split(':')[0] if args.device != 'cpu' else ''}.json")
    out.write_text(json.dumps({
        "model": args.model, "what": what, "device": args.device, "gpu": torch.cuda.get_device_name() if args.device != "cpu" else None,
        "torch": torch.__version__, "runner": "plan executor, data:1" if args.plan else "dense interpreter", "config": str(cfg), "threads": torch.get_num_threads(), "reps": args.reps,
        "wall_ratio": ratios, "cpu_ratio": cpu_ratios, "target": TARGET,
        "step_ms": {k: [[x * 1e3 for x in t[k]] for t, _ in rounds] for k in ("meshdsl", "torch")},
        "loss": {"meshdsl": md_loss, "torch": th_loss}, "max_grad_diff": None if args.update else gdiff,
        "load_average": list(os.getloadavg())}, indent=1))
    console.print(f"wrote {out.relative_to(ROOT)}")
    if not args.update:
        console.print(f"|loss difference| = {abs(md_loss - th_loss):.2e}, max |grad difference| = {gdiff:.2e}")
    else:
        console.print(f"|first-step loss difference| = {abs(md_loss - th_loss):.2e}")
    return 0


def _synced(step):
    def run():
        out = step()
        torch.cuda.synchronize()
        return out
    return run


def _round(md_step, th_step, reps: int):
    """``reps`` interleaved steps of each side: (wall seconds, CPU seconds) per side."""
    # Wall time is what a user waits for; this process's CPU time is also kept
    # because it barely moves when other jobs share the machine.
    times = {"meshdsl": [], "torch": []}
    cpu = {"meshdsl": [], "torch": []}
    for i in range(reps):
        order = (("meshdsl", md_step), ("torch", th_step))
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return times, cpu


def profile(md_step, th_step, console, steps: int = 3) -> int:
    """Self CPU time per torch op for each side, then meshdsl's Python hot spots."""
    import cProfile
    import pstats
    from torch.profiler import ProfilerActivity, profile as tprofile

    for _ in range(2):
        md_step()
        th_step()
    for name, fn in (("meshdsl dense", md_step), ("plain torch", th_step)):
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fn()
        console.rule(f"{name}: torch ops over {steps} steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    console.rule("meshdsl dense: Python (cProfile, tottime)")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        md_step()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(15)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15, help="timed steps per side (interleaved)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="repeat the measurement; report the ratios' range")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--update", action="store_true", help="include the SGD update in the step")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--profile", action="store_true", help="profile instead of timing")
    p.add_argument("--plan", action="store_true", help="run meshdsl's side through the plan executor (mesh data:1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: where both sides run")
    p.add_argument("--model", default="transformer", choices=sorted(PEERS),
                   help="the model file in models/ and its torch peer (default transformer)")
    p.add_argument("--config", default="", metavar="K=V,...",
                   help="override the model's Config fields, e.g. d_model=1024,layers=8,seq=512")
    return bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
