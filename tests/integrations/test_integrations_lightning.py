"""Lightning: ``GradpressDDPStrategy`` on 2 CPU processes (gloo), with a real ``lightning.pytorch.Trainer``.

The Trainers run inside the shared worker group (``tests/distributed.py``): the process group already
exists, and ``LOCAL_RANK`` tells Lightning that the processes were launched outside it (as under
torchrun), so no Lightning run pays for starting processes.
"""

from __future__ import annotations

import functools
import io
import os
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import gradpress  # noqa: E402
from distributed import modules_imported_by, run, run_fresh  # noqa: E402
from gradpress.integrations.lightning import GradpressDDPStrategy, rank_file  # noqa: E402

# slow; and on one test worker, where the module's runs (fixtures below) are made once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lightning")]

STEPS_PER_EPOCH = 8  # 64 samples, 2 ranks, batch 4
START_ITER = 2  # PowerSGD compresses from the 3rd step
WARMUP, PERIOD = 3, 6  # averaging on steps 3, 9, 15: the last step averages, the end of epoch 1 does not


class TinyRegression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=generator)
    y = torch.tanh(x @ torch.randn(8, 4, generator=generator))
    return DataLoader(TensorDataset(x, y), batch_size=4)


def _strategy(kind: str, storage: str = "checkpoint") -> tuple[Any, Any]:
    """``(strategy, hook state)`` for a method; every call builds fresh state."""
    if kind == "allreduce":
        return GradpressDDPStrategy(), None
    if kind in ("powersgd", "fp16-powersgd", "lightning-ddp"):
        state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=START_ITER)
        if kind == "lightning-ddp":  # Lightning's own strategy: on CPU it drops the hook
            return pl.strategies.DDPStrategy(ddp_comm_state=state, ddp_comm_hook=gradpress.powerSGD_hook), state
        wrapper = gradpress.fp16_compress_wrapper if kind == "fp16-powersgd" else None
        return GradpressDDPStrategy(ddp_comm_state=state, ddp_comm_hook=gradpress.powerSGD_hook,
                                    ddp_comm_wrapper=wrapper, comm_state_storage=storage), state
    # Local SGD: synchronous for WARMUP steps, then no gradient communication at all.
    state = gradpress.PostLocalSGDState(None, None, start_localSGD_iter=WARMUP, post_local_gradient_allreduce=False)
    common = {"ddp_comm_state": state, "ddp_comm_hook": gradpress.post_localSGD_hook, "comm_state_storage": storage}
    if kind == "localsgd":
        return GradpressDDPStrategy(model_averaging_period=PERIOD, **common), state
    if kind == "hierarchical":  # a factory: the averager creates subgroups, so it is built in setup
        return GradpressDDPStrategy(model_averager=lambda: gradpress.HierarchicalModelAverager(
            OrderedDict([(2, 1), (PERIOD, 2)]), warmup_steps=WARMUP, count_from_warmup=True), **common), state
    assert kind == "diloco"
    averager = gradpress.OuterOptimizerAverager(
        period=PERIOD, warmup_steps=WARMUP, outer_lr=0.7, outer_momentum=0.9,
        compression=gradpress.Config(rank=1, min_compression_rate=0, start_compressing_after_num_steps=0))
    return GradpressDDPStrategy(model_averager=averager, **common), state


def _trainer(strategy: Any, epochs: int, **kwargs: Any) -> Any:
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def launched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a worker function as if a launcher had started the process (``LOCAL_RANK`` set: Lightning then
    uses the existing processes and process group), restoring the shared worker's environment after."""

    @functools.wraps(fn)
    def wrapper(rank: int, world: int, *args: Any) -> Any:
        saved = dict(os.environ)
        os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
        try:
            return fn(rank, world, *args)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    return wrapper


def _result(module: TinyRegression, strategy: Any, state: Any) -> dict[str, Any]:
    averager = getattr(strategy, "model_averager", None)
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "losses": module.losses,
        "iter": getattr(state, "iter", None),
        "stats": state.compression_stats() if isinstance(state, gradpress.PowerSGDState) else None,
        "averages": None if averager is None else averager.num_averages,
    }


@launched
def fit(rank: int, world: int, kind: str, epochs: int) -> dict[str, Any]:
    strategy, state = _strategy(kind)
    module = TinyRegression()
    _trainer(strategy, epochs).fit(module, _loader())
    return _result(module, strategy, state)


