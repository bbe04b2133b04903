"""What the demo's methods put on the wire at each step, the pieces :mod:`~gradpress.tools.workloads.methods`
shares: the demo's gradients, one exact average of them, the anchor's step, and the streamed kinds'
traffic (:class:`FragmentTraffic`: each fragment's sync by its phases, at the world size that decides a
compressed sync's schedule). Counted by :mod:`gradpress.tools.bytes`, the one byte model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ...comm import link_bytes
from ...powersgd import Plan
from ...streaming import StreamingDiLoCoAverager
from .. import bytes as model_bytes
from .config import DemoConfig

__all__ = ["FragmentTraffic", "allreduce_payload", "at_anchor_step", "gradients"]

Number = TypeVar("Number", int, float)


def gradients(plan: Plan) -> tuple[list[tuple[int, ...]], list[torch.dtype]]:
    """The demo's gradients: the plan's shapes, fp32."""
    return [t.shape for t in plan.tensors], [torch.float32] * len(plan.tensors)


def allreduce_payload(plan: Plan, wire_dtype: torch.dtype | None = None) -> int:
    """Bytes of one exact average of the gradients (:func:`gradpress.tools.bytes.allreduce_bytes`)."""
    return model_bytes.allreduce_bytes(*gradients(plan), wire_dtype).bytes_sent


def at_anchor_step(out: list[Number], config: DemoConfig, value: Number) -> list[Number]:
    """``out`` with ``value`` (the anchor's broadcast) added at the last warm-up step (step 0 without one)."""
    if out:
        out[min(len(out) - 1, max(0, config.start_iter - 1))] += value
    return out


class FragmentTraffic:
    """The bytes of a kind whose averager is a :class:`StreamingDiLoCoAverager`, built by ``build``
    (``(method, config, number of tensors) -> averager``): :meth:`payload` and :meth:`link` at each step,
    :meth:`sync_bytes` and :meth:`sync_link` of one complete synchronisation (every fragment once)."""

    def __init__(self, build: Callable[[Any, DemoConfig, int], Any]) -> None:
        self.build = build

    def averager(self, method: Any, plan: Plan, config: DemoConfig) -> StreamingDiLoCoAverager:
        averager = self.build(method, config, len(plan.tensors))
        assert isinstance(averager, StreamingDiLoCoAverager)
        return averager

    def phases(self, method: Any, plan: Plan, config: DemoConfig, world_size: int | None
               ) -> tuple[StreamingDiLoCoAverager, list[list[tuple[int, float]]]]:
        """The averager and each fragment's sync phases ``(payload, link)`` at ``world_size``
        (:func:`gradpress.tools.bytes.sync_phases`; ``None``: the all-gather's payload, no link)."""
        averager = self.averager(method, plan, config)
        shapes, dtypes = gradients(plan)
        if world_size is None:
            payloads = model_bytes.sync_bytes(shapes, dtypes, averager.compression, averager.num_fragments)
            return averager, [[(p, 0.0)] for p in payloads]
        return averager, model_bytes.sync_phases(shapes, dtypes, averager.compression, averager.num_fragments,
                                                 world=world_size, schedule=averager.schedule)

    @staticmethod
    def _by_fragment(averager: StreamingDiLoCoAverager, config: DemoConfig, warm: float,
                     phases: Sequence[Sequence[float]]) -> list[float]:
        """``warm`` until ``start_iter``, then each fragment's sync by its phases: the first at its send
        step, two-shot's second ``(τ + 1) // 2`` steps later (where the averager issues it; past the last
        step, never)."""
        out = [warm if step < config.start_iter else 0.0 for step in range(config.steps)]
        later = (averager.fragment_sync_delay + 1) // 2
        for step in range(config.start_iter, config.steps):
            fragment = averager.fragment_sent_at(step)  # the averager's step numbering is the 0-based step
            if fragment is None:
                continue
            for k, value in enumerate(phases[fragment]):
                at = step + (later if k else 0)
                if at < config.steps:
                    out[at] += value
        return out

    def payload(self, method: Any, plan: Plan, config: DemoConfig, world_size: int | None = None) -> list[int]:
        """fp32 gradients until ``start_iter``, the anchor at its last step, then at each fragment's sync
        step its payload (every sync, the first included, is an outer step; a two-shot sync's all-gather
        where the averager issues it)."""
        averager, phases = self.phases(method, plan, config, world_size)
        payloads = [[p for p, _ in fragment] for fragment in phases]
        out = [int(b) for b in self._by_fragment(averager, config, allreduce_payload(plan), payloads)]
        return at_anchor_step(out, config, model_bytes.anchor_bytes(*gradients(plan)))

    def link(self, method: Any, plan: Plan, config: DemoConfig, world_size: int) -> list[float]:
        """:meth:`payload` on one worker's link: the warm-up's allreduce, the anchor's broadcast, each
        fragment's sync by the collectives its schedule takes at ``world_size``."""
        averager, phases = self.phases(method, plan, config, world_size)
        links = [[link for _, link in fragment] for fragment in phases]
        out = self._by_fragment(averager, config, link_bytes("allreduce", allreduce_payload(plan), world_size), links)
        return at_anchor_step(out, config, model_bytes.anchor_link_bytes(*gradients(plan), world_size))

    def sync_bytes(self, method: Any, plan: Plan, config: DemoConfig, world_size: int | None = None) -> int:
        return sum(p for fragment in self.phases(method, plan, config, world_size)[1] for p, _ in fragment)

    def sync_link(self, method: Any, plan: Plan, config: DemoConfig, world_size: int) -> float:
        return sum(link for fragment in self.phases(method, plan, config, world_size)[1] for _, link in fragment)
