"""A small, deterministic classification workload for demos: synthetic 8x8 "digits" and an MLP.

Nothing is downloaded. Each class has a few smooth random 8x8 templates; a sample is one of them,
scaled, plus heavy Gaussian pixel noise, so the task is learnable but not trivial. Everything (data,
model initialisation, batch order) is a function of ``DemoConfig.seed`` alone, so two runs that differ
only in the communication hook see exactly the same data in the same order.

:func:`train` runs one data-parallel training run on an already initialised process group:

>>> # inside each of world_size processes, after dist.init_process_group(...)  # doctest: +SKIP
>>> result = train(rank, world_size, "powersgd", DemoConfig(steps=200))       # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..hooks import PowerSGDState, allreduce_hook, powerSGD_hook
from ..powersgd import make_plan

__all__ = ["DemoConfig", "METHODS", "ProgressFn", "make_dataset", "make_model", "make_templates",
           "param_checksum", "train"]

#: Method names accepted by :func:`train`, in the order the demo runs them.
METHODS = ("allreduce", "powersgd")

IMAGE_SIDE = 8
CLASSES = 10
TEMPLATES_PER_CLASS = 3

#: ``on_progress(method, step, steps, loss)``: called on rank 0 every ``log_every`` steps.
ProgressFn = Callable[[str, int, int, float], None]


@dataclass(frozen=True)
class DemoConfig:
    """Everything that defines a demo run (identical on every rank).

    ``batch_size`` is per worker; ``rank`` is PowerSGD's approximation rank; ``start_iter`` the number
    of plain-allreduce steps before PowerSGD starts. ``fail_at_step`` makes rank ``fail_rank`` raise at
    that step (to exercise the launcher's failure handling; ``None`` in normal runs).
    """

    steps: int = 240
    rank: int = 2
    start_iter: int = 10
    seed: int = 0
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    hidden: int = 256
    n_train: int = 4000
    n_test: int = 1000
    noise: float = 1.5
    min_compression_rate: float = 2.0
    log_every: int = 40
    fail_at_step: int | None = None
    fail_rank: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serialisable, picklable)."""
        return asdict(self)


class MLP(nn.Module):
    """The student: 64 -> hidden -> hidden -> 10 with ReLU (three weight matrices PowerSGD compresses)."""

    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IMAGE_SIDE * IMAGE_SIDE, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.fc1(x.flatten(1)))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def make_templates(seed: int, per_class: int = TEMPLATES_PER_CLASS) -> Tensor:
    """``(10 * per_class, 1, 8, 8)`` smooth random images, zero mean, unit RMS; class ``c`` owns rows
    ``c * per_class ...`` (several "handwriting styles" per class)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    raw = torch.randn(CLASSES * per_class, 1, IMAGE_SIDE + 2, IMAGE_SIDE + 2, generator=gen)
    smooth = nn.functional.avg_pool2d(raw, 3, stride=1)
    smooth = smooth - smooth.mean(dim=(2, 3), keepdim=True)
    return smooth / smooth.pow(2).mean(dim=(2, 3), keepdim=True).sqrt()


def make_dataset(config: DemoConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_train, y_train, x_test, y_test)``: ``x`` is ``(N, 1, 8, 8)`` float32, ``y`` class indices.

    Each sample is one of its class's templates (:func:`make_templates`) at a random amplitude in
    [0.5, 1.5), plus Gaussian pixel noise of standard deviation ``config.noise``: a digit-like task
    that a small MLP learns to roughly 90% test accuracy in a few hundred steps.
    """
    templates = make_templates(config.seed)
    gen = torch.Generator().manual_seed(20_000 + config.seed)
    total = config.n_train + config.n_test
    y = torch.randint(0, CLASSES, (total,), generator=gen)
    style = torch.randint(0, TEMPLATES_PER_CLASS, (total,), generator=gen)
    amplitude = 0.5 + torch.rand(total, 1, 1, 1, generator=gen)
    x = amplitude * templates[y * TEMPLATES_PER_CLASS + style]
    x = x + config.noise * torch.randn(total, 1, IMAGE_SIDE, IMAGE_SIDE, generator=gen)
    return x[: config.n_train], y[: config.n_train], x[config.n_train:], y[config.n_train:]


def make_model(config: DemoConfig) -> MLP:
    """The student model, initialised from ``config.seed`` (the same on every rank and for every method)."""
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(config.seed)
        return MLP(config.hidden)
    finally:
        torch.random.set_rng_state(gen_state)


def param_checksum(model: nn.Module) -> tuple[float, str]:
    """``(sum of all parameters in float64, sha256 of their bytes)``: equal iff ranks hold equal weights."""
    digest = hashlib.sha256()
    total = 0.0
    for param in model.parameters():
        data = param.detach().cpu().contiguous()
        total += float(data.double().sum())
        digest.update(ctypes.string_at(data.data_ptr(), data.numel() * data.element_size()))  # no numpy
    return total, digest.hexdigest()


