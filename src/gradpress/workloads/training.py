"""One data-parallel training run of a demo task with one communication method, and its figures.

Used by ``gradpress demo`` (which spawns the workers) and by ``examples/train.py`` (under ``torchrun``):
the same code path. Every run with the same :class:`DemoConfig` sees the same data in the same order
and starts from the same weights, so methods differ only in how gradients are communicated.

>>> # inside each worker, after dist.init_process_group(...)                     # doctest: +SKIP
>>> result = train(rank, world_size, parse_methods("powersgd", [2])[0], DemoConfig(steps=100))
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .. import comm
from ..averaging import (ModelAverager, OuterOptimizerAverager, PeriodicModelAverager, PostLocalSGDOptimizer,
                         average_tensors_, tensors_to_average)
from ..hooks import (PostLocalSGDState, PowerSGDState, allreduce_hook, bf16_compress_hook, fp16_compress_hook,
                     post_localSGD_hook, powerSGD_hook)
from ..powersgd import Plan, make_plan
from ..streaming import QuantizeInt4, QuantizeInt8, StreamingDiLoCoAverager, TopK, split_by_size
from . import checkpoints
from .tasks import get_task

__all__ = ["DemoConfig", "METHOD_KINDS", "Method", "ProgressFn", "bytes_schedule", "default_start_iter",
           "param_checksum", "parse_methods", "train"]

#: Method kinds: what each sends per step (``powersgd`` and ``multi`` take a rank).
METHOD_KINDS: dict[str, str] = {
    "allreduce": "plain allreduce of fp32 gradients (the baseline)",
    "fp16": "gradients cast to fp16 for the allreduce (fp16_compress_hook)",
    "bf16": "gradients cast to bf16 for the allreduce (bf16_compress_hook)",
    "powersgd": "PowerSGD DDP hook, rank r (classic: P and Q every step)",
    "multi": "multi-iteration PowerSGD, one one-sided iteration per step (half of powersgd's floats)",
    "localsgd": "post-local SGD: synchronous until --start-iter, then local steps and model averaging "
                "every H steps (localsgd:H, default 8)",
    "diloco": "like localsgd, but every H steps the averaged change goes through an outer Nesterov "
              "optimizer (DiLoCo; outer lr 0.7, momentum 0.5)",
    "streaming": "streaming DiLoCo: diloco with the model in 4 fragments synchronised in turn (one every H/4 "
                 "steps, a quarter of the bytes each time), each sync overlapped with the next inner step",
    "diloco-int8": "diloco with the outer gradient quantized to int8 (per-chunk scales, error feedback)",
    "diloco-int4": "diloco with the outer gradient quantized to int4 (per-chunk scales, error feedback)",
    "sparseloco": "diloco with a sparse outer gradient: top 3% of each chunk, 2-bit values, error feedback "
                  "in place of the outer momentum (SparseLoCo)",
}
_RANKED = ("powersgd", "multi")
_PERIODIC = ("localsgd", "diloco", "streaming", "diloco-int8", "diloco-int4", "sparseloco")
#: Fragments, overlap (inner steps) and local share of ``streaming``: (F, tau, alpha), F and tau capped by H.
STREAMING_FRAGMENTS, STREAMING_DELAY, STREAMING_ALPHA = 4, 1, 0.5
#: ``sparseloco``'s outer step: top-k density, error-feedback decay (SparseLoCo's beta) and outer lr, with
#: no outer momentum. The best of a sweep on charlm (4 workers, 300 steps, H=8; BENCHMARKS.md): density
#: 1% -> 3% and beta 0.9/0.95 -> 1 each lowered the perplexity.
SPARSELOCO = {"density": 0.03, "error_decay": 1.0, "outer_lr": 1.0}
#: Averaging period of ``localsgd`` and ``diloco`` when none is given.
DEFAULT_PERIOD = 8

#: How an injected failure (``DemoConfig.fail_at_step``) fails.
FAIL_KINDS = ("raise", "sigkill", "hang")

#: ``on_progress(label, step, steps, loss)``: called on rank 0 at every logged step.
ProgressFn = Callable[[str, int, int, float], None]


@dataclass(frozen=True)
class Method:
    """A communication method: ``kind`` (a key of :data:`METHOD_KINDS`), PowerSGD's rank or local
    SGD's averaging period."""

    kind: str
    rank: int | None = None
    period: int | None = None

    @property
    def label(self) -> str:
        """``"allreduce"``, ``"powersgd r=2"``, ``"multi r=2"``, ``"localsgd H=8"``."""
        if self.period is not None:
            return f"{self.kind} H={self.period}"
        return self.kind if self.rank is None else f"{self.kind} r={self.rank}"

    @property
    def spec(self) -> str:
        """The ``--methods`` spelling that selects exactly this method (``"powersgd:2"``)."""
        number = self.rank if self.period is None else self.period
        return self.kind if number is None else f"{self.kind}:{number}"


