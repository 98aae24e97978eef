"""Does the model rank real probes right on this machine? (issue #17)

    python benchmarks/rank_fidelity.py [--profile host.yaml] [--refit-probes 3] [--json out.json]
                                       [--measurements earlier.json] [--configs 12]

Measures a fixed, diverse set of 12 tiny-Llama configs (tp, pp, micro-batch, recompute, ZeRO,
precision) with the torch probe on 2 gloo processes (``search_spaces/tiny_llama_cpu.yaml``'s
model and workload), and compares the simulator's predicted tokens/s/device of each with what
was measured:

- with the shipped ``cpu`` profile (data-sheet figures of a server socket),
- with ``--profile`` (a profile ``autotune calibrate --out host.yaml`` wrote on this host),
- after ``--refit-probes`` k refit measurements (``autotune.guide.refit`` from the first k configs of
  the list, judged on the other 12 - k): Spearman rank correlation and median absolute error.

Every config is measured once, in the list's order, each in a one-config study (so the order
and the measurements are the same whatever the profile). Takes several minutes (each probe
starts two processes; bf16 is slow on CPUs without native bf16). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from simulator_vs_cpu_probe import spearman  # noqa: E402

from autotune.cli.assembly import study_runner  # noqa: E402
from autotune.dispatch.backends import BackendChoice  # noqa: E402
from autotune.spec.resolve import objectives_of, probe_context  # noqa: E402
from autotune.guide.ranking import rank_space  # noqa: E402
from autotune.guide.refit import RIDGE_DATA_SHEET, RIDGE_MEASURED, fit_refit  # noqa: E402


def _assembled(spec, run_dir):
    """The dispatcher and launcher the CLI would give a torch study (autotune.cli.assembly)."""
    from autotune.cli.assembly import dispatcher_for, launcher_for

    choice = BackendChoice("torch", "benchmark")
    return {"dispatcher": dispatcher_for(spec, choice, run_dir), "launcher": launcher_for(spec, choice)}


from autotune.spec.space import Space, config_key  # noqa: E402
from autotune.spec.load import load_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# (tp, pp, micro_batch_size, recompute, zero_stage, precision): every knob varies, both ways
CONFIGS = [
    (1, 1, 4, "none", 0, "fp32"),
    (2, 1, 1, "full", 0, "fp32"),
    (1, 2, 1, "none", 0, "fp32"),
    (1, 1, 1, "none", 1, "fp32"),
    (2, 1, 4, "selective", 0, "fp32"),
    (1, 2, 2, "full", 0, "fp32"),
    (1, 1, 2, "full", 1, "fp32"),
    (2, 1, 2, "none", 0, "fp32"),
    (1, 1, 4, "selective", 0, "bf16"),
    (1, 2, 4, "none", 1, "fp32"),
    (2, 1, 1, "none", 0, "bf16"),
    (1, 1, 1, "selective", 0, "fp32"),
]
NAMES = ("tp", "pp", "micro_batch_size", "recompute", "zero_stage", "precision")


def _spec(tmp: Path, profile: Path | None, space: dict[str, list[Any]] | None = None, name: str = "rank-fidelity"):
    data = yaml.safe_load((REPO / "search_spaces" / "tiny_llama_cpu.yaml").read_text())
    data.update(name=name, target="none")
    data.pop("baseline", None)
    data["search"] = {"n_trials": 1, "sampler": "random", "seed": 0, "prune": False}
    data["ray"] = {"enabled": False}
    if space is not None:
        data["space"] = space
    if profile is not None:
        data["cluster"]["profile"] = str(profile.resolve())
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_spec(path)


def predictions(tmp: Path, profile: Path | None) -> dict[str, dict[str, Any]]:
    """The simulator's prediction of every config of the list (key -> metrics with time_*)."""
    space = {n: sorted({c[i] for c in CONFIGS}, key=str) for i, n in enumerate(NAMES)}
    spec = _spec(tmp, profile, space, name="rank-fidelity-space")
    sp = Space(spec)
    ranking = rank_space(sp.enumerate(), probe_context(spec), objectives_of(spec))
    out = {}
    for values in CONFIGS:
        resolved = sp.resolve(dict(zip(NAMES, values)))
        index = ranking.index_of(resolved.key)
        out[resolved.key] = ranking.metrics_of(index) if index is not None else {}
    return out