@launched
def fit_stop_resume(rank: int, world: int, kind: str, storage: str, directory: str) -> dict[str, Any]:
    """One epoch with a ModelCheckpoint every 3 steps, save, then a second epoch from the checkpoint."""
    path = str(Path(directory) / f"{kind}-{storage}.ckpt")
    strategy, _ = _strategy(kind, storage)
    keep_last = pl.callbacks.ModelCheckpoint(dirpath=directory, filename=f"{kind}-{{step}}", every_n_train_steps=3,
                                             save_top_k=1, monitor=None)
    first = _trainer(strategy, 1, callbacks=[keep_last], enable_checkpointing=True)
    stopped = TinyRegression()
    first.fit(stopped, _loader())
    first.save_checkpoint(path)
    dist.barrier()
    files = sorted(os.listdir(directory))
    strategy, state = _strategy(kind, storage)
    module = TinyRegression()  # the initial weights: the checkpoint must bring everything back
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(strategy, 2).fit(module, _loader(), ckpt_path=path)
    missing = [str(w.message) for w in caught if "holds no" in str(w.message) or "ignored" in str(w.message)]
    return {**_result(module, strategy, state), "files": files, "warnings": missing,
            "stopped": [p.detach().clone() for p in stopped.parameters()]}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    """Two epochs (16 steps) of every method, once per module."""
    return {kind: run(fit, 2, kind, 2, timeout=300)
            for kind in ("allreduce", "powersgd", "fp16-powersgd", "lightning-ddp", "localsgd", "hierarchical",
                         "diloco")}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["powersgd", "fp16-powersgd", "localsgd", "hierarchical", "diloco"])
def test_the_hook_and_averager_run_on_cpu_ranks_agree_and_the_loss_falls(runs, kind):
    baseline, results = runs["allreduce"], runs[kind]
    assert _same(results[0]["params"], results[1]["params"]), "ranks ended with different parameters"
    assert not _same(results[0]["params"], baseline[0]["params"]), "same result as plain allreduce: no hook ran"
    losses = results[0]["losses"]
    assert len(losses) == 2 * STEPS_PER_EPOCH
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])
    assert results[0]["iter"] == 2 * STEPS_PER_EPOCH  # the hook saw every step
    if kind in ("localsgd", "diloco"):
        assert results[0]["averages"] == 3  # steps 3, 9, 15
    if kind == "hierarchical":
        assert results[0]["averages"] == 7  # every 2nd step from step 3 (alone), steps 3, 9, 15 both ranks


@pytest.mark.parametrize("kind", ["powersgd", "fp16-powersgd"])
def test_compression_is_counted_as_the_plan_says(runs, kind):
    shapes = [p.shape for p in TinyRegression().parameters()]
    plan = gradpress.make_plan(shapes, 1, 2)
    compressed_steps = 2 * STEPS_PER_EPOCH - START_ITER
    rate, before, after = runs[kind][0]["stats"]
    assert (before, after) == (compressed_steps * plan.numel, compressed_steps * plan.numel_sent)
    assert rate > 1


def test_lightnings_own_ddp_strategy_drops_the_hook_on_cpu(runs):
    """The upstream defect this strategy fixes: same arguments, the hook never runs on CPU."""
    ours, theirs, plain = runs["powersgd"], runs["lightning-ddp"], runs["allreduce"]
    assert theirs[0]["iter"] == 0 and theirs[0]["stats"] == (0, 0, 0)
    assert _same(theirs[0]["params"], plain[0]["params"])
    assert ours[0]["iter"] == 2 * STEPS_PER_EPOCH


@pytest.mark.parametrize("kind, storage", [("powersgd", "checkpoint"), ("diloco", "per_rank_files")])
def test_stopping_and_resuming_from_the_checkpoint_equals_never_stopping(runs, tmp_path, kind, storage):
    resumed = run(fit_stop_resume, 2, kind, storage, str(tmp_path), timeout=300)
    straight = runs[kind]
    if kind == "diloco":  # stopped between two averages: each rank must get its own parameters back
        assert not _same(resumed[0]["stopped"], resumed[1]["stopped"])
    for rank in range(2):
        assert _same(resumed[rank]["params"], straight[rank]["params"]), f"rank {rank} differs after resuming"
        assert resumed[rank]["losses"] == straight[rank]["losses"][STEPS_PER_EPOCH:]
        assert resumed[rank]["iter"] == straight[rank]["iter"]
        assert resumed[rank]["stats"] == straight[rank]["stats"]
        assert resumed[rank]["averages"] == straight[rank]["averages"]
        assert resumed[rank]["warnings"] == []
    # ModelCheckpoint(save_top_k=1) kept the step-6 checkpoint only, and removed the step-3 side files too.
    files = resumed[0]["files"]
    sides = [f for f in files if ".gradpress-rank" in f]
    if storage == "per_rank_files":
        assert sorted(sides) == sorted(f"{name}.gradpress-rank{r}" for name in (f"{kind}-step=6.ckpt",
                                                                                 f"{kind}-{storage}.ckpt")
                                       for r in range(2))
    else:
        assert sides == []
    assert f"{kind}-step=3.ckpt" not in files and f"{kind}-step=6.ckpt" in files


