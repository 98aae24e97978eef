"""The probe's command line, for the dispatcher. Imports no torch (the driver may not have it).

Three launchers start the same ranks. ``warm`` (warm.py, single node) forks the ranks from a server
that has already imported torch: ~3.5 s less per trial on a small CPU. ``spawn`` (spawn.py, single
node) imports no torch in the launcher and is ~1.5-2 s cheaper than torchrun. ``torchrun``, single
node (tested): ``python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node N -m
autotune.workers.torch_probe TRIAL_FILE``. ``--standalone`` runs the rendezvous on a free localhost
port, so concurrent trials on one machine never collide on ``--master-port``; ``--max-restarts 0``
because a failed probe is an answer, not something to retry inside the same trial.

Multi-node (tested on a local multi-raylet Ray cluster): the dispatcher reserves one Ray
placement-group bundle per node and starts one torchrun per bundle with torchrun's static
rendezvous, ``--nnodes N --node-rank R --master-addr A --master-port P`` (node 0's address and a
free port there, filled in per node); a c10d rendezvous (``rdzv_endpoint``) is kept for callers
that manage their own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PROBE_MODULE", "LAUNCHERS", "torchrun_argv", "spawn_argv", "warm_argv", "probe_argv", "processes_per_node"]

PROBE_MODULE = "autotune.workers.torch_probe"


def static_rendezvous(nnodes: str) -> list[str]:
    """torchrun's static rendezvous for one node of a multi-node trial: the dispatcher's placement
    group assigns the node ranks and node 0 hosts the store; ``{node_rank}``, ``{master_addr}`` and
    ``{master_port}`` are filled in per node by the dispatcher. Shared with the stack presets'
    launches (:mod:`autotune.dispatch.stack_presets`), which run a team's script under the same torchrun."""
    return [
        "--nnodes",
        nnodes,
        "--node-rank",
        "{node_rank}",
        "--master-addr",
        "{master_addr}",
        "--master-port",
        "{master_port}",
    ]


def processes_per_node(request: Any) -> tuple[int, int]:
    """``(nodes, processes per node)``: one process per device of the trial's world.

    The world is ``cluster.world_size`` (or nodes × devices_per_node). A trial whose
    tp·pp·dp·cp does not match it is still launched: the probe reports it as ``invalid`` with
    the numbers, so the sampler learns it like any other infeasible config.
    """
    cluster = dict(request.cluster)
    nodes = int(cluster.get("nodes", 1) or 1)
    world = cluster.get("world_size")
    if not world:
        world = nodes * int(cluster.get("devices_per_node", 1) or 1)
    world = int(world)
    if world % nodes:
        raise ValueError(f"world size {world} does not split evenly over {nodes} nodes")
    return nodes, world // nodes


def torchrun_argv(
    request: Any,
    python: str,
    trial_file: str = "{trial_file}",
    *,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
) -> list[str]:
    """argv for one node of the trial. ``trial_file`` defaults to the ``{trial_file}`` placeholder
    the dispatcher substitutes; ``master_port`` pins the single-node rendezvous port instead of
    ``--standalone``'s free-port choice."""
    nodes, nproc = processes_per_node(request)
    argv = [python, "-m", "torch.distributed.run"]
    if nodes == 1:
        if master_port is None:
            argv += ["--standalone", "--nnodes", "1"]
        else:
            argv += ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    elif rdzv_endpoint is None:
        argv += static_rendezvous(str(nodes))
    else:
        run_id = rdzv_id or f"{getattr(request, 'study', '') or 'autotune'}-{getattr(request, 'number', 0)}"
        argv += [
            "--nnodes",
            str(nodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            rdzv_endpoint,
            "--rdzv-id",
            run_id,
        ]
    argv += ["--nproc-per-node", str(nproc), "--max-restarts", "0", "-m", PROBE_MODULE, trial_file]
    return argv


def spawn_argv(request: Any, python: str, trial_file: str = "{trial_file}") -> list[str]:
    """argv for the light single-node launcher (spawn.py): the same probe, ranks and protocol as
    torchrun, ~1.5-2 s less per trial because the launcher imports no torch. Single node only."""
    nodes, nproc = processes_per_node(request)
    if nodes != 1:
        raise ValueError(f"the spawn launcher runs one node; this trial has {nodes}: use torchrun_argv")
    return [python, "-m", PROBE_MODULE + ".spawn", "--nproc-per-node", str(nproc), trial_file]


def warm_argv(request: Any, python: str, trial_file: str = "{trial_file}") -> list[str]:
    """argv for the warm single-node launcher (warm.py): ranks forked from a server that has
    imported torch already, so a trial pays neither the interpreter nor ``import torch``."""
    nodes, nproc = processes_per_node(request)
    if nodes != 1:
        raise ValueError(f"the warm launcher runs one node; this trial has {nodes}: use torchrun_argv")
    return [python, "-m", PROBE_MODULE + ".warm", "--nproc-per-node", str(nproc), trial_file]


LAUNCHERS = ("auto", "warm", "spawn", "torchrun")


def probe_argv(request: Any, python: str, trial_file: str = "{trial_file}", launcher: str = "auto") -> list[str]:
    """The probe's argv with the launcher named in ``request.backend['launcher']`` (or
    ``launcher``): ``warm``, ``spawn``, ``torchrun``, or ``auto`` = warm on a single cpu node
    (where start-up is most of a probe), spawn on a single accelerator node (a fresh process per
    trial: nothing of a previous trial's device state can leak), torchrun across nodes."""
    choice = str((getattr(request, "backend", None) or {}).get("launcher", launcher))
    if choice not in LAUNCHERS:
        raise ValueError(f"unknown launcher {choice!r}: expected one of {', '.join(LAUNCHERS)}")
    nodes, _ = processes_per_node(request)
    if choice == "auto" and nodes == 1:
        accelerator = str(dict(getattr(request, "cluster", None) or {}).get("accelerator", "cpu"))
        choice = "warm" if accelerator == "cpu" else "spawn"
    if choice == "warm":
        return warm_argv(request, python, trial_file)
    if choice == "spawn":
        return spawn_argv(request, python, trial_file)
    return torchrun_argv(request, python, trial_file)
