"""Step events under Ray (issue #31, item 4): a probe that prints tens of thousands of
``{"event": "step"}`` lines keeps its final metrics line, and its step events still reach the
driver while it runs (``step_events()``), batched to the ``_StepSink`` actor."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from autotune.dispatch.dispatcher import ProbeLaunch
from autotune.dispatch.ray_dispatch import RayDispatcher
from autotune.workers.protocol import TrialRequest

PY = sys.executable

# Prints N step events as fast as it can, then the metrics line, then exits 0 at once: the
# output still queued when the probe exits is what run_probe_process has about a second for.
FLOOD_PROBE = textwrap.dedent("""
    import json, sys
    n = int(sys.argv[1])
    out = sys.stdout
    for i in range(n):
        out.write(json.dumps({"event": "step", "step": i, "step_time_s": 0.001}) + "\\n")
    out.write(json.dumps({"metrics": {"tokens_per_s": 123.0, "steps": n}}) + "\\n")
    out.flush()
""")

# A few step events, then a long pause: the events must reach the driver while it still runs.
SLOW_PROBE = textwrap.dedent("""
    import json, time
    for i in range(3):
        print(json.dumps({"event": "step", "step": i}), flush=True)
    time.sleep(30)
    print(json.dumps({"metrics": {"x": 1}}), flush=True)
""")


def request(number: int) -> TrialRequest:
    return TrialRequest(
        params={"tp": 1},
        model={"arch": "llama"},
        workload={"kind": "train"},
        cluster={"accelerator": "cpu"},
        study="t",
        number=number,
    )


@pytest.fixture(scope="module")
def ray_dispatcher(tmp_path_factory):
    pytest.importorskip("ray")
    d = RayDispatcher(None, num_cpus=2, resources=None, run_dir=tmp_path_factory.mktemp("ray_events"))
    yield d
    d.shutdown()


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.timeout(300)
def test_many_step_events_keep_the_metrics_line(ray_dispatcher, tmp_path):
    """20,000 step events then metrics: ``ok`` with its metrics (was ``crash``, "exited 0 without a
    metrics line": each event was one actor call, and the queued output outlived the 1 s drain)."""
    d = ray_dispatcher
    n = 20_000
    probe = _script(tmp_path, "flood.py", FLOOD_PROBE)
    h = d.submit(request(1), ProbeLaunch(argv=[PY, str(probe), str(n)], timeout_s=240, resources={"num_cpus": 0.5}))
    events: list[tuple[int, dict]] = []
    result = None
    end = time.monotonic() + 240
    while result is None and time.monotonic() < end:
        events.extend(d.step_events())
        for handle, r in d.wait_any(timeout=0.5):
            assert handle is h
            result = r
    assert result is not None, "the trial never finished"
    assert result.status == "ok", (result.status, result.reason)
    assert result.metrics == {"tokens_per_s": 123.0, "steps": float(n)}
    assert len(result.steps) == n
    # every step event reaches the driver too, in order, none twice (the last batch is sent at the end)
    deadline = time.monotonic() + 30
    while len(events) < n and time.monotonic() < deadline:
        events.extend(d.step_events())
        time.sleep(0.1)
    assert [e["step"] for number, e in events if number == 1] == list(range(n))


@pytest.mark.timeout(120)
def test_step_events_arrive_while_the_probe_runs(ray_dispatcher, tmp_path):
    """Batched, the events are still live: a probe that prints three steps and then works for a
    while has them at the driver well before it ends (pruning reads them)."""
    d = ray_dispatcher
    probe = _script(tmp_path, "slow.py", SLOW_PROBE)
    h = d.submit(request(2), ProbeLaunch(argv=[PY, str(probe)], timeout_s=60, resources={"num_cpus": 0.5}))
    try:
        seen: list[int] = []
        end = time.monotonic() + 25  # the probe sleeps 30 s after its steps
        while len(seen) < 3 and time.monotonic() < end:
            seen += [e["step"] for number, e in d.step_events() if number == 2]
            time.sleep(0.2)
        assert seen == [0, 1, 2]
        assert d.pending == 1  # still running: the events came live, not with the result
    finally:
        d.cancel(h)
        end = time.monotonic() + 60
        while d.pending and time.monotonic() < end:
            d.wait_any(timeout=1.0)


# The probe reports the CPU priority it ran at, as a metric: what the kernel gave the measured process.
NICE_PROBE = textwrap.dedent("""
    import json, os
    print(json.dumps({"metrics": {"niceness": os.nice(0)}}), flush=True)
""")


@pytest.mark.timeout(120)
def test_a_probe_records_the_cpu_priority_it_ran_at(ray_dispatcher, tmp_path):
    """Ray runs its workers, and so the probes, at niceness 15 unless the cluster says otherwise: the
    trial's info says what the measured process was given (the probe's own reading of it)."""
    d = ray_dispatcher
    probe = _script(tmp_path, "nice.py", NICE_PROBE)
    d.submit(request(3), ProbeLaunch(argv=[PY, str(probe)], timeout_s=60, resources={"num_cpus": 0.5}))
    result = None
    end = time.monotonic() + 60
    while result is None and time.monotonic() < end:
        for _, r in d.wait_any(timeout=0.5):
            result = r
    assert result is not None and result.status == "ok", result
    assert result.info["niceness"] == int(result.metrics["niceness"]) > 0
