"""How a :class:`~gradpress.PowerSGDState`'s DDP buckets reach the engine: the warm-up's exact average, the
compressed iteration (every bucket held until the last and compressed in one step, each bucket's P phase
issued as it arrives, or each bucket on its own under ``commit_each_bucket()``), and the futures DDP
waits on. A base class of ``PowerSGDState``; the state's core is in :mod:`gradpress.hooks.powersgd`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ..powersgd.memory import Segment
from ..powersgd.seeding import RESIZE_DRAW
from ..powersgd.session import EngineSession
from ..powersgd.transport import Communicator, decision_of
from .auto_rank import decide_rank, measure_bucket
from .iteration import StartedBuckets, WaitingBuckets, bucket_segment, overlap_pays
from .parameters import ParameterKeys

__all__ = ["StateBuckets"]


class _Driven(Protocol):
    """What :class:`StateBuckets`'s methods use of the ``PowerSGDState`` they are part of."""

    iter: int
    start_powerSGD_iter: int
    overlap: str
    random_seed: int
    _session: EngineSession
    _params: ParameterKeys
    _waiting: WaitingBuckets
    _started: StartedBuckets
    _bucket_memory: Any
    _lr_iter: int
    _auto: Any

    @property
    def num_iters_per_step(self) -> int | None: ...
    @property
    def matrix_approximation_rank(self) -> int: ...
    @property
    def min_compression_rate(self) -> float: ...
    @property
    def warm_up_bytes_per_weight(self) -> int | None: ...

    def _communicator(self) -> Communicator: ...
    def _sync_lr(self, force: bool = False) -> None: ...
    def _measure(self) -> bool: ...
    def _measure_global(self) -> bool: ...
    def _report_stats(self) -> None: ...
    def maybe_increase_iter(self, bucket: Any) -> None: ...
    def _hand_over(self, bucket: Any, result: Tensor, start: Callable[..., object], compressed: bool,
                   finish: Callable[[], Any] | None = None) -> torch.futures.Future: ...
    def _move_to_another_model(self) -> None: ...
    def compress_bucket(self, bucket: Any, segment: Segment, tensors: list[Tensor], result: Tensor, *,
                        numel: int | None = None, finish: Callable[[], Any] | None = None,
                        track: bool = False) -> torch.futures.Future: ...
    def _overlaps(self, tensors: list[Tensor]) -> bool: ...
    def _start_p_phase(self, bucket: Any, tensors: list[Tensor], track: bool, on_done: Callable[[], None],
                       on_fail: Callable[[BaseException], None]) -> None: ...


