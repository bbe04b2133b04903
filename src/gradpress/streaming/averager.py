"""Streaming DiLoCo as a model averager: fragments, overlapped outer steps, compressed outer gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..aggregator import Config
from ..averaging import OuterStep
from ..averaging.compress import Compressor
from ..averaging.outer import anchored_state_dict, check_first_sync, no_anchor_message, take_anchor, takes_anchor
from ..averaging.tensors import Params
from ..averaging.transport import Link, OuterTransport, Sent, transport_for
from ..validation import check_int, check_number
from ..comm import average_tensors_, is_member, link_bytes
from .elastic import check_sync_group, guarded, means_if_committed, round_start
from .fragments import FragmentSpec, explicit_layout, fragment_members, fragment_offsets, split_by_size
from .state import Fragment, FragmentCheckpoint, InFlight

__all__ = ["StreamingDiLoCoAverager"]

Compression = Union[None, str, Compressor, Config, OuterTransport]


class StreamingDiLoCoAverager(FragmentCheckpoint):
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
    in one: ``fragments=model_fragments(model, model.layers)``, :func:`~gradpress.streaming.model_fragments`,
    adds a GPT's embeddings, final norm and head to the layers' fragments; a tensor in none is refused
    when the averager first sees the parameters, by name where they carry one). With
    ``r = step - warmup_steps``, fragment ``f`` is *sent* at the steps where ``r >= 0``
    and ``r % sync_every`` is its offset (:func:`~gradpress.streaming.fragments.fragment_offsets`), and
    its update is applied ``τ = fragment_sync_delay`` steps later:

    * ``fragment_phase="start"`` (the default): sent at ``f * sync_every // F``, fragment 0 right after
      warm-up (with ``F=1`` at ``warmup_steps``, like :class:`gradpress.OuterOptimizerAverager`), and
      applied at ``f * sync_every // F + τ``;
    * ``fragment_phase="end"`` (torchft's ``DiLoCo``): applied at the end of the fragment's period,
      ``(f + 1) * sync_every // F - 1`` (after ``(f + 1) · sync_every / F`` local steps), and sent ``τ``
      steps before it, at ``(f + 1) * sync_every // F - 1 - τ`` (torchft's ``prepare_sync`` then
      ``perform_sync``); ``τ`` must be below ``sync_every // F``, as in torchft, so one fragment is in
      flight at a time and every fragment is sent in the first period.

    With ``τ = 0`` a fragment is sent and applied at the same step in either phase. Each tensor is sent once per
    ``sync_every`` steps, one fragment per step at most, so a sync moves about ``1/F`` of the model.

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

    ``F=1, τ=0`` reproduces :class:`gradpress.OuterOptimizerAverager` with the same ``compression`` bit for bit.
    The collectives are issued from :meth:`average_parameters` only, in step order, so every rank
    issues the same ones in the same order; at most one fragment is sent per step and a fragment is
    applied before it is sent again (``τ < sync_every``). Updates still in flight when training stops
    are not applied.

    **Compression** (``compression``, the transports :class:`gradpress.OuterOptimizerAverager` takes too,
    :mod:`gradpress.averaging.transport`):

    * ``None``: one all-reduce of ``δ / world`` per (device, dtype), in that dtype;
    * ``"fp16"``/``"bf16"``: the same all-reduce in that dtype (no error feedback);
    * a :class:`gradpress.Config`: PowerSGD per fragment (its error memory per rank), blocking at the send
      step, the result applied ``τ`` steps later;
    * a :class:`QuantizeInt8`, :class:`QuantizeInt4` or :class:`TopK`: ``e = δ + residual`` (fp32, or
      fp64 for fp64 parameters) is encoded and ``residual ← e - decode(own payload)`` (error feedback:
      over time nothing is lost). Codes with per-rank scales cannot be summed as they are, so the
      payloads travel by ``schedule`` (:mod:`gradpress.averaging.twoshot`):

      - ``"all-gather"``: one ``uint8`` all-gather; every rank decodes every payload with its sender's
        scales, sums in fp32/fp64 in rank order and divides by the world size. Exact, but each rank's
        link carries ``(W - 1)`` payloads: against ``2 (W - 1) / W · 4n`` for an fp32 all-reduce, int8
        pays below 8 ranks, int4 below 16.
      - ``"two-shot"``: the fragment is cut into ``W`` regions of whole chunks; an all-to-all hands each
        region's payloads to its owner rank, which decodes them, sums in rank order, divides by ``W``,
        adds its *owner residual*, encodes again (keeping what that missed as its owner residual) and
        all-gathers its row: ``2 (W - 1) / W`` of the padded payload per rank, as an all-reduce, for one
        more rounding carried by the owner's error feedback. The all-gather is issued at step
        ``s + (τ + 1) // 2`` (``s`` the send step), so both phases overlap inner steps when ``τ >= 2``.
        Owner residuals are dropped (logged) when the rank or the world size changes.
      - ``"auto"`` (the default): two-shot for int8/int4 from 3 ranks, all-gather otherwise. Top-k
        two-shot is another algorithm (the owner keeps the top k of each chunk of the mean, so the update
        stays at density d instead of the union of the ranks' supports): taken only when asked for.

    ``bytes_sent`` counts the payload bytes this rank hands to collectives (at the steps it issues them);
    ``link_bytes`` what its link carries for them, ring-equivalent at the world size of each sync
    (:func:`gradpress.comm.link_bytes`); ``fragment_bytes_sent`` and ``fragment_link_bytes`` split them by
    fragment. ``num_averages`` counts fragment syncs applied (plain or outer).

    **Non-finite outer gradients** never reach the anchor: when ``Δ`` of a fragment holds a NaN or an
    infinity (decided on every rank from the same collective result, on the device, no host sync), its
    outer step is skipped: the anchor and momentum keep their values, the fragment's parameters are reset
    to the anchor on every rank, and the residual keeps its value from before that sync.

    **Checkpoints.** :meth:`state_dict` holds the step, counters, the fragment layout, each fragment's
    anchor and outer momentum (shared, or sharded as DTensors), and per rank (see
    :class:`~gradpress.averaging.ModelAverager`) each fragment's residual and PowerSGD memory and, for
    each update in flight, its due step and what its collective returned: ``state_dict`` *waits* for
    in-flight collectives (every rank already issued them, so this cannot deadlock) and stores the
    results; after :meth:`load_state_dict` they are applied at their due steps as if never interrupted,
    and no collective is issued again. Residuals are per rank: loading a checkpoint saved on another rank
    raises ``ValueError`` unless ``allow_other_rank=True``, on another world size unless
    ``on_world_size_change="fresh"`` (residuals, memory and updates in flight then start fresh or are
    dropped). Resuming equals never stopping, bit for bit, through ``torch.save`` or
    ``torch.distributed.checkpoint``.

    Args:
        sync_every: inner steps between two syncs of the same fragment (``H``; torchft's name).
        warmup_steps: calls before the first sync (:class:`PeriodicModelAverager`'s semantics).
        process_group: the group to average over (``None``: the default group).
        num_fragments: ``F``, in ``[1, sync_every]`` (default 1); exclusive with ``fragments``.
        fragments: explicit fragments (modules or iterables of tensors), at most ``sync_every``.
        fragment_sync_delay: ``τ`` in ``[0, sync_every)``; with ``fragment_phase="end"`` in
            ``[0, sync_every // F)``.
        fragment_update_alpha: ``α`` in ``[0, 1]``.
        fragment_phase: ``"start"`` (default: send on schedule, apply ``τ`` later) or ``"end"`` (torchft's:
            apply on schedule, send ``τ`` earlier), see above.
        first_sync: ``"outer"`` (default, the paper's) or ``"average"``, see above.
        outer_lr, outer_momentum, nesterov: the outer SGD (as :class:`OuterOptimizerAverager`).
        compression: ``None``, ``"fp16"``, ``"bf16"``, a :class:`~gradpress.streaming.Compressor`, a
            :class:`gradpress.Config` or an ``OuterTransport``.
        schedule: ``"auto"`` (default), ``"all-gather"`` or ``"two-shot"``: how a compressor's payloads
            travel, see above (other compressions are all-reduced and take ``"auto"`` only).
        average_buffers: also synchronize floating-point buffers.
        sync_group: who takes part in each sync when that is decided per sync
            (:class:`~gradpress.averaging.syncgroup.SyncGroup`: a torchft ``Manager`` through
            ``gradpress.integrations.torchft.FaultTolerantGroup``, or the replica simulator's membership),
            instead of ``process_group``. The schedule is then torchft's ``DiLoCo``'s: ``fragment_phase="end"``,
            ``sync_every`` a multiple of ``F``, no warm-up; fragment ``m % F`` syncs in each round, ``m`` the
            syncs committed so far, and the sync's stochastic rounding is seeded from ``m`` too; the anchor is
            taken locally (the group heals a joiner from a peer). A sync that does not commit (a member lost,
            too few members) leaves the anchor, the outer momentum, the residual and the owner residual bitwise
            as they were, puts the fragment's parameters back to its anchor and is retried in the next round.
            See ``docs/torchft.md``.

    Example::

        from gradpress import PostLocalSGDOptimizer, StreamingDiLoCoAverager, QuantizeInt4
        averager = StreamingDiLoCoAverager(sync_every=100, num_fragments=4, fragment_sync_delay=5,
                                           fragment_update_alpha=0.5, compression=QuantizeInt4())
        optimizer = PostLocalSGDOptimizer(torch.optim.AdamW(model.parameters()), averager)
        for x, y in loader:
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
        torch.save(optimizer.state_dict(), f"ckpt-rank{rank}.pt")  # one file per rank
    """

    _outer_step = True  # native HSDP across its group would make it another optimizer: refused

    def __init__(self, sync_every: int, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None,
                 *, num_fragments: int | None = None, fragments: Sequence[FragmentSpec] | None = None,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, compression: Compression = None,
                 average_buffers: bool = False, fragment_phase: str = "start", first_sync: str = "outer",
                 schedule: str = "auto", sync_group: Any = None) -> None:
        check_sync_group(sync_group, process_group=process_group, sync_every=sync_every,
                         num_fragments=num_fragments if num_fragments is not None else
                         len(fragments) if isinstance(fragments, Sequence) else 1,
                         warmup_steps=warmup_steps, fragment_phase=fragment_phase, first_sync=first_sync,
                         compression=compression)
        super().__init__(process_group, average_buffers)
        self.sync_group = sync_group
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
            self._explicit = fragment_members(fragments)
            num_fragments = len(fragments)
        elif num_fragments is None:
            num_fragments = 1
        self.num_fragments = check_int("num_fragments", num_fragments, 1, sync_every)
        self.fragment_sync_delay = check_int("fragment_sync_delay", fragment_sync_delay, 0, sync_every - 1)
        self.fragment_update_alpha = check_number("fragment_update_alpha", fragment_update_alpha,
                                                   lambda v: 0 <= v <= 1, "in [0, 1]")
        self.outer_lr, self.outer_momentum, self.nesterov = OuterStep.check_options(outer_lr, outer_momentum, nesterov)
        self._transport = transport_for(compression, schedule)  # ValueError listing the accepted values
        self.compression = compression
        self.schedule = schedule
        self.first_sync = check_first_sync(first_sync)
        self.fragment_phase = fragment_phase
        offsets = fragment_offsets(sync_every, self.num_fragments, fragment_phase, self.fragment_sync_delay)
        self._fragments = [Fragment(f, offset) for f, offset in enumerate(offsets)]  # send offsets
        self._by_offset = {fr.offset: fr for fr in self._fragments}
        self._layout: list[int] | None = None
        self._in_flight: list[InFlight] = []

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
    def fragment_link_bytes(self) -> list[float]:
        """Bytes this rank's link carried so far (ring-equivalent), per fragment."""
        return [fr.link_bytes for fr in self._fragments]

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
        super().anchor_parameters(params)  # reads them once, then _anchor

    def _anchor(self, tensors: list[Tensor]) -> None:
        super()._anchor(tensors)  # writes a loaded checkpoint's parameters into them
        if self._explicit is not None and is_member(self.process_group):  # refused now, not at the first sync
            explicit_layout(tensors, self._explicit, self.num_fragments, self._unnamed_hint, type(self).__name__)
        if takes_anchor(self, from_average=False):
            self._take_anchor(tensors)

    def anchor_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The model the islands agreed on, fragment by fragment: ``model.state_dict()`` with each averaged
        tensor replaced by its fragment's anchor, the global parameters at that fragment's last sync
        (see :meth:`gradpress.OuterOptimizerAverager.anchor_state_dict`: between syncs a DCP checkpoint of
        ``model.state_dict()`` is a per-shard mix of the islands' parameters). ``ValueError`` before the
        anchors are taken."""
        if self._layout is None or not self.anchored:
            raise ValueError(f"{type(self).__name__}.anchor_state_dict: no anchor yet (taken when the "
                             "PostLocalSGDOptimizer is built, or at the last warm-up step): until then the "
                             "islands train together, and model.state_dict() is the model")
        anchors: list[Tensor | None] = [None] * len(self._layout)
        for fr in self._fragments:
            for j, position in enumerate(fr.positions):
                anchors[position] = None if fr.anchor is None else fr.anchor[j]
        return anchored_state_dict(model, self._params, anchors, type(self).__name__)

    @property
    def anchored(self) -> bool:
        """Whether the fragments' anchors are taken (or loaded)."""
        return any(fr.outer is not None for fr in self._fragments)

    @property
    def synchronized(self) -> bool:
        """Whether a fragment synchronized (sent or applied)."""
        return self.num_averages > 0 or any(fr.syncs for fr in self._fragments)

    def _take_anchor(self, tensors: list[Tensor]) -> None:
        self._bind(tensors)
        views = self._local(tensors)[0]
        if self.sync_group is not None:  # the group heals a joiner: every replica's anchor is its own start
            anchor, sent = [v.detach().clone() for v in views], 0
        else:
            anchor, sent = take_anchor(views, self.process_group)
        world = dist.get_world_size(self.process_group) if sent else 1
        for fr in self._fragments:
            self._set_anchor(fr, [anchor[i] for i in fr.positions])
            if sent:
                size = sum(anchor[i].numel() * anchor[i].element_size() for i in fr.positions)
                self._count(fr, size, link_bytes("broadcast", size, world))

    def average_parameters(self, params: Params) -> None:
        """Send the fragment scheduled at this step and apply the updates due now (see the class
        docstring); mutates ``params`` in place; advances the step counter. A collective on sync steps:
        every rank calls it at every step; a rank outside ``process_group`` only counts the step."""
        if not is_member(self.process_group):
            self.step += 1
            return
        tensors = self._remember(params)  # read once: a generator works
        if takes_anchor(self, from_average=True):
            self._take_anchor(tensors)
        sent = self.fragment_sent_at(self.step)
        group = self.sync_group
        if sent is not None and group is not None:
            group.begin()  # the sync's quorum: a joiner is healed here, its schedule read again below
            sent = self.fragment_sent_at(self.step)
        due = [p for p in self._in_flight if self.step in (p.due, p.progress_at)] if self._in_flight else []
        applied = False
        if sent is not None or due:
            self._bind(tensors)  # by the parameters' global sizes: the same layout on every shard
            views = self._local(tensors)[0]
            if sent is not None:
                self._send(self._fragments[sent], views)
            for pending in [p for p in self._in_flight if p.progress_at == self.step]:
                self._progress(pending)  # two-shot's all-gather, in the order the syncs were sent
            for pending in [p for p in self._in_flight if p.due == self.step]:
                self._apply(pending, views)
                applied = True
        self.step += 1
        if applied and group is not None:  # the next round, keyed on the syncs committed (a failed one again)
            self.step = round_start(group.committed(), self.sync_every, self.num_fragments)

    def _bind(self, tensors: list[Tensor]) -> None:
        if self._explicit is not None:
            layout = explicit_layout(tensors, self._explicit, self.num_fragments, self._unnamed_hint,
                                     type(self).__name__)
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

    def _unnamed_hint(self, index: int) -> str:
        """Averaged tensor ``index`` in words, and where its name would come from if unknown."""
        if index < len(self._names) and self._names[index]:
            return self._describe(index)
        return (f"{self._describe(index)} (its name shows here when the inner optimizer is built from "
                "model.named_parameters())")

    def _members(self, fr: Fragment, tensors: list[Tensor]) -> list[Tensor]:
        members = [tensors[i].detach() for i in fr.positions]
        if fr.anchor is not None and (len(fr.anchor) != len(members) or
                                      any(a.shape != t.shape for a, t in zip(fr.anchor, members))):
            raise ValueError(f"StreamingDiLoCoAverager: the parameters of fragment {fr.index} changed since "
                             f"its last synchronization")
        return members

    def _send(self, fr: Fragment, tensors: list[Tensor]) -> None:
        members = self._members(fr, tensors)
        if fr.anchor is None:  # first sync, first_sync="average": plain average, sets the anchor
            if self.first_sync == "outer":
                raise ValueError(no_anchor_message(type(self).__name__, self.step))
            with torch.no_grad():
                bytes_sent = average_tensors_(members, self.process_group, issuer=self._issuer())
                self._set_anchor(fr, [t.clone() for t in members])
            world = dist.get_world_size(self.process_group) if bytes_sent else 1
            self._count(fr, bytes_sent, link_bytes("allreduce", bytes_sent, world))
            self.num_averages += 1
            return
        assert fr.anchor is not None and fr.transport is not None
        group = self.sync_group
        sync = fr.syncs if group is None else group.committed() // self.num_fragments
        link = self._link(fr, sync)
        delay = self.fragment_sync_delay
        transport, anchor = fr.transport, fr.anchor
        sent = guarded(group, lambda: transport.send(anchor, members, fr.residual, link))
        failed = sent is None
        sent = Sent([], []) if sent is None else sent
        if sent.schedule == "all-gather":
            fr.owner.drop(f"{type(self).__name__}, fragment {fr.index}", "the sync is all-gathered")
        self._count(fr, sent.bytes_sent, sent.link_bytes)
        pending = InFlight(fr.index, self.step + delay, sent, sync, self.step + (delay + 1) // 2)
        pending.failed = failed
        self._in_flight.append(pending)
        fr.syncs = sync + 1

    def _link(self, fr: Fragment, sync: int) -> Link:
        """Where sync ``sync`` of fragment ``fr`` goes (this rank, the world size, its seeds)."""
        group = self.sync_group
        if group is not None:
            rank, world, exchange = group.rank, group.world, group.exchange(self._issuer())
            return Link(group.process_group, rank, world, fr.index, sync, self._issuer(),
                        lambda op, sent: self._describe_sync(fr, op, sent, world), exchange)
        rank, world = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        return Link(self.process_group, rank, world, fr.index, sync, self._issuer(),
                    lambda op, sent: self._describe_sync(fr, op, sent, world))

    def _progress(self, pending: InFlight) -> None:
        """Issue the remaining phase of ``pending`` (two-shot's all-gather), at its step on every rank."""
        sent = pending.sent
        if not sent.needs_progress or pending.failed:
            return
        fr = self._fragments[pending.fragment]
        assert fr.anchor is not None and fr.transport is not None
        group = self.sync_group
        link = self._link(fr, pending.sync)
        before = sent.bytes_sent, sent.link_bytes
        owner = fr.owner.usable(link, f"{type(self).__name__}, fragment {fr.index}")
        if guarded(group, lambda: fr.transport.progress(sent, fr.anchor, owner, link) or True) is None:  # type: ignore
            pending.failed = True
        self._count(fr, sent.bytes_sent - before[0], sent.link_bytes - before[1])

    def _describe_sync(self, fr: Fragment, op: str, sent: int, world: int) -> str:
        """The collective of one sync, as a :class:`gradpress.comm.CollectiveError` names it."""
        return (f"{op} of fragment {fr.index}'s outer gradient ({sent:,} bytes per rank) over {world} ranks in "
                f"{self._issuer()}")

    def _count(self, fr: Fragment, sent: int, link: float) -> None:
        fr.bytes_sent += sent
        self.bytes_sent += sent
        fr.link_bytes += link
        self.link_bytes += link

    def _set_anchor(self, fr: Fragment, anchor: list[Tensor]) -> None:
        """Start fragment ``fr``'s outer step from ``anchor`` and bind the transport to it."""
        fr.outer = OuterStep(anchor, self.outer_lr, self.outer_momentum, self.nesterov)
        fr.transport = self._transport.bind(anchor, self.process_group)

    def _apply(self, pending: InFlight, tensors: list[Tensor]) -> None:
        fr = self._fragments[pending.fragment]
        members = self._members(fr, tensors)
        assert fr.anchor is not None and fr.outer is not None and fr.transport is not None
        self._progress(pending)  # nothing left to issue unless a caller skipped its step
        if self.sync_group is None:
            means, finite = fr.transport.mean(pending.sent, fr.anchor)
        else:
            held = means_if_committed(self.sync_group, pending, fr.transport, fr.anchor)
            if held is None:  # not committed: every averager tensor as it was, the fragment at its anchor
                with torch.no_grad():
                    for member, a in zip(members, fr.anchor):
                        member.copy_(a)
                self._in_flight.remove(pending)
                return
            means, finite = held
        # A non-finite Δ must not move the anchor nor the momentum: decided on the device.
        fr.outer.step(means, finite)
        with torch.no_grad():
            for i, a in enumerate(fr.anchor):
                ok = finite.to(a.device)
                if self.fragment_update_alpha == 0:
                    members[i].copy_(a)
                else:  # α · local + (1 - α) · global; on a skipped step, the anchor
                    members[i].copy_(torch.where(ok, torch.lerp(a, members[i], self.fragment_update_alpha), a))
            residual = pending.sent.residual
            if residual is not None:
                old_residual = fr.residual if fr.residual is not None else torch.zeros_like(residual)
                fr.residual = torch.where(finite.to(old_residual.device), residual, old_residual)
            fr.owner.take(pending.sent, finite)
        self._in_flight.remove(pending)
        self.num_averages += 1

    # -- state ------------------------------------------------------------------------------------

    def in_sync(self) -> bool:
        # Only one fragment with no delay and no mixing leaves every rank at the anchor after its sync.
        one = self.num_fragments == 1 and self.fragment_sync_delay == 0 and self.fragment_update_alpha == 0
        return self.step <= self.warmup_steps or (one and self.fragment_sent_at(self.step - 1) is not None)
