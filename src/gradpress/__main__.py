"""``python -m gradpress``: the same as the ``gradpress`` command."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
