"""``gradpress demo``: train one model on real data with several gradient-communication methods.

The parent process starts ``--workers`` local processes (gloo on CPU with one thread each; NCCL when
there is one GPU per worker), forked from a server that imported torch once where the platform has one
(``supervisor.context``), spawned otherwise. Every worker runs
:func:`gradpress.tools.workloads.training.train` once per method, with the same seed, weights and data
order, and sends progress, results or its traceback back through a pipe of its own. The parent shows
progress bars, then prints a table (test metric, loss, bytes per step, compression, time) and writes
``demo.json``, ``demo.md`` and ``demo.png`` to ``--out``. It checks that every worker ended with
identical parameters and that PowerSGD's counted bytes match the plan.

If a worker fails, the parent stops the others, prints the traceback of the worker that caused it and
exits 1; if no worker reports progress (an optimizer step, an evaluation, a result) for ``--timeout``
seconds, it stops them too, however long the run has been going. Stopped in either way or by Ctrl-C,
it still reports and writes the methods that every worker had finished, with the method it stopped in
and why.

On a task with a measured PowerSGD recipe (``charlm``, ``charlm-wide``, ``gpt``, ``gpt-wide``:
:class:`~gradpress.tools.workloads.Recipe`) the demo takes its learning rate (for every method), its rank and
its PowerSGD options (an fp16 wire) for whatever ``--lr``, ``--rank`` and ``--powersgd-options`` leave
out (:func:`resolve`); the report says so. Other tasks keep their own defaults. With ``--optimizer adamw``
the learning rate comes from the quality map (:mod:`gradpress.tools.quality_map`) where the task was
measured with AdamW, and the PowerSGD options from its AdamW recipe (an fp16 wire and a half-precision
warm-up, :data:`~gradpress.tools.quality_map.ADAMW_OPTIONS`).

The method ``recommended`` is the configuration the quality map advises for this task, optimizer and
global batch (``--workers`` x ``--batch-size`` sequences): PowerSGD at the task's rank with an fp16 wire
where it was measured within 1.5% of allreduce (or beyond the largest measured batch, with no failure
measured), the fp16 hook where PowerSGD was measured to fall behind. ``demo.json`` says what it resolved
to and why, under ``"recommended"`` (with a ``"warning"`` where ``--start-iter`` starts PowerSGD before
AdamW's learning-rate warm-up ends, which the measured rows did not).

This module holds the arguments, the progress bars and the command; :mod:`.supervisor` the worker
processes, :mod:`.report` the summary and tables, :mod:`.plot` the figure.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ....hooks import PowerSGDState
from ...check.advice import model_width
from ...processes import usable_cores
from ...quality_map import advise, early_start_warning, recipe_options
from ...workloads.config import ADAMW_LR, OPTIMIZERS, DemoConfig, default_start_iter
from ...workloads.methods import METHOD_KINDS, METHOD_REGISTRY, RECOMMENDED, Method, parse_methods
from ...workloads.tasks import SEQUENCE, TASKS, WIDTH_FAMILY, Task, get_task
from ..args import int_at_least, int_list, positive_float
from .plot import plot
from .report import format_markdown, format_report, plural, summarize
from .supervisor import (DEFAULT_COLLECTIVE_TIMEOUT, DEFAULT_TIMEOUT, Interrupted, StoppedEarly, WorkerFailure,
                         run_workers)

__all__ = ["Interrupted", "Resolved", "StoppedEarly", "WorkerFailure", "format_report", "parse_bandwidth", "register",
           "resolve", "run", "run_workers", "summarize"]


_DEFAULTS = DemoConfig()
DEFAULT_METHODS = "allreduce,fp16,powersgd,multi,localsgd,diloco"
DEFAULT_RANKS = (1, 2)


# --- argument parsing ---------------------------------------------------------------------------------

def _beta(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BANDWIDTH = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtT]?)(bit|bits|bps|bit/s|B/s|Bps|byte/s|bytes/s)\s*$")


def parse_bandwidth(text: str) -> float:
    """Link rate in **bytes** per second from ``"1gbit"``, ``"100mbit"``, ``"10Gbit/s"``, ``"125MB/s"``.

    Decimal prefixes (k = 1000). ``bit``/``bps``/``bit/s`` are bits, ``B/s``/``Bps``/``byte/s`` bytes.

    >>> parse_bandwidth("1gbit")
    125000000.0
    """
    match = _BANDWIDTH.match(text)
    if not match or not float(match.group(1)) > 0:
        raise argparse.ArgumentTypeError(f"must be a positive rate such as 1gbit, 100mbit, 10Gbit/s or "
                                         f"125MB/s, got {text!r}")
    value = float(match.group(1)) * _PREFIX[match.group(2).lower()]
    unit = match.group(3)
    return value if unit.startswith(("B", "byte")) else value / 8


def parse_powersgd_options(text: str) -> dict[str, Any]:
    """``--powersgd-options``: a JSON object of further ``PowerSGDState`` keyword arguments, checked by
    building a state with them (so a typo fails here, not in the workers).

    >>> parse_powersgd_options('{"bytes_per_weight": 2}')
    {'bytes_per_weight': 2}
    """
    try:
        options = json.loads(text)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of PowerSGDState arguments such as "
                                         f"'{{\"bytes_per_weight\": 4}}', got {text!r}")
    try:
        PowerSGDState(None, **{"start_powerSGD_iter": 2, **options})
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"not valid PowerSGDState arguments ({exc}), got {text!r}") from None
    return options


def _listing(items: Sequence[str]) -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _recipes_help(value: str) -> str:
    """``"charlm 2, charlm-wide 1, gpt 0.1 and gpt-wide 0.05"``: each measured recipe's ``lr`` or ``rank``;
    for ``"powersgd_options"``, ``'{"bytes_per_weight": 2}' on charlm, charlm-wide, gpt and gpt-wide``."""
    recipes = [(t.name, t.recipe) for t in TASKS.values() if t.recipe is not None]
    if value != "powersgd_options":
        return _listing([f"{name} {getattr(recipe, value):g}" for name, recipe in recipes])
    groups: dict[str, list[str]] = {}
    for name, recipe in recipes:
        groups.setdefault(json.dumps(dict(recipe.powersgd_options)), []).append(name)
    return "; ".join(f"'{options}' on {_listing(names)}" for options, names in groups.items())


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to ``subparsers`` (an ``add_subparsers()`` result)."""
    # argparse %-formats help strings: a literal "%" in a description must be doubled.
    methods_help = "; ".join(f"{k}: {v}" for k, v in METHOD_KINDS.items()).replace("%", "%%")
    tasks_help = "; ".join([f"{t.name}: {t.description}" for t in TASKS.values()]
                           + [f"{WIDTH_FAMILY}: gpt-stdlib's GPT at another width"]).replace("%", "%%")
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="train a model on real data with several methods and compare accuracy, bytes and time",
        description="Train one model on real data that ships with scikit-learn or Python (nothing is "
                    "downloaded) with DDP on local worker processes, once per communication method, same "
                    "seed and data order; print accuracy, loss, bytes sent per step and time side by side, "
                    "and write demo.json, demo.md and demo.png to --out.")
    parser.add_argument("--workers", type=int_at_least(1), default=4, metavar="N",
                        help="number of local worker processes (integer >= 1; default: %(default)s)")
    parser.add_argument("--task", default=_DEFAULTS.task, metavar="NAME",
                        help=f"what to train ({tasks_help}; default: %(default)s)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, metavar="LIST",
                        help=f"comma-separated methods to compare ({methods_help}; {RECOMMENDED}: what the "
                             "quality map advises for this task, optimizer and global batch, docs/tuning.md). "
                             "powersgd and multi run once per --rank, or at one rank as powersgd:R "
                             "(default: %(default)s)")
    parser.add_argument("--rank", type=int_list(1), default=None, metavar="R[,R...]",
                        help=f"PowerSGD approximation rank(s) for the methods given without one (powersgd, "
                             f"multi) (integers >= 1; default: the task's measured recipe, "
                             f"{_recipes_help('rank')}; {','.join(map(str, DEFAULT_RANKS))} on the other tasks)")
    parser.add_argument("--lr", type=positive_float, default=None, metavar="LR",
                        help="learning rate of every method (AdamW: its peak) (default: the task's measured recipe, "
                             f"{_recipes_help('lr')}; the task's own on the others: "
                             f"{', '.join(f'{t.name} {t.lr:g}' for t in TASKS.values() if t.recipe is None)})")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=_DEFAULTS.optimizer,
                        help="the inner optimizer: sgd (momentum 0.9, constant lr) or adamw as nanoGPT trains "
                             "(betas 0.9/0.95, weight decay 0.1 on matrices, linear warm-up over a tenth of the "
                             f"run, then cosine decay to 10%%; lr default: the quality map's where the task was "
                             f"measured with adamw, else {ADAMW_LR:g}) (default: %(default)s)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=None, metavar="N",
                        help="samples (sequences on the language tasks) per worker per step (integer >= 1; "
                             "default: the task's)")
    parser.add_argument("--powersgd-options", type=parse_powersgd_options, default=None, metavar="JSON",
                        help="further PowerSGDState arguments for the PowerSGD methods, as a JSON object (e.g. "
                             "'{\"bytes_per_weight\": 4}' for an fp32 wire; default: the task's measured recipe, "
                             f"{_recipes_help('powersgd_options')}; none on the others)")
    parser.add_argument("--steps", type=int_at_least(1), default=_DEFAULTS.steps, metavar="N",
                        help="training steps per method (integer >= 1; default: %(default)s)")
    parser.add_argument("--start-iter", type=int_at_least(2), default=None, metavar="N",
                        help="plain-allreduce steps before PowerSGD, local SGD and DiLoCo start (integer >= 2, "
                             "less than --steps; default: a tenth of --steps, at least 2: "
                             f"{_DEFAULTS.start_iter} for {_DEFAULTS.steps} steps)")
    parser.add_argument("--seed", type=int_at_least(0), default=_DEFAULTS.seed, metavar="S",
                        help="seed for the split, initialisation and batch order (integer >= 0; "
                             "default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("gradpress-demo"), metavar="DIR",
                        help="folder for demo.json, demo.md and demo.png (created; default: %(default)s)")
    parser.add_argument("--bandwidth", type=parse_bandwidth, default=None, metavar="RATE",
                        help="also report each method's MODELLED time on a link of this rate, e.g. 1gbit, "
                             "100mbit, 10Gbit/s, 125MB/s: measured time + each worker's link bytes / rate "
                             "(ring-equivalent: 2(n-1)/n of an allreduced payload)")
    parser.add_argument("--schedule", choices=("auto", "all-gather", "two-shot"), default=_DEFAULTS.schedule,
                        help="how the compressed DiLoCo methods' payloads travel (the averagers' schedule=): auto "
                             "(two-shot for int8/int4 from 3 workers), all-gather or two-shot (default: %(default)s)")
    parser.add_argument("--warm-up-beta", type=_beta, default=None, metavar="BETA",
                        help="PowerSGDState(warm_up_beta_factor=BETA) for the PowerSGD methods (in (0, 1])")
    parser.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help="stall timeout: stop the workers when none has reported progress (a training step, "
                             "an evaluation, a result) for this many seconds, however long the whole run takes "
                             "(starting the workers, until their first report, may take --collective-timeout "
                             "more); the methods every worker finished are still reported and written (a number "
                             "> 0; default: %(default)s)")
    parser.add_argument("--collective-timeout", type=positive_float, default=DEFAULT_COLLECTIVE_TIMEOUT,
                        metavar="SECONDS", help="a worker's collective waits this long for a dead or stuck peer, "
                        "then fails naming the collective (default: %(default)s; at most --timeout)")
    parser.set_defaults(func=run)
    return parser


