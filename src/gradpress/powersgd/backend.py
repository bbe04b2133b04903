"""How the engine's kernels run on a kind of device: the one place that asks what a device is.

Two backends. :data:`CPU`: reading a value on the host is free (the ops have finished when they
return), a Python loop over matrices costs about what a foreach op does, and some products are faster
per matrix or as fused multiply-adds. :data:`DEVICE` (GPUs, and any device whose reads wait for a
stream): nothing is read on the host, every choice between a finite and a non-finite outcome is made on
the device, and ops are issued per shape group or per buffer, never per matrix ("no host reads on the
hot path", "one collective per phase" in docs/design.md).

A segment takes its backend from its device (:func:`backend_for`); :func:`forced` runs CPU tensors down
the :data:`DEVICE` path, which is how the tests check the accelerator path on a machine without one.

>>> import torch
>>> backend_for(torch.device("cpu")).name, backend_for(torch.device("meta")).name
('cpu', 'device')
>>> with forced(DEVICE):
...     backend_for(torch.device("cpu")).name
'device'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

__all__ = ["CPU", "DEVICE", "Backend", "backend_for", "forced", "upload"]


class Backend:
    """The kernels whose best form depends on the device (see the module docstring).

    ``reads_wait``: reading a tensor's value on the host waits for the device. ``orthogonalization``:
    what ``EngineConfig(orthogonalization="auto")`` means here (a name of
    :data:`~gradpress.powersgd.linalg.ORTHOGONALIZATIONS`).
    """

    name = "device"
    reads_wait = True
    orthogonalization = "cholesky"
    #: What ``orient_matrices="auto"`` means here: a transpose costs a strided copy, and a shape group fewer
    #: saves a dozen kernel launches (GPT-2 small: 131 -> 120 ops).
    orients_matrices = True

    def __repr__(self) -> str:
        return f"<gradpress engine backend {self.name!r}>"

    # --- elementwise ----------------------------------------------------------------------------------
    def add_into(self, targets: list[Tensor], first: Sequence[Tensor], second: Sequence[Tensor] | None) -> None:
        """``targets[i] = first[i] + second[i]`` (``second=None``: a copy of ``first``): a fused copy, then
        one fused add for all."""
        torch._foreach_copy_(targets, list(first))
        if second is not None:
            torch._foreach_add_(targets, list(second))

    def all_finite(self, tensor: Tensor) -> Tensor:
        """Whether every value of ``tensor`` is finite: a 0-d bool tensor on its device, nothing read.
        ``(x * 0).sum() == 0``: an inf or NaN makes a NaN there, and nothing finite can overflow; three
        kernels, where ``isfinite(x).all()`` is five (``isfinite`` is ``x == x`` and ``|x| != inf``)."""
        return torch.mul(tensor, 0).sum() == 0

    # --- products ------------------------------------------------------------------------------------
    def product(self, a: Tensor, b: Tensor, out: Tensor) -> None:
        """``out = a @ b`` for a shape group ``(B, ., .)``: one ``bmm``."""
        torch.bmm(a, b, out=out)

    def product_add(self, a: Tensor, b: Tensor, out: Tensor, alpha: float) -> None:
        """``out += alpha * a @ b`` for a shape group: one ``baddbmm``."""
        out.baddbmm_(a, b, alpha=alpha)

    def fused_outer(self, rank: int, numel: int) -> bool:
        """Whether ``P Q^T`` of rank ``rank`` into ``numel`` elements is r fused multiply-adds instead of a
        GEMM (never here: a kernel per rank)."""
        return False

    def per_matrix(self, batch: int, rank: int) -> bool:
        """Whether a group's work (a product, a sketch) goes one matrix at a time (never here)."""
        return False

    # --- the scaled fp16 wire -------------------------------------------------------------------------
    def peaks(self, views: list[Tensor]) -> Tensor:
        """Each view's largest |value| (fp32; NaN where the view has one): one ``_foreach_norm(inf)``."""
        return torch.stack(torch._foreach_norm(views, float("inf"))).float()

    @property
    def span_tables(self) -> bool:
        """Whether per-span scales reach the elements through a table of span lengths on the device
        (``repeat_interleave``), rather than through one ``_foreach_mul_`` of 0-d scales (a kernel per span
        here)."""
        return True

    @property
    def keeps_wire_buffers(self) -> bool:
        """Whether the half-precision warm-up keeps a wire buffer per bucket between iterations (where a
        fresh buffer is fresh pages from the kernel, a quarter of that warm-up's cost on GPT-2 small)."""
        return False


