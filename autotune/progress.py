"""Live progress of a study on stderr: trials done / budget, running, best so far."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .records import TrialRecord

__all__ = ["ProgressObserver"]


class ProgressObserver:
    """A :class:`~autotune.listeners.SearchObserver` drawing a rich progress bar.

    Failed trials are printed above the bar as they happen (with their reason), so a user sees
    an OOM wave early instead of at the end. ``quiet`` (``--json``) hides only the bar: messages
    are logs and still go to stderr."""

    def __init__(self, console: Console, objectives: list[tuple[str, str]], quiet: bool = False):
        self.console = console
        self.metric = objectives[0][0]
        self.quiet = quiet
        self.progress = Progress(
            TextColumn("[bold]trials"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=quiet,
        )
        self.task: Any = None
        self.running = 0
        self.best_text = ""  # kept while trials start and finish, so the best never flickers out
        self.started = time.monotonic()  # the job's start: the elapsed time is the job's, not the bar's

    def __enter__(self) -> "ProgressObserver":
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def on_start(self, budget: int, done: int) -> None:
        self.task = self.progress.add_task("trials", total=budget, completed=done, status="starting")
        for task in self.progress.tasks:  # rich's clock is time.monotonic, like ours
            if task.id == self.task:
                task.start_time = self.started

    def on_trial_started(self, number: int, config: dict[str, Any], why: str) -> None:
        self.running += 1
        self._status(None)

    def on_trial_finished(self, record: TrialRecord, best: TrialRecord | None, running: int) -> None:
        self.running = running
        if self.task is not None and record.status != "infra":  # not a probe of the budget: its retry is
            self.progress.advance(self.task)
        if record.status not in ("ok",):  # a probe's words: brackets in them are text, never markup
            self.progress.console.print(
                Text.assemble(f"  trial {record.number}: ", (record.status, "yellow"), f" {record.reason[:160]}")
            )
        self._status(best)

    def on_message(self, text: str) -> None:
        self.progress.console.print(text, markup=False, highlight=False)

    def _status(self, best: TrialRecord | None) -> None:
        if self.task is None:
            return
        if best is not None and isinstance(best.metrics.get(self.metric), (int, float)):
            self.best_text = f" | best {self.metric} {best.metrics[self.metric]:,.4g} (trial {best.number})"
        self.progress.update(self.task, status=escape(f"running {self.running}{self.best_text}"))

    def status(self, text: str) -> None:
        """A phase of the job that takes a while (opening MLflow, ranking, writing results), so
        that no stretch of seconds passes without a line."""
        self.progress.console.print(Text(text, style="dim"))
