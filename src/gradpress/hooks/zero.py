"""Overlap a sharded (ZeRO) optimizer step with DDP's gradient communication, around any comm hook.

Drop-in for PyTorch's ``ddp_zero_hook`` module (same names, same arguments), with what it gets wrong
fixed:

* **gloo works.** PyTorch refuses gloo ("may hang"). The cause: its interleaved variant issues the
  parameter broadcasts from future callbacks, which gloo runs on its worker threads whenever an allreduce
  finishes, while the autograd thread keeps issuing the next buckets' allreduces. The order in which a
  rank issues collectives then depends on timing, differs between ranks, and gloo (which pairs the n-th
  collective of every rank) matches a broadcast with an allreduce and hangs; the callbacks also block on
  collectives inside gloo's 2 worker threads. Here every collective is issued by the thread that calls
  the hook, in bucket order, and only after every hook future of the iteration has completed (so not even
  a hook that issues collectives from its own callbacks, like PyTorch's ``powerSGD_hook``, can interleave
  with them). Callbacks only compute.
* **No lost iterations.** PyTorch waits until DDP has rebuilt its buckets (the 2nd or 3rd iteration) and
  silently applies no update before that. Here ZeRO is initialized at the end of the first backward pass
  and ownership is by parameter, not by bucket index, so the first iteration already updates and DDP's
  later bucket rebuild changes nothing.
* **Any hook's result is used.** The reduced gradients are read from the hook's future, not from the
  bucket (a hook may return a new tensor instead of writing into the bucket).
* **Resume is exact.** :meth:`ZeroStepHook.load_optimizer_state_dict` may be called before the first
  iteration (ZeRO itself refuses until initialized) and does not modify the caller's dict.
* **Clear errors** for what cannot work: more than one parameter group, a ZeRO built without
  ``overlap_with_ddp=True`` or over other parameters or another process group, a model that is not DDP,
  ``find_unused_parameters=True``.

Example (each rank; no ``zero.step()`` in the loop: the step runs inside backward)::

    ddp = DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=1e-3)
    state = gradpress.PowerSGDState(process_group=None, matrix_approximation_rank=2)
    ddp.register_comm_hook(state, gradpress.hook_with_zero_step(gradpress.powerSGD_hook, ddp, zero))
    for x, y in data:
        loss_fn(ddp(x), y).backward()   # reduces, steps this rank's shard, broadcasts the shards
        ddp.zero_grad()

No ``from __future__ import annotations`` here: DDP checks the hook's ``bucket`` annotation at runtime.
"""

import copy
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from ..comm import broadcast_async
from . import _zero_internals as internals
from .bucket import check_hook
from .powersgd import PowerSGDState

