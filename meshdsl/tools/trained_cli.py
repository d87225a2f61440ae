"""``meshdsl generate`` and ``meshdsl eval``: use what ``meshdsl train`` saved.

Both take a run's ``--out`` folder, a ``--checkpoint`` folder (its latest step) or a step
folder, read through :func:`meshdsl.train.trained.load_trained` (every shard file hashed, the
model rebuilt from the saved Config, a checkpoint of any mesh and layout resharded to full
tensors).  ``generate`` samples text from a model on byte tokens; ``eval`` reports the held-out
loss (and the model's metrics) as the summary of ``meshdsl train`` does, on the same eval batches.
"""
from __future__ import annotations

import argparse
import sys
import time

from ..errors import message
from ..train.evaluate import evaluate
from ..train.generate import generate, samplable
from ..train.model import ModelError
from ..train.trained import load_trained
from ..train.trainer import RUN_THREADS, torch_threads
from .cli_common import EXIT_CODES, EXIT_OK, make_console
from .preflight import float_in, int_in

_PATH_HELP = "a run's --out folder (runs/<stamp>), its --checkpoint folder (the latest step) or one step folder"


def _common(p) -> None:
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help=_PATH_HELP)
    p.add_argument("--model", default=None, metavar="FILE",
                   help="the model file (default: the run's; for a bare checkpoint, the shipped model it names)")
    p.add_argument("--threads", type=int_in(1, fix="e.g. --threads 2"), default=None, metavar="N",
                   help=f"torch threads (default {RUN_THREADS}, as train runs)")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a trained run or checkpoint",
                       description="Continue --prompt with sampled byte tokens from the model a run or checkpoint "
                                   "saved (a language model on text: Model.logits over the 256 byte tokens). The "
                                   "checkpoint's files are hashed (sha256) before use.",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--prompt", default="", metavar="TEXT", help="the text to continue (default: none, a newline)")
    p.add_argument("--tokens", type=int_in(1, fix="e.g. --tokens 200"), default=200, metavar="N",
                   help="how many tokens to sample (default 200)")
    p.add_argument("--temperature", type=float_in(0.0, fix="e.g. --temperature 0.8 (0: greedy)"), default=0.8,
                   metavar="T", help="softmax temperature (default 0.8; 0 takes the most likely token)")
    p.add_argument("--top-k", type=int_in(1, fix="e.g. --top-k 40"), default=None, metavar="K",
                   help="sample among the K most likely tokens only (default: all)")
    p.add_argument("--seed", type=int_in(0, 2**63 - 1, fix="e.g. --seed 0"), default=0, metavar="S",
                   help="sampling seed (default 0: the same seed gives the same text)")
    p.add_argument("--raw", action="store_true",
                   help="print the text as sampled (default: control characters other than newline and tab are "
                        "shown as \\xNN escapes, so a terminal never runs one)")
    p.set_defaults(run=cmd_generate)


def shown(text: str) -> str:
    """``text`` with its control characters, but newline and tab, as ``\\xNN`` escapes (``--raw`` skips this)."""
    return "".join(f"\\x{ord(c):02x}" if (ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f else c
                   for c in text)


def cmd_generate(args) -> int:
    with torch_threads(args.threads or RUN_THREADS):
        trained = load_trained(args.path, model=args.model, batch=1, where="generate")   # one prompt: one row
        if not samplable(trained.model):
            raise ModelError(message(
                f"generate: the model of {str(trained.path)!r} is not a text model.",
                rule="generate samples byte tokens from Model.logits [batch, seq, vocab >= 256], made from one "
                     "integer input of token ids",
                fix=f"sample a language model trained on text; this one's loss: meshdsl eval {args.path}"))
        t0 = time.perf_counter()
        text = generate(trained.model, trained.params, args.prompt, args.tokens, args.temperature, args.seed,
                        threads=args.threads or RUN_THREADS, top_k=args.top_k)
        took = time.perf_counter() - t0
    print(f"meshdsl generate: step {trained.step} of {trained.path}: {args.tokens} tokens in {took:.2f} s "
          f"({args.tokens / took:,.0f} tokens/s)", file=sys.stderr, flush=True)
    print(args.prompt + (text if args.raw else shown(text)), flush=True)
    return EXIT_OK


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="the held-out loss of a trained run or checkpoint",
                       description="Report the held-out loss (and the model's metrics) of the params a run or "
                                   "checkpoint saved, on the eval batches train reports its final eval loss on. "
                                   "The checkpoint's files are hashed (sha256) before use.",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--batches", type=int_in(1, fix="e.g. --batches 4"), default=None, metavar="N",
                   help="eval batches (default: the run's --eval-batches, 4)")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="a text file to evaluate on (its held-out split; default: the run's text)")
    p.add_argument("--config", default="", metavar="K=V,...",
                   help="Config fields over the run's, e.g. mode=eval: the model file's eval graph of the same "
                        "params (batch norm's running statistics)")
    p.set_defaults(run=cmd_eval)


def cmd_eval(args) -> int:
    from rich.table import Table

    from ..train.checkpoint import read_metadata
    from ..train.data import TokenData
    from ..train.feeder import reads_text

    with torch_threads(args.threads or RUN_THREADS):
        trained = load_trained(args.path, model=args.model, config=args.config, where="eval")
        saved = trained.data or {}
        batches = args.batches or int((read_metadata(trained.path).meta.get("run") or {}).get("eval_batches", 4))
        text = reads_text(trained.model)
        tokens = None
        if text:
            source = args.data or (None if saved.get("source", "stdlib") == "stdlib" else saved["source"])
            tokens = TokenData.load(source, seed=trained.seed)
        got = evaluate(trained.model, trained.params, batches=batches, data=tokens, seed=trained.seed)
    t = Table(title=f"meshdsl eval: step {trained.step} of {trained.path}", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    unit = " nats/token" if text else ""
    if text:
        same = saved.get("sha256") == tokens.fingerprint()["sha256"]
        what = "held-out text" + ("" if same else f" of {args.data or tokens.source}, not the run's")
    else:
        what = "the model's own feeds, seeds no step uses"
    t.add_row(f"eval loss ({what}; {got['batches']} batches)", f"{got['loss']:.4f}{unit}")
    for k in trained.model.metrics:
        t.add_row(f"eval {k}", f"{got[k]:.4f}")
    if text:
        entropy = tokens.unigram_entropy()
        gap = entropy - got["loss"]
        t.add_row("unigram (byte-frequency) entropy of the corpus", f"{entropy:.4f} nats/token")
        t.add_row("eval loss below the unigram entropy by", f"{gap:.4f} nats/token"
                  + (" (learned more than byte frequencies)" if gap > 0 else " (NOT below)"))
    make_console().print(t)
    return EXIT_OK


__all__ = ["add_eval", "add_generate", "cmd_eval", "cmd_generate"]
