"""Infrastructure failure is not the config's failure (issue #16): a Ray worker killed under a
trial gives status ``infra`` with the node named, the config is retried once, nothing is fed to
the search as a bad config, and the study completes its budget with no trial lost or doubled."""

from __future__ import annotations

import pytest

import json
import re

from typer.testing import CliRunner

from autotune.cli.commands import app
from support import command_spec

KILLER = r"""
import json, os, signal, sys, time
trial = json.load(open(sys.argv[sys.argv.index("--trial") + 1]))
marker = os.environ["KILL_MARKER"]
if trial["number"] == 2 and not os.path.exists(marker):
    open(marker, "w").write(str(os.getppid()))
    os.kill(os.getppid(), signal.SIGKILL)   # the Ray worker running this trial dies under it
    time.sleep(30)
p = trial["params"]
print(json.dumps({"event": "step", "step": 1, "step_time_s": 0.1}))
print(json.dumps({"metrics": {"tokens_per_s_per_device": 1000.0 * p["micro_batch_size"] / p["tp"], "step_time_s": 1.0}}))
"""


def test_a_killed_ray_worker_is_an_infrastructure_failure_retried_once(write_spec, tmp_path):
    spec = command_spec(write_spec, tmp_path, n_trials=5, parallel=1, ray="ray: {num_cpus: 2}")
    (tmp_path / "probe.py").write_text(KILLER)
    marker = tmp_path / "killed"
    spec.write_text(spec.read_text().replace("PROBE_SLEEP:", f'KILL_MARKER: "{marker}", PROBE_SLEEP:'))
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    assert marker.exists()  # the worker was killed
    assert "infrastructure failure; its config is retried once" in result.stderr
    trials = json.loads(CliRunner().invoke(app, ["report", str(run_dir), "--json"]).stdout)["trials"]
    infra = [t for t in trials if t["status"] == "infra"]
    assert len(infra) == 1 and infra[0]["number"] == 2
    assert re.search(r"infrastructure failure on node \d+\.\d+\.\d+\.\d+ \(\w+\)", infra[0]["failure"])
    assert "WorkerCrashedError" in infra[0]["failure"]
    assert f"Ray worker pid {marker.read_text()}" in infra[0]["failure"]
    assert "retried once as a new trial" in infra[0]["failure"]
    retry = [t for t in trials if t["chosen_because"].startswith("retry of trial 2 after an infrastructure failure")]
    assert len(retry) == 1 and retry[0]["status"] == "ok" and retry[0]["params"] == infra[0]["params"]
    ok = [t for t in trials if t["probed"] and t["status"] == "ok"]
    assert len(ok) == 5  # the whole budget measured: the infra trial spent none of it
    assert len({json.dumps(t["params"], sort_keys=True) for t in ok}) == 5  # none twice
    from support import mlflow_runs

    _, children = mlflow_runs(run_dir, "tiny")
    assert sorted(c.data.tags["autotune.status"] for c in children).count("infra") == 1


