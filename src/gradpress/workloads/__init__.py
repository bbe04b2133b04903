"""Training workloads for ``gradpress demo`` and ``examples/train.py``: real data that ships with
scikit-learn or Python (nothing is downloaded), a model per task, and the data-parallel training loop."""

from .tasks import TASKS, Task, TaskData, get_task, task_names
from .training import METHOD_KINDS, DemoConfig, Method, default_start_iter, param_checksum, parse_methods, train

__all__ = ["METHOD_KINDS", "TASKS", "DemoConfig", "Method", "Task", "TaskData", "default_start_iter", "get_task",
           "param_checksum", "parse_methods", "task_names", "train"]
