"""``gradpress inspect``: the PowerSGD paper's ResNet-18 traffic, agreement with make_plan, user models, errors."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gradpress
from distributed import run as run_ranks
from gradpress.tools.check.loader import load_model
from gradpress.tools.cli.main import main
from gradpress.hooks.hierarchical import assign_shares
from gradpress.tools.zoo import build_model
from gradpress import QuantizeInt4

PAPER = ["--workers", "16", "--batch-size", "128", "--dataset-size", "50000"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def inspect_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def hand_count(shapes: list[tuple[int, ...]], rank: int) -> int:
    """Floats per step if every 2D+ tensor is compressed to (n + m) min(n, m, r) and vectors sent whole."""
    sent = 0
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        if len(shape) >= 2:
            n, m = shape[0], numel // shape[0]
            sent += (n + m) * min(n, m, rank)
        else:
            sent += numel
    return sent


@pytest.mark.parametrize("rank, paper_ratio", [(1, 243), (2, 136), (4, 72)])
@pytest.mark.parametrize("min_rate", ["2", "0"])
def test_resnet18_reproduces_the_powersgd_paper(capsys, rank: int, paper_ratio: int, min_rate: str) -> None:
    # Vogels et al. 2019, ResNet-18 on CIFAR-10, 16 workers x 128: SGD 1023 MB/epoch, rank 1/2/4 243x/136x/72x.
    report = inspect_json(capsys, "--model", "resnet18-cifar", "--rank", str(rank), "--min-compression-rate",
                          min_rate, *PAPER)
    totals = report["totals"]
    shapes = [tuple(layer["shape"]) for layer in report["layers"]]
    assert report["epoch"]["steps"] == 50_000 // (16 * 128) == 24
    assert totals["parameters"] == 11_173_962
    assert abs(totals["mib_per_epoch"]["allreduce"] - 1023) < 1
    assert totals["mib_per_epoch"]["allreduce"] == pytest.approx(11_173_962 * 4 * 24 / 2**20)
    assert all(layer["compressed"] for layer in report["layers"] if len(layer["shape"]) >= 2)
    sent = hand_count(shapes, rank)
    assert totals["floats_per_step"] == {"allreduce": 11_173_962, "powersgd": sent}
    assert sent == {1: 45_935, 2: 82_260, 4: 154_910}[rank]
    assert totals["compression_ratio"] == pytest.approx(11_173_962 / sent)
    assert totals["compression_ratio"] == pytest.approx(paper_ratio, rel=0.01)
    assert totals["mib_per_epoch"]["powersgd"] == pytest.approx(sent * 4 * 24 / 2**20)


def test_default_setting_of_resnet18_is_the_papers_and_text_shows_totals(capsys) -> None:
    code, out, err = run(capsys, "--model", "resnet18-cifar", "--rank", "2")
    assert code == 0 and err == ""
    assert "24 steps" in out and "16 workers x 128 per worker" in out
    totals = out[out.index("floats per step"):]
    assert "11,173,962" in totals and "82,260" in totals and "1,023.0" in totals and "135.8x" in totals
    for name, _ in build_model("resnet18-cifar").named_parameters():
        assert f" {name} " in out


@pytest.mark.parametrize("name", ["resnet18-cifar", "resnet50", "gpt2", "lstm-wikitext2"])
def test_rows_agree_with_make_plan(capsys, name: str) -> None:
    report = inspect_json(capsys, "--model", name, "--rank", "4", "--min-compression-rate", "3")
    named = list(build_model(name).named_parameters())
    plan = gradpress.make_plan([p.shape for _, p in named], 4, 3)
    assert [layer["name"] for layer in report["layers"]] == [n for n, _ in named]
    for layer, t in zip(report["layers"], plan.tensors, strict=True):
        assert (tuple(layer["shape"]), tuple(layer["matrix"]), layer["rank"], layer["numel"], layer["compressed"],
                layer["numel_sent"]) == (t.shape, t.matrix, t.rank, t.numel, t.compressed, t.numel_sent)
        if not t.compressed:
            assert layer["reason"] == ("vector" if len(t.shape) < 2 else "below min rate")
    totals = report["totals"]
    assert totals["floats_per_step"] == {"allreduce": plan.numel, "powersgd": plan.numel_sent}
    assert (totals["p_numel"], totals["q_numel"], totals["uncompressed_numel"]) == \
        (plan.p_numel, plan.q_numel, plan.uncompressed_numel)
    assert sum(layer["numel_sent"] for layer in report["layers"]) == plan.numel_sent


def test_below_min_rate_bytes_per_weight_and_custom_epoch(capsys) -> None:
    # At r=4 and rate 4, ResNet-18's classifier (10 x 512): (10 + 512) * 4 * 4 = 8352 > 5120, sent whole.
    report = inspect_json(capsys, "--model", "resnet18-cifar", "--rank", "4", "--min-compression-rate", "4",
                          "--bytes-per-weight", "2", "--workers", "4", "--batch-size", "100", "--dataset-size", "1000")
    fc = next(layer for layer in report["layers"] if layer["name"] == "fc.weight")
    assert (fc["compressed"], fc["reason"], fc["numel_sent"]) == (False, "below min rate", 5120)
    totals = report["totals"]
    sent = 154_910 - (10 + 512) * 4 + 5120
    assert totals["floats_per_step"]["powersgd"] == sent
    # allreduce sends the fp32 gradients; PowerSGD its floats in fp16.
    assert totals["bytes_per_step"] == {"allreduce": 4 * 11_173_962, "powersgd": 2 * sent}
    assert totals["compression_ratio"] == pytest.approx(2 * 11_173_962 / sent)
    assert totals["floats_compression_ratio"] == pytest.approx(11_173_962 / sent)
    assert (report["gradients"], report["wire"]) == ("fp32", "fp16")
    assert report["epoch"]["steps"] == 2
    assert totals["mib_per_epoch"]["powersgd"] == pytest.approx(2 * sent * 2 / 2**20)


def test_user_factory(capsys) -> None:
    report = inspect_json(capsys, "--model", "user_models:two_layer", "--rank", "2")
    # The frozen 64 x 64 layer is left out, as DDP leaves it out; (3 x 100) at r=2 is below rate 2.
    assert [(layer["name"], layer["compressed"], layer["numel_sent"]) for layer in report["layers"]] == \
        [("0.weight", True, (100 + 50) * 2), ("0.bias", False, 100), ("2.weight", False, 300)]
    assert report["totals"]["parameters"] == 5000 + 100 + 300
    assert report["epoch"]["workers"] == 16 and report["epoch"]["source"].startswith("generic")
    assert inspect_json(capsys, "--model", "user_models:Builders.wide", "--rank", "1")["totals"][
        "floats_per_step"]["powersgd"] == 1020 + 20


def test_user_factory_in_current_folder(capsys, monkeypatch, tmp_path) -> None:
    (tmp_path / "my_inspect_model.py").write_text("from torch import nn\n\ndef build():\n    return nn.Linear(8, 4)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert inspect_json(capsys, "--model", "my_inspect_model:build", "--rank", "1")["totals"]["parameters"] == 36


BAD_MODELS = [
    ("resnet19", "--model 'resnet19' is not a model name; give resnet18-cifar, resnet50, gpt2, lstm-wikitext2, "
                 "the demo's tasks digits, charlm, charlm-wide, gpt, gpt-wide, gpt-stdlib, gpt-wide-stdlib, or "
                 "module.path:function for your own model (returning an nn.Module or (nn.Module, example_batch))"),
    ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
    ("user_models:missing", "module 'user_models' has no attribute 'missing'"),
    ("user_models:NOT_CALLABLE", "'NOT_CALLABLE' is an object of type int, not a function"),
    ("user_models:not_a_module", "not_a_module() returned an object of type dict; expected an nn.Module or "
                                 "(nn.Module, example_batch)"),
    ("user_models:needs_arguments",
     "callable with no arguments, but needs_arguments() is missing a required argument: 'width'"),
    ("user_models:", "expected module.path:function"),
]


@pytest.mark.parametrize("model, message", BAD_MODELS)
def test_bad_models(capsys, model: str, message: str) -> None:
    code, out, err = run(capsys, "--model", model, "--rank", "1")
    assert code == 2 and out == ""
    assert err.startswith(f"gradpress inspect: error: --model {model!r}") and message in err
    assert err.count("\n") == 1


# --- the same --model values as gradpress check, through its loader --------------------------------------

def with_batch() -> tuple[nn.Module, torch.Tensor]:
    """The form gradpress check documents for a user's model: (module, example_batch)."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)), torch.randn(8, 32)