class Progress:
    """Progress bars on stderr: one line redrawn in place on a terminal, a line per milestone otherwise."""

    def __init__(self, stream: Any = None, width: int = 24) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.started = time.perf_counter()
        self.method_started: dict[str, float] = {}
        self.milestones: dict[str, int] = {}

    def __call__(self, label: str, step: int, steps: int, loss: float) -> None:
        now = time.perf_counter()
        began = self.method_started.setdefault(label, now)
        filled = round(self.width * step / steps)
        line = (f"  {label:<14} [{'#' * filled}{'.' * (self.width - filled)}] {step:>{len(str(steps))}}/{steps}"
                f"  loss {loss:.4f}  {now - began:5.1f} s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step == steps else ""))
        else:
            milestone = 2 * step // steps  # halfway and done
            if milestone > self.milestones.get(label, 0):
                self.milestones[label] = milestone
                self.stream.write(line + "\n")
        self.stream.flush()


# --- the command --------------------------------------------------------------------------------------

def _fail(message: str, code: int = 2) -> int:
    """Print ``gradpress demo: error: message`` on stderr; return ``code``."""
    print(f"gradpress demo: error: {message}", file=sys.stderr)
    return code


def write_outputs(summary: dict[str, Any], out: Path) -> list[Path]:
    """Write ``demo.json``, ``demo.png`` (if matplotlib is installed) and ``demo.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "demo.json"]
    written[0].write_text(json.dumps(summary, indent=2) + "\n")
    has_plot = plot(summary, out / "demo.png")
    if has_plot:
        written.append(out / "demo.png")
    (out / "demo.md").write_text(format_markdown(summary, "demo.png" if has_plot else None))
    written.append(out / "demo.md")
    return written


def _warn(message: str) -> None:
    print(f"gradpress demo: warning: {message}", file=sys.stderr)


@dataclass(frozen=True)
class Resolved:
    """What ``gradpress demo``'s arguments come to: the methods, the learning rate (``None``: the task's),
    the PowerSGD options, ``recipe``: what of the task's measured recipe filled in what the user left
    out, in words for the report (``None``: nothing), and ``recommended``: what the ``recommended``
    method resolved to and why (``None``: not asked for)."""

    methods: list[Method]
    lr: float | None
    powersgd_options: dict[str, Any] | None
    recipe: str | None
    recommended: dict[str, Any] | None = None
    names: tuple[str, ...] = ()  # --methods, with recommended replaced by what it resolved to


def _task_width(task: Task) -> int:
    """The task's model width as ``gradpress check`` reads it (the median ``min(n, m)`` of its matrices)."""
    return model_width([tuple(p.shape) for p in task.build().parameters()])


