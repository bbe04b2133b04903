"""How well PowerSGD approximates each matrix: per-parameter errors, a summary, and logging.

For each compressed parameter, the **relative approximation error** is

    ||M - P Q^T||_F / ||M||_F

where M is the matrix this worker compressed (its gradient plus its error memory) and P Q^T the
low-rank approximation every worker applied. It is 0 when the approximation is exact (full rank on one
worker, or on workers whose matrices agree), and it is the relative size of what error feedback carries
to the next step: on several workers it also holds how far this worker's M lies from the workers' mean,
which no rank can remove. A parameter whose error stays near 1 gains little from compression at its
rank; one near 0 could use a lower rank.

That number is per worker, and on several workers it says little about quality: M_i = g_i + e_i is
dominated by the error memory and by how far worker i's matrix lies from the mean, so it reads near 1
everywhere. What the run applies is P Q^T in place of the workers' mean, so the **global residual**

    ||mean_i M_i - P Q^T||_F / ||mean_i M_i||_F          captured energy: 1 - (global residual)^2

says how much of the averaged matrix the shared approximation captures (0: all of it; the classic
scheme's P Q^T = P P^T mean M is a projection, so it lies in [0, 1]). The mean of the M_i is never sent,
so it is *estimated* with a seeded Gaussian sketch Omega (m x k, k = 16, identical on every rank; the
identity, hence exact, when m <= 16): the step all-reduces ``M_i Omega`` (n x k per matrix, one extra
all-reduce per bucket on measured steps only, not counted in ``bytes_stats()``) and takes
``||(mean M - P Q^T) Omega|| / ||mean M Omega||``. Since ``E ||X Omega||^2 = k ||X||^2``, each squared norm is
unbiased with relative standard error ``sqrt(2 / (k s))``, s the stable rank ``||X||_F^4 / ||X^T X||_F^2`` of
the matrix sketched (1 <= s <= min(n, m); about n for n rows of spread-out, unrelated energy): at most
35% (s = 1), a few percent for the spread-out residuals of large matrices, about half that on the norm.
It is exactly 0 when P Q^T equals the mean (full rank), and a new Omega is drawn at every measurement,
so measurements along a run average out.

The approximation error costs two norms per compressed matrix, taken on the device from tensors the
step holds anyway, on the steps chosen by ``approximation_error_every_n_iters``; the global residual
costs the sketch (``M Omega``, k/r times the cost of ``P = M Q``) and its all-reduce, on the steps chosen
by ``global_residual_every_n_iters`` (``PowerSGDState``; ``Config`` for the aggregator). Nothing is read
on the host until you ask for the numbers:

>>> import torch, gradpress
>>> layer = torch.nn.Linear(64, 32)
>>> powersgd = gradpress.PowerSGD(layer.named_parameters(), gradpress.Config(
...     rank=8, num_iters_per_step=None, start_compressing_after_num_steps=0,
...     approximation_error_every_n_iters=1, global_residual_every_n_iters=1))
>>> layer(torch.randn(8, 64)).square().sum().backward()
>>> powersgd.aggregate_([p.grad for p in layer.parameters()])
>>> list(powersgd.approximation_error())            # by name: the bias is sent exactly
['weight']
>>> round(powersgd.approximation_error()["weight"], 4)   # a rank-8 gradient at rank 8: exact
0.0
>>> s = powersgd.approximation_error_summary(); (s.parameters, s.worst_name)
(1, 'weight')
>>> round(powersgd.global_residual()["weight"], 4), round(powersgd.captured_energy()["weight"], 4)
(0.0, 1.0)
>>> round(powersgd.global_residual_summary().captured_energy, 4)
1.0

With TensorBoard: ``log_approximation_error(writer, state, step)`` after the optimizer step (it writes
both diagnostics).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from torch import Tensor, nn

__all__ = ["ApproximationSummary", "approximation_error_metrics", "captured_energies", "check_measure_every",
           "log_approximation_error", "named_pairs", "parameter_names", "relative_errors", "should_measure",
           "summarize"]

#: A parameter's key in a table of norms: the engine's per-parameter key, or a bucket memory's name.
K = TypeVar("K", int, str)

@dataclass(frozen=True)
class ApproximationSummary:
    """The approximation errors of the compressed parameters at their last measurement: one worker's
    (``approximation_error_summary()``, M its own matrix) or the global residuals
    (``global_residual_summary()``, M the workers' mean, sketched).

    ``overall``: ``sqrt(sum ||M - P Q^T||^2 / sum ||M||^2)`` over the parameters (the error of the whole
    compressed gradient, weighted by size); ``worst`` and ``worst_name``: the largest relative error and
    its parameter; ``mean``: the unweighted mean of the relative errors; ``parameters``: how many were
    measured; :attr:`captured_energy`: ``1 - overall^2``.
    """

    overall: float
    mean: float
    worst: float
    worst_name: str
    parameters: int

    @property
    def captured_energy(self) -> float:
        """``1 - overall^2``: the share of ``sum ||M||^2`` that ``P Q^T`` captures (for the global residual:
        of the averaged gradient's energy)."""
        return 1.0 - self.overall * self.overall


def check_measure_every(every: object, name: str = "approximation_error_every_n_iters") -> None:
    """``ValueError`` naming ``name`` unless ``every`` is ``None`` (never measure) or an integer >= 1."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"{name} must be None (never measure) or an integer >= 1, got {every!r}")


def should_measure(every: int | None, compressed_step: int) -> bool:
    """Whether compressed step ``compressed_step`` (0: the first) measures, every ``every`` steps."""
    return every is not None and compressed_step >= 0 and compressed_step % every == 0


def relative_errors(norms: Mapping[K, tuple[float, float]], name_of: Callable[[K], str]) -> dict[str, float]:
    """``{name: ||M - P Q^T|| / ||M||}`` from ``{key: (||M||, ||M - P Q^T||)}``; 0 where M is zero."""
    return {name_of(key): (residual / whole if whole > 0 else 0.0) for key, (whole, residual) in sorted(norms.items())}


def captured_energies(norms: Mapping[K, tuple[float, float]], name_of: Callable[[K], str]) -> dict[str, float]:
    """``{name: 1 - (residual / whole)^2}`` from ``{key: (whole, residual)}``: the share of each matrix's
    energy the approximation captures (1 where the matrix is zero)."""
    return {name: 1.0 - error * error for name, error in relative_errors(norms, name_of).items()}


def summarize(norms: Mapping[K, tuple[float, float]], name_of: Callable[[K], str]) -> ApproximationSummary | None:
    """The :class:`ApproximationSummary` of ``{key: (||M||, ||M - P Q^T||)}``; ``None`` if empty."""
    if not norms:
        return None
    errors = relative_errors(norms, name_of)
    worst_name = max(errors, key=lambda name: errors[name])
    whole = sum(w * w for w, _ in norms.values())
    residual = sum(r * r for _, r in norms.values())
    return ApproximationSummary(overall=math.sqrt(residual / whole) if whole > 0 else 0.0,
                                mean=sum(errors.values()) / len(errors), worst=errors[worst_name],
                                worst_name=worst_name, parameters=len(errors))


def named_pairs(module: nn.Module | Iterable[tuple[str, Tensor]], owner: str) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` pairs of a module (a DDP/FSDP wrapper's ``module.`` prefix is dropped), or the
    pairs given, such as ``model.named_parameters()``; ``TypeError`` naming ``owner`` otherwise."""
    if isinstance(module, nn.Module):
        inner = getattr(module, "module", module)
        return list((inner if isinstance(inner, nn.Module) else module).named_parameters())
    pairs = list(module)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], Tensor)):
            raise TypeError(f"{owner}.name_parameters takes an nn.Module or (name, parameter) pairs such as "
                            f"model.named_parameters(), got an item {type(pair).__name__}")
    return pairs


