"""A probe's process group: how it is killed as a whole, and what kills it if its parent dies.

Split from :mod:`.command` (which starts a probe and reads its output): these are the pieces that
signal processes. ``kill_group`` SIGTERMs a probe's session, then SIGKILLs it; ``kill_marked``
sweeps the descendants that left the group by the mark in their environment (the serving probe
marks its engines the same way); the watchdog is a tiny ``sh`` outside the group that kills it if
the process that started the probe dies without finishing (a Ray worker killed by
``ray.cancel(force=True)`` or Ray's memory monitor: Ray kills the worker's direct children only).

Standard library only: it runs on worker nodes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

__all__ = [
    "PROBE_MARK_ENV",
    "finish_watchdog",
    "kill_group",
    "kill_marked",
    "kill_probe_marked",
    "leader_exited",
    "signal_group",
    "start_watchdog",
]

log = logging.getLogger(__name__)

# Runs outside the probe's group: waits for "done" on its stdin (fd 3 in the background subshell,
# since an asynchronous list gets /dev/null as stdin). EOF without "done" means the process that
# started the probe died: kill the group, politely first. dash's kill takes no "--".
_WATCHDOG_SCRIPT = (
    'exec 3<&0; ( read x <&3; if [ "$x" != done ]; then kill -TERM -"$1" 2>/dev/null; '
    'sleep "$2"; kill -KILL -"$1" 2>/dev/null; fi ) >/dev/null 2>&1 & exit 0'
)


def leader_exited(proc: subprocess.Popen) -> bool:
    """True once the leader has exited, without reaping it (so its pid/pgid stays reserved)."""
    if proc.returncode is not None:
        return True
    waitid = getattr(os, "waitid", None)
    if waitid is None:  # pragma: no cover - not on Linux
        return proc.poll() is not None
    try:
        info = waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll() is not None
    return info is not None


PROBE_MARK_ENV = "AUTOTUNE_PROBE_MARK"


def kill_probe_marked(marker: str) -> int:
    """SIGKILL every process whose environment carries this probe's mark (Linux ``/proc``; elsewhere
    nothing is found): the descendants that left the probe's process group, which killing the
    group cannot reach. A process that cleared its environment is not found: nothing else marks
    it. Returns how many were killed."""
    return kill_marked(PROBE_MARK_ENV, marker)


def kill_marked(var: str, marker: str) -> int:
    """SIGKILL every process but this one whose environment has ``var=marker`` (Linux ``/proc``);
    how many. The serving probe marks its engines the same way."""
    needle = f"{var}={marker}".encode()
    killed = 0
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return 0
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return killed


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the group, SIGKILL after ``grace_s`` (or as soon as the leader is gone), reap."""
    if proc.returncode is not None:
        return
    signal_group(proc.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and not leader_exited(proc):
        time.sleep(0.02)
    signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - an unkillable (D-state) process
        log.warning("probe process %d did not die after SIGKILL", proc.pid)


def start_watchdog(pgid: int, grace_s: float) -> subprocess.Popen | None:
    try:
        guard = subprocess.Popen(
            ["/bin/sh", "-c", _WATCHDOG_SCRIPT, "autotune-probe-watchdog", str(pgid), f"{max(grace_s, 0.0):g}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        return guard  # the outer sh exits at once (reaped in finish_watchdog); its subshell watches
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("no probe watchdog: %s", exc)
        return None


def finish_watchdog(guard: subprocess.Popen | None) -> None:
    if guard is None or guard.stdin is None:
        return
    try:
        guard.stdin.write(b"done\n")
        guard.stdin.close()
    except OSError:
        pass
    try:
        guard.wait(timeout=1.0)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass
