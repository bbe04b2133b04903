"""Outer-gradient compressors of DiLoCo's averagers (:class:`~gradpress.StreamingDiLoCoAverager`,
:class:`~gradpress.OuterOptimizerAverager`).

A compressor turns a flat float vector into a ``uint8`` payload (``encode``) and any stack of payloads
back into vectors (``decode``); its transport (:class:`gradpress.averaging.transport.Compressed`)
all-gathers the payloads, decodes every rank's, sums in the working dtype (fp32, or fp64 for fp64
parameters) and divides by the world size. The error feedback (what a rank's own payload failed to
carry, added to its next outer gradient) is kept by the averager, per fragment.

Payload layouts and exact sizes (``n`` values, chunks of ``C``, ``nc = ceil(n / C)``; scales fp32):

* ``QuantizeInt8``: ``n`` int8 codes | ``nc`` scales: ``n + 4·nc`` bytes;
* ``QuantizeInt4``: ``n`` 4-bit codes, two per byte | ``nc`` scales: ``ceil(n/2) + 4·nc`` bytes;
* ``TopK``: ``nc·k`` 2-bit codes, four per byte | ``nc`` scales | ``nc·k`` indices within the chunk:
  ``ceil(nc·k/4) + 4·nc + b·nc·k`` bytes, ``b = 2`` (int16) for ``C <= 32768``, else ``4`` (int32).

Integer quantization is symmetric per chunk: ``scale = max|x| / L`` (``L = 127`` or ``7``), code
``q = round(x / scale)`` in ``[-L, L]``, value ``q · scale``. Nearest rounding errs by at most
``scale / 2`` per value, stochastic rounding (``floor(x / scale + u)``, ``u ~ U[0, 1)``, unbiased) by less
than ``scale``. The noise ``u`` is drawn on the vector's own device from a generator on that device
(:func:`rounding_generator`), seeded per rank, fragment and sync count by the transport
(:func:`gradpress.averaging.transport.sync_seed`): reproducible from those counters alone, one draw of
the same shape on every rank, nothing built on the host. The numbers depend on the device type (a CPU
generator on CPU tensors draws what it always has; a CUDA generator draws others).

Top-k keeps the ``k`` largest magnitudes of each chunk (SparseLoCo) and sends each as a 2-bit code on
the grid ``{-s, -s/3, s/3, s}`` with ``s`` the chunk's largest magnitude: error at most ``s / 3``
(nearest) or ``2s / 3`` (stochastic) per kept value; the others are left to error feedback.

Two-shot reduction (:mod:`gradpress.averaging.twoshot`) cuts a vector into regions of whole chunks and
sends each region's payload to its owner: :meth:`Compressor.encode_regions` gives the payloads of every
region at once, row ``r`` holding exactly ``encode(x[start_r:end_r])`` (zero-padded to the longest row), the
values rounded as one ``encode(x)`` would round them (stochastic rounding draws its noise for the whole
vector once). A compressor whose chunks are encoded independently of each other (``two_shot = True``:
the three here) can be decoded by an owner, summed and encoded again.

A non-finite input value makes its chunk's scale non-finite, so every rank decodes a non-finite value
there and the averager skips that fragment's outer step (rather than sending garbage codes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..validation import check_int

__all__ = ["Compressor", "QuantizeInt4", "QuantizeInt8", "RegionGroup", "TopK", "rounding_generator"]

#: A run of consecutive regions of one length: ``(first region, count, first value, length)``.
RegionGroup = tuple[int, int, int, int]

_ROUNDINGS = ("nearest", "stochastic")


def _check_rounding(owner: str, rounding: object) -> None:
    if rounding not in _ROUNDINGS:
        raise ValueError(f"{owner}: rounding must be one of {_ROUNDINGS}, got {rounding!r}")


def _chunks(x: Tensor, chunk_size: int) -> Tensor:
    """``x`` (flat) zero-padded to whole chunks, as ``(num_chunks, chunk_size)``."""
    pad = -x.numel() % chunk_size
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, chunk_size)


def rounding_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator of one stochastic rounding of a vector on ``device``: on that device (so the noise
    is drawn there: no host draw, no copy up), seeded with ``seed``. ``meta`` tensors hold no values and
    have no generator of their own: a CPU generator serves them (torch draws nothing from it).

    >>> rounding_generator(3, "cpu").initial_seed()
    3
    """
    device = torch.device(device)
    if device.type == "meta":
        return torch.Generator().manual_seed(seed)
    return torch.Generator(device=device).manual_seed(seed)


