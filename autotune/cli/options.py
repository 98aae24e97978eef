"""What the commands share of their definition: the help shown as plain flags, the arguments and
options several commands take (a spec, a run directory, ``--json``, ``-v``), and the help texts
read from the registries (every backend ``--backend`` accepts, every export format and its file).

Apart from :mod:`autotune.cli.commands` so that the command line reads as its commands.
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

__all__ = [
    "Command",
    "Group",
    "JsonOpt",
    "RunDirOpt",
    "RunOrSpecArg",
    "SpecArg",
    "VerboseOpt",
    "backend_kinds",
    "flag",
    "format_help",
]


class PlainHelp:
    """``--help`` shown as a plain flag (typer 0.29 prints ``--help <bool>``)."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.metavar = ""
        return option


def _keep_click_error(exc: BaseException) -> None:
    """A click error (``UsageError``: an unknown command or option, a bad value; click prints it
    itself) kept for a ``--json`` failure's object. typer raises its own copy of click's classes
    (``typer._click``), so the error is known by its ``format_message``."""
    if callable(getattr(exc, "format_message", None)):
        from .console import record_error

        record_error(exc.format_message())


class Command(PlainHelp, TyperCommand):
    def invoke(self, ctx: Any) -> Any:
        """The command runs: its ``--json`` as parsed decides (a ``--json`` that was another option's
        value, or came after ``--``, is not the flag)."""
        from .console import set_json

        set_json(bool(ctx.params.get("as_json")))
        return super().invoke(ctx)


class Group(PlainHelp, TyperGroup):
    """The ``autotune`` group: each command's run begins and ends here. A command given ``--json``
    that fails without writing its object ends with one saying why
    (:func:`autotune.cli.console.json_failure`); Ctrl-C or SIGTERM in a command that does not handle
    it (all but ``run``, which saves its study first) ends as documented, 130 or 143, said on stderr."""

    def main(self, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        from .console import begin_command, json_failure

        argv = list(sys.argv[1:] if args is None else args)
        # until the command's options are parsed (an option error stops the parse), the words decide
        begin_command("--json" in (argv[: argv.index("--")] if "--" in argv else argv))
        try:
            return super().main(argv, *rest, **kwargs)
        except SystemExit as exc:  # how every command ends in standalone mode
            json_failure(exc.code)
            raise

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except Exception as exc:  # an option of the group itself
            _keep_click_error(exc)
            raise

    def invoke(self, ctx: Any) -> Any:
        from .exit_status import interrupted_exit, interrupted_words

        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:  # typer would make any of them exit 130, SIGTERM too
            from .console import warn

            warn(interrupted_words(exc))
            raise SystemExit(interrupted_exit(exc)) from None
        except Exception as exc:  # a command's name or options (its parse runs here) that click refuses
            _keep_click_error(exc)
            raise


SpecArg = typer.Argument(..., help="tuning spec (YAML)", show_default=False)
RunOrSpecArg = typer.Argument(..., help="run directory, or the tuning spec (YAML)", show_default=False)
RunDirOpt = typer.Option(None, "--run-dir", help="study directory (default ./autotune_runs/<spec name>)")


def flag(*names: str, help: str) -> Any:
    """A boolean option shown as a plain flag (typer 0.29 prints ``--json <bool>`` otherwise)."""
    return typer.Option(False, *names, help=help, metavar="")


JsonOpt = flag("--json", help="print one JSON object on stdout (logs and progress stay on stderr)")
VerboseOpt = flag("-v", "--verbose", help="log what each stage does (stderr)")


def backend_kinds() -> tuple[str, ...]:
    """Every backend ``--backend`` accepts, as :func:`autotune.dispatch.backends.select_backend` does."""
    from ..spec.schema import BACKEND_KINDS
    from ..stacks import preset_names

    return (*BACKEND_KINDS, *(name for name in preset_names() if name not in BACKEND_KINDS))


def format_help() -> str:
    """``--format``'s help: every export format with the file it writes (from the registry)."""
    from ..finish.exports import EXPORTERS

    formats = ", ".join(f"{name} ({exporter.filename})" for name, exporter in EXPORTERS.items())
    formats += "; mindie writes mindie_pd_user_config.json for a disaggregated config"
    return (
        f"comma-separated: {formats}; or all (every one that can launch the config). Default: yaml, env and the "
        "launch file of the spec's target stack"
    )
