"""How well the host's noise measured by ``autotune calibrate --serving`` describes a serving reading's
next run (issue 44: a serving study's noise before its own repeats).

    python benchmarks/serving_host_noise.py --profile P --rounds DIR1 DIR2 [DIR3 ...]

``P``: a profile ``autotune calibrate --serving`` wrote (its ``serving_steps.repeat_noise`` and
``repeat_noise_dof``; refit older readings with ``autotune calibrate --serving SPEC --readings
P.serving-calibration --out P``). ``DIR``: exhaustive runs of the same space kept by
``serving_cpu_study.py --model-check --keep`` (each config measured once a round). For every config and
round, the interval a study would report between runs on that one reading (the certificate's:
Student's t at the prior's degrees of freedom + 1, the study's confidence) is checked against the
config's readings in the other rounds and against the mean over every round. Reads kept runs only;
runs no engine. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import optuna
import yaml
from optuna.storages.journal import JournalFileBackend, JournalStorage

from autotune.guide.spec_settings import measured_noise
from autotune.objectives.intervals import between_runs_interval
from autotune.spec.space import config_key
from autotune.study.records import trial_records

METRIC = "goodput_rps_per_device"


def readings(run_dir: Path) -> dict[str, float]:
    """Each config's goodput in one kept exhaustive run (its only study)."""
    storage = JournalStorage(JournalFileBackend(str(run_dir / "optuna.journal")))
    study = optuna.load_study(study_name=None, storage=storage)
    return {
        config_key(r.config): float(r.metrics[METRIC]) for r in trial_records(study) if r.status == "ok" and r.probed
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--rounds", type=Path, nargs="+", required=True)
    args = ap.parse_args()
    if len(args.rounds) < 2:
        ap.error("--rounds: at least two kept runs (an interval is checked against another round)")
    prior = measured_noise(yaml.safe_load(args.profile.read_text()))
    if prior is None:
        ap.error(f"{args.profile}: serving_steps has no repeat_noise (calibrate with --repeats 2 or more)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rounds = [readings(d) for d in args.rounds]
    configs = sorted(set.intersection(*(set(r) for r in rounds)))
    others_held = others = means_held = n = 0
    print(f"host noise {prior.noise:.1%} per reading, {prior.dof} degrees of freedom ({args.profile})")
    print("| config | round | reading | interval | the other rounds | mean | holds the mean |")
    print("|---|---|---:|---|---|---:|---|")
    for k in configs:
        values = [r[k] for r in rounds]
        mean = statistics.fmean(values)
        for i, v in enumerate(values):
            low, high = between_runs_interval([v], prior.noise, prior.dof)
            rest = values[:i] + values[i + 1 :]
            others += len(rest)
            others_held += sum(low <= x <= high for x in rest)
            n += 1
            means_held += low <= mean <= high
            print(
                f"| {k[:60]} | {i} | {v:.2f} | [{low:.2f}, {high:.2f}] | {', '.join(f'{x:.2f}' for x in rest)} "
                f"| {mean:.2f} | {'yes' if low <= mean <= high else 'no'} |"
            )
    print(
        f"\n{len(configs)} configs x {len(rounds)} rounds: the other rounds' readings inside the interval "
        f"{others_held} of {others}; the mean over the rounds inside it {means_held} of {n}"
    )


if __name__ == "__main__":
    main()
