"""``python -m gradpress``: the same as the ``gradpress`` command."""

import sys

from .tools.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
