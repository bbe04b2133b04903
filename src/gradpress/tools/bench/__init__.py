"""Benchmarks that ship with the package, so that ``gradpress bench`` works from an installed wheel.

``gradpress.tools.bench.overhead``: per-step overhead of gradpress's vs PyTorch's PowerSGD hook over plain
allreduce (``python -m gradpress.tools.bench.overhead --help``; ``benchmarks/overhead.py`` is a thin wrapper).
"""