@pytest.mark.parametrize("model", ["test_cli_inspect:with_batch", "user_models:two_layer", "lstm-wikitext2", "gpt"])
def test_every_form_check_accepts_is_inspected(capsys, model: str) -> None:
    report = inspect_json(capsys, "--model", model, "--rank", "2", "--dataset-size", "100000")
    loaded, _, _ = load_model(model, torch.device("meta"), data=False)
    named = [(n, p) for n, p in loaded.named_parameters() if p.requires_grad]
    assert [(layer["name"], tuple(layer["shape"])) for layer in report["layers"]] == \
        [(n, tuple(p.shape)) for n, p in named]
    assert report["totals"]["parameters"] == sum(p.numel() for _, p in named)


@pytest.mark.parametrize("model", [model for model, _ in BAD_MODELS])
def test_check_and_inspect_refuse_a_model_with_the_same_words(capsys, model: str) -> None:
    assert main(["check", "--model", model]) == 2
    check_err = capsys.readouterr().err
    _, _, inspect_err = run(capsys, "--model", model, "--rank", "1")
    assert check_err.removeprefix("gradpress check: error: ") == inspect_err.removeprefix("gradpress inspect: error: ")
    assert check_err.startswith("gradpress check: error: --model ")


# --- the ratio is the state's: bytes_stats() of a real run ------------------------------------------------

