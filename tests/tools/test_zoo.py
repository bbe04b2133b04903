"""``gradpress.tools.zoo``: parameter counts (published and by formula), tied weights, meta device, forward passes."""

from __future__ import annotations

import pytest
import torch

from gradpress.tools import zoo


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, expected", [
    ("resnet18-cifar", 11_173_962),  # the PowerSGD paper / kuangliu's pytorch-cifar ResNet18
    ("resnet50", 25_557_032),  # torchvision.models.resnet50()
    ("gpt2", 124_439_808),  # Hugging Face GPT2LMHeadModel("gpt2"), tied head counted once
    ("lstm-wikitext2", 31_819_578),
])
def test_parameter_counts(name: str, expected: int) -> None:
    model = zoo.build_model(name)
    assert count(model) == expected == zoo.PARAMETER_COUNTS[name]
    assert all(p.device.type == "meta" for p in model.parameters())


def test_counts_by_formula() -> None:
    d, vocab, context, layers = 768, 50257, 1024, 12
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert count(zoo.build_model("gpt2")) == vocab * d + context * d + layers * block + 2 * d
    size, vocab = 650, 33_278
    lstm_layer = 2 * (4 * size * size) + 2 * (4 * size)
    assert count(zoo.build_model("lstm-wikitext2")) == vocab * size + 3 * lstm_layer + vocab


def test_tied_weights_appear_once() -> None:
    gpt2 = zoo.build_model("gpt2")
    assert gpt2.lm_head.weight is gpt2.wte.weight
    assert [tuple(p.shape) for p in gpt2.parameters()].count((50257, 768)) == 1
    assert tuple(next(gpt2.blocks[0].attn_qkv.parameters()).shape) == (2304, 768)
    lstm = zoo.build_model("lstm-wikitext2")
    assert lstm.decoder.weight is lstm.encoder.weight


def test_names_and_registry() -> None:
    assert zoo.model_names() == list(zoo.MODELS) == list(zoo.PARAMETER_COUNTS)


def test_small_models_run_on_cpu() -> None:
    torch.manual_seed(0)
    gpt = zoo.GPT2(vocab_size=50, context=16, n_layers=2, d_model=32, n_heads=4)
    tokens = torch.randint(0, 50, (2, 10))
    logits = gpt(tokens)
    assert logits.shape == (2, 10, 50)
    # Causal: the first position's logits do not depend on later tokens.
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 50
    torch.testing.assert_close(gpt(changed)[:, :5], logits[:, :5])
    lstm = zoo.LSTMLanguageModel(vocab_size=40, size=16, layers=2)
    out, (h, c) = lstm(torch.randint(0, 40, (7, 3)))
    assert out.shape == (7, 3, 40) and h.shape == c.shape == (2, 3, 16)
    resnet = zoo.build_model("resnet18-cifar", device="cpu").eval()
    assert resnet(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_gpt2_initialisation_is_gpt2s() -> None:
    torch.manual_seed(0)
    layers = 3
    gpt = zoo.GPT2(vocab_size=500, context=64, n_layers=layers, d_model=96, n_heads=4)
    for weight in (gpt.wte.weight, gpt.wpe.weight, gpt.blocks[0].attn_qkv.weight, gpt.blocks[2].mlp_fc.weight):
        assert float(weight.std()) == pytest.approx(0.02, rel=0.1)
    residual = 0.02 / (2 * layers) ** 0.5  # the projections that add into the residual stream
    for block in gpt.blocks:
        assert float(block.attn_proj.weight.std()) == pytest.approx(residual, rel=0.1)
        assert float(block.mlp_proj.weight.std()) == pytest.approx(residual, rel=0.1)
        assert not block.attn_qkv.bias.any() and not block.mlp_proj.bias.any()
        assert torch.equal(block.ln_1.weight, torch.ones(96)) and not block.ln_1.bias.any()


@pytest.mark.parametrize("kwargs, message", [
    ({"d_model": 100, "n_heads": 8}, r"d_model \(100\) must be a multiple of n_heads \(8\)"),
    ({"n_layers": 0}, "n_layers must be an integer >= 1, got 0"),
    ({"vocab_size": 2.5}, "vocab_size must be an integer >= 1, got 2.5"),
])
def test_gpt2_bad_sizes(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        zoo.GPT2(**{"vocab_size": 10, "context": 8, "n_layers": 1, "d_model": 16, "n_heads": 2, **kwargs})
