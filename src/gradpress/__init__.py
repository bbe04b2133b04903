"""gradpress: communication-efficient data-parallel training for PyTorch.

PowerSGD low-rank gradient compression as drop-in DDP communication hooks, plain and fp16/bf16 hooks,
an optimizer-agnostic PowerSGD aggregator, and local SGD (post-local SGD hook, model averagers, an
outer optimizer). See the README for the ways to use it (DDP hook, aggregator, local SGD, CLI).

The public names are imported on first use (PEP 562), so that ``import gradpress`` and
``gradpress --version`` do not pay for importing torch until something needs it::

    from gradpress import PowerSGDState, powerSGD_hook     # imports torch and the hooks here
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the submodule that defines it.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["Aggregator", "AllReduce", "Config", "PowerSGD", "optimizer_step"], "aggregator"),
    **dict.fromkeys(["HierarchicalModelAverager", "ModelAverager", "OuterOptimizerAverager", "PeriodicModelAverager",
                     "PostLocalSGDOptimizer", "average_parameters"], "averaging"),
    "broadcast_parameters": "comm",
    **dict.fromkeys(["PostLocalSGDState", "PowerSGDState", "ZeroStepHook", "allreduce_hook", "batched_powerSGD_hook",
                     "batched_powersgd_hook", "bf16_compress_hook", "bf16_compress_wrapper", "fp16_compress_hook",
                     "fp16_compress_wrapper", "hook_with_zero_step", "hook_with_zero_step_interleaved",
                     "post_localSGD_hook", "post_localsgd_hook", "powerSGD_hook", "powersgd_hook"], "hooks"),
    **dict.fromkeys(["EngineConfig", "Plan", "make_plan"], "powersgd"),
    **dict.fromkeys(["ApproximationSummary", "approximation_error_metrics", "log_approximation_error"], "diagnostics"),
    "AdaptiveRank": "adaptive",
    "AutoRank": "autorank",
    **dict.fromkeys(["gather_state", "scatter_state", "state_nbytes"], "checkpoint"),
    **dict.fromkeys(["QuantizeInt4", "QuantizeInt8", "TopK"], "averaging.compress"),
    "StreamingDiLoCoAverager": "streaming",
    "register_fsdp_comm_hook": "hooks.fsdp",
    "hierarchical_wrapper": "hooks.hierarchical",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from .aggregator import Aggregator, AllReduce, Config, PowerSGD, optimizer_step
    from .averaging import (HierarchicalModelAverager, ModelAverager, OuterOptimizerAverager, PeriodicModelAverager,
                            PostLocalSGDOptimizer, average_parameters)
    from .comm import broadcast_parameters
    from .hooks import (PostLocalSGDState, PowerSGDState, ZeroStepHook, allreduce_hook, batched_powerSGD_hook,
                        batched_powersgd_hook, bf16_compress_hook, bf16_compress_wrapper, fp16_compress_hook,
                        fp16_compress_wrapper, hook_with_zero_step, hook_with_zero_step_interleaved,
                        post_localSGD_hook, post_localsgd_hook, powerSGD_hook, powersgd_hook)
    from .adaptive import AdaptiveRank
    from .autorank import AutoRank
    from .checkpoint import gather_state, scatter_state, state_nbytes
    from .diagnostics import ApproximationSummary, approximation_error_metrics, log_approximation_error
    from .hooks.fsdp import register_fsdp_comm_hook
    from .hooks.hierarchical import hierarchical_wrapper
    from .powersgd import EngineConfig, Plan, make_plan
    from .averaging.compress import QuantizeInt4, QuantizeInt8, TopK
    from .streaming import StreamingDiLoCoAverager


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (gradpress.hooks, gradpress.tools.zoo, ...), as after an eager import
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'gradpress' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
