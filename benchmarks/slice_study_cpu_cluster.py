"""Tuning on a slice, checked on the local multi-node Ray cluster (issue 45): the same study of the
tiny Llama for a 4-node target (CPU "nodes", gloo over loopback TCP), once probing at full size
and once on a 1-node slice (``cluster.probe_nodes: 1``, every measurement projected to 4 nodes by
the calibrated model). Then each study's recommended config is measured again at 4 nodes with
``autotune scale`` (the same procedure for both, ``--repeats`` readings), and the device-hours
each study's probes took are added up (wall time x devices).

Printed: each study's pick and its throughput measured at 4 nodes, the slice pick's shortfall
against the full-size pick, and the device-hours ratio. With ``--confirm-top K`` the slice study
measures its K best configs by projection again at 4 nodes before it recommends
(``cluster.confirm_top``); those full-size probes count in its device-hours.

    python benchmarks/slice_study_cpu_cluster.py [--space wide|narrow] [--trials 12] [--repeats 3] \\
      [--run-dir DIR] [--confirm-top K]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SPEC = """
name: slice-{name}
model: tiny-llama
workload: {{kind: train, seq_len: 128, global_batch_size: {gbs}, warmup_steps: 2, measured_steps: {steps},
  timeout_s: 600}}
cluster: {{accelerator: cpu, nodes: {nodes}, devices_per_node: 1, threads_per_rank: 1{probe}}}
backend: {{kind: torch, launcher: torchrun}}
target: none
space:
{space}
  tp: [1]
  pp: [1]
objectives: [tokens_per_s_per_device]
search: {{n_trials: {trials}, seed: 0, sampler: auto}}
"""
# the spaces (global batch, knobs). "narrow" is the first runs' 12 configs, half of them bf16, which
# this CPU emulates 15x slower: a full-size study is done after 4-5 probes there, so no slice study
# that confirms 2 configs at full size can cost much less than it. "wide": 24 fp32 configs with
# ZeRO-1 (whose collectives the slice, at dp 1, does not run) and micro-batch 8: a search that
# needs its budget, as a real study's does.
KNOBS = ("micro_batch_size", "recompute", "zero_stage", "precision")
SPACES = {
    "narrow": (
        16,
        "  micro_batch_size: [1, 2, 4]\n  recompute: [none, full]\n  precision: [fp32, bf16]\n  zero_stage: [0]",
    ),
    "wide": (
        32,
        "  micro_batch_size: [1, 2, 4, 8]\n  recompute: [none, selective, full]\n  precision: [fp32]\n"
        "  zero_stage: [0, 1]",
    ),
}


def confirmation_seconds(run: Path) -> float:
    """The walls of a slice study's confirmations at full size (``cluster.confirm_top``), from its
    Optuna journal (the report's summary adds every probe's wall on one figure)."""
    from autotune.cli.input import load_run_or_spec
    from autotune.study.records import CONFIRMED_AT_TARGET, trial_records
    from autotune.study.storage import open_study

    spec, run_dir = load_run_or_spec(run, None)
    study = open_study(spec, run_dir or run, create=False)
    return sum(r.wall_s for r in trial_records(study) if r.info.get(CONFIRMED_AT_TARGET))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--space", choices=sorted(SPACES), default="wide", help="the knobs searched (see SPACES)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--confirm-top", type=int, default=0, help="the slice study's confirmations at full size")
    args = ap.parse_args()
    from typer.testing import CliRunner

    from autotune.cli.commands import app
    from local_ray_cluster import local_cluster

    base = args.run_dir or Path(tempfile.mkdtemp(prefix="slice-cpu-"))
    base.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict] = {}
    with local_cluster(args.nodes, 1) as address:
        confirm = f", confirm_top: {args.confirm_top}" if args.confirm_top else ""
        gbs, space = SPACES[args.space]
        for name, probe in (("full", ""), ("slice", f", probe_nodes: 1{confirm}")):
            spec = base / f"{name}.yaml"
            text = SPEC.format(
                name=name, nodes=args.nodes, probe=probe, trials=args.trials, steps=args.steps, gbs=gbs, space=space
            )
            spec.write_text(text)
            run = base / name
            t0 = time.monotonic()
            result = CliRunner().invoke(
                app, ["run", str(spec), "--run-dir", str(run), "--json", "--no-tracking", "--ray-address", address]
            )
            if result.exit_code != 0:
                print(result.output, file=sys.stderr)
                return 1
            payload = json.loads(result.stdout)
            report = json.loads(CliRunner().invoke(app, ["report", str(run), "--json"]).stdout)
            probes = report["summary"]["probes"]
            # the probes' walls on the devices they ran on: the slice's on 1 node, its confirmations on all
            device_s = float(probes["probe_seconds"]) * (args.nodes if name == "full" else 1)
            device_s += confirmation_seconds(run) * (args.nodes - 1) if name == "slice" else 0.0
            chosen = payload["best"][0]
            scale = CliRunner().invoke(
                app,
                [
                    "scale",
                    str(run),
                    "--nodes",
                    f"1,{args.nodes}",
                    "--repeats",
                    str(args.repeats),
                    "--no-tracking",
                    "--json",
                    "--ray-address",
                    address,
                ],
            )
            if scale.exit_code != 0:
                print(scale.output, file=sys.stderr)
                return 1
            at_target = next(p for p in json.loads(scale.stdout)["points"] if p["nodes"] == args.nodes)
            out[name] = {
                "trial": chosen["number"],
                "config": {k: chosen["params"][k] for k in KNOBS},
                "reported": chosen["metrics"]["tokens_per_s_per_device"],
                "measured_at_target": at_target["tokens_per_s_per_device"],
                "ci": at_target["tokens_per_s_per_device_ci"],
                "device_hours": device_s / 3600.0,
                "probes": probes["probes"],
                "wall_s": time.monotonic() - t0,
            }
    for name, row in out.items():
        ci = row["ci"]
        print(
            f"{name:>5}: trial {row['trial']} {row['config']}; reported {row['reported']:.0f} tokens/s/device, "
            f"measured at {args.nodes} nodes {row['measured_at_target']:.0f}"
            + (f" [{ci[0]:.0f}, {ci[1]:.0f}]" if ci else "")
            + f" (n={args.repeats}); {row['probes']} probes, {row['device_hours'] * 3600:.0f} device-s"
        )
    full, part = out["full"], out["slice"]
    ratio = part["measured_at_target"] / full["measured_at_target"]
    print(
        f"slice pick / full-size pick at {args.nodes} nodes: {ratio:.3f}; "
        f"device-hours: {part['device_hours'] / full['device_hours']:.2f} of the full-size study's"
    )
    print(f"run directories: {base}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