if TYPE_CHECKING:  # torch.distributed.optim pulls in FSDP and sympy: about a second on import
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["ZeroStepHook", "hook_with_zero_step", "hook_with_zero_step_interleaved"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def _same_group(a: Any, b: Any) -> bool:
    if a is None or a is dist.group.WORLD:
        a = dist.group.WORLD
    if b is None or b is dist.group.WORLD:
        b = dist.group.WORLD
    if a is b:
        return True
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def _reduced_gradients(bucket: dist.GradBucket, value: Any) -> list[Tensor]:
    """The bucket's gradients holding the hook's result (copied into the bucket if the hook returned a new tensor)."""
    if isinstance(value, (list, tuple)):
        value = value[0]
    buffer = bucket.buffer()
    if not isinstance(value, Tensor) or value.numel() != buffer.numel():
        raise RuntimeError(f"hook_with_zero_step: the wrapped hook's future must hold the reduced bucket "
                           f"({buffer.numel()} elements), got {type(value).__name__}")
    if value.data_ptr() != buffer.data_ptr():
        buffer.copy_(value.view_as(buffer))
    return bucket.gradients()


def _shard_units(params: list[Tensor], cap_bytes: int) -> list[list[Tensor]]:
    """Consecutive groups of ``params`` of at most ``cap_bytes`` (at least one parameter each), one dtype
    and device per group: the units ZeRO assigns to ranks and each owner broadcasts as one flat tensor.

    ``params`` come in the order DDP reduced them in the first iteration, so the groups follow DDP's
    rebuilt buckets (same cap) closely; DDP's first-iteration buckets themselves can be one bucket for the
    whole model, which would leave every parameter to one rank.
    """
    units: list[list[Tensor]] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if (not units or size + nbytes > cap_bytes or param.dtype != units[-1][0].dtype
                or param.device != units[-1][0].device):
            units.append([])
            size = 0
        units[-1].append(param)
        size += nbytes
    return units


class ZeroStepHook:
    """The hook returned by :func:`hook_with_zero_step` / :func:`hook_with_zero_step_interleaved`.

    Call it like any comm hook (``ddp.register_comm_hook(state_of_the_wrapped_hook, zero_hook)``).
    ``iterations``: backward passes completed with an optimizer step (every one, from the first).
    """

    def __init__(self, hook: Hook, ddp: DistributedDataParallel, zero: "ZeroRedundancyOptimizer",
                 shard_buckets: bool, interleaved: bool) -> None:
        name = "hook_with_zero_step_interleaved" if interleaved else "hook_with_zero_step"
        check_hook(hook, name)
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"{name}: ddp must be a torch.nn.parallel.DistributedDataParallel model, "
                            f"got {type(ddp).__name__}")
        from torch.distributed.optim import ZeroRedundancyOptimizer  # here: importing it costs a second

        if not isinstance(zero, ZeroRedundancyOptimizer):
            raise TypeError(f"{name}: zero must be a torch.distributed.optim.ZeroRedundancyOptimizer, "
                            f"got {type(zero).__name__}")
        if not isinstance(shard_buckets, bool):
            raise TypeError(f"{name}: shard_buckets must be True or False, got {shard_buckets!r}")
        internals.check_internals(zero)
        if not internals.overlaps_with_ddp(zero):
            raise ValueError(f"{name}: construct the optimizer with ZeroRedundancyOptimizer(..., "
                             "overlap_with_ddp=True); without it, call zero.step() after backward instead")
        if len(zero.param_groups) != 1:
            raise ValueError(f"{name}: the ZeroRedundancyOptimizer has {len(zero.param_groups)} parameter groups; "
                             "overlapping supports exactly one (the functional optimizers take one group)")
        if internals.is_driven(zero) or internals.is_initialized(zero):
            raise ValueError(f"{name}: this ZeroRedundancyOptimizer is already driven by a hook; "
                             "create one optimizer per hook")
        if getattr(ddp, "find_unused_parameters", False):
            raise ValueError(f"{name}: DistributedDataParallel(find_unused_parameters=True) is not supported: "
                             "unused parameters would be stepped with zero gradients (momentum and Adam "
                             "would still move them); construct DDP with find_unused_parameters=False")
        if not _same_group(ddp.process_group, zero.process_group):
            raise ValueError(f"{name}: ddp and zero use different process groups; pass the DDP model's "
                             "process_group to ZeroRedundancyOptimizer(..., process_group=...)")
        trainable = {id(p) for p in ddp.parameters() if p.requires_grad}
        owned = {id(p) for p in zero.param_groups[0]["params"]}
        if trainable != owned:
            raise ValueError(f"{name}: the ZeroRedundancyOptimizer must be built over exactly the DDP model's "
                             f"trainable parameters ({len(trainable)}; it has {len(owned)}, "
                             f"{len(trainable & owned)} in common): use [p for p in ddp.parameters() if "
                             "p.requires_grad]")
        internals.mark_driven(zero)
        self.hook = hook
        self.zero = zero
        self.shard_buckets = shard_buckets
        self.interleaved = interleaved
        self.iterations = 0
        self._name = name
        self.__name__ = self.__qualname__ = name  # DDP's register_comm_hook reads both
        self._group = zero.process_group
        self._ready = False
        self._record: list[tuple[dist.GradBucket, torch.futures.Future]] = []
        self._pending_state: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._local_index: dict[int, int] = {}
        self._num_local = 0
        self._broadcasts: list[tuple[Tensor, int]] = []  # (shard, its owner's rank within the group)
        self._bucket_bytes = int(getattr(ddp, "bucket_bytes_cap", 25 << 20))

    # -- checkpointing ---------------------------------------------------------------------------
    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``zero.state_dict()`` (after ``consolidate_state_dict()``) into the sharded optimizer.

        Unlike ``zero.load_state_dict``, may be called before the first backward pass (it is applied when
        the optimizer is initialized, before the first update), and leaves ``state_dict`` untouched.
        """
        state_dict = copy.deepcopy(state_dict)
        if self._ready:
            self.zero.load_state_dict(state_dict)
        else:
            self._pending_state = state_dict

    @property
    def ready(self) -> bool:
        """Whether the sharded optimizer is initialized (after the first backward pass)."""
        return self._ready

    # -- the hook ----------------------------------------------------------------------------------
    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        if self.interleaved and isinstance(state, PowerSGDState):
            # A PowerSGDState completes its buckets' futures together at the last bucket (so that a
            # non-finite iteration can leave every bucket's memory as it was); stepping each shard as
            # its bucket completes needs each future at once. A GradScaler cannot skip a step taken
            # inside backward anyway, so committing bucket by bucket loses nothing here.
            state.commit_each_bucket()
        fut = self.hook(state, bucket)
        if not (callable(getattr(fut, "wait", None)) and callable(getattr(fut, "then", None))):
            raise TypeError(f"{self._name}: the wrapped hook must return a torch.futures.Future, "
                            f"got {type(fut).__name__}")
        index = bucket.index()
        if index == 0:
            self._record.clear()  # a new backward pass (also after one that failed half-way)
        if index != len(self._record):
            raise RuntimeError(f"{self._name}: DDP called the hook for bucket {index} after "
                               f"{len(self._record)} buckets; buckets must arrive in order 0, 1, ...")
        chained = self._ready and self.interleaved
        if chained and self._owns_any(bucket):
            fut = fut.then(partial(self._step_in_callback, bucket))
        self._record.append((bucket, fut))
        if bucket.is_last():
            if not self._ready:
                self._initialize(_shard_units([p for b, _ in self._record for p in b.parameters()],
                                              self._bucket_bytes))
            self._finish_iteration(stepped=chained)
        return fut

    def _initialize(self, params_per_bucket: list[list[Tensor]]) -> None:
        assignments, ranks_per_bucket = internals.initialize(self.zero, params_per_bucket, self.shard_buckets)
        local = internals.local_parameters(self.zero)
        internals.install_state_dict(self.zero)
        self._local_index = {id(p): i for i, p in enumerate(local)}
        self._num_local = len(local)
        in_buckets = {id(p) for ps in params_per_bucket for p in ps}
        if any(key not in in_buckets for key in self._local_index):
            raise RuntimeError(f"{self._name}: ZeRO assigned this rank parameters that no DDP bucket holds")
        self._broadcasts = []
        for bucket_index in range(len(params_per_bucket)):
            for owner in sorted(ranks_per_bucket[bucket_index]):  # the same order on every rank
                # ``owner`` is a rank within the ZeRO group, which is what comm.broadcast_async takes.
                self._broadcasts.append((assignments[owner][bucket_index].tensor, owner))
        if self._pending_state is not None:
            self.zero.load_state_dict(self._pending_state)
            self._pending_state = None
        self._ready = True

    def _owns_any(self, bucket: dist.GradBucket) -> bool:
        return any(id(p) in self._local_index for p in bucket.parameters())

    def _step_bucket(self, bucket: dist.GradBucket, value: Any) -> None:
        """This rank's optimizer step on its parameters in ``bucket``, from the reduced gradients."""
        if not self._owns_any(bucket):
            return
        grads = _reduced_gradients(bucket, value)
        gradients: list[Tensor | None] = [None] * self._num_local
        for param, grad in zip(bucket.parameters(), grads):
            position = self._local_index.get(id(param))
            if position is not None:
                gradients[position] = grad
        with self._lock:  # gloo may complete two buckets' futures on two threads at once
            internals.local_step(self.zero, gradients)

    def _step_in_callback(self, bucket: dist.GradBucket, fut: torch.futures.Future) -> Any:
        value = fut.value()  # compute only: no collective is issued or awaited in a callback
        self._step_bucket(bucket, value)
        return value

    def _finish_iteration(self, stepped: bool) -> None:
        """Wait for every bucket (stepping the rest), then broadcast each owner's shard, in bucket order."""
        record, self._record = self._record, []
        for bucket, fut in record:
            value = fut.wait()
            if not stepped:
                self._step_bucket(bucket, value)
        group = None if self._group is dist.group.WORLD else self._group
        handles = [broadcast_async(tensor, owner, group, issuer=self._name) for tensor, owner in self._broadcasts]
        for handle in handles:
            handle.wait()
        self.iterations += 1


