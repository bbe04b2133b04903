"""Explicit fragments must cover every averaged tensor. ``fragments=list(model.layers)`` leaves out what a GPT
holds outside its layers (embeddings, the final norm, the head): the refusal names that parameter and says
how to cover it, at construction; :func:`gradpress.streaming.model_fragments` covers the rest of the model,
each leftover tensor joining the fragment next to it in the model's order (the pattern of the docs' FSDP2
islands snippet, on a small GPT-shaped module)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run
from gradpress import PostLocalSGDOptimizer, StreamingDiLoCoAverager
from gradpress.streaming import model_fragments


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``layers``, a final norm and a head: a GPT's layout."""

    def __init__(self, vocab: int = 11, width: int = 8, depth: int = 3, context: int = 5) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, width)
        self.pos_embeddings = nn.Parameter(torch.randn(context, width) / 4)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.output = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens) + self.pos_embeddings[: tokens.shape[-1]]
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


@pytest.mark.parametrize("warmup", [0, 3])
def test_layers_alone_are_refused_at_construction_naming_the_parameter_and_the_fix(warmup):
    model = TinyGPT()
    averager = StreamingDiLoCoAverager(sync_every=6, warmup_steps=warmup, fragments=list(model.layers))
    with pytest.raises(ValueError) as named:
        PostLocalSGDOptimizer(torch.optim.AdamW(model.named_parameters()), averager)
    message = str(named.value)
    # The root's own parameter comes first in named_parameters(), then the embedding; the norm and head too.
    assert "averaged tensor 0 'pos_embeddings' (shape (5, 8)) is in none of the fragments" in message, message
    assert "nor are 4 more: tensors [1, 14, 15, 16]" in message, message
    assert "model_fragments(model, model.layers)" in message, message
    # Built from model.parameters(), the optimizer knows no names: the message says where to get them.
    averager = StreamingDiLoCoAverager(sync_every=6, warmup_steps=warmup, fragments=list(model.layers))
    with pytest.raises(ValueError, match=r"averaged tensor 0 \(shape \(5, 8\)\).*named_parameters\(\)"):
        PostLocalSGDOptimizer(torch.optim.AdamW(model.parameters()), averager)


def test_model_fragments_adds_every_other_tensor_to_the_fragment_next_to_it():
    model = TinyGPT()
    fragments = model_fragments(model, model.layers)
    ids = [{id(t) for t in fragment} for fragment in fragments]
    first = [model.tok_embeddings.weight, model.pos_embeddings, *model.layers[0].parameters()]
    last = [*model.layers[2].parameters(), *model.norm.parameters(), model.output.weight]
    assert len(fragments) == 3 and ids[0] == {id(t) for t in first} and ids[2] == {id(t) for t in last}
    assert ids[1] == {id(t) for t in model.layers[1].parameters()}
    assert set().union(*ids) >= {id(p) for p in model.parameters()}  # every parameter, once
    assert sum(map(len, ids)) == len(set().union(*ids))
    # Fragments given as generators (read once) and as one tensor, as the averager takes them.
    again = model_fragments(model, (layer.parameters() for layer in model.layers))
    assert [{id(t) for t in f} for f in again] == ids
    alone = model_fragments(model, [model.output.weight])
    assert {id(t) for t in alone[0]} == {id(p) for p in model.parameters()}
    with pytest.raises(ValueError, match=r"fragments\[1\] shares a tensor with fragments\[0\]"):
        model_fragments(model, [model.layers[0], model.layers[0].norm])
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        model_fragments(list(model.parameters()), model.layers)


def gpt_fragments(rank, world):
    """Outer lr 1, no momentum: each fragment's sync is the plain average of its tensors (the oracle)."""
    torch.manual_seed(0)
    model = TinyGPT()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_((rank + 1) * (i + 1) / 8)  # every rank elsewhere
    means = [p.detach() - (rank + 1) * (i + 1) / 8 + 1.5 * (i + 1) / 8 for i, p in enumerate(model.parameters())]
    rank0 = [m - 0.5 * (i + 1) / 8 for i, m in enumerate(means)]  # rank 0's start: every fragment's first anchor
    averager = StreamingDiLoCoAverager(sync_every=6, fragments=model_fragments(model, model.layers), outer_lr=1.0,
                                       outer_momentum=0.0)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.named_parameters(), lr=0.0), averager)
    synced, exported = [], []
    for step in range(6):
        optimizer.step()  # lr 0: only the averager moves the parameters
        synced.append([torch.allclose(p, m, atol=1e-6) for p, m in zip(model.parameters(), means)])
        # The export: each fragment's anchor, the mean once it synchronized, rank 0's start before.
        anchors = averager.anchor_state_dict(model)
        exported.append([torch.allclose(anchors[name], m if done else start, atol=1e-6) for (name, _), m, start, done
                         in zip(model.named_parameters(), means, rank0, synced[-1])])
    return synced, averager.fragment_layout, exported


def test_every_tensor_of_a_gpt_synchronizes_at_its_fragments_step():
    names = [n for n, _ in TinyGPT().named_parameters()]
    for synced, layout, exported in run(gpt_fragments, 2):
        assert all(all(step) for step in exported), exported
        fragment = dict(zip(names, layout))
        assert fragment["tok_embeddings.weight"] == fragment["pos_embeddings"] == fragment["layers.0.mlp.weight"] == 0
        assert fragment["norm.weight"] == fragment["output.weight"] == fragment["layers.2.mlp.bias"] == 2
        for step, offset in ((0, 0), (2, 1), (4, 2)):  # fragment f is sent and applied at step 2f
            assert [synced[step][i] for i, f in enumerate(layout) if f <= offset] == \
                [True] * sum(f <= offset for f in layout), (step, synced[step])
            assert not any(synced[step][i] for i, f in enumerate(layout) if f > offset), (step, synced[step])
