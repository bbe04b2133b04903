"""gradpress in ``pytorch_lightning`` (Lightning's older package name): :class:`GradpressDDPStrategy`.

The same strategy as :mod:`gradpress.integrations.lightning`, built on
``pytorch_lightning.strategies.DDPStrategy``; use the one that matches your imports (a strategy of one
package is not accepted by the other package's ``Trainer``)::

    import pytorch_lightning as pl
    from gradpress.integrations.pytorch_lightning import GradpressDDPStrategy

    strategy = GradpressDDPStrategy(ddp_comm_state=state, ddp_comm_hook=gradpress.powerSGD_hook)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy)
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.strategies import DDPStrategy as LightningDDPStrategy

from ._lightning_strategy import CHECKPOINT_KEY, GradpressStrategyMixin, rank_file

__all__ = ["CHECKPOINT_KEY", "DDPStrategy", "GradpressDDPStrategy", "rank_file"]


class GradpressDDPStrategy(GradpressStrategyMixin, LightningDDPStrategy):
    """``pytorch_lightning``'s ``DDPStrategy`` with gradpress's fixes: see
    :class:`gradpress.integrations.lightning.GradpressDDPStrategy` for the arguments and the example."""

    def __init__(self, *args: Any, model_averager: Any = None, comm_state_storage: str = "checkpoint",
                 **kwargs: Any) -> None:
        super().__init__(*args, model_averager=model_averager, comm_state_storage=comm_state_storage, **kwargs)


#: The name users of Lightning reach for: ``from gradpress.integrations.pytorch_lightning import DDPStrategy`` gives
#: gradpress's strategy (Lightning's own drops communication hooks on CPU ranks), never Lightning's.
DDPStrategy = GradpressDDPStrategy
