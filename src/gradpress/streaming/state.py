"""The checkpoint half of :class:`~gradpress.streaming.StreamingDiLoCoAverager`: each fragment's state
(:class:`Fragment`), an outer update in flight (:class:`InFlight`), what the averager's ``state_dict()``
holds of them (shared: anchors and momenta, sharded like the parameters; per rank: residuals, PowerSGD
memory, updates in flight) and how a load restores them (:class:`FragmentCheckpoint`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..averaging import ModelAverager, OuterStep
from ..averaging.outer import outer_template, restore_outer
from ..averaging.saved import Kind
from ..averaging.shards import local_views, on_device_of
from ..averaging.transport import OuterTransport, OwnerResidual, Sent
from ..checkpoint import check_placement, placement

__all__ = ["Fragment", "FragmentCheckpoint", "InFlight"]


class Fragment:
    """Per-fragment state: its outer step (the anchor: global parameters at its last sync, identical on
    every rank; and the outer optimizer's momentum), the transport bound to that anchor, this rank's
    error-feedback residual and, under two-shot, its owner residual, and counters."""

    __slots__ = ("index", "offset", "positions", "outer", "transport", "residual", "owner", "syncs", "bytes_sent",
                 "link_bytes")

    def __init__(self, index: int, offset: int) -> None:
        self.index = index
        self.offset = offset
        self.positions: list[int] = []
        self.outer: OuterStep | None = None
        self.transport: OuterTransport | None = None
        self.residual: Tensor | None = None
        self.owner = OwnerResidual()
        self.syncs = 0          # outer syncs started: seeds the stochastic rounding
        self.bytes_sent = 0
        self.link_bytes = 0.0

    @property
    def anchor(self) -> list[Tensor] | None:
        return None if self.outer is None else self.outer.anchor


class InFlight:
    """An outer gradient sent and not yet applied: what its transport has in flight (``sent``: the
    collectives' handles, their output buffers, and the residual this rank keeps if the result is
    finite), the step at which it is applied (``due``), the fragment's sync count when it was sent
    (``sync``: it seeds the owner's rounding), the step that issues its second phase, if it has one
    (``progress_at``, at most ``due``), and under a sync group whether one of its collectives failed."""

    __slots__ = ("fragment", "due", "sent", "sync", "progress_at", "failed")

    def __init__(self, fragment: int, due: int, sent: Sent, sync: int = 0, progress_at: int | None = None) -> None:
        self.fragment = fragment
        self.due = due
        self.sent = sent
        self.sync = sync
        self.progress_at = due if progress_at is None else progress_at
        #: Under a sync group: a collective of this sync failed (it will not be applied).
        self.failed = False


class FragmentCheckpoint(ModelAverager):
    """The state methods of :class:`~gradpress.streaming.StreamingDiLoCoAverager` (its base): the
    attributes below are set by the averager."""

    num_fragments: int
    compression: Any
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    _transport: OuterTransport
    _fragments: list[Fragment]
    _layout: list[int] | None
    _in_flight: list[InFlight]

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's whole state as one plain dict (fragments' anchors, residuals, updates in flight)."""
        state = {**super().local_state_dict(), "placement": placement(self.process_group),
                 "compression": repr(self.compression), "layout": None if self._layout is None else list(self._layout)}
        state["fragments"] = [{
            **(fr.outer.state_dict() if fr.outer is not None else {"anchor": None, "outer": None}),
            **self._own_fragment(fr), "syncs": fr.syncs} for fr in self._fragments]
        state["in_flight"] = self._in_flight_state()
        return state

    def global_state_dict(self) -> dict[str, Any]:
        """What every replica holds alike, as copies: the step, ``num_averages``, the fragment layout and
        each fragment's anchor, outer momentum and sync count. What a fault-tolerant group copies to a
        joining replica when it heals it (:meth:`load_global_state_dict` there); the rest of the state is
        this replica's own (residuals, owner residuals, byte counters, updates in flight) and starts from
        zero on the joiner: copying a peer's residual would apply that peer's unsent mass twice."""
        return {"step": self.step, "num_averages": self.num_averages, "compression": repr(self.compression),
                "layout": None if self._layout is None else list(self._layout),
                "fragments": [{**(fr.outer.state_dict() if fr.outer is not None else {"anchor": None, "outer": None}),
                               "syncs": fr.syncs} for fr in self._fragments]}

    def load_global_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a peer's :meth:`global_state_dict` (a replica healed by its group): the shared values are
        copied, this replica's own start from zero (no residual, no owner residual, nothing in flight, byte
        counters at 0). ``ValueError`` for a state of another compression or fragment count."""
        if state.get("compression") != repr(self.compression):
            raise ValueError(f"{type(self).__name__}.load_global_state_dict: the state was saved with compression="
                             f"{state.get('compression')}, this averager has compression={self.compression!r}")
        self._load(state, None, True)

    def _own_fragment(self, fr: Fragment) -> dict[str, Any]:
        return {"residual": None if fr.residual is None else fr.residual.clone(),
                **({} if fr.transport is None or fr.transport.state_dict() is None
                   else {"powersgd": fr.transport.state_dict()}),
                **fr.owner.state_dict(), "bytes_sent": fr.bytes_sent, "link_bytes": fr.link_bytes}

    def _in_flight_state(self) -> list[dict[str, Any]]:
        in_flight = []
        for pending in self._in_flight:
            sent = pending.sent
            sent.wait()
            two_shot = {} if sent.schedule != "two-shot" else {
                "schedule": sent.schedule, "phase": sent.phase, "owner": list(sent.owner or ()),
                "sync": pending.sync, "progress_at": pending.progress_at,
                "owner_residual": None if sent.owner_residual is None else sent.owner_residual.clone()}
            in_flight.append({"fragment": pending.fragment, "due": pending.due,
                              "buffers": [b.clone() for b in sent.buffers],
                              "residual": None if sent.residual is None else sent.residual.clone(),
                              **({} if sent.finite is None else {"finite": sent.finite.clone()}),
                              **({} if sent.schedule is None else {"schedule": sent.schedule}), **two_shot})
        return in_flight

    def _shared_state(self) -> dict[str, Any]:
        state = super()._shared_state()
        state["compression"] = repr(self.compression)
        state["layout"] = None if self._layout is None else list(self._layout)
        specs = local_views(self._params)[1] if self._params else []  # as the parameters are sharded
        fragments = []
        for fr in self._fragments:
            if fr.outer is not None:
                item = outer_template(fr.outer, [], [specs[i] for i in fr.positions] if specs else [],
                                      self.outer_momentum)
            elif self._layout is not None and self._params:
                item = outer_template(None, [self._params[i] for i in fr.positions], [], self.outer_momentum)
            else:
                item = {"anchored": False}
            fragments.append({**item, "syncs": fr.syncs})
        state["fragments"] = fragments
        return state

    def _kind(self) -> Kind:
        tensors = None if self._layout is None else tuple(len(fr.positions) for fr in self._fragments)
        return Kind("streaming", self.num_fragments, tensors)

    def _per_rank_contents(self, own: Mapping[str, Any]) -> list[str]:
        parts = super()._per_rank_contents(own)
        for f, item in enumerate(own.get("fragments") or []):
            if item.get("residual") is not None:
                parts.append(f"fragment {f}'s error-feedback residual (compression={self.compression!r})")
            if item.get("owner_residual") is not None:
                parts.append(f"fragment {f}'s owner residual of two-shot syncs")
            if "powersgd" in item:
                parts.append(f"fragment {f}'s PowerSGD error memory (compression=Config(...))")
        for pending in own.get("in_flight") or []:
            if pending.get("residual") is not None:
                parts.append(f"the residual of fragment {pending['fragment']}'s update in flight")
        return parts

    def _own_state(self) -> dict[str, Any]:
        own = super()._own_state()
        own["fragments"] = [self._own_fragment(fr) for fr in self._fragments]
        own["in_flight"] = self._in_flight_state()
        return own

    def _load(self, state: Mapping[str, Any], own: Mapping[str, Any] | None, allow_other_rank: bool) -> None:
        saved = state["fragments"]
        if len(saved) != self.num_fragments:
            raise ValueError(f"StreamingDiLoCoAverager checkpoint has {len(saved)} fragments, this averager "
                             f"{self.num_fragments}")
        mine = None if own is None else own.get("fragments", saved)
        in_flight = [] if own is None else own.get("in_flight", [])
        if mine is not None and (any(f.get("residual") is not None or "powersgd" in f for f in mine) or
                                 any(p["residual"] is not None for p in in_flight)):
            check_placement(own.get("placement"), placement(self.process_group),  # type: ignore[union-attr]
                            "StreamingDiLoCoAverager", allow_other_rank)
        if in_flight and state.get("compression") != repr(self.compression):
            raise ValueError(f"StreamingDiLoCoAverager checkpoint has outer updates in flight encoded with compression="
                             f"{state.get('compression')}, but this averager has compression={self.compression!r}")
        super()._load(state, own, allow_other_rank)
        self._layout = None if state["layout"] is None else [int(f) for f in state["layout"]]
        for fr in self._fragments:
            fr.positions = [] if self._layout is None else [i for i, f in enumerate(self._layout) if f == fr.index]
        for fr, item in zip(self._fragments, saved):
            ours = None if mine is None else mine[fr.index]
            members = [self._params[i] for i in fr.positions] if self._params and self._layout is not None else []
            outer = restore_outer(item, members, self.outer_lr, self.outer_momentum, self.nesterov,
                                  type(self).__name__)
            fr.outer, fr.transport = outer, None
            if outer is not None:
                fr.transport = self._transport.bind(outer.anchor, self.process_group)
                if ours is not None and "powersgd" in ours and fr.transport.state_dict() is not None:
                    fr.transport.load_state_dict(ours["powersgd"])  # placement checked above
            fr.residual = None if ours is None else on_device_of(ours["residual"], fr.anchor)
            fr.syncs = int(item["syncs"])
            fr.bytes_sent = 0 if ours is None else int(ours["bytes_sent"])
            fr.link_bytes = 0.0 if ours is None else float(ours.get("link_bytes", 0.0))
            fr.owner = OwnerResidual()
            if ours is not None and fr.anchor is not None:
                fr.owner.load(ours, placement(self.process_group), fr.anchor[0].device,
                              f"{type(self).__name__}, fragment {fr.index}")
        here = placement(self.process_group)
        self._in_flight = []
        for p in in_flight:
            fr = self._fragments[int(p["fragment"])]
            owner = tuple(int(v) for v in p["owner"]) if p.get("owner") else None
            if p.get("schedule") == "two-shot" and owner != (here["rank"], here["world_size"]):
                sender = f"rank {owner[0]} of {owner[1]}" if owner else "another rank"
                raise ValueError(f"{type(self).__name__}.load_state_dict: fragment {fr.index}'s two-shot sync in "
                                 f"flight was sent as {sender}; its all-to-all delivered that rank's region and "
                                 f"cannot be finished as rank {here['rank']} of {here['world_size']}: load each "
                                 "rank's own state, or on_world_size_change='fresh' on another world size (updates in "
                                 "flight dropped)")
            sent = Sent([], [on_device_of(b, fr.anchor) for b in p["buffers"]], on_device_of(p["residual"], fr.anchor),
                        finite=on_device_of(p.get("finite"), fr.anchor), schedule=p.get("schedule"),
                        phase=int(p.get("phase", 1)), owner_residual=on_device_of(p.get("owner_residual"), fr.anchor),
                        owner=owner)  # type: ignore[arg-type]
            self._in_flight.append(InFlight(int(p["fragment"]), int(p["due"]), sent, int(p.get("sync", 0)),
                                            p.get("progress_at")))