def mixed() -> nn.Module:
    """At rank 3: two matrices compressed, one (3 x 30) below the min rate, two biases sent whole."""
    return nn.Sequential(nn.Linear(50, 100), nn.ReLU(), nn.Linear(100, 30), nn.ReLU(), nn.Linear(30, 3, bias=False))


def mixed_bf16() -> nn.Module:
    return mixed().to(torch.bfloat16)


def _powersgd_bytes(rank: int, world_size: int, factory: str, bytes_per_weight: int) -> tuple:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = {"mixed": mixed, "mixed_bf16": mixed_bf16}[factory]()
    dtype = next(model.parameters()).dtype
    net = DDP(model)
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=2,
                                    min_compression_rate=2, bytes_per_weight=bytes_per_weight)
    net.register_comm_hook(state, gradpress.powerSGD_hook)
    for _ in range(5):
        net.zero_grad()
        net(torch.randn(4, 50, dtype=dtype)).float().pow(2).mean().backward()
    return state.bytes_stats(), state.compression_stats()


@pytest.mark.parametrize("factory, bytes_per_weight, wire", [
    ("mixed", 2, "fp16"), ("mixed", 4, "fp32"), ("mixed_bf16", 2, "bf16"), ("mixed_bf16", 4, "fp32")])
def test_ratio_and_bytes_equal_bytes_stats_of_a_two_rank_run(capsys, factory: str, bytes_per_weight: int,
                                                             wire: str) -> None:
    report = inspect_json(capsys, "--model", f"test_cli_inspect:{factory}", "--rank", "3",
                          "--bytes-per-weight", str(bytes_per_weight))
    (rate, before, after), (numel_rate, _, _) = run_ranks(_powersgd_bytes, 2, factory, bytes_per_weight)[0]
    totals = report["totals"]
    steps = before // totals["bytes_per_step"]["allreduce"]  # the compressed steps the run counted
    assert steps >= 1 and before == steps * totals["bytes_per_step"]["allreduce"]
    assert after == steps * totals["bytes_per_step"]["powersgd"]
    assert totals["compression_ratio"] == pytest.approx(rate, rel=1e-12)
    assert totals["floats_compression_ratio"] == pytest.approx(numel_rate, rel=1e-12)
    assert report["wire"] == wire
    code, out, _ = run(capsys, "--model", f"test_cli_inspect:{factory}", "--rank", "3",
                       "--bytes-per-weight", str(bytes_per_weight))
    expected = "4 B/float" if wire == report["gradients"] == "fp32" else f"{report['gradients']} gradients, {wire} wire"
    assert code == 0 and f"bytes per step ({expected})" in out and f"{rate:,.1f}x" in out


