"""DiLoCo's outer step: an anchor identical on every rank, an outer SGD on it, and a guard that never
applies a non-finite outer gradient (:class:`OuterStep`, shared with streaming DiLoCo), and the averager
that takes it every ``period`` steps (:class:`OuterOptimizerAverager`)."""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..checkpoint import check_placement, placement
from ..validation import check_number
from ..comm import broadcast_parameters, is_distributed, is_member, link_bytes
from .averagers import PeriodicModelAverager, sharded_copies
from .outer_settings import warn_if_measured_to_lose
from .saved import Kind
from .shards import Spec, as_sharded, from_saved, local_views
from .tensors import Params
from .transport import Exact, Link, OuterTransport, OwnerResidual, transport_for

__all__ = ["OuterOptimizerAverager", "OuterStep"]

logger = logging.getLogger("gradpress.averaging")


class OuterStep:
    """DiLoCo's outer step on one list of tensors: the anchor ``x`` (the parameters at the last
    synchronization, identical on every rank) and an outer SGD on it (Nesterov momentum by default).

    :meth:`step` takes the averaged outer gradient ``Δ = mean_i(x - x_i)`` and moves ``x``; the caller
    then copies ``x`` (or a mix of it) into the parameters. Used by :class:`OuterOptimizerAverager` (all
    tensors at once) and by :class:`gradpress.StreamingDiLoCoAverager` (one per fragment), so that one
    fragment with no delay reproduces the former bit for bit.
    """

    __slots__ = ("anchor", "optimizer")

    def __init__(self, anchor: list[Tensor], lr: float, momentum: float, nesterov: bool) -> None:
        self.anchor = anchor
        self.optimizer = torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=nesterov)
        if momentum > 0:  # present before the first step (a checkpoint template); zero reads as "none yet":
            for a in anchor:  # SGD's 0 * momentum + grad is its first step's clone(grad), bit for bit
                self.optimizer.state[a]["momentum_buffer"] = torch.zeros_like(a)

    @staticmethod
    def check_options(outer_lr: Any, outer_momentum: Any, nesterov: Any) -> tuple[float, float, bool]:
        """``(lr, momentum, nesterov)`` checked (``ValueError`` naming ``outer_lr`` or ``outer_momentum``);
        Nesterov only with momentum."""
        lr = check_number("outer_lr", outer_lr, lambda v: v > 0, "> 0")
        momentum = check_number("outer_momentum", outer_momentum, lambda v: 0 <= v < 1, "in [0, 1)")
        return lr, momentum, bool(nesterov) and momentum > 0

    def matches(self, tensors: list[Tensor]) -> bool:
        """Whether ``tensors`` have the anchor's count and shapes."""
        return len(self.anchor) == len(tensors) and all(a.shape == t.shape for a, t in zip(self.anchor, tensors))

    def step(self, grads: list[Tensor], finite: Tensor | None = None) -> None:
        """One outer SGD step on the anchor with gradient ``grads`` (cast to the anchor's dtypes).

        ``finite``: ``None`` applies the step. A 0-dim bool tensor decides on the device, with no host
        read: where it is false, the anchor and the momentum end exactly as before (a momentum buffer the
        step creates is then zero, which the next step reads as "no momentum yet"). A caller that decided
        on the host that ``grads`` are not finite does not call this at all.
        """
        before: list[Tensor] = []
        momentum_before: list[Tensor | None] = []
        with torch.no_grad():
            if finite is not None:
                before = [a.clone() for a in self.anchor]
                momentum_before = [self._momentum(a) for a in self.anchor]
                momentum_before = [None if m is None else m.clone() for m in momentum_before]
            for a, grad in zip(self.anchor, grads):
                a.grad = grad.to(a.dtype)
        self.optimizer.step()
        with torch.no_grad():
            for i, a in enumerate(self.anchor):
                a.grad = None
                if finite is None:
                    continue
                ok = finite.to(a.device)
                torch.where(ok, a, before[i], out=a)
                momentum = self._momentum(a)
                if momentum is not None:
                    old = momentum_before[i]
                    torch.where(ok, momentum, old if old is not None else torch.zeros_like(momentum), out=momentum)

    def _momentum(self, anchor: Tensor) -> Tensor | None:
        return self.optimizer.state.get(anchor, {}).get("momentum_buffer")

    def state_dict(self) -> dict[str, Any]:
        """``{"anchor": [tensors], "outer": the outer SGD's state_dict}`` (copies)."""
        return {"anchor": [a.detach().clone() for a in self.anchor],
                "outer": copy.deepcopy(self.optimizer.state_dict())}

    def momenta(self) -> list[Tensor] | None:
        """The momentum buffers (the tensors themselves), or ``None`` without momentum."""
        if self.optimizer.defaults["momentum"] == 0:
            return None
        out = []
        for a in self.anchor:
            buffer = self._momentum(a)
            out.append(torch.zeros_like(a) if buffer is None else buffer)
        return out

    @classmethod
    def from_parts(cls, anchor: list[Tensor], momenta: list[Tensor] | None, lr: float, momentum: float,
                   nesterov: bool) -> OuterStep:
        """An outer step on ``anchor`` (kept) with momentum buffers copied from ``momenta``."""
        outer = cls(anchor, lr, momentum, nesterov)
        if momenta is not None and momentum > 0:
            with torch.no_grad():
                for a, m in zip(anchor, momenta):
                    outer.optimizer.state[a]["momentum_buffer"].copy_(m)
        return outer

    @classmethod
    def restore(cls, state: Mapping[str, Any], lr: float, momentum: float, nesterov: bool) -> OuterStep:
        """An outer step from :meth:`state_dict`'s ``anchor`` and ``outer`` (copied, not kept)."""
        outer = cls([a.detach().clone() for a in state["anchor"]], lr, momentum, nesterov)
        outer.optimizer.load_state_dict(copy.deepcopy(state["outer"]))
        return outer


