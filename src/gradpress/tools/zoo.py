"""Built-in models, constructed by name, for looking at gradient shapes (``gradpress inspect``, benchmarks).

Plain ``torch.nn``, no downloads and no extra dependencies. :func:`build_model` builds on the meta device
by default, so even GPT-2 costs no memory: only the parameter shapes exist, which is all a compression
plan needs. The modules also run (``forward``) when built on a real device.

=================  ==============  =============================================================
name               parameters      model
=================  ==============  =============================================================
``resnet18-cifar``     11,173,962  ResNet-18, CIFAR variant (3x3 stride-1 stem, no max-pool, 10
                                   classes), as in the PowerSGD paper's CIFAR-10 experiments
``resnet50``           25,557,032  torchvision's ``resnet50()`` layout (ImageNet, 1000 classes)
``gpt2``              124,439,808  GPT-2 small: 12 layers, d=768, 12 heads, vocabulary 50,257,
                                   context 1024, LM head tied to the token embedding
``lstm-wikitext2``     31,819,578  the PowerSGD paper's language model: 3-layer LSTM, embedding
                                   and hidden size 650, tied input/output embedding, vocabulary
                                   33,278 (WikiText-2)
=================  ==============  =============================================================

Any other name of the form ``module.path:factory`` imports ``module.path`` and calls ``factory()``
(no arguments), which must return an ``nn.Module``.

>>> model = build_model("resnet18-cifar")
>>> sum(p.numel() for p in model.parameters()), next(model.parameters()).device.type
(11173962, 'meta')
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["GPT2", "MODELS", "PARAMETER_COUNTS", "BasicBlock", "Bottleneck", "LSTMLanguageModel", "ResNet",
           "build_model", "gpt2", "import_callable", "import_from_current_folder", "lstm_wikitext2", "model_names",
           "resnet18_cifar", "resnet50"]


# --- ResNet ---------------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    """1x1 - 3x3 - 1x1 convolutions with a residual connection, stride on the 3x3 (ResNet-50 v1.5)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes * 4:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes * 4))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """torchvision's ResNet layout; ``cifar=True``: 3x3 stride-1 stem and no max-pool."""

    def __init__(self, block: type[BasicBlock | Bottleneck], layers: Sequence[int], num_classes: int,
                 cifar: bool) -> None:
        super().__init__()
        self.inplanes = 64
        if cifar:
            self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._make_layer(block, 64, layers[0], 1)
        self.layer2 = self._make_layer(block, 128, layers[1], 2)
        self.layer3 = self._make_layer(block, 256, layers[2], 2)
        self.layer4 = self._make_layer(block, 512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def _make_layer(self, block: type[BasicBlock | Bottleneck], planes: int, blocks: int,
                    stride: int) -> nn.Sequential:
        layers = [block(self.inplanes, planes, stride)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_cifar() -> ResNet:
    """ResNet-18, CIFAR-10 variant: 11,173,962 parameters."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=10, cifar=True)


def resnet50() -> ResNet:
    """torchvision ``resnet50()``: 25,557,032 parameters."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=1000, cifar=False)


# --- GPT-2 ----------------------------------------------------------------------------------------

class GPT2Block(nn.Module):
    """Pre-norm transformer block. ``attn_qkv`` is GPT-2's ``c_attn``: q, k and v as ONE ``d x 3d`` linear
    layer, so PowerSGD sees a ``(3d, d)`` gradient matrix (HF's ``Conv1D`` stores it transposed, ``(d, 3d)``;
    ``(n + m) r`` is the same either way)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn_qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, d_model = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(d_model, dim=2)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(attn.transpose(1, 2).reshape(batch, length, d_model))
        return x + self.mlp_proj(nn.functional.gelu(self.mlp_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 (Radford et al. 2019); the LM head shares the token embedding's weight (one parameter).

    Parameters: ``vocab x d + context x d + n_layers x (12 d^2 + 13 d) + 2 d`` (per block: two layer norms
    ``4 d``, qkv ``3 d^2 + 3 d``, attention projection ``d^2 + d``, MLP ``8 d^2 + 5 d``; the head adds none).
    Initialised as GPT-2: weights and embeddings normal with std 0.02, the two projections that write into
    the residual stream with std ``0.02 / sqrt(2 n_layers)``, biases zero. (PyTorch's default ``N(0, 1)``
    embedding, read back through the tied head, would give logits of std ``sqrt(d)`` at the start.)
    """

    def __init__(self, vocab_size: int = 50257, context: int = 1024, n_layers: int = 12, d_model: int = 768,
                 n_heads: int = 12) -> None:
        super().__init__()
        for argument, value in (("vocab_size", vocab_size), ("context", context), ("n_layers", n_layers),
                                ("d_model", d_model), ("n_heads", n_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPT2: {argument} must be an integer >= 1, got {value!r}")
        if d_model % n_heads:
            raise ValueError(f"GPT2: d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(GPT2Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            assert isinstance(block, GPT2Block)
            nn.init.normal_(block.attn_proj.weight, std=0.02 / (2 * n_layers) ** 0.5)
            nn.init.normal_(block.mlp_proj.weight, std=0.02 / (2 * n_layers) ** 0.5)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(batch, length, vocab)`` for token ids ``(batch, length)``."""
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2() -> GPT2:
    """GPT-2 small: 124,439,808 parameters (the tied LM head counted once)."""
    return GPT2()


# --- LSTM language model --------------------------------------------------------------------------

class LSTMLanguageModel(nn.Module):
    """Embedding -> multi-layer LSTM -> linear decoder tied to the embedding (PyTorch's
    ``word_language_model`` example, as used by the PowerSGD paper's WikiText-2 experiments)."""

    def __init__(self, vocab_size: int = 33278, size: int = 650, layers: int = 3, dropout: float = 0.4) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab_size, size)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.LSTM(size, size, layers, dropout=dropout)
        self.decoder = nn.Linear(size, vocab_size)
        self.decoder.weight = self.encoder.weight

    def forward(self, tokens: Tensor, hidden: tuple[Tensor, Tensor] | None = None
                ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Logits ``(length, batch, vocab)`` and the new hidden state, for token ids ``(length, batch)``."""
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)), hidden


def lstm_wikitext2() -> LSTMLanguageModel:
    """3-layer LSTM, size 650, tied embedding, vocabulary 33,278: 31,819,578 parameters.

    Embedding ``33278 x 650`` = 21,630,700; per LSTM layer ``2 x (2600 x 650) + 2 x 2600`` = 3,385,200,
    three layers 10,155,600; decoder bias 33,278 (its weight is the embedding).
    """
    return LSTMLanguageModel()


# --- registry -------------------------------------------------------------------------------------

#: Built-in model factories by name.
MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet18-cifar": resnet18_cifar,
    "resnet50": resnet50,
    "gpt2": gpt2,
    "lstm-wikitext2": lstm_wikitext2,
}

#: Parameters of each built-in model (``sum(p.numel() for p in model.parameters())``, tied weights once).
PARAMETER_COUNTS: dict[str, int] = {
    "resnet18-cifar": 11_173_962,
    "resnet50": 25_557_032,
    "gpt2": 124_439_808,
    "lstm-wikitext2": 31_819_578,
}


def model_names() -> list[str]:
    """The built-in model names, in :data:`MODELS` order.

    >>> model_names()
    ['resnet18-cifar', 'resnet50', 'gpt2', 'lstm-wikitext2']
    """
    return list(MODELS)


def _valid_names() -> str:
    return ", ".join(MODELS) + ", or module.path:factory for your own model"


def _import_factory(name: str) -> Callable[[], object]:
    return import_callable(name, f"model {name!r}")


def import_callable(spec: str, prefix: str, kind: str = "factory",
                    not_callable: str = "not a callable factory") -> Callable[[], object]:
    """The callable ``module.path:attr`` names, checked to take no arguments; ``ValueError`` starting
    with ``prefix`` (e.g. ``"--model 'x:y'"``) and naming what is wrong otherwise. ``kind`` names the
    expected callable in the messages, ``not_callable`` ends the message for an object that is not one."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{prefix}: expected module.path:{kind}, e.g. mypackage.models:build")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{prefix}: cannot import module {module_name!r} ({exc})") from None
    factory: object = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"{prefix}: module {module_name!r} has no attribute {attribute!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"{prefix}: {attribute!r} is an object of type {type(factory).__name__}, {not_callable}")
    try:
        signature: inspect.Signature | None = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature; calling them will tell
        signature = None
    if signature is not None:
        try:
            signature.bind()
        except TypeError as exc:
            raise ValueError(f"{prefix}: the {kind} must be callable with no arguments, but "
                             f"{attribute}() is {exc}") from None
    return factory


def import_from_current_folder() -> None:
    """Make modules in the current folder importable for ``module.path:factory`` names, as ``python -m``
    does (the CLI is a console script, whose ``sys.path`` does not hold the current folder)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def build_model(name: str, device: torch.device | str = "meta") -> nn.Module:
    """Build the model called ``name`` on ``device`` (default ``"meta"``: shapes only, no memory).

    ``name`` is a key of :data:`MODELS` or ``module.path:factory``; the factory is called with no
    arguments under ``with torch.device(device)`` and must return an ``nn.Module``.
    Raises ``ValueError`` (one line, naming ``name``) for an unknown built-in name, a module that cannot be
    imported, a missing attribute, or a factory that does not return an ``nn.Module``.

    >>> build_model("gpt2").wte.weight.shape
    torch.Size([50257, 768])
    >>> build_model("resnet19")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown model 'resnet19'; choose from resnet18-cifar, resnet50, gpt2, lstm-wikitext2, or ...
    """
    if name in MODELS:
        factory: Callable[[], object] = MODELS[name]
    elif ":" in name:
        factory = _import_factory(name)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {_valid_names()}")
    with torch.device(device):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {name!r}: the factory returned an object of type {type(model).__name__}, "
                         "not a torch.nn.Module")
    return model
