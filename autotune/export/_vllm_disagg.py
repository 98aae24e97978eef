"""vLLM / vLLM-Ascend disaggregated prefill: ``serve_vllm.sh`` for a prefill pool, a decode pool and
the proxy in front of them (issue 46).

Each instance is a ``vllm serve`` of its own with the trial's engine arguments (its pool's tp) and
``--kv-transfer-config`` (vLLM 0.32's ``KVTransferConfig``, ``vllm/config/kv_transfer.py``): the
connector's class and the instance's role, ``kv_producer`` for prefill and ``kv_consumer`` for
decode (0.32's NixlConnector calls ``kv_both`` deprecated). The proxy sends each request to a
prefill instance with ``max_tokens`` 1, then to a decode instance, which loads the KV cache and
streams the answer. It is not part of vLLM's package, so the script asks for its path (``PROXY``):

- NIXL (and Mooncake on CUDA): vLLM's ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``
  (``--port --prefiller-hosts --prefiller-ports --decoder-hosts --decoder-ports``, at vLLM commit
  030ea52e), the proxy of vLLM's ``docs/features/nixl_connector_usage.md``;
- vLLM-Ascend's Mooncake connector: ``examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py``
  (the same five options, vllm-ascend 182b75ea);
- the shared-storage example connector and LMCache: vLLM's
  ``examples/online_serving/disaggregated_serving/disagg_proxy_demo.py`` (``--model --prefill HOST:PORT
  ... --decode HOST:PORT ... --port``, at vLLM commit 03a7284d), which passes no connector-specific
  request fields.

Instances are placed first-fit on the deployment's nodes, prefill first; an instance wider than a node
takes whole nodes of its own and is started on each of them with vLLM's multi-node launch
(``_vllm_multinode``: ``--nnodes --node-rank --master-addr --master-port``, ``--headless`` past its
first node, which serves its API). The script runs on each node with ``NODE`` set to its index in
``NODES`` (the nodes' hosts) and starts the instances (or ranks) placed there; node 0 also starts the
proxy, which reaches each instance at its first node.
"""

from __future__ import annotations

import shlex
from typing import Any

from ..workers.parameters import kv_connector_on, pd_placement, prefill_tensor_parallel, value as param
from ._base import json_text
from ._vllm_multinode import MASTER_PORT, multinode_words

__all__ = [
    "DISAGG_PROXIES",
    "MULTINODE_ARGS",
    "NIXL_SIDE_CHANNEL_BASE",
    "connector_class",
    "kv_transfer_config",
    "placement",
    "disaggregated_lines",
    "instances_across_nodes",
]

# where a prefill / decode server listens: PORT + this + its index in the pool (the proxy takes PORT)
PORT_OFFSETS = {"prefill": 100, "decode": 200}
NIXL_SIDE_CHANNEL_BASE = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT's default; one per server on a host
MOONCAKE_ASCEND_KV_PORT = 30000  # vLLM-Ascend's pd_disaggregation_mooncake_single_node tutorial's
SHARED_STORAGE_PATH = "/dev/shm/autotune-kv"  # the example connector's files (a tmpfs on one node)

# the proxy each connector's deployment runs, and how it names the pools: "lists" (--prefiller-hosts
# H.. --prefiller-ports P..) or "pairs" (--prefill H:P ..., with --model)
DISAGG_PROXIES = {
    "vllm-nixl": ("vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py", "lists"),
    "vllm-ascend": ("vLLM-Ascend's examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py", "lists"),
    "vllm-generic": ("vLLM's examples/online_serving/disaggregated_serving/disagg_proxy_demo.py", "pairs"),
}


def connector_class(config: dict[str, Any], accelerator: str) -> str:
    """The KV connector's registered name in the engine that runs on ``accelerator``."""
    name = kv_connector_on(param(config, "kv_connector"), accelerator)
    if name == "mooncake":
        return "MooncakeConnectorV1" if accelerator == "npu" else "MooncakeConnector"
    return {"nixl": "NixlConnector", "lmcache": "LMCacheConnectorV1", "shared_storage": "ExampleConnector"}[name]


