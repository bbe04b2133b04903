"""Two-level (hierarchical) communication around any DDP hook: exact inside a node, ``hook`` across nodes.

With N nodes of L ranks, a flat hook sends each rank's whole (compressed) bucket over the slow inter-node
link. :func:`hierarchical_wrapper` instead, per bucket:

  1. reduces the bucket exactly inside the node (``intra_group``), as a reduce-scatter whose chunks are
     the local ranks' *shares*: whole parameters, balanced by size (:func:`assign_shares`), the same on
     every node (NCCL moves (L-1)/L of the bucket per rank; gloo implements a reduce-scatter as an
     allreduce, twice that, which is what an allreduce-then-slice design would cost everywhere);
  2. each local rank runs ``hook`` on its share only, across nodes (the group in the hook's state: the
     ranks with the same local index on every node), so the inter-node link carries 1/L of the flat
     scheme's bytes per rank;
  3. gathers the shares back inside the node (one all-gather), so every rank holds the whole result.

>>> state = gradpress.PowerSGDState(mesh["node"].get_group(), matrix_approximation_rank=2)  # doctest: +SKIP
>>> hook = gradpress.hierarchical_wrapper(gradpress.powerSGD_hook, mesh["local"].get_group())  # doctest: +SKIP
>>> ddp_model.register_comm_hook(state, hook)                                  # doctest: +SKIP

No ``from __future__ import annotations`` here: DDP checks the hook's ``bucket`` annotation at runtime.
"""

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import all_gather_async, all_gather_objects, reduce_scatter_async
from .bucket import DenseBucket, check_hook, future_tensor

__all__ = ["HierarchicalHook", "ShareBucket", "assign_shares", "hierarchical_wrapper"]

Hook = Callable[[Any, Any], torch.futures.Future]
_UNCHECKED = object()


def assign_shares(sizes: Sequence[int], num_shares: int) -> list[list[int]]:
    """Split items ``0 .. len(sizes) - 1`` into ``num_shares`` lists with balanced total size.

    Deterministic greedy (LPT): largest item first (ties: lower index first), each to the share with the
    smallest total so far (ties: lower share index); each list is then sorted. A pure function of its
    arguments, so every process computes the same shares. Afterwards the largest total exceeds the
    smallest by at most ``max(sizes)``. Shares may be empty (fewer items than shares).

    >>> assign_shares([100, 10, 60, 50], 2)
    [[0, 1], [2, 3]]
    >>> assign_shares([5], 3)
    [[0], [], []]
    """
    if isinstance(num_shares, bool) or not isinstance(num_shares, int) or num_shares < 1:
        raise ValueError(f"num_shares must be an integer >= 1, got {num_shares!r}")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
        raise ValueError(f"sizes must be integers >= 0, got {list(sizes)!r}")
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    loads = [(0, share) for share in range(num_shares)]  # a heap of (total, share index)
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        total, share = heapq.heappop(loads)
        shares[share].append(item)
        heapq.heappush(loads, (total + sizes[item], share))
    return [sorted(share) for share in shares]


@dataclass(frozen=True)
class _Layout:
    """Where a bucket's gradients go in the packed, share-major buffer of ``L`` chunks of ``chunk`` elements.

    Local rank ``j``'s chunk holds the gradients of ``shares[j]`` back to back (in bucket order), then
    zero padding; ``packed_offsets[i]`` is where bucket parameter ``i`` starts in the packed buffer.
    """

    param_ids: tuple[int, ...]
    numels: tuple[int, ...]
    shares: tuple[tuple[int, ...], ...]
    share_numels: tuple[int, ...]
    chunk: int
    packed_offsets: tuple[int, ...]

    @classmethod
    def build(cls, params: Sequence[Tensor], num_shares: int) -> "_Layout":
        numels = tuple(p.numel() for p in params)
        shares = tuple(tuple(s) for s in assign_shares(numels, num_shares))
        share_numels = tuple(sum(numels[i] for i in share) for share in shares)
        chunk = max(share_numels)
        offsets = [0] * len(numels)
        for j, share in enumerate(shares):
            position = j * chunk
            for i in share:
                offsets[i] = position
                position += numels[i]
        return cls(tuple(id(p) for p in params), numels, shares, share_numels, chunk, tuple(offsets))

    def pack(self, buffer: Tensor, divisor: int) -> Tensor:
        """A new share-major copy of ``buffer`` (the gradients back to back), divided by ``divisor``."""
        pieces = buffer.split(self.numels)
        padding = buffer.new_zeros(self.chunk - min(self.share_numels))
        parts: list[Tensor] = []
        for share, numel in zip(self.shares, self.share_numels):
            parts += [pieces[i] for i in share]
            parts.append(padding[: self.chunk - numel])
        # Divide before the sum (house rule "fp32 numerics": fp16 buckets must not overflow in the reduction).
        return torch.cat(parts).div_(divisor)

    def unpack(self, packed: Tensor, buffer: Tensor) -> None:
        """Write the gathered shares back into ``buffer`` in bucket order (one ``cat``)."""
        torch.cat([packed[start: start + numel] for start, numel in zip(self.packed_offsets, self.numels)],
                  out=buffer)


