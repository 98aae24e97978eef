"""A real serving study on this CPU against the exhaustive truth of the same small space.

    python benchmarks/serving_cpu_study.py [--keep DIR] [--trials 6] [--quick]

Measures every config of ``search_spaces/tiny_llama_serve_cpu.yaml``'s space (vLLM's CPU engine
serving a tiny random-weight Llama under open-loop Poisson load; sampler ``exhaustive``), then
runs the study as a user would (sampler ``auto``: the simulator's ranking, then model-guided) with
its budget, and reports:

- every config's measured goodput per device, max rate meeting the SLO, p99 TTFT / TPOT;
- the config the study recommends, its goodput in the exhaustive measurement and in its own, and
  the ratio to the best goodput the exhaustive run found (issue #33 asks for >= 0.95);
- the simulator's prediction of each config (recorded before it ran) against the measurement.

Every figure is the engine's real responses (a probe starts the engine, waits for health, drives
load, reads /metrics). Takes about 1.5 minutes per config on a 2-core machine. Not a test.

``--quick`` is the smallest run, a smoke test of the benchmark itself (its figures mean little): two
configs (``max_num_seqs`` 1 and 8, chunked prefill on), rates 2 and 4 requests/s for 3 s each, one
closed-loop batch, a study budget of 2.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import yaml

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")

from autotune.cli.assembly import dispatcher_for, launcher_for, study_runner  # noqa: E402
from autotune.dispatch.backends import select_backend  # noqa: E402
from autotune.spec.space import config_key  # noqa: E402
from autotune.spec.load import load_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "search_spaces" / "tiny_llama_serve_cpu.yaml"
METRIC = "goodput_rps_per_device"


def _study(data: dict, run_dir: Path, tmp: Path, name: str):
    spec_path = tmp / f"{name}.yaml"
    data = {**data, "name": name}
    backend = dict(data["backend"])
    backend["python"] = os.path.abspath(SPEC.parent / backend["python"])  # not resolve(): a venv's python is a link
    data["backend"] = backend
    spec_path.write_text(yaml.safe_dump(data))
    spec = load_spec(spec_path)
    choice = select_backend(spec)
    runner = study_runner(
        spec, run_dir, choice, dispatcher=dispatcher_for(spec, choice, run_dir), launcher=launcher_for(spec, choice)
    )
    try:
        return runner.run()
    finally:
        runner.close()


def _row(r) -> str:
    m, c = r.metrics, r.config
    return (
        f"{r.number:>5}  {m.get(METRIC, float('nan')):>8.3f}  {m.get('max_rate_rps', float('nan')):>6g}  "
        f"{m.get('ttft_p99_ms', float('nan')):>9.0f}  {m.get('tpot_p99_ms', float('nan')):>9.1f}  "
        f"max_num_seqs {c.get('max_num_seqs')} chunked {c.get('enable_chunked_prefill')}"
    )


def quick(data: dict) -> dict:
    """The spec shrunk to the smallest run (``--quick``): 2 configs, 2 rates of 3 s, one batch, budget 2."""
    workload = dict(data["workload"], batch_sweep=[1])
    workload["traffic"] = dict(workload["traffic"], rates=[2, 4], duration_s=3, warmup_requests=2)
    space = dict(data["space"], max_num_seqs=[1, 8], enable_chunked_prefill=[True])
    return dict(data, workload=workload, space=space, search=dict(data["search"], n_trials=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=None, help="the study's budget (default: the spec's)")
    ap.add_argument("--keep", type=Path, default=None, help="folder for both run directories (default: temporary)")
    ap.add_argument("--quick", action="store_true", help="the smallest run: 2 configs, 2 short rates, budget 2")
    args = ap.parse_args()
    data = yaml.safe_load(SPEC.read_text())
    if args.quick:
        data = quick(data)
    with tempfile.TemporaryDirectory(prefix="autotune-serving-") as tmp_name:
        tmp = Path(tmp_name)
        base = args.keep or tmp
        exhaustive = dict(data, search={**data["search"], "sampler": "exhaustive", "n_trials": 1000})
        truth = _study(exhaustive, base / "exhaustive", tmp, "serving-exhaustive")
        study_data = dict(data)
        if args.trials:
            study_data["search"] = {**data["search"], "n_trials": args.trials}
        study = _study(study_data, base / "study", tmp, "serving-study")

    measured = [r for r in truth.records if r.probed and r.status == "ok"]
    print(f"exhaustive: {len(measured)} configs measured ({len(truth.records)} trials)")
    print(f"{'trial':>5}  {'goodput':>8}  {'rate':>6}  {'ttft p99':>9}  {'tpot p99':>9}  config")
    for r in sorted(measured, key=lambda r: -r.metrics.get(METRIC, 0.0)):
        print(_row(r))
    best = max(measured, key=lambda r: r.metrics.get(METRIC, 0.0))
    probed = [r for r in study.records if r.probed and r.status == "ok"]
    print(f"\nstudy: {len(probed)} configs measured, distinct: {len({config_key(r.config) for r in probed})}")
    for r in probed:
        print(_row(r))
    predicted = [(r.predicted.get(METRIC), r.metrics.get(METRIC)) for r in measured if r.predicted.get(METRIC)]
    if len(predicted) >= 3:
        from simulator_vs_cpu_probe import spearman

        p, m = zip(*predicted)
        print(
            f"\nsimulator vs the engine, {len(p)} configs: Spearman {spearman(list(p), list(m)):.2f}, "
            f"median predicted/measured {sorted(a / b for a, b in predicted if b)[len(p) // 2]:.2f}"
        )
    chosen = study.result.chosen
    same = next((r for r in measured if config_key(r.config) == config_key(chosen.config)), None)
    in_truth = same.metrics.get(METRIC, 0.0) if same else float("nan")
    top = best.metrics[METRIC]
    print(
        f"\nrecommended: trial {chosen.number} ({chosen.metrics.get(METRIC, float('nan')):.3f} in the study, "
        f"{in_truth:.3f} in the exhaustive run); best of the exhaustive run: trial {best.number} ({top:.3f}); "
        f"ratio {in_truth / top if top else float('nan'):.3f}"
    )


if __name__ == "__main__":
    main()
