"""A :class:`~gradpress.PowerSGDState`'s checkpoints: ``local_state_dict()`` (this rank's plain tensors and
numbers), ``state_dict()`` / ``load_state_dict()`` (the same, kept per rank by ``torch.distributed.checkpoint``:
:func:`gradpress.checkpoint.per_rank_state`) and pickling. A base class of ``PowerSGDState``; the state's
core is in :mod:`gradpress.hooks.powersgd`.

The local format: options, counters, the placement (rank and world size), parameter shapes, the adaptive
rank's decisions, ``"memory"`` (per-parameter error memory and factors, :meth:`EngineSession.memory_state
<gradpress.powersgd.EngineSession.memory_state>`) and ``"padded"`` (``batched_powerSGD_hook``'s per-bucket
memory, :class:`~gradpress.hooks.batched.PaddedBuckets`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..adaptive import AdaptiveRank
from ..autorank import AutoRank
from ..checkpoint import (check_placement, check_saved_options, per_rank_state, placement, read_per_rank,
                          reject_gathered)
from ..policy import RankRules
from .auto_rank import apply_rank

__all__ = ["StateCheckpoint"]

# PowerSGDState's log lines keep the logger of the module users know it from.
logger = logging.getLogger("gradpress.hooks.powersgd")

_STATE_DICT_VERSION = 1

# AutoRank's options that only choose the rank from what was measured (see load_state_dict).
_CHOOSING = ("threshold", "min_rank", "criterion", "noise_multiple", "width_floor")


# Options that decide what the memory means; a checkpoint must agree with the state on them.
_MEMORY_OPTIONS = ("matrix_approximation_rank", "min_compression_rate", "use_error_feedback", "warm_start",
                   "random_seed", "num_iters_per_step")


class _State(Protocol):
    """What :class:`StateCheckpoint`'s methods use of the ``PowerSGDState`` they are part of: its options,
    counters, engine session, parameter keys and per-bucket memory."""

    process_group: dist.ProcessGroup | None
    start_powerSGD_iter: int
    compression_stats_logging_frequency: int
    batch_tensors_with_same_shape: bool
    comm_device: torch.device | None
    approximation_error_every_n_iters: int | None
    global_residual_every_n_iters: int | None
    iter: int
    next_stats_report: int
    total_numel_before_compression: int
    total_numel_after_compression: int
    total_bytes_before_compression: int
    total_bytes_after_compression: int
    _session: Any
    _params: Any
    _bucket_memory: Any
    _lr_iter: int
    _auto: Any

    # Read-only: the engine configuration's (the memory's meaning depends on them) and the policies given.
    @property
    def matrix_approximation_rank(self) -> int: ...
    @property
    def min_compression_rate(self) -> float: ...
    @property
    def use_error_feedback(self) -> bool: ...
    @property
    def warm_start(self) -> bool: ...
    @property
    def orthogonalization_epsilon(self) -> float: ...
    @property
    def random_seed(self) -> int: ...
    @property
    def num_iters_per_step(self) -> int | None: ...
    @property
    def bytes_per_weight(self) -> int | None: ...
    @property
    def warm_up_bytes_per_weight(self) -> int | None: ...
    @property
    def feedback_every_n_iters(self) -> int: ...
    @property
    def warm_up_beta_factor(self) -> float | None: ...
    @property
    def orient_matrices(self) -> bool | str: ...
    @property
    def half_precision_wire(self) -> str: ...
    @property
    def orthogonalization(self) -> str: ...
    @property
    def rank_policy(self) -> RankRules | None: ...
    @property
    def adaptive_rank(self) -> AdaptiveRank | None: ...

    def local_state_dict(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_other_rank: bool = False,
                        on_world_size_change: str = "raise") -> None: ...


class StateCheckpoint:
    """The checkpoint half of :class:`~gradpress.PowerSGDState` (see the module docstring)."""

    __slots__ = ()
    # Replaced whole by load_state_dict (a hook's per-bucket memory, or its checkpoint form).
    _bucket_memory: Any

    def local_state_dict(self: _State) -> dict[str, Any]:
        """This rank's state as plain tensors and numbers: counters, options, the placement (rank and world
        size of ``process_group``) and per-parameter error memory and Q; what ``torch.save`` of
        ``state_dict()`` held per rank before :meth:`state_dict` took the per-rank layout, and what
        :meth:`load_state_dict` still accepts.

        No process group, nothing tied to a device or to DDP's bucket layout. Call between iterations
        (on every rank that will resume; each rank's error memory is its own).
        """
        if self._session.in_flight():
            raise RuntimeError("PowerSGDState.state_dict() was called while a backward pass is in flight")
        return {
            "version": _STATE_DICT_VERSION,
            "placement": placement(self.process_group),
            "options": {
                "matrix_approximation_rank": self.matrix_approximation_rank,
                "min_compression_rate": self.min_compression_rate,
                "use_error_feedback": self.use_error_feedback,
                "warm_start": self.warm_start,
                "orthogonalization_epsilon": self.orthogonalization_epsilon,
                "random_seed": self.random_seed,
                "start_powerSGD_iter": self.start_powerSGD_iter,
                "compression_stats_logging_frequency": self.compression_stats_logging_frequency,
                "batch_tensors_with_same_shape": self.batch_tensors_with_same_shape,
                "comm_device": None if self.comm_device is None else str(self.comm_device),
                "num_iters_per_step": self.num_iters_per_step,
                "bytes_per_weight": self.bytes_per_weight,
                "feedback_every_n_iters": self.feedback_every_n_iters,
                "warm_up_beta_factor": self.warm_up_beta_factor,
                "approximation_error_every_n_iters": self.approximation_error_every_n_iters,
                **({} if self.global_residual_every_n_iters is None
                   else {"global_residual_every_n_iters": self.global_residual_every_n_iters}),
                # A mapping policy is plain data; a function policy is kept by pickling only (__getstate__).
                "rank_policy": self.rank_policy if isinstance(self.rank_policy, dict) else None,
                "adaptive_rank": None if self.adaptive_rank is None else self.adaptive_rank.to_dict(),
                **({} if self._auto is None else {"auto_rank": self._auto.rule.to_dict()}),
                # The memory's factors belong to one side of each wide matrix: the orientation it was built in
                # (the setting while no memory exists; checkpoints from before the option: PyTorch's view).
                "orient_matrices": self.orient_matrices if self._session.oriented is None else self._session.oriented,
                # Only when set: checkpoints keep the keys they had before the option existed.
                **({} if self.warm_up_bytes_per_weight is None
                   else {"warm_up_bytes_per_weight": self.warm_up_bytes_per_weight}),
                **({} if self.half_precision_wire == "auto" else {"half_precision_wire": self.half_precision_wire}),
                **({} if self.orthogonalization == "auto" else {"orthogonalization": self.orthogonalization}),
            },
            "adaptive": self._params.adaptive_state(),
            # The automatic rank's decision (matrix_approximation_rank above holds it), or its measurement so far.
            **({} if self._auto is None else {"auto_rank": self._auto.state()}),
            "last_lr": self._session.last_lr,
            "total_bytes_before_compression": self.total_bytes_before_compression,
            "total_bytes_after_compression": self.total_bytes_after_compression,
            "iter": self.iter,
            "total_numel_before_compression": self.total_numel_before_compression,
            "total_numel_after_compression": self.total_numel_after_compression,
            "next_stats_report": self.next_stats_report,
            "param_shapes": [list(shape) for shape in self._params.shapes],
            "memory": self._session.memory_state(),
            "padded": dict(memory) if isinstance(memory := self._bucket_memory, dict) else memory.state_dict(),
        }

    def state_dict(self: _State) -> dict[str, Any]:
        """:meth:`local_state_dict` under this process's global rank (:func:`~gradpress.checkpoint.per_rank_state`):
        ``{"format", "world_size", "per_rank": {"rank_<r>": <serialized local_state_dict>}}``. Every rank's
        entry has its own key, so ``torch.distributed.checkpoint`` keeps each rank's (``dcp.save({"powersgd":
        state})`` on every rank; the state is a Stateful); ``torch.save`` per rank and
        :func:`~gradpress.checkpoint.gather_state` take it as well. Call between iterations."""
        return per_rank_state(self.local_state_dict())

    def load_state_dict(self: _State, state_dict: dict[str, Any], *, allow_other_rank: bool = False,
                        on_world_size_change: str = "raise") -> None:
        """Restore what :meth:`state_dict` or :meth:`local_state_dict` saved (files from before the per-rank
        layout hold the latter); tensors may come from another device.

        Raises ``ValueError`` if the checkpoint was made with different compression options, or on another
        rank or world size (checkpoints without this record are accepted; ``allow_other_rank=True`` skips
        the rank/world-size check). ``on_world_size_change="fresh"``: a :meth:`state_dict` saved by another
        world size is not loaded, and the state stays as it is (as constructed, in a resume): error memory
        from zero and ``iter`` from 0, so it sends plain allreduce again for its ``start_powerSGD_iter``
        iterations, as :func:`~gradpress.checkpoint.scatter_state` does with that option.
        """
        reject_gathered(state_dict, "PowerSGDState.load_state_dict")
        local, loaded = read_per_rank(state_dict, "PowerSGDState", on_world_size_change=on_world_size_change,
                                      allow_other_rank=allow_other_rank)
        if not loaded:
            return
        state_dict = local
        if state_dict.get("version") != _STATE_DICT_VERSION:
            raise ValueError(f"unsupported PowerSGDState state_dict version {state_dict.get('version')!r}; "
                             f"expected {_STATE_DICT_VERSION}")
        adaptive = None if self.adaptive_rank is None else self.adaptive_rank.to_dict()
        remedy = "construct the state with the same value to resume"
        auto = None if self._auto is None else self._auto.rule.to_dict()
        saved_auto = state_dict["options"].get("auto_rank")
        saved_auto = None if saved_auto is None else AutoRank.from_saved(saved_auto).to_dict()
        decided = (state_dict.get("auto_rank") or {}).get("rank")
        if decided is not None and auto is not None and saved_auto is not None:
            # A decision taken is kept: the options that only choose (threshold, floor) no longer matter, so
            # a checkpoint saved under another default threshold still resumes; those that shape what was
            # measured (max_rank, measure_iters) must agree.
            choosing = {name: (saved_auto[name], auto[name]) for name in _CHOOSING if saved_auto[name] != auto[name]}
            if choosing:
                logger.info("PowerSGDState auto_rank: the checkpoint's decision, rank %s, stands (taken with %s; "
                            "this state's %s chooses only before a decision)", decided,
                            ", ".join(f"{n}={old}" for n, (old, _) in choosing.items()),
                            ", ".join(f"{n}={new}" for n, (_, new) in choosing.items()))
                saved_auto = saved_auto | {name: auto[name] for name in choosing}
        check_saved_options({"auto_rank": saved_auto}, {"auto_rank": auto}, "PowerSGDState", remedy)
        if self._auto is not None and "auto_rank" in state_dict:  # a decision is kept, never taken again
            self._auto.load(state_dict["auto_rank"])
            if self._auto.rank is not None:
                apply_rank(self._auto.rank, self._session, self._params)
        check_saved_options(state_dict["options"], {name: getattr(self, name) for name in _MEMORY_OPTIONS} |
                            {"adaptive_rank": adaptive}, "PowerSGDState", remedy)
        check_placement(state_dict.get("placement"), placement(self.process_group), "PowerSGDState",
                        allow_other_rank)
        if self._session.in_flight():
            raise RuntimeError("PowerSGDState.load_state_dict() was called while a backward pass is in flight")
        oriented = state_dict["options"].get("orient_matrices", False)
        if isinstance(oriented, bool) and oriented != self.orient_matrices:
            logger.info("PowerSGDState: the checkpoint's memory was built with orient_matrices=%s; this state "
                        "follows it (its factors belong to that orientation)", oriented)
            self._session.configure(dataclasses.replace(self._session.config, orient=oriented))
        self.iter = int(state_dict["iter"])
        self.total_numel_before_compression = int(state_dict["total_numel_before_compression"])
        self.total_numel_after_compression = int(state_dict["total_numel_after_compression"])
        self.next_stats_report = int(state_dict["next_stats_report"])
        self._session.last_lr = state_dict.get("last_lr")
        self._lr_iter = -1
        self.total_bytes_before_compression = int(state_dict.get("total_bytes_before_compression", 0))
        self.total_bytes_after_compression = int(state_dict.get("total_bytes_after_compression", 0))
        self._params.load(state_dict["param_shapes"], state_dict.get("adaptive", {}))
        self._session.load_memory_state(state_dict["memory"])
        self._bucket_memory = dict(state_dict.get("padded") or {})

    def __getstate__(self: _State) -> dict[str, Any]:
        state = self.local_state_dict()
        if self.rank_policy is not None:
            state["options"]["rank_policy"] = self.rank_policy
        return state

    def __setstate__(self: _State, state: dict[str, Any]) -> None:
        options = dict(state["options"])
        if isinstance(options.get("auto_rank"), dict):
            options["auto_rank"] = AutoRank.from_saved(options["auto_rank"])
        self.__init__(None, **options)  # type: ignore[misc]  # re-runs PowerSGDState.__init__ on purpose
        self.load_state_dict(state, allow_other_rank=True)  # a copy, not a resume on a given rank
        if dist.is_available() and dist.is_initialized():
            logger.warning("PowerSGDState unpickled: process_group is the default group; set "
                           "state.process_group if another group is wanted.")
