"""The local rendezvous the demo and the tests' worker groups meet at (``gradpress.tools.processes``)."""

import socket

import pytest

from distributed import run
from gradpress.tools.processes import serve_rendezvous


def test_the_rendezvous_port_is_held_for_as_long_as_the_store_lives() -> None:
    store = serve_rendezvous(2)
    port = store.port
    with socket.socket() as sock, pytest.raises(OSError):
        sock.bind(("127.0.0.1", port))  # taken: no other process can have it before the workers join
    del store
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # released with the store


def _world(rank: int, world: int) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def test_workers_that_join_the_rendezvous_form_one_group() -> None:
    assert run(_world, 2) == [(0, 2), (1, 2)]
