"""``python -m autotune.cli``: the ``autotune`` command."""

from .commands import main

main()
