"""The MindSpore probe's command line, for the dispatcher. Imports no MindSpore.

One process: ``PYTHON probe.py TRIAL_FILE``. Data parallel over N devices (or N CPU processes):
``msrun --worker_num N --local_worker_num N --master_port P --join=True --tail_worker_log 0
--log_dir DIR probe.py TRIAL_FILE`` — msrun starts a scheduler and N workers with the ``python``
on PATH (so the environment of the probe puts the MindSpore interpreter's folder first), writes
each worker's output to ``DIR/worker_<i>.log`` and, with ``--tail_worker_log 0``, copies worker
0's (the protocol lines) to its own stdout. The port is a free one, picked when the trial starts.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from ..torch_probe.launch import processes_per_node  # imports no torch: one world-size rule for both probes

__all__ = ["PROBE_SCRIPT", "probe_argv", "probe_env", "resolve_python", "MINDSPORE_PYTHON_ENV"]

PROBE_SCRIPT = Path(__file__).resolve().parent / "probe.py"
MINDSPORE_PYTHON_ENV = "AUTOTUNE_MINDSPORE_PYTHON"
_DEFAULT_VENV = ".venv-mindspore"


def resolve_python(configured: str | None, spec_dir: Path | None = None) -> str:
    """The MindSpore interpreter: ``backend.python`` (relative to the spec), else
    ``$AUTOTUNE_MINDSPORE_PYTHON``, else ``./.venv-mindspore/bin/python`` (the README's set-up)."""
    candidates = []
    if configured:
        path = Path(configured).expanduser()
        candidates.append(path if path.is_absolute() or spec_dir is None else spec_dir / path)
    elif os.environ.get(MINDSPORE_PYTHON_ENV):
        candidates.append(Path(os.environ[MINDSPORE_PYTHON_ENV]))
    else:
        candidates += [Path.cwd() / _DEFAULT_VENV / "bin" / "python"]
        if spec_dir is not None:
            candidates += [p / _DEFAULT_VENV / "bin" / "python" for p in (spec_dir, *spec_dir.parents)]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise ValueError(
        "no MindSpore environment found (looked for " + ", ".join(str(c) for c in candidates) + "): create one with "
        f"`python -m venv {_DEFAULT_VENV} && {_DEFAULT_VENV}/bin/pip install 'mindspore==2.10.0' 'numpy<2' decorator`, "
        f"or set backend.python in the spec (or ${MINDSPORE_PYTHON_ENV})"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def probe_argv(request: Any, python: str, trial_file: str = "{trial_file}", log_dir: str | None = None) -> list[str]:
    """argv of one trial: the script alone for one process, msrun for several. Across nodes, one
    msrun per node (the dispatcher's placement group) with ``--worker_num`` the whole world,
    ``--local_worker_num`` this node's share and ``{master_addr} {master_port} {node_rank}``
    filled in per node by the dispatcher (node 0 runs msrun's scheduler)."""
    nodes, per_node = processes_per_node(request)
    if nodes * per_node == 1:
        return [python, str(PROBE_SCRIPT), trial_file]
    msrun = str(Path(python).parent / "msrun")
    log_dir = log_dir or tempfile.mkdtemp(prefix="autotune-msrun-")
    if nodes == 1:
        where = ["--master_port", str(_free_port())]
    else:
        where = ["--master_addr", "{master_addr}", "--master_port", "{master_port}", "--node_rank", "{node_rank}"]
    return [
        msrun,
        "--worker_num",
        str(nodes * per_node),
        "--local_worker_num",
        str(per_node),
        *where,
        "--join=True",
        "--tail_worker_log",
        "0",
        "--log_dir",
        log_dir,
        str(PROBE_SCRIPT),
        trial_file,
    ]


def probe_env(python: str, base_path: str | None = None) -> dict[str, str]:
    """msrun starts its workers with the ``python`` on PATH: put the MindSpore interpreter first."""
    path = base_path if base_path is not None else os.environ.get("PATH", "")
    return {"PATH": str(Path(python).parent) + (os.pathsep + path if path else "")}