class _CpuBackend(Backend):
    """The CPU: values are read for free, loops over matrices cost what foreach ops do."""

    name = "cpu"
    reads_wait = False
    orthogonalization = "householder"  # one LAPACK call per group: 4.4x faster here (benchmarks/orthogonalize.py)
    # A transposed gradient is a strided pass each way (ResNet-18 at rank 2: a step of 46 ms took 130 ms
    # oriented); an op saved costs microseconds here.
    orients_matrices = False

    def add_into(self, targets: list[Tensor], first: Sequence[Tensor], second: Sequence[Tensor] | None) -> None:
        """One pass per matrix (a fused copy then an add take two: on the CPU as costly as a kernel per
        matrix is not)."""
        if second is None:
            torch._foreach_copy_(targets, list(first))
            return
        for target, a, b in zip(targets, first, second):
            torch.add(a, b, out=target)

    def all_finite(self, tensor: Tensor) -> Tensor:
        """From the largest and smallest value (two vectorized reductions, which propagate NaN: 6x faster
        here than ``isfinite(...).all()``, which writes a bool per element)."""
        if not tensor.numel():
            return torch.isfinite(tensor).all()
        return torch.isfinite(torch.stack([tensor.amax(), tensor.amin()])).all()

    def product(self, a: Tensor, b: Tensor, out: Tensor) -> None:
        """One ``mm`` per matrix for a group of one or a rank-1 product (a matrix-vector product, which MKL's
        batched path handles poorly), else one ``bmm``."""
        if self.per_matrix(out.shape[0], min(out.shape[1], out.shape[2])):
            for x, y, o in zip(a.unbind(0), b.unbind(0), out.unbind(0)):
                torch.mm(x, y, out=o)
        else:
            torch.bmm(a, b, out=out)

    def product_add(self, a: Tensor, b: Tensor, out: Tensor, alpha: float) -> None:
        if self.per_matrix(out.shape[0], min(out.shape[1], out.shape[2])):
            for x, y, o in zip(a.unbind(0), b.unbind(0), out.unbind(0)):
                o.addmm_(x, y, alpha=alpha)
        else:
            out.baddbmm_(a, b, alpha=alpha)

    def fused_outer(self, rank: int, numel: int) -> bool:
        """For large matrices and r <= 4, where the GEMM (inner dimension r) is 2-3x slower (measured with
        MKL; see BENCHMARKS.md)."""
        return (rank <= 2 and numel >= 1 << 16) or (rank <= 4 and numel >= 1 << 20)

    def per_matrix(self, batch: int, rank: int) -> bool:
        return batch == 1 or rank == 1

    #: Spans at least this long on average take their largest |value| from one ``aminmax`` each (a
    #: vectorized reduction, ~9x faster here than ``_foreach_norm(inf)``, at one op per span).
    SPAN_REDUCTIONS = 1 << 16

    def peaks(self, views: list[Tensor]) -> Tensor:
        """For spans of gradients (long on average) one ``aminmax`` each: the CPU's inf-norm reduction is not
        vectorized (436 ms against 50 ms on GPT-2 small's 124M gradient elements, one thread)."""
        if sum(v.numel() for v in views) >= self.SPAN_REDUCTIONS * len(views):
            smallest, largest = (torch.stack(ends) for ends in zip(*(torch.aminmax(v) for v in views), strict=True))
            return torch.maximum(largest, smallest.neg_()).float()  # propagates NaN, as the norm does
        return super().peaks(views)

    @property
    def span_tables(self) -> bool:
        return False

    @property
    def keeps_wire_buffers(self) -> bool:
        return True


#: The CPU's backend, and every other device's.
CPU: Backend = _CpuBackend()
DEVICE: Backend = Backend()

_forced: list[Backend] = []


def backend_for(device: torch.device) -> Backend:
    """The backend of ``device``: :data:`CPU` for the CPU, :data:`DEVICE` elsewhere, or the one
    :func:`forced` gives for the moment."""
    if _forced:
        return _forced[-1]
    return CPU if device.type == "cpu" else DEVICE


@contextlib.contextmanager
def forced(backend: Backend) -> Iterator[Backend]:
    """Run every engine step inside the block on ``backend``, whatever the tensors' device (the tests run
    CPU tensors down the :data:`DEVICE` path with it). Not thread-local: for tests and benchmarks."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be gradpress.powersgd.backend.CPU or DEVICE, got {backend!r}")
    _forced.append(backend)
    try:
        yield backend
    finally:
        _forced.pop()


def upload(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` (built on the host) on ``device``, without making the host wait for the device.

    A plain copy from pageable host memory to a GPU synchronises the stream: the first compressed step
    (the seeded factors) and every step with an fp16 wire (its span tables) would stall on it. On CUDA
    the copy goes through pinned memory, asynchronously (the caching host allocator keeps the pinned
    block until the copy has run); elsewhere it is a non-blocking ``to``. On the CPU: ``tensor`` itself.

    >>> upload(torch.ones(2), torch.device("cpu"))
    tensor([1., 1.])
    """
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