def recommendation(args: argparse.Namespace) -> dict[str, Any]:
    """The quality map's advice (:func:`gradpress.tools.quality_map.advise`) for the demo's task, optimizer
    and global batch, with the setting it was read for."""
    task = get_task(args.task)
    per_worker = args.batch_size or task.batch_size
    width = _task_width(task)
    text = task.metric == "perplexity"  # sequences of SEQUENCE characters; elsewhere a sample is the unit
    tokens = args.workers * per_worker * (SEQUENCE if text else 1)
    optimizer = getattr(args, "optimizer", "sgd")
    advice = advise(width, optimizer, tokens, task=task.name)
    return {**advice.to_dict(), "task": task.name, "optimizer": optimizer, "width": width,
            "global_batch": args.workers * per_worker, "tokens_per_step": tokens}


def _describe_options(options: Mapping[str, Any]) -> str:
    """``{"bytes_per_weight": 2}`` -> ``"an fp16 wire"``, ``"warm_up_bytes_per_weight": 2`` -> ``"a
    half-precision warm-up"``; other options as ``key=value``."""
    words = {"bytes_per_weight": {2: "an fp16 wire", 4: "an fp32 wire", 8: "an fp64 wire"},
             "warm_up_bytes_per_weight": {2: "a half-precision warm-up"}}
    return ", ".join(words.get(k, {}).get(v, f"{k}={v!r}") for k, v in options.items())


