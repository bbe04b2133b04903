"""PowerSGD without DDP: an aggregator that works with any optimizer and any training loop.

The API of the PowerSGD authors' reference implementation (github.com/epfml/powersgd)::

    from gradpress import PowerSGD, Config, optimizer_step
    powersgd = PowerSGD(model.parameters(), config=Config(
        rank=1,                      # lower rank => more aggressive compression
        min_compression_rate=10,     # don't compress gradients with less compression
        num_iters_per_step=2,        # lower number => more aggressive compression
        start_compressing_after_num_steps=0,
    ))
    for x, y in loader:
        loss_fn(model(x), y).backward()
        optimizer_step(optimizer, powersgd)

It runs the same engine as :func:`gradpress.powerSGD_hook` (one
:meth:`gradpress.powersgd.EngineSession.run` per (device, dtype) group of gradients), averaging over
``torch.distributed``'s default group when it is initialised and over nothing (one worker) when it is
not. Unlike the reference, the error memory lives inside the aggregator, not in ``.grad``: the ordinary
loop (``zero_grad``, ``backward``, ``optimizer_step``) and the reference's loop (no ``zero_grad``) both
work, and so does gradient accumulation over several backward passes.

Modules: :mod:`~gradpress.aggregator.exact` (the :class:`Aggregator` interface, :class:`AllReduce`, what
both aggregators check and group), :mod:`~gradpress.aggregator.config` (:class:`Config`),
:mod:`~gradpress.aggregator.powersgd` (:class:`PowerSGD`, :func:`optimizer_step`).
"""

from .config import Config
from .exact import Aggregator, AllReduce
from .powersgd import PowerSGD, optimizer_step

__all__ = ["AllReduce", "Aggregator", "Config", "PowerSGD", "optimizer_step"]
