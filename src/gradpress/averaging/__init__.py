"""Local SGD: model averaging every few steps instead of gradient averaging every step.

Drop-in for ``torch.distributed.algorithms.model_averaging`` (same names, arguments and defaults), with
PyTorch's defects fixed, plus an outer optimizer (DiLoCo)::

    from gradpress import PostLocalSGDState, post_localSGD_hook, PeriodicModelAverager, PostLocalSGDOptimizer
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)
    model.register_comm_hook(state, post_localSGD_hook)          # synchronous SGD for 100 steps, then local
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      PeriodicModelAverager(period=4, warmup_steps=100))
    for x, y in loader:
        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()   # averages every 4th step

What differs from PyTorch (each has a test):

* averaging is **in place** (``param.copy_``): optimizers, EMA copies and anything else holding the
  parameter tensors see the averaged values (PyTorch rebinds ``param.data``);
* ``average_buffers=True`` (or passing a module) also averages floating-point buffers such as BatchNorm
  running statistics; integer buffers (``num_batches_tracked``) are left alone;
* parameters with ``requires_grad=False`` are skipped; the rest are averaged whether or not they have a
  ``.grad`` this step (PyTorch skips those with ``grad is None`` and lets them drift apart);
* one collective per (device, dtype), each in its own dtype: no silent upcast of fp16/bf16 parameters;
  the sum is taken of ``value / world_size`` so fp16 cannot overflow;
* no ``torch.cuda.synchronize()``.

Where PyTorch's behaviour is kept on purpose: a rank outside the group keeps its parameters;
:class:`HierarchicalModelAverager` counts its periods from step 0 (``count_from_warmup=True`` counts from
the end of warm-up, like :class:`PeriodicModelAverager`); a state without ``"step"`` loads with PyTorch's
warning and the step counter at 0.

Modules: ``tensors`` (what is averaged), ``averagers`` (periodic and hierarchical), ``outer`` (the
outer step, shared with :mod:`gradpress.streaming`, and the outer-optimizer averager), ``optimizer``
(the optimizer wrapper). The collectives themselves (:func:`~gradpress.comm.broadcast_parameters`,
:func:`~gradpress.comm.average_tensors_`) live in :mod:`gradpress.comm`.
"""

from .averagers import HierarchicalModelAverager, ModelAverager, PeriodicModelAverager
from .optimizer import PostLocalSGDOptimizer
from .outer import OuterOptimizerAverager, OuterStep
from .tensors import average_parameters

__all__ = ["HierarchicalModelAverager", "ModelAverager", "OuterOptimizerAverager", "OuterStep", "PeriodicModelAverager",
           "PostLocalSGDOptimizer", "average_parameters"]
