"""Dispatch of trials to probes (docs/ARCHITECTURE.md: the probe protocol, and defaults at scale).

A ``Dispatcher`` takes a resolved trial (``TrialRequest``) and how to run its probe
(``ProbeLaunch``), runs it somewhere, and hands back ``ProbeResult``s as they finish:

- ``RayDispatcher`` — the default: one Ray task per trial, reserving the trial's devices as Ray
  resources (``NPU``, ``GPU``, ``CPU``). Without an address it starts a small local Ray in-process;
  with one (``auto``, ``ray://…``, ``host:port``) it joins that cluster. A request the cluster can
  never satisfy is answered at once with an ``invalid`` result naming what was asked and what the
  cluster offers: it never waits forever.
- ``LocalProcessDispatcher`` — the same probes in threads of this process, no Ray
  (``ray: {enabled: false}``, unit tests).
- ``InProcessDispatcher`` — a cheap probe that is a function (the simulator), run synchronously.

Usage::

    with RayDispatcher(None, num_cpus=4, resources=None, run_dir=run_dir) as d:
        h = d.submit(request, ProbeLaunch(argv=[...], resources=resources_for("npu", 8)))
        for handle, result in d.wait_any(timeout=1.0): ...

A cancelled trial still comes back through ``wait_any``, as ``pruned`` (unless it had finished).
``ray`` is imported only inside ``RayDispatcher``, so importing this module is cheap.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import logging
import os
import signal
import shutil
import socket
import tempfile
import threading
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from autotune.workers.protocol import ProbeResult, TrialRequest, write_trial_file

__all__ = [
    "Dispatcher",
    "Handle",
    "InProcessDispatcher",
    "LocalProcessDispatcher",
    "ProbeLaunch",
    "RayDispatcher",
    "RayUnreachable",
    "check_ray_address",
    "probe_env",
    "resources_for",
]

log = logging.getLogger(__name__)

# After a non-forced Ray cancel, how long the task gets to kill its probe's process group
# (SIGTERM, KILL_GRACE_S, SIGKILL) before the worker itself is killed.
_FORCE_CANCEL_AFTER_S = 10.0
_NODE_CACHE_S = 5.0
# Step events go to the driver's sink actor in batches (``_StepBatcher``): at most this many per
# actor call, and none waits longer than this many seconds once the probe's loop polls again.
_STEP_BATCH = 500
_STEP_FLUSH_S = 0.2
# How long a cluster address (``ray.address``, ``--ray-address``) gets to answer before ``ray.init``
# is even tried: Ray's own connect retries for minutes in C++, deaf to SIGTERM (see check_ray_address).
_RAY_CONNECT_TIMEOUT_S = 10.0
_RAY_CLIENT_PORT = 10001  # Ray Client's default port, for a ``ray://host`` without one


@dataclass
class ProbeLaunch:
    """How to run one trial's probe.

    ``argv``: the command (a list, no shell; ``{trial_file}`` is replaced by the trial file's path).
    ``env``: extra environment for the probe (the trial's ``env.VAR`` params are added on top by
    the dispatcher, see ``probe_env``). ``timeout_s``: wall-clock limit of the probe once started.
    ``resources``: the Ray resource request of the task (``resources_for``); ignored by the
    local dispatchers. ``metric_patterns``: metric name -> regex applied to the probe's log
    (``run_probe_process``). ``cwd``: working directory of the probe on the worker.
    """

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = 600.0
    resources: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 1})
    metric_patterns: dict[str, str] | None = None
    cwd: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # name -> text, written in the trial's folder
    stack_log: dict[str, Any] | None = None  # a stack preset's log reader (workers.stack_logs.stack_log)
    nodes: int = 1  # > 1: one process per node, each on its own placement-group bundle (``bundle``)
    bundle: dict[str, float] = field(default_factory=dict)  # one node's share, e.g. {"NPU": 8, "CPU": 1}
    placement_timeout_s: float = 120.0  # how long a multi-node trial waits for its nodes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


NODE_PLACEHOLDERS = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint")


def node_env(node: dict[str, Any]) -> dict[str, str]:
    """What one node of a multi-node trial is told: the same values as the argv placeholders."""
    return {"NNODES": str(node["nnodes"]), "NODE_RANK": str(node["node_rank"]), "MASTER_ADDR": str(node["master_addr"]),
            "MASTER_PORT": str(node["master_port"])}


def visible_devices_env() -> dict[str, str]:
    """The devices Ray assigned this task, as the variables the runtimes read (from Ray's own
    assignment, never guessed): NPU -> ``ASCEND_RT_VISIBLE_DEVICES``, GPU -> ``CUDA_VISIBLE_DEVICES``."""
    try:
        import ray

        ids = ray.get_runtime_context().get_accelerator_ids()
    except Exception:
        return {}
    out = {}
    for name, var in (("NPU", "ASCEND_RT_VISIBLE_DEVICES"), ("GPU", "CUDA_VISIBLE_DEVICES")):
        if ids.get(name):
            out[var] = ",".join(str(i) for i in ids[name])
    return out


def prepare_launch(launch: ProbeLaunch, trial_file: Path) -> tuple[list[str], Any]:
    """On the worker: write the launch's files into a folder of the trial's own (``{trial_dir}``
    in argv names it) and build its stack log reader; the argv to run and the reader."""
    folder = trial_file.parent / f"{trial_file.stem}.files"
    if launch.files:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in launch.files.items():
            (folder / Path(name).name).write_text(text)
    argv = [str(a).replace("{trial_dir}", str(folder)) for a in launch.argv]
    reader = None
    if launch.stack_log:
        from autotune.workers.stack_logs import stack_log

        reader = stack_log(launch.stack_log)
    return argv, reader


def resources_for(accelerator: str, devices: int, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Ray resource request (``.options(**request)``) of a trial using ``devices`` devices.

    ``npu`` -> ``{"num_cpus": 1, "resources": {"NPU": n}}``, ``cuda``/``gpu`` ->
    ``{"num_cpus": 1, "num_gpus": n}``, ``cpu`` -> ``{"num_cpus": n}``. ``override`` (a backend's
    ``resources:`` mapping) replaces the request entirely: a command that submits work elsewhere,
    or a wrapped simulator, needs no devices, e.g. ``{"num_cpus": 0}``.
    """
    if override is not None:
        return dict(override)
    if devices < 0:
        raise ValueError(f"devices must be >= 0, got {devices}")
    kind = accelerator.lower()
    if kind == "npu":
        return {"num_cpus": 1, "resources": {"NPU": devices}}
    if kind in ("cuda", "gpu"):
        return {"num_cpus": 1, "num_gpus": devices}
    if kind == "cpu":
        return {"num_cpus": devices}
    raise ValueError(f"unknown accelerator {accelerator!r}; expected npu, cuda or cpu")


def probe_env(request: TrialRequest, launch: ProbeLaunch) -> dict[str, str]:
    """The environment a probe gets on top of the worker's: ``launch.env``, then the trial's own
    ``env.VAR`` params (they win: they are what is being tuned, and allocator settings such as
    ``PYTORCH_NPU_ALLOC_CONF`` only take effect at process start)."""
    env = {str(k): str(v) for k, v in (launch.env or {}).items()}
    env.update(request.env())
    return env


@dataclass(frozen=True, eq=False)
class Handle:
    """One submitted trial: its number and the dispatcher's own reference (compared by identity)."""

    number: int
    ref: Any = field(repr=False, default=None)


class Dispatcher(ABC):
    """Runs trials' probes and reports them as they finish."""

    @abstractmethod
    def submit(self, request: TrialRequest, launch: ProbeLaunch) -> Handle:
        """Start (or queue) the trial; never blocks on the probe."""

    @abstractmethod
    def wait_any(self, timeout: float | None = None) -> list[tuple[Handle, ProbeResult]]:
        """Block until at least one submitted trial has finished (or ``timeout`` seconds passed)
        and return all finished ones, each exactly once; ``[]`` on timeout or with none pending."""

    @abstractmethod
    def cancel(self, handle: Handle) -> None:
        """Stop the trial (kill its probe's process group); it comes back from ``wait_any`` as
        ``pruned``, or with its own result if it had already finished."""

    @abstractmethod
    def shutdown(self) -> None:
        """Cancel what is still running and release everything (idempotent)."""

    @property
    @abstractmethod
    def pending(self) -> int:
        """Submitted trials not yet returned by ``wait_any``."""

    def step_events(self) -> list[tuple[int, dict[str, Any]]]:
        """``(trial number, event)`` for every ``{"event": "step"}`` the running probes printed
        since the last call, in order (live progress and pruning). Default: none."""
        return []

    def placement_problem(self, resources: dict[str, Any], nodes: int = 1,
                          bundle: dict[str, float] | None = None) -> tuple[str, str] | None:
        """Why a trial with this request cannot be placed (``("never"|"lost", why)``), or None.
        Default: every trial can be placed (this machine's processes)."""
        return None

    def __enter__(self) -> "Dispatcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _crash(exc: BaseException, what: str) -> ProbeResult:
    tail = "".join(traceback.format_exception(exc))[-4000:]
    return ProbeResult("crash", reason=f"{what}: {type(exc).__name__}: {exc}"[:500], log_tail=tail)


def _infrastructure_errors(ray: Any) -> tuple[type, ...]:
    """Ray's exceptions that mean the machine failed, not the probe: a worker process killed
    (``WorkerCrashedError``), a node or its raylet gone, the object or its owner lost."""
    names = ("WorkerCrashedError", "NodeDiedError", "LocalRayletDiedError", "RaySystemError", "ObjectLostError",
             "OwnerDiedError", "ObjectReconstructionFailedError", "ActorDiedError")
    return tuple(cls for name in names if isinstance(cls := getattr(ray.exceptions, name, None), type))


def _trial_file_name(request: TrialRequest, seq: int) -> str:
    return f"trial_{request.number:05d}.json" if request.number >= 0 else f"trial_x{seq:05d}.json"


# ---------------------------------------------------------------------------------------------
# In-process (the simulator)


class InProcessDispatcher(Dispatcher):
    """Runs ``fn(request) -> ProbeResult`` synchronously in ``submit``; for cheap probes (the
    analytical simulator). ``launch`` is ignored and may be omitted. An exception from ``fn`` is
    a ``crash`` result, not an exception."""

    def __init__(self, fn: Callable[[TrialRequest], ProbeResult]) -> None:
        self._fn = fn
        self._done: list[tuple[Handle, ProbeResult]] = []

    def submit(self, request: TrialRequest, launch: ProbeLaunch | None = None) -> Handle:
        handle = Handle(request.number)
        t0 = time.perf_counter()
        try:
            result = self._fn(request)
            if not isinstance(result, ProbeResult):
                raise TypeError(f"probe function returned {type(result).__name__}, not ProbeResult")
        except Exception as exc:
            result = _crash(exc, "probe function raised")
        if not result.wall_s:
            result.wall_s = time.perf_counter() - t0
        self._done.append((handle, result))
        return handle

    def wait_any(self, timeout: float | None = None) -> list[tuple[Handle, ProbeResult]]:
        done, self._done = self._done, []
        return done

    def cancel(self, handle: Handle) -> None:
        pass  # already finished in submit

    def shutdown(self) -> None:
        self._done.clear()

    @property
    def pending(self) -> int:
        return len(self._done)


# ---------------------------------------------------------------------------------------------
# Local processes, no Ray


class LocalProcessDispatcher(Dispatcher):
    """Runs each probe with ``run_probe_process`` in a thread of this process, at most
    ``max_parallel`` at a time (the rest queue). Trial files go to ``run_dir/trials/`` (a
    temporary directory, removed at shutdown, when ``run_dir`` is None). ``on_event(number,
    event)``, if given, receives the probes' events, from the worker threads. Resource requests
    are not checked: this is for one machine whose devices the caller already knows."""

    def __init__(self, max_parallel: int = 1, run_dir: str | Path | None = None,
                 on_event: Callable[[int, dict[str, Any]], None] | None = None) -> None:
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
        self._pool = cf.ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="autotune-probe")
        self._tmp = None if run_dir is not None else tempfile.mkdtemp(prefix="autotune-trials-")
        self._trial_dir = (Path(run_dir) / "trials") if run_dir is not None else Path(self._tmp)
        self._on_event = on_event
        self._steps: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()
        self._futures: dict[cf.Future, Handle] = {}
        self._stops: dict[Handle, threading.Event] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, request: TrialRequest, launch: ProbeLaunch) -> Handle:
        if self._closed:
            raise RuntimeError("dispatcher is shut down")
        stop = threading.Event()
        handle = Handle(request.number, stop)
        path = self._trial_dir / _trial_file_name(request, next(self._seq))
        future = self._pool.submit(self._run, request, launch, path, stop)
        with self._lock:
            self._futures[future] = handle
            self._stops[handle] = stop
        return handle

    def _run(self, request: TrialRequest, launch: ProbeLaunch, path: Path, stop: threading.Event) -> ProbeResult:
        from autotune.workers.command import run_probe_process

        if stop.is_set():
            return ProbeResult("pruned", reason="cancelled before it started")
        if launch.nodes > 1:
            return ProbeResult("invalid", reason=f"the trial spans {launch.nodes} nodes: that needs Ray (ray.enabled: "
                                                 "true, and --ray-address for a cluster)")
        try:
            write_trial_file(request, path)
            number, callback, steps = request.number, self._on_event, self._steps

            def on_event(event: dict[str, Any]) -> None:
                if event.get("event") == "step":
                    steps.append((number, event))  # deque.append is thread-safe
                if callback is not None:
                    callback(number, event)

            argv, reader = prepare_launch(launch, path)
            return run_probe_process(
                argv, probe_env(request, launch), path, launch.timeout_s, cwd=launch.cwd,
                on_event=on_event, should_stop=stop.is_set, metric_patterns=launch.metric_patterns,
                log_reader=reader)
        except Exception as exc:
            return _crash(exc, "running the probe failed")

    def wait_any(self, timeout: float | None = None) -> list[tuple[Handle, ProbeResult]]:
        with self._lock:
            futures = list(self._futures)
        if not futures:
            return []
        done, _ = cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)
        out = []
        with self._lock:
            for future in done:
                handle = self._futures.pop(future)
                self._stops.pop(handle, None)
                if future.cancelled():
                    result = ProbeResult("pruned", reason="cancelled before it started")
                else:
                    try:
                        result = future.result()
                    except BaseException as exc:  # pragma: no cover - _run catches Exception
                        result = _crash(exc, "running the probe failed")
                out.append((handle, result))
        return out

    def cancel(self, handle: Handle) -> None:
        with self._lock:
            stop = self._stops.get(handle)
            future = next((f for f, h in self._futures.items() if h is handle), None)
        if stop is not None:
            stop.set()
        if future is not None:
            future.cancel()  # only succeeds while queued

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for stop in self._stops.values():
                stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._futures)

    def step_events(self) -> list[tuple[int, dict[str, Any]]]:
        out = []
        while self._steps:
            out.append(self._steps.popleft())
        return out