class OuterOptimizerAverager(PeriodicModelAverager):
    """DiLoCo (Douillard et al. 2023): every ``period`` steps, average the change since the last
    synchronization and apply it with an outer SGD (Nesterov momentum by default).

    With ``x`` the *anchor* (identical on every rank) and ``x_i`` rank i's parameters now, the outer
    gradient is ``Δ = mean_i(x - x_i)``; the outer optimizer takes a step on ``x`` with gradient ``Δ``
    and every rank continues from the new ``x``. As in the paper and in torchft, every synchronization,
    the first included, is such an outer step, and the first anchor is the parameters where local
    training starts, taken once: without warm-up by :meth:`anchor_parameters`, which
    :class:`PostLocalSGDOptimizer` calls when it is built; with ``warmup_steps`` by
    :meth:`average_parameters` at the last warm-up step (warm-up steps are taken to be synchronous, e.g.
    DDP with :func:`post_localSGD_hook` until ``start_localSGD_iter``, so local training starts after
    them). Taking the anchor broadcasts rank 0's values (one collective), so ranks that did not start
    equal cannot drift apart. With :class:`PeriodicModelAverager`'s schedule the first outer step comes
    at ``warmup_steps``, one inner step after the anchor, and then every ``period`` steps.
    ``first_sync="average"`` restores the former rule: the first synchronization is a plain average
    that sets the anchor. ``outer_lr=1, outer_momentum=0`` is plain periodic averaging (from the second
    synchronization on, or with ``first_sync="average"``). ``compression``: how Δ is sent, any of the
    transports :class:`gradpress.StreamingDiLoCoAverager` takes (:func:`~gradpress.averaging.transport.transport_for`):
    ``None``, ``"fp16"``, ``"bf16"`` (cast Δ for the allreduce), a :class:`gradpress.Config` to send Δ
    through PowerSGD (with its own error feedback), a ``QuantizeInt8``/``QuantizeInt4``/``TopK``
    compressor (a per-rank residual as error feedback) or an ``OuterTransport``. ``schedule``: how a
    compressor's payloads travel (:mod:`gradpress.averaging.twoshot`): ``"all-gather"`` (each rank's link
    carries ``(W - 1)`` payloads), ``"two-shot"`` (an all-to-all of regions to their owners, who requantize
    the mean with their own residual, then an all-gather: ``2 (W - 1) / W`` of the padded payload, one
    more rounding) or ``"auto"`` (the default: two-shot for int8/int4 from 3 ranks, all-gather
    otherwise; top-k two-shot is another algorithm, the update staying at density d instead of the
    union of the ranks' supports, and is taken only when asked for). Other compressions are all-reduced
    and take ``"auto"`` only; a bad value raises ``ValueError`` here, naming the allowed ones.

    A non-finite averaged Δ (a rank's parameters overflowed to inf/NaN since the last synchronization;
    the mean carries it to every rank) is never applied: the outer step is skipped, ``x`` and the outer
    momentum stay as they were, the PowerSGD memory too (compressed variant), and every rank goes back
    to ``x``, so all ranks stay identical and finite (a compressor's residual keeps its value too).
    ``num_skipped`` counts such synchronizations (a warning is logged); they do not count in
    ``num_averages``. Deciding reads one flag on the host per synchronization.

    >>> averager = OuterOptimizerAverager(period=50, outer_lr=0.7, outer_momentum=0.9)     # doctest: +SKIP
    >>> optimizer = PostLocalSGDOptimizer(torch.optim.AdamW(model.parameters()), averager)  # doctest: +SKIP
    """

    _outer_step = True  # native HSDP across its group would make it another optimizer: refused

    def __init__(self, period: int, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None, *,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 compression: Any = None, average_buffers: bool = False, first_sync: str = "outer",
                 schedule: str = "auto") -> None:
        super().__init__(period, warmup_steps, process_group, average_buffers=average_buffers)
        self.outer_lr, self.outer_momentum, self.nesterov = OuterStep.check_options(outer_lr, outer_momentum, nesterov)
        self._transport = transport_for(compression, schedule)  # ValueError listing the accepted values
        warn_if_measured_to_lose(type(self).__name__, self.period, self.outer_lr, self.outer_momentum)
        self.first_sync = check_first_sync(first_sync)
        self.compression = compression
        self.schedule = schedule
        self._outer: OuterStep | None = None
        self._bound: OuterTransport | None = None  # the transport bound to the anchor (PowerSGD's memory)
        self._residual: Tensor | None = None       # a compressor's error feedback, this rank's
        self._owner = OwnerResidual()              # two-shot: this rank's error feedback as an owner
        self.num_skipped = 0

    def anchor_parameters(self, params: Params) -> None:
        """Take ``params`` as the anchor, the parameters where local training starts (before the first
        inner step; :class:`PostLocalSGDOptimizer` calls it when built): rank 0's values (of
        ``process_group``) are copied to every rank's anchor (a collective: every rank calls it). Does
        nothing where :func:`takes_anchor` says so: with a warm-up (the anchor is taken at its last step),
        once a synchronization happened (the anchor and its momentum are the run's), with
        ``first_sync="average"``, or on a rank outside ``process_group``."""
        super().anchor_parameters(params)  # reads them once, then _anchor

    def _anchor(self, tensors: list[Tensor]) -> None:
        super()._anchor(tensors)  # writes a loaded checkpoint's parameters into them
        if takes_anchor(self, from_average=False):
            self._take_anchor(tensors)

    def _take_anchor(self, tensors: list[Tensor]) -> None:
        anchor, sent = take_anchor(self._local(tensors)[0], self.process_group)
        self.bytes_sent += sent
        self.link_bytes += link_bytes("broadcast", sent, dist.get_world_size(self.process_group)) if sent else 0.0
        self._start(OuterStep(anchor, self.outer_lr, self.outer_momentum, self.nesterov))

    def average_parameters(self, params: Params) -> None:
        tensors = self._remember(params)  # read once: a generator works
        if takes_anchor(self, from_average=True):
            self._take_anchor(tensors)
        self._average_step(tensors)

    def anchor_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The model every island agreed on at the last synchronization: ``model.state_dict()`` with each
        averaged tensor replaced by a copy of its anchor (a ``DTensor`` laid out like the parameter where
        it is sharded). Between synchronizations each island holds its own parameters, and a
        ``torch.distributed.checkpoint`` of ``model.state_dict()`` keeps each shard once, from whichever
        island DCP picks: a per-shard mix that is neither island's model. Save this to evaluate or export
        a consistent model at any step (``dcp.save({"model": averager.anchor_state_dict(model)}, ...)``).
        ``ValueError`` before the anchor is taken."""
        if self._outer is None:
            raise ValueError(f"{type(self).__name__}.anchor_state_dict: no anchor yet (it is taken when the "
                             "PostLocalSGDOptimizer is built, or at the last warm-up step): until then the "
                             "islands train together, and model.state_dict() is the model")
        return anchored_state_dict(model, self._params, list(self._outer.anchor), type(self).__name__)

    @property
    def powersgd(self) -> Any:
        """The :class:`gradpress.PowerSGD` aggregator that sends Δ when ``compression`` is a
        :class:`gradpress.Config` (once the anchor is taken), else ``None``."""
        return getattr(self._bound, "aggregator", None)

    @property
    def anchored(self) -> bool:
        """Whether the anchor is taken (or loaded)."""
        return self._outer is not None

    @property
    def synchronized(self) -> bool:
        """Whether a synchronization happened (applied or skipped)."""
        return self.num_averages + self.num_skipped > 0

    def _average(self, tensors: list[Tensor]) -> None:
        with torch.no_grad():
            if self._outer is None:
                if self.first_sync == "outer":
                    raise ValueError(no_anchor_message(type(self).__name__, self.step))
                super()._average(tensors)
                self._start(OuterStep([t.detach().clone() for t in tensors], self.outer_lr, self.outer_momentum,
                                      self.nesterov))
                return
            if not self._outer.matches(tensors):
                raise ValueError("OuterOptimizerAverager: the parameters changed since the last synchronization")
            assert self._bound is not None
            distributed = is_distributed()
            world = dist.get_world_size(self.process_group) if distributed else 1
            link = Link(self.process_group, dist.get_rank(self.process_group) if distributed else 0, world,
                        sync=self.num_averages + self.num_skipped, issuer=self._issuer())
            sent = self._bound.send(self._outer.anchor, tensors, self._residual, link)
            if sent.needs_progress:  # two-shot: the owner's reduction, then the all-gather
                self._bound.progress(sent, self._outer.anchor, self._owner.usable(link, type(self).__name__), link)
            elif sent.schedule == "all-gather":
                self._owner.drop(type(self).__name__, "the sync is all-gathered")
            deltas, flag = self._bound.mean(sent, self._outer.anchor)
            # An exact average counts the bytes that cross the link (none alone, as average_tensors_);
            # the other transports what they hand to their collectives, as the streaming averager does.
            self.bytes_sent += 0 if world == 1 and isinstance(self._transport, Exact) else sent.bytes_sent
            self.link_bytes += sent.link_bytes
            # The averaged deltas are the same on every rank, so every rank takes the same branch.
            finite = bool(flag)
            if finite and sent.residual is not None:
                self._residual = sent.residual
            if finite:
                self._owner.take(sent)
        if finite:
            self._outer.step(deltas)
        with torch.no_grad():
            for anchor, t in zip(self._outer.anchor, tensors):
                t.detach().copy_(anchor)  # on a skipped step, back to the last synchronized parameters
        if finite:
            self.num_averages += 1
        else:
            self.num_skipped += 1
            logger.warning("OuterOptimizerAverager: the averaged change at step %s is not finite; the outer "
                           "step is skipped and every rank goes back to the last synchronized parameters",
                           self.step)

    def _start(self, outer: OuterStep) -> None:
        """Take ``outer`` and bind the transport to its anchor (for PowerSGD a fresh aggregator; the anchor
        is identical on every rank, so this issues no collective); a compressor's residual starts empty."""
        self._outer = outer
        self._bound = self._transport.bind(outer.anchor, self.process_group)
        self._residual = None
        self._owner = OwnerResidual()

    def in_sync(self) -> bool:
        # A synchronization, applied or skipped, leaves every rank at the anchor.
        return super().in_sync() and (self._outer is not None or self.first_sync == "average" or
                                      self.step <= self.warmup_steps)

    def local_state_dict(self) -> dict[str, Any]:
        state = super().local_state_dict()
        state["num_skipped"] = self.num_skipped
        if self._outer is not None:
            state.update(self._outer.state_dict())
            state.update(self._own_outer_state())
        return state

    def _own_outer_state(self) -> dict[str, Any]:
        """The per-rank part of the outer state: the compressed variant's memory, a compressor's residual."""
        own: dict[str, Any] = {}
        memory = None if self._bound is None else self._bound.state_dict()
        if memory is not None:
            own["powersgd"] = memory
        if self._residual is not None:
            own["residual"] = self._residual.clone()
            own["placement"] = placement(self.process_group)
        own.update(self._owner.state_dict())
        return own

    def _kind(self) -> Kind:
        return Kind("outer", None, (len(self._params),) if self._params else None)

    def _per_rank_contents(self, own: Mapping[str, Any]) -> list[str]:
        parts = super()._per_rank_contents(own)
        if isinstance(own.get("powersgd"), Mapping):
            parts.append("the error memory of its PowerSGD outer gradients (compression=Config(...))")
        if own.get("residual") is not None:
            parts.append(f"the error-feedback residual of its compressed outer gradients "
                         f"(compression={self.compression!r})")
        if own.get("owner_residual") is not None:
            parts.append("its owner residual of two-shot syncs")
        return parts

    def _shared_state(self) -> dict[str, Any]:
        state = super()._shared_state()
        state["num_skipped"] = self.num_skipped
        specs = local_views(self._params)[1] if self._params else []  # as the parameters are sharded
        state.update(outer_template(self._outer, self._params, specs, self.outer_momentum))
        return state

    def _own_state(self) -> dict[str, Any]:
        own = super()._own_state()
        if self._outer is not None:
            own.update(self._own_outer_state())
        return own

    def load_state_dict(self, state: Mapping[str, Any], *, allow_other_rank: bool = False,
                        on_world_size_change: str = "raise") -> None:
        """Restore :meth:`state_dict`'s (or :meth:`local_state_dict`'s) output; issues no collective. The
        compressed variant's error memory and a compressor's residual are per rank: saved on another rank
        raises ``ValueError`` here (unless ``allow_other_rank=True``), on another world size too unless
        ``on_world_size_change="fresh"`` (they then start fresh; the anchor and outer momentum, sharded
        or identical on every rank, still load). Older checkpoints without that record are accepted."""
        super().load_state_dict(state, allow_other_rank=allow_other_rank, on_world_size_change=on_world_size_change)

    def _load(self, state: Mapping[str, Any], own: Mapping[str, Any] | None, allow_other_rank: bool) -> None:
        if own is not None:
            if isinstance(own.get("powersgd"), Mapping):
                check_placement(own["powersgd"].get("placement"), placement(self.process_group),
                                "OuterOptimizerAverager", allow_other_rank)
            if own.get("residual") is not None:
                check_placement(own.get("placement"), placement(self.process_group), "OuterOptimizerAverager",
                                allow_other_rank)
        super()._load(state, own, allow_other_rank)
        self.num_skipped = int(state.get("num_skipped", 0))
        outer = restore_outer(state, self._params, self.outer_lr, self.outer_momentum, self.nesterov,
                              type(self).__name__)
        if outer is None:
            self._outer = self._bound = self._residual = None
            return
        self._start(outer)
        assert self._bound is not None
        if own is not None and "powersgd" in own and self._bound.state_dict() is not None:
            self._bound.load_state_dict(own["powersgd"])  # placement checked above
        if own is not None and own.get("residual") is not None:
            self._residual = own["residual"].to(outer.anchor[0].device, copy=True)  # saved on the CPU
        if own is not None:
            self._owner.load(own, placement(self.process_group), outer.anchor[0].device, type(self).__name__)


def anchored_state_dict(model: nn.Module, tensors: list[Tensor], anchors: list[Tensor | None],
                        owner: str) -> dict[str, Any]:
    """``model.state_dict()`` with each of the averaged ``tensors`` replaced by a copy of its anchor
    (``anchors[i]``: the local shard, made a ``DTensor`` like the parameter where sharded). ``ValueError``
    if an anchor is missing or a tensor is not ``model``'s."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{owner}.anchor_state_dict: model must be the nn.Module whose parameters are averaged, "
                        f"got {type(model).__name__}")
    state = model.state_dict()
    position = {id(t): i for i, t in enumerate(tensors)}
    specs = local_views(tensors)[1]
    placed: set[int] = set()
    for name, tensor in itertools.chain(model.named_parameters(remove_duplicate=False),
                                        model.named_buffers(remove_duplicate=False)):
        i = position.get(id(tensor))
        if i is None or name not in state:
            continue
        anchor = anchors[i]
        if anchor is None:
            raise ValueError(f"{owner}.anchor_state_dict: {name!r} has no anchor yet (its fragment has not "
                             "synchronized)")
        with torch.no_grad():
            state[name] = as_sharded(anchor.detach().clone(), specs[i])
        placed.add(i)
    if len(placed) != len(tensors):
        raise ValueError(f"{owner}.anchor_state_dict: {len(tensors) - len(placed)} of the averaged tensors are not "
                         "in model's state dict: pass the model whose parameters the averager averages")
    return state


def outer_template(outer: OuterStep | None, params: list[Tensor], specs: list[Spec | None],
                   momentum: float) -> dict[str, Any]:
    """An outer step's anchor and momentum for a checkpoint (DTensors where the parameters are),
    under ``"anchored"``, ``"anchor"`` and ``"momentum"``; before the anchor is taken, zero tensors
    shaped like ``params``' local shards (the template ``torch.distributed.checkpoint`` loads into),
    or none when the parameters are not known yet."""
    if outer is not None:
        if len(specs) != len(outer.anchor):  # the parameters not known (loaded, not given): plain tensors
            specs = [None] * len(outer.anchor)
        momenta = outer.momenta()
        return {"anchored": True, "anchor": sharded_copies(outer.anchor, specs),
                **({} if momenta is None else {"momentum": sharded_copies(momenta, specs)})}
    if not params:
        return {"anchored": False}
    views, specs = local_views(params)
    zeros = sharded_copies([torch.zeros_like(v) for v in views], specs)
    return {"anchored": False, "anchor": zeros,
            **({} if momentum == 0 else {"momentum": sharded_copies([torch.zeros_like(v) for v in views], specs)})}


def restore_outer(state: Mapping[str, Any], params: list[Tensor], lr: float, momentum: float, nesterov: bool,
                  owner: str) -> OuterStep | None:
    """The outer step saved in ``state`` (:func:`outer_template`'s keys, or the earlier ``"anchor"`` /
    ``"outer"`` layout), ``None`` where none was taken. Saved DTensors come back as local shards
    shaped like ``params``' (when known)."""
    if "anchored" not in state:  # the earlier layout: plain tensors and the outer SGD's state_dict
        return None if state.get("anchor") is None else OuterStep.restore(state, lr, momentum, nesterov)
    if not state["anchored"]:
        return None
    if state.get("anchor") is None:
        raise ValueError(f"{owner}.load_state_dict: the checkpoint holds an anchor, but this averager's state_dict() "
                         "had no place for it when torch.distributed.checkpoint loaded it: build the "
                         "PostLocalSGDOptimizer, or call averager.anchor_parameters(params), before loading")
    views = local_views(params)[0] if params else None
    anchor = [from_saved(a, views[i] if views else (a.to_local() if hasattr(a, "to_local") else a))
              for i, a in enumerate(state["anchor"])]
    momenta = state.get("momentum")
    restored = None if momenta is None else [from_saved(m, a) for m, a in zip(momenta, anchor)]
    return OuterStep.from_parts(anchor, restored, lr, momentum, nesterov)


FIRST_SYNC = ("outer", "average")


def takes_anchor(averager: Any, from_average: bool) -> bool:
    """Whether DiLoCo's ``averager`` takes its anchor now, once per run: never once it has one (taken or
    loaded), after a synchronization, with ``first_sync="average"`` or on a rank outside its group; with
    a warm-up, in
    ``average_parameters`` at its last step; without one, from ``anchor_parameters`` (before the first
    inner step)."""
    if averager.first_sync != "outer" or averager.synchronized or averager.anchored or \
            not is_member(averager.process_group):
        return False
    if averager.warmup_steps == 0:
        return not from_average
    return from_average and averager.step == averager.warmup_steps - 1


def check_first_sync(value: Any) -> str:
    """``first_sync`` checked: ``"outer"`` (the paper's) or ``"average"``."""
    if value not in FIRST_SYNC:
        raise ValueError(f"first_sync must be one of {FIRST_SYNC}, got {value!r}")
    return str(value)


def take_anchor(tensors: list[Tensor], process_group: dist.ProcessGroup | None) -> tuple[list[Tensor], int]:
    """Copies of ``tensors`` holding rank 0's values on every rank (one broadcast per (device, dtype)),
    and the bytes that sent (0 without ``torch.distributed`` or on one rank)."""
    with torch.no_grad():
        anchor = [t.detach().clone() for t in tensors]
    broadcast_parameters(anchor, process_group)  # nothing without torch.distributed or on one rank
    alone = not is_distributed() or dist.get_world_size(process_group) == 1
    return anchor, 0 if alone else sum(a.numel() * a.element_size() for a in anchor)


def no_anchor_message(name: str, step: int) -> str:
    return (f"{name}: synchronization at step {step} has no anchor (the parameters where local training "
            f"started): wrap the inner optimizer in gradpress.PostLocalSGDOptimizer (which takes it when "
            f"built), call averager.anchor_parameters(params) before the first inner step, set warmup_steps "
            f">= 1 (the anchor is then taken at the last warm-up step), or pass first_sync='average' (the "
            f"first synchronization is then a plain average that sets the anchor)")
