"""Run one probe as its own process group (docs/ARCHITECTURE.md, "The probe protocol").

``run_probe_process`` is what every process probe goes through, whichever dispatcher runs it
(a local thread or a Ray task on a worker node): the ``command`` backend (any external launcher),
the torch probe and the MindSpore probe alike. It

- starts ``argv`` (a list: there is no shell) in a new session, so the probe and everything it
  starts form one process group that can be killed as a whole;
- gives it ``os.environ`` + ``env`` + ``AUTOTUNE_TRIAL_FILE`` and replaces ``{trial_file}`` in
  every argv element;
- reads its output (stdout and stderr merged) in a thread, line by line, so a deadline fires even
  when the probe prints nothing; protocol lines (``{"event": ...}``, ``{"metrics": {...}}``) are
  parsed, everything else is kept as a bounded log tail and, optionally, scanned by regexes for
  metrics of launchers that cannot print JSON;
- kills the whole group (SIGTERM, then SIGKILL after a grace period) at the deadline, when
  ``should_stop()`` says so (pruning), when a device allocator's out-of-memory error is not
  followed by the probe's exit within ``oom_exit_grace_s`` (the ranks still alive would wait in a
  collective until its timeout, holding the devices), or when the caller is interrupted; processes
  left in the group after the probe's leader exits are killed too;
- starts a tiny ``sh`` watchdog outside the group that kills the group if the process running
  this function dies without finishing (for instance a Ray worker killed by ``ray.cancel(force=True)``
  or by Ray's memory monitor: Ray then kills the worker's direct children only, and a probe's
  own children, which hold the accelerators, would otherwise live on).

It imports only the standard library, ``.protocol`` and ``.process_group`` (signalling the group,
the watchdog): it runs on worker nodes.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .process_group import (
    PROBE_MARK_ENV,
    finish_watchdog,
    kill_group,
    kill_probe_marked,
    leader_exited,
    signal_group,
    start_watchdog,
)
from .protocol import (
    PEAK_COUNTS,
    PEAK_COUNTS_KEY,
    TRIAL_FILE_ENV,
    ProbeResult,
    classify_failure,
    device_oom_raised,
    native_cause,
    oom_evidence,
    parse_output_line,
)

__all__ = ["run_probe_process", "kill_group", "MAX_LINE_BYTES", "KILL_GRACE_S", "OOM_EXIT_GRACE_S"]

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 1 << 20  # a protocol line (metrics with an info breakdown) may be long, not endless
MAX_LOG_LINE_CHARS = 4000  # per line kept in the log tail
MAX_STEPS = 100_000  # step events kept per trial; later ones still reach on_event
KILL_GRACE_S = 3.0  # between SIGTERM and SIGKILL
POLL_S = 0.05  # how often should_stop() and the deadline are checked
# After a rank's device allocator raised out-of-memory, how long the probe has to exit on its own (its
# launcher's teardown, its last lines) before its process group is stopped. A rank that failed leaves
# the others waiting in their next collective until its timeout: 10 minutes for NCCL
# (modelscope/FunASR issue 2006: one rank's "CUDA out of memory", the other ranks' watchdogs at 600 s),
# 30 for HCCL (HCCL_EXEC_TIMEOUT 1836 s), and the devices stay held all the while. A step reported
# after the error (a launcher that caught it and went on) cancels the stop.
OOM_EXIT_GRACE_S = 30.0
_CLASSIFY_LINES = 1000  # output lines kept for classifying a failure (>= log_tail_lines)
_EOF = object()


# after the probe's leader exited: stop reading once its output has been quiet this long (something
# outside its process group holds the pipe), and at the latest after this long
_EXIT_QUIET_S = 1.0
_EXIT_DRAIN_MAX_S = 15.0


class _Unterminated(str):
    """The last output of a probe that ended without a newline. When autotune killed the probe,
    it is a line cut in half by the kill and is dropped; otherwise it is kept as a normal line."""


_SINGLE_NODE = ("{nnodes}", "{node_rank}", "{master_addr}", "{master_port}", "{rdzv_endpoint}")


def single_node_values(argv: list[str]) -> list[str]:
    """A trial on one node: the node placeholders a multi-node trial's dispatch fills
    (``autotune.dispatch.ray_tasks``) take one node's values here (1 node, rank 0, this host and a
    free port), so one launcher argv runs at every size of a scaling study."""
    if not any(p in a for a in argv for p in _SINGLE_NODE):
        return argv
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    values = {"nnodes": "1", "node_rank": "0", "master_addr": "127.0.0.1", "master_port": port}
    values["rdzv_endpoint"] = f"127.0.0.1:{port}"
    for key, value in values.items():
        argv = [a.replace("{" + key + "}", value) for a in argv]
    return argv


def run_probe_process(
    argv: list[str],
    env: dict[str, str],
    trial_file: str | Path,
    timeout_s: float | None,
    *,
    cwd: str | Path | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    metric_patterns: dict[str, str] | None = None,
    log_tail_lines: int = 200,
    kill_grace_s: float = KILL_GRACE_S,
    watchdog: bool = True,
    log_reader: Any = None,
    oom_exit_grace_s: float | None = OOM_EXIT_GRACE_S,
) -> ProbeResult:
    """Run one probe process to completion and return what it produced.

    ``argv``: the command, each element with ``{trial_file}`` replaced by the trial file's path
    (``str.replace``, so other braces survive). ``env``: added to ``os.environ`` (a ``None`` value
    removes a variable); ``AUTOTUNE_TRIAL_FILE`` is set, and ``PYTHONUNBUFFERED=1`` unless set, so
    that Python probes stream their step events. ``timeout_s``: wall-clock deadline (``None``: none).

    ``on_event`` receives every ``{"event": ...}`` message the probe prints (steps, failures, any
    other event), in order, on the calling thread; ``should_stop`` is polled about every 50 ms on
    the calling thread and, once true, the probe is killed and reported as ``pruned`` with the steps
    measured so far. ``metric_patterns`` maps a metric name to a regex whose first group (or whole
    match) is the value, applied to each log line (last match wins); they let a launcher that
    cannot print JSON be a probe. ``log_reader`` (a :class:`~autotune.workers.stack_logs.StackLog`)
    reads a production stack's own log lines instead: its step events stream like the protocol's,
    its metrics come from the measured iterations, and its failure words decide the status where
    the generic rules see only a crash. ``oom_exit_grace_s``: a probe that prints a device
    allocator's out-of-memory error (``device_oom_raised``) and neither exits nor reports a step
    within this long is stopped and recorded as ``oom`` (None: wait for its exit or the deadline).

    Status: ``ok`` when the probe exits 0 and reported metrics (a ``{"metrics": ...}`` line, or at
    least one metric extracted by ``metric_patterns``) and printed no failure event; ``pruned``
    when stopped by ``should_stop``; ``timeout`` at the deadline; ``invalid`` when the program
    cannot be started; otherwise ``classify_failure`` decides (an explicit
    ``{"event": "failure", "status": ...}`` first). Metrics and steps that arrived are kept
    whatever the status. Nothing the probe prints or does raises here; exceptions raised by the
    callbacks, and KeyboardInterrupt, propagate after the process group has been killed.
    """
    t0 = time.monotonic()
    trial_file = str(trial_file)
    if isinstance(argv, (str, bytes)) or not argv:
        return ProbeResult("invalid", reason=f"probe command must be a non-empty argv list, got {argv!r}")
    argv = single_node_values([str(a).replace("{trial_file}", trial_file) for a in argv])

    try:
        patterns = _compile_patterns(metric_patterns)
    except ValueError as exc:
        return ProbeResult("invalid", reason=str(exc), wall_s=time.monotonic() - t0)

    proc_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            proc_env.pop(key, None)
        else:
            proc_env[str(key)] = str(value)
    proc_env[TRIAL_FILE_ENV] = trial_file
    proc_env.setdefault("PYTHONUNBUFFERED", "1")
    # every process the probe starts inherits this mark, also one that leaves the process group
    # (setsid, a daemonising launcher): the sweep at the end finds it by the mark
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    proc_env[PROBE_MARK_ENV] = marker

    if cwd is not None and not Path(cwd).is_dir():
        return ProbeResult(
            "invalid", reason=f"probe working directory {str(cwd)!r} does not exist", wall_s=time.monotonic() - t0
        )
    try:
        proc = subprocess.Popen(
            argv,
            env=proc_env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            # Binary: a probe may print anything (invalid UTF-8, NULs, no newlines); lines are cut
            # at MAX_LINE_BYTES and decoded with errors="replace" by the reader.
        )
    except FileNotFoundError:
        return ProbeResult(
            "invalid", reason=f"probe executable not found: {argv[0]!r} (argv {argv!r})", wall_s=time.monotonic() - t0
        )
    except PermissionError:
        return ProbeResult(
            "invalid", reason=f"probe executable is not executable: {argv[0]!r}", wall_s=time.monotonic() - t0
        )
    except OSError as exc:
        return ProbeResult("invalid", reason=f"cannot start probe {argv[0]!r}: {exc}", wall_s=time.monotonic() - t0)

    run = _Run(proc, patterns, log_tail_lines, on_event, log_reader)
    guard = start_watchdog(proc.pid, kill_grace_s) if watchdog else None
    lines: queue.Queue = queue.Queue(maxsize=10_000)  # bounded: a flooding probe blocks on its pipe
    reader_stop = threading.Event()
    reader = threading.Thread(
        target=_read_lines, args=(proc.stdout, lines, reader_stop), name=f"probe-reader-{proc.pid}", daemon=True
    )
    reader.start()

    deadline = None if timeout_s is None or math.isinf(timeout_s) else t0 + float(timeout_s)
    stopped = timed_out = False
    term_at: float | None = None  # when SIGTERM went to the group
    killed = False  # SIGKILL sent
    rc: int | None = None
    left_at = 0.0
    eof = False
    nap = 0.0005
    try:
        while True:
            if not eof:
                eof = run.drain(lines, POLL_S)
            else:  # output closed: only the exit is left to see, soon in the usual case
                time.sleep(nap)
                nap = min(nap * 2, POLL_S)
            if rc is None and leader_exited(proc):
                # The leader is a zombie until reaped, so its pid (the group id) cannot be reused:
                # kill whatever it left behind in its group, then reap it.
                signal_group(proc.pid, signal.SIGKILL)
                finish_watchdog(guard)
                guard = None
                rc = proc.wait()
                left_at = time.monotonic()
            now = time.monotonic()
            if rc is not None:
                if eof:
                    break
                if now - max(left_at, run.last_line_at) > _EXIT_QUIET_S or now - left_at > _EXIT_DRAIN_MAX_S:
                    # a process outside the group (one that called setsid) holds the pipe open. Quiet
                    # since the exit, not merely a second after it: on a loaded machine the lines
                    # still in the pipe can take longer than that to read, and the last ones are often
                    # the ones that matter (CI lost a rank's memory line that way)
                    log.warning(
                        "probe %s exited but something outside its process group keeps its "
                        "output open; not waiting for it",
                        argv[0],
                    )
                    break
                continue
            if term_at is None:
                if should_stop is not None and should_stop():
                    stopped = True
                elif deadline is not None and now >= deadline:
                    timed_out = True
                elif run.oom_unresolved(now, oom_exit_grace_s):
                    run.stopped_after_oom_s = float(oom_exit_grace_s)
                if stopped or timed_out or run.stopped_after_oom_s is not None:
                    signal_group(proc.pid, signal.SIGTERM)
                    run.signalled = True
                    term_at = now
            elif not killed and now - term_at >= kill_grace_s:
                signal_group(proc.pid, signal.SIGKILL)
                killed = True
    except BaseException:
        # A callback raised, or the caller was interrupted (Ray's non-forced cancel raises
        # KeyboardInterrupt here): never leave the group running.
        kill_group(proc, kill_grace_s)
        finish_watchdog(guard)
        raise
    finally:
        reader_stop.set()  # from now on the reader drops lines; it closes the pipe at EOF
        reader.join(timeout=0.5)

    escaped = kill_probe_marked(marker)
    if escaped:
        log.warning("probe %s left %d process(es) outside its process group (setsid): killed", argv[0], escaped)
    result = run.result(rc, stopped=stopped, timed_out=timed_out)
    result.wall_s = time.monotonic() - t0
    if timed_out and result.status == "timeout":
        result.reason = (
            f"the probe ran past its time limit of {float(timeout_s):g} s and was killed (the limit is "
            "workload.timeout_s, or backend.timeout_s where the spec sets it: raise it for a config that "
            "is slow, not stuck)"
        )
    return result


class _Run:
    """What has been read from one probe so far."""

    def __init__(
        self,
        proc: subprocess.Popen,
        patterns: dict[str, re.Pattern],
        tail_lines: int,
        on_event: Callable[[dict[str, Any]], None] | None,
        reader: Any = None,
    ) -> None:
        self.proc = proc
        self.reader = reader
        self.patterns = patterns
        self.tail_lines = max(0, int(tail_lines))
        self.lines: collections.deque[str] = collections.deque(maxlen=max(self.tail_lines, _CLASSIFY_LINES))
        self.on_event = on_event
        self.steps: list[dict[str, Any]] = []
        self.steps_dropped = 0
        self.metrics: dict[str, float] | None = None
        self.pattern_metrics: dict[str, float] = {}
        self.info: dict[str, Any] = {}
        self.source = "measured"
        self.failure: dict[str, Any] | None = None
        self.failure_line = ""
        self.signalled = False  # autotune sent the group a signal: an unterminated last line is cut
        self.last_line_at = 0.0  # monotonic time of the last line handled
        self.oom_at: float | None = None  # when a device allocator's out-of-memory error was printed
        self.stopped_after_oom_s: float | None = None  # the grace after which autotune stopped it

    def oom_unresolved(self, now: float, grace_s: float | None) -> bool:
        """A device OOM printed ``grace_s`` ago, and since then neither a step nor the metrics."""
        return grace_s is not None and self.oom_at is not None and self.metrics is None and now - self.oom_at >= grace_s

    def _saw_oom(self) -> None:
        if self.oom_at is None:
            self.oom_at = time.monotonic()

    def drain(self, lines: queue.Queue, wait_s: float) -> bool:
        """Handle the lines read so far (at most a batch, so that a probe printing without pause
        cannot starve the deadline checks), waiting up to ``wait_s`` for the first; True at EOF."""
        try:
            item = lines.get(timeout=wait_s)
        except queue.Empty:
            return False
        handled = 0
        while True:
            if item is _EOF:
                return True
            self.line(item)
            handled += 1
            if handled >= 2000:
                return False
            try:
                item = lines.get_nowait()
            except queue.Empty:
                return False

    def line(self, text: str) -> None:
        self.last_line_at = time.monotonic()
        if self.signalled and isinstance(text, _Unterminated):
            return
        msg = parse_output_line(text)
        if msg is None:
            self.lines.append(text if len(text) <= MAX_LOG_LINE_CHARS else text[:MAX_LOG_LINE_CHARS] + " ...[cut]")
            if device_oom_raised(text):
                self._saw_oom()
            for name, pattern in self.patterns.items():
                m = pattern.search(text)
                if m:
                    value = _to_float(m.group(1) if pattern.groups else m.group(0))
                    if value is not None:
                        self.pattern_metrics[name] = value
            if self.reader is not None:  # the stack's own words, as protocol events
                for event in self.reader.parse(text):
                    self._event(event)
            return
        if "metrics" in msg and "event" not in msg:
            self._metrics(msg)
            self.lines.append(text if len(text) <= MAX_LOG_LINE_CHARS else text[:MAX_LOG_LINE_CHARS] + " ...[cut]")
            return
        if msg.get("event") != "step":
            self.lines.append(text if len(text) <= MAX_LOG_LINE_CHARS else text[:MAX_LOG_LINE_CHARS] + " ...[cut]")
        self._event(msg)

    def _event(self, msg: dict[str, Any]) -> None:
        event = msg.get("event")
        if event == "step":
            self.oom_at = None  # a step after an OOM: the launcher caught it and went on
            if len(self.steps) < MAX_STEPS:
                self.steps.append(msg)
            else:
                self.steps_dropped += 1
        elif event == "failure":
            self.failure = msg
            self.failure_line = json.dumps(msg, default=str)
            if msg.get("status") == "oom":
                self._saw_oom()
        if self.on_event is not None:
            self.on_event(msg)

    def _metrics(self, msg: dict[str, Any]) -> None:
        raw = msg.get("metrics")
        if not isinstance(raw, dict):
            self.info.setdefault("protocol_errors", []).append("a metrics message that is not a mapping")
            return
        metrics: dict[str, float] = {}
        for name, value in raw.items():
            number = _to_float(value)
            if number is None:
                self.info.setdefault("non_numeric_metrics", {})[str(name)] = value
            else:
                metrics[str(name)] = number
        self.metrics = metrics  # exactly one is expected; the last one wins
        if isinstance(msg.get("info"), dict):
            self.info.update(msg["info"])
            counts = self.info.get(PEAK_COUNTS_KEY)
            if counts is not None and counts not in PEAK_COUNTS:
                self.info.pop(PEAK_COUNTS_KEY)
                self.info.setdefault("protocol_errors", []).append(
                    f"info.{PEAK_COUNTS_KEY} {counts!r} is not one of {', '.join(PEAK_COUNTS)}: the peak is taken "
                    "as the device's"
                )
        if msg.get("source") in ("measured", "simulated"):
            self.source = msg["source"]

    def result(self, rc: int | None, *, stopped: bool, timed_out: bool) -> ProbeResult:
        metrics = dict(self.pattern_metrics)
        if self.reader is not None and self.metrics is None:
            metrics.update(self.reader.metrics(self.steps) or {})
        metrics.update(self.metrics or {})
        has_metrics = self.metrics is not None or bool(self.pattern_metrics) or bool(metrics)
        info = dict(self.info)
        info["returncode"] = rc
        if self.reader is not None and self.reader.peak_memory_gib is not None:
            info.setdefault(PEAK_COUNTS_KEY, self.reader.peak_counts)
        if self.steps_dropped:
            info["steps_dropped"] = self.steps_dropped
        tail_list = list(self.lines)[-self.tail_lines :] if self.tail_lines else []
        tail = "\n".join(tail_list)
        if stopped:
            status, reason = "pruned", "stopped early by the driver"
        elif timed_out:
            status, reason = classify_failure(rc, [], timed_out=True)
        elif rc == 0 and has_metrics and self.failure is None:
            status, reason = (self.reader.verdict(self.steps) if self.reader is not None else None) or ("ok", "")
        elif rc == 0 and self.failure is None:  # the stack's own verdict first (every iteration skipped: nan)
            status, reason = (self.reader.verdict(self.steps) if self.reader is not None else None) or (
                "crash",
                "probe exited 0 without a metrics line"
                if self.reader is None
                else f"probe exited 0 without metrics: {self.reader.missing}",
            )
        else:
            output = list(self.lines)
            if self.failure is not None and self.failure_line not in output:
                output.append(self.failure_line)  # scrolled out of the window: still honoured
            status, reason = classify_failure(rc, output)
            stack = self.reader.failure(output) if self.reader is not None else None
            if stack is not None and status != "oom":  # an OOM's own message outranks what follows it
                status, reason = stack
            if status == "crash" and self.failure is not None and rc == 0:
                reason = str(self.failure.get("reason", reason))[:500]
            if status == "crash":  # a worker's bare "Response is empty.": the runtime's own line says why
                cause = native_cause(output, reason)
                if cause:
                    reason = f"{reason} (the runtime's error: {cause})"[:1000]
            if self.metrics is not None and status != "ok":
                reason = f"{reason} (after reporting metrics)"
            if status == "oom":  # how far over: the allocator's own byte counts
                evidence = oom_evidence(output)
                if evidence:
                    info["oom"] = evidence
            if self.stopped_after_oom_s is not None:
                info["stopped_after_oom_s"] = self.stopped_after_oom_s
                reason = (
                    f"{reason} (autotune stopped the probe {self.stopped_after_oom_s:g} s after this out-of-memory "
                    "error: it had not exited, and its other ranks would have waited in a collective until its timeout)"
                )[:2000]
        return ProbeResult(
            status, metrics=metrics, steps=self.steps, source=self.source, log_tail=tail, reason=reason, info=info
        )


def _compile_patterns(metric_patterns: dict[str, str] | None) -> dict[str, re.Pattern]:
    patterns: dict[str, re.Pattern] = {}
    for name, regex in (metric_patterns or {}).items():
        try:
            patterns[str(name)] = re.compile(regex)
        except (re.error, TypeError) as exc:
            raise ValueError(
                f"metric pattern for {name!r} is not a valid regular expression ({regex!r}): {exc}"
            ) from None
    return patterns


def _to_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace(",", ""))
        except ValueError:
            return None
    return None


def _read_lines(stream, out: queue.Queue, stop: threading.Event) -> None:
    """Reader thread: put decoded lines (cut at MAX_LINE_BYTES) on ``out``, then _EOF; after
    ``stop`` is set, drop them. Never raises; closes ``stream`` itself (closing it from another
    thread while this one is blocked in readline would deadlock on the buffer lock)."""
    try:
        skipping = False  # inside an over-long line whose head was already delivered
        while True:
            chunk = stream.readline(MAX_LINE_BYTES)
            if not chunk:
                break
            complete = chunk.endswith(b"\n")
            if skipping:
                skipping = not complete
                continue
            if not complete and len(chunk) >= MAX_LINE_BYTES:
                skipping = True
                chunk += b" ...[line cut]"
            text = chunk.decode("utf-8", errors="replace").rstrip("\r\n")
            _put(out, text if complete or skipping else _Unterminated(text), stop)
    except Exception as exc:  # defensive: the reader must always end with _EOF
        _put(out, f"[autotune: reading the probe output failed: {exc!r}]", stop)
    finally:
        _put(out, _EOF, stop)
        try:
            stream.close()
        except Exception:
            pass


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return
        except queue.Full:
            continue