def measure(tmp: Path, configs: list[tuple] = CONFIGS) -> list[tuple[str, dict[str, Any], dict[str, float]]]:
    rows = []
    for n, values in enumerate(configs):
        space = {name: [value] for name, value in zip(NAMES, values)}
        spec = _spec(tmp, None, space, name=f"rank-fidelity-{n}")
        runner = study_runner(
            spec, tmp / f"run{n}", BackendChoice("torch", "benchmark"), **_assembled(spec, tmp / f"run{n}")
        )
        try:
            outcome = runner.run()
        finally:
            runner.close()
        record = next(r for r in outcome.records if r.probed)
        print(
            f"  measured {n + 1}/{len(configs)}: {record.status} "
            f"{record.metrics.get('tokens_per_s_per_device', float('nan')):,.0f} tokens/s/device  {values}",
            file=sys.stderr,
            flush=True,
        )
        rows.append((config_key(record.config), record.config, record.metrics if record.status == "ok" else {}))
    return rows


def judge(pred: list[float], meas: list[float]) -> str:
    errors = [abs(p - m) / m for p, m in zip(pred, meas)]
    return f"Spearman {spearman(pred, meas):.2f}, median abs error {100 * statistics.median(errors):,.0f} %"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, default=None, help="a calibrated profile (autotune calibrate --out FILE)")
    ap.add_argument("--refit-probes", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--measurements",
        type=Path,
        default=None,
        help="judge against the measurements of an earlier --json output instead of probing again "
        "(compare profiles on the same measurements, without the probes' run-to-run noise)",
    )
    ap.add_argument(
        "--configs",
        type=int,
        default=len(CONFIGS),
        help=f"measure only the first N configs of the list (default all {len(CONFIGS)}; a smoke run: 3)",
    )
    args = ap.parse_args()
    if not args.refit_probes < args.configs <= len(CONFIGS):
        ap.error(f"--configs must be more than --refit-probes ({args.refit_probes}) and at most {len(CONFIGS)}")
    with tempfile.TemporaryDirectory(prefix="autotune-rank-fidelity-") as tmp_name:
        tmp = Path(tmp_name)
        shipped = predictions(tmp, None)
        calibrated = predictions(tmp, args.profile) if args.profile else None
        if args.measurements:
            earlier = json.loads(args.measurements.read_text())["rows"]
            rows = [(config_key(r["config"]), r["config"], r["measured_metrics"]) for r in earlier]
        else:
            rows = [r for r in measure(tmp, CONFIGS[: args.configs]) if r[2].get("tokens_per_s_per_device")]
    metric = "tokens_per_s_per_device"
    meas = [m[metric] for _, _, m in rows]
    columns = {"shipped cpu profile": [shipped[k][metric] for k, _, _ in rows]}
    if calibrated:
        columns["calibrated profile"] = [calibrated[k][metric] for k, _, _ in rows]
    k = args.refit_probes
    base = calibrated or shipped
    refit = fit_refit(
        ((base[key], m["step_time_s"]) for key, _, m in rows[:k]),
        ridge=RIDGE_MEASURED if calibrated else RIDGE_DATA_SHEET,
    )  # as a study would
    after = [refit.apply(base[key]).get(f"refit_{metric}", base[key][metric]) for key, _, _ in rows]
    print(f"\n{len(rows)} configs measured on this host; predicted {metric} against measured\n")
    head = "  ".join(f"{c:>20}" for c in (*columns, f"refit after {k}"))
    print(f"{'config':<40}  {head}  {'measured':>10}")
    for i, (_, config, m) in enumerate(rows):
        c = config
        label = (
            f"tp{c['tp']} pp{c['pp']} mbs{c['micro_batch_size']} {c['recompute']} zero{c['zero_stage']} "
            f"{c['precision']}"
        ) + (" (refit)" if i < k else "")
        cells = "  ".join(f"{col[i]:>20,.0f}" for col in (*columns.values(), after))
        print(f"{label:<40}  {cells}  {m[metric]:>10,.0f}")
    print()
    for name, col in columns.items():
        print(f"{name}: {judge(col, meas)}")
    print(f"after {k} refit probes ({refit.describe()}), on the other {len(rows) - k}: {judge(after[k:], meas[k:])}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": [
                        {
                            "config": c,
                            "measured": m[metric],
                            "measured_metrics": m,
                            "shipped_prediction": shipped[key],
                            "calibrated_prediction": (calibrated or {}).get(key),
                        }
                        for key, c, m in rows
                    ],
                    **{n: col for n, col in columns.items()},
                    "refit": after,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