class ShareBucket(DenseBucket):
    """A ``GradBucket`` stand-in holding one local rank's share of a bucket (see :class:`CastBucket`).

    ``buffer()``: a contiguous tensor with the share's gradients back to back; ``gradients()``: views of
    it with the parameters' shapes; ``parameters()``: the share's parameters; ``index()``: the bucket's
    index; ``is_last()``: whether this is the last share this rank hands to the hook in this backward pass.
    """

    __slots__ = ()


class _Entry:
    """One bucket of the current backward pass, from its intra-node reduce-scatter to its all-gather."""

    __slots__ = ("bucket", "buffer", "layout", "packed", "share", "reduce_work", "inner", "future")

    def __init__(self, bucket: Any, buffer: Tensor, layout: _Layout, packed: Tensor, share: Tensor,
                 reduce_work: Any) -> None:
        self.bucket = bucket
        self.buffer = buffer
        self.layout = layout
        self.packed: Tensor | None = packed
        self.share = share
        self.reduce_work = reduce_work
        self.inner: torch.futures.Future | None = None
        self.future: torch.futures.Future = torch.futures.Future()

    def wait_reduced(self) -> None:
        """Wait (once) for the reduce-scatter, then let the packed copy go (the share holds what is needed).

        Once only: gloo's reduce-scatter copies this rank's chunk out on every ``wait()``, which would
        overwrite the wrapped hook's in-place result.
        """
        if self.reduce_work is not None:
            self.reduce_work.wait()
            self.reduce_work = self.packed = None


def _ranks(group: Any, name: str) -> list[int]:
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup that contains this rank (or None for "
                        f"the default group), got {group!r}")
    return sorted(dist.get_process_group_ranks(group))


def _check_nodes(nodes: list[list[int]]) -> str | None:
    """What is wrong with ``nodes`` (each rank's intra-node group, which contains it) as a split into nodes
    of equal size of consecutive ranks; ``None`` if nothing. (Such nodes cover the world, so their size
    divides it.)"""
    size = len(nodes[0])
    for rank, ranks in enumerate(nodes):
        if len(ranks) != size:
            return "its nodes differ in size"
        if ranks != list(range(ranks[0], ranks[0] + size)) or ranks[0] % size:
            return f"rank {rank}'s node {ranks} is not {size} consecutive ranks starting at a multiple of {size}"
    return None


