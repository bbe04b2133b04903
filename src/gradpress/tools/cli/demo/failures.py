"""The demo's failure report: which worker caused a failure and which failed as its consequence (a
collective that lost a peer), whatever order their messages arrived in, in words for the user."""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["WorkerError", "failure_report", "is_peer_loss", "root_cause_line", "root_causes"]


#: What gloo and NCCL say when a peer's connection went away (not every backend raises a DistError for
#: it), and how a CollectiveError reads once DDP has re-raised it from a comm hook's future as a plain
#: RuntimeError ("Got the following error when running the callback: CollectiveError: ...").
_PEER_LOSS_WORDS = ("collectiveerror:", "connection closed by peer", "connection reset by peer", "broken pipe",
                    "communicator was aborted")


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because a peer died, hung or left, and so a
    consequence of another worker's failure rather than a failure of this worker's own: a
    :class:`gradpress.comm.CollectiveError` or a ``torch.distributed.DistError`` anywhere in its chain
    of causes, an error whose text carries a CollectiveError (a comm hook's, re-raised by DDP), or a
    backend error saying that a peer's connection is gone."""
    kinds: list[type] = []
    try:
        from ....comm.errors import CollectiveError
        kinds.append(CollectiveError)
    except Exception:  # noqa: BLE001 - a worker that failed to import torch has no collective to blame
        pass
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
    if isinstance(dist_error, type):
        kinds.append(dist_error)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, tuple(kinds)) or any(word in str(current).lower() for word in _PEER_LOSS_WORDS):
            return True
        current = current.__cause__ or current.__context__
    return False


@dataclass(frozen=True)
class WorkerError:
    """A worker's traceback. ``consequence``: its exception is a collective that lost a peer
    (:func:`is_peer_loss`), so another worker caused it."""

    method: str | None
    traceback: str
    consequence: bool


# --- the failure report -------------------------------------------------------------------------------

def _stuck_line(rank: int) -> str:
    return (f"worker rank {rank} was still running and reported no error: it is probably stuck (the others' "
            "collectives timed out waiting for it)")


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)\b")


def _exception_line(tb: str, limit: int = 240) -> str:
    """The last ``SomeError: message`` line of a traceback (shortened), or its last line."""
    lines = [line for line in tb.strip().splitlines() if line.strip()]
    fallback = lines[-1] if lines else "?"
    found = next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)), fallback)
    return found if len(found) <= limit else found[: limit - 3] + "..."


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "was still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _during(method: str | None) -> str:
    return f" during {method}" if method else ""


def root_causes(errors: dict[int, WorkerError], exit_codes: Sequence[int | None]) -> list[int]:
    """The ranks that failed on their own, in rank order: a worker whose exception is not a collective
    that lost a peer, and a worker that died (non-zero exit code, a signal) without a traceback. Which
    message arrived first plays no part: a crashed worker is often heard from after the peers whose
    collectives its exit broke."""
    own = {rank for rank, error in errors.items() if not error.consequence}
    silent = {rank for rank, code in enumerate(exit_codes) if code not in (None, 0) and rank not in errors}
    return sorted(own | silent)


def root_cause_line(errors: dict[int, WorkerError], exit_codes: Sequence[int | None]) -> str | None:
    """One line on the first root cause (:func:`root_causes`): its exception, or how it died; ``None``
    when no worker failed on its own."""
    roots = root_causes(errors, exit_codes)
    if not roots:
        return None
    if roots[0] in errors:
        error = errors[roots[0]]
        return f"worker rank {roots[0]} failed{_during(error.method)}: {_exception_line(error.traceback)}"
    return f"worker rank {roots[0]} {_describe_exit(exit_codes[roots[0]])}"


def failure_report(errors: dict[int, WorkerError], exit_codes: Sequence[int | None], reason: str | None = None) -> str:
    """What to print when the workers failed: each root cause (:func:`root_causes`: the traceback of a
    worker that raised on its own, or how a worker died without one); without one, the workers still
    running while the others' collectives failed (probably stuck); then the other workers' errors, one
    line each, as consequences. ``exit_codes`` are taken before the survivors were stopped (``None``:
    still running)."""
    lines: list[str] = []
    roots = root_causes(errors, exit_codes)
    consequences = sorted(rank for rank, error in errors.items() if error.consequence)
    for rank in roots:
        if rank in errors:
            lines.append(f"worker rank {rank} failed{_during(errors[rank].method)}:")
            lines.append(errors[rank].traceback.rstrip())
        else:
            lines.append(f"worker rank {rank} {_describe_exit(exit_codes[rank])} without a traceback "
                         "(any output it printed is above)")
    if not roots and consequences:
        stuck = [rank for rank, code in enumerate(exit_codes) if code is None and rank not in errors]
        lines += [_stuck_line(rank) for rank in stuck]
        if not stuck:  # every worker's collective failed, none on its own: show one in full
            first = consequences.pop(0)
            lines.append(f"every worker failed in a collective (none on its own: a network problem, or a "
                         f"worker stopped from outside?); worker rank {first} failed{_during(errors[first].method)}:")
            lines.append(errors[first].traceback.rstrip())
    for rank in consequences:
        lines.append(f"worker rank {rank} also failed{_during(errors[rank].method)}, as a consequence (its "
                     f"collective lost a peer): {_exception_line(errors[rank].traceback)}")
    if reason:
        lines.append(reason)
    lines.append("stopped all workers")
    return "\n".join(lines)
