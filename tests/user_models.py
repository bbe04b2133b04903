"""Factories for ``gradpress inspect --model user_models:NAME`` tests (tests/ is on sys.path)."""

from __future__ import annotations

from torch import nn


def two_layer() -> nn.Module:
    """A 100x50 matrix (compressed at rank 1), its bias, and a frozen 64x64 matrix DDP would not see."""
    model = nn.Sequential(nn.Linear(50, 100), nn.ReLU(), nn.Linear(100, 3, bias=False), nn.Linear(64, 64))
    model[3].requires_grad_(False)
    return model


class Builders:
    @staticmethod
    def wide() -> nn.Module:
        return nn.Linear(1000, 20)


def not_a_module() -> dict:
    return {"weight": (3, 3)}


def needs_arguments(width: int) -> nn.Module:
    return nn.Linear(width, width)


NOT_CALLABLE = 42
