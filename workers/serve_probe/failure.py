"""How the serving probe fails: one exception carrying the protocol status and the reason.

Every way a serving trial can end badly is decided where it is seen (an engine that refused to
start, never answered its health check, died under load, requests the engine rejected) and
raised as a :class:`ProbeFailure`; the probe's main turns it into the protocol's
``{"event": "failure", "status": ..., "reason": ...}`` line, which ``classify_failure`` honours
before any guess from the log. ``Terminated`` is a signal from outside (the driver's deadline or
pruning, Ctrl-C): a ``SystemExit``, so that no ``except Exception`` on the way swallows it and
asyncio re-raises it out of the event loop at once (it keeps other BaseExceptions in the task
that raised them), and the engines are stopped on the way out.
"""

from __future__ import annotations

from ..protocol import FAILURE_STATUSES

__all__ = ["ProbeFailure", "Terminated"]


class ProbeFailure(Exception):
    def __init__(self, status: str, reason: str) -> None:
        if status not in FAILURE_STATUSES:
            status = "crash"
        super().__init__(reason)
        self.status = status
        self.reason = reason


class Terminated(SystemExit):
    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum
