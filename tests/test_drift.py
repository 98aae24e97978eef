"""Issue 44, "drift": on a long study a control config (the baseline, else the first measured) is
measured again at intervals (``search.drift_every``), and a change beyond the noise is reported: the
same config no longer measures the same, so comparisons across that trial are unsafe."""

from __future__ import annotations


import pytest

from autotune.guide.guided import Observation
from autotune.objectives.race import control_drift
from support import flat_guide, run_launcher_study


def test_a_change_beyond_the_noise_is_drift_and_one_within_it_is_not():
    found = control_drift([(0, 1000.0), (8, 1004.0), (16, 800.0)], 0.03)
    assert found["beyond_noise"] and found["at_trial"] == 16 and found["change"] == pytest.approx(-0.2)
    # 3 % apart at 3 % noise per reading: two standard errors of the difference are 8.5 %
    calm = control_drift([(0, 1000.0), (8, 1030.0)], 0.03)
    assert not calm["beyond_noise"] and calm["limit"] == pytest.approx(2 * 0.03 * 2**0.5)
    assert control_drift([(0, 1000.0)], 0.03) is None


_guide = flat_guide


def test_the_control_is_measured_again_after_drift_every_probes_and_is_not_the_races_budget():
    guide = _guide(6, drift_every=3)
    obs = [Observation(i, "ok", 1000.0 - 50 * i, 1.0, number=i) for i in range(3)]
    assert guide.drift_check(obs) is None  # two probes since the control's reading
    obs.append(Observation(3, "ok", 850.0, 1.0, number=3))
    check = guide.drift_check(obs)
    assert check is not None and check.index == 0 and check.remeasure and "drift check" in check.reason
    assert guide.drift_check(obs, exclude=[0]) is None  # running: not twice at once
    obs.append(Observation(0, "ok", 990.0, 1.0, number=4))
    assert guide.drift_check(obs) is None and guide.race_spent(obs) == 0  # the check is not the race's
    assert _guide(6).drift_check(obs) is None  # drift_every 0: never


# a team's launcher that slows down by 30 % from trial 5 on (a neighbour's job arrived)
PROBE = r"""
import json, random, sys
trial = json.load(open(sys.argv[sys.argv.index("--trial") + 1]))
truth = {1: 40.0, 2: 41.0, 4: 30.0, 8: 20.0}[trial["params"]["micro_batch_size"]]
slow = 0.7 if trial["number"] >= 5 else 1.0
tps = truth * slow * (1.0 + random.Random(trial["number"]).uniform(-0.01, 0.01))
print(json.dumps({"metrics": {"tokens_per_s_per_device": tps, "step_time_s": 1.0, "peak_memory_gib": 0.4}}))
"""


@pytest.mark.timeout(600)
def test_a_planted_slow_down_is_reported_as_drift(write_spec, tmp_path):
    _, payload, report = run_launcher_study(
        write_spec,
        tmp_path,
        PROBE,
        "micro_batch_size: [1, 2, 4, 8]\nprecision: [fp32]",
        "{n_trials: 9, seed: 1, prune: false, drift_every: 4, stop_early: false}",
        "drifting",
    )
    drift = payload["drift"]
    assert drift is not None and drift["beyond_noise"], drift
    assert drift["at_trial"] >= 5 and drift["change"] == pytest.approx(-0.3, abs=0.03)
    assert "not comparable" in report["summary"]["drift"]["sentence"]
    # the certificate compares the readings normalised to the control: the slowed-down re-measurement
    # of micro-batch 1 (28 tokens/s, truly 40) does not make micro-batch 2 (41) look 20 % ahead of it
    cert = report["summary"]["certificate"]
    assert cert["normalised_to_control"] and cert["noise"] < 0.05
    checks = [t for t in report["trials"] if t["chosen_because"].startswith("drift check")]
    assert checks, [t["chosen_because"] for t in report["trials"]]
