"""FSDP2: any gradpress hook as the gradient all-reduce across replicas of ``fully_shard`` units.

Hybrid sharding by hand: shard each unit over a 1-D mesh (``mesh["shard"]``), and let a gradpress hook
average the reduce-scattered shards over the replicate group (``mesh["replicate"]``), e.g. PowerSGD.

>>> mesh = init_device_mesh("cuda", (nodes, 8), mesh_dim_names=("replicate", "shard"))  # doctest: +SKIP
>>> for block in model.blocks:                                                        # doctest: +SKIP
...     fully_shard(block, mesh=mesh["shard"])
>>> fully_shard(model, mesh=mesh["shard"])                                              # doctest: +SKIP
>>> state = gradpress.PowerSGDState(mesh["replicate"].get_group(), matrix_approximation_rank=4)  # doctest: +SKIP
>>> gradpress.register_fsdp_comm_hook(model, state, gradpress.powerSGD_hook)           # doctest: +SKIP

How it maps onto FSDP2 (torch 2.13, ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``,
``foreach_reduce``): ``FSDPModule.set_all_reduce_hook`` calls a hook once per unit per backward with
the reduce-scatter output, a flat 1-D tensor holding the unit's parameters' dim-0 shards, each padded to
``ceil(dim0 / shards)`` rows, in the unit's parameter order. FSDP has already averaged it over the shard
group, or divided it only in part and divides the rest after the hook (fp16 reduce dtype,
``set_force_sum_reduction_for_comms``, ``set_gradient_divide_factor``: a scale the hook needs not know).
FSDP reads the tensor back as soon as the hook returns, so the hook must finish its communication
before returning (on a GPU it runs on FSDP's all-reduce stream, which FSDP orders with its own).
Every private FSDP2 or autograd field read is in :mod:`gradpress.hooks._fsdp_internals`. This module's hook:

  1. views the flat tensor as a :class:`FSDPBucket` (gradients = the local shards, padding left out);
  2. runs ``hook(state, bucket)`` and waits for its future (the collectives run inside the call);
  3. writes the result back. FSDP's own later division then gives the mean over all ranks, exactly what
     native HSDP gives; with ``set_gradient_divide_factor(f)`` the result is also native HSDP's (the
     sum over all ranks divided by ``f``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import _fsdp_internals as internals
from .bucket import DenseBucket, check_hook, future_tensor
from .powersgd import PowerSGDState

__all__ = ["FSDPBucket", "register_fsdp_comm_hook"]

Hook = Callable[[Any, Any], torch.futures.Future]


class FSDPBucket(DenseBucket):
    """One ``fully_shard`` unit's reduced gradient shards, shaped like DDP's ``GradBucket``.

    ``buffer()`` holds the trainable parameters' local shards back to back, without FSDP's padding (a
    copy when the unit has padding, else FSDP's own tensor); ``gradients()`` are views into it shaped as
    the local shards (a 2-D weight sharded over ``s`` ranks gives an ``(n / s, m)`` row block, the same
    block on every rank of a replicate group); ``parameters()`` are the module's sharded parameters
    (``DTensor``, stable across iterations: PowerSGD keys its memory by them). ``index()`` numbers the
    units with parameters in ``module.modules()`` order; ``is_last()`` is true for the last unit reduced in
    a backward pass.
    """

    __slots__ = ()

    def __init__(self, index: int, is_last: bool, parameters: list[Tensor], shapes: list[torch.Size],
                 buffer: Tensor) -> None:
        super().__init__(index, is_last, parameters, buffer, shapes)


def register_fsdp_comm_hook(module: nn.Module, state: Any, hook: Hook) -> None:
    """Run ``hook(state, bucket)`` as the all-reduce across replicas of every ``fully_shard`` unit.

    Args:
        module: a module containing FSDP2 ``fully_shard`` units (itself one or not), each sharded over a
            1-D device mesh (the shard dimension of a ``("replicate", "shard")`` mesh).
        state: the hook's state. It names the replicate group: ``PowerSGDState.process_group`` for the
            PowerSGD hooks; the group itself (``None``: the default group) for :func:`allreduce_hook`,
            :func:`fp16_compress_hook` and :func:`bf16_compress_hook`. That group must contain no other
            rank of a unit's shard mesh (the ranks holding the same shard, one per replica).
        hook: any gradpress DDP hook or cast wrapper (``fp16_compress_wrapper(powerSGD_hook)``), or a
            function with the same contract: average ``bucket.buffer()`` over the group, return a future.

    Contracts:
        * Replaces each unit's ``set_all_reduce_hook``. The result equals native HSDP's gradients (the
          mean over all ranks) for exact hooks, on every rank; FSDP's gradient divide factor, reduce dtype
          and sum-only option keep their meaning.
        * Each unit's hook completes its collectives before returning (FSDP reads the buffer right
          after); the units are reduced in backward order, the same on every rank.
        * ``bucket.is_last()`` is true for the last unit of each backward pass, so a ``PowerSGDState``
          counts one iteration per backward that synchronizes gradients (none while
          ``set_requires_gradient_sync(False)`` accumulates). Its memory is per parameter and per rank:
          save ``state.state_dict()`` on every rank (or pass ``state`` to ``dcp.save``, a Stateful).
        * A ``PowerSGDState`` commits each unit alone (FSDP reads a unit's result as soon as its hook
          returns): a unit whose averages are not finite keeps its error memory and factors, but the
          units that stayed finite in that backward take their new memory (under DDP the whole
          iteration is kept or dropped together).
        * A ``PowerSGDState`` learns the parameters' names from ``module`` (its ``rank_policy`` and
          ``approximation_error()`` use them); a rank applies to each rank's row block ``(n / s, m)``.
        * Padding rows of uneven shards (``dim0 % shards != 0``) are never sent, compressed or counted.
        * Every trainable parameter must get a gradient in every backward (else a ``RuntimeError``
          says so; ``set_reduce_scatter_unused_params(True)`` reduces zeros for unused ones).

    Raises:
        TypeError: ``hook`` is not callable, or ``state`` names no process group.
        ValueError: ``module`` has no ``fully_shard`` unit with parameters; a unit is sharded over a 2-D
            mesh (native HSDP all-reduces already) or comes from ``replicate()`` (it all-reduces before any
            hook: use ``fully_shard`` over the size-1 ``"shard"`` dimension of a ``(world, 1)`` mesh); the
            group contains other ranks of a shard mesh.

    Example::

        state = gradpress.PowerSGDState(mesh["replicate"].get_group(), matrix_approximation_rank=4,
                                        start_powerSGD_iter=10)
        gradpress.register_fsdp_comm_hook(model, state, gradpress.powerSGD_hook)
        loss.backward()        # each unit: reduce-scatter over mesh["shard"], PowerSGD over mesh["replicate"]
    """
    check_hook(hook, "register_fsdp_comm_hook")
    group = _replicate_group(state)
    units = internals.units(module)
    replicas = dist.get_world_size(group)
    for name, unit, param_group in units:
        internals.check_replicate_group(group, param_group, name)
    counter = _BackwardCounter([param_group for _, _, param_group in units])
    if isinstance(state, PowerSGDState) and state.auto_rank is not None:
        raise ValueError("register_fsdp_comm_hook: a PowerSGDState with auto_rank is not supported under FSDP "
                         "(each rank holds a shard of every matrix); give it a fixed matrix_approximation_rank")
    if isinstance(state, PowerSGDState):
        # FSDP reads each unit's result as soon as its hook returns: each unit commits its own memory
        # (a non-finite unit keeps its memory; the others are not held back until the last unit).
        state.commit_each_bucket()
        # The units' parameters are the module's own (sharded) parameters: their names are known here,
        # for the approximation errors and a rank policy.
        state.name_parameters(module)
    for index, (_, unit, param_group) in enumerate(units):
        unit.set_all_reduce_hook(_UnitHook(state, hook, index, param_group, counter, replicas))


class _UnitHook:
    """The all-reduce hook of one unit: steps 1-3 of the module docstring."""

    __slots__ = ("state", "hook", "index", "param_group", "counter", "replicas")

    def __init__(self, state: Any, hook: Hook, index: int, param_group: Any, counter: _BackwardCounter,
                 replicas: int) -> None:
        self.state = state
        self.hook = hook
        self.index = index
        self.param_group = param_group
        self.counter = counter
        self.replicas = replicas

    def __call__(self, flat: Tensor) -> None:
        parameters, offsets, shapes = internals.layout(self.param_group, flat)
        dense = _is_dense(offsets, shapes)
        packed = flat if dense else torch.cat([flat[o: o + s.numel()] for o, s in zip(offsets, shapes)])
        bucket = FSDPBucket(self.index, self.counter.next_is_last(), parameters, shapes, packed)
        fut = self.hook(self.state, bucket)
        if isinstance(self.state, PowerSGDState):
            # The PowerSGD hooks queue their later phases in the state's ordered pipeline and complete
            # the future when it advances (on the next bucket in DDP). FSDP needs the result now.
            self.state.drain()
        result = future_tensor(fut.wait())
        if result.numel() != packed.numel():
            raise RuntimeError(f"the hook's future holds {result.numel()} elements, the bucket {packed.numel()}")
        if dense:
            if result is not flat:
                flat.copy_(result)
        else:
            for chunk, offset in zip(result.split([s.numel() for s in shapes]), offsets):
                flat[offset: offset + chunk.numel()].copy_(chunk)
        if internals.divide_factor(self.param_group) is not None:
            # FSDP divides by the factor alone and expects the sum across replicas (native HSDP sums
            # there); the hook averaged.
            flat.mul_(self.replicas)


class _BackwardCounter:
    """Tells which unit is the last of a backward pass: the n-th one reduced, for n trainable units.

    A backward pass is recognized by autograd's graph task id; an autograd final callback checks that
    every unit was reduced (FSDP skips a unit whose parameters got no gradient, which would leave a
    PowerSGD state without its end of iteration).
    """

    __slots__ = ("param_groups", "calls", "expected", "task")

    def __init__(self, param_groups: list[Any]) -> None:
        self.param_groups = param_groups
        self.calls = 0
        self.expected = 0
        self.task = -1

    def next_is_last(self) -> bool:
        task = internals.current_backward()
        if self.calls == 0 or task != self.task:
            self.task = task
            self.calls = 0
            self.expected = internals.trainable_units(self.param_groups)
            internals.on_backward_end(self._check_complete)
        self.calls += 1
        return self.calls == self.expected

    def _check_complete(self) -> None:
        calls, self.calls = self.calls, 0
        if calls != self.expected:
            raise RuntimeError(
                f"register_fsdp_comm_hook: {calls} of {self.expected} fully_shard units with trainable "
                "parameters reduced gradients in this backward pass. Every trainable parameter must get a "
                "gradient (call set_reduce_scatter_unused_params(True) on the root module to reduce zeros "
                "for unused ones), and set_requires_gradient_sync must be set on the root module.")


# --- helpers ---------------------------------------------------------------------------------------------

def _is_dense(offsets: list[int], shapes: list[torch.Size]) -> bool:
    end = 0
    for offset, shape in zip(offsets, shapes):
        if offset != end:
            return False
        end += shape.numel()
    return True


def _replicate_group(state: Any) -> dist.ProcessGroup | None:
    if state is None or isinstance(state, dist.ProcessGroup):
        return state
    if hasattr(state, "process_group"):
        return state.process_group
    raise TypeError(f"state must be the hook's state naming the replicate group: a PowerSGDState, a "
                    f"ProcessGroup or None (the default group), got {type(state).__name__}")