def _round(ratio: Tensor, rounding: str, generator: torch.Generator | None) -> Tensor:
    if rounding == "nearest":
        return torch.round(ratio)
    if generator is None:
        raise ValueError("stochastic rounding needs a generator")
    # Drawn on the tensor's device, from a generator there (rounding_generator): nothing copied up.
    noise = torch.rand(ratio.shape, generator=generator, dtype=ratio.dtype, device=ratio.device)
    return torch.floor(ratio + noise)


def _view(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """``raw`` (uint8, last dim) reinterpreted as ``dtype``; copied first so that the view is aligned. An
    empty ``raw`` (an empty shard of an FSDP2 parameter encodes to nothing) gives an empty tensor."""
    if raw.shape[-1] == 0:
        return raw.new_empty((*raw.shape[:-1], 0), dtype=dtype)
    return raw.clone(memory_format=torch.contiguous_format).view(dtype)


def _bytes_of(t: Tensor) -> Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class Compressor(ABC):
    """What the averager needs of a compressor. Implementations are frozen dataclasses."""

    chunk_size: int
    rounding: str
    seed: int
    #: Whether its chunks are encoded independently (a region of whole chunks encodes as the same chunks
    #: of the whole vector do), so that a two-shot reduction may decode, sum and encode again.
    two_shot: ClassVar[bool] = False

    @abstractmethod
    def payload_bytes(self, numel: int) -> int:
        """Exact size in bytes of the payload that encodes ``numel`` values."""

    @abstractmethod
    def encode(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """The ``uint8`` payload (``payload_bytes(x.numel())`` bytes, on ``x``'s device) for the flat
        float tensor ``x``. ``generator`` (on ``x``'s device: :func:`rounding_generator`) is required for
        stochastic rounding, which draws ``u ~ U[0, 1)`` from it on ``x``'s device."""

    @abstractmethod
    def decode(self, payloads: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
        """``(W, numel)`` values in ``dtype`` from ``(W, payload_bytes(numel))`` payloads."""

    def encode_regions(self, x: Tensor, groups: Sequence[RegionGroup], regions: int, row_bytes: int,
                       generator: torch.Generator | None = None) -> Tensor:
        """``(regions, row_bytes)`` ``uint8``: row ``r`` is the payload of region ``r`` of ``x`` (see the
        module docstring), zero-padded; ``groups`` cover the regions in order. This default encodes each
        region on its own (the generator's draws follow one another); the compressors here encode the
        whole vector once and cut the rows out of it."""
        out = torch.zeros((regions, row_bytes), dtype=torch.uint8, device=x.device)
        for first, count, start, length in groups:
            for k in range(count):
                payload = self.encode(x[start + k * length: start + (k + 1) * length], generator)
                out[first + k, :payload.numel()] = payload
        return out


@dataclass(frozen=True)
class _Quantize(Compressor):
    chunk_size: int = 1024
    rounding: str = "nearest"
    seed: int = 0
    bits: ClassVar[int] = 8
    two_shot: ClassVar[bool] = True

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_int("chunk_size", self.chunk_size, 1, owner=owner)
        _check_rounding(owner, self.rounding)
        check_int("seed", self.seed, 0, owner=owner)

    @property
    def levels(self) -> int:
        """Largest code magnitude: 127 (int8) or 7 (int4)."""
        return 2 ** (self.bits - 1) - 1

    def _value_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def payload_bytes(self, numel: int) -> int:
        return self._value_bytes(numel) + 4 * (-(-numel // self.chunk_size))

    def quantize(self, x: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """``(codes, scales)``: int8 codes in ``[-levels, levels]`` (``x.numel()`` of them) and one fp32
        scale per chunk; ``x ≈ codes · scale`` chunk by chunk."""
        n = x.numel()
        chunks = _chunks(x.reshape(-1), self.chunk_size)
        scales = (chunks.abs().amax(dim=1) / self.levels).to(torch.float32)
        scale = scales.to(x.dtype).unsqueeze(1)
        ratio = torch.where(scale > 0, chunks / scale, torch.zeros_like(chunks))
        # A non-finite scale already makes the chunk decode non-finite; keep the cast well defined.
        ratio = torch.nan_to_num(ratio, nan=0.0, posinf=0.0, neginf=0.0)
        codes = _round(ratio, self.rounding, generator).clamp_(-self.levels, self.levels)
        return codes.to(torch.int8).view(-1)[:n], scales

    def _pack(self, codes: Tensor) -> Tensor:
        """Codes ``(..., L)`` as their value bytes ``(..., value_bytes(L))``."""
        if self.bits == 8:
            return codes.view(torch.uint8)
        nibbles = (codes + 8).to(torch.uint8)  # 4 bits: code + 8 in [1, 15], two per byte (low nibble first)
        if nibbles.shape[-1] % 2:
            nibbles = torch.cat([nibbles, nibbles.new_zeros((*nibbles.shape[:-1], 1))], dim=-1)
        pairs = nibbles.view(*nibbles.shape[:-1], -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4)

    def encode(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        codes, scales = self.quantize(x, generator)
        return torch.cat([self._pack(codes), _bytes_of(scales)])

    def encode_regions(self, x: Tensor, groups: Sequence[RegionGroup], regions: int, row_bytes: int,
                       generator: torch.Generator | None = None) -> Tensor:
        codes, scales = self.quantize(x, generator)  # one draw of the noise for the whole vector
        out = torch.zeros((regions, row_bytes), dtype=torch.uint8, device=x.device)
        for first, count, start, length in groups:
            if length == 0:
                continue
            chunks = -(-length // self.chunk_size)
            values = self._pack(codes[start: start + count * length].view(count, length))
            scale_bytes = scales[start // self.chunk_size: start // self.chunk_size + count * chunks]
            row = torch.cat([values, scale_bytes.view(count, chunks).view(torch.uint8)], dim=1)
            out[first: first + count, :row.shape[1]] = row
        return out

    def decode(self, payloads: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
        world = payloads.shape[0]
        value_bytes = self._value_bytes(numel)
        num_chunks = -(-numel // self.chunk_size)
        values = payloads[:, :value_bytes]
        scales = _view(payloads[:, value_bytes: value_bytes + 4 * num_chunks], torch.float32)
        if self.bits == 8:
            codes = _view(values, torch.int8).to(dtype)
        else:
            codes = torch.stack([values & 0xF, values >> 4], dim=2).view(world, -1)[:, :numel]
            codes = codes.to(dtype) - 8
        pad = num_chunks * self.chunk_size - numel
        if pad:
            codes = torch.cat([codes, codes.new_zeros(world, pad)], dim=1)
        out = codes.view(world, num_chunks, self.chunk_size) * scales.to(dtype).unsqueeze(2)
        return out.view(world, -1)[:, :numel]


@dataclass(frozen=True)
class QuantizeInt8(_Quantize):
    """Symmetric int8 quantization with one fp32 scale per ``chunk_size`` values: ``n + 4·ceil(n/C)``
    bytes. ``rounding``: ``"nearest"`` or ``"stochastic"`` (seeded by ``seed``, the rank, the fragment
    and the sync count, so that it resumes exactly).

    >>> QuantizeInt8(chunk_size=256).payload_bytes(1000)
    1016
    """

    bits: ClassVar[int] = 8


@dataclass(frozen=True)
class QuantizeInt4(_Quantize):
    """Symmetric 4-bit quantization (codes ``-7..7``, two per byte) with one fp32 scale per
    ``chunk_size`` values: ``ceil(n/2) + 4·ceil(n/C)`` bytes.

    >>> QuantizeInt4(chunk_size=256).payload_bytes(1001)
    517
    """

    bits: ClassVar[int] = 4


@dataclass(frozen=True)
class TopK(Compressor):
    """Chunked top-k sparsification with 2-bit values (SparseLoCo, Sarfi et al. 2025, arXiv:2508.15706):
    in every chunk of ``chunk_size`` values, the ``k`` largest magnitudes are sent as (index within the
    chunk, 2-bit code on ``{-s, -s/3, s/3, s}``), ``s`` the chunk's largest magnitude, sent in fp32.

    ``k``: values kept per chunk; when ``None``, ``max(1, round(density · chunk_size))``.
    ``error_decay``: SparseLoCo's β, the error feedback ``e ← β·e + δ`` (in the averager); ``1`` (the
    default) keeps every bit of mass, below 1 the accumulator acts as SparseLoCo's local stand-in for
    the outer momentum (use it with ``outer_momentum=0``). Every chunk
    sends exactly ``k`` (the last chunk is zero-padded to ``chunk_size``, so it may send padding
    positions, which decode to nothing). Bytes: ``ceil(nc·k/4) + 4·nc + b·nc·k`` with
    ``nc = ceil(n/C)`` and ``b = 2`` (int16 indices) for ``chunk_size <= 32768``, else ``4``.

    >>> TopK(k=8, chunk_size=512).payload_bytes(1024)
    44
    """

    k: int | None = None
    density: float = 0.01
    chunk_size: int = 4096
    rounding: str = "nearest"
    seed: int = 0
    error_decay: float = 1.0
    two_shot: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int("chunk_size", self.chunk_size, 1, 2 ** 31 - 1, owner="TopK")
        if isinstance(self.error_decay, bool) or not isinstance(self.error_decay, (int, float)) \
                or not 0 < self.error_decay <= 1:
            raise ValueError(f"TopK: error_decay must be a number in (0, 1], got {self.error_decay!r}")
        if self.k is not None:
            check_int("k", self.k, 1, self.chunk_size, owner="TopK")
        elif isinstance(self.density, bool) or not isinstance(self.density, (int, float)) \
                or not 0 < self.density <= 1:
            raise ValueError(f"TopK: density must be a number in (0, 1], got {self.density!r}")
        _check_rounding("TopK", self.rounding)
        check_int("seed", self.seed, 0, owner="TopK")

    @property
    def k_per_chunk(self) -> int:
        if self.k is not None:
            return self.k
        return min(self.chunk_size, max(1, round(self.density * self.chunk_size)))

    @property
    def index_dtype(self) -> torch.dtype:
        return torch.int16 if self.chunk_size <= 2 ** 15 else torch.int32

    def _sizes(self, numel: int) -> tuple[int, int, int]:
        num_chunks = -(-numel // self.chunk_size)
        kept = num_chunks * self.k_per_chunk
        return num_chunks, kept, (kept + 3) // 4

    def payload_bytes(self, numel: int) -> int:
        num_chunks, kept, code_bytes = self._sizes(numel)
        index_bytes = 2 if self.index_dtype == torch.int16 else 4
        return code_bytes + 4 * num_chunks + index_bytes * kept

    def select(self, x: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(codes, scales, index)`` per chunk of ``x``: ``(nc, k)`` 2-bit codes (``uint8``), ``nc`` fp32
        scales and ``(nc, k)`` indices within the chunk (``index_dtype``)."""
        chunks = _chunks(x.reshape(-1), self.chunk_size)
        index = chunks.abs().topk(self.k_per_chunk, dim=1).indices
        kept = chunks.gather(1, index)
        # The chunk's largest magnitude (the first kept value, or NaN/inf when the chunk has one).
        scales = chunks.abs().amax(dim=1).to(torch.float32)
        step = (scales.to(x.dtype) * (2.0 / 3.0)).unsqueeze(1)  # grid {-1.5, -0.5, 0.5, 1.5} · step
        ratio = torch.where(step > 0, kept / step, torch.zeros_like(kept)) + 1.5
        ratio = torch.nan_to_num(ratio, nan=0.0, posinf=0.0, neginf=0.0)
        codes = _round(ratio, self.rounding, generator).clamp_(0, 3).to(torch.uint8)
        return codes, scales, index.to(self.index_dtype)

    @staticmethod
    def _pack(codes: Tensor) -> Tensor:
        """2-bit codes ``(..., K)`` four per byte: ``(..., ceil(K / 4))``."""
        if codes.shape[-1] % 4:
            codes = torch.cat([codes, codes.new_zeros((*codes.shape[:-1], 4 - codes.shape[-1] % 4))], dim=-1)
        quads = codes.view(*codes.shape[:-1], -1, 4)
        return quads[..., 0] | (quads[..., 1] << 2) | (quads[..., 2] << 4) | (quads[..., 3] << 6)

    def encode(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        codes, scales, index = self.select(x, generator)
        return torch.cat([self._pack(codes.view(-1)), _bytes_of(scales), _bytes_of(index)])

    def encode_regions(self, x: Tensor, groups: Sequence[RegionGroup], regions: int, row_bytes: int,
                       generator: torch.Generator | None = None) -> Tensor:
        codes, scales, index = self.select(x, generator)  # one draw of the noise for the whole vector
        out = torch.zeros((regions, row_bytes), dtype=torch.uint8, device=x.device)
        k = self.k_per_chunk
        for first, count, start, length in groups:
            if length == 0:
                continue
            chunks = -(-length // self.chunk_size)
            c0, c1 = start // self.chunk_size, start // self.chunk_size + count * chunks
            row = torch.cat([self._pack(codes[c0:c1].reshape(count, chunks * k)),
                             scales[c0:c1].view(count, chunks).view(torch.uint8),
                             index[c0:c1].reshape(count, chunks * k).view(torch.uint8)], dim=1)
            out[first: first + count, :row.shape[1]] = row
        return out

    def decode(self, payloads: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
        world = payloads.shape[0]
        num_chunks, kept, code_bytes = self._sizes(numel)
        k = self.k_per_chunk
        packed = payloads[:, :code_bytes]
        codes = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=2).view(world, -1)[:, :kept]
        scales = _view(payloads[:, code_bytes: code_bytes + 4 * num_chunks], torch.float32)
        index = _view(payloads[:, code_bytes + 4 * num_chunks:], self.index_dtype)
        step = (scales.to(dtype) * (2.0 / 3.0)).unsqueeze(2)
        values = (codes.to(dtype).view(world, num_chunks, k) - 1.5) * step
        out = torch.zeros(world, num_chunks, self.chunk_size, dtype=dtype, device=payloads.device)
        out.scatter_(2, index.view(world, num_chunks, k).long(), values)
        return out.view(world, -1)[:, :numel]
