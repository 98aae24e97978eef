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

__all__ = [
    "err",
    "out",
    "error",
    "warn",
    "say",
    "setup_logging",
    "voice",
    "begin_command",
    "json_failure",
    "record_error",
]


class _DataConsole(Console):
    """stdout, remembering whether the command wrote to it: a failed ``--json`` command whose own
    object was never written gets :func:`json_failure`'s instead, and never two objects."""

    wrote = False

    def print(self, *args: Any, **kwargs: Any) -> None:
        self.wrote = True
        super().print(*args, **kwargs)


err = Console(stderr=True, highlight=False, soft_wrap=True)  # paths and commands stay copyable
out = _DataConsole(highlight=False, soft_wrap=True)

_said: dict[str, list[str]] = {"errors": [], "warnings": []}  # the command's error and warning lines
_json_wanted = False


def begin_command(json_wanted: bool) -> None:
    """A command starts (the command line's group, :class:`autotune.cli.options.Group`): nothing said
    or written yet, and whether ``--json`` was given, read from the arguments before their parse,
    which an option error stops before any value is known."""
    global _json_wanted
    _json_wanted = json_wanted
    _said["errors"], _said["warnings"] = [], []
    out.wrote = False


def set_json(json_wanted: bool) -> None:
    """The command's ``--json`` as its options were parsed (:class:`autotune.cli.options.Command`)."""
    global _json_wanted
    _json_wanted = json_wanted


def record_error(text: str) -> None:
    """An error another printed (click's option errors): kept for :func:`json_failure`."""
    _said["errors"].append(escape_text(text))


def json_failure(code: Any) -> None:
    """A command given ``--json`` that ends with a non-zero exit code and wrote no object of its own:
    ``{"ok": false, "exit_code": N, "errors": [...], "warnings": [...]}`` on stdout, the lines it
    said on stderr, so a script reads why from stdout as it reads a result (``validate --json``'s
    shape). Nothing where ``--json`` was not given, the command succeeded, or it wrote its object."""
    import json

    if not _json_wanted or not isinstance(code, int) or code == 0 or out.wrote:
        return
    out.print_json(json.dumps({"ok": False, "exit_code": code, **_said}))


def error(text: str) -> None:
    """An error line. The text is never read as rich markup: it quotes specs, probes and paths,
    which are full of brackets (``[rank0]:``, ``[tp for x in ...]``, ``[/bold]``); and its control,
    bidi and invisible characters are escapes (:func:`~autotune.spec.errors.escape_text`: an ESC
    is ``\\x1b``, a newline ``\\n``; text escaped already stays as it is)."""
    _said["errors"].append(escape_text(text))
    err.print(Text.assemble(("error", "red"), " ", escape_text(text)))


def warn(text: str) -> None:
    _said["warnings"].append(escape_text(text))
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
