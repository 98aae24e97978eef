"""What other rules would have reported from the same readings: the search benchmark's studies,
each judged at its end by several rules for picking the reported config among the measured ones.

A study's reported best can miss the optimum in two ways: it never measured a config near it, or it
measured one and reported another. The second is the report's rule, and a rule can be judged without
rerunning a search: at the end of each study of ``search_efficiency.py`` the readings are fixed, and
each rule below picks one measured config from them; the world's truth says how far it is from the
optimum. (The race's re-measurements follow the study's own rule, so a rule judged here is judged on
readings taken for another; a rule that would also steer the race needs a rerun.)

The rules:

- ``study``: what the study reported (``autotune.study.records.best_records`` with the guide's
  estimates: among the configs whose mean reading the noise cannot tell from the best, the best
  estimate of the objective model, which pools every reading);
- ``mean reading``: the best mean reading;
- ``model, every measured``: the objective model's estimate over every measured config, no window;
- ``model, contenders``: the same within a window of the believed noise (``noise_belief``: the
  study's own window is floored at the assumed 3 % and falls back to the readings where the model's
  estimates disagree with them, so the two differ in a few studies);
- ``prediction + readings``: each config's leave-one-out prediction (the model from every other
  reading, its sd scaled as the study's own misses say: the certificate's prior) combined with its
  readings at the study's measured noise, over every measured config; configs without a prediction
  by their mean reading.

    python benchmarks/report_rules.py [--within 0.03] [--json F] -- <search_efficiency.py arguments>

e.g. ``python benchmarks/report_rules.py --within 0.03 -- --methods autotune --in-process --worlds 30
--scenarios 7b-8x64,7b-8x32,13b-8x64,70b-32x64 --path production --device-check --budget 25
--step-noise 0.05``. Prints, per rule, the worlds whose pick is within ``--within`` of the optimum, and
the worlds it turned and lost against the study's report. ``--pool A.json B.json ...``: no run, the
table over earlier runs' ``--json`` files (three runs of 30 worlds pooled).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable


sys.path.insert(0, str(Path(__file__).resolve().parent))
import search_efficiency  # noqa: E402

from autotune.guide.interface import readings_of  # noqa: E402
from autotune.objectives.intervals import noise_belief  # noqa: E402
from autotune.objectives.race import _posterior  # noqa: E402 - the certificate's own view of one config
from autotune.spec.space import config_key  # noqa: E402

RULES = ("study", "mean reading", "model, every measured", "model, contenders", "prediction + readings")


def picks(guided: Any, trials: list, truth: Any) -> dict[str, float]:
    """Each rule's pick from a finished study's readings (``guided``: its sampler), as its true value
    over the optimum; ``study`` is filled in from the study's own curve by the caller."""
    guide = guided.guide
    obs = guided.observations(trials)
    values = readings_of(obs)
    if not values:
        return {}
    configs = guide.ranking.enumeration.configs
    sign = 1.0 if guide.direction == "maximize" else -1.0
    control = guide._control(obs)
    noise, _ = noise_belief((v for i, v in values.items() if i != control), guide.noise_floor(obs))
    estimate, _ = guide._objective_model(obs)
    priors = guide.measured_priors(obs)
    chosen: dict[str, int] = {
        "mean reading": guide.race_leader(values, noise, None),
        "model, every measured": max(values, key=lambda i: sign * estimate[i]),
        # the study's window (race_leader's), at the believed noise
        "model, contenders": guide.race_leader(values, noise, estimate),
        "prediction + readings": max(values, key=lambda i: sign * _posterior(values[i], noise, priors.get(i))[0]),
    }
    return {rule: truth.value.get(config_key(configs[i]), 0.0) / truth.optimum for rule, i in chosen.items()}


@contextlib.contextmanager
def judged(rows: list[dict[str, float]]):
    """While active, every autotune study of ``search_efficiency`` appends its rules' picks to ``rows``
    at its end, and the study's own report (its curve's ``final``) beside them."""
    at_end: Callable = search_efficiency.optimum_as_seen
    curve: Callable = search_efficiency.curve

    def observed(guided, trials, truth):
        rows.append(picks(guided, trials, truth))
        return at_end(guided, trials, truth)

    def curved(*args, **kwargs):
        out = curve(*args, **kwargs)
        if rows and "study" not in rows[-1]:
            rows[-1]["study"] = out["final"]
        return out

    search_efficiency.optimum_as_seen, search_efficiency.curve = observed, curved
    try:
        yield rows
    finally:
        search_efficiency.optimum_as_seen, search_efficiency.curve = at_end, curve


def table(rows: list[dict[str, float]], within: float) -> list[dict[str, Any]]:
    """Per rule: the studies whose pick is within ``within`` of the optimum, and those it turned
    and lost against the study's report."""
    threshold = 1.0 - within
    rows = [r for r in rows if "study" in r and len(r) > 1]
    study = [r["study"] >= threshold for r in rows]
    out = []
    for rule in RULES:
        right = [r[rule] >= threshold for r in rows]
        out.append(
            dict(
                rule=rule,
                studies=len(rows),
                right=sum(right),
                turned=sum(a and not b for a, b in zip(right, study)),
                lost=sum(b and not a for a, b in zip(right, study)),
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, theirs = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--within", type=float, default=0.02, help="a pick is right within this of the optimum")
    parser.add_argument("--json", type=Path, help="write every study's picks here")
    parser.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        help="no run: the table over earlier runs' --json files (worlds 0-29, 30-59, ...)",
    )
    args = parser.parse_args(ours)
    rows: list[dict[str, float]] = []
    if args.pool:
        for path in args.pool:
            try:
                rows.extend(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError) as exc:
                raise SystemExit(f"{path}: not a report_rules.py --json output ({exc})") from None
    else:
        if "--methods" not in theirs:
            theirs = ["--methods", "autotune", *theirs]
        with judged(rows):
            search_efficiency.main(theirs)
    if args.json:
        args.json.write_text(json.dumps(rows))
    result = table(rows, args.within)
    print(f"\nthe report's rule against others, on the same readings: picks within {args.within:.0%} of the optimum")
    print("| rule | studies | within | turned | lost |")
    print("|---|---|---|---|---|")
    for r in result:
        share = f"{r['right']} ({r['right'] / r['studies']:.1%})" if r["studies"] else "-"
        print(f"| {r['rule']} | {r['studies']} | {share} | {r['turned']} | {r['lost']} |")
    return 0 if result and result[0]["studies"] else 1


if __name__ == "__main__":
    sys.exit(main())
