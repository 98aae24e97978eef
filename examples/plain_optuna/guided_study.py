"""A plain Optuna study with autotune's guide as its sampler: no autotune runner, no MLflow, no Ray.

The spec gives the space, the model and the machine; ``GuidedSampler.from_spec`` ranks the space
with the simulator and proposes, trial by trial, the config most worth measuring given what was
measured so far. The objective is yours: here it runs the spec's own probe (a real measurement:
the torch probe on the tiny CPU spec) or, with ``--simulate``, the simulator (said so in the output).

    python examples/plain_optuna/guided_study.py search_spaces/tiny_llama_cpu.yaml --n-trials 6
    python examples/plain_optuna/guided_study.py search_spaces/llama2_7b_8npu.yaml --simulate
    python examples/plain_optuna/guided_study.py SPEC --storage sqlite:///study.db   # re-run: it resumes

Results go to stdout, one line per trial and the best at the end; exit 1 when no trial succeeded.
"""

from __future__ import annotations

import argparse
import sys

import optuna

from autotune.dispatch.backends import BackendChoice, launch_for, select_backend
from autotune.spec.resolve import objectives_of, probe_context
from autotune.guide.sampler import GuidedSampler, report_failure
from autotune.spec.load import load_spec
from autotune.workers.protocol import ProbeResult, TrialRequest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--n-trials", type=int, default=None, help="default: the spec's search.n_trials")
    ap.add_argument("--simulate", action="store_true", help="measure with the simulator instead of the probe")
    ap.add_argument("--storage", default=None, help="an Optuna storage URL; a re-run resumes the study")
    args = ap.parse_args()

    spec = load_spec(args.spec)
    n_trials = args.n_trials or spec.search.n_trials
    metric, direction = objectives_of(spec)[0]
    context = probe_context(spec)
    backend = BackendChoice("simulate", "--simulate") if args.simulate else select_backend(spec)
    print(f"measuring with: {backend.kind} ({backend.reason})", file=sys.stderr)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = GuidedSampler.from_spec(spec, n_trials=n_trials)
    study = optuna.create_study(
        study_name=spec.name, direction=direction, sampler=sampler, storage=args.storage, load_if_exists=True
    )

    def measure(request: TrialRequest) -> ProbeResult:
        if backend.simulated:
            from autotune.workers.simulate import simulate_trial

            return simulate_trial(request)
        from autotune.dispatch.dispatcher import LocalProcessDispatcher

        with LocalProcessDispatcher(max_parallel=1) as dispatcher:
            dispatcher.submit(request, launch_for(spec, backend, request))
            while True:
                done = dispatcher.wait_any(timeout=1.0)
                if done:
                    return done[0][1]

    def objective(trial: optuna.Trial) -> float:
        config = sampler.suggest_config(trial)
        request = TrialRequest(
            params=config,
            model=context.model,
            workload=context.workload,
            cluster=context.cluster,
            study=spec.name,
            number=trial.number,
            backend=spec.backend.model_dump(),
        )
        result = measure(request)
        trial.set_user_attr("source", result.source)
        if not result.ok:  # the guide learns from the failure: an OOM's byte counts, a NaN, ...
            report_failure(trial, "\n".join(filter(None, [result.reason, result.log_tail])), status=result.status)
            raise (
                optuna.TrialPruned(f"{result.status}: {result.reason}")
                if result.status == "pruned"
                else RuntimeError(f"{result.status}: {result.reason}")
            )
        for name in ("peak_memory_gib", "step_time_s"):
            if name in result.metrics:
                trial.set_user_attr(name, float(result.metrics[name]))
        return float(result.metrics[metric])

    done = len([t for t in study.trials if t.state.is_finished()])
    study.optimize(
        objective, n_trials=max(0, n_trials - done), callbacks=[sampler.stop_callback], catch=(RuntimeError,)
    )

    for t in study.trials:
        why = (t.system_attrs.get("autotune.guide") or {}).get("reason", "fixed or resumed")
        value = f"{t.value:.4g}" if t.value is not None else t.user_attrs.get("autotune.status", t.state.name.lower())
        params = " ".join(f"{k}={v}" for k, v in t.params.items())
        print(f"trial {t.number:3d} {t.user_attrs.get('source', '?'):9} {metric}={value:>10}  {params}  [{why}]")
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    stopped = sampler.stop_reason(study)
    print(f"trials: {len(study.trials)} of {n_trials}" + (f"; stopped early: {stopped}" if stopped else ""))
    if not complete:
        print("no trial succeeded", file=sys.stderr)
        return 1
    best = study.best_trial
    print(f"best: trial {best.number}, {metric} = {best.value:.4g} ({best.user_attrs.get('source')}): {best.params}")
    # the highest reading may be a slower config read high: the guide's estimate pools every trial
    estimates = sampler.estimates(study.trials)
    if estimates:
        key, (mean, sd, n) = max(estimates.items(), key=lambda kv: kv[1][0] * (1 if direction == "maximize" else -1))
        print(f"the guide's estimate puts first: {key} at {mean:.4g} ± {sd:.2g} ({n} measurement{'s' * (n > 1)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
