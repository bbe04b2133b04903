"""transformers ``Trainer``: ``register_comm_hook`` (a ``TrainerCallback``) on 2 CPU processes (gloo).

The Trainers run inside the shared worker group (``tests/distributed.py``) with the environment a
launcher sets: the Trainer sees a distributed run (``parallel_mode`` DISTRIBUTED) over the existing
process group and wraps the model in DDP through Accelerate (MULTI_CPU).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gradpress  # noqa: E402
from accelerate_launch import launched  # noqa: E402
from distributed import run  # noqa: E402
from torchrun import torchrun_script  # noqa: E402
from gradpress.integrations.transformers import GradpressCallback, register_comm_hook, state_file  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 8  # optimizer steps: 2 epochs of 4 (64 samples, 2 ranks, batch 4, accumulation 2)
START_ITER = 2


class TinyRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def _dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=generator)
    y = torch.tanh(x @ torch.randn(8, 4, generator=generator))
    return [{"x": x[i], "labels": y[i]} for i in range(64)]


@launched
def train(rank: int, world: int, method: str, output_dir: str, resume: str | None = None) -> dict[str, Any]:
    args = transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=0.05, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, use_cpu=True,
        save_strategy="steps", save_steps=4, report_to="none", logging_strategy="no", disable_tqdm=True,
        remove_unused_columns=False, seed=0, dataloader_num_workers=0)
    model = TinyRegressor()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset())
    state = None
    if method == "powersgd":
        state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=START_ITER)
        callback = register_comm_hook(trainer, state, gradpress.powerSGD_hook)
        assert isinstance(callback, GradpressCallback) and callback in trainer.callback_handler.callbacks
    output = trainer.train(resume_from_checkpoint=resume)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "loss": output.training_loss,
        "ddp": type(trainer.model_wrapped).__name__,
        "iter": getattr(state, "iter", None),
        "stats": None if state is None else state.compression_stats(),
    }


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_trainer_runs_the_hook_ranks_agree_and_resuming_is_exact(tmp_path):
    plain = run(train, 2, "allreduce", str(tmp_path / "plain"), timeout=300)
    ours = run(train, 2, "powersgd", str(tmp_path / "ours"), timeout=300)
    assert ours[0]["ddp"] == "DistributedDataParallel"
    assert _same(ours[0]["params"], ours[1]["params"]), "ranks ended with different parameters"
    assert not _same(ours[0]["params"], plain[0]["params"]), "same result as plain allreduce: the hook did not run"
    assert ours[0]["iter"] == STEPS  # 16 backward passes, one synchronizing per optimizer step
    plan = gradpress.make_plan([p.shape for p in TinyRegressor().parameters()], 1, 2)
    assert ours[0]["stats"][1:] == ((STEPS - START_ITER) * plan.numel, (STEPS - START_ITER) * plan.numel_sent)
    checkpoint = tmp_path / "ours" / "checkpoint-4"
    assert all(Path(state_file(checkpoint, rank)).exists() for rank in range(2))
    resumed = run(train, 2, "powersgd", str(tmp_path / "ours"), str(checkpoint), timeout=300)
    for rank in range(2):
        assert _same(resumed[rank]["params"], ours[rank]["params"]), f"rank {rank} differs after resuming"
        assert resumed[rank]["iter"] == ours[rank]["iter"] and resumed[rank]["stats"] == ours[rank]["stats"]


def test_bad_arguments_are_clear_errors(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = transformers.Trainer(model=TinyRegressor(), args=args, train_dataset=_dataset())
    with pytest.raises(TypeError, match="trainer must be a transformers.Trainer"):
        register_comm_hook(object(), None, gradpress.allreduce_hook)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hook must be a callable"):
        register_comm_hook(trainer, None, None)  # type: ignore[arg-type]


def test_the_example_runs_under_torchrun(tmp_path):
    """``examples/trainer_powersgd.py`` (the README's Trainer snippet) on 2 processes started by torchrun."""
    example = Path(__file__).resolve().parents[2] / "examples" / "trainer_powersgd.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = torchrun_script(example, ["--output-dir", str(tmp_path / "out"), "--steps", "20"], nproc=2, timeout=300,
                           env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PowerSGD: 20 iterations" in proc.stdout and "ranks identical: True" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoint-20").glob("gradpress_*")) == [
        "gradpress_comm_state_rank0.pt", "gradpress_comm_state_rank1.pt"]
