"""The one place that talks to a process group: every ``torch.distributed`` collective gradpress issues.

The engine only sees its :class:`~gradpress.powersgd.transport.Communicator` protocol, so it can run under
DDP hooks, under the standalone aggregator, or with no ``torch.distributed`` at all
(:class:`LocalCommunicator`). The rest of the package calls the functions here: blocking collectives
(:func:`all_reduce`, :func:`broadcast`, :func:`barrier`, the object collectives), asynchronous ones
returning a :class:`Work` (whose ``wait()`` describes a failure as a :class:`CollectiveError`), the one
exact-average primitive (blocking :func:`average_tensors_`, asynchronous :func:`start_average`, the
pipeline task :func:`average_task`) and :func:`broadcast_parameters`.

Modules: ``errors`` (:class:`CollectiveError` and how a collective is described), ``communicator`` (the
engine's communicators), ``collectives`` (every ``torch.distributed`` collective, and
:class:`Work`), ``average`` (exact averages of tensor lists: :func:`average_tensors_`,
:func:`start_average` and its :class:`PendingAverage`, :func:`average_task`), ``parameters``
(:func:`broadcast_parameters`), ``link`` (:func:`link_bytes`: what one rank's link carries for a collective,
ring-equivalent), ``exchange`` (:class:`GroupExchange`: the all-gather and all-to-all of compressed payloads
behind one small interface, :class:`PayloadExchange`).
"""

from .collectives import (Work, all_gather_async, all_gather_ints, all_gather_objects, all_reduce, all_reduce_async,
                          all_to_all_async, barrier, broadcast, broadcast_async, gather_objects, is_distributed,
                          is_member,
                          reduce_scatter_async, scatter_objects)
from .communicator import LocalCommunicator, ProcessGroupCommunicator, make_communicator
from .average import PendingAverage, average_task, average_tensors_, device_groups, start_average
from .exchange import GroupExchange, PayloadExchange
from .link import link_bytes
from .errors import (TORCHFT_HINT, CollectiveError, check_communicator, check_process_group, collective_error,
                     describe_collective, is_torchft_object)
from .parameters import broadcast_parameters, flat_groups

__all__ = ["CollectiveError", "GroupExchange", "LocalCommunicator", "PayloadExchange", "PendingAverage",
           "ProcessGroupCommunicator", "TORCHFT_HINT", "Work", "all_gather_async", "all_gather_ints",
           "all_gather_objects", "all_reduce", "all_reduce_async", "all_to_all_async", "average_task",
           "average_tensors_", "barrier", "broadcast", "broadcast_async", "broadcast_parameters", "check_communicator",
           "check_process_group", "collective_error", "describe_collective", "device_groups", "flat_groups",
           "gather_objects", "is_distributed", "is_member", "is_torchft_object", "link_bytes", "make_communicator",
           "reduce_scatter_async", "scatter_objects", "start_average"]
