"""``python -m pipeline``: the command line of ``pipeline.cli``."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