def parse_methods(text: str | Sequence[str], ranks: Sequence[int]) -> list[Method]:
    """``"allreduce,powersgd,multi:4,localsgd:16"`` -> methods; a PowerSGD kind without ``:R`` runs once
    per rank; ``localsgd``/``diloco`` take an averaging period ``:H`` (default :data:`DEFAULT_PERIOD`).

    Raises ``ValueError`` (naming the valid methods) for an unknown name or a bad rank.
    """
    names = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if not names:
        raise ValueError(f"--methods is empty; valid methods: {', '.join(METHOD_KINDS)}")
    out: list[Method] = []
    for name in names:
        kind, _, rank_text = name.partition(":")
        if kind not in METHOD_KINDS:
            raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(METHOD_KINDS)} "
                             "(powersgd and multi also as powersgd:R; "
                             f"{', '.join(_PERIODIC)} as localsgd:H)")
        if kind in _PERIODIC:
            if rank_text and (not rank_text.isdigit() or int(rank_text) < 1):
                raise ValueError(f"method {name!r}: the period after ':' must be an integer >= 1")
            candidates = [Method(kind, period=int(rank_text) if rank_text else DEFAULT_PERIOD)]
        elif kind not in _RANKED:
            if rank_text:
                raise ValueError(f"method {kind!r} takes no rank (got {name!r})")
            candidates = [Method(kind)]
        elif rank_text:
            if not rank_text.isdigit() or int(rank_text) < 1:
                raise ValueError(f"method {name!r}: the rank after ':' must be an integer >= 1")
            candidates = [Method(kind, int(rank_text))]
        else:
            candidates = [Method(kind, r) for r in ranks]
        out += [m for m in candidates if m not in out]
    return out


def default_start_iter(steps: int) -> int:
    """Plain-allreduce steps before compression or local steps start, when the user gives none: a tenth
    of the run (30 of the default 300 steps), at least 2 (DDP rebuilds its buckets after the first step,
    and ``PowerSGDState`` needs ``start_powerSGD_iter >= 2``).

    >>> default_start_iter(300), default_start_iter(10)
    (30, 2)
    """
    return max(2, round(steps / 10))


