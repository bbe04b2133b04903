"""The tools built on the library: the ``gradpress`` command line (``cli``: ``demo``, ``check``, ``inspect``,
``bench``), ``check``'s measurements and advice, the overhead harness (``bench``), the demo's tasks and
training loop (``workloads``), the model zoo (``zoo``) and local process helpers (``processes``).

Nothing in the library imports from here (``tests/package/test_structure.py`` enforces the layers).
"""