def resolve(args: argparse.Namespace) -> Resolved:
    """The methods and settings of a ``gradpress demo`` command line. On a task with a measured recipe
    (:class:`~gradpress.tools.workloads.Recipe`), what ``--lr``, ``--rank`` and ``--powersgd-options`` leave out
    comes from it: its lr for every method (the allreduce baseline is the tuned one too), its rank for the
    PowerSGD methods given without ``:R``, its options for the PowerSGD methods; elsewhere the task's lr
    and :data:`DEFAULT_RANKS`. With AdamW the lr comes from the quality map where it has the task, and the
    PowerSGD options from the map's AdamW recipe (:func:`~gradpress.tools.quality_map.recipe_options`). The
    method ``recommended`` is replaced by what :func:`recommendation` advises (``Resolved.recommended``
    says what and why). ``ValueError`` for an unknown task or a bad ``--methods``.
    """
    recipe = get_task(args.task).recipe
    rank = args.rank
    ranks = rank if rank is not None else [recipe.rank] if recipe is not None else DEFAULT_RANKS
    names = [t.strip() for t in args.methods.split(",")] if isinstance(args.methods, str) else list(args.methods)
    recommended = recommendation(args) if RECOMMENDED in names else None
    if recommended is not None:
        names = [recommended["method"] if n == RECOMMENDED else n for n in names]
    try:
        methods = parse_methods(names, ranks)
    except ValueError as exc:
        raise ValueError(f"{exc}; or {RECOMMENDED} (the quality map's advice for this task, optimizer and batch)") \
            from None
    powersgd = any(METHOD_REGISTRY[m.kind].argument == "rank" for m in methods)
    lr, options = args.lr, args.powersgd_options
    applied: list[str] = []
    optimizer = getattr(args, "optimizer", "sgd")
    if recipe is not None and lr is None and optimizer == "sgd":  # measured with SGD
        lr = recipe.lr
        applied.append(f"lr {lr:g} for every method")
    if lr is None and optimizer != "sgd":
        lr = (recommended or recommendation(args))["lr"]  # the tuned allreduce's, where the map has the task
        if lr is not None:
            applied.append(f"the quality map's {optimizer} lr {lr:g} for every method")
    details: list[str] = []
    if recipe is not None and rank is None and parse_methods(names, []) != methods:
        details.append(f"rank {recipe.rank}")  # some PowerSGD method took the default rank
    if options is None and powersgd:
        # The tasks' recipes were measured with SGD; with AdamW the map's recipe adds a half-precision warm-up.
        if optimizer != "sgd" and (recipe is not None or recommended is not None):
            options = recipe_options(optimizer)
        elif recipe is not None:
            options = dict(recipe.powersgd_options)
        elif recommended is not None:
            options = dict(recommended["powersgd_options"])
        if options is not None:
            details.append(f"with {_describe_options(options)}")
    if details:
        applied.append(" ".join(["PowerSGD", *details]))
    note = f"the measured recipe (docs/tuning.md): {', '.join(applied)}" if applied else None
    return Resolved(methods, lr, options, note, recommended, tuple(names))


