"""What the overhead benchmark feeds the hooks: a model's parameter shapes (built on the meta device by
:mod:`gradpress.tools.zoo`) in DDP's initial bucket layout
(``torch.distributed._compute_bucket_assignment_by_size`` with caps ``[1 MB, 25 MB]`` over the parameters in
definition order, bucket list reversed, so bucket 0 holds the last layers and the 1 MB bucket with the stem is
the last one). Each bucket has a flat buffer whose gradients are views into it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ...hooks.bucket import DenseBucket
from .. import zoo
from .summary import MB

__all__ = ["DEFAULT_BUCKET_CAPS", "MODELS", "FakeBucket", "make_buckets", "model_names", "model_parameters"]

DEFAULT_BUCKET_CAPS = (1 * MB, 25 * MB)  # DDP: _DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_mb=25

#: Short names used in BENCHMARKS.md -> :mod:`gradpress.tools.zoo` names. Every zoo built-in is accepted too.
MODELS: dict[str, str] = {"resnet18": "resnet18-cifar", "resnet50": "resnet50"}


def model_names() -> list[str]:
    """Names :func:`model_parameters` accepts: the short names, then :func:`gradpress.tools.zoo.model_names`."""
    return list(MODELS) + [name for name in zoo.model_names() if name not in MODELS]


def model_parameters(name: str) -> list[Tensor]:
    """The model's parameters (meta tensors), in definition order (tied weights once). ``name``: a built-in
    (:func:`model_names`) or ``module.path:factory``, the user's own model as ``gradpress inspect`` takes it."""
    if name not in MODELS and name not in zoo.MODELS and ":" not in name:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(model_names())}, or module.path:factory")
    return [p.detach() for p in zoo.build_model(MODELS.get(name, name)).parameters()]


class FakeBucket(DenseBucket):
    """A ``dist.GradBucket`` stand-in: a new flat buffer of ``dtype`` and per-parameter gradient views into it."""

    __slots__ = ()

    def __init__(self, index: int, params: list[Tensor], is_last: bool, dtype: torch.dtype) -> None:
        super().__init__(index, is_last, params, torch.empty(sum(p.numel() for p in params), dtype=dtype))


def make_buckets(params: list[Tensor], caps: Sequence[int] = DEFAULT_BUCKET_CAPS,
                 dtype: torch.dtype = torch.float32) -> list[FakeBucket]:
    """DDP's initial bucket layout: assignment by size in definition order, bucket list reversed."""
    indices, _ = dist._compute_bucket_assignment_by_size(params, list(caps))
    indices = list(reversed(indices))
    return [FakeBucket(i, [params[j] for j in idx], i == len(indices) - 1, dtype)
            for i, idx in enumerate(indices)]