def _proxy(config: dict[str, Any], accelerator: str) -> str:
    name = kv_connector_on(param(config, "kv_connector"), accelerator)
    if accelerator == "npu":
        return "vllm-ascend"
    return "vllm-nixl" if name in ("nixl", "mooncake") else "vllm-generic"


def kv_transfer_config(
    config: dict[str, Any], accelerator: str, pool: str, index: int, storage: str = SHARED_STORAGE_PATH
) -> dict[str, Any]:
    """``--kv-transfer-config`` of the ``index``-th server of ``pool`` (prefill | decode); ``storage``:
    the shared-storage connector's folder."""
    cls = connector_class(config, accelerator)
    out: dict[str, Any] = {"kv_connector": cls, "kv_role": "kv_producer" if pool == "prefill" else "kv_consumer"}
    if (
        cls == "MooncakeConnectorV1"
    ):  # vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_connector.py reads both pools
        out["kv_port"] = MOONCAKE_ASCEND_KV_PORT + 100 * (pool == "decode") + index
        out["kv_connector_extra_config"] = {
            "prefill": {"dp_size": 1, "tp_size": prefill_tensor_parallel(config)},
            "decode": {"dp_size": 1, "tp_size": param(config, "tp")},
        }
    elif cls == "ExampleConnector":
        out["kv_connector_extra_config"] = {"shared_storage_path": storage}
    return out


def placement(config: dict[str, Any], devices_per_node: int) -> list[tuple[str, int, int, int, list[int]]]:
    """(pool, index in the pool, first node, nodes, the devices it takes on each) of every server:
    prefill first, first-fit within a node, an instance wider than a node on whole nodes of its own
    (``workers.parameters.pd_placement``, the rule the space checks)."""
    pp = param(config, "pp")
    return pd_placement(
        param(config, "prefill_replicas"),
        prefill_tensor_parallel(config) * pp,
        param(config, "replicas"),
        param(config, "tp") * pp,
        devices_per_node,
    )


# the words disaggregated_lines sets, per server, for a rank of an instance across nodes: a serve
# command of a deployment with such an instance (instances_across_nodes) passes them on
MULTINODE_ARGS = '"${multinode[@]}"'


def instances_across_nodes(config: dict[str, Any], devices_per_node: int) -> bool:
    """Whether any instance of the deployment takes more than one node."""
    return any(span > 1 for _, _, _, span, _ in placement(config, devices_per_node))


