"""Plain and cast communication hooks, drop-in for ``torch.distributed.algorithms.ddp_comm_hooks``.

>>> model.register_comm_hook(None, gradpress.fp16_compress_hook)                    # doctest: +SKIP
>>> state = gradpress.PowerSGDState(None, matrix_approximation_rank=2)              # doctest: +SKIP
>>> model.register_comm_hook(state, gradpress.bf16_compress_wrapper(gradpress.powerSGD_hook))  # doctest: +SKIP
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import check_process_group, start_average
from .bucket import CastBucket, check_hook, future_tensor

__all__ = ["allreduce_hook", "allreduce_mean_future", "bf16_compress_hook", "bf16_compress_wrapper",
           "fp16_compress_hook", "fp16_compress_wrapper"]

Hook = Callable[[Any, Any], torch.futures.Future]


def allreduce_mean_future(buffer: Tensor, process_group: dist.ProcessGroup | None = None,
                          wire_dtype: torch.dtype | None = None,
                          comm_device: torch.device | str | None = None,
                          issuer: str = "allreduce_mean_future") -> torch.futures.Future:
    """Start averaging ``buffer`` over the group; the future's value is ``buffer`` holding the mean.

    :func:`gradpress.comm.start_average` of the one buffer: divided by the world size *before* the sum (no
    fp16 overflow), optionally cast to ``wire_dtype`` and moved to ``comm_device`` for the trip (else
    averaged in place). The completion callback only copies. If the collective fails, the future's error
    is a :class:`gradpress.comm.CollectiveError` naming it and ``issuer`` (e.g. ``"allreduce_hook, bucket 3"``).
    """
    return start_average([buffer], process_group, wire_dtype=wire_dtype, comm_device=comm_device,
                         issuer=issuer).get_future()


def _check_group(process_group: Any, hook: str, wrapper: str | None = None) -> None:
    """The state of a plain hook is its process group: anything else is a clear ``TypeError`` at the
    first call (DDP's ``register_comm_hook`` does not look at the state). ``wrapper``: the wrapper that
    runs PowerSGD under this hook's cast, named when the state is PowerSGD's."""
    hint = "register the hook with None (the default group) or a process group as its state"
    if type(process_group).__name__ == "PowerSGDState":   # not imported: gradpress.hooks.powersgd imports us
        hint = "a PowerSGDState is the state of powerSGD_hook" + (
            f"; for PowerSGD on its buckets register {wrapper}(powerSGD_hook) with that state" if wrapper else "")
    check_process_group(process_group, f"{hook}'s state (the first argument given to register_comm_hook)", hint)


def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Average the bucket over ``process_group`` (``None``: the default group). Same as DDP without a hook."""
    _check_group(process_group, "allreduce_hook")
    return allreduce_mean_future(bucket.buffer(), process_group, issuer=f"allreduce_hook, bucket {bucket.index()}")


def fp16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Average the bucket with half the bytes: cast to fp16, divide by the world size, sum, cast back."""
    _check_group(process_group, "fp16_compress_hook", "fp16_compress_wrapper")
    return allreduce_mean_future(bucket.buffer(), process_group, wire_dtype=torch.float16,
                                 issuer=f"fp16_compress_hook, bucket {bucket.index()}")


def bf16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Like :func:`fp16_compress_hook` with bfloat16 (fp32's range, 8 bits of mantissa)."""
    _check_group(process_group, "bf16_compress_hook", "bf16_compress_wrapper")
    return allreduce_mean_future(bucket.buffer(), process_group, wire_dtype=torch.bfloat16,
                                 issuer=f"bf16_compress_hook, bucket {bucket.index()}")


# DDP refuses to register a hook whose __name__ is "bf16_compress_hook" unless CUDA and NCCL are present
# (PyTorch's bf16 hook needs them); this one works on gloo too, so it goes by another name internally.
bf16_compress_hook.__name__ = "gradpress_bf16_compress_hook"


def _cast_wrapper(hook: Hook, dtype: torch.dtype) -> Hook:
    check_hook(hook)

    def cast_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        buffer = bucket.buffer()
        fut = hook(state, CastBucket(bucket, buffer.to(dtype)))

        def cast_back(f: torch.futures.Future) -> Tensor:
            buffer.copy_(future_tensor(f.value()))
            return buffer

        return fut.then(cast_back)

    cast_hook.__name__ = f"{torch.finfo(dtype).dtype}_wrapped_{getattr(hook, '__name__', 'hook')}"
    cast_hook.__doc__ = f"{getattr(hook, '__name__', 'hook')} run on a {dtype} copy of the bucket."
    return cast_hook


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on an fp16 copy of each bucket and cast the result back.

    With :func:`~gradpress.powerSGD_hook` the factors are still computed and orthogonalized in fp32.
    """
    return _cast_wrapper(hook, torch.float16)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a bfloat16 copy of each bucket and cast the result back."""
    return _cast_wrapper(hook, torch.bfloat16)
