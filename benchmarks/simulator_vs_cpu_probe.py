"""Simulator vs real torch probes on this machine: rank correlation over tiny CPU configs.

    python benchmarks/simulator_vs_cpu_probe.py [--trials 12] [--profile host.yaml] [--keep DIR]

Runs a study of ``search_spaces/tiny_llama_cpu.yaml`` (a tiny Llama on 2 gloo processes; every
trial a real probe) with a random sampler, so the configs spread over the grid instead of
clustering at the model's favourites, then compares the simulator's prediction of each probed
config (recorded with the trial before it ran) with what was measured:

- Spearman rank correlation and MAPE of predicted vs measured tokens/s/device, with the profile
  the spec names (the bundled ``cpu`` data-sheet figures) or ``--profile`` (e.g. a file written by
  ``autotune calibrate`` on this host);
- the refit of the model from all the measurements (``autotune.guide.refit``): step-time error before
  and after, and the factors.

Takes minutes (each probe starts two processes and trains for a few steps; bf16 configs are
slow on CPUs without native bf16). Issue #3 asks for the figure; nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import yaml

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")

from autotune.cli.assembly import study_runner  # noqa: E402
from autotune.dispatch.backends import BackendChoice  # noqa: E402
from autotune.guide.refit import fit_refit  # noqa: E402


def _assembled(spec, run_dir):
    """The dispatcher and launcher the CLI would give a torch study (autotune.cli.assembly)."""
    from autotune.cli.assembly import dispatcher_for, launcher_for

    choice = BackendChoice("torch", "benchmark")
    return {"dispatcher": dispatcher_for(spec, choice, run_dir), "launcher": launcher_for(spec, choice)}


from autotune.spec.load import load_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def spearman(x: list[float], y: list[float]) -> float:
    import numpy as np

    def ranks(v: list[float]) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for value in set(v):  # ties share their mean rank
            idx = [i for i, w in enumerate(v) if w == value]
            r[idx] = r[idx].mean()
        return r

    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--profile", type=Path, default=None, help="hardware profile file (default: the spec's)")
    ap.add_argument("--keep", type=Path, default=None, help="run directory to keep (default: a temporary one)")
    args = ap.parse_args()

    data = yaml.safe_load((REPO / "search_spaces" / "tiny_llama_cpu.yaml").read_text())
    data["name"] = "simulator-vs-cpu-probe"
    data["search"].update({"n_trials": args.trials, "sampler": "random", "seed": 7})
    data.pop("baseline", None)
    if args.profile:
        data["cluster"]["profile"] = str(args.profile.resolve())
    with tempfile.TemporaryDirectory(prefix="autotune-fidelity-") as tmp:
        spec_path = Path(tmp) / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(data))
        spec = load_spec(spec_path)
        run_dir = args.keep or Path(tmp) / "run"
        runner = study_runner(spec, run_dir, BackendChoice("torch", "benchmark"), **_assembled(spec, run_dir))
        try:
            outcome = runner.run()
        finally:
            runner.close()

    rows = [r for r in outcome.records if r.probed and r.status == "ok" and r.predicted]
    print(f"profile: {spec.cluster.profile_name}; {len(rows)} measured configs\n")
    print(f"{'trial':>5}  {'predicted':>10}  {'measured':>9}  {'error %':>8}  config")
    for r in sorted(rows, key=lambda r: -r.metrics["tokens_per_s_per_device"]):
        p, m = r.predicted["tokens_per_s_per_device"], r.metrics["tokens_per_s_per_device"]
        c = r.config
        print(
            f"{r.number:>5}  {p:>10,.0f}  {m:>9,.0f}  {100 * (p - m) / m:>+8.0f}  "
            f"tp{c['tp']} pp{c['pp']} dp{c['dp']} mbs{c['micro_batch_size']} zero{c['zero_stage']} "
            f"{c['recompute']} {c['precision']}"
        )
    if len(rows) < 3:
        print("\nfewer than 3 measured configs: no correlation")
        return
    predicted = [r.predicted["tokens_per_s_per_device"] for r in rows]
    measured = [r.metrics["tokens_per_s_per_device"] for r in rows]
    mape = sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(rows) * 100
    print(f"\nSpearman rank correlation {spearman(predicted, measured):.3f}; MAPE {mape:,.0f} %")
    refit = fit_refit((r.predicted, r.metrics.get("step_time_s")) for r in rows)
    print(
        f"refit from all {refit.n}: {refit.describe()}; "
        f"step-time error {refit.mape_before:.0f} % -> {refit.mape_after:.0f} %"
    )


if __name__ == "__main__":
    main()
