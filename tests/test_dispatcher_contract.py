"""One contract over every dispatcher (issue #32): local process groups, Ray tasks, and Ray
placement groups over two nodes. Each runs a probe and returns its result once, classifies a
failure, stops a cancelled probe (its process group too) and says how long it ran, honours ``wait_any``'s timeout, counts
what is pending, and says a placeable trial can be placed."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from autotune.dispatch.dispatcher import LocalProcessDispatcher, ProbeLaunch
from autotune.dispatch.ray_dispatch import RayDispatcher
from autotune.workers.protocol import TrialRequest
from support import grandchild_probe, read_pid, script, wait_dead

pytestmark = pytest.mark.timeout(300)

OK_PROBE = r"""
import json, os, sys
trial = json.load(open(sys.argv[sys.argv.index("--trial") + 1]))
if os.environ.get("NODE_RANK", "0") == "0":
    print(json.dumps({"metrics": {"tokens_per_s_per_device": 10.0 * trial["params"]["tp"], "step_time_s": 1.0}}))
"""


def _request(number: int) -> TrialRequest:
    return TrialRequest(
        params={"tp": number + 1},
        model={"arch": "llama"},
        workload={"kind": "train"},
        cluster={"accelerator": "cpu"},
        study="contract",
        number=number,
    )


@pytest.fixture(scope="module", params=["local", "ray", "ray-2-nodes"])
def dispatching(request, tmp_path_factory):
    """(a dispatcher, what a launch of it adds: the nodes of a multi-node trial)."""
    import ray

    kind = request.param
    if kind == "local":
        d = LocalProcessDispatcher(max_parallel=2, run_dir=tmp_path_factory.mktemp("local"))
        yield d, {}
        d.shutdown()
        return
    if ray.is_initialized():
        ray.shutdown()
    if kind == "ray":
        d = RayDispatcher(num_cpus=2, run_dir=tmp_path_factory.mktemp("ray"))
        yield d, {}
        d.shutdown()
        ray.shutdown()
        return
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"NPU": 1}, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    d = RayDispatcher(address=cluster.address, run_dir=tmp_path_factory.mktemp("multi"))
    yield d, {"nodes": 2, "bundle": {"NPU": 1.0, "CPU": 1.0}, "placement_timeout_s": 60.0, "resources": {"num_cpus": 0}}
    d.shutdown()
    ray.shutdown()
    cluster.shutdown()


def _launch(argv: list[str], extra: dict, **kw) -> ProbeLaunch:
    return ProbeLaunch(argv=argv, timeout_s=kw.pop("timeout_s", 60), **{**extra, **kw})


def _drain(d, within_s: float = 120.0) -> dict[int, object]:
    out: dict[int, object] = {}
    end = time.monotonic() + within_s
    while d.pending and time.monotonic() < end:
        for handle, result in d.wait_any(timeout=1.0):
            assert handle.number not in out, "a trial came back twice"
            out[handle.number] = result
    assert not d.pending, "trials never finished"
    return out


def test_each_trial_comes_back_once_with_its_result(dispatching, tmp_path):
    d, extra = dispatching
    argv = script(tmp_path, OK_PROBE) + ["--trial", "{trial_file}"]
    for n in range(2):
        d.submit(_request(n), _launch(argv, extra))
    assert d.pending == 2
    results = _drain(d)
    assert {n: r.status for n, r in results.items()} == {0: "ok", 1: "ok"}
    assert results[1].metrics["tokens_per_s_per_device"] == 20.0


def test_a_failing_probe_is_classified(dispatching, tmp_path):
    d, extra = dispatching
    argv = script(
        tmp_path,
        "import sys\nprint('RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB')\nsys.exit(1)\n",
        "oom.py",
    )
    d.submit(_request(5), _launch(argv, extra))
    result = _drain(d)[5]
    assert result.status == "oom", result


def test_a_cancelled_probe_and_its_process_group_stop(dispatching, tmp_path):
    d, extra = dispatching
    pid_file = tmp_path / "grandchild.pid"
    # the grandchild would live ten minutes: on a loaded CI host (two test workers and two raylets on
    # two cores) the cancel's fallback path (a forced cancel 10 s on, then the watchdog) took over 30 s
    submitted_at = time.monotonic()
    handle = d.submit(_request(7), _launch(grandchild_probe(tmp_path, pid_file, lives_s=600), extra))
    pid = read_pid(pid_file, within_s=60)
    d.cancel(handle)
    cancelled_at = time.monotonic()
    result = _drain(d)[7]
    assert result.status == "pruned", result
    # the wall it ran, which the budget counts a pruned probe's share from (a Ray task cancelled
    # returns no result of its own: the step sink timed it); 0 would count it a whole full probe
    assert 0 < result.wall_s <= time.monotonic() - submitted_at, result
    died = wait_dead(pid, within_s=90)
    if not died:  # not left running for ten minutes after the failure
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert died, "the probe's grandchild outlived the cancel"
    if extra.get("nodes", 1) > 1:  # the nodes the trial reserved are free again, and soon
        import ray

        while ray.available_resources().get("NPU", 0) < 2 and time.monotonic() - cancelled_at < 20:
            time.sleep(0.2)
        assert ray.available_resources().get("NPU", 0) >= 2, "a cancelled trial kept its nodes reserved"


def test_wait_any_honours_its_timeout_and_placement_is_said(dispatching, tmp_path):
    d, extra = dispatching
    handle = d.submit(_request(9), _launch(script(tmp_path, "import time\ntime.sleep(3)\n", "slow.py"), extra))
    started = time.monotonic()
    assert d.wait_any(timeout=0.3) == [] and time.monotonic() - started < 10
    d.cancel(handle)
    _drain(d)
    placement = {k: extra[k] for k in ("nodes", "bundle") if k in extra}
    assert d.placement_problem(extra.get("resources", {"num_cpus": 1}), **placement) is None
