"""One data-parallel training run of a demo task with one communication method, and its figures.

Used by ``gradpress demo`` (which spawns the workers) and by ``examples/train.py`` (under ``torchrun``):
the same code path. Every run with the same :class:`DemoConfig` sees the same data in the same order
and starts from the same weights, so methods differ only in how gradients are communicated.

>>> from gradpress.tools.workloads import DemoConfig, parse_methods, train      # doctest: +SKIP
>>> # inside each worker, after dist.init_process_group(...)                     # doctest: +SKIP
>>> result = train(rank, world_size, parse_methods("powersgd", [2])[0], DemoConfig(steps=100))
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ... import comm
from ...averaging import ModelAverager, PostLocalSGDOptimizer
from ...averaging.tensors import tensors_to_average
from ...hooks import PowerSGDState
from ...powersgd import make_plan
from . import checkpoints
from .config import ADAMW_BETAS, DemoConfig
from .methods import Method, anchor_bytes, bytes_schedule, link_schedule, method_kind, warm_up_wire
from .tasks import get_task

__all__ = ["ProgressFn", "make_optimizer", "param_checksum", "train"]

#: ``on_progress(label, step, steps, loss)``: called on rank 0 at every logged step.
ProgressFn = Callable[[str, int, int, float], None]


def param_checksum(model: nn.Module) -> tuple[float, str]:
    """``(sum of all parameters in float64, sha256 of their bytes)``: equal iff workers hold equal weights."""
    digest = hashlib.sha256()
    total = 0.0
    for param in model.parameters():
        data = param.detach().cpu().contiguous()
        total += float(data.double().sum())
        digest.update(ctypes.string_at(data.data_ptr(), data.numel() * data.element_size()))  # no numpy
    return total, digest.hexdigest()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _approximation_error(state: Any) -> float | None:
    """This worker's overall approximation error at PowerSGD's last measurement (``None``: not PowerSGD,
    or nothing measured yet)."""
    summary = state.approximation_error_summary() if isinstance(state, PowerSGDState) else None
    return None if summary is None else summary.overall


def _global_residual(state: Any) -> float | None:
    """PowerSGD's overall global residual ``||mean M - P Q^T|| / ||mean M||`` at its last measurement, the
    same on every worker (``None``: not PowerSGD, or nothing measured yet)."""
    summary = state.global_residual_summary() if isinstance(state, PowerSGDState) else None
    return None if summary is None else summary.overall


def _fail(kind: str, rank: int, step: int) -> None:
    """The failure ``DemoConfig.fail_kind`` injects on ``rank`` at ``step``."""
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:  # stuck inside the step: the others block in their next collective
            time.sleep(3600)
    raise RuntimeError(f"injected failure on rank {rank} at step {step} (DemoConfig.fail_at_step)")


def _clip_local_gradient(hook: Callable[[Any, Any], Any], max_norm: float) -> Callable[[Any, Any], Any]:
    """``hook`` after scaling this worker's bucket to norm at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` scales (coefficient ``max_norm / (norm + 1e-6)``, capped at 1), on
    the device. Over the whole gradient when the model is one bucket (``_bucket_cap_mb``)."""
    def clipped(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotations other than its own
        buffer = bucket.buffer()
        norm = torch.linalg.vector_norm(buffer, dtype=torch.float32)
        buffer.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(buffer.dtype))
        return hook(state, bucket)
    return clipped


def _bucket_cap_mb(numel: int) -> float:
    """A DDP bucket cap that holds all ``numel`` fp32 gradients in one bucket (at least DDP's 25 MB; an
    explicit cap also sets the first bucket's, which is 1 MB by default)."""
    return max(25.0, 4 * numel / 2**20 + 1)


def _data_parallel(model: nn.Module, state_and_hook: tuple[Any, Any], config: DemoConfig,
                   device: torch.device) -> tuple[DistributedDataParallel, Any]:
    """DDP around ``model`` with the method's ``(state, hook)`` registered; with
    ``config.clip_before_averaging`` the hook first clips this worker's gradient, all of it in one bucket."""
    state, hook = state_and_hook
    numel = sum(p.numel() for p in model.parameters())
    # Passed only when wanted: DDP's own default applies otherwise.
    one_bucket: dict[str, Any] = {"bucket_cap_mb": _bucket_cap_mb(numel)} if config.clip_before_averaging else {}
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, **one_bucket)
    if config.clip_before_averaging:
        assert config.clip_grad_norm is not None  # DemoConfig checks it
        hook = _clip_local_gradient(hook, config.clip_grad_norm)
    if isinstance(state, PowerSGDState):
        state.name_parameters(model)
    ddp.register_comm_hook(state, hook)
    return ddp, state


