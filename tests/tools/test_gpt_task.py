"""The demo's transformer tasks ``gpt`` and ``gpt-wide``: the model's contract (causal, shapes, tied head,
parameter count by the architecture's formula), its data, and training it with DDP and PowerSGD."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from distributed import run
from gradpress.tools.cli.main import main
from gradpress.tools.workloads.tasks import CHARSET, SEQUENCE, get_task, task_names

VOCAB = len(CHARSET)

# (task, layers, width, heads): the sizes the task descriptions promise.
SIZES = [("gpt", 4, 128, 4), ("gpt-wide", 4, 256, 8), ("gpt-stdlib-w384", 4, 384, 12),
         ("gpt-stdlib-w512", 4, 512, 16), ("gpt-stdlib-w768-l2", 2, 768, 24)]


def formula(vocab: int, context: int, layers: int, d: int) -> int:
    """Parameters of a GPT with a tied head, counted from its parts."""
    layer_norm = 2 * d  # weight and bias
    block = (2 * layer_norm + (d * 3 * d + 3 * d) + (d * d + d)  # two norms, fused qkv, attention projection
             + (d * 4 * d + 4 * d) + (4 * d * d + d))  # MLP up and down
    return vocab * d + context * d + layers * block + layer_norm  # embeddings, blocks, final norm; head: none


def build(name: str, device: str = "cpu") -> nn.Module:
    with torch.device(device):
        return get_task(name).model(seed=0)


@pytest.mark.parametrize("name, layers, d, heads", SIZES)
def test_parameter_count_is_the_architectures(name: str, layers: int, d: int, heads: int) -> None:
    model = build(name, "meta")
    assert sum(p.numel() for p in model.parameters()) == formula(VOCAB, SEQUENCE, layers, d)
    assert (len(model.blocks), model.wte.weight.shape[1], model.blocks[0].n_heads) == (layers, d, heads)
    assert model.wpe.weight.shape == (SEQUENCE, d)


def test_the_two_sizes() -> None:
    assert formula(VOCAB, SEQUENCE, 4, 128) == 813_952
    assert formula(VOCAB, SEQUENCE, 4, 256) == 3_200_768


@pytest.mark.parametrize("name", ["gpt", "gpt-wide"])
def test_head_is_the_token_embedding(name: str) -> None:
    model = build(name, "meta")
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes.count((VOCAB, model.wte.weight.shape[1])) == 1
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_forward_shape_and_causality() -> None:
    model = build("gpt").eval()
    tokens = torch.randint(0, VOCAB, (3, SEQUENCE), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (3, SEQUENCE, VOCAB) and logits.dtype == torch.float32
        for t in (0, 20, SEQUENCE - 2):
            changed = tokens.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % VOCAB
            after = model(changed)
            torch.testing.assert_close(after[:, : t + 1], logits[:, : t + 1], rtol=0, atol=0)
            # ... while the changed position and the ones after it do see the change.
            assert not torch.allclose(after[:, t + 1], logits[:, t + 1])
            assert not torch.allclose(after[:, -1], logits[:, -1])
        # Shorter inputs than the context work too (positions 0..length-1).
        assert model(tokens[:, :10]).shape == (3, 10, VOCAB)


@pytest.mark.parametrize("name", ["gpt", "gpt-wide"])
def test_initial_prediction_is_near_uniform(name: str) -> None:
    # GPT-2's small initialisation: the untrained model's held-out perplexity is of the order of the
    # vocabulary size, as an uninformed guess's. (Somewhat below it: through the tied head each position
    # slightly favours repeating its own character, and the text repeats spaces. PyTorch's default N(0, 1)
    # embedding, read through the tied head, would give logits of std sqrt(width) and a perplexity of
    # thousands.)
    task = get_task(name)
    data = task.load(0)
    loss, _, count = task.evaluate(task.model(seed=0), data.x_test, data.y_test)
    assert 0.5 * VOCAB < math.exp(loss / count) < 1.5 * VOCAB


def test_same_text_and_windows_as_charlm() -> None:
    gpt, charlm = get_task("gpt").load(0), get_task("charlm").load(0)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(gpt, field), getattr(charlm, field))
    assert gpt.x_train.shape[1] == SEQUENCE
    assert torch.equal(gpt.x_train[:, 1:], gpt.y_train[:, :-1])  # targets are the next characters
    assert {"gpt", "gpt-wide"} <= set(task_names())
    assert get_task("gpt").metric == get_task("gpt-wide").metric == "perplexity"


def test_models_differ_by_seed_and_repeat_with_it() -> None:
    task = get_task("gpt")
    a, b, c = task.model(seed=0), task.model(seed=0), task.model(seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.wte.weight, c.wte.weight)


def _train_ddp(rank: int, world_size: int, method: str, steps: int) -> dict:
    """``steps`` SGD steps of gpt on this rank's own batches under DDP with ``method``'s hook."""
    from torch.nn.parallel import DistributedDataParallel

    from gradpress import PowerSGDState, allreduce_hook, powerSGD_hook

    task = get_task("gpt")
    model = task.model(seed=0)
    ddp = DistributedDataParallel(model)
    if method == "allreduce":
        ddp.register_comm_hook(None, allreduce_hook)
    else:  # "powersgd:R"; R = 128 is full rank for every matrix of gpt (min(n, m) <= 128)
        rank_r = int(method.split(":")[1])
        state = PowerSGDState(None, matrix_approximation_rank=rank_r, start_powerSGD_iter=2,
                              min_compression_rate=0 if rank_r >= 128 else 2, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=task.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, SEQUENCE + 1), generator=gen)
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(ddp, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    tied = model.lm_head.weight is model.wte.weight
    return {"params": [p.detach().clone() for p in model.parameters()], "tied": tied, "losses": losses}


def test_ddp_with_powersgd_keeps_ranks_identical_and_the_head_tied() -> None:
    initial = [p.detach() for p in get_task("gpt").model(seed=0).parameters()]
    results = run(_train_ddp, 2, "powersgd:2", 5)
    for r in results:
        assert r["tied"] and all(torch.isfinite(p).all() for p in r["params"])
    for p, q in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(p, q)
    assert all(not torch.equal(p, q) for p, q in zip(results[0]["params"], initial))  # every tensor trained
    # Different data on the two ranks: their losses differ, their models do not.
    assert results[0]["losses"] != results[1]["losses"]


def test_full_rank_powersgd_matches_allreduce() -> None:
    # At full rank PowerSGD's approximation is exact, so it applies the same mean gradient as allreduce
    # (the shared embedding/head gradient included), up to rounding.
    exact = run(_train_ddp, 2, "allreduce", 4)
    full = run(_train_ddp, 2, "powersgd:128", 4)
    for p, q in zip(exact[0]["params"], full[0]["params"], strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_demo_trains_gpt_on_two_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--task", "gpt", "--workers", "2", "--steps", "6", "--start-iter", "2",
                 "--methods", "allreduce,powersgd:2", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["task"] == "gpt" and report["metric_name"] == "perplexity"
    for spec in ("allreduce", "powersgd:2"):
        entry = report["methods"][spec]
        assert entry["ranks_agree"]
        assert entry["numel"] == formula(VOCAB, SEQUENCE, 4, 128)  # the tied weight sent once
        assert entry["metric"] == pytest.approx(math.exp(entry["test_loss"]))
        assert entry["metric"] < entry["curve"][0]["metric"]  # six steps already lower the perplexity
    assert report["methods"]["powersgd:2"]["counted"]["ok"]


def test_the_stdlib_corpus_is_read_about_once_at_32_workers_worth_and_holds_out_whole_files() -> None:
    import sysconfig
    import zlib
    from pathlib import Path

    from gradpress.tools.workloads.tasks import CHARSET, _stdlib_codes

    data = get_task("gpt-stdlib").load(0)
    assert data.x_train.shape[1] == SEQUENCE and torch.equal(data.x_train[:, 1:], data.y_train[:, :-1])
    assert int(data.x_train.max()) < len(CHARSET) and len(data.x_test) == 256
    # 800 steps of 32 workers' worth of 16 windows do not repeat a window.
    assert 800 * 32 * 16 <= len(data.x_train)
    # The held-out part is whole files, none of them in the training part: the held-out text of one file
    # chosen by the path hash is found in the held-out codes and not in the training codes.
    root = Path(sysconfig.get_paths()["stdlib"])
    held = next(p for p in sorted(root.rglob("*.py"))
                if zlib.crc32(p.relative_to(root).as_posix().encode()) % 10 == 0 and p.stat().st_size > 8000)
    lookup = {c: i for i, c in enumerate(CHARSET)}
    probe = bytes(lookup.get(c, 0) for c in held.read_text("utf-8", "replace")[4000:4400])
    train, held_codes, description = _stdlib_codes()
    assert probe in held_codes.to(torch.uint8).numpy().tobytes()
    assert probe not in train.to(torch.uint8).numpy().tobytes()
    assert "standard library" in description and "sha256" in description
    assert get_task("gpt-wide-stdlib").model(seed=0).wte.weight.shape[1] == 256


def test_the_width_family_is_gpt_stdlib_at_any_width() -> None:
    # At 128 and 256 the family's model is gpt-stdlib's and gpt-wide-stdlib's, weight for weight.
    for width, named in ((128, "gpt-stdlib"), (256, "gpt-wide-stdlib")):
        ours, theirs = get_task(f"gpt-stdlib-w{width}").model(seed=3), get_task(named).model(seed=3)
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(),
                                                      strict=True))
    assert get_task("gpt-stdlib-w384").load is get_task("gpt-stdlib").load
    for bad in ("gpt-stdlib-w100", "gpt-stdlib-w32", "gpt-stdlib-w8192"):
        with pytest.raises(ValueError, match="multiple of 32 from 64 to 4096"):
            get_task(bad)
    with pytest.raises(ValueError, match=r"gpt-stdlib-w<width>"):
        get_task("gpt-stdlib-wide")
    # -l<layers>: the same model with another depth; -l4 is the family's own depth, weight for weight
    four, given = get_task("gpt-stdlib-w192").model(seed=1), get_task("gpt-stdlib-w192-l4").model(seed=1)
    assert all(torch.equal(a, b) for a, b in zip(four.state_dict().values(), given.state_dict().values(), strict=True))
    for bad in ("gpt-stdlib-w768-l0", "gpt-stdlib-w768-l13"):
        with pytest.raises(ValueError, match="layers must be from 1 to 12, got"):
            get_task(bad)
