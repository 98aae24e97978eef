"""A long study under load: 1,000 trials, 8 in flight, through the real CLI; then a no-op re-run.

    python benchmarks/load.py [--trials 1000] [--parallel 8] [--backend simulate|command]

Runs ``autotune run`` in a child process (as a user would), on a 7B / 8-NPU space of ~6,000
combinations with the random sampler, MLflow tracking on its default SQLite store, and reports:
wall time, the driver's peak RSS (``getrusage`` of the child), trials in Optuna, probes, child
runs in MLflow, duplicated child runs, and the same after re-running the finished study (which
must probe nothing and log nothing). ``--backend command`` dispatches a real process per trial
through Ray (``sh -c 'echo ...'``), ``simulate`` answers each from the analytical model.

Issue #13 asks for the figures (no target): counts equal in Optuna and MLflow, 0 lost, 0 duplicated.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPEC = """
name: load
model: llama2-7b
workload: {{kind: train, seq_len: 4096, global_batch_size: 64}}
cluster: {{accelerator: npu, profile: ascend-910b, nodes: 1, devices_per_node: 8}}
target: none
{backend}
space:
  tp: [1, 2, 4, 8]
  pp: [1, 2, 4, 8]
  micro_batch_size: [1, 2, 4, 8, 16]
  recompute: [none, selective, full]
  zero_stage: [0, 1, 2, 3]
  precision: [bf16, fp16, fp32]
  sequence_parallel: [false, true]
objectives: [tokens_per_s_per_device]
search: {{n_trials: {trials}, parallel_trials: {parallel}, sampler: random, seed: 0, prune: false}}
ray: {{num_cpus: {parallel}}}
"""

COMMAND = """backend:
  kind: command
  argv: [sh, -c, 'echo "{\\"metrics\\": {\\"tokens_per_s_per_device\\": 1.0, \\"step_time_s\\": 1.0}}"']
  resources: {num_cpus: 1}"""


def run_cli(args: list[str]) -> tuple[float, float, dict]:
    """Wall seconds, peak RSS (MiB) of the child, and its --json payload."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "autotune.cli", *args, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        sys.exit(f"autotune run exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(rss, before) / 1024, json.loads(proc.stdout)


def counts(run_dir: Path) -> dict[str, int]:
    import optuna
    from mlflow.tracking import MlflowClient

    from autotune.study.records import trial_records
    from autotune.spec.secret_env import SPEC_COPY
    from autotune.spec.load import load_spec
    from autotune.study.storage import open_study

    spec = load_spec(run_dir / SPEC_COPY)
    records = trial_records(open_study(spec, run_dir, create=False))
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("load")
    runs = client.search_runs([exp.experiment_id], max_results=50000)
    children = [int(r.data.tags["autotune.trial"]) for r in runs if "mlflow.parentRunId" in r.data.tags]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from autotune.study.records import is_tracked

    tracked = {r.number for r in records if is_tracked(r)}
    return {
        "optuna_trials": len(records),
        "tracked": len(tracked),
        "mlflow_children": len(children),
        "duplicated": len(children) - len(set(children)),
        "lost": len(tracked - set(children)),
        "parents": sum(1 for r in runs if "mlflow.parentRunId" not in r.data.tags),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--backend", choices=["simulate", "command"], default="simulate")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="autotune-load-"))
    spec = root / "load.yaml"
    backend = "backend: simulate" if args.backend == "simulate" else COMMAND
    spec.write_text(SPEC.format(backend=backend, trials=args.trials, parallel=args.parallel))
    run_dir = root / "run"
    wall, rss, payload = run_cli(["run", str(spec), "--run-dir", str(run_dir)])
    first = counts(run_dir)
    wall2, _, payload2 = run_cli(["run", str(spec), "--run-dir", str(run_dir)])
    second = counts(run_dir)
    print(f"backend {args.backend}, {args.trials} trials, {args.parallel} parallel, run dir {run_dir}")
    print(
        f"first run:  {wall:7.1f} s wall, {wall / max(payload['probes'], 1) * 1000:6.1f} ms/probe, driver peak RSS "
        f"{rss:,.0f} MiB, stopped: {payload['stopped_because']}"
    )
    print(f"            {json.dumps(first)}")
    print(f"re-run:     {wall2:7.1f} s wall, probes reported {payload2['probes']} (same study), {json.dumps(second)}")
    unchanged = second == first
    print(f"re-run changed nothing: {unchanged}; lost {first['lost']}, duplicated {first['duplicated']}")
    sys.exit(0 if unchanged and not first["lost"] and not first["duplicated"] else 1)


if __name__ == "__main__":
    main()
