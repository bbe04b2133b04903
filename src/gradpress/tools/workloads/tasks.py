"""The demo's tasks: real data that ships with an installed package or with Python, and a model each.

Nothing is downloaded.

* ``digits``: scikit-learn's handwritten digits (1,797 scanned 8x8 images, 10 classes; the UCI "Optical
  Recognition of Handwritten Digits" test set), a fixed seeded split of 1,497 train / 300 test images,
  and a small CNN (:class:`DigitsCNN`). Metric: test accuracy.
* ``charlm``: a character-level language model (:class:`CharLSTM`) on the English text of Python's own
  documentation topics (``pydoc_data.topics``, ~465,000 characters, shipped with CPython). The last
  10% of the text is held out. Metric: held-out perplexity per character. ``charlm-wide``: the same
  with 512 hidden units.
* ``gpt``: the same text, windows and metric with a small decoder-only transformer (:func:`char_gpt`:
  4 layers, width 128, 4 heads, context 64, output head tied to the token embedding; 813,952 parameters).
  ``gpt-wide``: width 256 and 8 heads (3,200,768 parameters, 12.8 MB of fp32 gradients per step), a model
  whose gradients take longer to send on a 100 Mbit/s link than to compute.
* ``gpt-stdlib``, ``gpt-wide-stdlib``: the same models on a corpus large enough to be seen about once,
  as in pre-training: the source of Python's own standard library (every ``.py`` file under
  ``sysconfig``'s ``stdlib`` path, tests included: ~31 million characters on CPython 3.11, ~480,000
  windows of 64). Files are split by a hash of their path, a tenth held out; the corpus depends on the
  Python version, so its description names the version, its size and a digest. 800 steps of 32
  workers' worth of 16 windows read 0.85 of it.

Some tasks carry the PowerSGD :class:`Recipe` the quality study measured on them (learning rate, rank,
wire precision); only ``gradpress demo`` applies it, and ``Task.lr`` stays the task's own default.

>>> task = get_task("digits")                                 # doctest: +SKIP
>>> data = task.load(seed=0); model = task.model(seed=0)      # doctest: +SKIP
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import sys
import sysconfig
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from ..zoo import GPT2

__all__ = ["CHARSET", "SEQUENCE", "CharLSTM", "DigitsCNN", "TASKS", "WIDTH_FAMILY", "Recipe", "Task", "TaskData",
           "char_gpt", "get_task", "task_names"]


@dataclass
class TaskData:
    """Train and test tensors: inputs ``x`` and targets ``y`` (class indices or next characters)."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    description: str


