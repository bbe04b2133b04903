"""PyTorch's ``batched_powerSGD_hook``: each DDP bucket compressed as one zero-padded square matrix.

>>> import gradpress                                                            # doctest: +SKIP
>>> state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)  # doctest: +SKIP
>>> ddp_model.register_comm_hook(state, gradpress.batched_powerSGD_hook)        # doctest: +SKIP

The hook's memory is per bucket, not per parameter (:class:`PaddedBuckets`): the square view mixes the
bucket's parameters, so it cannot be split between them. It lives beside the state's per-parameter
memory, shares its workspace, and is saved in the state's checkpoint under ``"padded"``.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook checks the hook's annotations
# against ``dist.GradBucket`` itself, not a string.

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..powersgd.memory import ParamMemory, Segment, work_dtype_for
from ..powersgd.plan import make_plan
from ..powersgd.session import EngineSession
from ..powersgd.store import read_norms
from .powersgd import PowerSGDState

__all__ = ["PaddedBuckets", "batched_powerSGD_hook", "batched_powersgd_hook"]

logger = logging.getLogger(__name__)


def _seed_key(index: int) -> int:
    """The key bucket ``index``'s factors are drawn with: negative, so never a parameter's key."""
    return -1 - index


class PaddedBuckets:
    """``batched_powerSGD_hook``'s memory: per bucket index, its size, its segment (one ``s x s`` matrix,
    ``s = ceil(sqrt(numel))``) and the zero-padded square it compresses.

    ``saved``: the checkpoint form (:meth:`state_dict`: ``{index: {"numel", "shape", "error", "q", ...}}``);
    a bucket takes its saved memory when it is first seen again, and keeps it in the checkpoint until then.
    """

    __slots__ = ("session", "buckets", "saved")

    def __init__(self, session: EngineSession, saved: dict[Any, dict[str, Any]] | None = None) -> None:
        self.session = session
        self.buckets: dict[int, tuple[int, Segment, Tensor]] = {}
        self.saved = {int(index): entry for index, entry in (saved or {}).items()}

    @classmethod
    def of(cls, state: PowerSGDState) -> "PaddedBuckets":
        """The memory ``state`` keeps for this hook (built at first use, from its loaded checkpoint)."""
        return state.bucket_memory(lambda saved: cls(state.session, saved))

    def segment(self, index: int, buffer: Tensor) -> tuple[Segment, Tensor]:
        """The segment and the padded square of bucket ``index``; a bucket whose size or device changed
        starts with fresh memory (with a warning)."""
        numel = buffer.numel()
        entry = self.buckets.get(index)
        if entry is not None and entry[0] == numel and entry[1].device == buffer.device:
            return entry[1], entry[2]
        side = max(1, int(numel ** 0.5))
        while side * side < numel:
            side += 1
        config = self.session.config
        dtype = work_dtype_for(buffer.dtype)
        plan = make_plan([(side, side)], config.rank, min_compression_rate=0)
        key = _seed_key(index)
        segment = Segment(plan, [key], buffer.device, dtype, self.session.store.workspace)
        saved = self.saved.pop(index, None)
        if saved is not None:
            if saved["numel"] == numel:
                segment.load({key: ParamMemory.from_dict({**saved, "shape": (side, side)})}, config)
            else:
                logger.warning("batched_powerSGD_hook: bucket %s has %s elements, the checkpoint %s; its memory "
                               "is reset", index, numel, saved["numel"])
        elif entry is not None:
            logger.warning("batched_powerSGD_hook: bucket %s changed size (%s -> %s elements); its memory is "
                           "reset", index, entry[0], numel)
        square = torch.zeros(side, side, device=buffer.device, dtype=dtype)
        self.buckets[index] = (numel, segment, square)
        return segment, square

    def segments(self) -> list[Segment]:
        return [segment for _, segment, _ in self.buckets.values()]

    def scale_errors(self, factor: float) -> None:
        """Multiply the error memory of the buckets in use by ``factor`` (a learning-rate change)."""
        for segment in self.segments():
            segment.error_memory.mul_(factor)

    def approximation_norms(self) -> dict[str, tuple[float, float]]:
        """``{"bucket i": (||M||, ||M - P Q^T||)}`` of the last measured step; read on the host."""
        return self._named(read_norms([(s, s.norms) for s in self.segments()]))

    def global_residual_norms(self) -> dict[str, tuple[float, float]]:
        """``{"bucket i": (||mean M Omega||, ||(mean M - P Q^T) Omega||)}`` of the last measured step."""
        return self._named(read_norms([(s, s.global_norms) for s in self.segments()]))

    @staticmethod
    def _named(norms: dict[int, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        return {f"bucket {_seed_key(key)}": value for key, value in norms.items()}

    def state_dict(self) -> dict[int, dict[str, Any]]:
        """Per bucket index: ``numel`` and the memory (:class:`ParamMemory`'s form); buckets loaded but not
        seen again since keep their loaded memory."""
        config = self.session.config
        return {**self.saved,
                **{index: {"numel": numel, **segment.export(config)[_seed_key(index)].to_dict()}
                   for index, (numel, segment, _) in self.buckets.items()}}


def batched_powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    r"""PowerSGD on the whole bucket viewed as one zero-padded square matrix (PyTorch's batched hook).

    Cheaper than :func:`~gradpress.powerSGD_hook` (one small matrix product per bucket) but usually less
    accurate, since the square view mixes unrelated layers. A bucket of L elements becomes an ``s x s``
    matrix with ``s = ceil(sqrt(L))``; it sends ``2 s r`` numbers instead of L. Works where PyTorch's
    raises (it resizes DDP's bucket buffer in place; this one works on a padded copy).

    The memory of this hook is per bucket: if DDP changes a bucket's size, that bucket's memory is reset
    (with a warning). Same :class:`~gradpress.PowerSGDState`, counters, checkpoints and non-finite
    guarantees as :func:`~gradpress.powerSGD_hook`.
    """
    state = PowerSGDState.of(state, "batched_powerSGD_hook")
    if state.rank_policy is not None or state.adaptive_rank is not None:
        raise ValueError("batched_powerSGD_hook compresses each bucket as one matrix, so a PowerSGDState with "
                         "a rank_policy or an adaptive_rank cannot drive it; use powerSGD_hook")
    fut = state.start_bucket(bucket)
    if fut is not None:
        return fut
    buffer = bucket.buffer()
    numel = buffer.numel()
    segment, square = PaddedBuckets.of(state).segment(bucket.index(), buffer)
    flat = square.view(-1)
    flat[:numel].copy_(buffer)
    flat[numel:].zero_()
    return state.compress_bucket(bucket, segment, [square], buffer, numel=numel,
                                 finish=lambda: buffer.copy_(flat[:numel]))


batched_powersgd_hook = batched_powerSGD_hook
