"""The Ray dispatcher: one Ray task per trial, the trial's devices reserved as Ray resources.

Without an address it starts a small local Ray in-process; with one (``auto``, ``ray://…``,
``host:port``) it joins that cluster, after checking the address answers (Ray's own connect has no
overall timeout). A request the cluster can never satisfy is answered at once (``invalid``, or
``infra`` where the cluster lost the nodes that held it); a trial that spans nodes goes through a
placement group (:mod:`autotune.dispatch.ray_tasks`).

Why one module of over 500 lines: the dispatcher's feasibility, lost-capacity, cancel-escalation
and collection paths share its bookkeeping of refs, handles and nodes; split, each would reach into it.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from autotune.workers.protocol import ProbeResult, TrialRequest, write_trial_file

from .dispatcher import (
    DispatchSettings,
    _FORCE_CANCEL_AFTER_S,
    _NODE_CACHE_S,
    _RAY_CLIENT_PORT,
    _RAY_CONNECT_TIMEOUT_S,
    Dispatcher,
    Handle,
    ProbeLaunch,
    _crash,
    _infrastructure_errors,
    _trial_file_name,
)
from .ray_tasks import (
    _StepSink,
    _fmt,
    _holds,
    _node_name,
    _ray_multinode_task,
    trial_group_name,
    _ray_probe_task,
    _requirements,
    _unfinished,
    stop_tasks,
)

__all__ = ["RayDispatcher", "RayUnreachable", "check_ray_address"]

log = logging.getLogger(__name__)


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
            parts = urlsplit("//" + addr[len("ray://") :])
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
    gives up after ~32 s with "ray client connection timeout", naming no address. Ray offers no overall
    timeout for ``ray.init`` (ray-project/ray#46863: the maintainers
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
        f"head's GCS port, 6379 by default; ray://host:port its Ray Client port, {_RAY_CLIENT_PORT} by default)?"
    )


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

    @classmethod
    def from_settings(cls, settings: DispatchSettings, run_dir: str | Path | None = None) -> "RayDispatcher":
        """The Ray dispatcher a study's :class:`~autotune.dispatch.dispatcher.DispatchSettings` ask for."""
        return cls(address=settings.ray_address, num_cpus=settings.ray_num_cpus, resources=None, run_dir=run_dir)

    def __init__(
        self,
        address: str | None = None,
        num_cpus: int | None = None,
        resources: dict[str, float] | None = None,
        run_dir: str | Path | None = None,
        *,
        object_store_memory: int | None = 128 * 2**20,
        check_feasible: bool = True,
    ) -> None:
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
        self._groups: dict[Handle, str] = {}  # a pending multi-node trial -> its placement group's name
        self._nodes: tuple[float, list[dict[str, float]]] | None = None
        self._seen_nodes: dict[str, dict[str, Any]] = {}  # node id -> resources and address, once seen alive
        self._dead_nodes: set[str] = set()
        self._seq = itertools.count()
        self._closed = False

    def _init_ray(self, address, num_cpus, resources, object_store_memory) -> None:
        ray = self._ray
        kwargs: dict[str, Any] = dict(
            include_dashboard=False, log_to_driver=False, ignore_reinit_error=True, logging_level=logging.WARNING
        )
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
                log.warning(
                    "connecting to the Ray cluster at %s: num_cpus/resources are ignored "
                    "(the cluster's nodes declare their own)",
                    address,
                )
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
        return [
            f"{seen['address']} (node {node_id[:12]})"
            for node_id, seen in self._seen_nodes.items()
            if node_id in self._dead_nodes and (need is None or _holds(seen["resources"], need))
        ]

    def placement_problem(
        self, resources: dict[str, Any], nodes: int = 1, bundle: dict[str, float] | None = None
    ) -> tuple[str, str] | None:
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
            why = (
                f"the trial spans {nodes} nodes of {_fmt(need)} each, but only {len(holding)} node(s) of the "
                f"Ray cluster can hold that (per node: {per_node})"
            )
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
            return (
                f"needs {_fmt(need)} on one node but no node of the Ray cluster has it "
                f"(the cluster offers {_fmt(shown)} over {len(nodes)} nodes)"
            )
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
        data = request.to_json()
        ref = self._multinode.options(scheduling_strategy=here).remote(data, launch.to_json(), self._sink)
        handle = Handle(request.number, ref)
        self._refs[ref] = handle
        self._groups[handle] = trial_group_name(data)
        return handle

    def _remove_group(self, handle: Handle) -> None:
        """Remove a multi-node trial's placement group if it is still there (its coordinator removes
        it however the trial ends, unless the coordinator itself was killed)."""
        name = self._groups.pop(handle, None)
        if name is None:
            return
        try:
            from ray.util import get_placement_group, remove_placement_group

            remove_placement_group(get_placement_group(name))
            log.warning("removed the placement group %s that trial %d's coordinator left", name, handle.number)
        except Exception as exc:  # gone already: the usual case
            log.debug("placement group %s: %s", name, exc)

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
            if cancelled:
                self._remove_group(handle)
            self._groups.pop(handle, None)
            try:
                result = ProbeResult.from_json(ray.get(ref))
            except Exception as exc:
                if (
                    cancelled
                    or isinstance(exc, ray.exceptions.TaskCancelledError)
                    or isinstance(getattr(exc, "cause", None), ray.exceptions.TaskCancelledError)
                ):
                    result = ProbeResult("pruned", reason="cancelled by the driver", wall_s=self._ran_for(handle))
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

    def _ran_for(self, handle: Handle) -> float:
        """How long a cancelled trial's task ran, from its start to the cancel (the step sink's clock;
        0 where it never started or the sink cannot say): a pruned probe costs the budget that
        share of a full one, as it does on the local dispatcher, whose probe returns its own wall."""
        try:
            return float(self._ray.get(self._sink.ran_for.remote(handle.number), timeout=5))
        except Exception:
            return 0.0

    def _infra(self, handle: Handle, exc: BaseException) -> ProbeResult:
        """The infrastructure failed under the trial (its worker or node died): not the config's
        failure. The reason names the node the task ran on."""
        try:
            where = self._ray.get(self._sink.where.remote(handle.number), timeout=5)
        except Exception:
            where = {}
        node = (
            f"node {where.get('node_ip')} ({str(where.get('node_id', ''))[:12]}), Ray worker pid "
            f"{where.get('worker_pid')}"
            if where
            else "a node it never reported from"
        )
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ProbeResult(
            "infra",
            reason=f"infrastructure failure on {node}: {type(exc).__name__}: {first}"[:500],
            info={"node": where} if where else {},
        )

    def _escalate_cancels(self) -> None:
        """Force the cancels a task ignored for ``_FORCE_CANCEL_AFTER_S``; a task that finished
        meanwhile (its result not yet collected) is left alone, as in ``cancel``."""
        now = time.monotonic()
        overdue = {
            handle.ref: handle
            for handle, since in self._cancelled.items()
            if since >= 0 and now - since > _FORCE_CANCEL_AFTER_S and handle.ref in self._refs
        }
        for ref in _unfinished(self._ray, list(overdue)):
            handle = overdue[ref]
            log.warning("trial %d did not stop after a cancel; killing its Ray worker", handle.number)
            try:
                self._ray.cancel(ref, force=True)
            except Exception as exc:  # pragma: no cover
                log.debug("force cancel failed: %s", exc)
            self._remove_group(handle)  # a killed coordinator leaves its nodes reserved
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
            self._sink.stopping.remote(handle.number)  # the end of its wall (_ran_for), not when it is collected
        except Exception as exc:  # pragma: no cover - the wall is then counted to its collection
            log.debug("could not time the cancel: %s", exc)
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
        self._groups.clear()
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
