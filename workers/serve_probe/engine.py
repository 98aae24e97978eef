"""Start the engine replicas of ``engine.json``, wait until they answer, and stop every process
they started, however the probe ends.

Each replica is a process group of its own (``setpgid``: one the probe can kill as a whole, apart
from the probe's own group, in the probe's session), with ``PR_SET_PDEATHSIG`` = SIGKILL on Linux
(a probe killed with SIGKILL takes the replica's leader with it), and a marker in its environment
(``AUTOTUNE_SERVE_ENGINE``) that every descendant inherits: stopping sweeps ``/proc`` for it, so
a grandchild that left the group (a daemonising launcher, ``setsid``) is found too. The driver's
own sweep (``AUTOTUNE_PROBE_MARK``, workers/command.py) covers the case where the probe itself
never got to stop them.

A replica yields the host's cores to the probe's client (:func:`yield_host`): its group runs at the
lowest priority, in the probe's session. The client is the instrument: where it shares the cores
with the engine and waits for one, it sends late, in bursts, and the rate's percentiles are the
host's, not the engine's.

Output goes to ``engine.log`` in the replica's folder, never to the probe's stdout: an engine
prints thousands of lines, the protocol needs a clean channel, and the log is where a failure's
own words are read from. A replica that exits before it is healthy is classified by
``engine.json``'s ``startup_failures`` (the engine's own messages, in order: its KV-cache refusal
is ``oom``), else by the protocol's generic rules; the reason quotes the engine's line.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..process_group import kill_marked
from ..protocol import NODE_ENV, classify_failure
from .failure import ProbeFailure

__all__ = ["Replica", "Engines", "yield_host", "fill", "fit", "free_ports", "startup_failure", "ENGINE_MARK_ENV"]

ENGINE_MARK_ENV = "AUTOTUNE_SERVE_ENGINE"
PORT_NAMES = ("port", "management_port", "metrics_port")
LOG_NAME = "engine.log"
_VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
_TAIL_BYTES = 512 * 1024
_ERRORISH = re.compile(r"\w(Error|Exception)\b|\berror\b|\bFATAL\b|\bCRITICAL\b|Traceback|Killed", re.IGNORECASE)
_PR_SET_PDEATHSIG = 1
REASON_CHARS = 500  # what the driver keeps of a failure's reason (protocol.classify_failure)


def fill(text: str, values: Mapping[str, str]) -> str:
    """``text`` with each ``{name}`` of ``values`` replaced (``str.replace``: other braces, a JSON
    config's among them, are left alone)."""
    for name, value in values.items():
        text = text.replace("{" + name + "}", str(value))
    return text


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on loopback now (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _read_tail(path: Path, limit: int = _TAIL_BYTES) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()


def startup_failure(lines: Sequence[str], rules: Sequence[Sequence[str]]) -> tuple[str, str] | None:
    """(status, reason) of the first rule (``[regex, status, what]``) whose regex some line
    matches; the reason is ``what`` and the engine's own line (the last one matching)."""
    for rule in rules or ():
        if len(rule) < 2:
            continue
        pattern, status = rule[0], rule[1]
        what = rule[2] if len(rule) > 2 else ""
        try:
            rx = re.compile(pattern)
        except re.error:
            continue
        for line in reversed(lines):
            if rx.search(line):
                said = line.strip()[:600]
                return str(status), (f"{what}: {said}" if what else said)
    return None


def fit(text: str, tail: str = "", limit: int = REASON_CHARS) -> str:
    """``text`` + ``tail`` in at most ``limit`` characters, ``text`` cut (the tail says whose
    words they were and is kept whole)."""
    room = max(limit - len(tail), 40)
    if len(text) > room:
        text = text[: room - 3].rstrip() + "..."
    return (text + tail)[:limit]


def _cause(lines: Sequence[str]) -> str:
    """The engine's last line that reads like an error, else its last line."""
    said = [ln.strip() for ln in lines if ln.strip()]
    for line in reversed(said):
        if _ERRORISH.search(line) and not line.startswith(("File ", "^")):
            return line[:400]
    return said[-1][:400] if said else ""


def _own_group_killed_with_probe() -> Callable[[], None]:
    """A ``preexec_fn``: the child leads a process group of its own (in the probe's session:
    ``setpgid``, which Python 3.10's ``Popen`` has no argument for) and, on Linux, is SIGKILLed when
    the probe dies (``PR_SET_PDEATHSIG``)."""
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            prctl = None

    def setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    return setup


# the niceness a replica's processes run at: the lowest priority, below the probe's client
ENGINE_NICENESS = 19


def yield_host(pid: int, niceness: int = ENGINE_NICENESS) -> dict[str, Any]:
    """Lower the priority of the process group led by ``pid`` (a replica just started: every
    process it forks later inherits it); returns what was set (``niceness``) or why not
    (``priority_note``).

    Why: the probe's client shares the host with the engine, and a client that waits for a core
    sends late, in bursts, so the rate's percentiles are the host's, not the engine's. On the 2-core
    machine vLLM's CPU engine (its worker holds a core, its scheduler half another) kept the client's
    event loop waiting 0.1-1.0 s a second for a core while it used 0.03-0.1 of one: 1 % of its
    requests went out 88-633 ms late and the TTFT p99 read 137-757 ms at 8-16 req/s. Niceness alone
    did not help then: each replica was a session of its own, and Linux with
    ``kernel.sched_autogroup_enabled`` weighs every session as one group, whatever its processes'
    niceness. So a replica stays in the probe's session (its own process group only) and runs at
    niceness 19 in it: the client then sent within 2-9 ms of its plan and the p99 read 26-80 ms
    (benchmarks/README.md).
    Against the rest of the host the probe's session weighs as before; where there is no autogroup
    (processes in a cgroup), the niceness orders the engine after the client all the same. Raising
    a niceness needs no privilege."""
    try:
        os.setpriority(os.PRIO_PGRP, pid, niceness)
    except (OSError, AttributeError) as exc:
        return {"priority_note": f"niceness not set: {exc}"}
    return {"niceness": niceness}


@dataclass
class Replica:
    """One engine instance: its launch (placeholders filled), folder, ports and process."""

    index: int
    argv: list[str]
    env: dict[str, str]
    folder: Path
    ports: dict[str, int]
    files: dict[str, str] = field(default_factory=dict)
    role: str = ""  # a disaggregated deployment's "prefill" or "decode" server; "" for an aggregated replica
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    priority: dict[str, Any] = field(default_factory=dict)  # what :func:`yield_host` set

    @property
    def log_path(self) -> Path:
        return self.folder / LOG_NAME

    def start(self, base_env: Mapping[str, str], marker: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, text in self.files.items():
            _write_inside(self.folder, name, text)
        env = dict(base_env)
        env.update(self.env)
        env[ENGINE_MARK_ENV] = marker
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    env=env,
                    cwd=self.folder,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    close_fds=True,
                    preexec_fn=_own_group_killed_with_probe(),  # in the probe's session: see yield_host
                )
            except OSError as exc:
                raise ProbeFailure(
                    "invalid", f"engine replica {self.index} cannot be started: {exc} (argv {self.argv!r})"
                ) from None
        self.started_at = time.monotonic()
        self.priority = yield_host(self.proc.pid)

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_lines(self) -> list[str]:
        return _read_tail(self.log_path)

    def exit_reason(self, when: str, rules: Sequence[Sequence[str]] = ()) -> tuple[str, str]:
        """(status, reason) for a replica that exited ``when`` (e.g. "before it was healthy"):
        ``engine.json``'s startup failures first, then the protocol's generic rules (an
        allocator's out-of-memory message is oom), else a crash quoting the engine's error line."""
        rc = self.returncode()
        lines = self.log_lines()
        head = f"engine replica {self.index} exited with status {rc} {when}"
        if rc is not None and rc < 0:
            head = f"engine replica {self.index} was killed by signal {-rc} {when}"
        found = startup_failure(lines, rules)
        if found is not None:
            return found[0], fit(found[1], f" ({head})")
        status, reason = classify_failure(rc, lines)
        if status in ("oom", "nan", "invalid"):
            return status, fit(f"{head}: {reason}")
        cause = _cause(lines)
        return "crash", fit(f"{head}" + (f": {cause}" if cause else ""))


def _write_inside(root: Path, name: str, text: str) -> Path:
    path = (root / name).resolve()
    if root.resolve() not in path.parents:
        raise ProbeFailure("invalid", f"engine.json names a file outside its folder: {name!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o640)  # MindIE's daemon refuses a config file anyone else may write or read (GetConfigPath)
    return path


def node_values(environ: Mapping[str, str]) -> dict[str, str]:
    """This node's place in a multi-node trial, as the dispatcher tells each node
    (``autotune.dispatch.dispatcher.node_env``): ``{nnodes}``, ``{node_rank}``, ``{master_addr}``,
    ``{master_port}`` for engine.json's argv; {} on one node."""
    if not environ.get("NNODES") or int(environ["NNODES"]) <= 1:
        return {}
    return {name: str(environ.get(var, "")) for name, var in NODE_ENV.items()}


class Engines:
    """Every replica of one trial's ``engine.json``. On a node after the first of a multi-node trial
    (``node``: :func:`node_values`, ``node_rank`` > 0) each replica runs with its ``follower_words``
    (vLLM's ``--headless``): the engine's workers for node 0's instance, no API of its own."""

    def __init__(
        self,
        spec: Mapping[str, Any],
        trial_dir: Path,
        cluster: Mapping[str, Any],
        trial_env: Mapping[str, str],
        node: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.node = dict(node or {})
        self.follower = int(self.node.get("node_rank") or 0) > 0
        self.trial_dir = Path(trial_dir)
        self.api = dict(spec.get("api") or {})
        self.rules = list(spec.get("startup_failures") or [])
        self.marker = f"{os.getpid()}-{time.monotonic_ns()}"
        self.base_env = dict(os.environ)
        self.base_env.update({str(k): str(v) for k, v in trial_env.items()})
        self.replicas: list[Replica] = []
        launches = list(spec.get("replicas") or [])
        if not launches:
            raise ProbeFailure("invalid", "engine.json has no replicas to start")
        visible = self._visible_devices(cluster)
        ports = free_ports(len(PORT_NAMES) * len(launches))
        common = {"trial_dir": str(self.trial_dir)}
        for k, launch in enumerate(launches):
            mine = dict(zip(PORT_NAMES, ports[k * len(PORT_NAMES) : (k + 1) * len(PORT_NAMES)]))
            devices = [int(d) for d in launch.get("devices") or []]
            if visible is not None and any(d >= len(visible) for d in devices):
                raise ProbeFailure(
                    "invalid",
                    f"replica {k} wants devices {devices} but the probe was given only {len(visible)} ({visible})",
                )
            folder = self.trial_dir / f"replica{k}"
            values = {
                **common,
                **{name: str(port) for name, port in mine.items()},
                "replica": str(k),
                "replica_dir": str(folder),
                "devices": ",".join(visible[d] if visible is not None else str(d) for d in devices),
            }
            argv = launch.get("argv")
            if not isinstance(argv, list) or not argv:
                raise ProbeFailure("invalid", f"engine.json replica {k} has no argv list")
            asked = sorted(n for n in NODE_ENV if any("{" + n + "}" in str(a) for a in argv))
            if asked and not self.node:
                raise ProbeFailure(
                    "invalid",
                    f"engine.json replica {k} spans nodes ({', '.join('{' + n + '}' for n in asked)}) but the probe "
                    "runs on one node: the dispatcher starts it on each node of a multi-node trial",
                )
            values.update(self.node)
            if self.follower:
                argv = [*argv, *(launch.get("follower_words") or [])]
            self.replicas.append(
                Replica(
                    k,
                    [fill(str(a), values) for a in argv],
                    {str(n): fill(str(v), values) for n, v in (launch.get("env") or {}).items()},
                    folder,
                    mine,
                    {str(n): fill(str(t), values) for n, t in (launch.get("files") or {}).items()},
                    str(launch.get("role") or ""),
                )
            )
        self.common = common

    @staticmethod
    def _visible_devices(cluster: Mapping[str, Any]) -> list[str] | None:
        """The device ids this probe may use, when its launcher restricted them (Ray sets
        ``ASCEND_RT_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES``): a replica's device indices
        are positions in that list."""
        var = _VISIBLE.get(str(cluster.get("accelerator", "")).lower())
        value = os.environ.get(var, "") if var else ""
        return [d.strip() for d in value.split(",") if d.strip()] if value.strip() else None

    # ------------------------------------------------------------------ start / health
    def start(self) -> None:
        for name, text in (self.spec.get("files") or {}).items():
            _write_inside(self.trial_dir, str(name), fill(str(text), self.common))
        for replica in self.replicas:
            replica.start(self.base_env, self.marker)

    def url(self, replica: Replica, what: str) -> str:
        """``http://127.0.0.1:PORT/path`` of ``what`` (completions, health, metrics) on ``replica``:
        the port named by ``api[what + "_port"]`` (default ``port``)."""
        defaults = {"completions": "/v1/completions", "health": "/health", "metrics": "/metrics"}
        path = str(self.api.get(what, defaults[what]))
        port = replica.ports.get(str(self.api.get(f"{what}_port", "port")), replica.ports["port"])
        return f"http://127.0.0.1:{port}{path if path.startswith('/') else '/' + path}"

    def wait_healthy(self, timeout_s: float, heartbeat: Callable[[float, list[int]], None] | None = None) -> float:
        """Poll every replica's health URL until all answer 200; returns the seconds it took.
        A replica that exits first fails with its own words; one still silent at ``timeout_s``
        fails as ``timeout`` (unless its log already says why, by ``startup_failures``)."""
        t0 = time.monotonic()
        pending = {r.index for r in self.replicas}
        last_answer: dict[int, str] = {}
        next_beat = t0 + 5.0
        while pending:
            for replica in self.replicas:
                if replica.index not in pending:
                    continue
                if replica.returncode() is not None:
                    raise ProbeFailure(*replica.exit_reason("before it was healthy", self.rules))
                ok, said = _probe_health(self.url(replica, "health"))
                if ok:
                    pending.discard(replica.index)
                else:
                    last_answer[replica.index] = said
            if not pending:
                break
            now = time.monotonic()
            if now - t0 >= timeout_s:
                k = min(pending)
                replica = self.replicas[k]
                found = startup_failure(replica.log_lines(), self.rules)
                if found is not None:
                    raise ProbeFailure(
                        found[0], fit(found[1], f" (engine replica {k}, still not healthy after {timeout_s:g} s)")
                    )
                cause = _cause(replica.log_lines())
                raise ProbeFailure(
                    "timeout",
                    fit(
                        f"engine replica {k} never became healthy within {timeout_s:g} s "
                        f"(GET {self.url(replica, 'health')}: {last_answer.get(k, 'no answer')}); "
                        f"its log ends: {cause or '(empty)'}"
                    ),
                )
            if heartbeat is not None and now >= next_beat:
                heartbeat(now - t0, sorted(pending))
                next_beat = now + 5.0
            time.sleep(0.25)
        return time.monotonic() - t0

    def serve_node_0(self, poll_s: float = 0.5) -> Replica:
        """On a follower node: wait while its replicas serve node 0's instance; the first that exits
        (the dispatcher ends the trial by stopping this probe once node 0 has its result)."""
        while True:
            gone = self.dead()
            if gone is not None:
                return gone
            time.sleep(poll_s)

    def dead(self) -> Replica | None:
        """The first replica whose process has exited, if any."""
        for replica in self.replicas:
            if replica.returncode() is not None:
                return replica
        return None

    def priority(self) -> dict[str, Any]:
        """What :func:`yield_host` set on the started replicas: the ``niceness`` where every one got
        it, and a ``priority_note`` naming each replica that kept its priority and why."""
        started = [r for r in self.replicas if r.proc is not None]
        notes = [f"replica {r.index}: {r.priority['priority_note']}" for r in started if "priority_note" in r.priority]
        if notes:
            return {"priority_note": "; ".join(notes)}
        return {"niceness": started[0].priority["niceness"]} if started else {}

    def cpu_s(self) -> tuple[float, float] | None:
        """CPU seconds every started replica's processes have used so far, and their launched
        processes alone (:func:`group_cpu_s`)."""
        seconds = [group_cpu_s(r.proc.pid) for r in self.replicas if r.proc is not None]
        if not seconds or any(x is None for x in seconds):
            return None
        return float(sum(x[0] for x in seconds)), float(sum(x[1] for x in seconds))

    # ------------------------------------------------------------------ stop
    def stop(self, grace_s: float = 10.0) -> str:
        """SIGTERM every replica's group, wait up to ``grace_s`` for them to go, SIGKILL what is
        left (the groups, then every process carrying this probe's marker, wherever it went);
        returns what it took, in words, for the probe's log."""
        started = [r for r in self.replicas if r.proc is not None]
        t0 = time.monotonic()
        for r in started:
            _killpg(r.proc.pid, signal.SIGTERM)
        end = t0 + max(grace_s, 0.0)
        while time.monotonic() < end and any(_group_alive(r.proc.pid) for r in started):
            for r in started:
                r.proc.poll()  # reap a leader that exited (its group id stays reserved by the rest)
            time.sleep(0.05)
        lingering = [r.index for r in started if _group_alive(r.proc.pid)]
        for r in started:
            _killpg(r.proc.pid, signal.SIGKILL)
        for r in started:
            try:
                r.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - an unkillable (D-state) process
                pass
        swept = kill_marked(ENGINE_MARK_ENV, self.marker)
        said = f"stopped {len(started)} engine replica(s) in {time.monotonic() - t0:.1f} s"
        if lingering:
            said += f"; replica(s) {lingering} ignored SIGTERM for {grace_s:g} s and were killed"
        if swept:
            said += f"; {swept} process(es) that had left their replica's process group were killed"
        return said


def _group_stats(pgid: int) -> list[tuple[int, list[str]]]:
    """(pid, its ``/proc/<pid>/stat`` fields after the command name, state first) of every process
    in process group ``pgid``; raises ``OSError`` where there is no ``/proc``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(stat) > 12 and int(stat[2]) == pgid:
            out.append((int(name), stat))
    return out


def group_cpu_s(pgid: int) -> tuple[float, float] | None:
    """CPU seconds (user + system) the living processes of process group ``pgid`` have used, all of
    them and the group's leader alone: an engine replica's whole (vLLM's API server, scheduler and
    workers stay in the group it is started in) and the process the probe launched (vLLM's API
    server). Read from ``/proc/<pid>/stat`` (pid, utime, stime); None where there is no ``/proc``."""
    ticks = float(os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
    try:
        stats = _group_stats(pgid)
    except OSError:
        return None
    total = sum(int(stat[11]) + int(stat[12]) for _, stat in stats)
    leader = sum(int(stat[11]) + int(stat[12]) for pid, stat in stats if pid == pgid)
    return total / ticks, leader / ticks


def _probe_health(url: str) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:  # a loopback URL built here
            return resp.status == 200, f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, f"{type(reason).__name__}: {reason}"[:200]


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """True while some process of the group exists and is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # only zombies left (an unreaped leader) count as gone
        return any(stat[0] not in ("Z", "X") for _, stat in _group_stats(pgid))
    except OSError:
        return True
