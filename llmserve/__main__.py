"""``python -m llmserve``: the ``llmserve`` command."""

import sys

from llmserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