@dataclass(frozen=True)
class DemoConfig:
    """Everything that defines a run (identical on every worker).

    ``batch_size`` (per worker) and ``lr`` default to the task's. ``start_iter``: plain-allreduce steps
    before PowerSGD starts. ``evals``: how many times the test metric is measured along the run.
    ``warm_up_beta``: ``PowerSGDState(warm_up_beta_factor=...)`` for the PowerSGD methods.
    ``powersgd_options``: further ``PowerSGDState`` keyword arguments for the PowerSGD methods (e.g.
    ``{"num_iters_per_step": 2}``), over the ones the method and this configuration set.
    ``outer_lr``, ``outer_momentum``: ``diloco``'s outer Nesterov SGD (momentum 0.5, not DiLoCo's 0.9,
    which is tuned for periods of hundreds of AdamW steps and diverges on this short-period demo).
    ``fail_at_step``/``fail_rank``/``fail_kind``: make that rank fail at that step, to exercise failure
    handling: ``"raise"`` an exception, ``"sigkill"`` itself (a lost worker), or ``"hang"`` (sleep inside
    the step until killed: a stuck worker); only in a run that did not resume from a checkpoint, so a
    restarted run gets past it. Checkpoints ignore these three fields.
    """

    task: str = "digits"
    steps: int = 300
    start_iter: int = 30
    seed: int = 0
    batch_size: int | None = None
    lr: float | None = None
    momentum: float = 0.9
    min_compression_rate: float = 2.0
    evals: int = 15
    warm_up_beta: float | None = None
    powersgd_options: dict[str, Any] | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.5
    fail_at_step: int | None = None
    fail_rank: int = 1
    fail_kind: str = "raise"

    def __post_init__(self) -> None:
        if self.fail_kind not in FAIL_KINDS:
            raise ValueError(f"fail_kind must be one of {', '.join(FAIL_KINDS)}, got {self.fail_kind!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serialisable, picklable)."""
        return asdict(self)

    def resolved_batch_size(self) -> int:
        return self.batch_size if self.batch_size is not None else get_task(self.task).batch_size

    def resolved_lr(self) -> float:
        return self.lr if self.lr is not None else get_task(self.task).lr


def param_checksum(model: nn.Module) -> tuple[float, str]:
    """``(sum of all parameters in float64, sha256 of their bytes)``: equal iff workers hold equal weights."""
    digest = hashlib.sha256()
    total = 0.0
    for param in model.parameters():
        data = param.detach().cpu().contiguous()
        total += float(data.double().sum())
        digest.update(ctypes.string_at(data.data_ptr(), data.numel() * data.element_size()))  # no numpy
    return total, digest.hexdigest()


def bytes_schedule(method: Method, plan: Plan, config: DemoConfig) -> list[int]:
    """Payload bytes one worker hands to its collectives at each step (1-based index - 1), from the plan.
    (With one worker the collectives have no peer: nothing is sent, whatever the payload.)

    fp32 gradients: allreduce 4 bytes per element, fp16/bf16 2; PowerSGD sends every element (fp32)
    for ``start_iter`` steps, then ``(n + m) r`` per compressed matrix (classic), or one factor per step
    for ``multi`` (alternately ``n r`` and ``m r``). ``localsgd``/``diloco`` send every element on the
    synchronous steps and on each averaging step (every ``period`` steps from ``start_iter``), nothing
    on the others.
    """
    if method.kind in _STREAMED:
        return _streamed_schedule(method, plan, config)
    out = []
    for step in range(config.steps):
        if method.period is not None:
            averaging = step < config.start_iter or (step - config.start_iter) % method.period == 0
            out.append(4 * plan.numel if averaging else 0)
        elif method.kind in ("fp16", "bf16"):
            out.append(2 * plan.numel)
        elif method.kind == "allreduce" or step < config.start_iter:
            out.append(4 * plan.numel)
        elif method.kind == "powersgd":
            out.append(4 * plan.numel_sent)
        else:
            out.append(4 * plan.numel_sent_per_step(1, step - config.start_iter))
    return out


_STREAMED = ("streaming", "diloco-int8", "diloco-int4", "sparseloco")


def _streaming_averager(method: Method, config: DemoConfig, num_tensors: int) -> StreamingDiLoCoAverager:
    """The :class:`StreamingDiLoCoAverager` of a ``streaming``/``diloco-int8``/``diloco-int4``/``sparseloco``
    method (the latter three: one fragment, no overlap, compressed outer gradient)."""
    period = method.period or 1
    if method.kind == "streaming":
        return StreamingDiLoCoAverager(
            period, warmup_steps=config.start_iter, num_fragments=min(STREAMING_FRAGMENTS, period, num_tensors),
            fragment_sync_delay=min(STREAMING_DELAY, period - 1), fragment_update_alpha=STREAMING_ALPHA,
            outer_lr=config.outer_lr, outer_momentum=config.outer_momentum)
    if method.kind == "sparseloco":  # no outer momentum: the decayed error feedback stands in for it
        return StreamingDiLoCoAverager(period, warmup_steps=config.start_iter, outer_lr=SPARSELOCO["outer_lr"],
                                       outer_momentum=0.0, compression=TopK(density=SPARSELOCO["density"],
                                                                            error_decay=SPARSELOCO["error_decay"]))
    compression = QuantizeInt8() if method.kind == "diloco-int8" else QuantizeInt4()
    return StreamingDiLoCoAverager(period, warmup_steps=config.start_iter, outer_lr=config.outer_lr,
                                   outer_momentum=config.outer_momentum, compression=compression)


def _streamed_schedule(method: Method, plan: Plan, config: DemoConfig) -> list[int]:
    """:func:`bytes_schedule` of the :data:`_STREAMED` methods: fp32 gradients until ``start_iter``, then
    at each fragment's sync step its payload (a fragment's first sync: plain fp32 averaging)."""
    averager, numel, steady = _streamed_payloads(method, plan, config)
    out, synced = [], set()
    for step in range(config.steps):
        fragment = averager.fragment_sent_at(step)  # the averager's step numbering is the 0-based step
        if step < config.start_iter:
            out.append(4 * plan.numel)
        elif fragment is None:
            out.append(0)
        elif fragment not in synced:
            synced.add(fragment)
            out.append(4 * numel[fragment])
        else:
            out.append(steady[fragment])
    return out


def _streamed_payloads(method: Method, plan: Plan, config: DemoConfig
                       ) -> tuple[StreamingDiLoCoAverager, list[int], list[int]]:
    """``(averager, numel of each fragment, bytes of each fragment's outer sync after its first)``."""
    averager = _streaming_averager(method, config, len(plan.tensors))
    sizes = [t.numel for t in plan.tensors]
    layout = split_by_size(sizes, averager.num_fragments)
    numel = [sum(n for n, f in zip(sizes, layout) if f == k) for k in range(averager.num_fragments)]
    compression = averager.compression
    steady = [4 * n if compression is None else compression.payload_bytes(n) for n in numel]
    return averager, numel, steady


def _hook(method: Method, config: DemoConfig) -> tuple[Any, Any]:
    if method.kind == "allreduce":
        return None, allreduce_hook
    if method.kind == "fp16":
        return None, fp16_compress_hook
    if method.kind == "bf16":
        return None, bf16_compress_hook
    if method.period is not None:  # gradients averaged until start_iter, then none (model averaging)
        return PostLocalSGDState(None, None, start_localSGD_iter=config.start_iter,
                                 post_local_gradient_allreduce=False), post_localSGD_hook
    options: dict[str, Any] = {
        "matrix_approximation_rank": method.rank or 1, "start_powerSGD_iter": config.start_iter,
        "min_compression_rate": config.min_compression_rate, "random_seed": config.seed,
        "num_iters_per_step": 1 if method.kind == "multi" else None, "warm_up_beta_factor": config.warm_up_beta,
        # Measured at (about) every evaluation, where the curve records it.
        "approximation_error_every_n_iters": max(1, config.steps // config.evals),
        **(config.powersgd_options or {})}
    state = PowerSGDState(None, **options)
    return state, powerSGD_hook


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _approximation_error(state: Any) -> float | None:
    """This worker's overall approximation error at PowerSGD's last measurement (``None``: not PowerSGD,
    or nothing measured yet)."""
    summary = state.approximation_error_summary() if isinstance(state, PowerSGDState) else None
    return None if summary is None else summary.overall


def _fail(kind: str, rank: int, step: int) -> None:
    """The failure ``DemoConfig.fail_kind`` injects on ``rank`` at ``step``."""
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:  # stuck inside the step: the others block in their next collective
            time.sleep(3600)
    raise RuntimeError(f"injected failure on rank {rank} at step {step} (DemoConfig.fail_at_step)")


def _resumable(config: DemoConfig) -> dict[str, Any]:
    """What a checkpoint must agree on to be resumed: the whole configuration but the injected failure."""
    return {k: v for k, v in config.to_dict().items() if not k.startswith("fail_")}


def _check_identity(saved: dict[str, Any], identity: dict[str, Any], path: str) -> None:
    for key, value in identity.items():
        if saved.get(key) != value:
            if isinstance(value, dict) and isinstance(saved.get(key), dict):
                diffs = [f"{k}={saved[key].get(k)!r} (now {v!r})" for k, v in value.items() if saved[key].get(k) != v]
                detail = ", ".join(diffs)
            else:
                detail = f"{saved.get(key)!r} (now {value!r})"
            raise ValueError(f"checkpoint {path!r} belongs to another run: it was saved with {key} {detail}; "
                             "use another --checkpoint-dir or the same settings")


def _evaluate(task: Any, model: nn.Module, x: Tensor, y: Tensor, device: torch.device) -> tuple[float, float]:
    """(mean test loss, metric) over the whole test set, summed across workers."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    for start in range(0, len(y), 256):
        sums += torch.tensor(task.evaluate(model, x[start: start + 256].to(device), y[start: start + 256].to(device)),
                             dtype=torch.float64)
    model.train()
    sums = sums.to(device)
    comm.all_reduce(sums, issuer="the demo's evaluation")
    loss_sum, correct, count = (float(v) for v in sums.cpu())
    return loss_sum / count, task.score(loss_sum, correct, count)


def train(rank: int, world_size: int, method: Method, config: DemoConfig,
          on_progress: ProgressFn | None = None, device: torch.device | str = "cpu", *,
          checkpoint_dir: str | os.PathLike[str] | None = None, checkpoint_every: int | None = None) -> dict[str, Any]:
    """Train ``config.task``'s model with DDP and ``method``; return metrics, curves and a checksum.

    Needs an initialised default process group. Worker ``rank`` trains on its shard of the training
    set (``rank::world_size``), reshuffled every epoch from the seed; the test metric is over the whole
    test set (sharded, summed across workers). ``wall_time_s`` is the training loop without the
    evaluations, slowest worker; each point of ``curve`` has this worker's training time so far
    (``time_s``, evaluations excluded: time-to-accuracy). Bytes are the payload one worker sends (:func:`bytes_schedule`);
    for PowerSGD they are cross-checked against ``PowerSGDState.bytes_stats()``.

    ``checkpoint_dir``: every ``checkpoint_every`` steps and at the end, each rank saves atomically the
    model, the optimizer (with the averager), the hook's state, its data position, the RNG and the
    progress so far to ``checkpoint_dir/<method>/`` (:mod:`gradpress.workloads.checkpoints`); a run that
    finds checkpoints there resumes from the newest step every rank completed and ends with the same
    parameters as a run that never stopped. A checkpoint of another configuration raises ``ValueError``.
    """
    if method.kind not in METHOD_KINDS:
        raise ValueError(f"unknown method {method.kind!r}; valid methods: {', '.join(METHOD_KINDS)}")
    if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
                                         or checkpoint_every < 1):
        raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
    if checkpoint_every is not None and checkpoint_dir is None:
        raise ValueError("checkpoint_every was given without checkpoint_dir")
    device = torch.device(device)
    task = get_task(config.task)
    data = task.load(config.seed)
    x_local, y_local = data.x_train[rank::world_size], data.y_train[rank::world_size]
    x_test, y_test = data.x_test[rank::world_size], data.y_test[rank::world_size]
    batch_size = config.resolved_batch_size()

    model = task.model(config.seed).to(device)
    plan = make_plan([p.shape for p in model.parameters()], method.rank or 1, config.min_compression_rate)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    state, hook = _hook(method, config)
    if isinstance(state, PowerSGDState):
        state.name_parameters(model)
    ddp.register_comm_hook(state, hook)
    optimizer: torch.optim.Optimizer = torch.optim.SGD(ddp.parameters(), lr=config.resolved_lr(),
                                                       momentum=config.momentum)
    averager: ModelAverager | None = None
    if method.kind == "localsgd":
        averager = PeriodicModelAverager(method.period or 1, warmup_steps=config.start_iter)
    elif method.kind == "diloco":
        averager = OuterOptimizerAverager(method.period or 1, warmup_steps=config.start_iter,
                                          outer_lr=config.outer_lr, outer_momentum=config.outer_momentum)
    elif method.kind in _STREAMED:
        averager = _streaming_averager(method, config, len(plan.tensors))
    if averager is not None:
        optimizer = PostLocalSGDOptimizer(optimizer, averager)
    payload = bytes_schedule(method, plan, config)
    # What crosses the wire: a collective over one worker sends nothing.
    schedule = payload if world_size > 1 else [0] * len(payload)

    eval_steps = {max(1, round(config.steps * (i + 1) / config.evals)) for i in range(config.evals)}
    order_gen = torch.Generator().manual_seed(30_000 + 1_000 * config.seed + rank)
    order = torch.randperm(len(y_local), generator=order_gen)
    cursor, running, running_n, sent = 0, 0.0, 0, 0
    curve: list[dict[str, Any]] = []
    train_time = 0.0
    first_step = 1
    run_dir = None if checkpoint_dir is None else checkpoints.run_directory(checkpoint_dir, method.spec)
    identity = {"method": method.spec, "world_size": world_size, "config": _resumable(config)}
    resume_step = None if run_dir is None else checkpoints.newest_common_step(run_dir, rank, world_size)
    if resume_step is not None:
        assert run_dir is not None
        saved = checkpoints.load_everywhere(run_dir, resume_step, rank, world_size,
                                            check=lambda state, path: _check_identity(state, identity, path))
        with torch.no_grad():  # after DDP's broadcast: local SGD's ranks hold different models
            model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if state is not None:
            state.load_state_dict(saved["hook"])
        order, cursor = saved["data"]["order"], saved["data"]["cursor"]
        order_gen.set_state(saved["data"]["generator"])
        torch.set_rng_state(saved["rng"]["torch"])
        if device.type == "cuda" and saved["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(saved["rng"]["cuda"], device)
        progress = saved["progress"]
        running, running_n, sent = progress["running"], progress["running_n"], progress["sent"]
        curve, train_time = progress["curve"], progress["train_time"]
        first_step = resume_step + 1
    else:
        test_loss, metric = _evaluate(task, model, x_test, y_test, device)
        curve.append({"step": 0, "train_loss": None, "test_loss": test_loss, "metric": metric, "bytes": 0,
                      "time_s": 0.0})
    comm.barrier(issuer="the demo's start")
    for step in range(first_step, config.steps + 1):
        start = time.perf_counter()
        if cursor + batch_size > len(order):
            order = torch.randperm(len(y_local), generator=order_gen)
            cursor = 0
        index = order[cursor: cursor + batch_size]
        cursor += batch_size
        if config.fail_at_step == step and rank == config.fail_rank and resume_step is None:
            _fail(config.fail_kind, rank, step)
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(ddp, x_local[index].to(device), y_local[index].to(device))
        loss.backward()
        optimizer.step()
        running += float(loss.detach())
        train_time += time.perf_counter() - start
        running_n += 1
        sent += schedule[step - 1]
        if step in eval_steps:
            test_loss, metric = _evaluate(task, model, x_test, y_test, device)
            curve.append({"step": step, "train_loss": running / running_n, "test_loss": test_loss,
                          "metric": metric, "bytes": sent, "time_s": train_time,
                          "approximation_error": _approximation_error(state)})
            if on_progress is not None and rank == 0:
                on_progress(method.label, step, config.steps, running / running_n)
            running, running_n = 0.0, 0
        if run_dir is not None and (step == config.steps or step % (checkpoint_every or config.steps) == 0):
            checkpoints.save(run_dir, step, rank, {
                **identity, "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "hook": None if state is None else state.state_dict(),
                "data": {"order": order, "cursor": cursor, "generator": order_gen.get_state()},
                "rng": {"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None},
                "progress": {"running": running, "running_n": running_n, "sent": sent, "curve": curve,
                             "train_time": train_time},
            })
            comm.barrier(issuer="the demo's checkpoint")  # every rank holds this step: the older files are no longer needed
            checkpoints.prune(run_dir, rank, keep_from=step)

    syncs = config.steps
    if averager is not None:
        syncs = min(config.steps, config.start_iter) + averager.num_averages
        # End on the average of the workers' models, the model one would keep (streaming's fragments are
        # never all in step at once).
        if payload[-1] == 0 or method.kind == "streaming":
            start = time.perf_counter()
            sent += average_tensors_(tensors_to_average(model.parameters()))
            train_time += time.perf_counter() - start  # part of making the model: counted as training
            syncs += 1
            test_loss, metric = _evaluate(task, model, x_test, y_test, device)
            curve.append({**curve[-1], "test_loss": test_loss, "metric": metric, "bytes": sent,
                          "time_s": train_time})
    times = torch.tensor([train_time], dtype=torch.float64, device=device)
    comm.all_reduce(times, issuer="the demo's timing", op="max")
    checksum, digest = param_checksum(model)
    tail = schedule[config.start_iter:]
    steady: float = sum(tail) / len(tail) if method.kind == "multi" and tail else schedule[-1]
    if method.period is not None and world_size > 1:
        steady = (sum(_streamed_payloads(method, plan, config)[2]) if method.kind in _STREAMED
                  else 4 * plan.numel) / method.period
    allreduce_step = 4 * plan.numel if world_size > 1 else 0
    result: dict[str, Any] = {
        "method": method.spec,
        "label": method.label,
        "rank": rank,
        "world_size": world_size,
        "steps": config.steps,
        "metric_name": task.metric,
        "metric": curve[-1]["metric"],
        "test_loss": curve[-1]["test_loss"],
        "train_loss": curve[-1]["train_loss"],
        "wall_time_s": float(times[0]),
        "time_per_step_s": float(times[0]) / config.steps,
        "numel": plan.numel,
        "bytes_per_step": steady,
        "bytes_allreduce_per_step": allreduce_step,
        # None where nothing was sent (one worker): there is no ratio to report.
        "compression_ratio": allreduce_step / steady if steady else None,
        "bytes_total": sent,
        "bytes_warm_up": sum(schedule[:config.start_iter]),
        "bytes_allreduce_total": allreduce_step * config.steps,
        "total_ratio": allreduce_step * config.steps / sent if sent else None,
        "synchronizations": syncs,
        # Mean over the run's measurements of this worker's overall approximation error (PowerSGD only).
        "approximation_error": _mean([p["approximation_error"] for p in curve if p.get("approximation_error") is not None]),
        "approximation_errors": state.approximation_error() if isinstance(state, PowerSGDState) else None,
        "curve": curve,
        "checksum": checksum,
        "digest": digest,
    }
    if averager is not None:
        # The averagers count bytes sent, so nothing with one worker.
        result["counted"] = {"averages": averager.num_averages, "bytes_averaged": averager.bytes_sent,
                             "ok": averager.bytes_sent == sum(tail)}
    elif isinstance(state, PowerSGDState):
        # PowerSGDState counts the payload it hands to the collectives, whatever the world size.
        compressed = max(0, config.steps - config.start_iter)
        _, before, after = state.bytes_stats()
        result["counted"] = {"compressed_steps": compressed, "bytes_before": before, "bytes_after": after,
                             "ok": after == sum(payload[config.start_iter:])
                             and before == 4 * plan.numel * compressed}
    return result
