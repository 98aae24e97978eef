"""How the ``autotune`` process ends: its documented exit codes (:mod:`autotune.cli.commands`'s docstring
lists them), SIGTERM handled as Ctrl-C (the study saved, then exit 143), and the exit without the
interpreter's teardown once a command's work is done and said.

Apart from the commands because it is the process's life, not a command's: every command ends
through it, and the study's runner asks it whether a stop was requested.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

__all__ = [
    "EXIT_OK",
    "EXIT_NO_RESULT",
    "EXIT_INPUT",
    "EXIT_INFRA",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_INTERNAL",
    "Terminated",
    "exit_without_teardown",
    "install_sigterm",
    "interrupted_exit",
    "interrupted_words",
    "sigterm_received",
    "was_terminated",
]

EXIT_OK, EXIT_NO_RESULT, EXIT_INPUT, EXIT_INFRA, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 130, 143
EXIT_INTERNAL = 70  # sysexits EX_SOFTWARE: a bug in autotune, never "no trial succeeded" (1)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, ``kill``): handled like Ctrl-C, then exit 143."""


_SIGTERM_RECEIVED = False  # the exception may reach us re-raised as a plain KeyboardInterrupt


def _on_sigterm(signum: int, frame: Any) -> None:
    global _SIGTERM_RECEIVED
    _SIGTERM_RECEIVED = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


def install_sigterm() -> None:
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (the CLI called from a thread): leave it as it is
        pass


def sigterm_received() -> bool:
    """A SIGTERM came: the study stops starting trials (``StudyRunner``'s ``stop_requested``)."""
    return _SIGTERM_RECEIVED


def was_terminated(exc: KeyboardInterrupt) -> bool:
    """SIGTERM, not Ctrl-C. A ``Terminated`` raised inside Ray's C++ wait can come back as a new,
    plain ``KeyboardInterrupt`` (seen: exit 130 instead of 143, now and then): the flag decides."""
    return isinstance(exc, Terminated) or _SIGTERM_RECEIVED


def interrupted_exit(exc: KeyboardInterrupt) -> int:
    return EXIT_TERMINATED if was_terminated(exc) else EXIT_INTERRUPTED


def interrupted_words(exc: KeyboardInterrupt) -> str:
    """What stopped the command, as its last line says: SIGTERM or Ctrl-C."""
    return "terminated (SIGTERM)" if was_terminated(exc) else "interrupted"


def exit_without_teardown(code: Any) -> None:
    """Exit once the command's work is done and said, without the interpreter's teardown of
    torch, Ray, MLflow and pandas modules (2 s on an idle 2-core machine, up to 9 s on a loaded
    one, all of it silence after the last line). Nothing is skipped that keeps data: threads that
    are not daemons are joined, the atexit handlers (Ray's shutdown among them) run, and the
    standard streams and logs are flushed first."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): printed, status 1, as the interpreter does
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(status)
