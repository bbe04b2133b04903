"""Training workloads for ``gradpress demo`` and ``examples/train.py``: real data that ships with
scikit-learn or Python (nothing is downloaded), a model per task, the communication methods (one registry,
:mod:`.methods`), and the data-parallel training loop."""

from .config import DemoConfig, default_start_iter
from .methods import METHOD_KINDS, METHOD_REGISTRY, Method, MethodKind, parse_methods
from .tasks import TASKS, Recipe, Task, TaskData, get_task, task_names
from .training import param_checksum, train

__all__ = ["METHOD_KINDS", "METHOD_REGISTRY", "TASKS", "DemoConfig", "Method", "MethodKind", "Recipe", "Task",
           "TaskData", "default_start_iter", "get_task", "param_checksum", "parse_methods", "task_names", "train"]
