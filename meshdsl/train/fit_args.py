"""``md.fit``'s arguments checked at the front door: each wrong one is one message naming the
argument, what was given and what it takes, before a spec is built or a rank starts."""
from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path

from ..errors import MeshDSLError, did_you_mean, message


class FitArgumentError(MeshDSLError):
    """An argument of ``md.fit`` of the wrong kind, or one fit does not take."""


#: Arguments of fit itself (not TrainSpec fields passed through ``**options``).
_OWN = ("model", "mesh", "layout", "steps", "data", "eval_data", "nproc", "device", "threads", "backend", "timeout",
        "job_timeout")
#: ``meshdsl train`` flags that md.fit spells another way: the keyword that does the same.
_CLI_WORDS = {"accum": "microbatches=k (the CLI's --accum k: k micro-batches accumulated per step)",
              **{k: f"optimizer_args={{'{k}': ...}} (the CLI's --{k.replace('_', '-')})"
                 for k in ("momentum", "betas", "weight_decay")}}
#: Fields that take more than their annotation says, each checked where it is read
#: (``stage_layers="auto"``, a remat policy, a compile backend's name, a Config's overrides).
_OWN_CHECKS = ("stage_layers", "remat", "compile", "resume_from", "config", "optimizer_args")
#: The kinds a TrainSpec field's annotation names, and what each accepts.
_KINDS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, (str, Path)),
    "dict": lambda v: isinstance(v, dict),
    "tuple": lambda v: isinstance(v, (tuple, list)),
    "None": lambda v: v is None,
}
_WORDS = {"int": "an int", "float": "a number", "bool": "True or False", "str": "a str", "dict": "a dict",
          "tuple": "a tuple", "None": "None"}
_EXAMPLES = {"int": 10, "float": 0.01, "bool": True, "str": "name", "dict": {}, "tuple": (1, 1)}
#: Fields with a range beyond their kind: (test, what is allowed).
_RANGES = {
    "steps": (lambda v: v >= 1, "an int >= 1"),
    "lr": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    "microbatches": (lambda v: v >= 1, "an int >= 1"),
    "eval_batches": (lambda v: v >= 1, "an int >= 1"),
    "save_every": (lambda v: v >= 0, "an int >= 0"),
    "eval_every": (lambda v: v >= 0, "an int >= 0"),
}


def _fail(what: str, rule: str, fix: str) -> FitArgumentError:
    return FitArgumentError(message(f"fit: {what}", rule=rule, fix=fix))


def _check_value(name: str, value, annotation: str) -> None:
    kinds = [k.strip() for k in annotation.split("|")]
    if not any(_KINDS.get(k, lambda v: True)(value) for k in kinds):
        words = " or ".join(_WORDS.get(k, k) for k in kinds)
        raise _fail(f"{name}={value!r} ({type(value).__name__}) is not {words}.",
                    rule=f"{name} is {words}", fix=f"pass {name} as {_WORDS.get(kinds[0], kinds[0])}, "
                                                   f"e.g. {name}={_EXAMPLES.get(kinds[0])!r}")
    test, allowed = _RANGES.get(name, (None, None))
    if test is not None and value is not None and not test(value):
        raise _fail(f"{name}={value!r} is out of range.", rule=f"{name} is {allowed}", fix=f"pass {name} as {allowed}")


def _config_example(config) -> str:
    """``config={...}`` for what was given: a ``"k=v,k=v"`` string (the CLI's --config) as a dict."""
    import ast
    items = [kv.split("=", 1) for kv in str(config).split(",") if "=" in kv] if isinstance(config, str) else []
    if not items:
        return "config={'batch': 8}"

    def literal(v: str):
        try:
            return ast.literal_eval(v.strip())
        except (ValueError, SyntaxError):
            return v.strip()
    return f"config={ {k.strip(): literal(v) for k, v in items} !r}"


def _check_config(options: dict, built: bool) -> None:
    """``config`` is a dict of Config overrides; it and ``tiny`` build a model given by name or
    path, so with an already built Model they would be ignored."""
    config = options.get("config")
    if config is not None and not isinstance(config, dict):
        raise _fail(f"config={config!r} ({type(config).__name__}) is not a dict.",
                    rule="config is a dict of the model's Config overrides, field -> value (the command line's "
                         "--config k=v,... as a dict)",
                    fix=f"pass {_config_example(config)}")
    given = [f"{k}={options[k]!r}" for k in ("config", "tiny") if options.get(k)]
    if built and given:
        raise _fail(f"{' and '.join(given)} with a built md.Model, whose Config is already chosen: "
                    f"{'they' if len(given) > 1 else 'it'} would be ignored.",
                    rule="config= and tiny= say how fit builds a model given by name or path; a built Model "
                         "keeps the Config it was built with",
                    fix="build it so: md.fit(md.load_model(PATH, tiny=True, batch=8), ...), or pass the path: "
                        "md.fit(PATH, tiny=True, config={'batch': 8}, ...)")


