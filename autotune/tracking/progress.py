"""Live progress on stderr: a study's trials done / budget, running, best so far; and the
phases a user waits on outside the trials (opening the store, ranking, calibrating, writing),
each announced and kept moving so that no stretch of seconds passes without a sign of life."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Iterator

from rich.console import Console
from rich.markup import escape
from rich.text import Text
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..study.records import TrialRecord
from ..spec.errors import escape_text

__all__ = ["ProgressObserver", "Phase", "phase", "PROGRESS_EVERY_ENV"]

PROGRESS_EVERY_ENV = "AUTOTUNE_PROGRESS_EVERY_S"
_DEFAULT_EVERY_S = 3.0  # well under the 5 s a user may wait without a sign, on a busy machine too


def _every_s() -> float:
    try:
        value = float(os.environ.get(PROGRESS_EVERY_ENV, _DEFAULT_EVERY_S))
    except ValueError:
        return _DEFAULT_EVERY_S
    return value if value > 0 else _DEFAULT_EVERY_S


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


class Phase:
    """One phase in progress. On a terminal with no other live display, a spinner line whose
    elapsed seconds tick; elsewhere (a pipe, a CI log, under the trials' bar) a line every
    ``every_s`` seconds (``AUTOTUNE_PROGRESS_EVERY_S``, default 3) saying the phase is still going,
    with its latest detail and the seconds so far. ``update`` changes the detail (and prints it
    at once where there is no spinner: a new step is news)."""

    def __init__(self, console: Console, text: str, every_s: float | None = None):
        self.console = console
        self.text = text
        self.detail = ""
        self.every_s = every_s if every_s is not None else _every_s()
        self.started = time.monotonic()
        self._last_line = self.started
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._status: Any = None
        self._thread: threading.Thread | None = None

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def _line(self) -> str:
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.text}{detail} ({_seconds(self.elapsed_s)})"

    def update(self, detail: str) -> None:
        with self._lock:
            self.detail = detail
            if self._status is not None:
                self._status.update(Text(self._line(), style="dim"))
            else:
                self.console.print(Text(f"  {self.text}: {detail}", style="dim"))
                self._last_line = time.monotonic()

    def _tick(self) -> None:
        while not self._stop.wait(min(0.5, self.every_s)):
            with self._lock:
                if self._status is not None:
                    self._status.update(Text(self._line(), style="dim"))
                elif time.monotonic() - self._last_line >= self.every_s:
                    said = f"{self.detail} ({_seconds(self.elapsed_s)})" if self.detail else f"still {self._line()}"
                    self.console.print(Text(f"  … {said}", style="dim"))
                    self._last_line = time.monotonic()

    def _live_active(self) -> bool:
        # rich allows one live display per console (the trials' bar may be running)
        return bool(getattr(self.console, "_live_stack", None))

    def start(self) -> "Phase":
        self.console.print(Text(self.text, style="dim"))
        if self.console.is_terminal and not self._live_active():
            self._status = self.console.status(Text(self._line(), style="dim"), spinner="dots")
            self._status.start()
        self._thread = threading.Thread(target=self._tick, name="autotune-phase", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._status is not None:
            self._status.stop()
            self._status = None
        if self.elapsed_s >= self.every_s:  # a long phase says when it ended
            self.console.print(Text(f"  {self.text}: done in {_seconds(self.elapsed_s)}", style="dim"))


@contextlib.contextmanager
def phase(console: Console, text: str, every_s: float | None = None) -> Iterator[Phase]:
    """``with phase(err, "opening the MLflow store") as p: ...``: announce ``text`` on
    ``console`` and keep a status that moves until the block ends (see :class:`Phase`)."""
    current = Phase(console, text, every_s).start()
    try:
        yield current
    finally:
        current.stop()


class ProgressObserver:
    """A :class:`~autotune.study.listeners.SearchObserver` drawing a rich progress bar.

    Failed trials are printed above the bar as they happen (with their reason), so a user sees
    an OOM wave early instead of at the end. ``quiet`` (``--json``) hides only the bar: messages
    are logs and still go to stderr. Off a terminal (a pipe, a CI log, ``nohup``) rich draws no
    bar until the end, so there each trial's start and end is a line, and a line every few
    seconds (``AUTOTUNE_PROGRESS_EVERY_S``) says the study is still going while a probe runs."""

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
            disable=quiet or not console.is_terminal,
        )
        self.plain = not quiet and not console.is_terminal
        self.budget = 0
        self.done = 0
        self._last_line = time.monotonic()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._started_at: dict[int, float] = {}  # a trial answered from the cache never started
        self.task: Any = None
        self.running = 0
        self.best_text = ""  # kept while trials start and finish, so the best never flickers out
        self.started = time.monotonic()  # the job's start: the elapsed time is the job's, not the bar's

    def __enter__(self) -> "ProgressObserver":
        self.progress.start()
        if self.plain:
            self._ticker = threading.Thread(target=self._tick, name="autotune-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        self.progress.stop()

    def _say(self, text: Any) -> None:
        self.progress.console.print(text, markup=False, highlight=False)
        self._last_line = time.monotonic()

    def _tick(self) -> None:
        every = _every_s()
        while not self._stop.wait(min(0.5, every)):
            if self.task is not None and self.running and time.monotonic() - self._last_line >= every:
                elapsed = _seconds(time.monotonic() - self.started)
                self._say(f"  … {self.running} running, {self.done}/{self.budget} done{self.best_text} ({elapsed})")

    def on_start(self, budget: int, done: int) -> None:
        self.task = self.progress.add_task("trials", total=budget, completed=done, status="starting")
        self.budget, self.done = budget, done
        for task in self.progress.tasks:  # rich's clock is time.monotonic, like ours
            if task.id == self.task:
                task.start_time = self.started

    def on_trial_started(self, number: int, config: dict[str, Any], why: str) -> None:
        self.running += 1
        self._status(None)
        self._started_at[number] = time.monotonic()

    def on_trial_finished(self, record: TrialRecord, best: TrialRecord | None, running: int) -> None:
        self.running = running
        if self.task is not None and record.status != "infra":  # not a probe of the budget: its retry is
            self.progress.advance(self.task)
            self.done += 1
        if record.status not in ("ok",):  # a probe's words: brackets in them are text, never markup,
            # and an ESC, a BEL or a newline in them an escape (\x1b, \n), never a terminal's command
            reason = escape_text(str(record.reason or "")[:160])
            self.progress.console.print(
                Text.assemble(f"  trial {record.number}: ", (escape_text(str(record.status)), "yellow"), f" {reason}")
            )
            self._last_line = time.monotonic()
        self._status(best)
        took = time.monotonic() - self._started_at.pop(record.number, time.monotonic())
        if self.plain and record.status == "ok" and took >= 1.0:  # a probe, not a prediction's instant
            value = record.metrics.get(self.metric)
            shown = f" {self.metric} {value:,.4g}" if isinstance(value, (int, float)) else ""
            self._say(f"trial {record.number} ok:{shown} ({self.done}/{self.budget} done{self.best_text})")

    def on_message(self, text: str) -> None:
        self._say(escape_text(str(text)))  # may quote a probe (an infrastructure failure's reason)

    def _status(self, best: TrialRecord | None) -> None:
        if self.task is None:
            return
        if best is not None and isinstance(best.metrics.get(self.metric), (int, float)):
            self.best_text = f" | best {self.metric} {best.metrics[self.metric]:,.4g} (trial {best.number})"
        self.progress.update(self.task, status=escape(f"running {self.running}{self.best_text}"))

    def phase(self, text: str) -> contextlib.AbstractContextManager[Phase]:
        """A step before the trials' bar (ranking the space): announced and kept moving."""
        return phase(self.progress.console, text)
