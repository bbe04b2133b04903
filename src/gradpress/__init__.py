"""gradpress: communication-efficient data-parallel training for PyTorch.

PowerSGD low-rank gradient compression as drop-in DDP communication hooks, plain and fp16/bf16 hooks,
an optimizer-agnostic PowerSGD aggregator, and local SGD (post-local SGD hook, model averagers, an
outer optimizer). See the README for the ways to use it (DDP hook, aggregator, local SGD, CLI).
"""

from .aggregator import Aggregator, AllReduce, Config, PowerSGD, optimizer_step
from .averaging import (HierarchicalModelAverager, ModelAverager, OuterOptimizerAverager, PeriodicModelAverager,
                        PostLocalSGDOptimizer, average_parameters, broadcast_parameters)
from .hooks import (PostLocalSGDState, PowerSGDState, ZeroStepHook, allreduce_hook, batched_powerSGD_hook,
                    batched_powersgd_hook, bf16_compress_hook, bf16_compress_wrapper, fp16_compress_hook,
                    fp16_compress_wrapper, hook_with_zero_step, hook_with_zero_step_interleaved, post_localSGD_hook,
                    post_localsgd_hook, powerSGD_hook, powersgd_hook)
from .powersgd import EngineConfig, Plan, make_plan

__version__ = "0.1.0"

__all__ = ["Aggregator", "AllReduce", "Config", "EngineConfig", "HierarchicalModelAverager", "ModelAverager",
           "OuterOptimizerAverager", "PeriodicModelAverager", "Plan", "PostLocalSGDOptimizer", "PostLocalSGDState",
           "PowerSGD", "PowerSGDState", "ZeroStepHook", "allreduce_hook", "average_parameters", "batched_powerSGD_hook", "broadcast_parameters",
           "batched_powersgd_hook", "bf16_compress_hook", "bf16_compress_wrapper", "fp16_compress_hook",
           "fp16_compress_wrapper", "hook_with_zero_step", "hook_with_zero_step_interleaved", "make_plan", "optimizer_step", "post_localSGD_hook", "post_localsgd_hook",
           "powerSGD_hook", "powersgd_hook"]