def _start_iter(args: argparse.Namespace, methods: Sequence[Method]) -> int | str:
    """The warm-up length, or an error message when the user's own --start-iter contradicts --steps."""
    uses_warm_up = any(METHOD_REGISTRY[m.kind].warms_up for m in methods)
    if args.start_iter is None:
        start_iter = default_start_iter(args.steps)
        if start_iter >= args.steps and uses_warm_up:
            _warn(f"--steps {args.steps} is all warm-up ({start_iter} plain-allreduce steps come first): "
                  "PowerSGD, local SGD and DiLoCo will not start; use --steps 3 or more to see them")
        return start_iter
    if args.start_iter >= args.steps and uses_warm_up:
        return (f"--start-iter {args.start_iter} leaves no step for PowerSGD, local SGD or DiLoCo in "
                f"--steps {args.steps}: use --start-iter {args.steps - 1} or less (>= 2), or --steps "
                f"{args.start_iter + 1} or more, or leave --start-iter out (default: a tenth of --steps)")
    return int(args.start_iter)


#: How the command says that a run was stopped early, by :attr:`StoppedEarly.kind`.
_STOPPED_WORDS = {"interrupted": "interrupted", "failed": "a worker failed", "stalled": "the run stalled"}


def _stopped_code(exc: StoppedEarly) -> int:
    """The exit status of a run stopped early: 130 for Ctrl-C, 1 for a failure or a stall."""
    return 130 if exc.kind == "interrupted" else 1


