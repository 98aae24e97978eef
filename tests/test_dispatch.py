"""Dispatch of trials: resources, the in-process, local-process and Ray dispatchers."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autotune.dispatch.dispatcher import (
    Handle,
    InProcessDispatcher,
    LocalProcessDispatcher,
    ProbeLaunch,
    probe_env,
    resources_for,
)
from autotune.dispatch.ray_dispatch import RayDispatcher
from autotune.workers.protocol import ProbeResult, TrialRequest
from support import grandchild_probe, read_pid, wait_dead

PY = sys.executable

# Reads its trial file and environment, answers with them as metrics/info.
ECHO_PROBE = textwrap.dedent("""
    import json, os, sys
    trial = json.load(open(os.environ["AUTOTUNE_TRIAL_FILE"]))
    print(json.dumps({"event": "step", "step": 0}))
    print(json.dumps({"metrics": {"number": trial["number"], "tp": trial["params"]["tp"]},
                      "info": {"alloc": os.environ.get("PYTORCH_NPU_ALLOC_CONF"),
                               "static": os.environ.get("STATIC_VAR"), "argv": sys.argv[1:]}}))
""")


def request(number: int, **params) -> TrialRequest:
    params.setdefault("tp", number + 1)
    return TrialRequest(
        params=params,
        model={"arch": "llama"},
        workload={"kind": "train"},
        cluster={"accelerator": "cpu"},
        study="t",
        number=number,
    )


@pytest.fixture
def echo_launch(tmp_path: Path):
    path = tmp_path / "echo_probe.py"
    path.write_text(ECHO_PROBE)

    def make(**kw) -> ProbeLaunch:
        return ProbeLaunch(argv=[PY, str(path), "--trial", "{trial_file}"], env={"STATIC_VAR": "s"}, timeout_s=60, **kw)

    return make


def drain(dispatcher, timeout: float = 60.0) -> dict[int, ProbeResult]:
    out: dict[int, ProbeResult] = {}
    end = time.monotonic() + timeout
    while dispatcher.pending and time.monotonic() < end:
        for handle, result in dispatcher.wait_any(timeout=1.0):
            assert handle.number not in out, "a trial came back twice"
            out[handle.number] = result
    assert not dispatcher.pending, "trials never finished"
    return out


# -- resources ----------------------------------------------------------------------------------


def test_resources_for():
    assert resources_for("npu", 8) == {"num_cpus": 1, "resources": {"NPU": 8}}
    assert resources_for("cuda", 4) == {"num_cpus": 1, "num_gpus": 4}
    assert resources_for("cpu", 2) == {"num_cpus": 2}
    assert resources_for("npu", 8, override={"num_cpus": 0}) == {"num_cpus": 0}  # replaces entirely
    with pytest.raises(ValueError, match="accelerator"):
        resources_for("tpu", 1)


def test_probe_env_trial_params_win():
    launch = ProbeLaunch(argv=["x"], env={"A": "1", "PYTORCH_NPU_ALLOC_CONF": "default"})
    req = request(0, **{"env.PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "env.HCCL_BUFFSIZE": 200})
    assert probe_env(req, launch) == {
        "A": "1",
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
        "HCCL_BUFFSIZE": "200",
    }


# -- in-process -----------------------------------------------------------------------------------


def test_in_process_dispatcher():
    def simulate(req: TrialRequest) -> ProbeResult:
        if req.params["tp"] == 3:
            raise ZeroDivisionError("model bug")
        return ProbeResult("ok", metrics={"tp": req.params["tp"]}, source="simulated")

    with InProcessDispatcher(simulate) as d:
        handles = [d.submit(request(i)) for i in range(3)]
        assert d.pending == 3
        done = dict((h.number, r) for h, r in d.wait_any(timeout=0))
        assert d.pending == 0 and d.wait_any(timeout=0) == []
    assert [h.number for h in handles] == [0, 1, 2]
    assert done[0].metrics == {"tp": 1.0} and done[0].source == "simulated"
    assert done[2].status == "crash" and "ZeroDivisionError" in done[2].reason


# -- local processes ------------------------------------------------------------------------------


def test_local_dispatcher_runs_trials_in_parallel(tmp_path, echo_launch):
    events = []
    d = LocalProcessDispatcher(max_parallel=2, run_dir=tmp_path / "run", on_event=lambda n, e: events.append(n))
    try:
        for i in range(4):
            d.submit(request(i, **{"env.PYTORCH_NPU_ALLOC_CONF": f"conf{i}"}), echo_launch())
        results = drain(d)
    finally:
        d.shutdown()
    assert sorted(results) == [0, 1, 2, 3]
    for i, r in results.items():
        assert r.status == "ok", r
        assert r.metrics == {"number": i, "tp": i + 1}
        assert r.info["alloc"] == f"conf{i}" and r.info["static"] == "s"
        assert r.info["argv"] == ["--trial", str(tmp_path / "run" / "trials" / f"trial_{i:05d}.json")]
        assert len(r.steps) == 1
    assert sorted(events) == [0, 1, 2, 3]


def test_local_dispatcher_cancel_and_failures(tmp_path, echo_launch):
    pid_file = tmp_path / "gc.pid"
    with LocalProcessDispatcher(max_parallel=1) as d:
        running = d.submit(request(0), ProbeLaunch(argv=grandchild_probe(tmp_path, pid_file), timeout_s=60))
        queued = d.submit(request(1), echo_launch())
        d.submit(request(2), ProbeLaunch(argv=["/no/such/launcher"]))
        pid = read_pid(pid_file)
        d.cancel(queued)
        d.cancel(running)
        results = drain(d)
        assert isinstance(running, Handle)
    assert results[0].status == "pruned"
    assert results[1].status == "pruned"
    assert results[2].status == "invalid" and "not found" in results[2].reason
    assert wait_dead(pid)


def test_local_dispatcher_wait_any_timeout(tmp_path):
    with LocalProcessDispatcher(max_parallel=1) as d:
        assert d.wait_any(timeout=0) == []  # nothing pending
        h = d.submit(request(0), ProbeLaunch(argv=["sleep", "30"], timeout_s=60))
        assert d.wait_any(timeout=0.1) == []
        d.cancel(h)
        assert drain(d)[0].status == "pruned"


# -- Ray ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_dispatcher(tmp_path_factory):
    pytest.importorskip("ray")
    d = RayDispatcher(None, num_cpus=2, resources=None, run_dir=tmp_path_factory.mktemp("ray_run"))
    yield d
    d.shutdown()


def test_ray_runs_trials_in_parallel(ray_dispatcher, echo_launch):
    d = ray_dispatcher
    handles = [
        d.submit(request(i, **{"env.PYTORCH_NPU_ALLOC_CONF": f"conf{i}"}), echo_launch(resources={"num_cpus": 0.5}))
        for i in range(4)
    ]
    assert d.pending == 4
    results = drain(d)
    assert sorted(results) == [0, 1, 2, 3] and [h.number for h in handles] == [0, 1, 2, 3]
    for i, r in results.items():
        assert r.status == "ok", r
        assert r.metrics == {"number": i, "tp": i + 1}
        assert r.info["alloc"] == f"conf{i}" and r.info["static"] == "s"
        assert r.info["argv"][1] != "{trial_file}" and r.info["argv"][1].endswith("trial.json")
        assert r.info["host"]
    # the driver keeps a copy of every trial file
    copies = sorted(p.name for p in (d._trial_dir).iterdir())
    assert copies[:4] == [f"trial_{i:05d}.json" for i in range(4)]
    assert json.loads((d._trial_dir / "trial_00002.json").read_text())["params"]["tp"] == 3


def test_ray_impossible_request_is_invalid_at_once(ray_dispatcher, echo_launch):
    d = ray_dispatcher
    d.submit(request(7), echo_launch(resources=resources_for("npu", 8)))
    d.submit(request(8), echo_launch(resources={"num_cpus": 64}))
    done = dict((h.number, r) for h, r in d.wait_any(timeout=0))  # no waiting for a node that never comes
    assert done[7].status == "invalid"
    assert "NPU: 8" in done[7].reason and "offers" in done[7].reason and "NPU: 0" in done[7].reason
    assert done[8].status == "invalid" and "CPU: 64" in done[8].reason
    assert d.pending == 0


def test_ray_cancel_kills_the_probe_group(ray_dispatcher, tmp_path):
    d = ray_dispatcher
    pid_file = tmp_path / "gc.pid"
    h = d.submit(
        request(11), ProbeLaunch(argv=grandchild_probe(tmp_path, pid_file), timeout_s=60, resources={"num_cpus": 0.5})
    )
    pid = read_pid(pid_file)
    d.cancel(h)
    results = drain(d)
    assert results[11].status == "pruned"
    assert wait_dead(pid), "the probe's grandchild outlived the cancelled Ray task"


def test_ray_cancel_of_a_finished_trial_keeps_its_result(ray_dispatcher, echo_launch, monkeypatch):
    """A trial that finished before the driver cancels it (an interrupted study, a pruned loser)
    is not cancelled: a cancel racing the task's reply can kill the driver inside Ray, and the
    measurement it returned is kept."""
    import ray

    d = ray_dispatcher
    h = d.submit(request(12), echo_launch(resources={"num_cpus": 0.5}))
    ray.wait([h.ref], timeout=60)
    cancels = []
    monkeypatch.setattr(d._ray, "cancel", lambda *a, **k: cancels.append((a, k)))
    d.cancel(h)
    assert cancels == []
    results = drain(d)
    assert results[12].status == "ok" and results[12].metrics == {"number": 12, "tp": 13}


def test_ray_an_ignored_cancel_is_not_forced_once_the_trial_has_finished(ray_dispatcher, echo_launch, monkeypatch):
    """A cancelled trial that finished after the grace period, its result not yet collected, is
    not force-cancelled (the same race as above), and its measurement is kept."""
    import ray

    from autotune.dispatch import dispatcher as dispatch

    d = ray_dispatcher
    h = d.submit(request(13), echo_launch(resources={"num_cpus": 0.5}))
    ray.wait([h.ref], timeout=60)
    d._cancelled[h] = time.monotonic() - 2 * dispatch._FORCE_CANCEL_AFTER_S  # cancelled long ago, then finished
    cancels = []
    monkeypatch.setattr(d._ray, "cancel", lambda *a, **k: cancels.append((a, k)))
    d._escalate_cancels()
    assert cancels == []
    results = drain(d)
    assert results[13].status == "ok" and results[13].metrics == {"number": 13, "tp": 14}


def test_ray_probe_failure_and_timeout(ray_dispatcher, tmp_path):
    d = ray_dispatcher
    oom = tmp_path / "oom.py"
    oom.write_text("import sys; print('torch.OutOfMemoryError: CUDA out of memory'); sys.exit(1)\n")
    d.submit(request(20), ProbeLaunch(argv=[PY, str(oom)], resources={"num_cpus": 0.5}))
    d.submit(request(21), ProbeLaunch(argv=["sleep", "30"], timeout_s=0.5, resources={"num_cpus": 0.5}))
    results = drain(d)
    assert results[20].status == "oom"
    assert results[21].status == "timeout"


@pytest.mark.slow  # ~20 s; Ray cancel of a probe group stays in CI
def test_stop_tasks_cancels_only_unfinished_and_forces_only_ignored_cancels(ray_dispatcher):
    """Stopping a study's tasks never cancels a finished task (a cancel racing a task's reply can
    kill the driver inside Ray), and forces only a task still running after the grace period."""
    import ray

    from autotune.dispatch.ray_tasks import stop_tasks

    cancels: list[tuple[object, bool]] = []
    real_cancel = ray.cancel

    class Recording:  # ray, with cancel calls recorded
        wait = staticmethod(ray.wait)

        @staticmethod
        def cancel(ref, force=False):
            cancels.append((ref, force))
            return real_cancel(ref, force=force)

    def sleeps(seconds: float) -> None:
        time.sleep(seconds)

    task = ray.remote(num_cpus=0.1, max_retries=0)(sleeps)
    done = task.remote(0)
    ray.get(done)
    ends, no_grace = task.remote(4), task.remote(20)
    time.sleep(2.0)  # both running

    assert stop_tasks(Recording, [done, ends], grace_s=60.0) == []  # it ended within the grace period
    assert cancels == [(ends, False)]
    cancels.clear()
    assert stop_tasks(Recording, [done, ends, no_grace], grace_s=0.0) == [no_grace]
    assert cancels == [(no_grace, False), (no_grace, True)]
    ray.wait([no_grace], timeout=60)  # cancelled or ended: Ray ignores a force while the polite cancel is in flight


@pytest.mark.parametrize(
    "grace, expected", [("", 30.0), ("oom_exit_grace_s: 5", 5.0), ("oom_exit_grace_s: null", None)]
)
def test_the_specs_oom_exit_grace_reaches_the_probes_launch(write_spec, grace, expected):
    """backend.oom_exit_grace_s (30 s by default) travels with the launch to the worker that runs it."""
    from autotune.dispatch.backends import launch_for, select_backend
    from autotune.dispatch.dispatcher import ProbeLaunch
    from autotune.spec.load import load_spec
    from autotune.spec.resolve import probe_context

    spec = load_spec(
        write_spec(
            f"""
            name: oom-grace
            model: tiny-llama
            workload: {{kind: train, seq_len: 256, global_batch_size: 8}}
            cluster: {{accelerator: cpu, nodes: 1, devices_per_node: 2}}
            backend:
              kind: command
              argv: [python, launch.py, --trial, "{{trial_file}}"]
              {grace}
            space: {{tp: [1], micro_batch_size: [1]}}
            objectives: [tokens_per_s_per_device]
            """
        )
    )
    ctx = probe_context(spec)
    request = TrialRequest(
        params={"tp": 1, "pp": 1, "micro_batch_size": 1, "dp": 2},
        model=ctx.model,
        workload=ctx.workload,
        cluster=ctx.cluster,
    )
    launch = launch_for(spec, select_backend(spec), request)
    assert launch.oom_exit_grace_s == expected
    if not grace:  # the spec's default is the runner's
        from autotune.workers.command import OOM_EXIT_GRACE_S

        assert expected == OOM_EXIT_GRACE_S
    assert ProbeLaunch(**json.loads(json.dumps(launch.to_json()))).oom_exit_grace_s == expected  # as Ray ships it
