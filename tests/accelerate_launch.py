"""Shared by the Accelerate and Trainer tests: run a worker of ``tests/distributed.py`` as if a launcher
had started it, so that Accelerate runs as MULTI_CPU over the worker's existing process group."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def launched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a worker function with the environment a launcher sets (Accelerate then runs as MULTI_CPU over
    the existing process group), fresh Accelerate singletons, and the shared worker's environment restored
    after."""

    @functools.wraps(fn)
    def wrapper(rank: int, world: int, *args: Any) -> Any:
        saved = dict(os.environ)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
        reset_accelerate()
        try:
            return fn(rank, world, *args)
        finally:
            reset_accelerate()
            os.environ.clear()
            os.environ.update(saved)

    return wrapper
