"""Which fragment each averaged tensor belongs to, and when each fragment synchronizes."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["fragment_offsets", "split_by_size"]


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