def parameter_names(module: nn.Module | Iterable[tuple[str, Tensor]], owner: str) -> dict[int, str]:
    """``{id(parameter): name}`` for :func:`named_pairs`."""
    return {id(param): name for name, param in named_pairs(module, owner)}


class _Measured(Protocol):
    def approximation_error(self) -> dict[str, float]: ...

    def approximation_error_summary(self) -> ApproximationSummary | None: ...

    def global_residual(self) -> dict[str, float]: ...

    def global_residual_summary(self) -> ApproximationSummary | None: ...


class _ScalarWriter(Protocol):
    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


def approximation_error_metrics(source: _Measured, tag: str = "powersgd/approximation_error",
                                global_tag: str = "powersgd/global_residual") -> dict[str, float]:
    """``{f"{tag}/<parameter>": error, f"{tag}/overall": ..., f"{tag}/worst": ...}`` for ``source`` (a
    ``PowerSGDState`` or ``PowerSGD`` aggregator), and the same for the global residuals under
    ``global_tag`` plus ``f"{global_tag}/captured_energy"`` (``1 - overall^2``): what a logger takes (empty
    before the first measurement). Reads the values on the host."""
    metrics: dict[str, float] = {}
    for prefix, values, summary in ((tag, source.approximation_error(), source.approximation_error_summary()),
                                    (global_tag, source.global_residual(), source.global_residual_summary())):
        metrics.update({f"{prefix}/{name}": value for name, value in values.items()})
        if summary is not None:
            metrics[f"{prefix}/overall"] = summary.overall
            metrics[f"{prefix}/worst"] = summary.worst
            if prefix == global_tag:
                metrics[f"{prefix}/captured_energy"] = summary.captured_energy
    return metrics


def log_approximation_error(writer: _ScalarWriter, source: _Measured, step: int,
                            tag: str = "powersgd/approximation_error",
                            global_tag: str = "powersgd/global_residual") -> dict[str, float]:
    """Write ``source``'s approximation errors (a ``PowerSGDState`` or ``PowerSGD`` aggregator) to a
    TensorBoard ``SummaryWriter`` (or anything with ``add_scalar(tag, value, step)``): one scalar per
    parameter under ``tag/<name>`` and the summary under ``tag/overall`` and ``tag/worst``, and the
    global residuals likewise under ``global_tag`` with ``global_tag/captured_energy``
    (:func:`approximation_error_metrics`). Returns what it wrote (nothing before the first
    measurement). Reads the values on the host: call it on the steps you measure, e.g.::

        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter()
        ...
        if step % 100 == 0:
            gradpress.log_approximation_error(writer, state, step)
    """
    written = approximation_error_metrics(source, tag, global_tag)
    for name, value in written.items():
        writer.add_scalar(name, value, step)
    return written
