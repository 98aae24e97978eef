"""``autotune doctor``: what the Ray cluster a study would run on has, node by node.

Before a multi-node study, a team wants to know that every node joined, which accelerators each
declares to Ray (``NPU`` on Ascend, where Ray cannot detect them, is declared with ``ray start
--resources '{"NPU": 8}'``), what is free now, which software each node has (a node without
torch_npu, or with another CANN, fails every trial placed on it), and whether the spec's largest
trial can be placed at all. One small task per node, pinned to it, reports its software.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
from pathlib import Path
from typing import Any, Callable

__all__ = ["node_software", "cluster_report", "placement_verdict", "declare_command", "SOFTWARE"]

SOFTWARE = ("torch", "torch_npu", "mindspore", "deepspeed", "megatron-core", "torchtitan", "ray")
_CANN_FILES = (
    "/usr/local/Ascend/ascend-toolkit/latest/version.cfg",
    "/usr/local/Ascend/ascend-toolkit/latest/compiler/version.info",
)


def node_software() -> dict[str, Any]:
    """This node's Python packages of interest, CANN version and visible devices (runs on the node)."""
    versions: dict[str, str] = {}
    for name in SOFTWARE:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    home = os.environ.get("ASCEND_TOOLKIT_HOME")
    for path in ([str(Path(home) / "version.cfg")] if home else []) + list(_CANN_FILES):
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if "version" in line.lower() and "=" in line:
                versions["CANN"] = line.split("=", 1)[1].strip()
                break
        if "CANN" in versions:
            break
    visible = {k: os.environ[k] for k in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if k in os.environ}
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "software": versions,
        "visible_devices": visible,
    }


def cluster_report(
    ray: Any, timeout_s: float = 30.0, progress: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    """Every alive node: address, total and free resources, software (via a pinned zero-CPU task).
    ``progress`` hears each node as it answers (a worker starting on a busy node takes seconds)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        from ray._private.state import state as ray_state

        free_per_node = ray_state.available_resources_per_node()
    except Exception:  # an older or newer Ray without it: totals only
        free_per_node = {}
    probe = ray.remote(num_cpus=0, max_retries=0)(node_software)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    out = []
    progress(f"asking {len(nodes)} node(s) for their software")
    for i, (node, ref) in enumerate(zip(nodes, refs)):
        try:
            software = ray.get(ref, timeout=timeout_s)
        except Exception as exc:  # a node that cannot run a task is itself a finding
            software = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]}
        total = {k: float(v) for k, v in (node.get("Resources") or {}).items() if not k.startswith("node:")}
        free = {k: float(v) for k, v in (free_per_node.get(node["NodeID"]) or {}).items() if not k.startswith("node:")}
        # several raylets on one host share its address: the raylet port and node id tell them apart
        label = f"{node.get('NodeManagerAddress')}:{node.get('NodeManagerPort')} (node {node['NodeID'][:8]})"
        progress(f"{i + 1}/{len(nodes)} node(s) answered ({label})")
        out.append(
            {
                "node_id": node["NodeID"],
                "address": node.get("NodeManagerAddress"),
                "port": node.get("NodeManagerPort"),
                "label": label,
                "total": total,
                "free": free,
                **software,
            }
        )
    return out


def _resource_name(accelerator: str) -> str:
    return {"npu": "NPU", "cuda": "GPU"}.get(accelerator, "CPU")


def placement_verdict(
    nodes: list[dict[str, Any]], accelerator: str, trial_nodes: int, per_node: int
) -> tuple[bool, str]:
    """Whether a trial of ``trial_nodes`` x ``per_node`` devices can be placed (one bundle per
    node, each on a different node), and the sentence that says so."""
    name = _resource_name(accelerator)
    holding = [n for n in nodes if n["total"].get(name, 0.0) >= per_node]
    free_now = [n for n in holding if n["free"].get(name, n["total"].get(name, 0.0)) >= per_node]
    have = "; ".join(f"{n.get('label', n['address'])}: {n['total'].get(name, 0):g}" for n in nodes) or "no node"
    if len(holding) >= trial_nodes:
        busy = (
            ""
            if len(free_now) >= trial_nodes
            else (f"; only {len(free_now)} of them have it free now: the trial waits for running work to end")
        )
        return True, (
            f"the largest trial ({trial_nodes} node(s) x {per_node} {name}) can be placed: {len(holding)} "
            f"node(s) have {per_node} {name}{busy}"
        )
    return False, (
        f"the largest trial needs {trial_nodes} node(s) with {per_node} {name} each, but only "
        f"{len(holding)} node(s) of the cluster have that many (declared {name} per node: {have}); "
        f"add nodes or declare the devices with `{declare_command(accelerator, per_node)}`"
    )


def declare_command(accelerator: str, per_node: int) -> str:
    """How a node declares its devices to Ray: CPUs and GPUs have their own flags (Ray refuses
    them in ``--resources``: "use --num-cpus"), an NPU is a custom resource."""
    if accelerator == "npu":
        return f"ray start --resources '{{\"NPU\": {per_node}}}'"
    return f"ray start --num-gpus {per_node}" if accelerator == "cuda" else f"ray start --num-cpus {per_node}"
