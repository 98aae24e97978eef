"""Entry point: ``python -m autotune.workers.serve_probe [TRIAL_FILE]`` (see probe.py)."""

import sys

from .probe import main

if __name__ == "__main__":
    sys.exit(main())
