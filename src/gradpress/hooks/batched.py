"""PyTorch's ``batched_powerSGD_hook``: each DDP bucket compressed as one zero-padded square matrix.

>>> import gradpress                                                            # doctest: +SKIP
>>> state = gradpress.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)  # doctest: +SKIP
>>> ddp_model.register_comm_hook(state, gradpress.batched_powerSGD_hook)        # doctest: +SKIP
"""

import torch
import torch.distributed as dist
from torch import Tensor

from .powersgd import PowerSGDState

__all__ = ["batched_powerSGD_hook", "batched_powersgd_hook"]


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
    segment, square = state.session.padded_segment(bucket.index(), buffer)
    flat = square.view(-1)
    flat[:numel].copy_(buffer)
    flat[numel:].zero_()
    return state.compress_bucket(bucket, segment, [square], buffer, numel=numel,
                                 finish=lambda: buffer.copy_(flat[:numel]))


batched_powersgd_hook = batched_powerSGD_hook
