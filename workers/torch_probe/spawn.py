"""A light single-node launcher: ``python -m autotune.workers.torch_probe.spawn --nproc-per-node N TRIAL_FILE``.

What torchrun does for a single-node probe, without importing torch: start N ranks with
``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``, let them meet through a file store in
a private temporary directory (no port to pick, nothing to collide with), pass their output
through, and when one rank fails stop the others and exit with its status. torchrun imports
torch and runs an elastic agent, which costs ~1.5-2 s of every trial on a small CPU — a large
share of a tiny probe (benchmarks/torch_probe_overhead.py). No restarts, no elastic membership,
one node only: for multi-node trials use torchrun (``launch.torchrun_argv``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

__all__ = ["main", "DIST_INIT_ENV"]

# The probe reads this and calls init_process_group(init_method="file://...").
DIST_INIT_ENV = "AUTOTUNE_DIST_INIT_FILE"
_GRACE_S = 5.0


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autotune.workers.torch_probe.spawn")
    ap.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True)
    ap.add_argument("--module", default="autotune.workers.torch_probe", help="module each rank runs")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the module (the trial file)")
    ns = ap.parse_args(argv)
    n = ns.nproc_per_node
    if n < 1:
        ap.error("--nproc-per-node must be >= 1")
    with tempfile.TemporaryDirectory(prefix="autotune-spawn-") as tmp:
        base = dict(os.environ)
        base.update(
            {
                DIST_INIT_ENV: os.path.join(tmp, "store"),
                "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n),
                "GROUP_RANK": "0",
                "ROLE_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
            }
        )
        procs = []
        for rank in range(n):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen([sys.executable, "-m", ns.module, *ns.args], env=env))

        def forward(signum: int, frame: object) -> None:  # the dispatcher's deadline: stop the ranks too
            _stop(procs)
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        status = 0
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                status = failed[0]
                _stop(procs)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.02)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
