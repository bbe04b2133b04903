"""Adapters that plug gradpress's hooks and averagers into training frameworks.

Each submodule imports its framework when it is imported, never before: ``import gradpress`` and
``import gradpress.integrations`` import none of them. Install a framework with its extra
(``pip install "gradpress[lightning]"``, ``[accelerate]``, ``[transformers]``).

* :mod:`gradpress.integrations.lightning`: ``GradpressDDPStrategy``, a Lightning ``DDPStrategy`` that
  registers the hook on every device type (CPU/gloo too), runs any gradpress model averager after each
  optimizer step and keeps the hook's and averager's state in Lightning checkpoints
  (:mod:`gradpress.integrations.pytorch_lightning`: the same for the ``pytorch_lightning`` package).
* :mod:`gradpress.integrations.accelerate`: ``register_comm_hook(accelerator, model, state, hook)`` after
  ``accelerator.prepare``; ``save_state``/``load_state`` keep each process's hook state.
* :mod:`gradpress.integrations.transformers`: ``register_comm_hook(trainer, state, hook)`` for the
  transformers ``Trainer``: a ``TrainerCallback`` that registers the hook on the DDP model and keeps
  each process's hook state in the Trainer's checkpoints.
* :mod:`gradpress.integrations.torchft` (``pip install "gradpress[torchft]"``): ``FaultTolerantGroup``
  over a torchft ``Manager``, for PowerSGD and streaming DiLoCo across replica groups that come and go
  (``docs/torchft.md``).

Hook state (PowerSGD's error memory and warm-start factors) belongs to one process: every integration
saves it per rank and restores it on the rank that saved it (see each module for where it is stored).
"""

__all__: list[str] = []
