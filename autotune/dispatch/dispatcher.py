"""Dispatch of trials to probes (docs/ARCHITECTURE.md: the probe protocol, and defaults at scale).

A ``Dispatcher`` takes a resolved trial (``TrialRequest``) and how to run its probe
(``ProbeLaunch``), runs it somewhere, and hands back ``ProbeResult``s as they finish:

- ``RayDispatcher`` (:mod:`autotune.dispatch.ray_dispatch`; the code that runs inside Ray is
  :mod:`autotune.dispatch.ray_tasks`) — the default: one Ray task per trial, reserving the trial's devices as Ray
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
This module holds the contract, the launch and the dispatchers without Ray; ``ray`` is imported
only by the Ray modules, so importing this one is cheap.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import logging
import shutil
import tempfile
import threading
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from autotune.workers.protocol import NODE_ENV, ProbeResult, TrialRequest, attach_requests_file, write_trial_file
from autotune.workers.command import OOM_EXIT_GRACE_S

__all__ = [
    "Dispatcher",
    "DispatchSettings",
    "Handle",
    "InProcessDispatcher",
    "LocalProcessDispatcher",
    "ProbeLaunch",
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


@dataclass(frozen=True)
class DispatchSettings:
    """How a study's probes are dispatched, made once from the spec by the assembly
    (:func:`autotune.cli.assembly.dispatcher_for` builds the dispatcher from it)."""

    simulated: bool  # the analytical model answers in the driver: no process, no Ray
    use_ray: bool  # ray.enabled: Ray tasks; false: local process groups on this machine
    ray_address: str | None  # ray.address: the cluster to join; None starts a local Ray in this process
    ray_num_cpus: int | None  # ray.num_cpus: the CPUs a local Ray offers (default: the machine's cores)
    max_parallel: int  # search.parallel_trials: the probes the local pool runs at once


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
    # the trial's result is node 0's as soon as it has one: the other nodes only serve it (a serving
    # instance across nodes, whose headless workers run until they are stopped)
    ends_with_node_0: bool = False
    # a device OOM the probe does not exit after within this long: stopped (workers.command.OOM_EXIT_GRACE_S)
    oom_exit_grace_s: float | None = OOM_EXIT_GRACE_S

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


NODE_PLACEHOLDERS = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint")


def node_env(node: dict[str, Any]) -> dict[str, str]:
    """What one node of a multi-node trial is told: the same values as the argv placeholders."""
    return {var: str(node[name]) for name, var in NODE_ENV.items()}


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


def run_probe(
    request: TrialRequest,
    launch: ProbeLaunch,
    trial_file: Path,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> ProbeResult:
    """On the worker, one probe from start to result: write the trial file, the launch's files and
    its log reader (:func:`prepare_launch`), run the probe's process group with the trial's
    environment (:func:`probe_env`), and attach the serving probe's per-request records while the
    trial's folder still exists. The local pool and Ray's task run it alike; only what they do
    with the step events (``on_event``) and how they are stopped (``should_stop``) differ."""
    # looked up at each call, not bound at import: tests replace workers.command.run_probe_process
    # (tests/test_golden_study.py gives a profiled study walls by layers, so its budget is the same each run)
    from autotune.workers.command import run_probe_process

    write_trial_file(request, trial_file)
    argv, reader = prepare_launch(launch, trial_file)
    result = run_probe_process(
        argv,
        probe_env(request, launch),
        trial_file,
        launch.timeout_s,
        cwd=launch.cwd,
        on_event=on_event,
        should_stop=should_stop,
        metric_patterns=launch.metric_patterns,
        log_reader=reader,
        oom_exit_grace_s=launch.oom_exit_grace_s,
    )
    return attach_requests_file(result)


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

    def result_of(self, handle: Handle) -> ProbeResult:
        """Block until ``handle``'s probe has finished and return its result: for a caller that runs
        one probe at a time (a scaling study, the collectives across nodes), so no other result can
        come back meanwhile."""
        while True:
            for done, result in self.wait_any(timeout=1.0):
                if done == handle:
                    return result

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

    def placement_problem(
        self, resources: dict[str, Any], nodes: int = 1, bundle: dict[str, float] | None = None
    ) -> tuple[str, str] | None:
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
    names = (
        "WorkerCrashedError",
        "NodeDiedError",
        "LocalRayletDiedError",
        "RaySystemError",
        "ObjectLostError",
        "OwnerDiedError",
        "ObjectReconstructionFailedError",
        "ActorDiedError",
    )
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

    @classmethod
    def from_settings(cls, settings: DispatchSettings) -> "LocalProcessDispatcher":
        """The local pool a study's :class:`DispatchSettings` ask for."""
        return cls(max_parallel=settings.max_parallel)

    def __init__(
        self,
        max_parallel: int = 1,
        run_dir: str | Path | None = None,
        on_event: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
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
        if stop.is_set():
            return ProbeResult("pruned", reason="cancelled before it started")
        if launch.nodes > 1:
            return ProbeResult(
                "invalid",
                reason=f"the trial spans {launch.nodes} nodes: that needs Ray (ray.enabled: "
                "true, and --ray-address for a cluster)",
            )
        number, callback, steps = request.number, self._on_event, self._steps

        def on_event(event: dict[str, Any]) -> None:
            if event.get("event") == "step":
                steps.append((number, event))  # deque.append is thread-safe
            if callback is not None:
                callback(number, event)

        try:
            return run_probe(request, launch, path, on_event, stop.is_set)
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
