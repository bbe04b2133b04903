"""PowerSGD without DDP: an aggregator that works with any optimizer and any training loop.

The API of the PowerSGD authors' reference implementation (github.com/epfml/powersgd)::

    from gradpress import PowerSGD, Config, optimizer_step
    powersgd = PowerSGD(model.parameters(), config=Config(
        rank=1,                      # lower rank => more aggressive compression
        min_compression_rate=10,     # don't compress gradients with less compression
        num_iters_per_step=2,        # lower number => more aggressive compression
        start_compressing_after_num_steps=0,
    ))
    for x, y in loader:
        loss_fn(model(x), y).backward()
        optimizer_step(optimizer, powersgd)

It runs the same engine as :func:`gradpress.powerSGD_hook` (:func:`gradpress.powersgd.compress_step`),
averaging over ``torch.distributed``'s default group when it is initialised and over nothing (one
worker) when it is not. Unlike the reference, the error memory lives inside the aggregator, not in
``.grad``: the ordinary loop (``zero_grad``, ``backward``, ``optimizer_step``) and the reference's loop
(no ``zero_grad``) both work, and so does gradient accumulation over several backward passes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import broadcast_parameters
from .checkpoint import check_placement, placement, reject_gathered
from .comm import check_process_group, make_communicator
from .powersgd.transport import Communicator
from .diagnostics import (ApproximationSummary, captured_energies, check_measure_every, parameter_names,
                          relative_errors, should_measure, summarize)
from .policy import RankPolicy, RankRules
from .powersgd.pipeline import OrderedPipeline, Task
from .powersgd.config import EngineConfig
from .powersgd.memory import work_dtype_for
from .powersgd.plan import Plan, make_plan
from .powersgd.session import EngineSession, MemoryReport
from .powersgd.step import StepCommit, compress_step

__all__ = ["AllReduce", "Aggregator", "Config", "PowerSGD", "optimizer_step"]

_STATE_DICT_VERSION = 1
# Config fields a checkpoint's memory depends on.
_MEMORY_FIELDS = ("rank", "min_compression_rate", "num_iters_per_step", "random_seed")


class Aggregator(ABC):
    """Turns every worker's gradients into (an approximation of) their average over the workers.

    All workers must call :meth:`aggregate` / :meth:`aggregate_` together, with the same tensors (same
    shapes, same ones ``None``), as with any collective.

    ``finite``: after an aggregation, a 0-d bool tensor on the gradients' device, the same on every
    worker: whether everything averaged was finite (``False`` when any worker had an inf/NaN gradient;
    the averages are then non-finite too). ``None`` before the first aggregation or when there was
    nothing to aggregate. Reading it is a host sync on a GPU; :func:`optimizer_step` reads it once per
    step to skip non-finite steps.
    """

    finite: Tensor | None = None

    @abstractmethod
    def aggregate_(self, gradients: Sequence[Tensor | None]) -> None:
        """Replace each gradient, in place, by the average; ``None`` entries are skipped."""

    def aggregate(self, gradients: Sequence[Tensor | None]) -> list[Tensor | None]:
        """The averages as new tensors; the inputs are left unchanged (the reference's signature)."""
        _dense(gradients, type(self).__name__)  # refuse what is not a gradient before copying it
        out = [None if g is None else g.detach().clone() for g in gradients]
        self.aggregate_(out)
        return out


def _average_task(tensors: Sequence[Tensor], comm: Communicator, commit: StepCommit) -> Task:
    """Average ``tensors`` (one device and dtype) over the workers, in place, in one collective; add
    whether the averages are finite to ``commit``."""
    if not tensors:
        return
    if comm.world_size == 1:
        commit.add(torch.stack([torch.isfinite(t).all() for t in tensors]).all())
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat.div_(comm.world_size)
    yield comm.allreduce_sum(flat)
    torch._foreach_copy_([t.view(-1) for t in tensors], list(flat.split([t.numel() for t in tensors])))
    commit.add(torch.isfinite(flat).all())


def _dense(gradients: Sequence[Tensor | None], what: str) -> list[tuple[int, Tensor]]:
    out = []
    for index, grad in enumerate(gradients):
        if grad is None:
            continue
        if not isinstance(grad, Tensor):
            raise TypeError(f"{what}: gradient #{index} must be a torch.Tensor or None, got {type(grad).__name__}")
        if not grad.is_floating_point():
            raise TypeError(f"{what}: gradient #{index} has dtype {grad.dtype}; only real floating-point "
                            "gradients (float16, bfloat16, float32, float64) can be aggregated")
        if grad.is_sparse:
            raise ValueError(f"{what}: gradient #{index} is sparse; only dense gradients can be aggregated")
        out.append((index, grad))
    return out


def _by_device_dtype(items: Sequence[tuple[int, Tensor]]) -> dict[tuple[torch.device, torch.dtype],
                                                                   list[tuple[int, Tensor]]]:
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, Tensor]]] = {}
    for index, grad in items:
        groups.setdefault((grad.device, grad.dtype), []).append((index, grad))
    return groups


