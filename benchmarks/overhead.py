"""Per-step overhead of PowerSGD comm hooks over plain allreduce: gradpress vs. PyTorch.

A thin wrapper: the benchmark lives in :mod:`gradpress.tools.bench.overhead` (method, variants, isolation and
memory accounting are described there) so that the installed ``gradpress bench`` command can run it.

    python benchmarks/overhead.py --models resnet18,resnet50 --ranks 1,2,4 --json out.json
    python benchmarks/overhead.py --help
"""

from __future__ import annotations

import sys

from gradpress.tools.bench.overhead import main

if __name__ == "__main__":
    sys.exit(main(prog="python benchmarks/overhead.py"))