def run(args: argparse.Namespace) -> int:
    """``gradpress demo``: 0 on success, 1 if a worker or a check failed or the run stalled, 2 for bad
    arguments, 130 when interrupted. A run stopped early (crash, stall, Ctrl-C) still reports and writes
    the methods that every worker finished, with ``"stopped"`` in ``demo.json`` saying how, why and in
    which method."""
    try:
        task = get_task(args.task)
        resolved = resolve(args)
    except ValueError as exc:
        return _fail(str(exc))
    methods = resolved.methods
    if resolved.recommended is not None:
        rec = resolved.recommended
        print(f"gradpress demo: recommended = {rec['method']} ({rec['status_text']}: {rec['reason']})", file=sys.stderr)
    start_iter = _start_iter(args, methods)
    if isinstance(start_iter, str):
        return _fail(start_iter)
    out: Path = args.out
    if out.exists() and not out.is_dir():
        return _fail(f"--out: {str(out)!r} exists and is not a folder")
    if args.rank is not None and parse_methods(list(resolved.names), []) == methods:
        _warn(f"--rank {','.join(map(str, args.rank))} is not used: no method in --methods takes it (only "
              "powersgd and multi without ':R' run once per --rank)")
    cores = usable_cores()
    if args.workers > 2 * cores:
        _warn(f"{args.workers} workers on {plural(cores, 'core')}: each worker gets a small share of a core, so "
              f"the run is slow and its times mostly measure waiting; --workers {cores} to {2 * cores} fits "
              "this machine")
    config = DemoConfig(task=task.name, steps=args.steps, start_iter=start_iter, seed=args.seed, lr=resolved.lr,
                        evals=min(15, args.steps), warm_up_beta=args.warm_up_beta,
                        powersgd_options=resolved.powersgd_options, optimizer=args.optimizer,
                        batch_size=args.batch_size, schedule=args.schedule)
    if resolved.recommended is not None and resolved.recommended["start"] is not None:
        warning = early_start_warning(config.start_iter, config.lr_warmup_steps(), config.optimizer)
        if warning is not None:
            resolved.recommended["warning"] = warning
            _warn(f"recommended: {warning}; leave --start-iter out (default: a tenth of --steps, where AdamW's "
                  "warm-up ends)")
    argv = getattr(args, "argv", None)
    command = " ".join(["gradpress", "demo", *map(shlex.quote, argv or [])])
    print(f"gradpress demo: {task.name} ({task.description}), {plural(args.workers, 'worker')}, "
          f"{plural(len(methods), 'method')} x {config.steps} steps: {', '.join(m.label for m in methods)}",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    stopped: StoppedEarly | None = None
    try:
        results = run_workers(config, args.workers, timeout=args.timeout, methods=methods, on_progress=Progress(),
                              collective_timeout=args.collective_timeout)
    except (WorkerFailure, Interrupted) as exc:
        # One path for a crash, a stall and Ctrl-C: what every worker finished is still reported.
        if isinstance(exc, WorkerFailure):
            _fail(str(exc), code=1)
        what = _STOPPED_WORDS[exc.kind]
        if not exc.completed:
            print(f"\ngradpress demo: {what} before any method finished; nothing written", file=sys.stderr)
            return _stopped_code(exc)
        results, stopped = exc.completed, exc
        print(f"\ngradpress demo: {what}; reporting the {plural(len(results), 'method')} that finished",
              file=sys.stderr)
    wall_time = time.perf_counter() - start

    summary = summarize(results, config, args.workers, wall_time, args.bandwidth, command, resolved.recipe)
    if resolved.recommended is not None:
        summary["recommended"] = resolved.recommended
    if stopped is not None:
        summary["stopped"] = {"kind": stopped.kind, "reason": stopped.reason, "method": stopped.stopped,
                              "methods": [m.label for m in methods]}
    print(format_report(summary))
    print(f"total wall time: {wall_time:.1f} s (including starting {plural(args.workers, 'worker process')})")
    try:
        written = write_outputs(summary, out)
    except OSError as exc:
        return _fail(f"--out: could not write to {str(out)!r}: {exc}", code=1)
    if not any(p.name == "demo.png" for p in written):
        print("no demo.png: matplotlib is not installed (pip install 'gradpress[demo]')", file=sys.stderr)
    print(f"wrote {', '.join(p.name for p in written)} to {out}/")
    if stopped is not None:
        return _stopped_code(stopped)
    if not summary["ranks_agree"]:
        return _fail("workers ended with different parameters", code=1)
    if not summary["bytes_check_ok"]:
        return _fail("PowerSGD's counted bytes do not match the plan", code=1)
    return 0
