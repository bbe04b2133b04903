"""What one rank's link carries for a collective: the ring-equivalent byte model every byte figure of
gradpress reports beside the payload.

A rank hands a collective its *payload* (the bytes of its input buffer); how many bytes then cross its
link depends on the collective and on the world size ``W``. Counted as the ring algorithms move them
(the bus-bandwidth convention of nccl-tests), per rank:

* ``"allreduce"`` of ``S`` bytes: ``2 (W - 1) / W · S`` (a reduce-scatter, then an all-gather);
* ``"all-gather"`` of a ``P``-byte input (``S_total = W · P`` gathered): ``(W - 1) / W · S_total = (W - 1) · P``;
* ``"all-to-all"`` of an ``S``-byte input (``W`` equal pieces, one kept): ``(W - 1) / W · S``;
* ``"reduce-scatter"`` of an ``S``-byte input: ``(W - 1) / W · S``;
* ``"broadcast"`` of ``S`` bytes: ``S`` (a pipelined chain: every rank but the root receives it once);
* nothing at ``W = 1``.

So an all-gather of the same payload costs ``W / 2`` times an allreduce's bytes per rank: the
difference :mod:`gradpress.averaging.twoshot` exists for.

>>> link_bytes("allreduce", 1000, 4), link_bytes("all-gather", 1000, 4), link_bytes("all-to-all", 1000, 4)
(1500.0, 3000.0, 750.0)
>>> link_bytes("broadcast", 1000, 1)
0.0
"""

from __future__ import annotations

__all__ = ["COLLECTIVES", "link_bytes"]

#: The collectives :func:`link_bytes` knows, with the factor of the payload ``S`` each rank's link
#: carries at world size ``W``.
COLLECTIVES = ("allreduce", "all-gather", "all-to-all", "reduce-scatter", "broadcast")


def link_bytes(collective: str, payload: float, world: int) -> float:
    """Bytes one rank's link carries when it hands ``payload`` bytes to ``collective`` over ``world``
    ranks (see the module docstring; exact in float for integer payloads below 2^53 / W).
    ``ValueError`` naming the collectives for any other name, and for ``world < 1``."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an integer >= 1, got {world!r}")
    if world == 1:
        return 0.0
    if collective == "allreduce":
        return 2 * (world - 1) * payload / world
    if collective == "all-gather":
        return float((world - 1) * payload)
    if collective == "broadcast":
        return float(payload)
    return (world - 1) * payload / world