def _own_entry(state: dict, rank: int) -> dict:
    """Rank ``rank``'s values in a ``PowerSGDState.state_dict()``, which holds that rank's entry only."""
    assert list(state["per_rank"]) == [f"rank_{rank}"]
    return torch.load(io.BytesIO(state["per_rank"][f"rank_{rank}"]), weights_only=True)


def test_checkpoint_holds_every_ranks_state(tmp_path):
    """Both storages: what the checkpoint file holds, and that the per-rank state differs by rank."""
    results = run(save_only, 2, str(tmp_path), timeout=300)
    single = torch.load(tmp_path / "checkpoint.ckpt", weights_only=True)["gradpress"]
    assert single["world_size"] == 2 and single["storage"] == "checkpoint" and len(single["ranks"]) == 2
    memories = [_own_entry(entry["comm_state"], rank)["memory"] for rank, entry in enumerate(single["ranks"])]
    assert memories[0].keys() == memories[1].keys() and memories[0]
    key = next(iter(memories[0]))
    assert not torch.equal(memories[0][key]["error"], memories[1][key]["error"])  # error memory is per rank
    header = torch.load(tmp_path / "per_rank_files.ckpt", weights_only=True)["gradpress"]
    assert header == {"version": 1, "world_size": 2, "storage": "per_rank_files"}
    for rank in range(2):
        side = torch.load(rank_file(tmp_path / "per_rank_files.ckpt", rank), weights_only=True)
        assert torch.equal(_own_entry(side["comm_state"], rank)["memory"][key]["error"], memories[rank][key]["error"])
    assert results[0] == results[1] == "ok"


@launched
def save_only(rank: int, world: int, directory: str) -> str:
    strategy, _ = _strategy("powersgd")
    trainer = _trainer(strategy, 1)
    trainer.fit(TinyRegression(), _loader())
    trainer.save_checkpoint(str(Path(directory) / "checkpoint.ckpt"))
    strategy._gradpress_storage = "per_rank_files"  # the same state, the other storage
    trainer.save_checkpoint(str(Path(directory) / "per_rank_files.ckpt"))
    dist.barrier()
    return "ok"


def test_resuming_with_another_world_size_is_a_clear_error(tmp_path):
    path = tmp_path / "four-ranks.ckpt"
    torch.save({"gradpress": {"version": 1, "world_size": 4, "storage": "checkpoint", "ranks": [{}] * 4}}, path)
    strategy, _ = _strategy("powersgd")
    with pytest.raises(ValueError, match="state of 4 ranks, but this run has 1"):
        strategy.load_checkpoint(path)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"ddp_comm_hook": "powerSGD_hook"}, TypeError, "ddp_comm_hook must be a callable"),
    ({"ddp_comm_hook": gradpress.powerSGD_hook, "ddp_comm_wrapper": 2}, TypeError, "ddp_comm_wrapper"),
    ({"ddp_comm_wrapper": gradpress.fp16_compress_wrapper}, ValueError, "without ddp_comm_hook"),
    ({"ddp_comm_state": object()}, ValueError, "without ddp_comm_hook"),
    ({"model_averager": 3}, TypeError, "model_averager must be a gradpress model averager"),
    ({"model_averager": gradpress.PeriodicModelAverager}, TypeError, "model_averager"),
    ({"model_averaging_period": 4}, ValueError, "model_averaging_period applies to post-local SGD only"),
    ({"ddp_comm_state": gradpress.PostLocalSGDState(None, None, 2), "ddp_comm_hook": gradpress.post_localSGD_hook,
      "model_averaging_period": 0}, ValueError, "model_averaging_period must be an integer >= 1"),
    ({"comm_state_storage": "s3"}, ValueError, "comm_state_storage must be one of"),
])
def test_bad_arguments_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradpressDDPStrategy(**kwargs)


