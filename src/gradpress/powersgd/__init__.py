"""The PowerSGD engine: plan, memory, one step, and the session that runs them.

No ``torch.distributed``, no ``GradBucket`` in here."""

from .config import EngineConfig
from .memory import ParamMemory, Segment, Workspace
from .seeding import seeded_normal
from .plan import GroupPlan, Plan, TensorPlan, make_plan, should_compress
from .session import EngineSession, MemoryReport
from .store import SegmentStore
from .commit import StepCommit
from .step import alternating_step, compress_step, power_step

__all__ = ["EngineConfig", "EngineSession", "GroupPlan", "MemoryReport", "ParamMemory", "Plan", "Segment",
           "SegmentStore", "StepCommit", "TensorPlan", "Workspace", "alternating_step", "compress_step",
           "make_plan", "power_step", "seeded_normal", "should_compress"]
