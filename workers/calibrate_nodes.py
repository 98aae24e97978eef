"""Collectives across nodes (issue 45, item 4): one node's part of a measurement over ``nnodes``
nodes, run as a probe on each node of a multi-node placement (the dispatch fills ``{nnodes}``,
``{node_rank}``, ``{master_addr}`` and ``{master_port}`` as it does for a trial across nodes).

Each node starts ``--ranks-per-node`` processes (the node's devices; gloo on the CPU), all
``nnodes x ranks`` of them joining one process group at ``master_addr:master_port``, and times an
all-reduce and an all-gather over the whole group at each message size
(:func:`.calibrate_collectives.time_collectives`, as the host's calibration times them within a
node). Node 0 prints the seconds per size in the probe protocol (``{"metrics": {...}}``:
``allreduce_s_<bytes>``, ``allgather_s_<bytes>``); ``autotune calibrate --nodes`` fits latency and
bandwidth per node count from them (:func:`fit_inter_node_links`).

Run on worker nodes: torch where it runs, nothing of autotune's driver side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["fit_inter_node_links", "main", "metric_name", "parse_metrics"]

OPS = ("allreduce", "allgather")


def metric_name(op: str, nbytes: int) -> str:
    """The protocol metric of ``op``'s seconds at ``nbytes``: ``allreduce_s_1048576``."""
    return f"{op}_s_{int(nbytes)}"


def parse_metrics(metrics: dict[str, Any]) -> dict[str, dict[int, float]]:
    """``{op: {bytes: seconds}}`` back from node 0's metrics (:func:`metric_name`)."""
    out: dict[str, dict[int, float]] = {op: {} for op in OPS}
    for name, value in metrics.items():
        for op in OPS:
            prefix = f"{op}_s_"
            if name.startswith(prefix) and name[len(prefix) :].isdigit():
                out[op][int(name[len(prefix) :])] = float(value)
    return out


def fit_inter_node_links(
    seconds: dict[int, dict[str, dict[int, float]]], ranks_per_node: int
) -> dict[int, dict[str, float]]:
    """The profile's ``inter_node_links`` from the all-reduce seconds measured at each node count
    (``{nodes: {op: {bytes: s}}}``; one node is the host's calibration and adds no link): the
    simulator's collective model ``t = 2 latency + 2(g-1)/g bytes / bus`` fitted over the
    ``g = nodes x ranks_per_node`` ranks, and the bus spread over the node's ranks, each driving its
    own share of the link (``workers.simulate._common.group_bandwidth``)."""
    from .calibrate_collectives import fit_latency_bandwidth

    links: dict[int, dict[str, float]] = {}
    for nodes, ops in sorted(seconds.items()):
        times = ops.get("allreduce") or {}
        if nodes < 2 or len(times) < 2:
            continue
        world = nodes * ranks_per_node
        latency, bus = fit_latency_bandwidth(times, 2.0 * (world - 1) / world)
        links[nodes] = {
            "bandwidth_gbps": float(f"{bus / max(1, ranks_per_node) / 1e9:.4g}"),
            "latency_us": round(latency / 2.0 * 1e6, 2),
        }
    return links


def _rank_worker(
    local_rank: int,
    node_rank: int,
    ranks_per_node: int,
    nnodes: int,
    accelerator: str,
    init_method: str,
    sizes_kib: list[int],
    repeats: int,
    threads: int,
    result_path: str,
) -> None:
    """One rank (run by torch.multiprocessing): joins the group of every node's ranks, times the
    collectives; the group's rank 0 writes the seconds."""
    from .calibrate_collectives import calibration_device, time_collectives
    from .torch_probe._device import ACCELERATORS

    torch, device, sync = calibration_device(accelerator, local_rank=local_rank)
    if accelerator == "cpu":
        torch.set_num_threads(threads)
    import torch.distributed as dist

    rank, world = node_rank * ranks_per_node + local_rank, nnodes * ranks_per_node
    dist.init_process_group(ACCELERATORS[accelerator].backend, init_method=init_method, rank=rank, world_size=world)
    try:
        timed = time_collectives(torch, dist, device, sync, rank, world, sizes_kib, repeats, OPS)
        if rank == 0:
            metrics = {metric_name(op, n): s for op in OPS for n, s in timed[op].items()}
            Path(result_path).write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.workers.calibrate_nodes", description=__doc__)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--accelerator", choices=("cpu", "cuda", "npu"), default="cpu")
    parser.add_argument("--sizes-kib", default="4,64,1024,8192", help="comma-separated message sizes (KiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU: threads per rank (default cores / ranks)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes_kib.split(",") if s.strip()]
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.ranks_per_node))
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autotune-calibrate-nodes-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.start_processes(
            _rank_worker,
            args=(
                args.node_rank,
                args.ranks_per_node,
                args.nnodes,
                args.accelerator,
                f"tcp://{args.master_addr}:{args.master_port}",
                sizes,
                args.repeats,
                threads,
                result_path,
            ),
            nprocs=args.ranks_per_node,
            start_method="spawn",
        )
        if args.node_rank == 0:
            print(json.dumps({"metrics": json.loads(Path(result_path).read_text())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
