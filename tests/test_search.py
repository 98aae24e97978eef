"""The search loop with an in-process fake probe: resume, de-duplication, constraints."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from autotune.dispatch.backends import BackendChoice
from autotune.dispatch.dispatcher import InProcessDispatcher
from autotune.study.records import trial_records
from autotune.cli.assembly import study_runner
from autotune.study.storage import open_study
from autotune.trial_attrs import A
from autotune.spec.load import load_spec
from autotune.spec.space import Space
from autotune.workers.protocol import ProbeResult
from support import TINY_TRAIN

MEASURED = BackendChoice("command", "test")


def fake_probe(calls: list):
    """Throughput rises with micro-batch and falls with recompute; mbs 4 without recompute OOMs."""

    def probe(request):
        p = request.params
        calls.append(dict(p))
        if p["micro_batch_size"] == 4 and p["recompute"] == "none":
            return ProbeResult("oom", reason="NPU out of memory. Tried to allocate 2.00 GiB (rank 0)")
        tps = 1000.0 * p["micro_batch_size"] / (1.3 if p["recompute"] == "full" else 1.0) / p["tp"] / p["pp"]
        return ProbeResult("ok", metrics={"tokens_per_s_per_device": tps, "step_time_s": 1.0})

    return probe


def _spec(write_spec, text=TINY_TRAIN, **search):
    text = text.replace(
        "search: {n_trials: 6, seed: 1}",
        "search: {" + ", ".join(f"{k}: {v}" for k, v in {"n_trials": 6, "seed": 1, **search}.items()) + "}",
    )
    return load_spec(write_spec(text))


def _runner(spec, tmp_path, calls):
    return study_runner(spec, tmp_path / "run", MEASURED, dispatcher=InProcessDispatcher(fake_probe(calls)))


def test_budget_met_and_no_config_probed_twice(write_spec, tmp_path):
    calls: list = []
    spec = _spec(write_spec, n_trials=12, sampler="random")
    outcome = _runner(spec, tmp_path, calls).run()
    keys = [tuple(sorted(c.items())) for c in calls]
    assert len(keys) == len(set(keys)) == outcome.probes_run == 12
    records = outcome.records
    assert sum(r.probed for r in records) == 12
    dup = [r for r in records if r.status == "duplicate"]
    for r in dup:  # repeats are answered from the original, never probed
        assert not r.probed


def test_a_probe_that_ran_out_of_memory_costs_the_budget_the_wall_it_ran(write_spec, tmp_path):
    """An OOM ends at the step that failed (a quarter of a full probe's wall here): the budget counts
    that, not a whole full probe, and the study probes more configs for the same budget."""
    calls: list = []
    probe = fake_probe(calls)

    def timed(request):
        result = probe(request)
        result.wall_s = 25.0 if result.status == "oom" else 100.0
        return result

    spec = _spec(write_spec, n_trials=12, sampler="random")
    outcome = study_runner(spec, tmp_path / "run", MEASURED, dispatcher=InProcessDispatcher(timed)).run()
    probed = [r for r in outcome.records if r.probed and r.status != "duplicate"]
    ooms = [r for r in probed if r.status == "oom"]
    assert ooms and len(probed) > 12  # the OOMs gave back budget, spent on more configs
    # one that ran before any full probe's wall was known is counted whole until one is, then again
    assert outcome.probes_run == pytest.approx(len(probed) - len(ooms) + 0.25 * len(ooms))
    # a full probe starts only where the budget left pays for it: the study never spends past n_trials
    assert 11 < outcome.probes_run <= 12
    left = 12 - outcome.probes_run
    if left > 0.005:
        assert outcome.stopped_because == f"budget reached ({left:.2f} of a full probe left, too little for another)"
    else:
        assert outcome.stopped_because == "budget reached"


def test_a_probe_the_pruner_stopped_costs_the_budget_the_wall_it_ran(write_spec, tmp_path):
    """A pruned probe frees its devices where the pruner stopped it (a fifth of a full probe's wall
    here): like an OOM, it costs that share, and the budget it did not run goes to more configs."""
    calls: list = []
    probe = fake_probe(calls)

    def pruned_tp2(request):
        result = probe(request)
        if result.status == "ok" and request.params["tp"] == 2:
            result = ProbeResult("pruned", metrics=result.metrics, reason="stopped early after 2 measured steps")
            result.wall_s = 20.0
        else:
            result.wall_s = 100.0
        return result

    spec = _spec(write_spec, n_trials=10, sampler="random")
    outcome = study_runner(spec, tmp_path / "run", MEASURED, dispatcher=InProcessDispatcher(pruned_tp2)).run()
    probed = [r for r in outcome.records if r.probed and r.status != "duplicate"]
    pruned = [r for r in probed if r.status == "pruned"]
    first_ok = min(r.number for r in probed if r.status == "ok")
    early = sum(1 for r in pruned if r.number < first_ok)  # before a full probe's wall was known
    assert early and len(probed) > 10
    # counted whole until a full probe's wall was known, then at their share: as a resumed study counts
    assert outcome.probes_run == pytest.approx(len(probed) - 0.8 * len(pruned))
    assert outcome.probes_run <= 10
    resumed = _runner(_spec(write_spec, n_trials=10, sampler="random"), tmp_path, calls).run()
    assert resumed.stopped_because.startswith("already complete")  # the resume counts it the same


def test_oom_and_rule_violations_reach_the_sampler_as_constraints(write_spec, tmp_path):
    calls: list = []
    spec = _spec(write_spec, n_trials=16, sampler="random")
    outcome = _runner(spec, tmp_path, calls).run()
    study = outcome.study
    ooms = [t for t in study.trials if t.user_attrs.get(A.STATUS) == "oom"]
    rejected = [t for t in study.trials if t.user_attrs.get(A.STATUS) == "invalid"]
    assert ooms and rejected
    for t in ooms + rejected:
        assert t.state == TrialState.COMPLETE and t.constraints["feasible"] > 0
    for t in rejected:
        assert not t.user_attrs.get(A.PROBED) and "rejected by rules" in t.user_attrs[A.REASON]
    oks = [t for t in study.trials if t.user_attrs.get(A.STATUS) == "ok"]
    assert all(t.constraints["feasible"] == 0 for t in oks)
    # best trial respects constraints: never an OOM one
    assert study.best_trial.user_attrs[A.STATUS] == "ok"
    assert not any(c["micro_batch_size"] * c["dp"] > 8 for c in calls)  # invalid configs never dispatched


def test_resume_requeues_interrupted_trial(write_spec, tmp_path):
    calls: list = []
    spec = _spec(write_spec, n_trials=5, sampler="random")
    runner = _runner(spec, tmp_path, calls)
    runner.run()
    # simulate a kill mid-trial: one more trial left RUNNING with a full config
    study = open_study(spec, tmp_path / "run")
    config = {
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "vpp": 1,
        "micro_batch_size": 1,
        "sequence_parallel": False,
        "recompute": "full",
        "zero_stage": 3,
        "precision": "bf16",
        "dp": 2,
        "grad_accum": 4,
    }
    t = study.ask({})
    t.set_user_attr(A.CONFIG, config)
    t.set_user_attr(A.PROBED, True)
    calls.clear()
    spec2 = _spec(write_spec, n_trials=7, sampler="random")
    outcome = _runner(spec2, tmp_path, calls).run()
    interrupted = [r for r in outcome.records if r.status == "interrupted"]
    assert len(interrupted) == 1
    requeued = [tr for tr in outcome.study.trials if tr.user_attrs.get(A.REQUEUED_FROM) == interrupted[0].number]
    assert len(requeued) == 1 and requeued[0].user_attrs[A.STATUS] == "ok"
    assert config in calls  # the interrupted config was probed on resume
    probed = [r for r in outcome.records if r.probed and r.status != "interrupted"]
    assert len(probed) == 7  # the budget counts completed probes only


def test_trial_killed_while_being_proposed_is_closed_not_requeued(write_spec, tmp_path):
    """SIGKILL can land while Optuna writes a proposal param by param: such a trial has some
    params, no config and no probe; it must not be re-queued as a partial config."""
    calls: list = []
    spec = _spec(write_spec, n_trials=3, sampler="random")
    _runner(spec, tmp_path, calls).run()
    study = open_study(spec, tmp_path / "run")
    partial = study.ask({"tp": optuna.distributions.CategoricalDistribution([1, 2])})
    spec2 = _spec(write_spec, n_trials=5, sampler="random")
    outcome = _runner(spec2, tmp_path, calls).run()
    closed = [r for r in outcome.records if r.number == partial.number][0]
    assert closed.status == "interrupted" and "before its probe started" in closed.reason
    assert not [t for t in outcome.study.trials if t.user_attrs.get(A.REQUEUED_FROM) == partial.number]
    assert sum(1 for r in outcome.records if r.probed and r.status == "ok") == 5


def test_trial_killed_after_its_rule_rejection_is_closed_not_requeued(write_spec, tmp_path):
    """SIGKILL can land between a rule rejection's attributes and Optuna's tell: the trial holds a
    config, no probe; queued again, that config would skip the rules and reach a worker."""
    calls: list = []
    spec = _spec(write_spec, n_trials=3, sampler="random")
    _runner(spec, tmp_path, calls).run()
    study = open_study(spec, tmp_path / "run")
    rejected = study.ask({})
    bad = {"tp": 2, "pp": 2, "cp": 1, "micro_batch_size": 2, "dp": 1, "grad_accum": 4}
    rejected.set_user_attr(A.CONFIG, bad)
    rejected.set_user_attr(A.STATUS, "invalid")
    rejected.set_user_attr(A.REASON, "rejected by rules: tp*pp*cp does not divide the world size (2)")
    rejected.set_user_attr(A.SOURCE, "rules")
    outcome = _runner(_spec(write_spec, n_trials=4, sampler="random"), tmp_path, calls).run()
    closed = [r for r in outcome.records if r.number == rejected.number][0]
    assert closed.status == "invalid" and "rejected by rules" in closed.reason and not closed.probed
    assert not [t for t in outcome.study.trials if t.user_attrs.get(A.REQUEUED_FROM) == rejected.number]
    assert bad not in calls


def test_trial_killed_before_its_rule_verdict_is_judged_again_not_probed(write_spec, tmp_path):
    """SIGKILL can land between the resolver's recording of a proposal's config and the rules'
    verdict: a config, no key, no status. Queued again unjudged, the rejected config reached a
    worker, came back invalid as a probe and cost the budget one (CI: 7 configs measured of 8)."""
    calls: list = []
    spec = _spec(write_spec, n_trials=3, sampler="random")
    _runner(spec, tmp_path, calls).run()
    study = open_study(spec, tmp_path / "run")
    space = Space(spec)
    bad = {"tp": 2, "pp": 2, "micro_batch_size": 2, "zero_stage": 0, "recompute": "none"}
    study.enqueue_trial(bad)  # no attributes: the params as the sampler proposed them
    killed = study.ask(space.distributions())
    assert killed.params == bad and not space.resolve(bad).valid
    killed.set_user_attr(A.CONFIG, space.resolve(bad).config)  # the resolver's first write; then SIGKILL
    outcome = _runner(_spec(write_spec, n_trials=5, sampler="random"), tmp_path, calls).run()
    closed = [r for r in outcome.records if r.number == killed.number][0]
    assert closed.status == "invalid" and "rejected by rules" in closed.reason and not closed.probed
    assert not [t for t in outcome.study.trials if t.user_attrs.get(A.REQUEUED_FROM) == killed.number]
    assert not any(c["tp"] * c["pp"] > 2 for c in calls)
    assert sum(1 for r in outcome.records if r.probed and r.status == "ok") == 5  # the budget, all measured


def test_small_space_exhausts_without_reprobing(write_spec, tmp_path):
    text = (
        TINY_TRAIN.replace("  tp: [1, 2]\n  pp: [1, 2]\n", "  tp: [1]\n  pp: [1]\n")
        .replace("micro_batch_size: [1, 2, 4]", "micro_batch_size: [1, 2]")
        .replace("zero_stage: [0, 1, 3]", "zero_stage: [0]")
    )
    calls: list = []
    spec = _spec(write_spec, text, n_trials=10, sampler="random")
    outcome = _runner(spec, tmp_path, calls).run()
    assert len(calls) == 4  # 2 micro-batch x 2 recompute
    assert "every valid config of the space (4) has been probed" in outcome.stopped_because


def test_tpe_runs_with_constraints_without_warnings(write_spec, tmp_path, recwarn):
    calls: list = []
    spec = _spec(write_spec, n_trials=8, sampler="tpe")
    outcome = _runner(spec, tmp_path, calls).run()
    assert outcome.best and outcome.best[0].status == "ok"
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning) and "constraints_func" in str(w.message)]


def test_baseline_runs_first_and_is_marked(write_spec, tmp_path):
    text = TINY_TRAIN + "baseline: {tp: 2, pp: 1, micro_batch_size: 1, recompute: none}\n"
    calls: list = []
    spec = _spec(write_spec, text, n_trials=4, sampler="random")
    outcome = _runner(spec, tmp_path, calls).run()
    assert calls[0]["tp"] == 2 and calls[0]["micro_batch_size"] == 1
    assert outcome.baseline is not None and outcome.baseline.number == 0


def test_journal_lock_is_released_when_its_holder_is_killed(tmp_path):
    """A run SIGKILLed while writing the journal must leave no stale lock behind (Optuna's
    default symlink lock made the next run wait out a 30 s grace period)."""
    import fcntl
    import os
    import signal
    import subprocess
    import sys

    journal = tmp_path / "optuna.journal"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import time; from pathlib import Path; from autotune.study.storage import _journal_lock;"
                f"_journal_lock(Path({str(journal)!r})).acquire(); print('held', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
    )
    fd = None
    try:
        assert holder.stdout.readline().strip() == b"held"
        fd = os.open(str(journal) + ".flock", os.O_RDWR)
        with pytest.raises(BlockingIOError):  # really held while the holder lives
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free at once after the kill
    finally:
        if fd is not None:
            os.close(fd)
        if holder.poll() is None:
            holder.kill()


@pytest.mark.parametrize("sampler", ["auto", "random"])
def test_every_probe_carries_the_simulators_prediction(write_spec, tmp_path, sampler):
    """Predicted next to measured for every probed trial, whether the model ranked it or the
    sampler proposed it (issue #5 refits the model from these pairs)."""
    calls: list = []
    text = TINY_TRAIN + "baseline: {tp: 2, pp: 1, micro_batch_size: 1, zero_stage: 0, recompute: full}\n"
    spec = _spec(write_spec, text, n_trials=8, sampler=sampler)
    outcome = _runner(spec, tmp_path, calls).run()
    probed = [r for r in outcome.records if r.probed]
    assert len(probed) == 8 and sum(r.baseline for r in probed) == 1
    for r in probed:
        assert r.predicted["tokens_per_s_per_device"] > 0
        assert r.predicted["peak_memory_gib"] > 0


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_resuming_a_seeded_study_with_a_larger_budget_probes_new_configs(write_spec, tmp_path, sampler):
    """A seeded sampler re-created with the spec's seed replays its earlier proposals, every one
    answered without a probe (a study of hundreds stopped after 200 such misses in a row); a
    resumed study reseeds from its state and goes on proposing new configs."""
    calls: list = []
    first = _runner(_spec(write_spec, sampler=sampler, n_trials=8), tmp_path, calls).run()
    asked_before = len(first.study.trials)
    outcome = _runner(_spec(write_spec, sampler=sampler, n_trials=16), tmp_path, calls).run()
    assert len(calls) == 16, outcome.stopped_because
    assert len({tuple(sorted(c.items())) for c in calls}) == 16  # nothing probed twice
    resumed = [r for r in trial_records(outcome.study) if r.number >= asked_before]
    first_probe = next(i for i, r in enumerate(resumed) if r.probed)
    assert first_probe < 8  # not a replay of the first run's 8 probes (and its rejected proposals)


def test_a_grid_study_ends_when_its_grid_is_exhausted(write_spec, tmp_path):
    """Optuna's GridSampler calls study.stop() once every grid point was sampled, which raises
    outside study.optimize; the ask/tell loop takes it as the end of the grid, not a failure."""
    from typer.testing import CliRunner

    from autotune.cli.commands import app
    from support import TINY_TRAIN

    import json

    spec = write_spec(
        TINY_TRAIN.replace("search: {n_trials: 6, seed: 1}", "search: {n_trials: 80, seed: 1, sampler: grid}")
    )
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "run"), "--json", "--no-tracking"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["probes"] < 80 and "every valid config" in payload["stopped_because"]


def test_every_listener_hears_the_study_through_one_contract(write_spec, tmp_path):
    """Issue 43 (one listener contract): a listener handed to the loop is told the study started,
    each trial finished and each refit, as MLflow's is, and the finish stage tells it once that the
    study ended, with the result and the files it wrote: no listener is reached into."""
    from autotune.finish.study_end import finish_study
    from autotune.study.listeners import StudyEnded, TrialListener

    class Recorder(TrialListener):
        def __init__(self):
            self.heard: list[str] = []
            self.ended: list[StudyEnded] = []

        def study_started(self, study, ranking=None):
            self.heard.append("study_started")

        def trial_finished(self, study, record, result):
            self.heard.append(f"trial_finished {record.number}")

        def study_finished(self, ended):
            self.ended.append(ended)

    calls: list = []
    spec = _spec(write_spec, n_trials=4, sampler="random")
    recorder = Recorder()
    runner = study_runner(
        spec, tmp_path / "run", MEASURED, dispatcher=InProcessDispatcher(fake_probe(calls)), tracking=recorder
    )
    outcome = runner.run()
    runner.close()
    assert recorder in runner.listeners and recorder.heard[0] == "study_started"
    assert recorder.heard[1:] == [f"trial_finished {r.number}" for r in outcome.records if r.probed]
    finished = finish_study(
        spec,
        tmp_path / "run",
        outcome.study,
        outcome.result,
        probes_run=outcome.probes_run,
        stopped_because=outcome.stopped_because,
        listeners=runner.listeners,
    )
    (ended,) = recorder.ended
    assert ended.result is outcome.result and ended.stopped_because == outcome.stopped_because
    assert ended.files == finished.files and all(path.exists() for path in ended.files)
    assert ended.exports == finished.exports


def test_a_finished_trials_record_is_read_once_and_a_running_one_every_time():
    """The loop reads every record after each trial; a finished trial's never changes, so it is read
    once per study (the bookkeeping of a long study grew with the square of its trials)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    done = study.ask()
    done.set_user_attr(A.STATUS, "ok")
    study.tell(done, 1.0)
    running = study.ask()
    first = trial_records(study)
    assert [r.status for r in first] == ["ok", "running"]
    again = trial_records(study)
    assert again[0] is first[0]  # finished: the same record
    running.set_user_attr(A.STATUS, "oom")
    study.tell(running, state=TrialState.FAIL)
    last = trial_records(study)
    assert last[0] is first[0] and last[1].status == "oom" and last[1].state == "FAIL"
    # another study object over its own storage keeps its own records
    other = optuna.create_study()
    other.add_trial(optuna.trial.create_trial(value=2.0, user_attrs={A.STATUS: "ok"}))
    assert trial_records(other)[0] is not first[0]
