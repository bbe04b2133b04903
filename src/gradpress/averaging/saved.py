"""What an averager's checkpoint holds, read from its state dict or from the keys of a
``torch.distributed.checkpoint`` checkpoint: loading it into another kind of averager (another class,
another fragment count, another number of averaged tensors) is refused before anything loads, saying
what differs, where DCP would say "Missing key" and ``load_state_dict`` would raise a ``KeyError`` or load
nothing."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["Kind", "check_kind", "kind_from_keys", "kind_from_state"]

_NAMES = {"plain": "PeriodicModelAverager or HierarchicalModelAverager", "outer": "OuterOptimizerAverager",
          "streaming": "StreamingDiLoCoAverager"}


class Kind(NamedTuple):
    """An averager's state in outline: ``family`` (``"plain"``: counters only; ``"outer"``: one anchor;
    ``"streaming"``: an anchor per fragment), its fragment count and the tensors of each anchor (``None``
    where not known, e.g. before the anchor is taken)."""

    family: str
    fragments: int | None = None
    tensors: tuple[int | None, ...] | None = None

    def describe(self, name: str | None = None) -> str:
        """In words, with ``name`` (the class) where known: "a StreamingDiLoCoAverager with 2 fragments"."""
        name = name or _NAMES[self.family]
        article = "an" if name[0] in "AEIOU" else "a"
        return f"{article} {name}" + (f" with {self.fragments} fragments" if self.fragments is not None else "")


def kind_from_state(state: Mapping[str, Any]) -> Kind | None:
    """The :class:`Kind` of a ``state_dict()`` or ``local_state_dict()`` (``None``: not an averager's)."""
    if "step" not in state:
        return None
    if isinstance(state.get("fragments"), (list, tuple)):
        fragments = state["fragments"]
        return Kind("streaming", len(fragments),
                    tuple(None if not isinstance(f, Mapping) or f.get("anchor") is None else len(f["anchor"])
                          for f in fragments))
    if "num_skipped" in state or "anchored" in state or "anchor" in state:
        anchor = state.get("anchor")
        return Kind("outer", None, None if anchor is None or not state.get("anchored", True) else (len(anchor),))
    return Kind("plain")


def kind_from_keys(keys: set[str], prefix: str) -> Kind | None:
    """The :class:`Kind` saved under ``prefix`` in a DCP checkpoint whose keys are ``keys`` (``None``: no
    averager's state there)."""
    head = prefix + "."
    mine = {k[len(head):] for k in keys if k.startswith(head)}
    if "step" not in mine:
        return None
    fragments: dict[int, set[int]] = {}
    for key in mine:
        if match := re.fullmatch(r"fragments\.(\d+)\.(.+)", key):
            anchor = re.fullmatch(r"anchor\.(\d+)", match.group(2))
            fragments.setdefault(int(match.group(1)), set()).update([int(anchor.group(1))] if anchor else [])
    if fragments:
        count = max(fragments) + 1
        return Kind("streaming", count, tuple(len(fragments.get(f, ())) or None for f in range(count)))
    if "num_skipped" in mine or "anchored" in mine:
        anchors = {int(m.group(1)) for k in mine if (m := re.fullmatch(r"anchor\.(\d+)", k))}
        return Kind("outer", None, (len(anchors),) if anchors else None)
    return Kind("plain")


def check_kind(name: str, mine: Kind, saved: Kind | None, where: str) -> None:
    """Refuse a checkpoint of another kind than this averager's (``name``, ``mine``): ``ValueError``
    saying what the checkpoint holds (``where``: whose load, and where in the checkpoint) and what this
    averager is. Nothing is refused where ``saved`` is unknown."""
    if saved is None:
        return
    differs = ""
    if saved.family != mine.family or saved.fragments != mine.fragments:
        differs = f"the checkpoint holds the state of {saved.describe()}, this is {mine.describe(name)}"
    elif saved.tensors is not None and mine.tensors is not None:
        for f, (theirs, ours) in enumerate(zip(saved.tensors, mine.tensors)):
            if theirs is not None and ours is not None and theirs != ours:
                part = f"fragment {f}'s anchor" if mine.family == "streaming" else "the anchor"
                differs = (f"{part} holds {theirs} tensors in the checkpoint, and this {name} averages {ours} "
                           "there (another model, other fragments, or another average_buffers)")
                break
    if differs:
        raise ValueError(f"{where}: {differs}. Load it into the averager it was saved with (the same class, "
                         "num_fragments or fragments, and parameters), or leave the averager out of the load to "
                         "start it fresh")
