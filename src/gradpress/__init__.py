"""gradpress: communication-efficient data-parallel training for PyTorch.

PowerSGD low-rank gradient compression as drop-in DDP communication hooks, plus plain and
fp16/bf16 hooks. See the README for the three ways to use it (DDP hook, aggregator, CLI).
"""

from .aggregator import Aggregator, AllReduce, Config, PowerSGD, optimizer_step
from .hooks import (PowerSGDState, allreduce_hook, batched_powerSGD_hook, batched_powersgd_hook,
                    bf16_compress_hook, bf16_compress_wrapper, fp16_compress_hook, fp16_compress_wrapper,
                    powerSGD_hook, powersgd_hook)
from .powersgd import EngineConfig, Plan, make_plan

__version__ = "0.1.0"

__all__ = ["Aggregator", "AllReduce", "Config", "EngineConfig", "PowerSGD", "optimizer_step", "Plan", "PowerSGDState", "allreduce_hook", "batched_powerSGD_hook",
           "batched_powersgd_hook", "bf16_compress_hook", "bf16_compress_wrapper", "fp16_compress_hook",
           "fp16_compress_wrapper", "make_plan", "powerSGD_hook", "powersgd_hook"]
