"""DDP communication hooks: adapters from ``GradBucket`` to the engine and to plain collectives."""

from .default import (allreduce_hook, bf16_compress_hook, bf16_compress_wrapper, fp16_compress_hook,
                      fp16_compress_wrapper)
from .fsdp import FSDPBucket, register_fsdp_comm_hook
from .hierarchical import HierarchicalHook, assign_shares, hierarchical_wrapper
from .post_local import PostLocalSGDState, node_subgroup, post_localSGD_hook, post_localsgd_hook
from .batched import batched_powerSGD_hook, batched_powersgd_hook
from .powersgd import PowerSGDState, powerSGD_hook, powersgd_hook
from .zero import ZeroStepHook, hook_with_zero_step, hook_with_zero_step_interleaved

__all__ = ["FSDPBucket", "HierarchicalHook", "PostLocalSGDState", "PowerSGDState", "ZeroStepHook",
           "allreduce_hook", "assign_shares", "batched_powerSGD_hook", "batched_powersgd_hook",
           "bf16_compress_hook", "bf16_compress_wrapper", "fp16_compress_hook", "fp16_compress_wrapper",
           "hierarchical_wrapper", "hook_with_zero_step", "hook_with_zero_step_interleaved", "node_subgroup",
           "post_localSGD_hook", "post_localsgd_hook", "powerSGD_hook", "powersgd_hook", "register_fsdp_comm_hook"]
