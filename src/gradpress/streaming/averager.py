"""Streaming DiLoCo as a model averager: fragments, overlapped outer steps, compressed outer gradients."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..averaging import ModelAverager, OuterStep, Params, tensors_to_average
from ..averaging.outer import check_first_sync, no_anchor_message, take_anchor, takes_anchor
from ..checkpoint import check_placement, placement
from ..validation import check_int, check_number
from ..comm import Work, all_gather_async, all_reduce_async, average_tensors_, is_member
from .compress import Compressor
from .fragments import fragment_offsets, split_by_size

__all__ = ["StreamingDiLoCoAverager"]

Compression = Union[None, str, Compressor]
FragmentSpec = Union[nn.Module, Iterable[Tensor]]


def _sync_seed(seed: int, rank: int, fragment: int, count: int) -> int:
    """Seed of the stochastic rounding of one sync: a pure function of counters kept in the state, so
    that a resumed run draws the same numbers; different on every rank (independent rounding noise
    averages out across ranks instead of adding up)."""
    mixed = seed
    for part in (rank, fragment, count):
        mixed = (mixed * 0x9E3779B1 + part + 1) % (2 ** 61 - 1)
    return mixed


def _device_groups(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Positions of ``tensors`` grouped by (device, dtype), groups in first-seen order (as
    :func:`gradpress.averaging.average_tensors_` groups them)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


class _Fragment:
    """Per-fragment state: its outer step (the anchor: global parameters at its last sync, identical on
    every rank; and the outer optimizer's momentum), this rank's error-feedback residual, and counters."""

    __slots__ = ("index", "offset", "positions", "outer", "residual", "syncs", "bytes_sent")

    def __init__(self, index: int, offset: int) -> None:
        self.index = index
        self.offset = offset
        self.positions: list[int] = []
        self.outer: OuterStep | None = None
        self.residual: Tensor | None = None
        self.syncs = 0          # outer syncs started: seeds the stochastic rounding
        self.bytes_sent = 0

    @property
    def anchor(self) -> list[Tensor] | None:
        return None if self.outer is None else self.outer.anchor


class _InFlight:
    """An outer gradient sent and not yet applied: the collectives' handles (``works``, empty once
    waited on), their output ``buffers``, and the residual this rank keeps if the result is finite."""

    __slots__ = ("fragment", "due", "works", "buffers", "residual")

    def __init__(self, fragment: int, due: int, works: list[Work], buffers: list[Tensor],
                 residual: Tensor | None) -> None:
        self.fragment = fragment
        self.due = due
        self.works = works  # each names the fragment's outer gradient in a CollectiveError
        self.buffers = buffers
        self.residual = residual

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


class StreamingDiLoCoAverager(ModelAverager):
    """Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication",
    arXiv:2501.18512): DiLoCo's outer Nesterov step taken one *fragment* of the parameters at a time,
    with the outer gradient's collective overlapped with inner steps, optionally compressed.

    Call :meth:`average_parameters` after every inner optimizer step (or wrap the inner optimizer in
    :class:`gradpress.PostLocalSGDOptimizer`). Steps count calls from 0, as in
    :class:`gradpress.PeriodicModelAverager`; nothing happens before ``warmup_steps``.

    **Fragments.** The averaged tensors (trainable parameters; float buffers too with
    ``average_buffers=True`` or a module) are split into ``num_fragments`` runs of consecutive tensors
    balanced by bytes (:func:`~gradpress.streaming.fragments.split_by_size`), or taken from
    ``fragments`` (modules or tensor lists, torchft's ``model_fragments``; every averaged tensor must be
    in one). With ``r = step - warmup_steps``, fragment ``f`` is *sent* at the steps where ``r >= 0``
    and ``r % sync_every`` is its offset: ``f * sync_every // F`` (``fragment_phase="start"``, the
    default: fragment 0 right after warm-up; with ``F=1`` at ``warmup_steps``, like
    :class:`gradpress.OuterOptimizerAverager`) or ``(f + 1) * sync_every // F - 1``
    (``fragment_phase="end"``: torchft's phase, fragment ``f`` after ``(f + 1) · sync_every / F`` local
    steps). Each tensor is sent once per ``sync_every`` steps, one fragment per step at most, so a sync
    moves about ``1/F`` of the model.

    **Anchors.** As in the paper and torchft, every fragment's first anchor ``x_f`` is the parameters
    where local training starts, identical on every rank, and every sync, the first included, is an
    outer step. It is taken once, broadcasting rank 0's values (one collective): without warm-up by
    :meth:`anchor_parameters`, which :class:`gradpress.PostLocalSGDOptimizer` calls when built; with one
    by :meth:`average_parameters` at its last step (warm-up steps are taken to be synchronous).
    ``first_sync="average"``: a fragment's first sync is instead a plain (uncompressed, blocking) average
    that sets its anchor.

    **Outer step** (each sync of fragment ``f``):

    1. at the send step ``s``: outer gradient ``δ_i = x_f - θ_i`` (rank ``i``'s parameters now), plus
       the rank's residual ``e_i`` when compressed; the collective is started (``async_op=True``);
    2. inner steps ``s+1 .. s+τ`` run while it is in flight (``τ = fragment_sync_delay``);
    3. at step ``s + τ`` (after that step's inner update): wait; ``Δ = mean_i δ_i`` (decoded);
       ``x_f ← OuterSGD(x_f, Δ)`` (``torch.optim.SGD``, ``outer_lr``, ``outer_momentum``, ``nesterov``;
       one optimizer, hence one momentum, per fragment);
    4. ``θ_f ← α · θ_f + (1 - α) · x_f`` with ``α = fragment_update_alpha`` and ``θ_f`` the local
       parameters *now* (τ steps after the send): the paper's mixing of local and global parameters
       when communication overlaps computation (its α weighs the local ones). ``α = 0`` (the default,
       torchft's too) replaces them by the new global ones, dropping the fragment's last τ local steps;
       larger ``α`` keeps part of them.

    ``F=1, τ=0``, no compression reproduces :class:`gradpress.OuterOptimizerAverager` bit for bit.
    The collectives are issued from :meth:`average_parameters` only, in step order, so every rank
    issues the same ones in the same order; at most one fragment is sent per step and a fragment is
    applied before it is sent again (``τ < sync_every``). Updates still in flight when training stops
    are not applied.

    **Compression** (``compression``):

    * ``None``: one all-reduce of ``δ / world`` per (device, dtype), in that dtype;
    * ``"fp16"``/``"bf16"``: the same all-reduce in that dtype (no error feedback, as
      :class:`gradpress.OuterOptimizerAverager`);
    * a :class:`QuantizeInt8`, :class:`QuantizeInt4` or :class:`TopK`: ``e = δ + residual`` (fp32, or
      fp64 for fp64 parameters) is encoded, the payloads are **all-gathered** (one ``uint8`` collective
      per sync), every rank decodes every payload with its sender's scales and sums in fp32/fp64, then
      divides by the world size; ``residual ← e - decode(own payload)`` (error feedback: over time
      nothing is lost). All-gather rather than all-reduce because summing int8/int4 codes in their own
      type overflows and codes with per-rank scales cannot be added at all; an all-reduce in a wider
      type would need a shared scale (one more collective, and a coarser grid for every rank) and would
      send the wider type. The all-gather is exact, and each rank hands the collective exactly its own
      payload: ``bytes_sent`` grows by ``compression.payload_bytes(n)`` per sync, whatever the world
      size. (On a ring, an all-gather moves ``(W-1)·L`` bytes per rank against ``2(W-1)/W · 4n`` for an
      fp32 all-reduce: int8 wins for ``W < 8``, int4 for ``W < 16``, top-k at 1 % density far beyond.)

    ``bytes_sent`` counts the bytes this rank hands to collectives (at the send step);
    ``fragment_bytes_sent`` splits it by fragment. ``num_averages`` counts fragment syncs applied
    (plain or outer).

    **Non-finite outer gradients** never reach the anchor: when ``Δ`` of a fragment holds a NaN or an
    infinity (decided on every rank from the same collective result, on the device, no host sync), its
    outer step is skipped: the anchor and momentum keep their values, the fragment's parameters are reset
    to the anchor on every rank, and the residual keeps its value from before that sync.

    **Checkpoints.** :meth:`state_dict` holds the step, counters, the fragment layout, each fragment's
    anchor, outer-optimizer state and residual, and for each update in flight, its due step and what its
    collective returned: ``state_dict`` *waits* for in-flight collectives (every rank already issued
    them, so this cannot deadlock) and stores the results; after :meth:`load_state_dict` they are
    applied at their due steps as if never interrupted, and no collective is issued again. Residuals are
    per rank: loading a checkpoint saved on another rank or world size raises ``ValueError`` unless
    ``allow_other_rank=True``. Resuming equals never stopping, bit for bit.

    Args:
        sync_every: inner steps between two syncs of the same fragment (``H``; torchft's name).
        warmup_steps: calls before the first sync (:class:`PeriodicModelAverager`'s semantics).
        process_group: the group to average over (``None``: the default group).
        num_fragments: ``F``, in ``[1, sync_every]`` (default 1); exclusive with ``fragments``.
        fragments: explicit fragments (modules or iterables of tensors), at most ``sync_every``.
        fragment_sync_delay: ``τ`` in ``[0, sync_every)``.
        fragment_update_alpha: ``α`` in ``[0, 1]``.
        fragment_phase: ``"start"`` (default) or ``"end"`` (torchft's), see above.
        first_sync: ``"outer"`` (default, the paper's) or ``"average"``, see above.
        outer_lr, outer_momentum, nesterov: the outer SGD (as :class:`OuterOptimizerAverager`).
        compression: ``None``, ``"fp16"``, ``"bf16"`` or a :class:`~gradpress.streaming.Compressor`.
        average_buffers: also synchronize floating-point buffers.

    Example::

        from gradpress import PostLocalSGDOptimizer, StreamingDiLoCoAverager, QuantizeInt4
        averager = StreamingDiLoCoAverager(sync_every=100, num_fragments=4, fragment_sync_delay=5,
                                           fragment_update_alpha=0.5, compression=QuantizeInt4())
        optimizer = PostLocalSGDOptimizer(torch.optim.AdamW(model.parameters()), averager)
        for x, y in loader:
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
        torch.save(optimizer.state_dict(), f"ckpt-rank{rank}.pt")  # one file per rank
    """

    def __init__(self, sync_every: int, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None,
                 *, num_fragments: int | None = None, fragments: Sequence[FragmentSpec] | None = None,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, compression: Compression = None,
                 average_buffers: bool = False, fragment_phase: str = "start", first_sync: str = "outer") -> None:
        super().__init__(process_group, average_buffers)
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self._explicit: dict[int, int] | None = None
        if fragments is not None:
            if num_fragments is not None:
                raise TypeError("give num_fragments or fragments, not both")
            if isinstance(fragments, (nn.Module, Tensor)) or not isinstance(fragments, Sequence) \
                    or not 1 <= len(fragments) <= sync_every:
                raise ValueError(f"fragments must be a sequence of 1 to sync_every={sync_every} modules or "
                                 f"tensor lists, got {type(fragments).__name__}"
                                 f"{f' of {len(fragments)}' if isinstance(fragments, Sequence) else ''}")
            self._explicit = {}
            for f, spec in enumerate(fragments):
                if isinstance(spec, nn.Module):
                    members = tensors_to_average(spec, average_buffers=True)
                else:
                    members = tensors_to_average([spec] if isinstance(spec, Tensor) else list(spec))
                if not members:
                    raise ValueError(f"fragments[{f}] holds no tensor to average")
                for t in members:
                    if self._explicit.setdefault(id(t), f) != f:
                        raise ValueError(f"fragments[{f}] shares a tensor with fragments[{self._explicit[id(t)]}]")
            num_fragments = len(fragments)
        elif num_fragments is None:
            num_fragments = 1
        self.num_fragments = check_int("num_fragments", num_fragments, 1, sync_every)
        self.fragment_sync_delay = check_int("fragment_sync_delay", fragment_sync_delay, 0, sync_every - 1)
        self.fragment_update_alpha = check_number("fragment_update_alpha", fragment_update_alpha,
                                                   lambda v: 0 <= v <= 1, "in [0, 1]")
        self.outer_lr, self.outer_momentum, self.nesterov = OuterStep.check_options(outer_lr, outer_momentum, nesterov)
        if not (compression is None or compression in ("fp16", "bf16") or isinstance(compression, Compressor)):
            raise ValueError(f"compression must be None, 'fp16', 'bf16', QuantizeInt8(...), QuantizeInt4(...) or "
                             f"TopK(...), got {compression!r}")
        self.compression = compression
        self.first_sync = check_first_sync(first_sync)
        self.fragment_phase = fragment_phase
        self._fragments = [_Fragment(f, offset) for f, offset in
                           enumerate(fragment_offsets(sync_every, self.num_fragments, fragment_phase))]
        self._by_offset = {fr.offset: fr for fr in self._fragments}
        self._layout: list[int] | None = None
        self._in_flight: list[_InFlight] = []

    # -- schedule ---------------------------------------------------------------------------------

    def fragment_sent_at(self, step: int) -> int | None:
        """The fragment whose sync starts at ``step`` (``None``: none)."""
        r = step - self.warmup_steps
        if r < 0:
            return None
        fragment = self._by_offset.get(r % self.sync_every)
        return None if fragment is None else fragment.index

    @property
    def fragment_bytes_sent(self) -> list[int]:
        """Bytes handed to collectives so far, per fragment."""
        return [fr.bytes_sent for fr in self._fragments]

    @property
    def fragment_layout(self) -> list[int] | None:
        """Fragment index of each averaged tensor (``None`` until the first sync)."""
        return None if self._layout is None else list(self._layout)

    @property
    def in_flight(self) -> list[tuple[int, int]]:
        """``(fragment, due step)`` of each outer update sent and not yet applied."""
        return [(p.fragment, p.due) for p in self._in_flight]

    # -- the step ---------------------------------------------------------------------------------

    def anchor_parameters(self, params: Params) -> None:
        """Take ``params`` as every fragment's anchor, the parameters where local training starts (before
        the first inner step; :class:`gradpress.PostLocalSGDOptimizer` calls it when built): rank 0's
        values (of ``process_group``) on every rank (a collective: every rank calls it). Does nothing
        where :func:`~gradpress.averaging.outer.takes_anchor` says so: with a warm-up (the anchor is taken
        at its last step), once a fragment synchronized, with ``first_sync="average"``, or on a rank
        outside ``process_group``."""
        if takes_anchor(self, from_average=False):
            self._take_anchor(params)

    @property
    def synchronized(self) -> bool:
        """Whether a fragment synchronized (sent or applied)."""
        return self.num_averages > 0 or any(fr.syncs for fr in self._fragments)

    def _take_anchor(self, params: Params) -> None:
        tensors = tensors_to_average(params, self.average_buffers or isinstance(params, nn.Module))
        self._bind(tensors)
        anchor, sent = take_anchor(tensors, self.process_group)
        for fr in self._fragments:
            fr.outer = self._outer_step([anchor[i] for i in fr.positions])
            if sent:
                self._count(fr, sum(anchor[i].numel() * anchor[i].element_size() for i in fr.positions))

    def average_parameters(self, params: Params) -> None:
        """Send the fragment scheduled at this step and apply the updates due now (see the class
        docstring); mutates ``params`` in place; advances the step counter. A collective on sync steps:
        every rank calls it at every step; a rank outside ``process_group`` only counts the step."""
        if not is_member(self.process_group):
            self.step += 1
            return
        if takes_anchor(self, from_average=True):
            self._take_anchor(params)
        sent = self.fragment_sent_at(self.step)
        due = [p for p in self._in_flight if p.due == self.step] if self._in_flight else []
        if sent is not None or due:
            tensors = tensors_to_average(params, self.average_buffers or isinstance(params, nn.Module))
            self._bind(tensors)
            if sent is not None:
                self._send(self._fragments[sent], tensors)
            for pending in [p for p in self._in_flight if p.due == self.step]:
                self._apply(pending, tensors)
        self.step += 1

    def _bind(self, tensors: list[Tensor]) -> None:
        if self._explicit is not None:
            layout = []
            for i, t in enumerate(tensors):
                if id(t) not in self._explicit:
                    raise ValueError(f"StreamingDiLoCoAverager: averaged tensor {i} (shape {tuple(t.shape)}) is in "
                                     f"none of the fragments")
                layout.append(self._explicit[id(t)])
            missing = set(range(self.num_fragments)) - set(layout)
            if missing:
                raise ValueError(f"StreamingDiLoCoAverager: fragments {sorted(missing)} hold none of the averaged "
                                 f"tensors")
        elif self._layout is not None and len(self._layout) == len(tensors):
            layout = self._layout  # shapes are checked against the anchors
        else:
            layout = split_by_size([t.numel() * t.element_size() for t in tensors], self.num_fragments)
        if self._layout is None:
            self._layout = layout
        elif layout != self._layout:
            raise ValueError("StreamingDiLoCoAverager: the averaged tensors changed since the last synchronization "
                             f"(fragment layout {layout} != {self._layout})")
        for fr in self._fragments:
            fr.positions = [i for i, f in enumerate(self._layout) if f == fr.index]

    def _members(self, fr: _Fragment, tensors: list[Tensor]) -> list[Tensor]:
        members = [tensors[i].detach() for i in fr.positions]
        if fr.anchor is not None and (len(fr.anchor) != len(members) or
                                      any(a.shape != t.shape for a, t in zip(fr.anchor, members))):
            raise ValueError(f"StreamingDiLoCoAverager: the parameters of fragment {fr.index} changed since "
                             f"its last synchronization")
        return members

    def _world(self) -> tuple[int, int]:
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def _work_dtype(self, fr: _Fragment) -> torch.dtype:
        assert fr.anchor is not None
        return torch.float64 if any(a.dtype == torch.float64 for a in fr.anchor) else torch.float32

    def _send(self, fr: _Fragment, tensors: list[Tensor]) -> None:
        members = self._members(fr, tensors)
        if fr.anchor is None:  # first sync, first_sync="average": plain average, sets the anchor
            if self.first_sync == "outer":
                raise ValueError(no_anchor_message(type(self).__name__, self.step))
            with torch.no_grad():
                sent = average_tensors_(members, self.process_group, issuer=self._issuer())
                fr.outer = self._outer_step([t.clone() for t in members])
            self._count(fr, sent)
            self.num_averages += 1
            return
        assert fr.anchor is not None
        rank, world = self._world()
        works: list[Work] = []
        residual = None
        with torch.no_grad():
            if not isinstance(self.compression, Compressor):
                wire = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.compression)  # type: ignore[arg-type]
                deltas = [a - t for a, t in zip(fr.anchor, members)]
                buffers = []
                for group in _device_groups(deltas):
                    flat = torch.cat([deltas[i].reshape(-1) for i in group]).to(wire or deltas[group[0]].dtype)
                    if world > 1:
                        flat.div_(world)
                    buffers.append(flat)
                sent = sum(b.numel() * b.element_size() for b in buffers)
                if world > 1:
                    what = self._describe_sync(fr, "allreduce (sum)", sent, world)
                    works = [all_reduce_async(flat, self.process_group, what=what) for flat in buffers]
            else:
                dtype, device = self._work_dtype(fr), fr.anchor[0].device
                outer_grad = torch.cat([(a.to(dtype) - t.to(dtype)).reshape(-1).to(device)
                                        for a, t in zip(fr.anchor, members)])
                if fr.residual is not None:  # e = δ + β·residual (β = 1 but for SparseLoCo's TopK(error_decay=))
                    outer_grad.add_(fr.residual, alpha=getattr(self.compression, "error_decay", 1.0))
                generator = None
                if self.compression.rounding == "stochastic":
                    generator = torch.Generator().manual_seed(
                        _sync_seed(self.compression.seed, rank, fr.index, fr.syncs))
                payload = self.compression.encode(outer_grad, generator)
                residual = outer_grad - self.compression.decode(payload.unsqueeze(0), outer_grad.numel(), dtype)[0]
                sent = payload.numel()
                if world > 1:
                    gathered = payload.new_empty(world * payload.numel())
                    what = self._describe_sync(fr, "all-gather", sent, world)
                    works = [all_gather_async(gathered, payload, self.process_group, what=what)]
                else:
                    gathered = payload
                buffers = [gathered]
        fr.syncs += 1
        self._count(fr, sent)
        self._in_flight.append(_InFlight(fr.index, self.step + self.fragment_sync_delay, works, buffers, residual))

    def _describe_sync(self, fr: _Fragment, op: str, sent: int, world: int) -> str:
        """The collective of one sync, as a :class:`gradpress.comm.CollectiveError` names it."""
        return (f"{op} of fragment {fr.index}'s outer gradient ({sent:,} bytes per rank) over {world} ranks in "
                f"{self._issuer()}")

    def _count(self, fr: _Fragment, sent: int) -> None:
        fr.bytes_sent += sent
        self.bytes_sent += sent

    def _outer_step(self, anchor: list[Tensor]) -> OuterStep:
        return OuterStep(anchor, self.outer_lr, self.outer_momentum, self.nesterov)

    def _mean_outer_grads(self, fr: _Fragment, pending: _InFlight) -> tuple[list[Tensor], Tensor]:
        """Per anchor tensor, the averaged outer gradient ``Δ`` (in the anchor's dtype), and a 0-dim
        ``finite`` flag on the first anchor's device."""
        assert fr.anchor is not None
        if not isinstance(self.compression, Compressor):
            means: list[Tensor] = [torch.empty(0)] * len(fr.anchor)
            flags = []
            for group, flat in zip(_device_groups(fr.anchor), pending.buffers):
                offset = 0
                for i in group:
                    a = fr.anchor[i]
                    means[i] = flat[offset: offset + a.numel()].view_as(a).to(a.dtype)
                    offset += a.numel()
                flags.append(torch.isfinite(flat).all().to(fr.anchor[0].device))
            finite = torch.stack(flags).all()
        else:
            dtype = self._work_dtype(fr)
            numel = sum(a.numel() for a in fr.anchor)
            payloads = pending.buffers[0].view(-1, self.compression.payload_bytes(numel))
            mean = self.compression.decode(payloads, numel, dtype).sum(dim=0).div_(payloads.shape[0])
            finite = torch.isfinite(mean).all()
            means, offset = [], 0
            for a in fr.anchor:
                means.append(mean[offset: offset + a.numel()].view_as(a).to(a.device, a.dtype))
                offset += a.numel()
        return means, finite

    def _apply(self, pending: _InFlight, tensors: list[Tensor]) -> None:
        fr = self._fragments[pending.fragment]
        members = self._members(fr, tensors)
        assert fr.anchor is not None and fr.outer is not None
        pending.wait()
        with torch.no_grad():
            means, finite = self._mean_outer_grads(fr, pending)
        # A non-finite Δ must not move the anchor nor the momentum: decided on the device.
        fr.outer.step(means, finite)
        with torch.no_grad():
            for i, a in enumerate(fr.anchor):
                ok = finite.to(a.device)
                if self.fragment_update_alpha == 0:
                    members[i].copy_(a)
                else:  # α · local + (1 - α) · global; on a skipped step, the anchor
                    members[i].copy_(torch.where(ok, torch.lerp(a, members[i], self.fragment_update_alpha), a))
            if pending.residual is not None:
                old_residual = fr.residual if fr.residual is not None else torch.zeros_like(pending.residual)
                fr.residual = torch.where(finite.to(old_residual.device), pending.residual, old_residual)
        self._in_flight.remove(pending)
        self.num_averages += 1

    # -- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and numbers (see the class docstring); waits for the collectives in flight."""
        state = super().state_dict()
        state["placement"] = placement(self.process_group)
        state["compression"] = repr(self.compression)
        state["layout"] = None if self._layout is None else list(self._layout)
        state["fragments"] = [{
            **(fr.outer.state_dict() if fr.outer is not None else {"anchor": None, "outer": None}),
            "residual": None if fr.residual is None else fr.residual.clone(),
            "syncs": fr.syncs, "bytes_sent": fr.bytes_sent} for fr in self._fragments]
        in_flight = []
        for pending in self._in_flight:
            pending.wait()
            in_flight.append({"fragment": pending.fragment, "due": pending.due,
                              "buffers": [b.clone() for b in pending.buffers],
                              "residual": None if pending.residual is None else pending.residual.clone()})
        state["in_flight"] = in_flight
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, allow_other_rank: bool = False) -> None:
        """Restore :meth:`state_dict`'s output (a copy: the argument is not kept). Raises ``ValueError``
        for another fragment count, or (unless ``allow_other_rank``) for per-rank residuals saved on
        another rank or world size."""
        saved = state["fragments"]
        if len(saved) != self.num_fragments:
            raise ValueError(f"StreamingDiLoCoAverager checkpoint has {len(saved)} fragments, this averager "
                             f"{self.num_fragments}")
        if any(f["residual"] is not None for f in saved) or any(p["residual"] is not None for p in state["in_flight"]):
            check_placement(state.get("placement"), placement(self.process_group), "StreamingDiLoCoAverager",
                            allow_other_rank)
        if state["in_flight"] and state.get("compression") != repr(self.compression):
            raise ValueError(f"StreamingDiLoCoAverager checkpoint has outer updates in flight encoded with compression="
                             f"{state.get('compression')}, but this averager has compression={self.compression!r}")
        super().load_state_dict(state)
        self._layout = None if state["layout"] is None else [int(f) for f in state["layout"]]
        for fr, item in zip(self._fragments, saved):
            fr.outer = None if item["anchor"] is None else \
                OuterStep.restore(item, self.outer_lr, self.outer_momentum, self.nesterov)
            fr.residual = None if item["residual"] is None else item["residual"].clone()
            fr.syncs = int(item["syncs"])
            fr.bytes_sent = int(item["bytes_sent"])
            fr.positions = [] if self._layout is None else [i for i, f in enumerate(self._layout) if f == fr.index]
        self._in_flight = [
            _InFlight(int(p["fragment"]), int(p["due"]), [], [b.clone() for b in p["buffers"]],
                      None if p["residual"] is None else p["residual"].clone())
            for p in state["in_flight"]]
