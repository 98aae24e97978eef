"""What runs inside Ray for a trial: the probe task on a worker node, the coordinator of a trial that
spans nodes (a placement group of one bundle per node), the step-event sink the driver drains, and
the careful stopping of tasks (a cancel racing a finished task's reply can kill the driver).
Imported by the Ray dispatcher (:mod:`autotune.dispatch.ray_dispatch`) and pickled by reference into Ray.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from autotune.workers.protocol import ProbeResult

from .dispatcher import (
    NODE_PLACEHOLDERS,
    ProbeLaunch,
    _FORCE_CANCEL_AFTER_S,
    _STEP_BATCH,
    _STEP_FLUSH_S,
    _infrastructure_errors,
    node_env,
    run_probe,
    visible_devices_env,
)

__all__ = ["stop_tasks"]

log = logging.getLogger(__name__)


class _StepSink:
    """A Ray actor collecting the running probes' step events for the driver (a Ray task returns
    only at its end; pruning needs the steps while the probe runs)."""

    def __init__(self) -> None:
        self._events: list[tuple[int, dict[str, Any]]] = []
        self._where: dict[int, dict[str, Any]] = {}
        self._since: dict[int, float] = {}  # trial -> when its task said it started (this actor's clock)
        self._stopping: dict[int, float] = {}  # trial -> when the driver cancelled it

    def put(self, number: int, event: dict[str, Any]) -> None:
        self._events.append((number, event))

    def put_many(self, number: int, events: list[dict[str, Any]]) -> None:
        """A batch of one trial's events, in order (``_StepBatcher``: one actor call per batch)."""
        self._events.extend((number, event) for event in events)

    def started(self, number: int, where: dict[str, Any]) -> None:
        """Where trial ``number``'s task runs (node, worker pid): named when that node fails; and
        when it started, for :meth:`ran_for`."""
        self._where[number] = where
        self._since[number] = time.monotonic()

    def stopping(self, number: int) -> None:
        """The driver cancelled trial ``number``: the end of its wall (:meth:`ran_for`)."""
        self._stopping[number] = time.monotonic()

    def ran_for(self, number: int) -> float:
        """Seconds trial ``number``'s task ran, from its start to its cancel (to now where no cancel
        was said; 0: it never said it started), and the trial forgotten. A task the driver cancelled
        returns no result, so no wall of its own: this is the wall a pruned probe's share of the
        budget is counted from (``memory_profile.full_probe_cost_fpe``). Both ends on this actor's
        clock, so no two hosts' clocks are compared."""
        since = self._since.pop(number, None)
        end = self._stopping.pop(number, None)
        self._where.pop(number, None)
        if since is None:
            return 0.0
        return max(0.0, (end if end is not None else time.monotonic()) - since)

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


