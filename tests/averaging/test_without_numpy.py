"""The averagers need no numpy: gradpress declares only ``torch``, whose CPU wheel does not bring numpy, and
``torch.distributed``'s object collectives (``all_gather_object`` and friends) read their bytes back through
``Tensor.numpy()``. Every averager on FSDP2 islands, their checkpoints, ``average_parameters`` and
``post_localSGD_hook``'s default subgroup (the ranks of one machine) run

* in the shared gloo workers with every object collective and ``Tensor.numpy`` made to raise (so none is
  on these paths), on 4 ranks (2 islands x 2 shards);
* under torchrun in fresh interpreters where ``import numpy`` fails before torch is imported (slow)."""

from __future__ import annotations

import inspect
import os
import sys
import textwrap
from pathlib import Path

import pytest

from distributed import run
from torchrun import torchrun


def averagers_on_islands(rank: int, world: int) -> str:
    """Every averager over a (2 islands x world/2 shards) mesh for a few steps, with a state_dict round trip;
    HierarchicalModelAverager with a group that leaves ranks out. Self-contained (its source runs under
    torchrun too)."""
    from collections import OrderedDict

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradpress import (HierarchicalModelAverager, OuterOptimizerAverager, PeriodicModelAverager,
                           PostLocalSGDOptimizer, QuantizeInt4, QuantizeInt8, StreamingDiLoCoAverager,
                           average_parameters)

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("island", "shard"))
    island = mesh["island"].get_group()
    kinds = [lambda: PeriodicModelAverager(2, process_group=island),
             lambda: OuterOptimizerAverager(2, process_group=island, outer_momentum=0.5),
             lambda: OuterOptimizerAverager(2, warmup_steps=1, process_group=island,
                                            compression=QuantizeInt8(chunk_size=4)),
             lambda: StreamingDiLoCoAverager(4, process_group=island, num_fragments=2, fragment_sync_delay=1,
                                             compression=QuantizeInt4(chunk_size=4))]
    for make in kinds:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
        for unit in (model[0], model[2], model):
            fully_shard(unit, mesh=mesh["shard"])
        optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), make())
        for step in range(5):
            optimizer.zero_grad()
            x = torch.full((4, 5), float(rank + step), dtype=torch.float64)
            model(x).square().mean().backward()
            optimizer.step()
        optimizer.load_state_dict(optimizer.state_dict())
    average_parameters(model.parameters(), island)
    half = dist.new_group(list(range(world // 2)))
    try:  # built on every rank (new_group); the ranks outside the group are told so
        HierarchicalModelAverager(OrderedDict([(1, world // 2)]), process_group=half)
    except ValueError as error:
        assert "not in process_group" in str(error) and rank >= world // 2, error
    # post_localSGD_hook's default subgroup: the ranks of this machine, found by host name.
    from gradpress.hooks.post_local import node_subgroup

    machine = node_subgroup()
    assert dist.get_world_size(machine) == world  # one machine here
    return "ok"


def _raiser(name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{name} called: it needs numpy (Numpy is not available)")
    return refuse


def without_object_collectives(rank: int, world: int) -> str:
    import torch
    import torch.distributed as dist

    names = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
             "send_object_list", "recv_object_list")
    saved = {name: getattr(dist, name) for name in names}
    numpy = torch.Tensor.numpy
    try:
        for name in names:
            setattr(dist, name, _raiser(f"torch.distributed.{name}"))
        torch.Tensor.numpy = _raiser("Tensor.numpy")  # type: ignore[method-assign]
        return averagers_on_islands(rank, world)
    finally:
        for name, value in saved.items():
            setattr(dist, name, value)
        torch.Tensor.numpy = numpy  # type: ignore[method-assign]


def test_no_averager_path_calls_an_object_collective_or_numpy():
    assert run(without_object_collectives, 4) == ["ok"] * 4


BLOCK_NUMPY_THEN_RUN = """
import sys
sys.modules["numpy"] = None  # `import numpy` now raises ImportError, as in a venv without it
import os
import torch.distributed as dist
dist.init_process_group("gloo")
{source}
result = averagers_on_islands(dist.get_rank(), dist.get_world_size())
try:
    import numpy  # noqa: F401
    blocked = ""
except ImportError:
    blocked = "numpy blocked"
# One write per rank: the two workers share the pipe, and print's pieces are separate writes there.
sys.stdout.write(f"rank {{dist.get_rank()}} {{result}} {{blocked}}\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_averagers_run_where_numpy_cannot_be_imported():
    source = textwrap.dedent(inspect.getsource(averagers_on_islands))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
    proc = torchrun(["--no-python", sys.executable, "-c", BLOCK_NUMPY_THEN_RUN.format(source=source)],
                    timeout=300, nproc=2, env=env)
    assert proc.returncode == 0, "\n".join(line for line in proc.stderr.splitlines() if "Error" in line)[-4000:]
    assert proc.stdout.count("numpy blocked") == 2 and "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout, \
        proc.stdout
