"""Two-shot reduction of compressed outer gradients: the arithmetic, in plain functions of tensors.

An all-gather of ``W`` payloads of ``P`` bytes carries ``(W - 1) · P`` bytes over each rank's link; the
two-shot schedule carries ``2 (W - 1) / W`` of the (padded) payload, as an allreduce does, and requantizes
once, not at every hop (a ring that requantizes as it goes accumulates error as ``sqrt(W)``):

1. every rank cuts its outer gradient ``e_i`` (with its residual) into ``W`` *regions* of whole
   quantization chunks, balanced (:func:`regions`), encodes every region (:func:`encode_regions`: row
   ``r`` is ``encode(e_i[region r])``, zero-padded to the longest row) and keeps its residual
   ``e_i - decode(rows)`` as before;
2. an **all-to-all** hands row ``r`` of every rank to rank ``r``, the region's *owner*;
3. the owner decodes the ``W`` rows of its region (fp32, fp64 for fp64 anchors), sums them in rank order,
   divides by ``W``, adds its *owner residual* ``o_r``, encodes the result again and keeps
   ``o_r ← m_r - decode(its row)`` (:func:`owner_reduce`: error feedback of the mean, DeepSpeed's
   "server" error);
4. an **all-gather** hands every owner's row to every rank, which decodes them all
   (:func:`decode_regions`): the same bytes, the same function, so every rank holds bitwise the same
   update.

Over syncs nothing is lost: ``Σ_t applied = Σ_t mean_i δ_i - mean_i residual_i - o`` (the residuals of the
last sync), at both levels. Both phases send rows of ``row_bytes`` (the longest region's payload), so the
padded payload is ``W · row_bytes`` and each rank's link carries ``2 (W - 1) · row_bytes`` bytes.

Nothing here issues a collective: the transport (:class:`gradpress.averaging.transport.Compressed`)
moves the rows, and :func:`reference` runs the whole reduction for ``W`` ranks in one process (the
oracle of the tests, and the simulation of ``benchmarks/two_shot.py``).

>>> from gradpress import QuantizeInt8
>>> plan = regions(QuantizeInt8(chunk_size=4), 10, 2)
>>> plan.bounds, plan.row_bytes
(((0, 8), (8, 10)), 16)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .compress import Compressor, QuantizeInt4, QuantizeInt8, RegionGroup

__all__ = ["SCHEDULES", "Regions", "check_schedule", "decode_regions", "encode_regions", "owner_reduce",
           "reference", "regions", "resolve_schedule", "sum_in_rank_order"]

#: The values of ``schedule=`` (:class:`gradpress.OuterOptimizerAverager`, :class:`gradpress.StreamingDiLoCoAverager`).
SCHEDULES = ("auto", "all-gather", "two-shot")
#: ``"auto"`` picks two-shot for int8/int4 from this world size (at 2 the bytes are the same and the
#: all-gather requantizes nothing).
AUTO_FROM = 3


@dataclass(frozen=True)
class Regions:
    """How ``numel`` values split into ``world`` regions of whole chunks: ``bounds[r] = (start, end)``
    of region ``r`` (rank ``r`` owns it), ``groups`` the runs of regions of one length
    (``(first, count, start, length)``), ``row_bytes`` the longest region's payload."""

    numel: int
    world: int
    bounds: tuple[tuple[int, int], ...]
    groups: tuple[RegionGroup, ...]
    row_bytes: int

    def length(self, region: int) -> int:
        start, end = self.bounds[region]
        return end - start

    @property
    def padded_bytes(self) -> int:
        """``world · row_bytes``: what one rank's all-to-all (and every rank's all-gather) holds."""
        return self.world * self.row_bytes