class _Contiguous:
    """Contiguous stand-ins for non-contiguous gradients (e.g. channels-last), copied back on exit."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.originals = list(tensors)
        self.tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]

    def __enter__(self) -> list[Tensor]:
        return self.tensors

    def __exit__(self, *exc: Any) -> None:
        for original, tensor in zip(self.originals, self.tensors):
            if tensor is not original:
                original.copy_(tensor)


class AllReduce(Aggregator):
    """Exact averaging: one allreduce per device and dtype, no compression.

    >>> AllReduce().aggregate([torch.ones(2)])     # one worker: the average is the input
    [tensor([1., 1.])]
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None,
                 comm_device: torch.device | str | None = None) -> None:
        check_process_group(process_group, "AllReduce's process_group")
        self.process_group = process_group
        self.comm_device = comm_device

    def aggregate_(self, gradients: Sequence[Tensor | None]) -> None:
        comm = make_communicator(self.process_group, self.comm_device, issuer="gradpress.AllReduce.aggregate_")
        pipeline = OrderedPipeline()
        commit = StepCommit()
        for group in _by_device_dtype(_dense(gradients, "AllReduce")).values():
            with _Contiguous([g for _, g in group]) as tensors:
                pipeline.submit(_average_task(tensors, comm, commit), lambda: None, lambda exc: None)
                pipeline.drain()
        self.finite = commit.apply()