class HierarchicalHook:
    """The hook returned by :func:`hierarchical_wrapper`; register it with the wrapped hook's state.

    Attributes: ``hook`` (the wrapped hook), ``intra_group``, ``local_rank`` (index of this rank in its
    node), ``workers_per_node`` (L), ``num_nodes`` (N). One instance per DDP model.
    """

    def __init__(self, hook: Hook, intra_group: dist.ProcessGroup | None) -> None:
        check_hook(hook, "hierarchical_wrapper")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("hierarchical_wrapper needs torch.distributed to be initialized "
                               "(call torch.distributed.init_process_group first)")
        node = _ranks(intra_group, "hierarchical_wrapper: intra_group")
        world = dist.get_world_size()
        # A rank only sees its own node; a 3 + 1 split looks fine from the node of 1. Every rank checks
        # every node, so all of them raise the same error (rather than some hanging in a collective).
        nodes = all_gather_objects(node, issuer="hierarchical_wrapper")
        problem = _check_nodes(nodes)
        if problem is not None:
            shown = ", ".join(str(list(n)) for n in dict.fromkeys(map(tuple, nodes)))
            raise ValueError(f"hierarchical_wrapper: intra_group must split the {world} ranks into nodes of "
                             f"equal size, each of consecutive ranks (e.g. [0, 1], [2, 3]); got nodes "
                             f"{shown}: {problem}")
        self.hook = hook
        self.intra_group = intra_group
        self.workers_per_node = len(node)
        self.num_nodes = world // len(node)
        self.local_rank = node.index(dist.get_rank())
        self.__name__ = self.__qualname__ = f"hierarchical_{getattr(hook, '__name__', 'hook')}"
        self._checked_state: Any = _UNCHECKED  # the state whose inter-node group has been checked
        self._layouts: dict[int, _Layout] = {}
        self._entries: list[_Entry] = []
        self._deferred: _Entry | None = None

    def inter_node_group_ranks(self) -> list[int]:
        """The ranks the wrapped hook must communicate with: this local index on every node."""
        return [node * self.workers_per_node + self.local_rank for node in range(self.num_nodes)]

    def _check_state(self, state: Any) -> None:
        if state is self._checked_state:
            return
        if getattr(state, "auto_rank", None) is not None:
            raise ValueError(f"{self.__name__}: a PowerSGDState with auto_rank is not supported here (its ranks "
                             "would measure different node means); give it a fixed matrix_approximation_rank")
        if state is None or isinstance(state, dist.ProcessGroup):
            group, where = state, "the hook's state"
        elif hasattr(state, "process_group"):
            group, where = state.process_group, "state.process_group"
        else:
            raise TypeError(f"{self.__name__}: the wrapped hook's state must be its inter-node process group "
                            f"or have a .process_group (like PowerSGDState), got {type(state).__name__}")
        ranks = _ranks(group, f"{self.__name__}: {where}")
        expected = self.inter_node_group_ranks()
        if ranks != expected:
            raise ValueError(f"{self.__name__}: {where} must hold the ranks with this rank's local index "
                             f"{self.local_rank} on every node, {expected}; it holds {ranks} (build it with "
                             "mesh['node'].get_group() or dist.new_group)")
        self._checked_state = state

    def _layout(self, bucket: Any, buffer: Tensor) -> _Layout:
        params = bucket.parameters()
        layout = self._layouts.get(bucket.index())
        if layout is None or layout.param_ids != tuple(id(p) for p in params):  # DDP rebuilt its buckets
            layout = self._layouts[bucket.index()] = _Layout.build(params, self.workers_per_node)
        if sum(layout.numels) != buffer.numel():
            raise RuntimeError(f"{self.__name__}: bucket {bucket.index()} has {buffer.numel()} elements but its "
                               f"parameters {sum(layout.numels)}; expected the gradients back to back")
        return layout

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Start the intra-node reduce-scatter of ``bucket``; the future completes with ``bucket.buffer()``
        holding the mean over all ranks, once the last bucket of the backward pass has been handed over.

        Every collective is issued from this (the hook's) thread in bucket order ("same order on every rank"):
        reduce-scatters as buckets arrive; the wrapped hook for this rank's previous non-empty share
        when the next one arrives (so that the share marked ``is_last()`` is known to be the last); after
        the last bucket, the all-gathers of every bucket.
        """
        self._check_state(state)
        buffer = bucket.buffer()
        layout = self._layout(bucket, buffer)
        packed = layout.pack(buffer, self.workers_per_node)
        share = packed.new_empty(layout.chunk)
        work = reduce_scatter_async(share, packed, self.intra_group, issuer=self.__name__)
        entry = _Entry(bucket, buffer, layout, packed, share, work)
        self._entries.append(entry)
        if layout.shares[self.local_rank]:
            if self._deferred is not None:
                self._run_hook(state, self._deferred, is_last=False)
            self._deferred = entry
        if bucket.is_last():
            if self._deferred is not None:
                self._run_hook(state, self._deferred, is_last=True)
            self._finish()
        return entry.future

    def _run_hook(self, state: Any, entry: _Entry, is_last: bool) -> None:
        """The wrapped hook on this rank's share of ``entry`` (across nodes)."""
        self._deferred = None
        entry.wait_reduced()  # on the hook's thread, not in a callback: the share must be summed first
        mine = entry.layout.shares[self.local_rank]
        params = entry.bucket.parameters()
        share_bucket = ShareBucket(entry.bucket.index(), is_last, [params[i] for i in mine],
                                   entry.share[: entry.layout.share_numels[self.local_rank]])
        entry.inner = self.hook(state, share_bucket)

    def _finish(self) -> None:
        """After the last bucket: gather every bucket's shares inside the node, in bucket order.

        At most two all-gathers in flight (bucket b's is unpacked once b + 1's is started), so the
        gathered copies cost two buckets of memory, not the model's.
        """
        entries, self._entries = self._entries, []
        in_flight: tuple[_Entry, Tensor, Any] | None = None
        for entry in entries:
            entry.wait_reduced()
            if entry.inner is not None:
                self._take_result(entry)
            gathered = entry.share.new_empty(entry.layout.chunk * self.workers_per_node)
            work = all_gather_async(gathered, entry.share, self.intra_group, issuer=self.__name__)
            if in_flight is not None:
                self._unpack(*in_flight)
            in_flight = (entry, gathered, work)
        if in_flight is not None:
            self._unpack(*in_flight)

    def _take_result(self, entry: _Entry) -> None:
        """Put the wrapped hook's result for this rank's share into ``entry.share`` (if not already there)."""
        # Waited on the hook's thread, not in a callback; the wrapped hook has seen its is_last() share by
        # now, so a hook that completes its futures when its pipeline drains (powerSGD_hook) has done so.
        assert entry.inner is not None
        value = future_tensor(entry.inner.wait())
        result = entry.share[: entry.layout.share_numels[self.local_rank]]
        if value.numel() != result.numel():
            raise RuntimeError(f"{self.__name__}: the wrapped hook's future holds {value.numel()} elements, "
                               f"its share bucket {result.numel()}")
        if value.data_ptr() != result.data_ptr():
            result.copy_(value.view(-1))

    @staticmethod
    def _unpack(entry: _Entry, gathered: Tensor, work: Any) -> None:
        work.wait()
        entry.layout.unpack(gathered, entry.buffer)
        entry.future.set_result(entry.buffer)


def hierarchical_wrapper(hook: Hook, intra_group: dist.ProcessGroup | None) -> HierarchicalHook:
    """Run ``hook`` across nodes on 1/L of each bucket, after an exact reduction inside each node.

    ``intra_group``: this rank's node, e.g. ``mesh["local"].get_group()`` or the first result of
    ``dist.new_subgroups()``; the nodes must split the default group into equal parts of consecutive ranks
    (``ValueError`` otherwise). ``hook``: any comm hook (``powerSGD_hook``, ``allreduce_hook``, a cast
    wrapper, your own; ``TypeError`` if not callable). Its state carries the **inter-node group**: the
    ranks with this rank's local index on every node (``mesh["node"].get_group()``); for a
    :class:`~gradpress.PowerSGDState` that is ``state.process_group``, for the plain hooks the state is the
    group. It is checked at the first call (``ValueError`` if it holds other ranks).

    Contracts: the result in every rank's bucket is the mean over ALL ranks (the bucket is divided by L
    and summed in the node, then ``hook`` averages over the N nodes), as DDP without a hook at full
    precision. Each rank hands ``hook`` its share of each bucket (whole parameters, balanced by size,
    :func:`assign_shares`), the same share on every node and at every step while DDP's buckets do not
    change, so PowerSGD's error memory and warm start stay with the rank that owns the parameter; a rank
    whose share of a bucket is empty skips ``hook`` for it (so do its inter-node peers) but takes part
    in the intra-node collectives. ``hook`` sees ``is_last()`` on this rank's last non-empty share of the
    backward pass (so a ``PowerSGDState`` counts one iteration per pass in which its rank has a share).
    Per bucket: one reduce-scatter and one all-gather in ``intra_group`` (chunks padded to the largest
    share), plus ``hook``'s own collectives. The all-gathers run after the last bucket has been handed to
    DDP, so the returned futures complete then. Shares are whole parameters: a bucket of one huge
    parameter goes to one local rank whole (no saving for it; a smaller ``bucket_cap_mb`` mixes it with
    others).

    A collective: call it on every rank (it checks all nodes with one ``all_gather_object``).

    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("node", "local"))  # doctest: +SKIP
    >>> state = gradpress.PowerSGDState(mesh["node"].get_group(), matrix_approximation_rank=4)  # doctest: +SKIP
    >>> hook = gradpress.hierarchical_wrapper(gradpress.powerSGD_hook, mesh["local"].get_group())  # doctest: +SKIP
    >>> ddp_model.register_comm_hook(state, hook)                                  # doctest: +SKIP
    """
    return HierarchicalHook(hook, intra_group)