def hook_with_zero_step(hook: Hook, ddp: DistributedDataParallel, zero: "ZeroRedundancyOptimizer",
                        shard_buckets: bool = False) -> ZeroStepHook:
    """Wrap ``hook`` so that the ZeRO step runs inside backward, after the last bucket is handed to DDP.

    When DDP passes the last bucket, this rank waits for each bucket's reduced gradients in order and
    steps the parameters it owns as soon as their bucket is ready (overlapping the step with the buckets
    still in flight), then every owner broadcasts its updated shard. Prefer it when communication is slow
    compared with computation; :func:`hook_with_zero_step_interleaved` starts stepping during backward.

    ``hook``: any comm hook (gradpress's, PyTorch's, your own); register the result with the wrapped
    hook's state: ``ddp.register_comm_hook(state, hook_with_zero_step(hook, ddp, zero))``.
    ``zero``: ``ZeroRedundancyOptimizer(ddp.parameters(), OptimClass, overlap_with_ddp=True, ...)`` with one
    parameter group (``OptimClass`` needs a functional equivalent: SGD, Adam, AdamW, Adamax, Adagrad,
    Adadelta, RMSprop, Rprop). ``shard_buckets``: split buckets between ranks to balance the shards
    (otherwise whole buckets go round-robin). Do not call ``zero.step()``; every iteration, the first one
    included, updates. Works on gloo and NCCL.
    """
    return ZeroStepHook(hook, ddp, zero, shard_buckets, interleaved=False)


def hook_with_zero_step_interleaved(hook: Hook, ddp: DistributedDataParallel, zero: "ZeroRedundancyOptimizer",
                                    shard_buckets: bool = False) -> ZeroStepHook:
    """Like :func:`hook_with_zero_step`, but each bucket's step runs as soon as its reduction completes.

    The step is chained to the bucket's future, so it overlaps with the rest of the backward pass; the
    broadcasts are still issued by the hook's thread, in bucket order, after the last bucket (issuing
    them from callbacks is what makes PyTorch's version hang on gloo). The first iteration steps once
    all its buckets are known, as in :func:`hook_with_zero_step`.
    """
    return ZeroStepHook(hook, ddp, zero, shard_buckets, interleaved=True)