class DigitsCNN(nn.Module):
    """1x8x8 -> conv 16 -> conv 32 -> max-pool -> 128 -> 10 (five weight tensors PowerSGD can compress)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.conv1(x))
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class CharLSTM(nn.Module):
    """Character-level LSTM language model: embedding 64, one LSTM layer of 256, linear decoder."""

    def __init__(self, vocab: int, embedding: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embedding)
        self.lstm = nn.LSTM(embedding, hidden, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.decoder(out)  # (batch, sequence, vocab)


def char_gpt(n_layers: int = 4, d_model: int = 128, n_heads: int = 4) -> GPT2:
    """A character-level GPT over :data:`CHARSET` with a context of :data:`SEQUENCE` characters: the zoo's
    :class:`~gradpress.tools.zoo.GPT2` (token and learned position embeddings, pre-norm blocks with a fused qkv
    linear layer, causal ``scaled_dot_product_attention`` and a 4x GELU MLP, final layer norm, output head
    tied to the token embedding), at this size."""
    return GPT2(vocab_size=len(CHARSET), context=SEQUENCE, n_layers=n_layers, d_model=d_model, n_heads=n_heads)


def _load_digits(seed: int) -> TaskData:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise RuntimeError("the digits task needs scikit-learn (it ships the data): "
                           "pip install 'gradpress[demo]' or pip install scikit-learn") from exc
    bunch = load_digits()
    x = torch.tensor(bunch.images.tolist(), dtype=torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(bunch.target.tolist(), dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(40_000 + seed))
    test, train = order[:300], order[300:]
    return TaskData(x[train], y[train], x[test], y[test],
                    f"scikit-learn handwritten digits ({len(train)} train / {len(test)} test, 8x8)")


#: Characters the language model knows: newline and printable ASCII; everything else maps to index 0.
CHARSET = "\0\n" + "".join(chr(c) for c in range(32, 127))
SEQUENCE = 64


def _load_text() -> str:
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some minimal Python builds leave pydoc_data out
        raise RuntimeError("the charlm task reads Python's documentation topics (pydoc_data), which this "
                           "Python installation does not include") from exc
    return "\n\n".join(topics[key] for key in sorted(topics))


def _load_charlm(seed: int) -> TaskData:
    text = _load_text()
    lookup = {c: i for i, c in enumerate(CHARSET)}
    codes = torch.tensor([lookup.get(c, 0) for c in text], dtype=torch.long)
    split = int(len(codes) * 0.9)

    gen = torch.Generator().manual_seed(50_000 + seed)
    x_train, y_train = _windows(codes[:split], None, gen)
    x_test, y_test = _windows(codes[split:], 256, gen)  # a fixed sample of held-out windows
    return TaskData(x_train, y_train, x_test, y_test,
                    f"Python's documentation text (pydoc_data, {len(text):,} characters; "
                    f"{len(x_train)} train / {len(x_test)} held-out windows of {SEQUENCE})")


@functools.lru_cache(maxsize=1)
def _stdlib_codes() -> tuple[Tensor, Tensor, str]:
    """``(train codes, held-out codes, description)`` of the standard library's source (see the module
    docstring); characters outside :data:`CHARSET` map to code 0, as in ``charlm``. Cached: loaded once per
    process."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))
    if not files:
        raise RuntimeError(f"the stdlib tasks read Python's standard library source, and {root} holds no .py file")
    table = torch.zeros(256, dtype=torch.uint8)
    for i, c in enumerate(CHARSET):
        table[ord(c)] = i
    parts: tuple[list[bytes], list[bytes]] = ([], [])
    for path in files:
        rel = path.relative_to(root).as_posix()
        raw = path.read_bytes().decode("utf-8", "replace").encode("latin-1", "replace") + b"\n\n"
        parts[zlib.crc32(rel.encode()) % 10 == 0].append(raw)
    train, held = (b"".join(p) for p in parts)
    digest = hashlib.sha256(train + held).hexdigest()[:12]
    codes = [table[torch.frombuffer(bytearray(b), dtype=torch.uint8).long()] for b in (train, held)]
    description = (f"Python {sys.version_info.major}.{sys.version_info.minor}'s standard library source "
                   f"({len(files):,} files, {len(train) + len(held):,} characters, sha256 {digest})")
    return codes[0], codes[1], description