# ------------------------------------------------------------------- autotune doctor, many nodes
def test_doctor_on_a_local_multi_node_cluster(write_spec, tmp_path):
    """Three Ray nodes on this machine (a head and two workers declaring NPU: 2 each): doctor
    lists every node with its devices, free resources and software, and says whether a spec's
    largest trial can be placed."""
    import ray
    from ray.cluster_utils import Cluster

    from support import TINY_TRAIN

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"NPU": 2}, object_store_memory=80 * 2**20)
        cluster.wait_for_nodes()
        fits = write_spec(
            TINY_TRAIN.replace(
                "cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2}",
                "cluster: {accelerator: npu, nodes: 2, devices_per_node: 2}",
            ),
            "fits.yaml",
        )
        result = CliRunner().invoke(app, ["doctor", str(fits), "--ray-address", cluster.address, "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert len(report["nodes"]) == 3
        npus = sorted(n["total"].get("NPU", 0) for n in report["nodes"])
        assert npus == [0, 2, 2]
        # three raylets on one host: each is named so a person can tell them apart (issue #30)
        assert len({n["label"] for n in report["nodes"]}) == 3
        assert all("torch" in n["software"] and "ray" in n["software"] for n in report["nodes"])
        assert report["placement"]["ok"] and "2 node(s) have 2 NPU" in report["placement"]["why"]
        too_big = write_spec(
            TINY_TRAIN.replace(
                "cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2}",
                "cluster: {accelerator: npu, nodes: 2, devices_per_node: 4}",
            ),
            "big.yaml",
        )
        result = CliRunner().invoke(app, ["doctor", str(too_big), "--ray-address", cluster.address])
        assert result.exit_code == 1
        assert "needs 2 node(s) with 4 NPU each, but only 0 node(s)" in result.stdout
        assert "ray start --resources" in result.stdout
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


@pytest.mark.parametrize("accelerator", ["cpu", "cuda", "npu"])
def test_doctor_advises_a_ray_start_that_ray_accepts_and_names_each_node(accelerator):
    """Issue #30: on a CPU/GPU cluster doctor advised `ray start --resources '{"CPU": 1}'`, which Ray
    refuses ("use --num-cpus"); two nodes on one host read as the same `192.0.2.2: 1`."""
    import shlex

    from ray.scripts.scripts import start

    from autotune.cli.doctor import placement_verdict

    name = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}[accelerator]
    nodes = [
        {"label": f"192.0.2.2:{port} (node {nid})", "address": "192.0.2.2", "total": {name: 1.0}, "free": {}}
        for port, nid in ((40001, "aaaa1111"), (40002, "bbbb2222"))
    ]
    ok, why = placement_verdict(nodes, accelerator, 2, 4)
    assert not ok
    assert "192.0.2.2:40001 (node aaaa1111): 1" in why and "192.0.2.2:40002 (node bbbb2222): 1" in why
    command = why.split("`")[1]
    argv = shlex.split(command)
    assert argv[:2] == ["ray", "start"] and '"CPU"' not in command and '"GPU"' not in command
    ctx = start.make_context("start", argv[2:])  # Ray's own click parser reads the advice
    declared = {
        "cpu": ctx.params.get("num_cpus"),
        "cuda": ctx.params.get("num_gpus"),
        "npu": ctx.params.get("resources"),
    }[accelerator]
    assert declared in (4, '{"NPU": 4}'), ctx.params


def test_the_70b_four_node_spec_plans_on_the_simulator():
    from pathlib import Path

    spec = Path(__file__).resolve().parents[1] / "search_spaces" / "llama2_70b_32npu.yaml"
    result = CliRunner().invoke(app, ["plan", str(spec), "--json", "--top", "5"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["fit"] > 0 and len(payload["top"]) == 5
    for row in payload["top"]:
        p = row["params"]
        assert p["tp"] * p["pp"] * p["dp"] == 32 and p["tp"] <= 8
        assert row["metrics"]["peak_memory_gib"] <= 64


def test_ray_cluster_messages_go_to_the_log_not_stdout(capsys, caplog):
    """Ray's driver prints the cluster's error messages ("(raylet) A worker died ...") to stdout,
    which would break --json output exactly when a worker dies; autotune routes them to its log."""
    import logging

    import ray._private.worker as ray_worker

    from autotune.dispatch.ray_dispatch import _route_ray_messages

    saved = ray_worker.print_to_stdstream
    try:
        _route_ray_messages()
        with caplog.at_level(logging.WARNING, logger="autotune"):
            ray_worker.print_to_stdstream(
                {"lines": ["A worker died or was killed"], "pid": "raylet", "is_err": False}, ignore_prefix=False
            )
        assert "A worker died" not in capsys.readouterr().out
        assert "ray (raylet): A worker died or was killed" in caplog.text
    finally:
        ray_worker.print_to_stdstream = saved
