"""The ``gradpress`` command line (``gradpress --help``); entry point :func:`gradpress.tools.cli.main.main`."""

from .main import main

__all__ = ["main"]
