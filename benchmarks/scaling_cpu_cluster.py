"""The projection from a slice to a larger cluster, checked on the local multi-node Ray cluster
(issue 45): tiny-Llama configs measured with the torch probe at 1, 2 and 4 CPU "nodes" (gloo over
loopback TCP), the model's projection from 1 node and from 2 nodes to 4 compared with what 4
nodes measured.

A study of ``--configs`` configs of the tiny Llama runs on one device first (its trials are the
configs, distinct: Optuna's grid sampler draws the space's points without replacement, and none is
pruned, so each is scaled; ``--precision`` fp32 by default: bf16 is emulated on this CPU, 15x slower);
``autotune scale RUN_DIR --top N --nodes 1,2,4 --repeats R`` then measures each at every
size, weak scaling, as a user would run it. The projection is :mod:`autotune.guide.projection`'s
with the run's readings; printed: per config the measured tokens/s/device at each size, the
projections to 4 nodes and their errors; then the median absolute error over the configs from
each reference size, and the Spearman correlation between the projected and the measured
ranking at 4 nodes.

On this machine the 4 "nodes" share the host's cores (2 here), which the projection prices
(:func:`autotune.guide.projection.host_load`); a real cluster's nodes are hosts of their own.

With ``--links``, the host and the links across 2, ..., ``--nodes`` nodes are measured first
(``autotune calibrate --nodes ... --ray-address``) and the spec uses that profile: the projection
then pays the link measured at each node count instead of the data-sheet one.

    python benchmarks/scaling_cpu_cluster.py [--configs 6] [--repeats 2] [--run-dir DIR] [--nodes 4] [--links]
        [--precision fp32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SPEC = """
name: scale-cpu-cluster
model: tiny-llama
workload: {{kind: train, seq_len: 128, global_batch_size: 8, warmup_steps: 2, measured_steps: {steps}, timeout_s: 600}}
cluster: {{accelerator: cpu, nodes: 1, devices_per_node: 1, threads_per_rank: 1{profile}}}
backend: {{kind: torch, launcher: torchrun}}
target: none
space:
  micro_batch_size: [1, 2, 4]
  recompute: [none, full]
  precision: [{precision}]
  tp: [1]
  pp: [1]
  zero_stage: [0]
objectives: [tokens_per_s_per_device]
search: {{n_trials: {configs}, seed: 0, sampler: grid, prune: false}}
ray: {{enabled: false}}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per probe")
    ap.add_argument("--nodes", type=int, default=4, help="the largest size (node counts 1, 2, ..., this)")
    ap.add_argument("--run-dir", type=Path, default=None, help="keep the study here (default: a temporary one)")
    ap.add_argument("--precision", default="fp32", help="the space's precisions, comma-separated (fp32, bf16)")
    ap.add_argument("--links", action="store_true", help="measure the links per node count first (calibrate --nodes)")
    args = ap.parse_args()
    from typer.testing import CliRunner

    from autotune.cli.commands import app
    from local_ray_cluster import local_cluster

    base = args.run_dir or Path(tempfile.mkdtemp(prefix="scale-cpu-"))
    base.mkdir(parents=True, exist_ok=True)
    spec = base / "spec.yaml"
    run = base / "run"
    t0 = time.monotonic()
    sizes = [1]
    while sizes[-1] * 2 < args.nodes:
        sizes.append(sizes[-1] * 2)
    sizes.append(args.nodes)
    with local_cluster(args.nodes, 1) as address:
        profile = ""
        if args.links:
            path = base / "profile.yaml"
            calibrated = CliRunner().invoke(
                app,
                ["calibrate", "--ranks", "1", "--threads", "1", "--out", str(path), "--ray-address", address]
                + ["--nodes", ",".join(str(n) for n in sizes if n > 1)],
            )
            if calibrated.exit_code != 0:
                print(calibrated.output, file=sys.stderr)
                return 1
            print(calibrated.stdout.strip())
            profile = f", profile: {path}"
        spec.write_text(
            SPEC.format(
                configs=args.configs, steps=args.steps, profile=profile, precision=", ".join(args.precision.split(","))
            )
        )
        study = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run), "--json", "--no-tracking"])
        if study.exit_code != 0:
            print(study.output, file=sys.stderr)
            return 1
        result = CliRunner().invoke(
            app,
            [
                "scale",
                str(run),
                "--top",
                str(args.configs),
                "--nodes",
                ",".join(map(str, sizes)),
                "--repeats",
                str(args.repeats),
                "--ray-address",
                address,
                "--no-tracking",
                "--json",
            ],
        )
    if result.exit_code != 0:
        print(result.output, file=sys.stderr)
        return 1
    data = json.loads(result.stdout)
    print(f"study and scaling in {time.monotonic() - t0:.0f} s; run directory {run}")
    report(data, run, sizes)
    return 0


