"""Which part of ``--compile`` makes a compiled whole step differ from the eager executor.

A diagnostic: the whole step of a model's training outputs (the loss and every
gradient) is traced once, as ``--compile`` traces it (meshdsl/runtime/whole.py), and compiled by
inductor in several variants; each variant's outputs are compared with the eager executor's
at ``check``'s tolerance (meshdsl/runtime/agreement.py), and every output beyond its
allowance is printed with its difference; with ``--time N`` each variant's step is timed too
(the median of N calls after one, synchronized on a GPU), whether it agrees or not.  The variants:

  as run          the stacked-gradient rewrite, inductor's rewrites, inductor's decompositions
                  (what ``--compile`` compiles first)
  no rewrites     inductor's decompositions alone: whether inductor itself gets it wrong
  careful         no rewrites, the layer norms' backward as one opaque op (torch's kernel, not
                  inductor's code: ``--compile``'s third try)
  rewrites, opaque norms
                  the rewrites with the layer norms' backward opaque (``--compile``'s second try)
  without R       as run, less rewrite R (one row per rewrite; only where "as run" differs and
                  "no rewrites" agrees: which rewrite is the cause)

    python bench/compile_agreement.py --device cuda --config d_model=1024,heads=16,d_head=64,d_ff=4096,layers=2,seq=512,batch=16
    python bench/compile_agreement.py --device cpu --tiny     # the same on this machine (a few minutes)
    python bench/compile_agreement.py --device cuda --time 20 --config ...   # and each variant's step time
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import meshdsl as md
from meshdsl.runtime import whole
from meshdsl.runtime.agreement import TOLERANCE, allowed_diff
from meshdsl.train.model import load_model


def _parse_config(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        out[k.strip()] = int(v)
    return out


def _compiled(gm, example, stack: bool, rewrites):
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    if stack:
        whole._stack_layer_writes(gm)
    for rewrite in rewrites:
        rewrite(gm)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(x, static_shapes=True) for x in example]
    return compile_fx(gm, fakes)


def _off(flat: list, want: dict, names: list, counts: list) -> dict[str, str]:
    """Every output of ``flat`` beyond its allowance against ``want``: name -> 'diff (allowed, max |want|)'."""
    got, k = {}, 0
    for n, c in zip(names, counts):
        got[n], k = flat[k:k + (c or 0)], k + (c or 0)
    ref = {n: torch.stack([w.detach().double() for w in want[n]]) for n in names if want[n]}
    allowed = allowed_diff(ref, TOLERANCE[torch.float32])
    out = {}
    for n in ref:
        diff = max((g.detach().double() - w.detach().double()).abs().max().item() for g, w in zip(got[n], want[n]))
        if not diff <= allowed[n]:
            out[n] = f"{diff:.3g} (allowed {allowed[n]:.3g}, max |want| {ref[n].abs().max().item():.3g})"
    return out


def _step_ms(fn, example: list, n: int) -> float:
    """The median wall time of ``n`` calls of ``fn`` after one, each synchronized on a GPU."""
    inputs = [x.clone() for x in example]
    sync = torch.cuda.synchronize if inputs and inputs[0].is_cuda else (lambda: None)
    fn(*inputs)
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(*inputs)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _variants() -> list[tuple[str, bool, tuple, bool]]:
    """(label, stacked-gradient rewrite, inductor rewrites, opaque norms) of the first four variants."""
    all_ = whole.INDUCTOR_REWRITES
    return [("as run", True, all_, False), ("no rewrites", False, (), False),
            ("careful", False, (), True), ("rewrites, opaque norms", True, all_, True)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--config", default="", help="name=int,... over the model's Config")
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    ap.add_argument("--time", type=int, default=0, metavar="N", help="time N steps of each variant (median ms)")
    args = ap.parse_args(argv)
    model = load_model(args.model, tiny=args.tiny, **_parse_config(args.config))
    outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}
    plan = md.compile(outs, "data:1", "")
    eager = md.Executor(plan, md.SimulatedComm(plan.mesh, device=args.device))
    params = eager.init_params(0)
    feeds = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in model.feeds(0).items()}
    want = eager.run(feeds, params)
    print(f"{args.model} {args.config or ('tiny' if args.tiny else 'default')} on {args.device}, torch {torch.__version__}",
          flush=True)
    results, step_ms = {}, {}

    def run(label, stack, rewrites, opaque):
        t0 = time.perf_counter()
        try:
            gm, example, names, counts = whole.trace_step(eager, whole._flat(feeds, params)[0], feeds, params, opaque)
            fn = _compiled(gm, example, stack, rewrites)
            off = _off(fn(*[x.clone() for x in example]), want, names, counts)
            if args.time:
                step_ms[label] = _step_ms(fn, example, args.time)
        except Exception as e:  # noqa: BLE001  (a diagnostic: report and go on)
            off = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        results[label] = off
        timing = f"  step {step_ms[label]:.2f} ms" if label in step_ms else ""
        print(f"  {label:<24} {time.perf_counter() - t0:6.1f} s  {'agrees' if not off else 'DIFFERS'}{timing}",
              flush=True)
        for n, text in off.items():
            print(f"      {n}: {text}", flush=True)
        return not off

    ok = {label: run(label, *rest) for label, *rest in _variants()}
    if not ok["as run"] and ok["no rewrites"]:
        for r in (None, *whole.INDUCTOR_REWRITES):
            rest = tuple(x for x in whole.INDUCTOR_REWRITES if x is not r)
            run(f"without {r.__name__ if r else '_stack_layer_writes'}", r is not None, rest, False)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "config": args.config, "device": args.device, "variants": results,
                       "step_ms": step_ms}, f, indent=1)


if __name__ == "__main__":
    main()