def _check_spawn_options(spawn: dict, spawned: bool) -> None:
    """``backend``, ``timeout`` and ``job_timeout`` (the CLI's ``--backend``, ``--timeout``,
    ``--job-timeout``) are settings of spawned processes: valid values, and only for such a run."""
    given = {k: v for k, v in spawn.items() if v is not None and not (k == "backend" and v == "auto")}
    for k in ("timeout", "job_timeout"):
        v = given.get(k)
        if v is not None and not (_KINDS["float"](v) and v > 0):
            raise _fail(f"{k}={v!r} is not a positive number of seconds.",
                        rule=f"{k} is the seconds a {'collective' if k == 'timeout' else 'whole job'} may take "
                             "before the run gives up",
                        fix=f"pass e.g. {k}={60 if k == 'timeout' else 900}")
    if "backend" in given and given["backend"] not in ("gloo", "nccl"):
        raise _fail(f"backend={given['backend']!r} is not a torch.distributed backend meshdsl runs on.",
                    rule="backend is 'auto' (nccl where CUDA is available, else gloo), 'gloo' or 'nccl'",
                    fix="pass backend='gloo', or leave it out")
    if given and not spawned:
        raise _fail(f"{', '.join(f'{k}=' for k in given)} set(s) spawned processes, and this run trains in this "
                    "process.",
                    rule="backend, timeout and job_timeout apply to a run on nproc > 1 processes (a model's name "
                         "or file path); a run in this process simulates every rank and has no collective to time",
                    fix="pass the model file's path with nproc=N, or drop them")


def check_fit_arguments(spec_cls, model, steps, data, options: dict, eval_data=None, mesh: str = "",
                        layout: str = "", nproc: int | None = None, spawn: dict | None = None) -> None:
    """Raise a FitArgumentError for the first argument of ``fit`` that cannot be right."""
    from .data import TokenData
    from .model import Model
    from .optimizers import OPTIMIZERS

    fields = {f.name: f.type for f in dataclasses.fields(spec_cls)}
    takes = sorted(set(fields) - {"model", "mesh", "layout", "steps"})
    for k in options:
        if k not in fields or k in _OWN:
            hint = f" md.fit spells it {_CLI_WORDS[k]}." if k in _CLI_WORDS else did_you_mean(k, takes + list(_OWN))
            raise _fail(f"it takes no argument '{k}'.{hint}",
                        rule=f"fit(model, mesh=, layout=, steps=, data=, eval_data=, nproc=, device=, threads=, backend=, "
                             f"timeout=, job_timeout=) "
                             f"and any TrainSpec field: {', '.join(takes)}",
                        fix=f"pass {_CLI_WORDS[k].split(' (')[0]}" if k in _CLI_WORDS else
                            "correct the name, or drop it")
    if not isinstance(model, (Model, str, Path)):
        raise _fail(f"model is {model!r} ({type(model).__name__}).",
                    rule="model is an md.Model (a model file's build(...) result), a shipped model's name or a "
                         "model file's path",
                    fix="pass e.g. md.load_model('transformer', tiny=True), 'transformer' or './my_model.py'")
    if isinstance(model, Model) and nproc not in (None, 1):
        raise _fail(f"nproc={nproc!r} with a built md.Model, which trains in this process (every rank simulated).",
                    rule="a built Model cannot be sent to other processes; a model's name or file path can, and "
                         "each process builds it",
                    fix="pass the model file's path (md.fit('path/to/my_model.py', tiny=..., config={...}, "
                        f"nproc={nproc!r}, ...)), or drop nproc to simulate the mesh here")
    _check_config(options, built=isinstance(model, Model))
    auto = [k for k, v in (("mesh", mesh), ("layout", layout)) if v == "auto"]
    if auto:
        raise _fail(f"{auto[0]}='auto' is the command line's search (meshdsl train --layout auto).",
                    rule="md.fit takes a mesh and a layout string; md.search_layouts ranks them from Python",
                    fix="r = md.search_layouts(model, model.train_step(0.01), NPROC, md.load_calibration()); "
                        "c = r.ranked[0].candidate; md.fit(model, mesh=c.mesh, layout=c.layout, "
                        "microbatches=c.microbatches, schedule=c.schedule, nproc=NPROC, ...) (a pipelined "
                        "candidate's micro-batches and schedule too)")
    if options.get("stage_layers") == "auto":   # balancing reads the cost model (search/), above this room
        raise _fail("stage_layers='auto' is the command line's balancing (meshdsl train --stage-layers auto).",
                    rule="md.fit takes one layer count per stage; md.balance_stages gives the balanced counts "
                         "from Python",
                    fix="pass stage_layers=md.balance_stages(model.train_step(), mesh, layout, microbatches=M, "
                        "schedule=S), with the mesh, layout, microbatches and schedule of the run")
    if steps is not None:
        _check_value("steps", steps, "int")
    _check_spawn_options(spawn or {}, spawned=not isinstance(model, Model) and (nproc or 1) > 1)
    if data is not None and not isinstance(data, (str, Path, TokenData)) and not callable(data):
        raise _fail(f"data is {data!r} ({type(data).__name__}).",
                    rule="data is None, a text file's path, an md.TokenData, or a function step -> {input name: "
                         "full tensor}",
                    fix="pass e.g. data=lambda step: {'x': torch.randn(8, 4)}")
    if eval_data is not None and (isinstance(data, (str, Path, TokenData)) or not callable(data)):
        raise _fail("eval_data is given without data= a function, so it would not be read.",
                    rule="eval_data (a list of full feeds) is the eval of a run on data=a function step -> feeds; "
                         "a run on text evaluates on held-out text, a model's own batches or feeds on "
                         "eval_batches= seeds no step uses",
                    fix="pass data=lambda step: ... with it, or drop eval_data (eval_batches=N sets how many of "
                        "the model's own batches the eval reads)")
    for k, v in options.items():
        if k not in _OWN_CHECKS:
            _check_value(k, v, fields[k] if isinstance(fields[k], str) else "")
    opt = options.get("optimizer")
    if opt is not None and opt not in OPTIMIZERS:
        raise _fail(f"optimizer={opt!r} is not one meshdsl has.{did_you_mean(str(opt), OPTIMIZERS)}",
                    rule=f"optimizer is one of {', '.join(OPTIMIZERS)} (with lr=, optimizer_args=)",
                    fix="pass e.g. optimizer='adamw', lr=3e-3")
