"""Join the process group from a ``torchrun`` worker, safely across ``--max-restarts``.

``init_distributed()`` is ``torch.distributed.init_process_group`` for the environment ``torchrun`` sets
(NCCL with one GPU per process when CUDA is available, gloo otherwise), with one fix for restarts:

Since torch 2.4, ``torchrun``'s rendezvous shares one TCPStore with the workers and keeps it across
restarts, and a worker's ``init_process_group`` uses that store *without* a per-attempt prefix
(pytorch/pytorch#135712). The keys a restarted group reads are then the previous attempt's until each
peer overwrites them, so a fast worker can read a dead peer's old address and fail with ``Gloo
connectFullMesh failed ... Connection refused`` (or NCCL's "Failed to connect"); whether it does is a
race, which is why it is mostly seen when a worker dies soon after start-up. On a single node
(``--standalone`` or one agent) every worker of an attempt sees the same ``TORCHELASTIC_RESTART_COUNT``,
so the store is wrapped in a prefix per attempt. With several nodes that count is per agent (an agent
that restarts because another node failed does not count it), so it cannot name the attempt; there,
start ``torchrun`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per attempt), which a
warning recommends when restarts are enabled and the store is shared.

>>> device = init_distributed(timeout=600)          # inside a torchrun worker      # doctest: +SKIP
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "restart_store_prefix"]


def restart_store_prefix(environ: "os._Environ[str] | dict[str, str] | None" = None) -> str | None:
    """The per-attempt store prefix for this ``torchrun`` worker, or ``None`` where none is needed
    (not under ``torchrun``, no restarts allowed, a fresh store per attempt) or none can be trusted
    (several agents sharing the store: see the module's docstring)."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return None
    if int(env.get("GROUP_WORLD_SIZE", "1")) > 1:
        return None
    return f"gradpress/attempt_{int(env.get('TORCHELASTIC_RESTART_COUNT', '0'))}"


def init_distributed(backend: str | None = None, timeout: float | None = None) -> torch.device:
    """Initialise the default process group from ``torchrun``'s environment and return this worker's
    device (``cuda:LOCAL_RANK`` with NCCL when CUDA is available, else the CPU with gloo).

    ``backend``: ``"nccl"`` or ``"gloo"`` to choose; ``timeout``: seconds a collective may wait for its
    peers before raising (torch's default when ``None``). Safe under ``torchrun --max-restarts``.
    """
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"backend must be None, 'nccl' or 'gloo', got {backend!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed needs torchrun's environment ({', '.join(missing)} not set); "
                           "run under torchrun, e.g. torchrun --standalone --nproc-per-node 2 script.py")
    use_cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
    backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    prefix = restart_store_prefix()
    if prefix is None:
        if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and rank == 0):
            warnings.warn("torchrun shares its rendezvous store with the workers across restarts, and with "
                          "several nodes a restarted group can read the previous attempt's addresses; start "
                          "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node", stacklevel=2)
        dist.init_process_group(backend, **kwargs)
        return device
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          **kwargs)
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world, **kwargs)
    return device