def _ray_probe_task(
    request_data: dict[str, Any], launch_data: dict[str, Any], sink: Any = None, node: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Body of the Ray task: on the worker, write the trial file to local disk and run the probe;
    step events go to ``sink`` (a :class:`_StepSink` actor) as they come, in batches
    (:class:`_StepBatcher`). ``node``: this task is one node of a multi-node trial (``nnodes``,
    ``node_rank``, ``master_addr``, ``master_port`` fill the argv placeholders and the
    environment; only node 0 streams step events)."""
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
            sink.started.remote(
                number,
                {"node_ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(), "worker_pid": os.getpid()},
            )
        except Exception:  # where it ran is for the failure's reason only
            pass

    batcher = _StepBatcher(sink, number) if sink is not None else None

    def on_event(event: dict[str, Any]) -> None:
        if batcher is not None and event.get("event") == "step":
            batcher.add(event)  # a list append, mostly: never slows the reading of the probe's output

    with tempfile.TemporaryDirectory(prefix="autotune-trial-") as tmp:
        try:
            result = run_probe(
                request,
                launch,
                Path(tmp) / "trial.json",
                on_event,
                should_stop=batcher.tick if batcher is not None else None,
            )
        finally:
            if batcher is not None:
                batcher.flush()  # the last batch, before the result: the driver sees every event
    result.info.setdefault("host", socket.gethostname())
    if hasattr(os, "nice"):  # the CPU priority the probe ran at (Ray's workers': 15 unless the cluster says)
        result.info.setdefault("niceness", os.nice(0))
    for var in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        if os.environ.get(var):
            result.info.setdefault(var, os.environ[var])
    return result.to_json()


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
    return {
        "num_cpus": float(bundle.get("CPU", 0)),
        "num_gpus": float(bundle.get("GPU", 0)),
        **({"resources": other} if other else {}),
    }


# how long one wait of the coordinator blocks: short, so that a polite cancel (a KeyboardInterrupt,
# delivered only while Python runs) reaches it within a second and its ``finally`` frees the nodes.
# Blocked in one long ray.wait, a pruned trial's coordinator heard the cancel only when its probes
# ended on their own, was force-killed first, and its placement group stayed reserved: the next
# 4-node trials of the study found one CPU free and failed as infrastructure (2026-11-28)
_COORDINATOR_WAIT_S = 0.5


def trial_group_name(request_data: dict[str, Any]) -> str:
    """The placement group of a multi-node trial, named so that the driver can remove it if its
    coordinator was killed before it could."""
    study = "".join(c if c.isalnum() or c in "-_." else "-" for c in str(request_data.get("study") or "study"))
    return f"autotune-{study}-trial-{request_data.get('number')}"


def _wait_one(ray: Any, refs: list[Any], timeout_s: float | None = None) -> list[Any]:
    """``ray.wait`` for one of ``refs`` (up to ``timeout_s``, None: until one is ready) in short waits."""
    end = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        step = _COORDINATOR_WAIT_S if end is None else max(0.0, min(_COORDINATOR_WAIT_S, end - time.monotonic()))
        done, _ = ray.wait(refs, num_returns=1, timeout=step)
        if done or (end is not None and time.monotonic() >= end):
            return done


def _ray_multinode_task(request_data: dict[str, Any], launch_data: dict[str, Any], sink: Any = None) -> dict[str, Any]:
    """One trial over ``launch.nodes`` nodes: a placement group of one bundle per node
    (``STRICT_SPREAD``: each on its own node) reserves every node's devices at once; node 0's
    address and a free port there become the rendezvous; one probe task per bundle runs the
    launch with ``{nnodes} {node_rank} {master_addr} {master_port}`` filled in. The first node to
    fail ends the trial on every node (its reason names the node); the group is removed however
    the trial ends. The result is node 0's, with every node's address in ``info.nodes``; with
    ``launch.ends_with_node_0`` (a serving instance across nodes) node 0's success ends the trial at
    once, and the nodes still serving it are stopped."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    launch = ProbeLaunch(**launch_data)
    n, bundle = int(launch.nodes), dict(launch.bundle)
    pg = placement_group(
        [dict(bundle) for _ in range(n)], strategy="STRICT_SPREAD", name=trial_group_name(request_data)
    )
    refs: list[Any] = []
    try:
        if not _wait_one(ray, [pg.ready()], launch.placement_timeout_s):
            free = ray.available_resources()
            return ProbeResult(
                "infra",
                reason=(
                    f"the trial's {n} nodes could not be reserved within {launch.placement_timeout_s:g} s: it needs "
                    f"{n} bundles of {_fmt(bundle)} on distinct nodes (placement group, STRICT_SPREAD); the cluster "
                    "has "
                    f"{_fmt({k: free.get(k, 0.0) for k in bundle})} free now"
                ),
            ).to_json()
        addr, port = ray.get(
            ray.remote(num_cpus=0)(_node_address)
            .options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))
            .remote()
        )
        task = ray.remote(max_retries=0)(_ray_probe_task)
        for rank in range(n):
            node = {"nnodes": n, "node_rank": rank, "master_addr": addr, "master_port": port}
            refs.append(
                task.options(
                    **_bundle_options(bundle),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                ).remote(request_data, launch_data, sink, node)
            )
        results: dict[int, ProbeResult] = {}
        while len(results) < n:
            left = [r for i, r in enumerate(refs) if i not in results]
            done = _wait_one(ray, left)
            rank = refs.index(done[0])
            try:
                result = ProbeResult.from_json(ray.get(done[0]))
            except Exception as exc:
                kind = "infra" if isinstance(exc, _infrastructure_errors(ray)) else "crash"
                result = ProbeResult(
                    kind, reason=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                )
            if rank > 0 and result.status == "crash" and result.info.get("returncode") == 0 and not result.metrics:
                result = ProbeResult("ok", steps=result.steps, info=result.info)  # only node 0 reports metrics
            results[rank] = result
            if rank == 0 and launch.ends_with_node_0 and result.ok:
                break  # the other nodes served node 0's probe: the finally below stops them
            if not result.ok and result.status != "pruned":
                host = result.info.get("host") or _bundle_node(pg, rank)
                failed = ProbeResult(
                    result.status,
                    metrics=result.metrics,
                    steps=result.steps,
                    log_tail=result.log_tail,
                    reason=f"node {rank} of {n} ({host}) failed: {result.reason}"[:2000],
                    info={**result.info, "failed_node": rank},
                )
                return failed.to_json()  # the finally below stops the other nodes
        first = results[0]
        first.info["nodes"] = [
            {
                "node_rank": r,
                "host": results[r].info.get("host") if r in results else _bundle_node(pg, r),
                **{
                    k: results[r].info[k]
                    for k in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
                    if r in results and k in results[r].info
                },
            }
            for r in range(n)
        ]
        return first.to_json()
    finally:  # a failed or cancelled trial: the other nodes' probes end within seconds
        stop_tasks(ray, refs)
        remove_placement_group(pg)
