"""The demo's PowerSGD methods with the warm-up on the half-precision wire: what the loop counts."""

from __future__ import annotations

import torch

from distributed import run
from gradpress.tools.workloads import parse_methods, train
from gradpress.tools.workloads.config import DemoConfig
from gradpress.tools.workloads.methods import warm_up_wire


def _counted(rank: int, world_size: int) -> list[dict]:
    torch.manual_seed(0)
    out = []
    for options in ({"bytes_per_weight": 2}, {"bytes_per_weight": 2, "warm_up_bytes_per_weight": 2}):
        config = DemoConfig(task="digits", steps=6, start_iter=3, evals=1, powersgd_options=options)
        result = train(rank, world_size, parse_methods("powersgd:2", [])[0], config)
        out.append({**result["counted"], "checksum": result["checksum"]})
    return out


def test_the_loop_counts_the_half_precision_warm_up_apart_from_the_compressed_steps():
    first, second = run(_counted, 2)
    assert first == second
    exact, half = first
    assert exact["ok"] and half["ok"]  # what PowerSGDState counted equals the byte model, warm-up included
    assert exact["bytes_warm_up"] == 0 and exact["bytes_after"] == half["bytes_after"]
    config = DemoConfig(task="digits", steps=6, start_iter=3, powersgd_options={"warm_up_bytes_per_weight": 2})
    assert warm_up_wire(config) == torch.float16 and warm_up_wire(DemoConfig()) is None
    numel = exact["bytes_before"] // (4 * 3)  # fp32 gradients, 3 compressed steps counted before
    assert half["bytes_warm_up"] == 3 * 2 * numel  # 3 warm-up steps of 2-byte values
    assert half["bytes_before"] == 4 * numel * 6
    assert exact["checksum"] != half["checksum"]  # the warm-up's rounding shows in the weights