@pytest.mark.parametrize("argv, message", [
    (["--rank", "0"], "argument --rank: must be an integer >= 1, got 0"),
    (["--rank", "two"], "argument --rank: must be an integer >= 1, got 'two'"),
    (["--rank", "1", "--min-compression-rate", "-1"], "argument --min-compression-rate: must be a number >= 0"),
    (["--rank", "1", "--min-compression-rate", "nan"], "argument --min-compression-rate: must be a number >= 0"),
    (["--rank", "1", "--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
    (["--rank", "1", "--batch-size", "-3"], "argument --batch-size: must be an integer >= 1"),
    (["--rank", "1", "--bytes-per-weight", "3"],
     "argument --bytes-per-weight: invalid choice: 3 (choose from 2, 4, 8)"),
    (["--rank", "1", "--dataset-size", "2047"], "--dataset-size 2047 is smaller than --workers x --batch-size = 2048"),
    ([], "the following arguments are required: --rank"),
])
def test_bad_arguments(capsys, argv: list[str], message: str) -> None:
    code, out, err = run(capsys, "--model", "resnet18-cifar", *argv)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_command_line_smoke(capsys) -> None:
    # In this process: ``python -m gradpress`` itself is started once, by tests/tools/test_cli_demo.py.
    code, out, err = run(capsys, "--model", "lstm-wikitext2", "--rank", "4")
    assert code == 0, err
    assert "31,819,578" in out and "67 steps" in out
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert "inspect" in usage and "bench" in usage


def test_docs_example_is_what_the_command_prints(capsys) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    (example,) = re.findall(r"```\n\$ gradpress inspect --model lstm-wikitext2 --rank 4\n(.*?)```", docs, re.S)
    code, out, _ = run(capsys, "--model", "lstm-wikitext2", "--rank", "4")
    assert code == 0 and out == example


# --- --workers-per-node: inter-node bytes, flat vs hierarchical_wrapper ---------------------------------

@pytest.mark.parametrize("model, workers, per_node, rank", [("resnet18-cifar", "4", 2, 1), ("gpt2", "16", 4, 2)])
def test_workers_per_node_splits_the_plan_with_the_wrappers_shares(capsys, model, workers, per_node, rank) -> None:
    report = inspect_json(capsys, "--model", model, "--rank", str(rank), "--workers", workers,
                          "--workers-per-node", str(per_node), "--bytes-per-weight", "2")
    h = report["hierarchical"]
    shapes = [tuple(layer["shape"]) for layer in report["layers"]]
    floats = report["totals"]["floats_per_step"]
    flat = {"allreduce": 4 * floats["allreduce"], "powersgd": 2 * floats["powersgd"]}  # fp32 gradients, fp16 wire
    assert (h["workers_per_node"], h["nodes"]) == (per_node, int(workers) // per_node)
    shares = assign_shares([layer["numel"] for layer in report["layers"]], per_node)
    assert [s["tensors"] for s in h["shares"]] == shares
    for share in h["shares"]:
        plan = gradpress.make_plan([shapes[i] for i in share["tensors"]], rank, 2)
        assert share["bytes_per_step"] == {"allreduce": 4 * plan.numel, "powersgd": 2 * plan.numel_sent}
    assert h["per_rank"]["flat"] == flat
    assert h["per_node"]["flat"] == {k: per_node * v for k, v in flat.items()}
    # Each node sends what ONE rank of the flat scheme sends: 1/L of the flat node's bytes.
    assert h["per_node"]["hierarchical"] == flat
    for k in flat:
        assert h["per_rank"]["hierarchical_busiest"][k] == max(s["bytes_per_step"][k] for s in h["shares"])
    # Balanced by size: the allreduce bytes of every share are within one tensor of 1/L.
    largest = max(layer["numel"] for layer in report["layers"]) * 4
    assert all(abs(s["bytes_per_step"]["allreduce"] - flat["allreduce"] / per_node) <= largest for s in h["shares"])


def test_workers_per_node_text_and_absent_by_default(capsys) -> None:
    code, out, err = run(capsys, "--model", "resnet18-cifar", "--rank", "1", "--workers", "4",
                         "--workers-per-node", "2")
    assert code == 0 and err == ""
    table = [" ".join(line.split()) for line in out[out.index("inter-node bytes per step"):].splitlines()]
    assert "flat: each rank 44,695,848 183,740" in table
    assert "flat: each node (2 ranks) 89,391,696 367,480" in table
    assert "hierarchical: each node 44,695,848 183,740" in table
    assert "hierarchical: local rank 0 (32 tensors) 22,348,032 89,236" in table
    assert "hierarchical: local rank 1 (30 tensors) 22,347,816 94,504" in table
    # On the link: flat 2 (4 - 1) / 4 of each rank's plan; hierarchical 2 (2 - 1) / 2 of the busiest share's.
    assert "on the link: flat, each rank (allreduce over 4 workers) 67,043,772 275,610" in table
    assert "on the link: hierarchical, busiest rank (its inter-node allreduce over 2 nodes) 22,348,032 94,504" in table
    assert "4 workers = 2 nodes x 2" in out
    assert "hierarchical" not in inspect_json(capsys, "--model", "resnet18-cifar", "--rank", "1")
    code, out, _ = run(capsys, "--model", "resnet18-cifar", "--rank", "1")
    assert "inter-node" not in out


@pytest.mark.parametrize("argv, message", [
    (["--workers-per-node", "0"], "argument --workers-per-node: must be an integer >= 1, got 0"),
    (["--workers-per-node", "3"], "--workers-per-node 3 does not divide --workers 16: nodes must be of equal size"),
    (["--workers", "6", "--workers-per-node", "4"], "--workers-per-node 4 does not divide --workers 6"),
    (["--workers-per-node", "16"], "--workers-per-node 16 puts all --workers 16 on one node: nothing crosses nodes"),
])
def test_bad_workers_per_node(capsys, argv: list[str], message: str) -> None:
    code, out, err = run(capsys, "--model", "resnet18-cifar", "--rank", "1", *argv)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_docs_workers_per_node_example_is_what_the_command_prints(capsys) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    (tail,) = re.findall(r"```\n\$ gradpress inspect --model resnet18-cifar --rank 1 --workers 4 --workers-per-node 2\n"
                         r"\.\.\.\n(.*?)```", docs, re.S)
    code, out, _ = run(capsys, "--model", "resnet18-cifar", "--rank", "1", "--workers", "4", "--workers-per-node", "2")
    assert code == 0 and out.endswith("\n" + tail)


def gpt_parameters(vocab: int, context: int, layers: int, d: int) -> int:
    """A GPT with a tied head: embeddings, blocks (two norms, qkv, projection, 4x MLP), final norm."""
    return vocab * d + context * d + layers * (4 * d + 3 * d * d + 3 * d + d * d + d + 8 * d * d + 5 * d) + 2 * d


@pytest.mark.parametrize("name, layers, d", [("gpt", 4, 128), ("gpt-wide", 4, 256)])
def test_demo_task_models(capsys, name: str, layers: int, d: int) -> None:
    from gradpress.tools.workloads.tasks import CHARSET, SEQUENCE, get_task

    report = inspect_json(capsys, "--model", name, "--rank", "4")
    named = list(get_task(name).model(seed=0).named_parameters())
    assert [layer["name"] for layer in report["layers"]] == [n for n, _ in named]
    assert "lm_head.weight" not in [layer["name"] for layer in report["layers"]]  # tied: the embedding's
    assert report["totals"]["parameters"] == gpt_parameters(len(CHARSET), SEQUENCE, layers, d)
    plan = gradpress.make_plan([p.shape for _, p in named], 4, 2)
    assert report["totals"]["floats_per_step"] == {"allreduce": plan.numel, "powersgd": plan.numel_sent}
    # The demo's setting: its default 4 workers, the task's batch and training windows.
    windows = len(get_task(name).load(0).y_train)
    assert (report["epoch"]["workers"], report["epoch"]["batch_size"], report["epoch"]["dataset_size"]) == \
        (4, 16, windows)
    assert report["epoch"]["steps"] == windows // 64
    assert f"gradpress demo --task {name}" in report["epoch"]["source"]


@pytest.mark.parametrize("name", ["digits", "charlm", "charlm-wide"])
def test_every_demo_task_is_a_model(capsys, name: str) -> None:
    from gradpress.tools.workloads.tasks import get_task

    report = inspect_json(capsys, "--model", name, "--rank", "1", "--dataset-size", "1000")
    assert report["totals"]["parameters"] == sum(p.numel() for p in get_task(name).model(seed=0).parameters())
    assert report["epoch"]["batch_size"] == get_task(name).batch_size


def test_demo_task_with_dataset_size_does_not_load_the_data(capsys, monkeypatch) -> None:
    import dataclasses

    from gradpress.tools.workloads import tasks

    def missing(seed: int) -> None:
        raise RuntimeError("the data's package is missing")

    monkeypatch.setitem(tasks.TASKS, "gpt", dataclasses.replace(tasks.TASKS["gpt"], load=missing))
    report = inspect_json(capsys, "--model", "gpt", "--rank", "1", "--dataset-size", "640")
    assert report["epoch"]["steps"] == 640 // (4 * 16)
    code, out, err = run(capsys, "--model", "gpt", "--rank", "1")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--model gpt: the data's package is missing; or give --dataset-size" in err


def test_link_bytes_at_the_given_world_size_and_at_8_64_512(capsys, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    report = inspect_json(capsys, "--model", "resnet18-cifar", "--rank", "1", "--world-size", "3")
    link, totals = report["link"], report["totals"]
    assert link["world_size"] == 3 and link["world_sizes"] == [3, 8, 64, 512]
    for i, world in enumerate(link["world_sizes"]):
        for method in ("allreduce", "powersgd"):  # both all-reduce their payload
            assert link["per_step"][method][i] == 2 * (world - 1) / world * totals["bytes_per_step"][method]
        sync = link["diloco_sync"]
        assert sync["exact"][i] == link["per_step"]["allreduce"][i]
        assert sync["int4 all-gather"][i] == (world - 1) * QuantizeInt4().payload_bytes(totals["parameters"])
        assert sync["int4 two-shot"][i] < sync["exact"][i] / 7 and sync["int8 two-shot"][i] < sync["exact"][i] / 3.5
    monkeypatch.setenv("WORLD_SIZE", "5")  # launched by torchrun: its world size
    assert inspect_json(capsys, "--model", "resnet18-cifar", "--rank", "1")["link"]["world_size"] == 5
    monkeypatch.delenv("WORLD_SIZE")
    assert inspect_json(capsys, "--model", "resnet18-cifar", "--rank", "1")["link"]["world_size"] == 16  # --workers
    code, out, _ = run(capsys, "--model", "resnet18-cifar", "--rank", "1", "--world-size", "3")
    assert code == 0 and "W = 3" in out and "W = 512" in out and "per DiLoCo sync: int4 two-shot" in out
