"""Orchestration time per trial of a whole study, with a no-op ``command`` probe.

    python benchmarks/orchestration_overhead.py [--trials 100] [--parallel 4] [--repeats 3]

Unlike ``dispatch_overhead.py`` (the dispatchers alone), this runs the real search loop —
``StudyRunner`` with Optuna ask/tell on the journal storage, canonical resolution and
de-duplication, the trial files, Ray dispatch of a process-group probe — on a study of
``--trials`` distinct configs, ``--parallel`` in flight, and reports the amortised wall time per
trial (total / trials, median of the interleaved repeats). Rows: with and without MLflow
tracking (one child run per trial on the default SQLite store), random sampler and ``auto``
(simulator ranking first, then TPE). Ray's start is measured once and left out of the rows (a
study pays it once, not per trial). The probe is ``sh -c 'echo {"metrics": ...}'``: the cheapest
real process, so what is left is the orchestration.

Target (issue #2): <= 25 ms per trial amortised at 4 parallel.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")

import optuna  # noqa: E402

from autotune.cli.assembly import launcher_for, tracking_for, study_runner  # noqa: E402
from autotune.dispatch.backends import BackendChoice  # noqa: E402
from autotune.dispatch.ray_dispatch import RayDispatcher  # noqa: E402
from autotune.spec.load import load_spec  # noqa: E402
from autotune.tracking.tracker import Tracker, default_tracking_uri  # noqa: E402

SPEC = """
name: bench-{tag}
model: tiny-llama
workload: {{kind: train, seq_len: 128, global_batch_size: 256}}
cluster: {{accelerator: cpu, nodes: 1, devices_per_node: 8}}
backend:
  kind: command
  argv: [sh, -c, 'echo "{{\\"metrics\\": {{\\"tokens_per_s_per_device\\": 1.0}}}}"']
  resources: {{num_cpus: 1}}
space:
  tp: [1, 2, 4]
  pp: [1, 2]
  micro_batch_size: [1, 2, 4, 8, 16, 32]
  recompute: [none, selective, full]
  zero_stage: [0, 1, 2, 3]
  precision: [bf16, fp16, fp32]
objectives: [tokens_per_s_per_device]
search: {{n_trials: {trials}, parallel_trials: {parallel}, sampler: {sampler}, seed: 0}}
"""


def one_study(
    tmp: Path, dispatcher: RayDispatcher, tag: str, trials: int, parallel: int, sampler: str, tracked: bool
) -> float:
    folder = tmp / tag
    folder.mkdir(parents=True)
    path = folder / "spec.yaml"
    path.write_text(textwrap.dedent(SPEC.format(tag=tag, trials=trials, parallel=parallel, sampler=sampler)))
    spec = load_spec(path)
    run_dir = folder / "run"
    t0 = time.perf_counter()
    tracker = Tracker(default_tracking_uri(run_dir), spec.name, run_dir / "mlartifacts") if tracked else None
    backend = BackendChoice("command", "benchmark")
    # the launcher as `autotune run` builds it: a Ray dispatcher needs each probe's launch
    runner = study_runner(
        spec,
        run_dir,
        backend,
        tracking=tracking_for(tracker, spec, backend, run_dir),
        dispatcher=dispatcher,
        launcher=launcher_for(spec, backend),
    )
    outcome = runner.run()
    if tracker:
        tracker.finish_parent()
    seconds = time.perf_counter() - t0
    ok = sum(1 for r in outcome.records if r.probed and r.status == "ok")
    if ok != trials:
        raise RuntimeError(f"{tag}: {ok} of {trials} trials ok ({outcome.stopped_because})")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    cases = [(sampler, tracked) for sampler in ("random", "auto") for tracked in (False, True)]
    times: dict[tuple[str, bool], list[float]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory(prefix="autotune-orch-") as tmp:
        t0 = time.perf_counter()
        dispatcher = RayDispatcher(None, num_cpus=args.parallel, resources=None, run_dir=Path(tmp) / "ray")
        ray_start = time.perf_counter() - t0
        try:
            one_study(Path(tmp), dispatcher, "warmup", 2 * args.parallel, args.parallel, "random", False)
            for r in range(args.repeats):  # interleaved: the machine's load drifts
                for sampler, tracked in cases:
                    tag = f"{sampler}-{'mlflow' if tracked else 'none'}-{r}"
                    s = one_study(Path(tmp), dispatcher, tag, args.trials, args.parallel, sampler, tracked)
                    times[(sampler, tracked)].append(s / args.trials * 1000)
        finally:
            dispatcher.shutdown()
    print(f"(local Ray start: {ray_start:.1f} s, once per study, not included below)")
    print(
        f"\n{args.trials} no-op trials per study, {args.parallel} in flight, {args.repeats} interleaved repeats; "
        f"{os.cpu_count()} CPU cores\n"
    )
    print(f"{'sampler':<8} {'tracking':<9} {'median ms/trial':>16} {'min':>7} {'max':>7}")
    print("-" * 51)
    for (sampler, tracked), ms in times.items():
        print(
            f"{sampler:<8} {'mlflow' if tracked else 'off':<9} {statistics.median(ms):>16.1f} "
            f"{min(ms):>7.1f} {max(ms):>7.1f}"
        )
    print("\n(amortised: wall time of the study / trials.) target: <= 25 ms/trial amortised at 4 parallel")


if __name__ == "__main__":
    main()
