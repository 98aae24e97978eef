"""A local multi-node Ray cluster on one machine, for trials that span nodes (issue #35).

A 70B layout on 4 x 8 devices is a 4-node trial. autotune dispatches it through Ray as it would on
a real cluster (``autotune.dispatch.ray_tasks``): a placement group of one bundle per node
(``{"NPU": 8, "CPU": 1}``, ``STRICT_SPREAD``, so each bundle lands on its own node) reserves every
node's devices at once; node 0's address and a free port there become the rendezvous
(``{master_addr}``, ``{master_port}``); one launcher task per bundle runs the backend's argv with
``{node_rank}`` and ``{nnodes}`` filled in; the first node to fail ends the trial on every node,
and the trial's result is node 0's. A single-process ``--in-process`` run exercises none of that.

``local_cluster(nodes, devices_per_node)`` starts that cluster on this machine with
``ray.cluster_utils.Cluster`` (as ``tests/test_multinode.py`` does): a head with one CPU and no
devices (where the driver's coordinator and step sink run), and ``nodes`` raylets that each
declare ``resources={"NPU": devices_per_node}`` and one CPU (the bundle's launcher CPU). Small
object stores (80 MiB each) keep it within a 2-core machine's memory. It yields the address for a
spec's ``ray: {address: ...}`` and shuts Ray and the cluster down on exit, error or not.

    with local_cluster(4, 8) as address:
        spec = ...  # backend argv [..., "{trial_file}", "--node-rank", "{node_rank}"], ray.address = address
        study_runner(spec, run_dir, BackendChoice("command", "..."), dispatcher=...).run()  # autotune.cli.assembly

Ray prints a harmless "No module named 'acl'" traceback when NPU is declared without CANN, and
asks for token authentication unless ``RAY_AUTH_MODE=disabled`` (set here when not set).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

OBJECT_STORE_BYTES = 80 * 2**20
NODE_CPUS = 1


@contextlib.contextmanager
def local_cluster(
    nodes: int, devices_per_node: int, timeout_s: float = 120.0, node_cpus: int = NODE_CPUS
) -> Iterator[str]:
    """A head (1 CPU, no NPU) and ``nodes`` raylets declaring ``{"NPU": devices_per_node}`` and
    ``node_cpus`` CPUs each; yields the cluster's address (``host:port``) once every node is up
    (``TimeoutError`` after ``timeout_s``); Ray and the cluster are shut down on exit."""
    if nodes < 1 or devices_per_node < 1:
        raise ValueError(f"need at least one node and one device per node, got {nodes} x {devices_per_node}")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local runs: no token file, no warning
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False},
        )
        for _ in range(nodes):
            cluster.add_node(
                num_cpus=node_cpus, resources={"NPU": float(devices_per_node)}, object_store_memory=OBJECT_STORE_BYTES
            )
        _wait_for(cluster, nodes + 1, devices_per_node * nodes, timeout_s)
        yield cluster.address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def _wait_for(cluster, n_nodes: int, npus: float, timeout_s: float) -> None:
    """Until ``n_nodes`` nodes are alive and the cluster declares ``npus`` NPUs, or ``TimeoutError``."""
    import ray

    cluster.wait_for_nodes(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            have = sum(float(n.get("Resources", {}).get("NPU", 0.0)) for n in alive)
            if len(alive) >= n_nodes and have >= npus:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(alive)} of {n_nodes} Ray nodes up with {have:g} of {npus:g} NPUs after {timeout_s:g} s"
                )
            time.sleep(0.2)
    finally:
        ray.shutdown()  # the driver that runs the study connects on its own
