"""The command line's two consoles and the only ways it prints text it did not write.

Logs, progress and errors go to ``err`` (stderr), data to ``out`` (stdout), as ``ray job`` and
``optuna`` do. A line that quotes a spec, a probe, a path or a trial record is never read as rich
markup (they are full of brackets: ``[rank0]:``, ``[tp for x in ...]``, ``[/bold]``) and its
control, bidi and invisible characters are escapes (:func:`~autotune.spec.errors.escape_text`).
Apart from :mod:`autotune.cli.commands` so that every command, and the stages' voices it wires, print
through the same few functions.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rich.console import Console
from rich.text import Text

from ..spec.errors import escape_text

__all__ = ["err", "out", "error", "warn", "say", "setup_logging", "voice"]

err = Console(stderr=True, highlight=False, soft_wrap=True)  # paths and commands stay copyable
out = Console(highlight=False, soft_wrap=True)


def error(text: str) -> None:
    """An error line. The text is never read as rich markup: it quotes specs, probes and paths,
    which are full of brackets (``[rank0]:``, ``[tp for x in ...]``, ``[/bold]``); and its control,
    bidi and invisible characters are escapes (:func:`~autotune.spec.errors.escape_text`: an ESC
    is ``\\x1b``, a newline ``\\n``; text escaped already stays as it is)."""
    err.print(Text.assemble(("error", "red"), " ", escape_text(text)))


def warn(text: str) -> None:
    err.print(Text(escape_text(text), style="yellow"))


def say(console: Console, text: str, style: str = "") -> None:
    """A line of ``text`` that quotes a spec, a probe or a trial record: printed as it is, never
    read as markup, its control, bidi and invisible characters escaped (one line, what it holds)."""
    console.print(Text(escape_text(text), style=style))


def setup_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    level = logging.INFO if verbose else logging.WARNING
    handler = RichHandler(console=err, show_path=False, show_time=False)
    logging.basicConfig(level=level, handlers=[handler], format="%(message)s", force=True)
    logging.getLogger("autotune").setLevel(logging.INFO if verbose else logging.WARNING)
    for noisy in ("alembic", "mlflow", "optuna", "ray", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING if verbose else logging.ERROR)
    # both configure their own loggers on import, which would undo the levels set above
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.INFO if verbose else optuna.logging.WARNING)
    # Optuna prints through its own handler ("[W 2026-11-24 ...] ..."): route it through ours
    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()


def voice() -> Any:
    """How the stages speak through the command line (:class:`autotune.cli.assembly.Voice`): lines and
    errors on stderr, notes dimmed, each long phase a moving status (:func:`autotune.tracking.progress.phase`)."""
    from .assembly import Voice
    from ..tracking.progress import phase

    return Voice(
        say=lambda text: say(err, text),
        note=lambda text: say(err, text, style="dim"),
        warn=warn,
        error=error,
        phase=lambda text: phase(err, text),
    )