def report(data: dict, run: Path, sizes: list[int]) -> None:
    """Projections to the largest size from every smaller one, recomputed from the readings and the
    model's points (the table itself projects from the smallest size only)."""
    from autotune.guide.projection import projected_step

    points = data["points"]
    target = sizes[-1]
    by = {(p["trial"], p["nodes"]): p for p in points}
    trials = sorted({p["trial"] for p in points})
    models = _model_points(data)
    print(
        f"\n{'trial':>5} "
        + " ".join(f"{f'{n} node(s)':>14}" for n in sizes)
        + "  "
        + " ".join(f"{f'from {n}':>16}" for n in sizes[:-1])
    )
    errors: dict[int, list[float]] = {n: [] for n in sizes[:-1]}
    measured_at_target, projected_at_target = [], {n: [] for n in sizes[:-1]}
    for t in trials:
        row = [by.get((t, n), {}).get("tokens_per_s_per_device") for n in sizes]
        cells = [f"{v:14.0f}" if v else f"{'—':>14}" for v in row]
        proj_cells = []
        goal = by.get((t, target), {})
        for n in sizes[:-1]:
            ref = by.get((t, n), {})
            if not (
                ref.get("step_time_s")
                and goal.get("tokens_per_s_per_device")
                and (t, n) in models
                and (t, target) in models
            ):
                proj_cells.append(f"{'—':>16}")
                continue
            step = projected_step(ref["step_time_s"], ref.get("comm_fraction"), models[(t, n)], models[(t, target)])
            projected = models[(t, target)].tokens_per_s_per_device(step)
            err = projected / goal["tokens_per_s_per_device"] - 1.0
            errors[n].append(err)
            projected_at_target[n].append(projected)
            proj_cells.append(f"{projected:9.0f} ({100 * err:+5.1f}%)")
        if goal.get("tokens_per_s_per_device"):
            measured_at_target.append(goal["tokens_per_s_per_device"])
        print(f"{t:>5} " + " ".join(cells) + "  " + " ".join(proj_cells))
    from scipy.stats import spearmanr

    for n in sizes[:-1]:
        errs = [abs(e) for e in errors[n]]
        if not errs:
            continue
        rho = spearmanr(projected_at_target[n], measured_at_target).statistic if len(errs) >= 3 else float("nan")
        print(
            f"from {n} node(s) to {target}: median abs error {100 * statistics.median(errs):.1f} % over {len(errs)} "
            f"configs (max {100 * max(errs):.1f} %); Spearman projected vs measured at {target}: {rho:.2f}"
        )
    effs = [p["scaling_efficiency"] for p in points if p["nodes"] == target and p["scaling_efficiency"]]
    comm = [p["comm_fraction"] for p in points if p["nodes"] == target and p["comm_fraction"] is not None]
    if effs:
        print(
            f"measured weak-scaling efficiency at {target} nodes: median {100 * statistics.median(effs):.0f} %; "
            f"communication share median {100 * statistics.median(comm):.0f} %"
        )


def _model_points(data: dict) -> dict:
    """The model's point of every (trial, nodes), as `autotune scale` priced them (its JSON)."""
    from autotune.guide.projection import ModelPoint

    return {(p["trial"], p["nodes"]): ModelPoint.from_json(p["model"]) for p in data["points"] if p.get("model")}


if __name__ == "__main__":
    raise SystemExit(main())
