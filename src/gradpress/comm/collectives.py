"""The collectives gradpress issues, each a thin wrapper of its ``torch.distributed`` namesake whose
failure is a :class:`~gradpress.comm.errors.CollectiveError` naming it: blocking ones, asynchronous ones
returning a :class:`Work`, and the object collectives."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .errors import CollectiveError, collective_error, describe_collective

__all__ = ["Work", "all_gather_async", "all_gather_ints", "all_gather_objects", "all_reduce", "all_reduce_async",
           "all_to_all_async", "barrier", "broadcast", "broadcast_async", "gather_objects", "is_distributed",
           "is_member",
           "reduce_scatter_async", "require_member", "scatter_objects", "start_described"]

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is available and a default process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def is_member(process_group: dist.ProcessGroup | None = None) -> bool:
    """Whether this rank belongs to ``process_group`` (``None``: the default group, always).

    ``torch.distributed`` answers a rank outside a group with a world size and a rank of -1 and makes its
    collectives no-ops: the averaging helpers here return early on such a rank, as PyTorch's
    ``average_parameters`` does, and the collectives raise a :class:`CollectiveError`.
    """
    # new_group hands ranks outside the group this sentinel (what torch itself checks for).
    return process_group is not dist.GroupMember.NON_GROUP_MEMBER


def require_member(process_group: dist.ProcessGroup | None, what: str | Callable[[], str]) -> None:
    """Raise a :class:`CollectiveError` saying ``what`` (a string, or a function making it) cannot run
    when this rank is not a member of ``process_group``."""
    if not is_member(process_group):
        raise collective_error(what if isinstance(what, str) else what(),
                               RuntimeError(f"this rank (global rank {dist.get_rank()}) is not a member of the "
                                            "process group"))


def _op(op: str) -> dist.ReduceOp:
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    return getattr(dist.ReduceOp, _OPS[op])


def _global_rank(process_group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if process_group is None else dist.get_global_rank(process_group, rank)


class Work:
    """An in-flight collective started by this module: ``wait()`` blocks until ``result`` holds the
    outcome and returns it; a failure is raised as a :class:`CollectiveError` saying what failed.
    ``get_future()`` is the backend's future (for DDP hooks); :meth:`error` describes an exception taken
    from it the same way.

    ``what`` describes the collective: a string, or a function making it, called only on failure (no
    string building on the hot path). ``staging``: where the collective really runs (e.g. a CPU copy
    of a CUDA ``result`` for gloo), copied into ``result`` by ``wait()``.
    """

    __slots__ = ("work", "result", "_what", "staging")

    def __init__(self, work: Any, result: Tensor, what: str | Callable[[], str],
                 staging: Tensor | None = None) -> None:
        self.work = work
        self.result = result
        self._what = what
        self.staging = staging

    @property
    def what(self) -> str:
        return self._what if isinstance(self._what, str) else self._what()

    def wait(self) -> Tensor:
        try:
            self.work.wait()
        except RuntimeError as error:
            raise self.error(error) from error
        if self.staging is not None:
            self.result.copy_(self.staging)
            self.staging = None
        return self.result

    def get_future(self) -> torch.futures.Future:
        return self.work.get_future()

    def error(self, error: BaseException) -> CollectiveError:
        """``error`` (from this collective's future) as a :class:`CollectiveError` naming it."""
        return collective_error(self.what, error)


def start_described(what: str | Callable[[], str], collective: Any, *args: Any, **kwargs: Any) -> Any:
    """``collective(*args, async_op=True, **kwargs)``: its ``dist.Work``. A failure to start (or a rank
    outside the group, to which torch answers ``None``) is a :class:`CollectiveError` saying ``what``
    (a string, or a function making it) failed."""
    try:
        work = collective(*args, async_op=True, **kwargs)
        if work is None:  # nothing to wait on, nothing received
            raise RuntimeError("this rank is not a member of the process group")
    except RuntimeError as error:
        raise collective_error(what if isinstance(what, str) else what(), error) from error
    return work


def all_reduce_async(tensor: Tensor, process_group: dist.ProcessGroup | None = None, issuer: str = "gradpress",
                     op: str = "sum", what: str | None = None) -> Work:
    """Start reducing ``tensor`` in place over ``process_group`` (``op``: ``"sum"``, ``"max"``, ``"min"``).
    ``what`` replaces the default description (``"allreduce (sum) of N <dtype> values over W ranks in
    <issuer>"``) in a :class:`CollectiveError`."""
    described = what or (lambda: describe_collective(f"allreduce ({op})", tensor, dist.get_world_size(process_group),
                                                     issuer))
    return Work(start_described(described, dist.all_reduce, tensor, op=_op(op), group=process_group), tensor,
                described)


def all_reduce(tensor: Tensor, process_group: dist.ProcessGroup | None = None, issuer: str = "gradpress",
               op: str = "sum") -> Tensor:
    """Reduce ``tensor`` in place over ``process_group`` and return it; a failure is a
    :class:`CollectiveError` naming the collective, its size, the world size and ``issuer``."""
    require_member(process_group, lambda: f"allreduce ({op}) in {issuer}")
    try:
        dist.all_reduce(tensor, op=_op(op), group=process_group)
    except RuntimeError as error:
        what = describe_collective(f"allreduce ({op})", tensor, dist.get_world_size(process_group), issuer)
        raise collective_error(what, error) from error
    return tensor


def broadcast(tensor: Tensor, src: int = 0, process_group: dist.ProcessGroup | None = None,
              issuer: str = "gradpress") -> Tensor:
    """Overwrite ``tensor`` in place with its value on ``src`` (a rank *within* ``process_group``)."""
    require_member(process_group, lambda: f"broadcast from rank {src} in {issuer}")
    try:
        dist.broadcast(tensor, src=_global_rank(process_group, src), group=process_group)
    except RuntimeError as error:
        raise collective_error(_describe_broadcast(tensor, src, process_group, issuer), error) from error
    return tensor


def broadcast_async(tensor: Tensor, src: int = 0, process_group: dist.ProcessGroup | None = None,
                    issuer: str = "gradpress") -> Work:
    """Start overwriting ``tensor`` in place with its value on ``src`` (a rank *within* ``process_group``;
    ``torch.distributed.get_group_rank`` turns a global rank into one)."""
    described = partial(_describe_broadcast, tensor, src, process_group, issuer)
    return Work(start_described(described, dist.broadcast, tensor, src=_global_rank(process_group, src),
                           group=process_group), tensor, described)


def _describe_broadcast(tensor: Tensor, src: int, process_group: dist.ProcessGroup | None, issuer: str) -> str:
    return describe_collective(f"broadcast from rank {src}", tensor, dist.get_world_size(process_group), issuer)


def all_gather_async(out: Tensor, tensor: Tensor, process_group: dist.ProcessGroup | None = None,
                     issuer: str = "gradpress", what: str | Callable[[], str] | None = None,
                     as_list: bool = False) -> Work:
    """Start gathering every rank's ``tensor`` into ``out`` (``world_size * tensor.numel()`` values,
    in rank order). ``as_list``: through ``torch.distributed.all_gather`` into views of ``out`` (the same
    bytes), for a process group that has no backend registered per device, which the single-tensor
    all-gather looks up (torchft's reconfigurable groups)."""
    described = what or (lambda: describe_collective("all-gather", tensor, dist.get_world_size(process_group), issuer))
    if as_list:
        pieces = list(out.view(-1, tensor.numel()).unbind(0)) if tensor.numel() else \
            [out[:0] for _ in range(dist.get_world_size(process_group))]
        return Work(start_described(described, dist.all_gather, pieces, tensor, group=process_group), out, described)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # name since torch 2.13
    return Work(start_described(described, gather, out, tensor, group=process_group), out, described)


def all_to_all_async(out: Tensor, tensor: Tensor, process_group: dist.ProcessGroup | None = None,
                     issuer: str = "gradpress", what: str | Callable[[], str] | None = None) -> Work:
    """Start an all-to-all of equal splits: ``tensor`` (flat, ``world_size`` equal pieces) sends piece ``r``
    to rank ``r``; ``out`` (the same size) receives rank ``r``'s piece for this rank at position ``r``."""
    described = what or (lambda: describe_collective("all-to-all", tensor, dist.get_world_size(process_group),
                                                     issuer))
    return Work(start_described(described, dist.all_to_all_single, out, tensor, group=process_group), out,
                described)


def reduce_scatter_async(out: Tensor, tensor: Tensor, process_group: dist.ProcessGroup | None = None,
                         issuer: str = "gradpress", what: str | None = None) -> Work:
    """Start summing ``tensor`` over the ranks, ``out`` receiving this rank's chunk (rank order)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    described = what or (lambda: describe_collective("reduce-scatter (sum)", tensor,
                                                     dist.get_world_size(process_group), issuer))
    return Work(start_described(described, scatter, out, tensor, group=process_group), out, described)


def barrier(process_group: dist.ProcessGroup | None = None, issuer: str = "gradpress") -> None:
    """Wait until every rank of ``process_group`` reaches this call."""
    require_member(process_group, f"barrier in {issuer}")
    try:
        dist.barrier(group=process_group)
    except RuntimeError as error:
        raise collective_error(f"barrier over {dist.get_world_size(process_group)} ranks in {issuer}",
                               error) from error


def all_gather_ints(values: list[int], process_group: dist.ProcessGroup | None = None, issuer: str = "gradpress",
                    device: torch.device | None = None) -> list[list[int]]:
    """Every rank's ``values`` (a list of integers, of any length), in rank order, on every rank of
    ``process_group``: two all-gathers of int64 tensors (the lengths, then the values padded to the
    longest) on ``device`` (``None``: the current CUDA device for NCCL, else the CPU). Needs no numpy,
    unlike :func:`all_gather_objects` (``torch.distributed``'s object collectives read their bytes back
    through ``Tensor.numpy()``, and the torch wheels do not depend on numpy)."""
    require_member(process_group, f"all-gather of integers in {issuer}")
    if device is None:
        backend = str(dist.get_backend(process_group))
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    world = dist.get_world_size(process_group)
    length = torch.tensor([len(values)], dtype=torch.int64, device=device)
    lengths = all_gather_async(torch.empty(world, dtype=torch.int64, device=device), length, process_group,
                               issuer).wait().tolist()
    longest = max(lengths)
    if longest == 0:
        return [[] for _ in lengths]
    mine = torch.zeros(longest, dtype=torch.int64, device=device)
    mine[:len(values)] = torch.tensor(values, dtype=torch.int64)
    everyone = all_gather_async(torch.empty(world * longest, dtype=torch.int64, device=device), mine,
                                process_group, issuer).wait().view(world, longest).tolist()
    return [row[:n] for row, n in zip(everyone, lengths)]


def all_gather_objects(obj: object, process_group: dist.ProcessGroup | None = None,
                       issuer: str = "gradpress") -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank of ``process_group``. Needs numpy
    (``torch.distributed.all_gather_object`` does): :func:`all_gather_ints` does not."""
    require_member(process_group, f"all-gather of one object per rank in {issuer}")
    world = dist.get_world_size(process_group)
    everyone: list[Any] = [None] * world
    try:
        dist.all_gather_object(everyone, obj, group=process_group)
    except RuntimeError as error:
        raise collective_error(f"all-gather of one object per rank over {world} ranks in {issuer}", error) from error
    return everyone


def gather_objects(obj: object, dst: int = 0, process_group: dist.ProcessGroup | None = None) -> list[object] | None:
    """Every rank's ``obj`` (picklable) on rank ``dst`` of ``process_group``, in rank order; ``None`` on the
    other ranks. A collective: every rank of the group calls it. Failures are :class:`CollectiveError`."""
    require_member(process_group, f"gather of one object per rank to rank {dst}")
    world = dist.get_world_size(process_group)
    mine = dist.get_rank(process_group)
    gathered: list[object] | None = [None] * world if mine == dst else None
    try:
        dist.gather_object(obj, gathered, dst=dist.get_global_rank(process_group, dst) if process_group else dst,
                           group=process_group)
    except RuntimeError as error:
        raise collective_error(f"gather of one object per rank to rank {dst} over {world} ranks", error) from error
    return gathered


def scatter_objects(objs: list[object] | None, src: int = 0, process_group: dist.ProcessGroup | None = None) -> object:
    """Rank ``src`` hands ``objs[r]`` to rank ``r`` of ``process_group`` (the others pass ``None``); returns
    this rank's object. A collective: every rank of the group calls it."""
    require_member(process_group, f"scatter of one object per rank from rank {src}")
    world = dist.get_world_size(process_group)
    out: list[object] = [None]
    try:
        dist.scatter_object_list(out, objs if dist.get_rank(process_group) == src else None,
                                 src=dist.get_global_rank(process_group, src) if process_group else src,
                                 group=process_group)
    except RuntimeError as error:
        raise collective_error(f"scatter of one object per rank from rank {src} over {world} ranks", error) from error
    return out[0]