def _shard(tensor: Tensor, rank: int, world_size: int) -> Tensor:
    return tensor[rank::world_size]


def _evaluate(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float, float]:
    """Sum over the whole dataset, across ranks: ``(loss sum, correct, count)``."""
    with torch.no_grad():
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y, reduction="sum")
        correct = (logits.argmax(dim=1) == y).sum()
    totals = torch.tensor([float(loss), float(correct), float(len(y))], dtype=torch.float64)
    dist.all_reduce(totals)
    return float(totals[0]), float(totals[1]), float(totals[2])


def train(rank: int, world_size: int, method: str, config: DemoConfig,
          on_progress: ProgressFn | None = None) -> dict[str, Any]:
    """Train the student with DDP and ``method``'s comm hook; return metrics and a parameter checksum.

    Needs an initialised default process group (any backend that works on CPU tensors, e.g. gloo).
    ``method`` is ``"allreduce"`` (:func:`gradpress.allreduce_hook`) or ``"powersgd"``
    (:func:`gradpress.powerSGD_hook`, rank ``config.rank``, starting after ``config.start_iter`` steps).
    Each rank trains on its own shard of the training set (``rank::world_size``), reshuffled every
    epoch from the seed. Loss and accuracy in the result are over the full train / test sets, summed
    across ranks, after the last step. ``floats_per_step`` is what one worker puts on the wire per step
    (the payload; PowerSGD's after it has started), from :func:`gradpress.make_plan`.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    x_train, y_train, x_test, y_test = make_dataset(config)
    x_local, y_local = _shard(x_train, rank, world_size), _shard(y_train, rank, world_size)
    x_test_local, y_test_local = _shard(x_test, rank, world_size), _shard(y_test, rank, world_size)

    model = make_model(config)
    shapes = [tuple(p.shape) for p in model.parameters()]
    full_plan = make_plan(shapes, config.rank, config.min_compression_rate)
    ddp = DistributedDataParallel(model)
    state: PowerSGDState | None = None
    if method == "allreduce":
        ddp.register_comm_hook(None, allreduce_hook)
    else:
        state = PowerSGDState(None, matrix_approximation_rank=config.rank,
                              start_powerSGD_iter=config.start_iter,
                              min_compression_rate=config.min_compression_rate, random_seed=config.seed)
        ddp.register_comm_hook(state, powerSGD_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=config.momentum)

    order_gen = torch.Generator().manual_seed(30_000 + 1_000 * config.seed + rank)
    order = torch.randperm(len(y_local), generator=order_gen)
    cursor = 0
    running, running_n = 0.0, 0
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, config.steps + 1):
        if cursor + config.batch_size > len(order):
            order = torch.randperm(len(y_local), generator=order_gen)
            cursor = 0
        index = order[cursor: cursor + config.batch_size]
        cursor += config.batch_size
        if config.fail_at_step == step and rank == config.fail_rank:
            raise RuntimeError(f"injected failure on rank {rank} at step {step} (DemoConfig.fail_at_step)")
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x_local[index]), y_local[index])
        loss.backward()
        optimizer.step()
        running += float(loss.detach())
        running_n += 1
        if on_progress is not None and rank == 0 and (step % config.log_every == 0 or step == config.steps):
            on_progress(method, step, config.steps, running / running_n)
            running, running_n = 0.0, 0
    train_time = time.perf_counter() - start

    model.eval()
    loss_sum, _, n_train = _evaluate(model, x_local, y_local)
    _, correct, n_test = _evaluate(model, x_test_local, y_test_local)
    times = torch.tensor([train_time], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    checksum, digest = param_checksum(model)

    result: dict[str, Any] = {
        "method": method,
        "rank": rank,
        "world_size": world_size,
        "steps": config.steps,
        "test_accuracy": correct / n_test,
        "train_loss": loss_sum / n_train,
        "wall_time_s": float(times[0]),
        "numel": full_plan.numel,
        "param_shapes": [list(s) for s in shapes],
        "checksum": checksum,
        "digest": digest,
    }
    if state is None:
        result.update(floats_per_step=full_plan.numel, compression_rate=1.0, compressed_steps=0,
                      floats_total=full_plan.numel * config.steps, stats=None)
    else:
        compressed_steps = max(0, config.steps - config.start_iter)
        _, before, after = state.compression_stats()
        result.update(
            floats_per_step=full_plan.numel_sent,
            compression_rate=full_plan.compression_rate,
            compressed_steps=compressed_steps,
            floats_total=full_plan.numel * min(config.steps, config.start_iter)
            + full_plan.numel_sent * compressed_steps,
            stats={"numel_before": before, "numel_after": after,
                   "floats_per_step": after / compressed_steps if compressed_steps else None,
                   "iter": state.iter},
        )
    return result
