"""gradpress over torchft (``meta-pytorch/torchft``): fault-tolerant PowerSGD and streaming DiLoCo across
replica groups that come and go, without forking torchft. Install with ``pip install "gradpress[torchft]"``.

torchft forms a *quorum* of replica groups at each step (its ``Manager`` asks a lighthouse), heals a
replica that joins from a healthy peer, and decides after each step whether it counts
(``manager.should_commit()``). :class:`FaultTolerantGroup` wraps one ``Manager`` and gives gradpress:

* ``sync_group=`` for :class:`gradpress.StreamingDiLoCoAverager` (the :class:`~gradpress.averaging.syncgroup.
  SyncGroup` protocol): a quorum at each sync, its collectives among the quorum's members (the two-shot
  reduction included), the sync applied only where ``should_commit()`` says so, retried otherwise;
* :meth:`FaultTolerantGroup.communicator`, ``communicator=`` for :class:`gradpress.PowerSGD` and
  :class:`gradpress.PowerSGDState`: every all-reduce through ``manager.allreduce`` (torchft's error
  handling), and each step's memory and factors written only where ``should_commit()`` says so;
* :meth:`FaultTolerantGroup.register`: the state split. *Global* state (anchors, outer momentum, the
  step and sync counters, PowerSGD's warm-start factors, counters and rank decisions) is registered with
  the Manager's state-dict functions, so torchft copies it to a joiner when it heals; *local* state
  (PowerSGD's error memory, the averager's residuals and owner residuals, updates in flight) is not
  sent and starts from zero on the joiner: a peer's would apply that peer's unsent mass twice.
* :func:`fault_tolerant_ddp`: DDP built the way torchft's ``DistributedDataParallel`` builds its own
  (a dummy one-rank group for DDP's own collectives, buckets never rebuilt), with gradpress's PowerSGD
  hook instead of torchft's hard-coded all-reduce hook.

Example (one replica group of one process; the lighthouse runs elsewhere, ``TORCHFT_LIGHTHOUSE`` names
it)::

    from torchft import Manager, ProcessGroupGloo
    from gradpress import QuantizeInt4, StreamingDiLoCoAverager
    from gradpress.integrations.torchft import FaultTolerantGroup

    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None, min_replica_size=1,
                      use_async_quorum=False, quorum_timeout=timedelta(minutes=10))
    group = FaultTolerantGroup(manager)
    averager = StreamingDiLoCoAverager(sync_every=8, num_fragments=2, fragment_phase="end",
                                       compression=QuantizeInt4(), sync_group=group)
    group.register("model", model)            # the model's parameters travel to a joiner too
    group.register("diloco", averager)        # global state copied, residuals zero on a joiner
    averager.anchor_parameters(model.parameters())
    for batch in data:
        ...; inner.step()
        averager.average_parameters(model.parameters())

See ``docs/torchft.md`` for the decisions and what is not supported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..aggregator import PowerSGD
from ..checkpoint import clone_tensors, state_nbytes
from ..comm import GroupExchange, is_torchft_object
from ..hooks import PowerSGDState, powerSGD_hook
from ..streaming import StreamingDiLoCoAverager

__all__ = ["FaultTolerantGroup", "ManagerCommunicator", "fault_tolerant_ddp", "powersgd_global_state"]


def _is_manager(value: object) -> bool:
    return any(cls.__module__.split(".")[0] == "torchft" and cls.__name__ == "Manager" for cls in type(value).__mro__)


class FaultTolerantGroup:
    """A torchft ``Manager`` as gradpress's fault-tolerant group (see the module docstring).

    ``manager`` must be built with ``use_async_quorum=False``: the quorum (and a joiner's healing) is then
    complete when :meth:`begin` returns, and a healed replica takes part in the step it heals at, as
    torchft's own ``DiLoCo`` requires. Its process group reports rank 0 on every replica group: the rank
    and the number of members come from the Manager (``participating_rank()``, ``num_participants()``).

    Records, per :meth:`begin`: :attr:`quorums` (``(committed, rank, world)``) and per :meth:`commit`
    :attr:`commits` (what :mod:`gradpress.tools.workloads.membership` replays), :attr:`quorum_seconds`
    (the wait for each quorum, healing included), and per heal
    :attr:`healed_bytes` (the bytes of the registered state this replica received).

    Example::

        group = FaultTolerantGroup(manager)
        aggregator = gradpress.PowerSGD(model.parameters(), gradpress.Config(rank=4),
                                        communicator=group.communicator())
        group.register("model", model)
        group.register("optimizer", optimizer)
        group.register("powersgd", aggregator)  # factors and counters; the error memory stays local
        for batch in data:
            group.begin()                      # the step's quorum (a joiner is healed here)
            loss(model, batch).backward()
            gradpress.optimizer_step(optimizer, aggregator)   # steps only if the step committed
    """

    def __init__(self, manager: Any) -> None:
        if not _is_manager(manager):
            what = f"torchft's {type(manager).__name__} (a process group)" if is_torchft_object(manager) else \
                "a torch.distributed.ProcessGroup" if isinstance(manager, dist.ProcessGroup) else \
                f"{type(manager).__name__} {manager!r}"
            raise TypeError(f"FaultTolerantGroup's manager must be a torchft.Manager, got {what}: build "
                            "Manager(pg=ProcessGroupGloo(), ..., use_async_quorum=False) over the process group "
                            "and pass the Manager (a fixed torch.distributed group needs no FaultTolerantGroup: "
                            "give it as process_group=)")
        # torchft keeps this option private; its own DiLoCo checks it the same way.
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("FaultTolerantGroup's manager must be built with use_async_quorum=False (got True): "
                             "with an asynchronous quorum a healing replica sits the step out with zeros, and "
                             "gradpress's schedules read the quorum before anything is sent")
        self.manager = manager
        self.last_commit: bool | None = None
        self.quorums: list[tuple[int, int, int]] = []
        self.commits: list[bool] = []
        self.quorum_seconds: list[float] = []
        self.healed_bytes: list[int] = []

    # -- the SyncGroup protocol -------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This replica group's rank in the current quorum (``RuntimeError`` for a spare outside it)."""
        rank = self.manager.participating_rank()
        if rank is None:
            raise RuntimeError("FaultTolerantGroup: this replica group does not take part in the current quorum "
                               "(a spare of WorldSizeMode.FIXED_WITH_SPARES, or no quorum yet: call begin() "
                               "first); spares are not supported")
        return int(rank)

    @property
    def world(self) -> int:
        """How many replica groups take part in the current quorum."""
        return int(self.manager.num_participants())

    @property
    def process_group(self) -> Any:
        """torchft's reconfigurable process group (the Manager's), for the quorum's collectives."""
        return self.manager._pg  # torchft exposes no accessor; the Manager was built over it

    def begin(self) -> None:
        """Form the quorum of the next step or sync (``manager.start_quorum()``); a joiner is healed here
        (its registered state loaded) before this returns."""
        start = time.perf_counter()
        self.manager.start_quorum()
        self.quorum_seconds.append(time.perf_counter() - start)
        self.last_commit = None
        self.quorums.append((self.committed(), self.rank, self.world))

    def exchange(self, issuer: str) -> GroupExchange:
        """The compressed payloads' all-gather and all-to-all among the quorum's members."""
        return GroupExchange(self.process_group, issuer, rank=self.rank, world=self.world, gather_as_list=True)

    def failed(self) -> bool:
        """Whether a collective of the current step failed (reported to the Manager)."""
        return self.manager.errored() is not None

    def report(self, error: BaseException) -> None:
        """Tell the Manager a collective failed: the step will not commit."""
        self.manager.report_error(error if isinstance(error, Exception) else RuntimeError(str(error)))

    def commit(self) -> bool:
        """``manager.should_commit()``, asked once per step (every member votes); kept in :attr:`last_commit`."""
        self.last_commit = bool(self.manager.should_commit())
        self.commits.append(self.last_commit)
        return self.last_commit

    def committed(self) -> int:
        """Steps (syncs) committed so far: ``manager.current_step()``, copied to a joiner when it heals."""
        return int(self.manager.current_step())

    # -- PowerSGD ---------------------------------------------------------------------------------

    def communicator(self, issuer: str = "gradpress") -> ManagerCommunicator:
        """The engine's communicator over this group, for ``PowerSGD(..., communicator=)`` and
        ``PowerSGDState(None, ..., communicator=)``."""
        return ManagerCommunicator(self, issuer)

    # -- healing ----------------------------------------------------------------------------------

    def register(self, key: str, obj: Any) -> None:
        """Register ``obj``'s global state with the Manager's state-dict functions under ``key``, so that
        torchft copies it to a replica that joins: a :class:`~gradpress.StreamingDiLoCoAverager`
        (:meth:`~gradpress.StreamingDiLoCoAverager.global_state_dict`), a :class:`~gradpress.PowerSGD` or a
        :class:`~gradpress.PowerSGDState` (:func:`powersgd_global_state`: error memory left out, zero on the
        joiner), an ``nn.Module`` or ``torch.optim.Optimizer`` (its whole ``state_dict``). The state is
        copied when the quorum asks for it (torchft's transport serves it after :meth:`begin` returns,
        while training goes on). ``TypeError`` for anything else, ``ValueError`` for a key taken."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"register's key must be a non-empty string, got {key!r}")
        if key in getattr(self.manager, "_user_state_dicts", {}):
            raise ValueError(f"register: key {key!r} is already registered with this Manager")
        save: Callable[[], Any]
        load: Callable[[Any], None]
        if isinstance(obj, StreamingDiLoCoAverager):
            save, load = obj.global_state_dict, obj.load_global_state_dict
        elif isinstance(obj, (PowerSGD, PowerSGDState)):
            save = lambda: powersgd_global_state(obj)  # noqa: E731
            load = lambda state: obj.load_state_dict(state, allow_other_rank=True)  # noqa: E731
        elif isinstance(obj, (nn.Module, torch.optim.Optimizer)):
            save = lambda: clone_tensors(obj.state_dict())  # noqa: E731
            load = obj.load_state_dict
        else:
            raise TypeError(f"register's obj must be a StreamingDiLoCoAverager, PowerSGD, PowerSGDState, nn.Module "
                            f"or torch.optim.Optimizer, got {type(obj).__name__}")

        def counted(state: Any) -> None:
            self.healed_bytes.append(state_nbytes(state))
            load(state)

        self.manager.register_state_dict_fn(key, counted, save)


class _ManagedHandle:
    __slots__ = ("work", "buffer")

    def __init__(self, work: Any, buffer: Tensor) -> None:
        self.work, self.buffer = work, buffer

    def wait(self) -> Tensor:
        self.work.wait()  # torchft's work swallows a failure and reports it to the Manager
        return self.buffer


class ManagerCommunicator:
    """The PowerSGD engine's communicator over a :class:`FaultTolerantGroup`: sums and maxima through
    ``manager.allreduce`` (a failure is reported to the Manager, never raised; the buffer then holds
    garbage that no commit keeps), the quorum's size as ``world_size``, and :meth:`decide_step`,
    ``should_commit()``, asked once per optimizer step before the engine writes its memory.

    Example::

        state = gradpress.PowerSGDState(None, matrix_approximation_rank=4, communicator=group.communicator())
    """

    __slots__ = ("group", "issuer")

    def __init__(self, group: FaultTolerantGroup, issuer: str = "gradpress") -> None:
        self.group, self.issuer = group, issuer

    @property
    def world_size(self) -> int:
        return self.group.world

    def allreduce_sum(self, buffer: Tensor) -> _ManagedHandle:
        return _ManagedHandle(self.group.manager.allreduce(buffer, reduce_op=dist.ReduceOp.SUM), buffer)

    def allreduce_max(self, buffer: Tensor) -> _ManagedHandle:
        return _ManagedHandle(self.group.manager.allreduce(buffer, reduce_op=dist.ReduceOp.MAX), buffer)

    def decide_step(self) -> bool:
        return self.group.commit()


def powersgd_global_state(obj: PowerSGD | PowerSGDState) -> dict[str, Any]:
    """``obj.local_state_dict()`` without its error memory (every parameter's ``"error"`` ``None``: zero
    when loaded): the warm-start factors, counters, options and rank decisions, identical on every
    replica, that a joiner copies. ``ValueError`` for a ``batched_powerSGD_hook`` state holding per-bucket
    memory (not supported under torchft)."""
    state = obj.local_state_dict()
    if state.get("padded"):
        raise ValueError("powersgd_global_state: batched_powerSGD_hook's per-bucket memory is not supported under "
                         "torchft; use powerSGD_hook")
    state["memory"] = {key: {**entry, "error": None} for key, entry in state["memory"].items()}
    return clone_tensors(state)


def fault_tolerant_ddp(module: nn.Module, state: PowerSGDState,
                       hook: Callable[..., Any] = powerSGD_hook,
                       **ddp_kwargs: Any) -> nn.parallel.DistributedDataParallel:
    """``module`` in DDP the way torchft's ``DistributedDataParallel`` builds it (DDP's own collectives on
    a dummy one-rank group, ``find_unused_parameters=True`` so the buckets are never rebuilt and stay the
    same on a healed replica), with ``hook`` (default :func:`gradpress.powerSGD_hook`) over ``state``,
    whose communicator must be a :class:`FaultTolerantGroup`'s (``TypeError`` otherwise). torchft's own
    class hard-codes its all-reduce hook (``register_comm_hook`` cannot be called twice), hence this.

    Example::

        state = gradpress.PowerSGDState(None, matrix_approximation_rank=4, communicator=group.communicator())
        model = fault_tolerant_ddp(model, state)
        for batch in data:
            group.begin(); loss(model, batch).backward()
            if group.last_commit:             # decided at the iteration's last bucket
                optimizer.step()
            optimizer.zero_grad()
    """
    from torchft.process_group import ProcessGroupDummy

    if not isinstance(state, PowerSGDState) or not isinstance(state.communicator, ManagerCommunicator):
        raise TypeError("fault_tolerant_ddp's state must be a PowerSGDState built with "
                        "communicator=FaultTolerantGroup(manager).communicator(), got "
                        f"{type(state).__name__}")
    for name in ("process_group", "find_unused_parameters"):
        if name in ddp_kwargs:
            raise TypeError(f"fault_tolerant_ddp sets {name} itself (as torchft's DistributedDataParallel does)")
    model = nn.parallel.DistributedDataParallel(module, process_group=ProcessGroupDummy(0, 1),
                                                find_unused_parameters=True, **ddp_kwargs)
    model.register_comm_hook(state, hook)
    return model
