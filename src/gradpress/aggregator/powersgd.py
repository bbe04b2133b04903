"""The PowerSGD aggregator (:class:`PowerSGD`) and :func:`optimizer_step`; see :mod:`gradpress.aggregator`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
import logging
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..checkpoint import (check_placement, check_saved_options, per_rank_state, placement, read_per_rank,
                          reject_gathered)
from ..comm import broadcast_parameters, check_communicator, check_process_group, link_bytes, make_communicator
from ..diagnostics import (ApproximationSummary, captured_energies, parameter_names, relative_errors,
                           should_measure, summarize)
from ..policy import RankPolicy, RankRules
from ..powersgd.memory import work_dtype_for
from ..powersgd.plan import Plan, make_plan
from ..powersgd.session import EngineSession, MemoryReport
from ..powersgd.transport import Communicator, decision_of
from .config import Config
from .exact import Aggregator, Contiguous, by_device_dtype, dense_gradients

__all__ = ["PowerSGD", "optimizer_step"]

logger = logging.getLogger(__name__)

_STATE_DICT_VERSION = 1
# Config fields a checkpoint's memory depends on.
_MEMORY_FIELDS = ("rank", "min_compression_rate", "num_iters_per_step", "random_seed")
# Config fields added later, saved only when not at these defaults (checkpoints keep the keys they had).
_LATER_FIELDS = {"warm_up_bytes_per_weight": None, "global_residual_every_n_iters": None,
                 "half_precision_wire": "auto", "orthogonalization": "auto"}


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
        dcp.save({"model": model.state_dict(), "powersgd": powersgd}, checkpoint_id=path)  # or through DCP

    Non-finite steps (AMP): when anything averaged in a call of :meth:`aggregate_` is inf/NaN (an
    overflow on any worker), the error memory and factors of every worker stay bitwise as they were
    before the call, the averages are non-finite and :attr:`finite` is ``False`` on every worker.
    :func:`optimizer_step` then skips the optimizer step; with a ``GradScaler``, call
    ``aggregate_([p.grad ...])`` and then ``scaler.step(optimizer)``, which sees the inf and skips.
    ``step_counter`` still advances (no host sync decides it; as in ``PowerSGDState``): a run that
    leaves the step out and adds 1 to ``step_counter`` instead continues with the same numbers.
    Memory: besides the error memory, one buffer of its size where each step builds M = g + e once (the two
    trade roles at each commit); nothing a later step reads is written until every group of the call has
    finished, and then only if all are finite (the warm-start factors the step overwrites are saved first:
    see :class:`gradpress.powersgd.memory.Segment` and :class:`gradpress.powersgd.commit.StepCommit`).

    Args:
        params: the parameters whose gradients will be aggregated (order fixes the gradients' order), or
            ``(name, parameter)`` pairs such as ``model.named_parameters()``, which also name them in
            :meth:`approximation_error` and for ``rank_policy``.
        config: a :class:`Config`.
        process_group: the group to average over (``None``: the default group, or one worker when
            ``torch.distributed`` is not initialised).
        communicator: what to average over instead of ``process_group`` (which must then be ``None``): any
            object with the engine's :class:`~gradpress.powersgd.transport.Communicator` methods, e.g.
            ``gradpress.integrations.torchft.FaultTolerantGroup(manager).communicator()`` across torchft
            replica groups. One that decides whether steps count
            (:class:`~gradpress.powersgd.transport.StepDecision`) is asked once per :meth:`aggregate_`, after
            its collectives and before anything is written: a step it refuses leaves the memory bitwise as
            it was and :attr:`finite` ``False``. ``init_sync`` does not apply (that group brings its
            replicas in line itself: torchft heals a joiner from a peer).
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

    def __init__(self, params: Iterable[Tensor] | Iterable[tuple[str, Tensor]], config: Config, *,
                 process_group: dist.ProcessGroup | None = None,
                 comm_device: torch.device | str | None = None,
                 lr_scheduler: Any = None, init_sync: bool = True, rank_policy: RankRules | None = None,
                 communicator: Communicator | None = None) -> None:
        if not isinstance(config, Config):
            raise TypeError(f"config must be a gradpress.Config, got {type(config).__name__}")
        check_process_group(process_group, "PowerSGD's process_group")
        check_communicator(communicator, process_group, "PowerSGD")
        if lr_scheduler is not None and not callable(getattr(lr_scheduler, "get_last_lr", None)):
            raise TypeError(f"lr_scheduler must be None or have a get_last_lr() method (a "
                            f"torch.optim.lr_scheduler.LRScheduler), got {type(lr_scheduler).__name__}")
        items: list[Any] = list(params)
        pairs = [item for item in items if isinstance(item, tuple)]
        named = bool(items) and len(pairs) == len(items)
        self.params: list[Tensor] = [param for _, param in pairs] if named else items
        self._names: dict[int, str] = parameter_names(pairs, "PowerSGD") if named else {}
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
        self.communicator = communicator
        self.step_counter = 0
        self.lr_scheduler = lr_scheduler
        self._session = EngineSession(config.engine_config())
        self._index = {id(p): i for i, p in enumerate(self.params)}
        if not isinstance(init_sync, bool):
            raise TypeError(f"init_sync must be True or False, got {init_sync!r}")
        if init_sync and communicator is None:
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
                         self._ranks_of(range(len(self.params))), orient=self._oriented())

    def _oriented(self) -> bool:
        """The orientation this aggregator's memory is (or will be) built in."""
        oriented = self._session.oriented
        return self._session.config.orientation(self.params[0].device) if oriented is None else oriented

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
    def total_link_bytes(self) -> float:
        """What this rank's link carried for :attr:`total_bytes_sent`, ring-equivalent: ``2 (W - 1) / W``
        of it (every collective is an allreduce; ``W`` the size of ``process_group`` now, a checkpoint of
        another world size being refused). The wire's 64-byte padding of each factor is sent and not
        counted, here as there."""
        world = placement(self.process_group)["world_size"] if self.communicator is None else \
            self.communicator.world_size
        return link_bytes("allreduce", self.total_bytes_sent, world)

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
                             self.config.min_compression_rate, self._ranks_of(indices), orient=self._oriented())
            wire = self._session.wire_dtype(dtype)
            total += plan.mean_numel_sent(self.config.num_iters_per_step) * wire.itemsize
        return total

    def last_step_bytes_stats(self) -> tuple[float, int, int]:
        """``(rate, bytes before, bytes after)`` of the last step that compressed, as measured (the
        cumulative figures are ``total_bytes_sent`` and ``total_numel``); ``(0, 0, 0)`` before the first."""
        before, after = self._session.last_step_bytes
        return (before / after if after > 0 else 0, before, after)

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
        items = dense_gradients(gradients, "PowerSGD")
        for index, grad in items:
            if grad.shape != self.params[index].shape:
                raise ValueError(f"gradient #{index} has shape {tuple(grad.shape)}, its parameter "
                                 f"{tuple(self.params[index].shape)}")
        comm = self.communicator or make_communicator(self.process_group, self.comm_device,
                                                      issuer="gradpress.PowerSGD.aggregate_")
        compressed_step = self.step_counter - self.config.start_compressing_after_num_steps
        measure = should_measure(self.config.approximation_error_every_n_iters, compressed_step)
        global_residual = should_measure(self.config.global_residual_every_n_iters, compressed_step)
        if self.lr_scheduler is not None:
            self._session.rescale_to_lr(self.lr_scheduler.get_last_lr()[0])
        session = self._session
        contexts = []
        try:
            for (device, dtype), group in by_device_dtype(items).items():
                context = Contiguous([g for _, g in group])
                contexts.append(context)
                if compressed_step < 0:
                    session.average(context.tensors, comm)
                    continue
                keys = tuple(i for i, _ in group)
                segment = session.store.get((device, dtype), keys, [t.shape for t in context.tensors], device,
                                            work_dtype_for(dtype), self._ranks_of(keys))
                session.run(segment, context.tensors, comm, compressed_step, measure=measure,
                            global_residual=global_residual)
            self.finite = session.finish(decision_of(comm))
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
    def local_state_dict(self) -> dict[str, Any]:
        """This worker's step counter, configuration, placement (rank and world size of ``process_group``)
        and per-parameter error memory and factors, as plain tensors and numbers: what ``torch.save`` of
        ``state_dict()`` held per worker before :meth:`state_dict` took the per-rank layout, and what
        :meth:`load_state_dict` still accepts."""
        return {
            "version": _STATE_DICT_VERSION,
            "placement": placement(self.process_group),
            # Options added later only when set: checkpoints keep the keys they had before they existed.
            "config": {name: value for name, value in asdict(self.config).items()
                       if name not in _LATER_FIELDS or value != _LATER_FIELDS[name]}
            | ({} if self._session.oriented is None else {"orient_matrices": self._session.oriented}),
            "step_counter": self.step_counter,
            "total_numel": self.total_numel,
            "total_floats_sent": self.total_floats_sent,
            "total_bytes_sent": self.total_bytes_sent,
            "last_lr": self._session.last_lr,
            "param_shapes": [list(p.shape) for p in self.params],
            "memory": self._session.memory_state(),
        }

    def state_dict(self) -> dict[str, Any]:
        """:meth:`local_state_dict` under this process's global rank
        (:func:`~gradpress.checkpoint.per_rank_state`), so that ``torch.distributed.checkpoint`` keeps
        every worker's (``dcp.save({"powersgd": powersgd})`` on every rank; the aggregator is a Stateful);
        ``torch.save`` per worker and :func:`~gradpress.checkpoint.gather_state` take it as well."""
        return per_rank_state(self.local_state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any], *, allow_other_rank: bool = False,
                        on_world_size_change: str = "raise") -> None:
        """Restore :meth:`state_dict`'s or :meth:`local_state_dict`'s output (tensors may come from another
        device).

        Raises ``ValueError`` if it was saved for other parameter shapes, another compression setting, or
        on another rank or world size (checkpoints without this record are accepted;
        ``allow_other_rank=True`` skips the rank/world-size check). ``on_world_size_change="fresh"``: a
        :meth:`state_dict` saved by another world size is not loaded, and the aggregator stays as it is (as
        constructed, in a resume: error memory from zero, ``step_counter`` from 0), as
        :func:`~gradpress.checkpoint.scatter_state` does with that option.
        """
        reject_gathered(state_dict, "PowerSGD.load_state_dict")
        state_dict, loaded = read_per_rank(state_dict, "PowerSGD", on_world_size_change=on_world_size_change,
                                           allow_other_rank=allow_other_rank)
        if not loaded:
            return
        if state_dict.get("version") != _STATE_DICT_VERSION:
            raise ValueError(f"unsupported PowerSGD state_dict version {state_dict.get('version')!r}; "
                             f"expected {_STATE_DICT_VERSION}")
        check_saved_options(state_dict["config"], {name: getattr(self.config, name) for name in _MEMORY_FIELDS},
                            "PowerSGD", "use the same Config to resume")
        # The memory's warm-start factors belong to one side of each wide matrix: follow the checkpoint's
        # orientation (checkpoints from before the option: PyTorch's view, not oriented).
        oriented = state_dict["config"].get("orient_matrices", False)
        if isinstance(oriented, bool) and oriented != self.config.orient_matrices:
            logger.info("PowerSGD: the checkpoint's memory was built with orient_matrices=%s; this aggregator "
                        "follows it (its factors belong to that orientation)", oriented)
            self.config = replace(self.config, orient_matrices=oriented)
            self._session.configure(self.config.engine_config())
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
