"""Small, deterministic training workloads used by ``gradpress demo`` (generated data, no downloads)."""

from .digits import METHODS, DemoConfig, make_dataset, make_model, make_templates, param_checksum, train

__all__ = ["METHODS", "DemoConfig", "make_dataset", "make_model", "make_templates", "param_checksum", "train"]