def test_importing_gradpress_does_not_import_lightning():
    """In a process of its own that never imported the frameworks (forked from the tests' server, which
    imported torch and gradpress: no interpreter start and ``import torch`` of its own)."""
    frameworks = ["lightning", "pytorch_lightning", "accelerate", "transformers"]
    assert "lightning" in sys.modules  # here, it is
    (imported,) = run_fresh(modules_imported_by, 1, "import gradpress, gradpress.integrations; gradpress.PowerSGDState",
                            frameworks)
    assert imported == []


@launched
def fit_pytorch_lightning(rank: int, world: int) -> dict[str, Any]:
    """The same strategy built on the ``pytorch_lightning`` package, with that package's Trainer."""
    import pytorch_lightning

    from gradpress.integrations.pytorch_lightning import GradpressDDPStrategy as PLStrategy

    class Module(pytorch_lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=START_ITER)
    module = Module()
    pytorch_lightning.Trainer(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_progress_bar=False,
                              enable_model_summary=False, enable_checkpointing=False,
                              strategy=PLStrategy(ddp_comm_state=state, ddp_comm_hook=gradpress.powerSGD_hook)
                              ).fit(module, _loader())
    return {"params": [p.detach().clone() for p in module.parameters()], "iter": state.iter}


def test_the_pytorch_lightning_package_gets_the_same_strategy():
    pytest.importorskip("pytorch_lightning")
    results = run(fit_pytorch_lightning, 2, timeout=300)
    assert results[0]["iter"] == STEPS_PER_EPOCH
    assert _same(results[0]["params"], results[1]["params"])


def test_the_example_trains_on_two_processes_that_lightning_launches(tmp_path):
    """``examples/lightning_powersgd.py`` (the README's Lightning snippet): Lightning starts the 2nd process."""
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "lightning_powersgd.py"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(example), "--epochs", "2"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    first, last = (float(word) for word in lines[0].split() if word.replace(".", "").isdigit() and "." in word)
    assert last < 0.5 * first
    assert "PowerSGD: 64 iterations" in proc.stdout and "ranks identical: True" in proc.stdout


class _RecordingLogger(pl.loggers.logger.Logger):
    """A Lightning logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))


@launched
def fit_logging_errors(rank: int, world: int) -> dict[str, Any]:
    state = gradpress.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=START_ITER,
                                    approximation_error_every_n_iters=4)
    strategy = GradpressDDPStrategy(ddp_comm_state=state, ddp_comm_hook=gradpress.powerSGD_hook)
    logger = _RecordingLogger()
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=logger,
               enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False).fit(TinyRegression(), _loader())
    errors = [(step, {k: v for k, v in metrics.items() if k.startswith("powersgd/")})
              for step, metrics in logger.logged]
    return {"logged": [entry for entry in errors if entry[1]], "final": state.approximation_error()}


def test_the_strategy_logs_approximation_errors_by_name_after_each_measured_step():
    for rank, result in enumerate(run(fit_logging_errors, 2, timeout=300)):
        logged = result["logged"]
        # 8 steps, compression from iteration 2, every 4th compressed iteration: iterations 2 and 6, logged
        # at their optimizer steps (Lightning's global_step counts a step once it has returned). Every
        # rank hands its loggers its own values; Lightning's loggers write rank 0's.
        assert [step for step, _ in logged] == [2, 6], rank
        last = logged[-1][1]
        assert {"powersgd/approximation_error/net.0.weight", "powersgd/approximation_error/overall",
                "powersgd/approximation_error/worst"} <= set(last)
        assert last["powersgd/approximation_error/net.0.weight"] == result["final"]["net.0.weight"]


def test_the_name_users_guess_gives_gradpress_strategy_in_both_packages():
    from gradpress.integrations import lightning
    from gradpress.integrations.lightning import DDPStrategy

    assert DDPStrategy is GradpressDDPStrategy
    assert issubclass(DDPStrategy, pl.strategies.DDPStrategy) and DDPStrategy is not pl.strategies.DDPStrategy
    assert "DDPStrategy" in lightning.__all__
    old = pytest.importorskip("pytorch_lightning")
    from gradpress.integrations import pytorch_lightning

    assert pytorch_lightning.DDPStrategy is pytorch_lightning.GradpressDDPStrategy
    assert issubclass(pytorch_lightning.DDPStrategy, old.strategies.DDPStrategy)
