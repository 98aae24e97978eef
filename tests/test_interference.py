"""Readings a slowdown spoiled (issue 44, the heavy tail): set aside, never averaged
(objectives/interference.py), by the guide (``Guide.with_interference``, ``Guide.suspect_reading``)
and by the report (``autotune.study.records``) alike."""

from __future__ import annotations

import math

import numpy as np
import optuna
import pytest

from autotune.guide.guided import Guide, Observation, readings_of
from autotune.objectives.interference import (
    MIN_INTERFERENCE_GAP,
    interference,
    interference_gap,
    interference_gaps,
    robust_noise,
    slowed_by_interference,
)
from autotune.spec.space import config_key
from autotune.study.records import INTERFERENCE_KEY, best_records, interference_readings, race_readings, study_readings
from support import flat_guide, measured_record, run_launcher_study

TPS = [("tokens_per_s", "maximize")]


def test_the_slower_of_two_readings_far_apart_is_interference_in_either_direction():
    assert interference([1000.0, 830.0], 0.127, maximize=True) == [False, True]
    assert interference([830.0, 1000.0], 0.127, maximize=True) == [True, False]
    assert interference([1000.0, 930.0], 0.127, maximize=True) == [False, False]  # within the gap: noise
    # a step time: the slower is the higher
    assert interference([1.0, 1.2], 0.127, maximize=False) == [False, True]
    assert interference([1.2, 1.0, 1.01], 0.127, maximize=False) == [True, False, False]
    # one reading has nothing to disagree with; a missing one is no reading
    assert interference([500.0], 0.127, maximize=True) == [False]
    assert interference([1000.0, None, math.nan, 700.0], 0.127, maximize=True) == [False, False, False, True]


def test_the_gap_reads_the_noise_robustly_and_never_below_its_floor():
    # fewer than three configs measured twice: the floor (3 %: 3 x sqrt 2 x 3 % = 12.7 %)
    assert interference_gap([[1000.0, 1002.0]], 0.03) == pytest.approx(3 * math.sqrt(2) * 0.03)
    assert interference_gap([], 0.01) == MIN_INTERFERENCE_GAP
    # a spoiled pair among three honest ones at 5 % noise does not raise the bar it is judged by
    rng = np.random.default_rng(0)
    honest = [list(1000.0 * (1 + 0.05 * rng.standard_normal(2))) for _ in range(7)]
    spoiled = [1000.0, 1000.0 / 1.2]
    noise = robust_noise([*honest, spoiled], 0.03)
    assert 0.03 <= noise < 0.08
    pooled = math.sqrt(sum(np.var(g, ddof=1) / np.mean(g) ** 2 for g in [*honest, spoiled]) / 8)
    assert pooled > noise  # the plain pooled spread is pulled up by the spoiled pair


def test_each_config_is_judged_against_the_noise_the_others_repeats_show():
    """On a machine far noisier than the floor (a shared CPU host, readings 15 % apart), the other
    configs' repeats widen the gap and no honest reading is set aside; a spoiled pair among quiet
    ones is still caught, and does not widen its own gap."""
    noisy = [[1000.0, 850.0], [2000.0, 1720.0], [1500.0, 1290.0]]
    gaps = interference_gaps(noisy, 0.03)
    assert all(g > 0.3 for g in gaps)
    assert not any(flag for group, gap in zip(noisy, gaps) for flag in interference(group, gap, True))
    quiet = [[1000.0, 1004.0], [2000.0, 1990.0], [1500.0, 1250.0]]
    gaps = interference_gaps(quiet, 0.03)
    assert gaps[2] == pytest.approx(3 * math.sqrt(2) * 0.03)  # the others' spread is below the floor
    assert interference(quiet[2], gaps[2], True) == [False, True]
    # alone, the first pair a study repeats is judged on the floor
    assert interference_gaps([[1000.0, 850.0]], 0.03) == [pytest.approx(3 * math.sqrt(2) * 0.03)]


def test_only_figures_a_slowdown_makes_worse_are_read_for_interference():
    assert slowed_by_interference("tokens_per_s") and slowed_by_interference("step_time_s")
    assert slowed_by_interference("goodput_req_s")
    assert not slowed_by_interference("peak_memory_gib")


def _obs(*groups):
    return [
        Observation(i, "ok", v, 1.0, number=10 * i + k, peak_memory_gib=10.0)
        for i, vs in enumerate(groups)
        for k, v in enumerate(vs)
    ]


def test_the_guide_sets_a_spoiled_reading_aside_but_keeps_its_peak_and_never_the_controls():
    guide = flat_guide(3)
    obs = guide.with_interference(_obs([1000.0, 700.0], [1010.0, 1008.0], [990.0, 820.0]))
    flagged = [(o.index, o.objective) for o in obs if o.interference]
    assert flagged == [(2, 820.0)]  # config 0 is the control (the first measured): its slowdown is drift
    assert readings_of(obs)[2] == [990.0]
    spoiled = next(o for o in obs if o.interference)
    assert spoiled.peak_memory_gib == 10.0 and spoiled.status == "ok"
    # the race's budget still counts the spoiled reading as spent
    assert guide.race_spent(obs) == 3