@functools.lru_cache(maxsize=256)
def regions(compressor: Compressor, numel: int, world: int) -> Regions:
    """The regions of a vector of ``numel`` values over ``world`` owners: ``ceil(numel / C)`` chunks of
    ``C = compressor.chunk_size``, the first ``nc % world`` owners one chunk more than the others (so the
    regions of one length are consecutive: at most four runs); the last non-empty region may end inside
    its last chunk, and with fewer chunks than owners the last owners have none."""
    chunk = compressor.chunk_size
    chunks = -(-numel // chunk)
    base, extra = divmod(chunks, world)
    bounds, start = [], 0
    for r in range(world):
        end = start + base + (r < extra)
        bounds.append((min(start * chunk, numel), min(end * chunk, numel)))
        start = end
    groups: list[RegionGroup] = []
    for r, (a, b) in enumerate(bounds):
        if groups and groups[-1][3] == b - a and groups[-1][2] + groups[-1][1] * groups[-1][3] == a:
            first, count, start_value, length = groups[-1]
            groups[-1] = (first, count + 1, start_value, length)
        else:
            groups.append((r, 1, a, b - a))
    row_bytes = max(compressor.payload_bytes(b - a) for a, b in bounds)
    return Regions(numel, world, tuple(bounds), tuple(groups), row_bytes)


def check_schedule(schedule: object, compressor: Compressor | None, compression: object) -> str:
    """``schedule`` checked against the compression it goes with (``compressor``: the
    :class:`~gradpress.averaging.compress.Compressor` it is, else ``None``); ``ValueError`` naming
    ``schedule`` and the allowed values otherwise. ``"two-shot"`` needs a compressor whose chunks an owner
    can decode, sum and encode again (``two_shot``); ``"all-gather"`` and ``"two-shot"`` name how a
    compressor's payloads travel, so an all-reduced ``compression`` (exact, fp16/bf16, PowerSGD) takes
    ``"auto"`` only."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "auto":
        return "auto"
    if compressor is None:
        raise ValueError(f"schedule={schedule!r} chooses how compressed payloads travel and needs compression="
                         f"QuantizeInt8(...), QuantizeInt4(...) or TopK(...); compression={compression!r} is "
                         f"all-reduced: use schedule='auto'")
    if schedule == "two-shot" and not compressor.two_shot:
        raise ValueError(f"schedule='two-shot' needs a compressor whose chunks can be decoded, summed and encoded "
                         f"again (QuantizeInt8, QuantizeInt4, TopK); {compressor!r} cannot be requantized: use "
                         f"schedule='all-gather' or 'auto'")
    return str(schedule)


def resolve_schedule(schedule: str, compressor: Compressor, world: int) -> str:
    """``"all-gather"`` or ``"two-shot"`` at world size ``world``: ``"auto"`` is two-shot for int8/int4
    from :data:`AUTO_FROM` ranks, all-gather otherwise (top-k two-shot is another algorithm: opt-in);
    below 2 ranks there is nothing to exchange and both are the all-gather's identity."""
    if schedule == "auto":
        quantized = isinstance(compressor, (QuantizeInt8, QuantizeInt4))
        return "two-shot" if quantized and world >= AUTO_FROM else "all-gather"
    return "all-gather" if world < 2 else schedule


def encode_regions(compressor: Compressor, x: Tensor, plan: Regions,
                   generator: torch.Generator | None = None) -> Tensor:
    """Phase 1, sender side: ``(world, row_bytes)`` ``uint8``, row ``r`` the payload of region ``r`` of the
    flat vector ``x`` (``Compressor.encode_regions``)."""
    return compressor.encode_regions(x, plan.groups, plan.world, plan.row_bytes, generator)


def decode_regions(compressor: Compressor, rows: Tensor, plan: Regions, dtype: torch.dtype) -> Tensor:
    """The flat vector (``plan.numel`` values in ``dtype``) that ``rows`` (``(world, row_bytes)``, row ``r``
    region ``r``'s payload) encode: one ``decode`` per run of equal regions."""
    out = torch.empty(plan.numel, dtype=dtype, device=rows.device)
    for first, count, start, length in plan.groups:
        if length:
            used = compressor.payload_bytes(length)
            out[start: start + count * length] = compressor.decode(rows[first: first + count, :used], length,
                                                                   dtype).reshape(-1)
    return out


def sum_in_rank_order(values: Tensor) -> Tensor:
    """``((v_0 + v_1) + v_2) + ...`` over the first dimension of ``values`` (one row per rank, or one
    ``(owners, ranks, ...)`` block per owner with ``values`` transposed): a fixed order, whatever the
    reduction kernels of the device would choose."""
    total = values[0].clone()
    for row in values[1:]:
        total.add_(row)
    return total


def owner_reduce(compressor: Compressor, received: Tensor, length: int, owner_residual: Tensor | None,
                 dtype: torch.dtype, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Phase 2, owner side: ``received`` (``(W, row_bytes)``, row ``i`` rank ``i``'s payload of this owner's
    region of ``length`` values) decoded in ``dtype``, summed in rank order, divided by ``W``, plus
    ``owner_residual`` (``None``: zero), encoded again (``generator`` for stochastic rounding). Returns
    ``(row, new owner residual)``: the ``row_bytes`` row to all-gather and ``m - decode(row)``."""
    world, row_bytes = received.shape
    used = compressor.payload_bytes(length)
    mean = sum_in_rank_order(compressor.decode(received[:, :used], length, dtype)).div_(world)
    if owner_residual is not None:
        mean.add_(owner_residual)
    payload = compressor.encode(mean, generator)
    row = torch.zeros(row_bytes, dtype=torch.uint8, device=received.device)
    row[:used] = payload
    return row, mean - compressor.decode(payload.unsqueeze(0), length, dtype)[0]


def reference(compressor: Compressor, outer_grads: Sequence[Tensor], owner_residuals: Sequence[Tensor | None],
              generators: Sequence[torch.Generator | None] | None = None,
              owner_generators: Sequence[torch.Generator | None] | None = None
              ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """One two-shot reduction of ``W = len(outer_grads)`` ranks in one process, by the functions the
    ranks call: ``outer_grads[i]`` is rank ``i``'s ``e_i`` (its outer gradient plus residual, flat, in the
    working dtype), ``owner_residuals[r]`` owner ``r``'s (``None``: zero); ``generators`` /
    ``owner_generators``: each rank's rounding generators (stochastic rounding). Returns ``(update, rank
    residuals, owner residuals)``: what every rank applies, each rank's ``e_i - decode(own rows)``, each
    owner's new residual."""
    world = len(outer_grads)
    dtype, numel = outer_grads[0].dtype, outer_grads[0].numel()
    plan = regions(compressor, numel, world)
    generators = generators or [None] * world
    owner_generators = owner_generators or [None] * world
    sent = [encode_regions(compressor, e, plan, g) for e, g in zip(outer_grads, generators)]
    residuals = [e - decode_regions(compressor, rows, plan, dtype) for e, rows in zip(outer_grads, sent)]
    owned, owners = [], []
    for r in range(world):
        received = torch.stack([rows[r] for rows in sent])
        row, residual = owner_reduce(compressor, received, plan.length(r), owner_residuals[r], dtype,
                                     owner_generators[r])
        owned.append(row)
        owners.append(residual)
    return decode_regions(compressor, torch.stack(owned), plan, dtype), residuals, owners
