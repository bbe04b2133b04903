"""The PowerSGD engine: plan, memory, one step. No ``torch.distributed``, no ``GradBucket`` in here."""

from .config import EngineConfig
from .memory import ParamMemory, Segment, SegmentStore, Workspace, seeded_normal
from .plan import GroupPlan, Plan, TensorPlan, make_plan, should_compress
from .step import StepCommit, alternating_step, compress_step, power_step

__all__ = ["EngineConfig", "GroupPlan", "ParamMemory", "Plan", "Segment", "SegmentStore", "StepCommit", "TensorPlan",
           "Workspace", "alternating_step", "compress_step", "make_plan", "power_step", "seeded_normal",
           "should_compress"]