def make_optimizer(params: list[nn.Parameter], config: DemoConfig) -> torch.optim.Optimizer:
    """The run's inner optimizer over ``params``: SGD with ``config.momentum``, or AdamW as nanoGPT trains
    (betas ``ADAMW_BETAS``, ``config.weight_decay`` on parameters of 2 or more dimensions, none on
    vectors). Its learning rate is ``config.lr_at(step)``, set by the training loop at every step."""
    lr = config.lr_at(1)
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=ADAMW_BETAS)


def _clip_averaged_gradient(ddp: DistributedDataParallel, config: DemoConfig) -> None:
    """Between backward and the optimizer: clip the averaged gradient when ``config`` clips after the hook."""
    if config.clip_grad_norm is not None and not config.clip_before_averaging:
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), config.clip_grad_norm)


def _resumable(config: DemoConfig) -> dict[str, Any]:
    """What a checkpoint must agree on to be resumed: the whole configuration but the injected failure."""
    return {k: v for k, v in config.to_dict().items() if not k.startswith("fail_")}


def _check_identity(saved: dict[str, Any], identity: dict[str, Any], path: str) -> None:
    if isinstance(saved.get("config"), dict):
        # A checkpoint written before a DemoConfig field existed ran with that field's default.
        fields = DemoConfig.__dataclass_fields__
        saved = {**saved, "config": {**{k: fields[k].default for k in identity["config"] if k in fields},
                                     **saved["config"]}}
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
    (``time_s``, evaluations excluded: time-to-accuracy). Bytes are the payload one worker sends
    (:func:`~gradpress.tools.workloads.methods.bytes_schedule`); for PowerSGD they are cross-checked
    against ``PowerSGDState.bytes_stats()``.

    ``checkpoint_dir``: every ``checkpoint_every`` steps and at the end, each rank saves atomically the
    model, the optimizer (with the averager), the hook's state, its data position, the RNG and the
    progress so far to ``checkpoint_dir/<method>/`` (:mod:`gradpress.tools.workloads.checkpoints`); a run that
    finds checkpoints there resumes from the newest step every rank completed and ends with the same
    parameters as a run that never stopped. A checkpoint of another configuration raises ``ValueError``.
    """
    kind = method_kind(method.kind)  # ValueError naming the valid methods
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
    ddp, state = _data_parallel(model, kind.hook(method, config), config, device)
    optimizer: torch.optim.Optimizer = make_optimizer(list(ddp.parameters()), config)
    averager: ModelAverager | None = (None if kind.averager is None
                                      else kind.averager(method, config, len(plan.tensors)))
    if averager is not None:
        optimizer = PostLocalSGDOptimizer(optimizer, averager)
        # The averager is handed the optimizer's parameters (AdamW's: the matrices, then the vectors), and
        # its fragments, hence a sync's regions and padding, are cut from that list: so is the byte model's.
        plan = make_plan([p.shape for group in optimizer.param_groups for p in group["params"]],
                         method.rank or 1, config.min_compression_rate)
    payload = bytes_schedule(method, plan, config, world_size)
    # What crosses the wire: a collective over one worker sends nothing.
    schedule = payload if world_size > 1 else [0] * len(payload)
    links = link_schedule(method, plan, config, world_size)  # what one worker's link carries (0 alone)

    eval_steps = {max(1, round(config.steps * (i + 1) / config.evals)) for i in range(config.evals)}
    order_gen = torch.Generator().manual_seed(30_000 + 1_000 * config.seed + rank)
    order = torch.randperm(len(y_local), generator=order_gen)
    cursor, running, running_n, sent, carried = 0, 0.0, 0, 0, 0.0
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
        carried = progress.get("link", 0.0)
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
        if config.optimizer != "sgd":
            for group in optimizer.param_groups:
                group["lr"] = config.lr_at(step)
        loss = task.loss(ddp, x_local[index].to(device), y_local[index].to(device))
        loss.backward()
        _clip_averaged_gradient(ddp, config)
        optimizer.step()
        running += float(loss.detach())
        train_time += time.perf_counter() - start
        running_n += 1
        sent += schedule[step - 1]
        carried += links[step - 1]
        if step in eval_steps:
            test_loss, metric = _evaluate(task, model, x_test, y_test, device)
            curve.append({"step": step, "train_loss": running / running_n, "test_loss": test_loss,
                          "metric": metric, "bytes": sent, "link_bytes": carried, "time_s": train_time,
                          "approximation_error": _approximation_error(state),
                          "global_residual": _global_residual(state)})
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
                "progress": {"running": running, "running_n": running_n, "sent": sent, "link": carried,
                             "curve": curve, "train_time": train_time},
            })
            # Every rank holds this step: the older files are no longer needed.
            comm.barrier(issuer="the demo's checkpoint")
            checkpoints.prune(run_dir, rank, keep_from=step)

    syncs = config.steps
    if averager is not None:
        syncs = min(config.steps, config.start_iter) + averager.num_averages
        # End on the average of the workers' models, the model one would keep (and always for a kind with
        # final_average: streaming's fragments are never all in step at once).
        if payload[-1] == 0 or kind.final_average:
            start = time.perf_counter()
            final = comm.average_tensors_(tensors_to_average(model.parameters()))
            sent += final
            carried += comm.link_bytes("allreduce", final, world_size)
            train_time += time.perf_counter() - start  # part of making the model: counted as training
            syncs += 1
            test_loss, metric = _evaluate(task, model, x_test, y_test, device)
            curve.append({**curve[-1], "test_loss": test_loss, "metric": metric, "bytes": sent,
                          "link_bytes": carried, "time_s": train_time})
    times = torch.tensor([train_time], dtype=torch.float64, device=device)
    comm.all_reduce(times, issuer="the demo's timing", op="max")
    checksum, digest = param_checksum(model)
    tail = schedule[config.start_iter:]
    steady = kind.bytes_per_step(method, plan, config, schedule, world_size)
    steady_link = kind.bytes_per_step(method, plan, config, links, world_size, link=True)
    allreduce_step = 4 * plan.numel if world_size > 1 else 0
    allreduce_link = comm.link_bytes("allreduce", 4 * plan.numel, world_size)
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
        # What one worker's link carries (ring-equivalent, at this world size), beside the payload above:
        # the figure to compare methods by (an all-gathered payload reads small at every world size).
        "link_bytes_per_step": steady_link,
        "link_bytes_allreduce_per_step": allreduce_link,
        "link_compression_ratio": allreduce_link / steady_link if steady_link else None,
        "link_bytes_total": carried,
        "link_total_ratio": allreduce_link * config.steps / carried if carried else None,
        "synchronizations": syncs,
        # Mean over the run's measurements of this worker's overall approximation error (PowerSGD only).
        "approximation_error": _mean([p["approximation_error"] for p in curve
                                      if p.get("approximation_error") is not None]),
        "approximation_errors": state.approximation_error() if isinstance(state, PowerSGDState) else None,
        # The same for the global residual (of the workers' mean; sketched), and its last values by parameter.
        "global_residual": _mean([p["global_residual"] for p in curve if p.get("global_residual") is not None]),
        "global_residuals": state.global_residual() if isinstance(state, PowerSGDState) else None,
        # PowerSGD's automatic rank: what it chose, the captured energies E(1..max_rank) and, with the noise
        # criterion, the residuals over noise R(1..max_rank) it chose on.
        "auto_rank": ({"rank": state.matrix_approximation_rank, "captured": state.auto_rank_captured(),
                       "noise_ratio": state.auto_rank_noise_ratio()}
                      if isinstance(state, PowerSGDState) and state.auto_rank is not None else None),
        "curve": curve,
        "checksum": checksum,
        "digest": digest,
    }
    if averager is not None:
        # The averagers count bytes sent, so nothing with one worker.
        # Its bytes: the syncs after warm-up, and DiLoCo's anchor (broadcast at the last warm-up step).
        anchor = anchor_bytes(method, plan, config) if world_size > 1 and config.start_iter >= 1 else 0
        anchor_link = comm.link_bytes("broadcast", anchor, world_size)
        # (The demo's compressed kinds sync with no delay: a two-shot sync's all-gather is issued, and
        # counted, at its send step, where the model counts it.)
        link_ok = math.isclose(averager.link_bytes, sum(links[config.start_iter:]) + anchor_link, rel_tol=1e-9,
                               abs_tol=1e-6)
        result["counted"] = {"averages": averager.num_averages, "bytes_averaged": averager.bytes_sent,
                             "link_bytes": averager.link_bytes,
                             "ok": averager.bytes_sent == sum(tail) + anchor and link_ok}
    elif isinstance(state, PowerSGDState):
        # PowerSGDState counts the payload it hands to the collectives, whatever the world size.
        # With warm_up_bytes_per_weight=2 it counts the warm-up too: its bytes are given apart, and
        # "bytes_after" keeps the compressed steps' alone.
        compressed = max(0, config.steps - config.start_iter)
        counted_steps = config.steps if warm_up_wire(config) is not None else compressed
        warm = sum(payload[:config.start_iter]) if warm_up_wire(config) is not None else 0
        _, before, after = state.bytes_stats()
        result["counted"] = {"compressed_steps": compressed, "bytes_before": before, "bytes_after": after - warm,
                             "bytes_warm_up": warm, "link_bytes_after": state.link_bytes_stats()[2],
                             "ok": after == sum(payload[config.start_iter:]) + warm
                             and before == 4 * plan.numel * counted_steps}
    return result
