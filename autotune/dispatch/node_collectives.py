"""Collectives measured at each node count of a Ray cluster (``autotune calibrate --nodes``, issue 45).

A study projects a config measured on a slice of its cluster to the whole one, and ranks layouts
whose gradient reductions cross nodes, with the simulator's collective model. Its inter-node link is a
data-sheet figure unless measured, and a link shared by more nodes (switch hops, contention) is not
the link two nodes see. So each node count is measured as a trial over that many nodes runs: a
placement group of one node's devices per node (``STRICT_SPREAD``), the probe
(:mod:`autotune.workers.calibrate_nodes`) on every node, all ranks in one process group, an
all-reduce and an all-gather timed at each message size. The fit per node count
(:func:`autotune.workers.calibrate_nodes.fit_inter_node_links`) goes into the profile as
``inter_node_links``; the simulator pays the measured link at that count and says when a count was
not measured (:func:`autotune.workers.hardware.links_note`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from autotune.workers.protocol import TrialRequest

from .backends import node_bundle
from .dispatcher import ProbeLaunch, resources_for

__all__ = ["NodesUnavailable", "measure_node_counts", "node_launch"]


class NodesUnavailable(RuntimeError):
    """The cluster cannot place a node count asked for (too few nodes holding a node's devices)."""


def node_launch(
    accelerator: str, ranks_per_node: int, nodes: int, sizes_kib: tuple[int, ...], repeats: int, timeout_s: float
) -> ProbeLaunch:
    """The probe of one node count, launched as a trial over ``nodes`` nodes is (the dispatch fills
    the node placeholders)."""
    from autotune.workers.torch_probe.launch import static_rendezvous

    argv = [
        sys.executable,
        "-m",
        "autotune.workers.calibrate_nodes",
        *static_rendezvous("{nnodes}"),  # torchrun's flags: the same four, filled per node by the dispatch
        "--ranks-per-node",
        str(ranks_per_node),
        "--accelerator",
        accelerator,
        "--sizes-kib",
        ",".join(str(s) for s in sizes_kib),
        "--repeats",
        str(repeats),
    ]
    return ProbeLaunch(
        argv=argv,
        timeout_s=timeout_s,
        resources=resources_for(accelerator, ranks_per_node),
        nodes=nodes,
        bundle=node_bundle(accelerator, ranks_per_node),
    )


def measure_node_counts(
    dispatcher: Any,
    accelerator: str,
    ranks_per_node: int,
    node_counts: list[int],
    sizes_kib: tuple[int, ...],
    repeats: int,
    *,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[int, dict[str, dict[int, float]]]:
    """``{nodes: {op: {bytes: seconds}}}`` for each count of ``node_counts``, one after the other
    (each measurement has its nodes to itself). Every count is checked placeable before any runs;
    :class:`NodesUnavailable` names the first that is not; a measurement that fails raises
    ``RuntimeError`` with the probe's reason."""
    from autotune.workers.calibrate_nodes import parse_metrics

    launches = {n: node_launch(accelerator, ranks_per_node, n, sizes_kib, repeats, timeout_s) for n in node_counts}
    for n, launch in launches.items():
        problem = dispatcher.placement_problem(launch.resources, nodes=n, bundle=launch.bundle)
        if problem is not None:
            raise NodesUnavailable(
                f"{n} node(s) of {ranks_per_node} {accelerator} device(s) cannot be placed on the Ray cluster: "
                f"{problem[1]}. Start the nodes it needs, or leave {n} out of --nodes"
            )
    out: dict[int, dict[str, dict[int, float]]] = {}
    for i, (n, launch) in enumerate(launches.items()):
        progress(f"all-reduce / all-gather over {n} node(s) x {ranks_per_node} rank(s)")
        request = TrialRequest(
            params={},
            model={},
            workload={"kind": "calibrate"},
            cluster={"accelerator": accelerator, "nodes": n, "devices_per_node": ranks_per_node},
            study="calibrate-nodes",
            number=i,
        )
        result = dispatcher.result_of(dispatcher.submit(request, launch))
        if not result.ok:
            raise RuntimeError(f"the measurement over {n} node(s) failed ({result.status}): {result.reason}")
        out[n] = parse_metrics(result.metrics)
    return out
