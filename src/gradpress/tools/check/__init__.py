"""``gradpress check``'s logic: is gradpress correct here, how fast is the link, which method is fastest.

Modules: ``correctness`` (PASS/FAIL checks of the hooks against a plain allreduce), ``link`` (allreduce
bus bandwidth and latency), ``compute`` (the model, its step time, each hook's compute), ``advice``
(predicted step time per method, the recommendation), ``report`` (all of it as a dict and as text).

>>> from gradpress.tools.check import Link, candidate_methods, predict
>>> rows = predict(candidate_methods([(1024, 1024)]), Link(2, 1e-4, 12.5e6), step_ms=10.0)
>>> rows[-1].name
'allreduce'
"""

from .advice import Method, Prediction, candidate_methods, predict, recommend
from .correctness import DEFAULT_HOOKS, Item, run_correctness
from .link import Link, measure_link

__all__ = ["DEFAULT_HOOKS", "Item", "Link", "Method", "Prediction", "candidate_methods", "measure_link", "predict",
           "recommend", "run_correctness"]
