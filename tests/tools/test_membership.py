"""The membership replay (gradpress.tools.workloads.membership) without torchft: a schedule with a failed
attempt, a replica that leaves and one that joins, replayed for threads of this process. Its agreement with
a real torchft run is tests/integrations/test_torchft.py's (bitwise, every committed sync)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import gradpress
from gradpress.tools.workloads.membership import Attempt, Departed, Membership, schedule_from_records

RECORDS = {  # (committed before, rank, world, committed): a and b throughout, c lost at 2, d in from 2
    "a": [(0, 0, 3, True), (1, 0, 3, True), (2, 0, 3, False), (2, 0, 3, True), (3, 0, 3, True)],
    "b": [(0, 1, 3, True), (1, 1, 3, True), (2, 1, 3, False), (2, 1, 3, True), (3, 1, 3, True)],
    "c": [(0, 2, 3, True), (1, 2, 3, True), (2, 2, 3, None)],
    "d": [(2, 2, 3, True), (3, 2, 3, True)],
}


def test_the_schedule_from_records_orders_attempts_and_refuses_disagreement():
    schedule = schedule_from_records(RECORDS)
    three = (0, 1, 2)
    assert schedule == [Attempt(0, ("a", "b", "c"), True, 3, three), Attempt(1, ("a", "b", "c"), True, 3, three),
                        Attempt(2, ("a", "b"), False, 3, (0, 1)), Attempt(2, ("a", "b", "d"), True, 3, three),
                        Attempt(3, ("a", "b", "d"), True, 3, three)]
    with pytest.raises(ValueError, match="disagrees"):
        schedule_from_records({"a": [(0, 0, 2, True)], "b": [(0, 0, 2, True)]})   # two rank 0s
    with pytest.raises(ValueError, match="every member"):
        Attempt(0, ("a",), True, 2)


def test_a_replay_keeps_every_member_on_the_same_global_state_and_heals_the_joiner():
    membership = Membership(schedule_from_records(RECORDS), timeout_s=60.0)
    after: dict[str, dict[int, list[torch.Tensor]]] = {name: {} for name in RECORDS}
    groups: dict[str, Any] = {}
    built = {}
    for name in RECORDS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 6))
        group = groups[name] = membership.group(name)
        averager = gradpress.StreamingDiLoCoAverager(sync_every=4, num_fragments=2, fragment_sync_delay=1,
                                                     fragment_phase="end", compression=gradpress.QuantizeInt4(),
                                                     sync_group=group)
        group.register("model", model)
        group.register("diloco", averager)
        averager.anchor_parameters(list(model.parameters()))
        built[name] = model, torch.optim.SGD(model.parameters(), lr=0.05), averager
    errors: list[BaseException] = []

    def replica(name: str) -> None:
        model, inner, averager = built[name]
        g = torch.Generator().manual_seed(ord(name))
        try:
            while True:
                x = torch.randn(8, 12, generator=g)
                nn.functional.mse_loss(model(x), torch.zeros(8, 6)).backward()
                inner.step()
                inner.zero_grad()
                try:
                    averager.average_parameters(model.parameters())
                except Departed:
                    return
                if groups[name].last_commit:
                    after[name][groups[name].committed()] = [t.clone() for f in averager.global_state_dict()
                                                             ["fragments"] for t in f["anchor"]]
                    groups[name].last_commit = None
        except BaseException as error:  # noqa: BLE001 - raised in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=replica, args=(name,), daemon=True) for name in RECORDS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and not any(thread.is_alive() for thread in threads), errors
    assert sorted(after["a"]) == [1, 2, 3, 4] and sorted(after["c"]) == [1, 2] and sorted(after["d"]) == [3, 4]
    for name in ("b", "c", "d"):
        for m, anchors in after[name].items():
            assert all(torch.equal(x, y) for x, y in zip(anchors, after["a"][m])), (name, m)
    assert groups["d"].healed_bytes and not groups["a"].healed_bytes
    assert [q[2] for q in groups["a"].quorums] == [3, 3, 3, 3, 3]
