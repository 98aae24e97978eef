"""Memory safety of the search when the model is wrong (issue: <= 5 % OOM probes): the allocator's
byte counts parsed from an OOM, the peak of every step, honest P(fits) (widened by the model's own
error, lowered for every config tighter than one that ran out), and what OOM probes cost."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from autotune.spec.resolve import objectives_of, probe_context
from autotune.guide.guided import Guide, Observation
from autotune.guide.ranking import rank_space
from autotune.finish.report import memory_calibration, probe_costs
from autotune.study.records import TrialRecord
from autotune.study.interpret import step_peak_memory as _step_peak_memory
from autotune.spec.space import Space
from autotune.spec.schema import Spec
from autotune.workers.command import run_probe_process
from autotune.workers.protocol import oom_evidence

CUDA_NEW = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.15 GiB of which 1.23 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB memory in "
    "use. Of the allocated memory 75.20 GiB is allocated by PyTorch, and 1.30 GiB is reserved by PyTorch but "
    "unallocated."
)
CUDA_OLD = (
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
    "14.56 GiB already allocated; 3.75 MiB free; 14.72 GiB reserved in total by PyTorch)"
)
NPU = (
    "RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.97 GiB total capacity; 58.12 GiB "
    "already allocated; 58.12 GiB current active; 1.02 GiB free; 59.40 GiB reserved in total by PyTorch)"
)


@pytest.mark.parametrize(
    "text,requested,capacity,needed",
    [
        (CUDA_NEW, 2.0, 79.15, 79.15 - 1.23 + 2.0),
        (CUDA_OLD, 20 / 1024, 15.78, 15.78 - 3.75 / 1024 + 20 / 1024),
        (NPU, 2.0, 60.97, 60.97 - 1.02 + 2.0),
    ],
)
def test_oom_messages_give_their_byte_counts(text, requested, capacity, needed):
    e = oom_evidence(["[rank0]: step 3", text, "[rank0]: exiting"])
    assert e["requested"] == pytest.approx(requested, abs=1e-3)
    assert e["capacity"] == pytest.approx(capacity)
    assert e["needed_at_least"] == pytest.approx(needed, abs=1e-3)


def test_no_allocator_message_no_evidence():
    assert oom_evidence(["Killed", "std::bad_alloc"]) is None


def test_an_oom_probe_carries_the_evidence_in_its_result(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(f"import sys\nprint({NPU!r}, flush=True)\nsys.exit(1)\n")
    result = run_probe_process([sys.executable, str(script)], {}, tmp_path / "t.json", 30, watchdog=False)
    assert result.status == "oom"
    assert result.info["oom"]["needed_at_least"] == pytest.approx(61.95)


def test_a_probe_says_what_its_peak_counts(tmp_path):
    """The runner keeps what a probe says its peak counts, and a word it does not know is a
    protocol error (the peak is then taken as the device's), not a silent mismatch."""
    script = tmp_path / "probe.py"
    for counts, kept in (("allocated", "allocated"), ("allocted", None)):
        line = json.dumps(
            {"metrics": {"step_time_s": 1.0, "peak_memory_gib": 30.0}, "info": {"peak_memory_counts": counts}}
        )
        script.write_text(f"print({line!r}, flush=True)\n")
        result = run_probe_process([sys.executable, str(script)], {}, tmp_path / "t.json", 30, watchdog=False)
        assert result.status == "ok"
        assert result.info.get("peak_memory_counts") == kept
        if kept is None:
            assert "allocted" in result.info["protocol_errors"][0]


def test_the_peak_of_every_step_counts():
    steps = [
        {"event": "step", "phase": "warmup", "memory_gib": 41.5},
        {"event": "step", "phase": "measure", "memory_gib": 38.0},
    ]
    assert _step_peak_memory(steps) == 41.5
    assert _step_peak_memory([{"event": "step"}]) is None


# --------------------------------------------------------------------------------------- guide
SPEC = {
    "name": "mem",
    "model": "llama2-7b",
    "target": "none",
    "workload": {"kind": "train", "seq_len": 4096, "global_batch_size": 64},
    "cluster": {
        "accelerator": "npu",
        "profile": "ascend-910b",
        "devices_per_node": 8,
        "overrides": {"device_memory_gib": 40},
    },
    "space": {
        "tp": [1, 2, 4, 8],
        "pp": [1, 2, 4],
        "micro_batch_size": [1, 2, 4],
        "recompute": ["none", "selective", "full"],
        "zero_stage": [0, 1, 3],
    },
}


@pytest.fixture(scope="module")
def guide():
    spec = Spec.model_validate(SPEC)
    ranking = rank_space(Space(spec).enumerate(), probe_context(spec), objectives_of(spec))
    return Guide(ranking, ("tokens_per_s_per_device", "maximize"))


def _ok(guide, i, scale):
    peak = float(guide.peak[i]) * scale
    return Observation(i, "ok", objective=1000.0, step_time_s=1.0, peak_memory_gib=peak)


def test_peaks_the_model_cannot_explain_widen_every_unmeasured_configs_memory(guide):
    fits = np.flatnonzero(guide.peak < guide.limit * 0.8)
    a, b, c = fits[0], fits[len(fits) // 2], fits[-1]
    consistent = [_ok(guide, i, 1.10) for i in (a, b, c)]  # 10 % more everywhere: one factor explains it
    erratic = [_ok(guide, a, 1.30), _ok(guide, b, 0.95), _ok(guide, c, 1.25)]  # no factor explains this
    _, sd_consistent = guide._memory_model(consistent)
    _, sd_erratic = guide._memory_model(erratic)
    unmeasured = np.setdiff1d(np.arange(guide.n), [a, b, c])
    rel_c = sd_consistent[unmeasured] / guide.peak[unmeasured]
    rel_e = sd_erratic[unmeasured] / guide.peak[unmeasured]
    assert np.median(rel_e) > np.median(rel_c) + 0.05  # at least 5 % of the peak wider, on top of the prior


def test_a_departure_within_the_models_own_uncertainty_widens_nothing(guide):
    """A peak the model's own uncertainty covers is no sign of a term it lacks: the only ZeRO-0
    config measured, 7 % above its prediction (a value effect's prior is 8 % of the peak), and
    four ZeRO-3 configs measured as predicted. The leave-one-out error of the ZeRO-0 row is what
    its unmeasured value effect allows, which the posterior already carries for every config
    with that value; counted whole as well (before), it widened every config by 1.9 % of its
    peak, the ZeRO-3 configs the measurements pin down included."""
    configs = guide.ranking.enumeration.configs
    fits = guide.valid & (guide.peak < guide.limit * 0.8)
    zero3 = [i for i in np.flatnonzero(fits) if configs[i]["zero_stage"] == 3]
    zero0 = [i for i in np.flatnonzero(fits) if configs[i]["zero_stage"] == 0]
    measured = [zero3[0], zero3[len(zero3) // 3], zero3[2 * len(zero3) // 3], zero3[-1]]
    departed = zero0[len(zero0) // 2]
    obs = [_ok(guide, i, 1.0) for i in measured] + [_ok(guide, departed, 1.07)]
    belief = guide._memory_belief(obs)
    assert belief.discrepancy == 0.0
    # the departure is still learnt: the value's effect, not a widening of everything
    assert belief.mean[departed] > guide.peak[departed] * 1.03


def test_an_oom_lowers_p_fits_of_every_tighter_config_and_uses_the_allocators_bytes(guide):
    # a config the model says surely fits runs out of memory, 8 GiB over
    before = guide.fit_probability([], *guide._memory_model([]))
    sure = np.flatnonzero(guide.valid & (before > 0.96))
    roomy = int(sure[np.argmax(guide.peak[sure])])
    assert before[roomy] > 0.95
    oom = Observation(roomy, "oom", oom_needed_gib=float(guide.limit[roomy]) + 8.0)
    mean, sd = guide._memory_model([oom])
    plain_mean, _ = guide._memory_model([Observation(roomy, "oom")])  # the same OOM without byte counts
    assert mean[roomy] > guide.limit[roomy] and mean[roomy] > plain_mean[roomy] + 2.0  # how far over, not just over
    after = guide.fit_probability([oom], mean, sd)
    headroom = (guide.limit - mean) / guide.limit
    tighter = headroom <= headroom[roomy]
    assert tighter.sum() > 1 and np.all(after[tighter] <= after[roomy] + 1e-12)
    assert after[roomy] < 0.5


# ------------------------------------------------------------------------------------- summary
def _record(number, status, wall, p_fit=None):
    predicted = {"guided_p_fit": p_fit} if p_fit is not None else {}
    return TrialRecord(
        number=number,
        state="COMPLETE",
        config={},
        status=status,
        source="measured",
        metrics={},
        predicted=predicted,
        reason="",
        probed=True,
        baseline=False,
        chosen_because="",
        values=None,
        feasible=status != "oom",
        wall_s=wall,
    )


def test_summary_counts_what_oom_probes_cost_and_how_honest_p_fits_was():
    records = [
        _record(0, "ok", 100.0, 0.99),
        _record(1, "oom", 240.0, 0.97),
        _record(2, "ok", 90.0, 0.7),
        _record(3, "oom", 30.0, 0.6),
        _record(4, "duplicate", 0.0),
    ]
    cost = probe_costs(records)
    assert cost == {
        "probes": 4,
        "full_probes": 4,
        "probe_seconds": 460.0,
        "oom_probes": 2,
        "oom_probe_seconds": 270.0,
        "memory_profiles": 0,
        "memory_profile_seconds": 0,
        "oom_predicted": 0,
        # the OOM that ended after 30 s of a full probe's 95 (the median ok one) costs that share
        "full_probe_equivalents": pytest.approx(3 + 30.0 / 95.0, abs=1e-3),
    }
    # a trial its memory profile ended ran no full probe: its profile's walls are its cost, a share
    profiled = records + [_record(5, "oom_predicted", 30.0, 0.4)]
    profiled[-1].memory_profile = {"verdict": "oom_predicted", "walls_s": [10.0, 20.0], "layers_per_stage": [1, 4]}
    cost = probe_costs(profiled)
    assert cost["full_probes"] == 4 and cost["oom_predicted"] == 1 and cost["memory_profile_seconds"] == 30.0
    assert cost["full_probe_equivalents"] == pytest.approx(3 + 2 * 30.0 / 95.0, abs=1e-3)  # the median ok probe: 95 s
    bins = {(r["p_fit_from"], r["p_fit_to"]): (r["probes"], r["fitted"]) for r in memory_calibration(records)}
    assert bins == {(0.95, 1.0): (2, 1), (0.5, 0.8): (2, 1)}


def test_an_oom_below_the_capacity_teaches_the_usable_memory(guide):
    """A request that failed with in use + requested below the data-sheet capacity proves that less
    is usable (runtime and HCCL reserves): the search stops counting on the nominal figure."""
    nominal = float(guide.limit[0])
    first = int(np.flatnonzero(guide.peak < nominal * 0.9)[0])
    assert guide.usable_limit([])[0][0] == nominal
    oom = Observation(first, "oom", oom_needed_gib=nominal - 5.0, oom_in_use_gib=nominal - 7.0)
    usable, spread = guide.usable_limit([oom])
    assert nominal - 7.0 <= usable[first] <= nominal - 5.0 and spread[first] > 0
    # HCCL/NCCL buffers are per communicator and outside the allocator: a config with more of them
    # than the one that failed may have less usable, one with fewer is not credited
    comm = guide.mem_components[:, guide.mem_names.index("comm_buffers")]
    more, fewer = comm > comm[first] + 0.1, comm <= comm[first]
    assert more.any() and fewer.any()
    assert np.all(usable[more] < usable[first]) and np.all(spread[more] > spread[first])
    assert np.allclose(usable[fewer], usable[first]) and np.allclose(spread[fewer], spread[first])
    # a config the model puts between the usable and the nominal memory is no longer a safe bet
    mean, sd = guide._memory_model([])
    between = np.flatnonzero((mean > nominal - 4.0) & (mean < nominal - 1.0))
    assert between.size
    before = guide.fit_probability([], mean, sd)[between]
    after = guide.fit_probability([oom], *guide._memory_model([oom]))[between]
    assert np.all(after < 0.5) and np.all(before > after)