class StateBuckets:
    """The bucket half of :class:`~gradpress.PowerSGDState` (see the module docstring)."""

    __slots__ = ()
    # Replaced whole when the state moves to another model (a hook's per-bucket memory, or its checkpoint form).
    _bucket_memory: Any

    def _hand_over(self: _Driven, bucket: Any, result: Tensor, start: Callable[..., object], compressed: bool,
                   finish: Callable[[], Any] | None = None) -> torch.futures.Future:
        """Give ``bucket``'s work to the engine with ``start(on_done=, on_fail=)`` (one session call) and
        return a future completed with ``result`` once the outputs are written (``finish`` runs just
        before): at the iteration's last bucket, which ends the optimizer step, or as soon as the bucket's
        step ends after :meth:`commit_each_bucket`."""
        fut: torch.futures.Future = torch.futures.Future()

        def done() -> None:
            if finish is not None:
                finish()
            fut.set_result(result)

        start(on_done=done, on_fail=fut.set_exception)
        if bucket.is_last():
            self._session.finish(decision_of(self._communicator()))
            adaptive = self._params.adaptive
            if compressed and adaptive is not None \
                    and (self.iter - self.start_powerSGD_iter + 1) % adaptive.every == 0:
                self._params.adapt(self._session.store, self._communicator(), self.random_seed,
                                   RESIZE_DRAW | self.iter)
            if compressed:
                self._report_stats()
            self.maybe_increase_iter(bucket)
        return fut


    def start_bucket(self: _Driven, bucket: Any) -> torch.futures.Future | None:
        """Begin a hook's work on ``bucket``: before ``start_powerSGD_iter`` average it exactly and return
        the future (parameters are still given their keys, in DDP's first layout); after, ``None``, and
        the hook compresses it with :meth:`compress_bucket`. Moves the state to a new DDP model once its model
        is done (fresh memory, with a warning); refuses two models trained with it."""
        if self._params.starts_another_model(bucket):
            self._move_to_another_model()
        self._params.note_bucket(bucket)
        if self.iter >= self.start_powerSGD_iter:
            # automatic rank: once, at the first compressed bucket
            decide_rank(self._auto, bucket, self._communicator, self.matrix_approximation_rank, self._session,
                        self._params)
            return None
        self._params.keys_for(bucket.parameters())
        measure = measure_bucket(self._auto, self._params, bucket, self.iter, self.start_powerSGD_iter,
                                 self.random_seed, self.min_compression_rate)  # automatic rank: the last warm-up
        # The exact average goes through the engine's communicator and pipeline, in bucket order, like the
        # compressed steps (each gradient with its own fp16 scale); counted only on warm_up_bytes_per_weight.
        average = partial(self._session.average, bucket.gradients(), self._communicator(), flat=bucket.buffer(),
                          counted=self.warm_up_bytes_per_weight is not None,
                          bucket=bucket.index() if isinstance(bucket, dist.GradBucket) else None)
        return self._hand_over(bucket, bucket.buffer(), average, compressed=False, finish=measure)

    def _move_to_another_model(self: _Driven) -> None:
        """PyTorch's pattern of registering a finished model's state on a new DDP model: the new model
        starts with fresh error memory and factors (its buckets are not the old one's); the iteration
        count and the statistics go on, as in PyTorch."""
        warnings.warn("PowerSGDState: this state now serves another DDP model than the one it was used with; its "
                      "error memory and warm-start factors start afresh for the new model (the iteration count "
                      "goes on). The old model's parameters are refused from now on: give each model that trains "
                      "its own PowerSGDState", stacklevel=4)
        self._session.drain()
        self._session.forget_memory()
        self._waiting.clear()
        self._started.clear()
        self._bucket_memory = {}
        self._params = self._params.moved_to_another_model()
        self._lr_iter = -1

    def compress_bucket(self: _Driven, bucket: Any, segment: Segment, tensors: list[Tensor], result: Tensor, *,
                        numel: int | None = None, finish: Callable[[], Any] | None = None,
                        track: bool = False) -> torch.futures.Future:
        """Compress ``tensors`` (``segment``'s, in plan order) in this iteration's step and return a future
        completed with ``result`` once the outputs are written (at the iteration's last bucket, or at once
        after :meth:`commit_each_bucket`); ``finish`` runs just before. ``numel``: gradient elements the
        bucket stands for (default: the plan's); ``track``: feed the adaptive rank."""
        self._sync_lr()
        run = partial(self._session.run, segment, tensors, self._communicator(), self.iter - self.start_powerSGD_iter,
                      numel=numel, dtype=result.dtype, measure=self._measure(), track=track,
                      global_residual=self._measure_global())
        return self._hand_over(bucket, result, run, compressed=True, finish=finish)

    def compress_with_step(self: _Driven, bucket: Any, tensors: list[Tensor], result: Tensor, *,
                           track: bool = False) -> torch.futures.Future:
        """:meth:`compress_bucket` for all buckets of the iteration at once, in one engine step per (device,
        dtype) at the last bucket (:mod:`gradpress.hooks.iteration`); :meth:`commit_each_bucket` turns it off."""
        if self._session.commit_each_bucket:
            segment = bucket_segment(self._params, self._session, bucket.index(), bucket.parameters(), tensors)
            return self.compress_bucket(bucket, segment, tensors, result, track=track)
        if self._overlaps(tensors):
            start_p = partial(self._start_p_phase, bucket, tensors, track)
            return self._hand_over(bucket, result, start_p, compressed=True)

        def start(on_done: Callable[[], None], on_fail: Callable[[BaseException], None]) -> None:
            self._waiting.add(bucket.parameters(), tensors, on_done, on_fail)
            if bucket.is_last():
                self._sync_lr()
                self._waiting.run(self._params, self._session, self._communicator(),
                                  self.iter - self.start_powerSGD_iter, measure=self._measure(), track=track,
                                  global_residual=self._measure_global())
        return self._hand_over(bucket, result, start, compressed=True)

    def _overlaps(self: _Driven, tensors: list[Tensor]) -> bool:
        """Whether this iteration issues each bucket's P phase as the bucket arrives (``overlap``; ``"auto"``:
        where that was measured faster, docs/design.md)."""
        if self.overlap == "auto":
            return bool(tensors) and self.num_iters_per_step is None and overlap_pays(tensors[0].device)
        return self.overlap == "p-phase"

    def _start_p_phase(self: _Driven, bucket: Any, tensors: list[Tensor], track: bool, on_done: Callable[[], None],
                       on_fail: Callable[[BaseException], None]) -> None:
        self._sync_lr()
        self._started.start(self._params, self._session, self._communicator(), self.iter - self.start_powerSGD_iter,
                            bucket.index(), bucket.parameters(), tensors, measure=self._measure(), track=track,
                            global_residual=self._measure_global(), on_done=on_done, on_fail=on_fail)
        if bucket.is_last():
            self._started.finish(self._session, self._communicator(), on_fail)
