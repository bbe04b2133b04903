"""Streaming DiLoCo: outer steps one fragment of the model at a time, overlapped with inner steps, with
int8/int4/top-k compressed outer gradients and error feedback (:class:`StreamingDiLoCoAverager`)::

    from gradpress import PostLocalSGDOptimizer, StreamingDiLoCoAverager, QuantizeInt8
    averager = StreamingDiLoCoAverager(sync_every=64, num_fragments=4, fragment_sync_delay=4,
                                       fragment_update_alpha=0.5, compression=QuantizeInt8())
    optimizer = PostLocalSGDOptimizer(torch.optim.AdamW(model.parameters()), averager)
    for x, y in loader:   # every 16 steps a quarter of the model: sent, then applied 4 steps later
        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

Modules: ``fragments`` (split and schedule), ``averager`` (the rest). The payload codecs
(:mod:`gradpress.averaging.compress`) and the transports that send outer gradients
(:mod:`gradpress.averaging.transport`) live in :mod:`gradpress.averaging`, one layer down, since
:class:`gradpress.OuterOptimizerAverager` accepts them too; the package root exports the codecs.
"""

from .averager import StreamingDiLoCoAverager
from .fragments import fragment_offsets, model_fragments, split_by_size

__all__ = ["StreamingDiLoCoAverager", "fragment_offsets", "model_fragments", "split_by_size"]
