"""Small models and data shared by the tests (deterministic, generated, no downloads)."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Convolutions, a BatchNorm-free head and biases: several shapes, two of them repeated."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.conv3 = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Linear(width * 6 * 6, 32)
        self.out = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x)) + x
        x = torch.relu(self.conv3(x)) + x
        x = nn.functional.max_pool2d(x, 2)
        return self.out(torch.relu(self.head(x.flatten(1))))


class GivenGradients(nn.Module):
    """Two 64 x 48 weights and a bias; the gradient of each weight is the input given for it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(64, 48))
        self.b = nn.Parameter(torch.zeros(64, 48))
        self.bias = nn.Parameter(torch.zeros(48))

    def forward(self, xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
        return (self.a * xa).sum() + (self.b * xb).sum() + self.bias.sum()


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return SmallCNN(**kwargs).to(dtype)


def batch(rank: int, step: int, size: int = 16, dtype: torch.dtype = torch.float32):
    """A batch that differs on every rank and step (so compression really has something to average)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 1, 12, 12, generator=g, dtype=torch.float32).to(dtype)
    y = torch.randint(0, 10, (size,), generator=g)
    return x, y


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float(), y)


def train_regression(net: nn.Module, opt: torch.optim.Optimizer, rank: int, start: int, stop: int) -> None:
    """Steps ``start .. stop-1`` of an MSE regression on 4-feature inputs, batches seeded by (step, rank):
    the training loop of the averager tests (local SGD, DiLoCo, streaming DiLoCo)."""
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def floats_sent_by_hand(shapes, rank, min_rate: float = 2.0) -> int:
    """PowerSGD's per-step payload from the rule itself: ``(n + m) r`` per compressed matrix, every element
    of the rest. ``rank``: one for all, or one per tensor (``None``: sent exactly)."""
    ranks = list(rank) if isinstance(rank, (list, tuple)) else [rank] * len(shapes)
    total = 0
    for shape, r in zip(shapes, ranks):
        numel = 1
        for size in shape:
            numel *= size
        if r is None or len(shape) < 2:
            total += numel
            continue
        n, m = shape[0], numel // shape[0]
        r = min(n, m, r)
        total += (n + m) * r if (n + m) * r * min_rate < n * m else numel
    return total


def matrix_with_spectrum(n, m, singular_values, seed=0):
    """An ``n x m`` float64 matrix with exactly these singular values (random singular vectors from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n, len(singular_values), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(m, len(singular_values), generator=g, dtype=torch.float64))
    return u @ torch.diag(torch.tensor(singular_values, dtype=torch.float64)) @ v.T
