"""Guards the tests share: fail on any read of a tensor's value on the host (a stream sync on an
accelerator), count such reads, fail on a blocking copy from the host to a device (also a stream sync
on a GPU), and run the engine's CPU tensors down its accelerator path."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradpress.powersgd import backend

#: ATen ops that read device values on the host (a stream sync on an accelerator).
SYNCING_OPS = frozenset({"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.equal",
                         "aten.is_nonzero", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive"})
#: Indexing ops that turn a boolean mask into indices (by a ``nonzero`` in C++ that is never dispatched).
INDEXING_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
#: Python methods that read values (``tolist``/``numpy`` never reach the dispatcher).
READING_METHODS = ("__bool__", "item", "tolist", "nonzero", "__int__", "__float__", "__index__", "numpy")


class HostRead(AssertionError):
    pass


def _syncs(func, args) -> bool:
    name = str(func.overloadpacket)
    if name in INDEXING_OPS and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return name in SYNCING_OPS


class ForbidSyncingOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _syncs(func, args):
            raise HostRead(f"{func} reads a tensor's value on the host (a stream sync on a GPU)")
        return func(*args, **(kwargs or {}))


class CountSyncingOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += _syncs(func, args)
        return func(*args, **(kwargs or {}))


class ForbidBlockingUploads(TorchDispatchMode):
    """Raise :class:`HostRead` on a copy of a host tensor to another device that is not ``non_blocking``:
    from pageable memory to a GPU such a copy waits for the stream (run the engine on ``meta`` to see them)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name == "aten._to_copy" and args[0].device.type == "cpu":
            target = kwargs.get("device")
            if target is not None and torch.device(target).type != "cpu" and not kwargs.get("non_blocking"):
                raise HostRead(f"{func} copies a host tensor to {target} blocking (a stream sync on a GPU)")
        if name == "aten.copy_" and args[0].device.type != "cpu" and args[1].device.type == "cpu":
            if not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                raise HostRead(f"{func} copies a host tensor into {args[0].device} blocking (a stream sync on a GPU)")
        return func(*args, **kwargs)


def _forbidden(name):
    def method(self, *args, **kwargs):
        raise HostRead(f"Tensor.{name} reads a tensor's value on the host (a stream sync on a GPU)")
    return method


@contextlib.contextmanager
def no_host_reads():
    """Raise :class:`HostRead` on any read of a tensor's value inside the block."""
    with pytest.MonkeyPatch.context() as patch:
        for name in READING_METHODS:
            patch.setattr(torch.Tensor, name, _forbidden(name))
        with ForbidSyncingOps():
            yield


@contextlib.contextmanager
def as_on_an_accelerator():
    """Run the engine's CPU tensors down the path it takes where reading a value waits for the device
    (the engine's own switch: its device backend, whatever the tensors' device)."""
    with backend.forced(backend.DEVICE):
        yield