@dataclass(frozen=True)
class Config:
    """Configuration of :class:`PowerSGD` (the reference's fields and defaults, plus ``random_seed``).

    Args:
        rank: rank r of each approximation (each matrix uses ``min(n, m, r)``); lower is more aggressive.
        min_compression_rate: compress an ``n x m`` gradient only if ``n*m > (n+m)*r*rate``.
        num_iters_per_step: one-sided power iterations per step, each sending one rank-r factor
            (P or Q, alternating); lower is more aggressive. 1 sends half of classic PowerSGD, 2 about
            the same. ``None``: classic two-sided PowerSGD (as :func:`gradpress.powerSGD_hook`).
        start_compressing_after_num_steps: exact averaging for this many steps first.
        random_seed: seeds the initial factors, identically on every worker.
        bytes_per_weight: precision of what goes on the wire (P, Q, uncompressed gradients), as in
            :class:`gradpress.PowerSGDState`: 2 = half (bf16 for bf16 gradients, else fp16 scaled so
            the sum cannot overflow), 4 = fp32, 8 = fp64. ``None`` (default, the reference's
            behaviour): the working precision (fp32 for fp16/bf16/fp32 gradients, fp64 for fp64).
        feedback_every_n_iters: add the error memory back into the gradient only on every n-th
            compressed step (every step's residual is accumulated); 1 is standard PowerSGD.
        warm_up_beta_factor: beta in (0, 1]: during the first ``start_compressing_after_num_steps``
            compressed steps the stored residual is ``beta * residual``; ``None``: off. Needs
            ``start_compressing_after_num_steps > 0`` (the damping lasts as long as the exact warm-up).
        approximation_error_every_n_iters: measure each compressed matrix's approximation error on
            every n-th compressed step (the first included), on the device; read it with
            :meth:`PowerSGD.approximation_error` (:mod:`gradpress.diagnostics`). ``None``: never.

    >>> Config(rank=2, bytes_per_weight=2).engine_config().bytes_per_weight
    2
    """

    rank: int
    min_compression_rate: float = 2
    num_iters_per_step: int | None = 1
    start_compressing_after_num_steps: int = 100
    random_seed: int = 0
    bytes_per_weight: int | None = None
    feedback_every_n_iters: int = 1
    warm_up_beta_factor: float | None = None
    approximation_error_every_n_iters: int | None = None

    def __post_init__(self) -> None:
        check_measure_every(self.approximation_error_every_n_iters)
        steps = self.start_compressing_after_num_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"start_compressing_after_num_steps must be an integer >= 0, got {steps!r}")
        self.engine_config()  # validates the engine's fields
        if self.warm_up_beta_factor is not None and steps == 0:
            raise ValueError("warm_up_beta_factor damps the error memory during the first "
                             "start_compressing_after_num_steps compressed steps, so it needs "
                             "start_compressing_after_num_steps > 0 (got 0); set both, or leave "
                             "warm_up_beta_factor=None")

    def engine_config(self) -> EngineConfig:
        """The engine's view of this configuration (error feedback and warm start on)."""
        return EngineConfig(rank=self.rank, min_compression_rate=self.min_compression_rate,
                            use_error_feedback=True, warm_start=True, random_seed=self.random_seed,
                            num_iters_per_step=self.num_iters_per_step, bytes_per_weight=self.bytes_per_weight,
                            feedback_every_n_iters=self.feedback_every_n_iters,
                            warm_up_beta_factor=self.warm_up_beta_factor,
                            warm_up_steps=self.start_compressing_after_num_steps)