def _windows(part: Tensor, count: int | None, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Non-overlapping windows of :data:`SEQUENCE` characters of ``part`` and their next characters (all,
    or ``count`` drawn with ``gen``)."""
    n = (len(part) - 1) // SEQUENCE
    starts = torch.arange(n) * SEQUENCE
    if count is not None:
        starts = starts[torch.randperm(n, generator=gen)[:count]]
    chunk = part[starts[:, None] + torch.arange(SEQUENCE + 1)].long()
    return chunk[:, :-1], chunk[:, 1:]


def _load_stdlib(seed: int) -> TaskData:
    train, held, description = _stdlib_codes()
    gen = torch.Generator().manual_seed(50_000 + seed)
    x_train, y_train = _windows(train, None, gen)
    x_test, y_test = _windows(held, 256, gen)  # a fixed sample of held-out windows
    return TaskData(x_train, y_train, x_test, y_test,
                    f"{description}; {len(x_train)} train / {len(x_test)} held-out windows of {SEQUENCE}")


@dataclass(frozen=True)
class Recipe:
    """PowerSGD's measured recipe on a task (BENCHMARKS.md, "The recipe on the transformer, the wide LSTM,
    4 workers and a second seed"; docs/tuning.md): with SGD momentum 0.9, 800 steps and compression from
    10% of the run, ``lr`` is the learning rate at which allreduce ended best (where PowerSGD's was swept
    too, on the LSTMs, also PowerSGD's best); ``rank`` the PowerSGD rank and ``powersgd_options`` the
    further ``PowerSGDState`` arguments (``bytes_per_weight=2``: P, Q and the uncompressed tensors in fp16
    on the wire) that ended within 1.2% of allreduce's perplexity.

    ``gradpress demo`` uses it for the defaults the user does not give (``--lr``, ``--rank``,
    ``--powersgd-options``); nothing else does: :class:`Task` ``.lr`` and ``DemoConfig``'s defaults are
    the task's own, so the benchmarks' commands keep reproducing their numbers.
    """

    lr: float
    rank: int
    powersgd_options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:  # read-only, like the rest of the recipe
        object.__setattr__(self, "powersgd_options", MappingProxyType(dict(self.powersgd_options)))


#: fp16 on the wire: what every measured recipe sends.
_FP16_WIRE = {"bytes_per_weight": 2}


#: One model build at a time in a process (:meth:`Task.model`).
_BUILDING = threading.Lock()


@dataclass(frozen=True)
class Task:
    """A demo task: how to load its data, build its model, and score it.

    ``metric`` names the test score (``"accuracy"``: higher is better; ``"perplexity"``: lower is).
    ``evaluate(model, x, y)`` returns ``(loss sum, score numerator, count)`` over the batch so that sums
    across workers give the dataset's mean loss and score. ``lr`` and ``batch_size``: the defaults of
    every run. ``recipe``: PowerSGD's measured :class:`Recipe` on this task, which ``gradpress demo``
    applies (``None``: not measured).
    """

    name: str
    description: str
    metric: str
    load: Callable[[int], TaskData]
    build: Callable[[], nn.Module]
    lr: float
    batch_size: int
    recipe: Recipe | None = None

    def model(self, seed: int) -> nn.Module:
        """The model, initialised from ``seed`` only (the same on every worker and for every method). It
        seeds torch's process-wide generator, so builds take turns: replicas simulated as threads of one
        process (:mod:`.replicas`) would otherwise draw from each other's seeds."""
        with _BUILDING:
            state = torch.random.get_rng_state()
            try:
                torch.manual_seed(seed)
                return self.build()
            finally:
                torch.random.set_rng_state(state)

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """Mean cross-entropy of the batch."""
        out = model(x)
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def evaluate(self, model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float, float]:
        with torch.no_grad():
            out = model(x)
            out, target = out.reshape(-1, out.shape[-1]), y.reshape(-1)
            loss = float(nn.functional.cross_entropy(out, target, reduction="sum"))
            correct = float((out.argmax(dim=1) == target).sum())
        return loss, correct, float(target.numel())

    def score(self, loss_sum: float, correct: float, count: float) -> float:
        """The metric from summed :meth:`evaluate` results."""
        if self.metric == "accuracy":
            return correct / count
        return math.exp(loss_sum / count)


TASKS: dict[str, Task] = {
    "digits": Task("digits", "small CNN on scikit-learn's handwritten digits", "accuracy", _load_digits,
                   DigitsCNN, lr=0.05, batch_size=32),
    # lr 0.5 stays (the stored benchmarks ran with it): allreduce ends 3.8% worse there than at the recipe's 2.0.
    "charlm": Task("charlm", "character-level LSTM on Python's documentation text", "perplexity",
                   _load_charlm, lambda: CharLSTM(len(CHARSET)), lr=0.5, batch_size=16,
                   recipe=Recipe(lr=2.0, rank=22, powersgd_options=_FP16_WIRE)),
    # The same text with a 3.4x larger LSTM (1.23M parameters, 4.9 MB of fp32 gradients per step): a model
    # whose communication outweighs its compute on a 100 Mbit/s link (benchmarks/network/tta.py).
    "charlm-wide": Task("charlm-wide", "character-level LSTM with 512 hidden units (3.4x charlm's parameters) on "
                        "the same text", "perplexity", _load_charlm, lambda: CharLSTM(len(CHARSET), hidden=512),
                        lr=0.5, batch_size=16, recipe=Recipe(lr=1.0, rank=22, powersgd_options=_FP16_WIRE)),
    # A transformer on the same text. With the demo's SGD (momentum 0.9) and no warm-up or clipping it
    # wants a small lr: of 0.05/0.1/0.15/0.2/0.3 on 2 workers, 800 steps, 0.1 reached the lowest held-out
    # perplexity (5.7; 0.2 reached 9.7 and 0.3 diverged).
    "gpt": Task("gpt", "character-level GPT (4 layers, width 128, 4 heads) on the same text", "perplexity",
                _load_charlm, char_gpt, lr=0.1, batch_size=16,
                recipe=Recipe(lr=0.1, rank=16, powersgd_options=_FP16_WIRE)),
    "gpt-wide": Task("gpt-wide", "character-level GPT with width 256 and 8 heads (3.9x gpt's parameters) on the "
                     "same text", "perplexity", _load_charlm, lambda: char_gpt(d_model=256, n_heads=8),
                     lr=0.05, batch_size=16, recipe=Recipe(lr=0.05, rank=22, powersgd_options=_FP16_WIRE)),
    # The same models on a corpus seen about once (no recipe measured there yet).
    "gpt-stdlib": Task("gpt-stdlib", "character-level GPT (width 128) on Python's standard library source, seen "
                       "about once", "perplexity", _load_stdlib, char_gpt, lr=0.1, batch_size=16),
    "gpt-wide-stdlib": Task("gpt-wide-stdlib", "character-level GPT (width 256) on Python's standard library "
                            "source, seen about once", "perplexity", _load_stdlib,
                            lambda: char_gpt(d_model=256, n_heads=8), lr=0.05, batch_size=16),
}


#: The width axis: ``gpt-stdlib-w<width>`` is gpt-stdlib's GPT (4 layers, context 64) at any width that is a
#: multiple of 32 from 64 to 4096, with heads of 32 dimensions as gpt (128, 4 heads) and gpt-wide (256, 8);
#: ``gpt-stdlib-w<width>-l<layers>`` the same with 1 to 12 layers (a shallow wide model: ``-w768-l2``).
WIDTH_FAMILY = "gpt-stdlib-w<width>[-l<layers>]"
_WIDTH_TASK = re.compile(r"gpt-stdlib-w(\d+)(?:-l(\d+))?")


@functools.lru_cache(maxsize=None)
def _width_task(width: int, layers: int | None = None) -> Task:
    if width % 32 or not 64 <= width <= 4096:
        raise ValueError(f"task gpt-stdlib-w<width>: width must be a multiple of 32 from 64 to 4096, got {width}")
    if layers is not None and not 1 <= layers <= 12:
        raise ValueError(f"task gpt-stdlib-w<width>-l<layers>: layers must be from 1 to 12, got {layers}")
    name = f"gpt-stdlib-w{width}" + ("" if layers is None else f"-l{layers}")
    n_layers = 4 if layers is None else layers
    return Task(name, f"character-level GPT ({n_layers} layers, width {width}, {width // 32} heads) on "
                "Python's standard library source, seen about once", "perplexity", _load_stdlib,
                functools.partial(char_gpt, n_layers=n_layers, d_model=width, n_heads=width // 32), lr=0.1,
                batch_size=16)


def task_names() -> tuple[str, ...]:
    """The valid ``--task`` values (and any width of :data:`WIDTH_FAMILY`)."""
    return tuple(TASKS)


def get_task(name: str) -> Task:
    """The task called ``name`` (a :data:`TASKS` name or ``gpt-stdlib-w<width>``, e.g. ``gpt-stdlib-w384``);
    ``ValueError`` listing the valid names otherwise."""
    if name in TASKS:
        return TASKS[name]
    match = _WIDTH_TASK.fullmatch(name)
    if match:
        return _width_task(int(match.group(1)), None if match.group(2) is None else int(match.group(2)))
    raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}, or {WIDTH_FAMILY} "
                     "(a multiple of 32 from 64 to 4096)")