# ---------------------------------------------------------------------------------------------
# Ray


class _StepSink:
    """A Ray actor collecting the running probes' step events for the driver (a Ray task returns
    only at its end; pruning needs the steps while the probe runs)."""

    def __init__(self) -> None:
        self._events: list[tuple[int, dict[str, Any]]] = []
        self._where: dict[int, dict[str, Any]] = {}

    def put(self, number: int, event: dict[str, Any]) -> None:
        self._events.append((number, event))

    def put_many(self, number: int, events: list[dict[str, Any]]) -> None:
        """A batch of one trial's events, in order (``_StepBatcher``: one actor call per batch)."""
        self._events.extend((number, event) for event in events)

    def started(self, number: int, where: dict[str, Any]) -> None:
        """Where trial ``number``'s task runs (node, worker pid): named when that node fails."""
        self._where[number] = where

    def where(self, number: int) -> dict[str, Any]:
        return self._where.get(number, {})

    def drain(self) -> list[tuple[int, dict[str, Any]]]:
        out, self._events = self._events, []
        return out


class _StepBatcher:
    """Sends one trial's step events to the ``_StepSink`` actor in batches, on the task's thread.

    Why batches: every actor call costs the probe's reader loop far more than parsing a line, and
    ``run_probe_process`` gives the output still queued when the probe exits about a second to
    drain. With one call per event, a probe printing >= 10,000 steps lost its final metrics line
    (a ``crash``: "exited 0 without a metrics line"). Events are buffered and sent as one call per
    ``_STEP_BATCH`` events or per ``_STEP_FLUSH_S`` seconds, whichever comes first, so the driver
    still sees them live (pruning reads them): an event after a quiet spell goes out at once, and
    ``tick`` (polled every ~50 ms as ``run_probe_process``'s ``should_stop``) sends what a burst
    left in the buffer. ``flush`` at the end sends the rest. Ray runs one caller's calls to an
    actor in the order they were made, so the events stay in order. Progress is optional: a sink
    that fails is ignored, never the probe."""

    def __init__(self, sink: Any, number: int) -> None:
        self._sink = sink
        self._number = number
        self._events: list[dict[str, Any]] = []
        self._sent = 0.0  # monotonic time of the last call (0: none yet, the first event goes at once)

    def add(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        if len(self._events) >= _STEP_BATCH or time.monotonic() - self._sent >= _STEP_FLUSH_S:
            self.flush()

    def tick(self) -> bool:
        """Send a batch that has waited ``_STEP_FLUSH_S``; always False (never stops the probe)."""
        if self._events and time.monotonic() - self._sent >= _STEP_FLUSH_S:
            self.flush()
        return False

    def flush(self) -> None:
        events, self._events = self._events, []
        self._sent = time.monotonic()
        if events:
            try:
                self._sink.put_many.remote(self._number, events)  # fire and forget
            except Exception:  # progress is optional; the probe's result is not
                pass


def _ray_probe_task(request_data: dict[str, Any], launch_data: dict[str, Any], sink: Any = None,
                    node: dict[str, Any] | None = None) -> dict[str, Any]:
    """Body of the Ray task: on the worker, write the trial file to local disk and run the probe;
    step events go to ``sink`` (a :class:`_StepSink` actor) as they come, in batches
    (:class:`_StepBatcher`). ``node``: this task is one node of a multi-node trial (``nnodes``,
    ``node_rank``, ``master_addr``, ``master_port`` fill the argv placeholders and the
    environment; only node 0 streams step events)."""
    from autotune.workers.command import run_probe_process
    from autotune.workers.protocol import TrialRequest as _Request

    request = _Request(**request_data)
    launch = ProbeLaunch(**launch_data)
    number = request.number
    if node is not None:
        values = {**node, "rdzv_endpoint": f"{node['master_addr']}:{node['master_port']}"}
        argv = list(launch.argv)
        for key in NODE_PLACEHOLDERS:
            argv = [str(a).replace("{" + key + "}", str(values[key])) for a in argv]
        launch = ProbeLaunch(**{**launch_data, "argv": argv, "env": {**launch.env, **node_env(node)}})
        if int(node["node_rank"]) != 0:
            sink = None
    launch.env.update({k: v for k, v in visible_devices_env().items() if k not in launch.env})
    if sink is not None:
        try:
            import ray

            ctx = ray.get_runtime_context()
            sink.started.remote(number, {"node_ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                                         "worker_pid": os.getpid()})
        except Exception:  # where it ran is for the failure's reason only
            pass

    batcher = _StepBatcher(sink, number) if sink is not None else None

    def on_event(event: dict[str, Any]) -> None:
        if batcher is not None and event.get("event") == "step":
            batcher.add(event)  # a list append, mostly: never slows the reading of the probe's output

    with tempfile.TemporaryDirectory(prefix="autotune-trial-") as tmp:
        path = write_trial_file(request, Path(tmp) / "trial.json")
        argv, reader = prepare_launch(launch, Path(path))
        try:
            result = run_probe_process(argv, probe_env(request, launch), path, launch.timeout_s, cwd=launch.cwd,
                                       metric_patterns=launch.metric_patterns, on_event=on_event, log_reader=reader,
                                       should_stop=batcher.tick if batcher is not None else None)
        finally:
            if batcher is not None:
                batcher.flush()  # the last batch, before the result: the driver sees every event
    result.info.setdefault("host", socket.gethostname())
    for var in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        if os.environ.get(var):
            result.info.setdefault(var, os.environ[var])
    return result.to_json()


class RayUnreachable(ConnectionError):
    """The Ray cluster address does not answer. A ``ConnectionError`` (an ``OSError``, not a
    ``ValueError``): the CLI reports it as an infrastructure failure (exit 3), not a bad spec."""


def _ray_endpoint(address: str) -> tuple[str, int, str] | None:
    """What ``ray.init(address=...)`` will connect to: ``(host, port, what)``, or None when that
    cannot be told here (Ray then answers for itself, at once: no cluster found, a bad address).

    ``ray://host[:port]`` is Ray Client's server on ``host`` (port 10001 by default); ``auto`` is
    ``RAY_ADDRESS`` or the cluster last started on this machine; ``host:port`` is the head's GCS, as
    Ray itself rewrites it (a loopback host becomes this node's IP: the check asks what Ray asks)."""
    from urllib.parse import urlsplit

    addr = address.strip()
    if addr == "auto":
        addr = os.environ.get("RAY_ADDRESS", "").strip() or "auto"
    if addr.startswith("ray://"):
        try:
            parts = urlsplit("//" + addr[len("ray://"):])
            host, port = parts.hostname, parts.port or _RAY_CLIENT_PORT
        except ValueError:
            return None
        return (host, port, "Ray Client server") if host else None
    try:
        from ray._private.services import canonicalize_bootstrap_address

        resolved = canonicalize_bootstrap_address(addr) or ""
    except Exception:  # a private helper that moved, or no cluster for "auto": Ray says why itself
        resolved = "" if addr == "auto" else addr
    try:
        parts = urlsplit("//" + resolved)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    return (host, port, "GCS") if host and port else None


def check_ray_address(address: str, timeout_s: float = _RAY_CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`RayUnreachable`, naming ``address``, when nothing accepts a TCP connection at
    the Ray cluster address within ``timeout_s`` seconds (retried while refused: a head that is
    just starting gets the time).

    Why before ``ray.init``: for a ``host:port`` nobody listens on, Ray 2.60 retries its GCS
    connection in C++ (5 s per try, ``NUM_REDIS_GET_RETRIES`` = 20 tries) and was seen to hang
    over 330 s without an error, with SIGTERM acting only ~32 s later; for ``ray://`` Ray Client
    gives up after ~32 s with "ray client connection timeout", naming no address. Ray offers no overall timeout for ``ray.init`` (ray-project/ray#46863: the maintainers
    suggest a timer of the caller's own), and these checks are plain sockets, so SIGTERM and
    Ctrl-C act at once. A port that answers is then left to Ray."""
    endpoint = _ray_endpoint(address)
    if endpoint is None:
        return
    host, port, what = endpoint
    deadline = time.monotonic() + timeout_s
    error: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(3.0, left))):
                return
        except OSError as exc:
            error = exc
        if deadline - time.monotonic() <= 0.5:
            break
        time.sleep(0.5)
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    where = "" if shown in address else f" (Ray connects to its {what} at {shown})"
    if error is None or isinstance(error, TimeoutError):
        why = "no answer"
    else:
        why = error.strerror or str(error) or type(error).__name__
    raise RayUnreachable(
        f"cannot reach the Ray cluster at {address}{where}: {why} (tried for {timeout_s:g} s). Is the cluster "
        "up (`ray status` on its head) and the address right (ray.address, --ray-address: host:port is the "
        f"head's GCS port, 6379 by default; ray://host:port its Ray Client port, {_RAY_CLIENT_PORT} by default)?")


def _route_ray_messages() -> None:
    """Ray's driver prints the cluster's error messages ("(raylet) A worker died or was killed
    ...") to stdout, where ``--json`` data goes: send them through autotune's log (stderr,
    formatted) instead. Ray looks the printer up at each message, so replacing it takes effect."""
    try:
        import ray._private.worker as ray_worker
    except ImportError:  # pragma: no cover - a Ray without it prints nothing of the kind
        return
    if getattr(ray_worker.print_to_stdstream, "_autotune", False):
        return

    def to_log(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        for line in data.get("lines") or []:
            log.warning("ray (%s): %s", data.get("pid", "?"), str(line).strip()[:1000])

    to_log._autotune = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = to_log


def _python_handler(signum: int) -> Any:
    """The Python handler installed for ``signum`` (None when default/ignored, or off the main
    thread): Ray's start may replace it, and the driver's own stop-and-save must survive that."""
    if threading.current_thread() is not threading.main_thread():
        return None
    handler = signal.getsignal(signum)
    return handler if callable(handler) else None


def _requirements(resources: dict[str, Any]) -> dict[str, float]:
    """A ``.options()`` request as Ray resource amounts (``num_cpus`` defaults to 1, as in Ray)."""
    need: dict[str, float] = {"CPU": float(resources.get("num_cpus", 1) or 0)}
    if resources.get("num_gpus"):
        need["GPU"] = float(resources["num_gpus"])
    if resources.get("memory"):
        need["memory"] = float(resources["memory"])
    for name, amount in (resources.get("resources") or {}).items():
        need[str(name)] = need.get(str(name), 0.0) + float(amount)
    return {k: v for k, v in need.items() if v > 0}


def _fmt(amounts: dict[str, float]) -> str:
    def num(v: float) -> str:
        return f"{v:g}" if v < 1e6 else f"{v / 2**30:.1f} GiB"
    return "{" + ", ".join(f"{k}: {num(v)}" for k, v in amounts.items()) + "}"


def _holds(node: dict[str, float], need: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) >= v for k, v in need.items())


def _bundle_node(pg: Any, index: int) -> str:
    """The node a placement group's bundle was placed on (``address:port``), for a node task that
    died before it could say where it ran."""
    import ray
    from ray.util.placement_group import placement_group_table

    try:
        node_id = placement_group_table(pg)["bundles_to_node_id"][index]
        node = next(n for n in ray.nodes() if n.get("NodeID") == node_id)
        return f"{_node_name(node)}, node {str(node_id)[:12]}"
    except Exception:  # the table or the node is gone: say what is known
        return "its node is unknown"


def _node_name(node: dict[str, Any]) -> str:
    """A node as a person finds it: its address and raylet port (several nodes may share a host)."""
    return f"{node.get('NodeManagerAddress', '?')}:{node.get('NodeManagerPort', '?')}"


def _node_address() -> tuple[str, int]:
    """On the first node of a multi-node trial: its address and a free port for the rendezvous."""
    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _unfinished(ray: Any, refs: list[Any]) -> list[Any]:
    """The refs whose tasks have not finished: the only ones any cancel may touch (a cancel
    racing a finishing task's reply can kill the driver, see ``stop_tasks``)."""
    if not refs:
        return []
    _, running = ray.wait(refs, num_returns=len(refs), timeout=0)
    return running


def stop_tasks(ray: Any, refs: list[Any], grace_s: float = _FORCE_CANCEL_AFTER_S) -> list[Any]:
    """Stop the unfinished tasks of ``refs``: a polite cancel (the task gets a KeyboardInterrupt
    and kills its probe's process group), up to ``grace_s`` for them to end, then a forced cancel
    of those that did not. Returns the refs that had to be forced.

    Only unfinished tasks are cancelled, and only ignored cancels are forced: a cancel that races
    the reply of a task finishing at that moment can kill the driver in Ray's task submitter (a
    ``RAY_CHECK`` in the PushNormalTask callback, exit 1 with a C++ backtrace; ray-project/ray
    PRs 54527/54798 fixed one such race). Seen once in ~20 interrupted studies when every
    task was cancelled and force-cancelled, finished or not."""
    running = _unfinished(ray, refs)
    for ref in running:
        try:
            ray.cancel(ref, force=False)
        except Exception as exc:  # pragma: no cover - already gone
            log.debug("cancel failed: %s", exc)
    if not running:
        return []
    _, stuck = ray.wait(running, num_returns=len(running), timeout=grace_s)
    for ref in stuck:
        try:
            ray.cancel(ref, force=True)
        except Exception as exc:  # pragma: no cover
            log.debug("force cancel failed: %s", exc)
    return stuck


def _bundle_options(bundle: dict[str, float]) -> dict[str, Any]:
    """A bundle's amounts as a task's ``.options()`` (CPU and GPU by name, the rest as resources)."""
    other = {k: float(v) for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": float(bundle.get("CPU", 0)), "num_gpus": float(bundle.get("GPU", 0)),
            **({"resources": other} if other else {})}


def _ray_multinode_task(request_data: dict[str, Any], launch_data: dict[str, Any], sink: Any = None) -> dict[str, Any]:
    """One trial over ``launch.nodes`` nodes: a placement group of one bundle per node
    (``STRICT_SPREAD``: each on its own node) reserves every node's devices at once; node 0's
    address and a free port there become the rendezvous; one probe task per bundle runs the
    launch with ``{nnodes} {node_rank} {master_addr} {master_port}`` filled in. The first node to
    fail ends the trial on every node (its reason names the node); the group is removed however
    the trial ends. The result is node 0's, with every node's address in ``info.nodes``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    launch = ProbeLaunch(**launch_data)
    n, bundle = int(launch.nodes), dict(launch.bundle)
    pg = placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_SPREAD",
                         name=f"autotune-trial-{request_data.get('number')}")
    refs: list[Any] = []
    try:
        ready, _ = ray.wait([pg.ready()], timeout=launch.placement_timeout_s)
        if not ready:
            free = ray.available_resources()
            return ProbeResult("infra", reason=(
                f"the trial's {n} nodes could not be reserved within {launch.placement_timeout_s:g} s: it needs "
                f"{n} bundles of {_fmt(bundle)} on distinct nodes (placement group, STRICT_SPREAD); the cluster has "
                f"{_fmt({k: free.get(k, 0.0) for k in bundle})} free now")).to_json()
        addr, port = ray.get(ray.remote(num_cpus=0)(_node_address).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)).remote())
        task = ray.remote(max_retries=0)(_ray_probe_task)
        for rank in range(n):
            node = {"nnodes": n, "node_rank": rank, "master_addr": addr, "master_port": port}
            refs.append(task.options(**_bundle_options(bundle), scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank)).remote(request_data, launch_data, sink, node))
        results: dict[int, ProbeResult] = {}
        while len(results) < n:
            left = [r for i, r in enumerate(refs) if i not in results]
            done, _ = ray.wait(left, num_returns=1)
            rank = refs.index(done[0])
            try:
                result = ProbeResult.from_json(ray.get(done[0]))
            except Exception as exc:
                kind = "infra" if isinstance(exc, _infrastructure_errors(ray)) else "crash"
                result = ProbeResult(kind, reason=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if rank > 0 and result.status == "crash" and result.info.get("returncode") == 0 and not result.metrics:
                result = ProbeResult("ok", steps=result.steps, info=result.info)  # only node 0 reports metrics
            results[rank] = result
            if not result.ok and result.status != "pruned":
                host = result.info.get("host") or _bundle_node(pg, rank)
                failed = ProbeResult(result.status, metrics=result.metrics, steps=result.steps, log_tail=result.log_tail,
                                     reason=f"node {rank} of {n} ({host}) failed: {result.reason}"[:2000],
                                     info={**result.info, "failed_node": rank})
                return failed.to_json()  # the finally below stops the other nodes
        first = results[0]
        first.info["nodes"] = [{"node_rank": r, "host": results[r].info.get("host"),
                                **{k: results[r].info[k] for k in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
                                   if k in results[r].info}} for r in sorted(results)]
        return first.to_json()
    finally:  # a failed or cancelled trial: the other nodes' probes end within seconds
        stop_tasks(ray, refs)
        remove_placement_group(pg)


class RayDispatcher(Dispatcher):
    """One Ray task per trial (``max_retries=0``, the launch's resource request as options).

    ``address=None`` starts a local Ray in this process with ``num_cpus`` (default: the machine's
    cores) and custom ``resources`` (e.g. ``{"NPU": 8}`` on an NPU node whose devices Ray cannot
    detect), no dashboard, no log forwarding, a small object store, ``RAY_AUTH_MODE=disabled`` and
    usage stats off (both set in ``os.environ`` unless already set). Otherwise it connects to
    ``address`` (``auto``, ``ray://host:10001``, ``host:6379``) and ``num_cpus``/``resources`` are
    ignored. If Ray is already initialised in this process, that instance is used and left running.

    ``run_dir``: a copy of every trial file is kept in ``run_dir/trials/`` (the probe itself reads
    one written on its worker's local disk: the driver sends the request, not a path).
    """

    def __init__(self, address: str | None = None, num_cpus: int | None = None,
                 resources: dict[str, float] | None = None, run_dir: str | Path | None = None, *,
                 object_store_memory: int | None = 128 * 2**20, check_feasible: bool = True) -> None:
        import ray

        self._ray = ray
        self._owns_ray = False
        self._check_feasible = check_feasible
        if not ray.is_initialized():
            self._init_ray(address, num_cpus, resources, object_store_memory)
            self._owns_ray = True
        self._task = ray.remote(max_retries=0)(_ray_probe_task)
        self._multinode = ray.remote(num_cpus=0, max_retries=0)(_ray_multinode_task)
        self._sink = ray.remote(num_cpus=0)(_StepSink).remote()
        self._trial_dir = Path(run_dir) / "trials" if run_dir is not None else None
        self._refs: dict[Any, Handle] = {}  # ObjectRef -> Handle
        self._ready: list[tuple[Handle, ProbeResult]] = []  # answered without running (infeasible)
        self._cancelled: dict[Handle, float] = {}  # handle -> when the polite cancel was sent
        self._nodes: tuple[float, list[dict[str, float]]] | None = None
        self._seen_nodes: dict[str, dict[str, Any]] = {}  # node id -> resources and address, once seen alive
        self._dead_nodes: set[str] = set()
        self._seq = itertools.count()
        self._closed = False

    def _init_ray(self, address, num_cpus, resources, object_store_memory) -> None:
        ray = self._ray
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                                      logging_level=logging.WARNING)
        if address is None:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            kwargs.update(address="local", num_cpus=num_cpus if num_cpus is not None else (os.cpu_count() or 1))
            if resources:
                kwargs["resources"] = dict(resources)
            if object_store_memory:
                kwargs["object_store_memory"] = int(object_store_memory)
        else:
            if num_cpus is not None or resources:
                log.warning("connecting to the Ray cluster at %s: num_cpus/resources are ignored "
                            "(the cluster's nodes declare their own)", address)
            kwargs["address"] = address
            check_ray_address(address)  # an address nobody answers at: an error now, not a hang in ray.init
        # Without CANN, Ray's NPU detection logs a harmless "No module named 'acl'" traceback.
        npu_log = logging.getLogger("ray._private.accelerators.npu")
        level = npu_log.level
        try:
            import importlib.util

            if importlib.util.find_spec("acl") is None:
                npu_log.setLevel(logging.CRITICAL)
        except (ImportError, ValueError):
            pass
        sigterm = _python_handler(signal.SIGTERM)
        try:
            ray.init(**kwargs)
            _route_ray_messages()
        finally:
            npu_log.setLevel(level)
            if sigterm is not None and signal.getsignal(signal.SIGTERM) is not sigterm:
                signal.signal(signal.SIGTERM, sigterm)  # the CLI's: save the study, exit 143

    # -- feasibility -------------------------------------------------------------------------

    def _node_resources(self, refresh: bool = False) -> list[dict[str, float]]:
        now = time.monotonic()
        if refresh or self._nodes is None or now - self._nodes[0] > _NODE_CACHE_S:
            nodes = []
            for n in self._ray.nodes():
                if n.get("Alive"):
                    resources = dict(n.get("Resources") or {})
                    nodes.append(resources)
                    # a dead node's entry has no resources: what each node had is remembered here
                    self._seen_nodes[str(n.get("NodeID"))] = {"resources": resources, "address": _node_name(n)}
                else:
                    self._dead_nodes.add(str(n.get("NodeID")))
            self._nodes = (now, nodes)
        return self._nodes[1]

    def lost_nodes(self, need: dict[str, float] | None = None) -> list[str]:
        """The nodes this dispatcher saw alive that the cluster has lost since (those that could
        hold ``need``, when given), each as ``address (node id)``."""
        self._node_resources(refresh=True)
        return [f"{seen['address']} (node {node_id[:12]})" for node_id, seen in self._seen_nodes.items()
                if node_id in self._dead_nodes and (need is None or _holds(seen["resources"], need))]

    def placement_problem(self, resources: dict[str, Any], nodes: int = 1,
                          bundle: dict[str, float] | None = None) -> tuple[str, str] | None:
        """Why a trial with this request can not be placed: ``("never", why)`` when the cluster
        never had what it needs (a bad study for this cluster: refuse it before any trial), or
        ``("lost", why)`` when it had it and has lost the nodes since (an infrastructure failure:
        stop, and resume once they are back); None when it can be placed."""
        if nodes > 1:
            need = {k: float(v) for k, v in (bundle or {}).items() if v}
            alive = self._node_resources(refresh=True)
            holding = [nd for nd in alive if _holds(nd, need)]
            if len(holding) >= nodes:
                return None
            lost = self.lost_nodes(need)
            per_node = ", ".join(_fmt({k: nd.get(k, 0.0) for k in need}) for nd in alive)
            why = (f"the trial spans {nodes} nodes of {_fmt(need)} each, but only {len(holding)} node(s) of the "
                   f"Ray cluster can hold that (per node: {per_node})")
            if len(holding) + len(lost) >= nodes:
                return "lost", f"{why}: the cluster lost {', '.join(lost)}, which held it"
            return "never", f"{why}; the cluster can never place it"
        why = self.infeasible_reason(resources)
        if why is None:
            return None
        lost = self.lost_nodes(_requirements(resources))
        if lost:
            return "lost", f"{why}: the cluster lost {', '.join(lost)}, which could hold it"
        return "never", why

    def infeasible_reason(self, resources: dict[str, Any]) -> str | None:
        """Why a task with this request could never run on the live cluster, or None if one node
        can hold it (a single task runs on one node)."""
        need = _requirements(resources)
        if not need:
            return None
        for refresh in (False, True):  # a cached "no" is re-checked against the live cluster
            nodes = self._node_resources(refresh)
            if any(_holds(node, need) for node in nodes):
                return None
        total: dict[str, float] = {}
        for node in nodes:
            for k, v in node.items():
                total[k] = total.get(k, 0.0) + v
        shown = {k: total.get(k, 0.0) for k in ("CPU", "GPU", "NPU") if k in total or k in need}
        shown.update({k: total.get(k, 0.0) for k in need if k not in shown})
        if all(total.get(k, 0.0) >= v for k, v in need.items()):
            return (f"needs {_fmt(need)} on one node but no node of the Ray cluster has it "
                    f"(the cluster offers {_fmt(shown)} over {len(nodes)} nodes)")
        return f"needs {_fmt(need)} but the Ray cluster offers {_fmt(shown)}"

    # -- Dispatcher ----------------------------------------------------------------------------

    def submit(self, request: TrialRequest, launch: ProbeLaunch) -> Handle:
        if self._closed:
            raise RuntimeError("dispatcher is shut down")
        seq = next(self._seq)
        if self._trial_dir is not None:
            write_trial_file(request, self._trial_dir / _trial_file_name(request, seq))
        if launch.nodes > 1:
            return self._submit_multinode(request, launch)
        options = dict(launch.resources or {})
        problem = self.placement_problem(options) if self._check_feasible else None
        if problem is not None:
            return self._unplaced(request, problem)
        try:
            ref = self._task.options(**options).remote(request.to_json(), launch.to_json(), self._sink)
        except (TypeError, ValueError) as exc:  # a malformed resource request
            handle = Handle(request.number, None)
            self._ready.append((handle, ProbeResult("invalid", reason=f"bad Ray resource request {options!r}: {exc}")))
            return handle
        handle = Handle(request.number, ref)
        self._refs[ref] = handle
        return handle

    def _submit_multinode(self, request: TrialRequest, launch: ProbeLaunch) -> Handle:
        """A trial over several nodes: refused at once when no ``launch.nodes`` nodes of the
        cluster could ever hold one bundle each; else a coordinator task (no CPU of its own)
        reserves them with a placement group and runs the node tasks."""
        problem = self.placement_problem({}, launch.nodes, launch.bundle) if self._check_feasible else None
        if problem is not None:
            return self._unplaced(request, problem)
        # the coordinator stays on the driver's node: if a trial's node dies, the coordinator
        # (which owns the placement group) survives to report it and free the other nodes
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(self._ray.get_runtime_context().get_node_id(), soft=True)
        ref = self._multinode.options(scheduling_strategy=here).remote(request.to_json(), launch.to_json(), self._sink)
        handle = Handle(request.number, ref)
        self._refs[ref] = handle
        return handle

    def _unplaced(self, request: TrialRequest, problem: tuple[str, str]) -> Handle:
        """A trial answered without running: ``invalid`` when the cluster never had what it needs;
        ``infra`` (``info.capacity_lost``) when it had it and lost the nodes: not the config's fault."""
        kind, why = problem
        handle = Handle(request.number, None)
        if kind == "lost":
            result = ProbeResult("infra", reason=f"not started: {why}", info={"capacity_lost": self.lost_nodes()})
        else:
            result = ProbeResult("invalid", reason=why)
        self._ready.append((handle, result))
        return handle

    def wait_any(self, timeout: float | None = None) -> list[tuple[Handle, ProbeResult]]:
        out, self._ready = self._ready, []
        if out or not self._refs:
            if out and self._refs:
                out.extend(self._collect(0))
            return out
        return self._collect(timeout)

    def _collect(self, timeout: float | None) -> list[tuple[Handle, ProbeResult]]:
        ray = self._ray
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            self._escalate_cancels()
            refs = list(self._refs)
            step = None if end is None else max(0.0, end - time.monotonic())
            if self._cancelled:  # wake up to escalate a cancel that the task does not honour
                step = 1.0 if step is None else min(step, 1.0)
            ready, _ = ray.wait(refs, num_returns=1, timeout=step)
            if ready:
                break
            if end is not None and time.monotonic() >= end:
                return []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for ref in ready:
            handle = self._refs.pop(ref)
            cancelled = self._cancelled.pop(handle, None) is not None
            try:
                result = ProbeResult.from_json(ray.get(ref))
            except Exception as exc:
                if cancelled or isinstance(exc, ray.exceptions.TaskCancelledError) or \
                        isinstance(getattr(exc, "cause", None), ray.exceptions.TaskCancelledError):
                    result = ProbeResult("pruned", reason="cancelled by the driver")
                elif isinstance(exc, _infrastructure_errors(ray)):
                    result = self._infra(handle, exc)
                else:
                    result = _crash(exc, "the Ray task failed")
            if result.status == "infra" and "capacity_lost" not in result.info:
                lost = self.lost_nodes()  # a node gone for good, not a worker restarted
                if lost:
                    result.info["capacity_lost"] = lost
            out.append((handle, result))
        return out

    def _infra(self, handle: Handle, exc: BaseException) -> ProbeResult:
        """The infrastructure failed under the trial (its worker or node died): not the config's
        failure. The reason names the node the task ran on."""
        try:
            where = self._ray.get(self._sink.where.remote(handle.number), timeout=5)
        except Exception:
            where = {}
        node = (f"node {where.get('node_ip')} ({str(where.get('node_id', ''))[:12]}), Ray worker pid "
                f"{where.get('worker_pid')}" if where else "a node it never reported from")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ProbeResult("infra", reason=f"infrastructure failure on {node}: {type(exc).__name__}: {first}"[:500],
                           info={"node": where} if where else {})

    def _escalate_cancels(self) -> None:
        """Force the cancels a task ignored for ``_FORCE_CANCEL_AFTER_S``; a task that finished
        meanwhile (its result not yet collected) is left alone, as in ``cancel``."""
        now = time.monotonic()
        overdue = {handle.ref: handle for handle, since in self._cancelled.items()
                   if since >= 0 and now - since > _FORCE_CANCEL_AFTER_S and handle.ref in self._refs}
        for ref in _unfinished(self._ray, list(overdue)):
            handle = overdue[ref]
            log.warning("trial %d did not stop after a cancel; killing its Ray worker", handle.number)
            try:
                self._ray.cancel(ref, force=True)
            except Exception as exc:  # pragma: no cover
                log.debug("force cancel failed: %s", exc)
            self._cancelled[handle] = -1.0  # escalated

    def cancel(self, handle: Handle) -> None:
        if handle.ref is None or handle.ref not in self._refs or handle in self._cancelled:
            return
        # A task that has finished is not cancelled: a cancel racing its reply can kill the driver
        # in Ray's task submitter (stop_tasks). wait_any returns its result as measured.
        if not _unfinished(self._ray, [handle.ref]):
            return
        # Politely first: the task gets a KeyboardInterrupt and run_probe_process kills the probe's
        # whole process group. ray.cancel(force=True) kills the worker and its direct children
        # only (grandchildren in the probe's own session survive it; the probe's watchdog then
        # cleans up): it is the fallback, _FORCE_CANCEL_AFTER_S later.
        try:
            self._ray.cancel(handle.ref, force=False)
        except Exception as exc:  # pragma: no cover
            log.debug("cancel failed: %s", exc)
        self._cancelled[handle] = time.monotonic()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        stop_tasks(ray, list(self._refs))
        self._refs.clear()
        self._ready.clear()
        self._cancelled.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    @property
    def pending(self) -> int:
        return len(self._refs) + len(self._ready)

    def step_events(self) -> list[tuple[int, dict[str, Any]]]:
        if self._closed:
            return []
        try:
            return self._ray.get(self._sink.drain.remote(), timeout=10)
        except Exception as exc:  # the sink is only for progress and pruning: never fatal
            log.debug("reading step events failed: %s", exc)
            return []