class PowerSGD(Aggregator):
    """PowerSGD gradient compression with error feedback, for any optimizer (no DDP needed).

    ``aggregate_(gradients)`` takes the gradients of ``params``, in the same order (``None`` for a
    parameter without gradient this step: it is skipped and its memory kept). Matrices (tensors of
    2+ dimensions, viewed as ``(shape[0], -1)``) that compress by at least ``min_compression_rate`` are
    compressed; the rest are averaged exactly, in the same collective.

    Example::

        powersgd = PowerSGD(model.parameters(), Config(rank=2, start_compressing_after_num_steps=10))
        for x, y in loader:
            optimizer.zero_grad()                  # optional: optimizer_step leaves .grad at zero
            loss_fn(model(x), y).backward()
            optimizer_step(optimizer, powersgd)
        print(powersgd.compression_rate, powersgd.floats_per_step)
        torch.save(powersgd.state_dict(), f"powersgd.{rank}.pt")   # error memory is per worker

    Non-finite steps (AMP): when anything averaged in a call of :meth:`aggregate_` is inf/NaN (an
    overflow on any worker), the error memory and factors of every worker stay bitwise as they were
    before the call, the averages are non-finite and :attr:`finite` is ``False`` on every worker.
    :func:`optimizer_step` then skips the optimizer step; with a ``GradScaler``, call
    ``aggregate_([p.grad ...])`` and then ``scaler.step(optimizer)``, which sees the inf and skips.
    ``step_counter`` still advances (no host sync decides it; as in ``PowerSGDState``): a run that
    leaves the step out and adds 1 to ``step_counter`` instead continues with the same numbers.
    Memory: the new error memory is built beside the old one (one more error memory).

    Args:
        params: the parameters whose gradients will be aggregated (order fixes the gradients' order), or
            ``(name, parameter)`` pairs such as ``model.named_parameters()``, which also name them in
            :meth:`approximation_error` and for ``rank_policy``.
        config: a :class:`Config`.
        process_group: the group to average over (``None``: the default group, or one worker when
            ``torch.distributed`` is not initialised).
        comm_device: device the factors travel on (e.g. ``"cpu"`` for CUDA gradients over gloo).
        lr_scheduler: keep the error memory in update units, as ``PowerSGDState(lr_scheduler=...)``
            does: when ``lr_scheduler.get_last_lr()[0]`` goes from ``lr_old`` to ``lr_new`` between
            steps, the memory is multiplied by ``lr_old / lr_new``. ``None``: the memory is in
            gradient units (the reference's behaviour; the same as a constant learning rate).
        rank_policy: which parameters are compressed and at what rank, by name (needs named ``params``):
            ``{"embed*": None, "*.attn.*": 16}`` (shell patterns, the first match decides, ``None``
            averages the parameter exactly, unmatched ones take ``config.rank``) or a function
            ``(name, parameter) -> rank or None``; see :mod:`gradpress.policy`.
        init_sync: as ``DistributedDataParallel(init_sync=True)``: at construction, overwrite ``params``
            on every worker with rank 0's values (of ``process_group``), so that workers whose models
            were initialised differently do not train apart. Construction is then a collective: every
            worker builds its ``PowerSGD`` together. ``False``: leave the parameters as they are (e.g.
            when they are already equal, or were loaded from per-worker checkpoints).
    """

    def __init__(self, params: Iterable[Tensor], config: Config, *,
                 process_group: dist.ProcessGroup | None = None,
                 comm_device: torch.device | str | None = None,
                 lr_scheduler: Any = None, init_sync: bool = True, rank_policy: RankRules | None = None) -> None:
        if not isinstance(config, Config):
            raise TypeError(f"config must be a gradpress.Config, got {type(config).__name__}")
        check_process_group(process_group, "PowerSGD's process_group")
        if lr_scheduler is not None and not callable(getattr(lr_scheduler, "get_last_lr", None)):
            raise TypeError(f"lr_scheduler must be None or have a get_last_lr() method (a "
                            f"torch.optim.lr_scheduler.LRScheduler), got {type(lr_scheduler).__name__}")
        items = list(params)
        named = bool(items) and all(isinstance(item, tuple) for item in items)
        self.params: list[Tensor] = [item[1] for item in items] if named else items  # type: ignore[index]
        self._names: dict[int, str] = parameter_names(items, "PowerSGD") if named else {}
        self._policy = None if rank_policy is None else RankPolicy(rank_policy, config.rank, "PowerSGD")
        self._ranks: list[int | None] | None = None
        if self._policy is not None and not named:
            raise ValueError("PowerSGD's rank_policy needs the parameters' names: build it with "
                             "PowerSGD(model.named_parameters(), config, rank_policy=...)")
        self._resolve_ranks()
        if not self.params:
            raise ValueError("params is empty: PowerSGD needs the parameters whose gradients it aggregates")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("params contains the same tensor twice")
        self.config = config
        self.process_group = process_group
        self.comm_device = comm_device
        self.step_counter = 0
        self.lr_scheduler = lr_scheduler
        self._session = EngineSession(config.engine_config())
        self._index = {id(p): i for i, p in enumerate(self.params)}
        if not isinstance(init_sync, bool):
            raise TypeError(f"init_sync must be True or False, got {init_sync!r}")
        if init_sync:
            broadcast_parameters(self.params, process_group)

    # --- compression figures ------------------------------------------------------------------------
    def _resolve_ranks(self) -> None:
        """Each parameter's rank under the policy (``None`` without one: the configuration's rank)."""
        if self._policy is not None:
            ranks = self._policy.resolve([(self._names[id(p)], p) for p in self.params])
            self._ranks = [ranks[self._names[id(p)]] for p in self.params]

    def _ranks_of(self, indices: Sequence[int]) -> list[int | None] | None:
        return None if self._ranks is None else [self._ranks[i] for i in indices]

    def _plan(self) -> Plan:
        return make_plan([p.shape for p in self.params], self.config.rank, self.config.min_compression_rate,
                         self._ranks_of(range(len(self.params))))

    # --- counters, memory ---------------------------------------------------------------------------
    @property
    def total_numel(self) -> int:
        """Gradient elements aggregated so far."""
        return self._session.numel_in

    @total_numel.setter
    def total_numel(self, value: int) -> None:
        self._session.numel_in = int(value)

    @property
    def total_floats_sent(self) -> int:
        """Elements sent so far (factors and exactly averaged tensors)."""
        return self._session.numel_sent

    @total_floats_sent.setter
    def total_floats_sent(self, value: int) -> None:
        self._session.numel_sent = int(value)

    @property
    def total_bytes_sent(self) -> int:
        """Bytes sent so far, at the wire's precision (``bytes_per_weight``); the global-residual sketch of
        measured steps (:meth:`global_residual`), a diagnostic, is not counted."""
        return self._session.bytes_sent

    @total_bytes_sent.setter
    def total_bytes_sent(self, value: int) -> None:
        self._session.bytes_sent = int(value)

    @property
    def session(self) -> EngineSession:
        """The engine session this aggregator drives (see :mod:`gradpress.powersgd.session`)."""
        return self._session

    def memory_report(self) -> MemoryReport:
        """The bytes of error memory, factors and scratch held (:class:`gradpress.powersgd.MemoryReport`)."""
        return self._session.memory_report()

    @property
    def numel(self) -> int:
        """Elements of all parameters (what plain averaging sends per step)."""
        return sum(p.numel() for p in self.params)

    @property
    def floats_per_step(self) -> float:
        """Elements sent per compressed step, averaged over steps (alternating P/Q sides)."""
        return self._plan().mean_numel_sent(self.config.num_iters_per_step)

    @property
    def bytes_per_step(self) -> float:
        """Bytes sent per compressed step (averaged over steps), with ``bytes_per_weight`` on the wire."""
        total = 0.0
        for dtype in {p.dtype for p in self.params}:
            indices = [i for i, p in enumerate(self.params) if p.dtype == dtype]
            plan = make_plan([self.params[i].shape for i in indices], self.config.rank,
                             self.config.min_compression_rate, self._ranks_of(indices))
            wire = self._session.wire_dtype(dtype)
            total += plan.mean_numel_sent(self.config.num_iters_per_step) * wire.itemsize
        return total

    @property
    def compression_rate(self) -> float:
        """``numel / floats_per_step``: how many times fewer floats a compressed step sends."""
        sent = self.floats_per_step
        return self.numel / sent if sent else math.inf

    # --- aggregation --------------------------------------------------------------------------------
    def aggregate_(self, gradients: Sequence[Tensor | None]) -> None:
        if len(gradients) != len(self.params):
            raise ValueError(f"expected {len(self.params)} gradients (one per parameter, None for none), "
                             f"got {len(gradients)}")
        items = _dense(gradients, "PowerSGD")
        for index, grad in items:
            if grad.shape != self.params[index].shape:
                raise ValueError(f"gradient #{index} has shape {tuple(grad.shape)}, its parameter "
                                 f"{tuple(self.params[index].shape)}")
        comm = make_communicator(self.process_group, self.comm_device, issuer="gradpress.PowerSGD.aggregate_")
        compressed_step = self.step_counter - self.config.start_compressing_after_num_steps
        measure = should_measure(self.config.approximation_error_every_n_iters, compressed_step)
        if self.lr_scheduler is not None:
            self._session.rescale_to_lr(self.lr_scheduler.get_last_lr()[0])
        session = self._session
        contexts = []
        try:
            for (device, dtype), group in _by_device_dtype(items).items():
                context = _Contiguous([g for _, g in group])
                contexts.append(context)
                tensors = context.tensors
                numel = sum(t.numel() for t in tensors)
                if compressed_step < 0:
                    task, sent = _average_task(tensors, comm, session.commit), numel
                    wire = dtype
                else:
                    wire = session.wire_dtype(dtype)
                    keys = tuple(i for i, _ in group)
                    segment = session.store.get((device, dtype), keys, [t.shape for t in tensors], device,
                                                work_dtype_for(dtype), self._ranks_of(keys))
                    task, sent = compress_step(segment, tensors, comm, session.config, compressed_step,
                                               session.commit, measure=measure)
                session.submit(task, _nothing, _ignore)
                session.count(numel, sent, dtype, wire)
            self.finite = session.finish()
        except BaseException:
            session.discard()
            raise
        finally:
            for context in contexts:
                context.__exit__()
        self.step_counter += 1

    # --- diagnostics ----------------------------------------------------------------------------------
    def name_parameters(self, module: torch.nn.Module | Iterable[tuple[str, Tensor]]) -> None:
        """Name the parameters in :meth:`approximation_error` (and for ``rank_policy``) after ``module``'s
        ``named_parameters()`` (or after ``(name, parameter)`` pairs); building with
        ``PowerSGD(model.named_parameters(), ...)`` does the same."""
        names, previous_names = parameter_names(module, "PowerSGD"), self._names
        if self._policy is not None:
            missing = [i for i, p in enumerate(self.params) if id(p) not in names]
            if missing:
                raise ValueError(f"PowerSGD's rank_policy needs every parameter's name; parameters "
                                 f"#{missing[:5]} are not in the module given")
        before = self._ranks
        self._names = names
        self._resolve_ranks()
        if self._session.store.segments and self._ranks != before:
            self._names, self._ranks = previous_names, before
            raise ValueError("these names give the rank_policy other ranks than the ones PowerSGD is compressing "
                             "with; name the parameters before the first compressed step")

    def _name(self, key: int) -> str:
        return self._names.get(id(self.params[key]), f"#{key}")

    def approximation_error(self) -> dict[str, float]:
        """``{parameter: ||M - P Q^T|| / ||M||}`` for each compressed parameter, at its last measured step
        (``Config.approximation_error_every_n_iters``; empty before the first), on this worker: M is this
        worker's gradient plus error memory, P Q^T what every worker applied (see
        :mod:`gradpress.diagnostics`). Parameters are named as in ``named_parameters()`` when the
        aggregator knows the names, else ``"#i"`` for the i-th of ``params``. Reads the values on the host."""
        return relative_errors(self._session.approximation_norms(), self._name)

    def approximation_error_summary(self) -> ApproximationSummary | None:
        """The errors of :meth:`approximation_error` in one :class:`~gradpress.diagnostics.ApproximationSummary`
        (``None`` before the first measurement)."""
        return summarize(self._session.approximation_norms(), self._name)

    def global_residual(self) -> dict[str, float]:
        """``{parameter: ||mean M - P Q^T|| / ||mean M||}`` for each compressed parameter, at its last
        measured step (as :meth:`approximation_error`): how much of the workers' *averaged* matrix the
        applied ``P Q^T`` misses, the same on every worker. Estimated with a seeded Gaussian sketch of 16
        columns (exact for matrices of at most 16 columns, and 0 when P Q^T is the mean); see
        :mod:`gradpress.diagnostics`. Measuring adds one all-reduce of ``n x 16`` per matrix to each
        measured step, not counted in :attr:`total_bytes_sent`. Reads the values on the host."""
        return relative_errors(self._session.global_residual_norms(), self._name)

    def global_residual_summary(self) -> ApproximationSummary | None:
        """:meth:`global_residual` in one :class:`~gradpress.diagnostics.ApproximationSummary` (overall,
        mean, worst, ``captured_energy``; ``None`` before the first measurement)."""
        return summarize(self._session.global_residual_norms(), self._name)

    def captured_energy(self) -> dict[str, float]:
        """``{parameter: 1 - global_residual^2}``: the share of the averaged matrix's energy the applied
        approximation captures (see :meth:`global_residual`)."""
        return captured_energies(self._session.global_residual_norms(), self._name)

    # --- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step counter, configuration and per-parameter error memory and factors, as plain tensors."""
        return {
            "version": _STATE_DICT_VERSION,
            "placement": placement(self.process_group),
            "config": asdict(self.config),
            "step_counter": self.step_counter,
            "total_numel": self.total_numel,
            "total_floats_sent": self.total_floats_sent,
            "total_bytes_sent": self.total_bytes_sent,
            "last_lr": self._session.last_lr,
            "param_shapes": [list(p.shape) for p in self.params],
            "memory": self._session.memory_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_other_rank: bool = False) -> None:
        """Restore :meth:`state_dict`'s output (tensors may come from another device).

        Raises ``ValueError`` if it was saved for other parameter shapes, another compression setting, or
        on another rank or world size (checkpoints without this record are accepted;
        ``allow_other_rank=True`` skips the rank/world-size check).
        """
        reject_gathered(state_dict, "PowerSGD.load_state_dict")
        if state_dict.get("version") != _STATE_DICT_VERSION:
            raise ValueError(f"unsupported PowerSGD state_dict version {state_dict.get('version')!r}; "
                             f"expected {_STATE_DICT_VERSION}")
        saved = state_dict["config"]
        for name in _MEMORY_FIELDS:
            if saved.get(name) != getattr(self.config, name):
                raise ValueError(f"checkpoint was saved with {name}={saved.get(name)!r} but this PowerSGD has "
                                 f"{name}={getattr(self.config, name)!r}; use the same Config to resume")
        shapes = [tuple(int(d) for d in s) for s in state_dict["param_shapes"]]
        current = [tuple(p.shape) for p in self.params]
        if len(shapes) != len(current):
            raise ValueError(f"checkpoint was saved for {len(shapes)} parameters, this PowerSGD has "
                             f"{len(current)}: the checkpoint belongs to a different model")
        for i, (was, now) in enumerate(zip(shapes, current)):
            if was != now:
                raise ValueError(f"checkpoint parameter #{i} has shape {was}, this PowerSGD's has {now}: "
                                 "the checkpoint belongs to a different model")
        check_placement(state_dict.get("placement"), placement(self.process_group), "PowerSGD",
                        allow_other_rank)
        self.step_counter = int(state_dict["step_counter"])
        self.total_numel = int(state_dict["total_numel"])
        self.total_floats_sent = int(state_dict["total_floats_sent"])
        self.total_bytes_sent = int(state_dict.get("total_bytes_sent", 0))
        self._session.last_lr = state_dict.get("last_lr")
        self._session.load_memory_state(state_dict["memory"])


def _nothing() -> None:
    """What an aggregator task does when it ends: nothing (its outputs are written at the commit)."""


def _ignore(error: BaseException) -> None:
    """A failing task's error is raised by the pipeline itself."""


def optimizer_step(optimizer: torch.optim.Optimizer, aggregator: Aggregator) -> bool:
    """Average the gradients with ``aggregator``, take the optimizer step, then zero the gradients.

    Works with any ``torch.optim`` optimizer. The gradients hold the average during
    ``optimizer.step()`` and are zero afterwards (the part compression deferred is in the
    aggregator's error memory), so the next ``backward()`` starts from zero whether or not the loop
    calls ``zero_grad()``. Parameters without gradient are skipped. For gradient clipping or
    inspection of the averaged gradients, call ``aggregator.aggregate_([p.grad ...])`` yourself.

    Returns whether the optimizer stepped: ``False`` when the averages are not finite
    (:attr:`Aggregator.finite`; an inf/NaN gradient on any worker), on every worker alike; the
    parameters, the optimizer's state and the aggregator's memory are then as before the call. Deciding
    reads one flag per step on the host (a stream sync on a GPU, as ``GradScaler.step`` does).
    """
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if isinstance(aggregator, PowerSGD):
        unknown = [i for i, p in enumerate(in_optimizer) if id(p) not in aggregator._index and p.grad is not None]
        if unknown:
            raise ValueError(f"the optimizer's parameters #{unknown[:5]} are not among the PowerSGD "
                             "aggregator's params, so they would not be averaged; build PowerSGD with "
                             "all of the optimizer's parameters")
        params = aggregator.params
    else:
        params = in_optimizer
    grads = [p.grad for p in params]
    aggregator.aggregate_(grads)
    finite = aggregator.finite
    stepped = finite is None or bool(finite)
    if stepped:
        optimizer.step()
    with torch.no_grad():
        for grad in grads:
            if grad is not None:
                grad.zero_()
    return stepped

