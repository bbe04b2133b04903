"""How a buffer is averaged over the workers on the wire: one :class:`WireCodec` per wire format.

Every codec divides the buffer by the world size first (a sum of W terms is then bounded by W times the
largest term, so fp16 stays finite) and averages it in place, as a task (see
:mod:`gradpress.powersgd.pipeline`):

* :class:`NativeWire`: the buffer's own dtype, one all-reduce;
* :class:`CastWire`: another dtype with the range the sum needs, cast there and back (bf16, which has
  fp32's range, for fp32 or bf16 tensors; fp32 for fp64 ones);
* :class:`ScaledFp16Wire`: fp16 from a wider dtype, each tensor span scaled by its own power of two, the
  one that puts W times its largest |value| over the workers below 2^14, agreed on by a max-allreduce of
  one float per span first: no overflow whatever the gradients' size, full fp16 precision at each
  tensor's own largest values, and a value's scale that depends on its own tensor only, never on which
  tensors share its bucket (docs/design.md, "numbers that do not depend on the bucket layout").

:func:`wire_codec` picks the codec for a wire dtype; a new wire format is one class here.

>>> import torch
>>> type(wire_codec(torch.float16, torch.float32)).__name__, type(wire_codec(torch.bfloat16, torch.float32)).__name__
('ScaledFp16Wire', 'CastWire')
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .backend import backend_for
from .pipeline import Task
from .transport import Communicator

__all__ = ["CastWire", "NativeWire", "ScaledFp16Wire", "Spans", "WireCodec", "span_views", "wire_codec"]

#: The exponent floor of the fp16 wire's scales (2^(e - 14) stays a normal fp32 number).
_MIN_EXPONENT = -110


class Spans(NamedTuple):
    """The tensor spans that tile a buffer sent on the scaled fp16 wire: ``views`` of the buffer, and
    ``lengths``, their element counts as an int64 tensor on the buffer's device (``None`` where the
    backend scales each span with one ``_foreach`` op: :attr:`~gradpress.powersgd.backend.Backend.span_tables`)."""

    views: list[Tensor]
    lengths: Tensor | None


class WireCodec:
    """Averages a buffer over the workers, sending ``dtype``. ``needs_spans``: :meth:`mean` needs the
    buffer's tensor spans (:class:`Spans`)."""

    dtype: torch.dtype
    needs_spans = False

    def mean(self, buffer: Tensor, comm: Communicator, spans: Spans | None = None, out: Tensor | None = None) -> Task:
        """Average ``buffer`` (1-d, contiguous) over ``comm``'s workers, in place; ``out``: a buffer of
        :attr:`dtype` and ``buffer``'s size to send from (default: a fresh one, where one is needed)."""
        raise NotImplementedError

    @staticmethod
    def _divide(buffer: Tensor, comm: Communicator) -> None:
        if comm.world_size != 1:  # (dividing by 1 is exact: one pass saved)
            buffer.div_(comm.world_size)


class NativeWire(WireCodec):
    """The buffer's own dtype: one all-reduce of the buffer itself."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def mean(self, buffer: Tensor, comm: Communicator, spans: Spans | None = None, out: Tensor | None = None) -> Task:
        self._divide(buffer, comm)
        yield comm.allreduce_sum(buffer)


class CastWire(WireCodec):
    """Another dtype with the range the sum needs (bf16 for fp32 or bf16 memory, fp32 for fp64): cast,
    all-reduce, cast back."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def mean(self, buffer: Tensor, comm: Communicator, spans: Spans | None = None, out: Tensor | None = None) -> Task:
        self._divide(buffer, comm)
        wire = buffer.to(self.dtype) if out is None else out.copy_(buffer)
        yield comm.allreduce_sum(wire)
        buffer.copy_(wire)


class ScaledFp16Wire(WireCodec):
    """fp16 from a wider dtype, one power-of-two scale per tensor span (see the module docstring).

    Each span's largest |value| comes from one reduction for all (:meth:`Backend.peaks
    <gradpress.powersgd.backend.Backend.peaks>`); its scale is ``2^(e - 14)`` where ``W * max|span| = f 2^e``
    with ``f`` in [0.5, 1) (``frexp``), so the scaled sum stays below 2^14; an all-zero or non-finite span
    gets some power of two (a non-finite value stays so). Nothing is read on the host and no per-element
    table is built: on the CPU each span is scaled in place by one ``_foreach_mul_`` (0-d scales);
    elsewhere the scales reach the elements by one ``repeat_interleave`` on the device (a foreach op over
    spans of different sizes would issue a kernel per span there). The maxima are not payload.
    """

    dtype = torch.float16
    needs_spans = True

    def mean(self, buffer: Tensor, comm: Communicator, spans: Spans | None = None, out: Tensor | None = None) -> Task:
        assert spans is not None, "the scaled fp16 wire needs the buffer's tensor spans"
        self._divide(buffer, comm)
        if spans.views:  # nothing is read on the host
            peaks = backend_for(buffer.device).peaks(spans.views)
        else:  # nothing to send (the max-allreduce is still issued, as on every rank)
            peaks = buffer.new_zeros(1, dtype=torch.float32)
        yield comm.allreduce_max(peaks)
        exponent = torch.frexp(peaks.mul_(comm.world_size)).exponent
        scales = torch.exp2(exponent.clamp_(min=_MIN_EXPONENT).sub_(14).to(buffer.dtype))
        scale = None
        if spans.views and spans.lengths is None:
            torch._foreach_mul_(spans.views, list(torch.reciprocal(scales).unbind(0)))  # powers of two: exact
        elif spans.views and spans.lengths is not None:
            scale = torch.repeat_interleave(scales, spans.lengths, output_size=buffer.numel())
            buffer.div_(scale)  # by powers of two: exact
        wire = buffer.to(torch.float16) if out is None else out.copy_(buffer)
        yield comm.allreduce_sum(wire)
        if scale is not None:
            torch.mul(wire, scale, out=buffer)
        else:
            buffer.copy_(wire)
            if spans.views:
                torch._foreach_mul_(spans.views, list(scales.unbind(0)))


def wire_codec(wire_dtype: torch.dtype, work_dtype: torch.dtype) -> WireCodec:
    """The codec that sends a buffer of ``work_dtype`` as ``wire_dtype``: :class:`NativeWire` for the same
    dtype, :class:`ScaledFp16Wire` for fp16 from a wider one, :class:`CastWire` otherwise."""
    if wire_dtype == work_dtype:
        return NativeWire(work_dtype)
    if wire_dtype == torch.float16:
        return ScaledFp16Wire()
    return CastWire(wire_dtype)


def span_views(buffer: Tensor, sizes: list[int], lengths: Tensor | None) -> Spans:
    """:class:`Spans` of ``buffer`` cut into ``sizes`` (``lengths``: the same on the device, used where the
    backend scales through span tables, else dropped)."""
    return Spans(list(buffer.split(sizes)), lengths if backend_for(buffer.device).span_tables else None)