def test_a_single_reading_far_below_what_the_others_predict_of_it_is_measured_again():
    """The model predicts config 4 from the other four measurements; its one reading is 20 % below
    that and would otherwise be the best: a suspect, measured again. A reading within the noise of
    the prediction, or one already read twice, or with too few measurements behind the prediction,
    is not."""
    guide = flat_guide(6)
    obs = _obs([1000.0], [1010.0], [990.0], [1005.0], [1001.0 / 1.2])
    again = guide.suspect_reading(obs)
    assert again is not None and again.remeasure and again.index == 4
    assert "suspect reading" in again.reason and "interference" in again.reason
    assert guide.suspect_reading(obs, exclude=[4]) is None  # already running
    assert guide.suspect_reading(_obs([1000.0], [1010.0], [990.0], [1005.0], [960.0])) is None
    assert guide.suspect_reading(_obs([1000.0], [1010.0], [1001.0 / 1.2])) is None  # two behind it
    # measured again and far better: the first reading is set aside, and the config leads
    settled = guide.with_interference(obs + [Observation(4, "ok", 1021.0, 1.0, number=99)])
    assert readings_of(settled)[4] == [1021.0]
    assert guide.suspect_reading(settled) is None
    # a peak of memory is never suspected of interference, nor set aside
    memory = Guide(guide.ranking, ("peak_memory_gib", "minimize"))
    peaks = _obs([10.0], [10.1], [9.9], [10.05], [12.0], [12.0, 10.0])
    assert memory.suspect_reading(peaks) is None
    assert not any(o.interference for o in memory.with_interference(peaks))


def _record(number, mb, tps, **kw):
    return measured_record(number, {"micro_batch_size": mb}, {"tokens_per_s": tps}, **kw)


def test_the_report_sets_aside_what_the_guide_does_and_says_so():
    records = [
        _record(0, 1, 1000.0),
        _record(1, 2, 1035.0),
        _record(2, 4, 1040.0 / 1.2),  # mb 4 read slow once ...
        _record(3, 4, 1041.0),  # ... and right when measured again
        _record(4, 2, 1030.0),
    ]
    assert interference_readings(records, "tokens_per_s", "maximize") == {2}
    best = best_records(records, TPS)[0]
    assert best.config == {"micro_batch_size": 4} and best.metrics["tokens_per_s"] == 1041.0
    assert best.info[INTERFERENCE_KEY] == [2]
    readings = study_readings(records, "tokens_per_s", "maximize")
    assert readings.groups[config_key({"micro_batch_size": 4})] == [1041.0]
    # the certificate's count of re-measurements: a reading set aside was spent all the same
    assert readings.set_aside == [2] and race_readings(readings) == 2
    # the mean of both would have put mb 2 first
    assert (1041.0 + 1040.0 / 1.2) / 2 < 1032.5
    # a step time reads the other way round
    times = [measured_record(r.number, r.config, {"step_time_s": 1000.0 / r.metrics["tokens_per_s"]}) for r in records]
    assert interference_readings(times, "step_time_s", "minimize") == {2}


def test_the_best_line_and_the_summary_say_what_was_set_aside():
    from autotune.finish.report import study_summary
    from autotune.finish.run_output import _interval

    records = [_record(0, 1, 1000.0), _record(1, 4, 1040.0 / 1.2), _record(2, 4, 1041.0), _record(3, 2, 1020.0)]
    best = best_records(records, TPS)
    assert "trial 1 set aside as interference" in _interval(best[0], "tokens_per_s")
    summary = study_summary(optuna.create_study(direction="maximize"), records, TPS, best, records[0])
    row = next(r for r in summary["before_after"] if r["metric"] == "tokens_per_s")
    assert row["set_aside"] == [1] and row["readings"] == 1


# a team's launcher (1 % noise): micro-batch -> tokens/s; the second probe of micro-batch 2 ran beside
# a neighbour's job and read 20 % slow (the launcher counts its probes in a file beside it)
PROBE = r"""
import json, pathlib, random, sys
trial = json.load(open(sys.argv[sys.argv.index("--trial") + 1]))
mbs = trial["params"]["micro_batch_size"]
truth = {1: 40.0, 2: 41.0, 4: 27.0}[mbs]
count = pathlib.Path(__file__).with_name(f"probes-{mbs}")
seen = int(count.read_text()) if count.exists() else 0
count.write_text(str(seen + 1))
slow = 0.8 if (mbs == 2 and seen == 1) else 1.0
if slow < 1:
    pathlib.Path(__file__).with_name("slow-trial").write_text(str(trial["number"]))
tps = truth * slow * (1.0 + random.Random(trial["number"]).uniform(-0.01, 0.01))
print(json.dumps({"metrics": {"tokens_per_s_per_device": tps, "step_time_s": 1.0, "peak_memory_gib": 0.4}}))
"""


@pytest.mark.timeout(600)
def test_a_study_sets_a_slow_repeat_aside_and_says_so(write_spec, tmp_path):
    """Through the command backend and the CLI: the race measures micro-batch 2 again, the launcher
    reads it 20 % slow that once, and the study reports micro-batch 2 on its good reading (the mean of
    both would have put micro-batch 1 first), naming the trial it set aside."""
    _, _, report = run_launcher_study(
        write_spec,
        tmp_path,
        PROBE,
        "micro_batch_size: [1, 2, 4]\nprecision: [fp32]",
        "{n_trials: 7, seed: 1, prune: false}",
        "interfered",
    )
    slow = int((tmp_path / "slow-trial").read_text())
    readings = [t["metrics"]["tokens_per_s_per_device"] for t in report["trials"] if t["number"] == slow]
    assert readings and readings[0] < 34.0  # the launcher's slow reading is in the records
    assert report["summary"]["certificate"]["set_aside_as_interference"] == [slow]
    best = report["best"][0]
    assert best["params"]["micro_batch_size"] == 2, report["best"]
    assert best["metrics"]["tokens_per_s_per_device"] > 40.0
    row = next(r for r in report["summary"]["before_after"] if r["metric"] == "tokens_per_s_per_device")
    assert row["set_aside"] == [slow]