def disaggregated_lines(
    config: dict[str, Any],
    accelerator: str,
    devices_per_node: int,
    prefill_args: list[str],
    decode_args: list[str],
    bash_array: Any,
    serve_command: str,
) -> list[str]:
    """The script's body after its header, environment and MODEL: the pools' arguments, each server's
    place, the loop that starts this node's servers (``serve_command``: how one starts, reading
    ``$k``'s devices, port and KV config), and the proxy on node 0."""
    servers = placement(config, devices_per_node)
    nodes = max(node + span for _, _, node, span, _ in servers)
    wide = instances_across_nodes(config, devices_per_node)
    proxy = _proxy(config, accelerator)
    where, style = DISAGG_PROXIES[proxy]
    kv = [
        json_text(kv_transfer_config(config, accelerator, p, i), sort_keys=True, separators=(",", ":"))
        for p, i, _, _, _ in servers
    ]
    lines = [
        f"NODE=${{NODE:-0}}  # this node's index in NODES (the deployment spans {nodes} node(s))",
        'read -r -a NODES <<< "${NODES:-' + " ".join(["localhost"] * nodes) + "}\"  # the nodes' hosts, node 0 first",
        f'[ "${{#NODES[@]}}" -ge {nodes} ] || {{ echo "NODES lists ${{#NODES[@]}} host(s); the deployment spans '
        f'{nodes} nodes" >&2; exit 2; }}',
        "PROXY=${PROXY:-}  # " + where,
        '[ "$NODE" != 0 ] || [ -n "$PROXY" ] || { echo "set PROXY to '
        + where
        + ' (not part of the package)" >&2; exit 2; }',
        "",
        *bash_array("PREFILL_ARGS", prefill_args),
        *bash_array("DECODE_ARGS", decode_args),
        "# each server: its pool, first node, nodes, devices on each, port (PORT + offset) and KV transfer config",
        "SERVER_POOL=(" + " ".join(p for p, _, _, _, _ in servers) + ")",
        "SERVER_NODE=(" + " ".join(str(n) for _, _, n, _, _ in servers) + ")",
        "SERVER_NODES=(" + " ".join(str(span) for _, _, _, span, _ in servers) + ")",
        "SERVER_DEVICES=(" + " ".join(",".join(map(str, d)) for _, _, _, _, d in servers) + ")",
        "SERVER_PORT=(" + " ".join(str(PORT_OFFSETS[p] + i) for p, i, _, _, _ in servers) + ")",
        "SERVER_KV=(",
        *(f"    {shlex.quote(text)}" for text in kv),
        ")",
    ]
    if wide:
        lines.append(
            f"MASTER_PORT=${{MASTER_PORT:-{MASTER_PORT}}}  # where a wide instance's ranks meet: this + its index, "
            "on its first node"
        )
    lines += [
        "",
        "pids=()",
        "trap 'kill \"${pids[@]}\" 2>/dev/null || true' INT TERM",
        'for k in "${!SERVER_POOL[@]}"; do',
        "    first=${SERVER_NODE[$k]}; rank=$((NODE - first))",
        '    [ "$rank" -ge 0 ] && [ "$rank" -lt "${SERVER_NODES[$k]}" ] || continue',
        '    if [ "${SERVER_POOL[$k]}" = prefill ]; then args=("${PREFILL_ARGS[@]}");',
        '    else args=("${DECODE_ARGS[@]}"); fi',
    ]
    if wide:
        words = multinode_words('"${SERVER_NODES[$k]}"', '"$rank"', '"${NODES[$first]}"', "$((MASTER_PORT + k))")
        lines += [
            "    # an instance wider than a node: vLLM's multi-node launch on each of its nodes, the API on its first",
            '    multinode=(); if [ "${SERVER_NODES[$k]}" -gt 1 ]; then multinode=(' + " ".join(words) + "); fi",
            '    if [ "$rank" -gt 0 ]; then multinode+=(--headless); fi',
        ]
    lines += [
        serve_command,
        '    pids+=("$!")',
        "done",
        'if [ "$NODE" = 0 ]; then',
        "    prefill=(); prefill_hosts=(); prefill_ports=(); decode=(); decode_hosts=(); decode_ports=()",
        '    for k in "${!SERVER_POOL[@]}"; do',
        '        host="${NODES[${SERVER_NODE[$k]}]}"; port=$((PORT + SERVER_PORT[k]))',
        '        if [ "${SERVER_POOL[$k]}" = prefill ]; then',
        '            prefill+=("$host:$port"); prefill_hosts+=("$host"); prefill_ports+=("$port")',
        "        else",
        '            decode+=("$host:$port"); decode_hosts+=("$host"); decode_ports+=("$port")',
        "        fi",
        "    done",
    ]
    if style == "lists":
        lines.append(
            '    "${PYTHON:-python}" "$PROXY" --port "$PORT" --prefiller-hosts "${prefill_hosts[@]}" '
            '--prefiller-ports "${prefill_ports[@]}" \\\n        --decoder-hosts "${decode_hosts[@]}" '
            '--decoder-ports "${decode_ports[@]}" &'
        )
    else:
        lines.append(
            '    "${PYTHON:-python}" "$PROXY" --model "$MODEL" --port "$PORT" --prefill "${prefill[@]}" '
            '--decode "${decode[@]}" &'
        )
    lines += ['    pids+=("$!")', "fi", 'wait "${pids[@]}"']
    return lines
