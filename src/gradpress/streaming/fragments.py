"""Which fragment each averaged tensor belongs to, and when each fragment synchronizes."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union

from torch import Tensor, nn

from ..averaging.tensors import tensors_to_average

__all__ = ["explicit_layout", "fragment_members", "fragment_offsets", "model_fragments", "split_by_size"]

FragmentSpec = Union[nn.Module, Iterable[Tensor]]

#: How a fragment list that leaves part of the model out is fixed (the docs' own snippet once did).
COVER_THE_MODEL = ("fragments=list(model.layers) leaves out what lies outside the layers (a GPT's embeddings, final "
                   "norm and head): pass fragments=gradpress.streaming.model_fragments(model, model.layers), which "
                   "adds each such tensor to the fragment next to it, or add a fragment that holds them")


def _members(spec: Any) -> list[Tensor]:
    """The tensors of one fragment: a module's trainable parameters and floating-point buffers, or the
    trainable tensors given."""
    if isinstance(spec, nn.Module):
        return tensors_to_average(spec, average_buffers=True)
    return tensors_to_average([spec] if isinstance(spec, Tensor) else list(spec))


def fragment_members(fragments: Sequence[FragmentSpec]) -> dict[int, int]:
    """``id(tensor) -> fragment index`` for explicit ``fragments`` (modules or tensor lists); ``ValueError``
    for a fragment without a tensor or a tensor in two fragments."""
    members: dict[int, int] = {}
    for f, spec in enumerate(fragments):
        tensors = _members(spec)
        if not tensors:
            raise ValueError(f"fragments[{f}] holds no tensor to average")
        for t in tensors:
            if members.setdefault(id(t), f) != f:
                raise ValueError(f"fragments[{f}] shares a tensor with fragments[{members[id(t)]}]")
    return members


def explicit_layout(tensors: Sequence[Tensor], members: dict[int, int], num_fragments: int,
                    describe: Callable[[int], str], owner: str) -> list[int]:
    """Fragment index of each averaged tensor under explicit fragments (:func:`fragment_members`);
    ``ValueError`` naming the first tensor in none of them (``describe(i)``, by its name where known)
    and how to cover the rest of the model, or the fragments that hold none of ``tensors``."""
    outside = [i for i, t in enumerate(tensors) if id(t) not in members]
    if outside:
        more = f" (nor are {len(outside) - 1} more: tensors {outside[1:]})" if len(outside) > 1 else ""
        raise ValueError(f"{owner}: {describe(outside[0])} is in none of the fragments{more}: every averaged tensor "
                         f"must be in one. {COVER_THE_MODEL}")
    layout = [members[id(t)] for t in tensors]
    missing = set(range(num_fragments)) - set(layout)
    if missing:
        raise ValueError(f"{owner}: fragments {sorted(missing)} hold none of the averaged tensors")
    return layout


def model_fragments(model: nn.Module, fragments: Iterable[FragmentSpec]) -> list[list[Tensor]]:
    """``fragments`` (modules or tensor lists, e.g. ``model.layers``) completed to cover all of ``model``,
    for ``StreamingDiLoCoAverager(fragments=...)``: each fragment's tensors (a module's trainable
    parameters and floating-point buffers), and every tensor of ``model`` outside them added to the
    fragment of the nearest fragment tensor before it in the model's order (modules in ``model.modules()``
    order, each one's own parameters, then its buffers), or to the first fragment for those before any:
    a GPT's embeddings join its first layer's fragment, its final norm and head the last one's.

    >>> fragments = model_fragments(model, model.layers)  # doctest: +SKIP
    >>> StreamingDiLoCoAverager(sync_every=100, fragments=fragments)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (the whole model the fragments are parts of), got "
                        f"{type(model).__name__}")
    given = [spec if isinstance(spec, (nn.Module, Tensor)) else list(spec) for spec in fragments]  # read once
    if not given:
        raise ValueError("fragments must hold at least one module or tensor list")
    members = fragment_members(given)
    out = [_members(spec) for spec in given]
    seen: set[int] = set()
    current = 0
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad] + \
            [b for b in module.buffers(recurse=False) if b.is_floating_point()]
        for t in own:
            if id(t) in seen:
                continue
            seen.add(id(t))
            if id(t) in members:
                current = members[id(t)]
            else:
                out[current].append(t)
    return out


def split_by_size(sizes: Sequence[int], num_fragments: int) -> list[int]:
    """Fragment index of each tensor: ``num_fragments`` runs of consecutive tensors (parameter order),
    none empty, whose total ``sizes`` are as even as whole tensors allow.

    The cut before fragment ``k`` is placed at the tensor boundary nearest to ``k · total / F``, so every
    fragment holds at most ``total / F`` plus the largest tensor.

    >>> split_by_size([4, 4, 4, 4], 2)
    [0, 0, 1, 1]
    >>> split_by_size([10, 1, 1, 1, 1], 2)
    [0, 1, 1, 1, 1]
    """
    count = len(sizes)
    if not 1 <= num_fragments <= count:
        raise ValueError(f"num_fragments must be in [1, {count}] (the number of averaged tensors), "
                         f"got {num_fragments}")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + int(size))
    total = prefix[-1]
    cuts = [0]
    for k in range(1, num_fragments):
        target = total * k / num_fragments
        low, high = cuts[-1] + 1, count - (num_fragments - k)  # leave a tensor for every later fragment
        cuts.append(min(range(low, high + 1), key=lambda j: (abs(prefix[j] - target), j)))
    cuts.append(count)
    out: list[int] = []
    for fragment, (start, stop) in enumerate(zip(cuts, cuts[1:])):
        out += [fragment] * (stop - start)
    return out


def fragment_offsets(sync_every: int, num_fragments: int, phase: str = "start", delay: int = 0) -> list[int]:
    """Step offset (after warm-up, modulo ``sync_every``) at which each fragment is *sent*; its update is
    applied ``delay`` steps later.

    ``phase="start"``: sent at ``f · sync_every // num_fragments``, fragment 0 at the first step after
    warm-up; applied ``delay`` steps after that.
    ``phase="end"`` (torchft's): *applied* at ``(f + 1) · sync_every // num_fragments - 1``, after
    ``(f + 1) · sync_every // num_fragments`` local steps, the last one after ``sync_every`` (with one
    fragment DiLoCo's: ``H`` inner steps, then a sync); sent ``delay`` steps before that, so ``delay``
    must be below ``sync_every // num_fragments`` (the shortest fragment period) to leave a send step in
    the first period and one fragment in flight at a time. With ``delay=0`` both phases send and apply
    at the same step.

    >>> fragment_offsets(6, 3)
    [0, 2, 4]
    >>> fragment_offsets(6, 2, "end")
    [2, 5]
    >>> fragment_offsets(6, 2, "end", delay=1)
    [1, 4]
    """
    if phase not in FRAGMENT_PHASES:
        raise ValueError(f"fragment_phase must be one of {FRAGMENT_PHASES}, got {phase!r}")
    if phase == "end":
        period = sync_every // num_fragments
        if not 0 <= delay < period:  # sent and applied inside the fragment's own period, as torchft requires
            raise ValueError(f"fragment_sync_delay must be an integer in [0, {period - 1}] with fragment_phase='end' "
                             f"(below sync_every // num_fragments = {sync_every} // {num_fragments}), got {delay!r}")
        return [(f + 1) * sync_every // num_fragments - 1 - delay for f in range(num_fragments)]
    return [f * sync_every // num_fragments for f in range(num_fragments)]


FRAGMENT_PHASES = ("start", "end")
