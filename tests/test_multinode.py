"""Trials that span nodes (issue #16), on a local Ray cluster of several raylets
(``ray.cluster_utils.Cluster``) with declared resources: one placement-group bundle per node,
one launcher task per bundle, the rendezvous from node 0; an unplaceable trial refused with
what is missing; a real 2-node x 1-process torch probe over gloo with the loss of a one-node run."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from support import TINY_TRAIN, local_npu_cluster

pytestmark = pytest.mark.timeout(600)

RECORDER = r"""
import json, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
out = os.environ["RECORD"]
with open(out, "a") as f:
    f.write(json.dumps({"argv": args, "env": {k: os.environ.get(k) for k in
            ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "ASCEND_RT_VISIBLE_DEVICES")},
            "pid": os.getpid()}) + "\n")
if args["--rank"] == "0":
    print(json.dumps({"metrics": {"tokens_per_s_per_device": 100.0, "step_time_s": 1.0}}))
"""


@pytest.fixture(scope="module")
def cluster():
    """A head (1 CPU, no NPU) and two worker raylets declaring NPU: 1 each, on this machine."""
    with local_npu_cluster(2) as c:
        yield c


def _spec(write_spec, tmp_path, nodes: int, argv: str, n_trials: int = 2, name: str = "mn.yaml"):
    text = TINY_TRAIN.replace("global_batch_size: 8", "global_batch_size: 12").replace(
        "cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2}",
        f"cluster: {{accelerator: npu, nodes: {nodes}, devices_per_node: 1}}",
    )
    text = text.replace(
        "backend: simulate",
        f"""backend:
  kind: command
  argv: {argv}
  timeout_s: 60
  env: {{RECORD: "{tmp_path / "record.jsonl"}"}}""",
    )
    text = text.replace(
        "search: {n_trials: 6, seed: 1}", f"search: {{n_trials: {n_trials}, seed: 1, sampler: random}}\ntarget: none"
    )
    return write_spec(text.replace("  tp: [1, 2]\n", "  tp: [1]\n").replace("  pp: [1, 2]\n", "  pp: [1]\n"), name)


def test_a_command_probe_runs_once_per_node_with_the_rendezvous(write_spec, tmp_path, cluster):
    script = tmp_path / "record.py"
    script.write_text(RECORDER)
    argv = (
        f'[{sys.executable}, {script}, --trial, "{{trial_file}}", --rank, "{{node_rank}}", --nnodes, "{{nnodes}}", '
        f'--master, "{{master_addr}}:{{master_port}}"]'
    )
    spec = _spec(write_spec, tmp_path, 2, argv)
    result = CliRunner().invoke(
        app,
        [
            "run",
            str(spec),
            "--run-dir",
            str(tmp_path / "run"),
            "--json",
            "--no-tracking",
            "--ray-address",
            cluster.address,
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["probes"] == 2
    records = [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]
    assert len(records) == 4  # 2 trials x 2 nodes
    for trial in (records[:2], records[2:]):  # the trials ran one after the other
        assert sorted(r["argv"]["--rank"] for r in trial) == ["0", "1"]
        assert {r["argv"]["--nnodes"] for r in trial} == {"2"} and {r["env"]["NNODES"] for r in trial} == {"2"}
        assert len({r["argv"]["--master"] for r in trial}) == 1  # one rendezvous: node 0's address and port
        assert {f"{r['env']['MASTER_ADDR']}:{r['env']['MASTER_PORT']}" for r in trial} == {trial[0]["argv"]["--master"]}
        assert sorted(r["env"]["NODE_RANK"] for r in trial) == ["0", "1"]
        # each node sees the device Ray assigned it (one NPU per node here)
        assert all(r["env"]["ASCEND_RT_VISIBLE_DEVICES"] == "0" for r in trial)


# A launcher whose full-size runs carry what the model does not price: on the 1-node slice the
# largest micro-batch is fastest; across the target's 2 nodes its communication stops overlapping
BREAKS_AT_TARGET = r"""
import json, os, sys, time
req = json.load(open(sys.argv[1]))
nodes, mbs = req["cluster"]["nodes"], req["params"]["micro_batch_size"]
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({"nodes": nodes, "mbs": mbs, "rank": os.environ.get("NODE_RANK", "0")}) + "\n")
step = 0.9 - 0.1 * mbs
if nodes == 2:
    step *= 3.0 if mbs == 4 else 1.3
for i in range(4):  # steps the pruner sees while the probe runs: a confirmation is never pruned
    print(json.dumps({"event": "step", "step": i, "step_time_s": step}), flush=True)
    time.sleep(0.5)
print(json.dumps({"metrics": {"step_time_s": step, "peak_memory_gib": 1.0}}))
"""


def test_a_slice_studys_best_are_measured_again_at_full_size(write_spec, tmp_path, cluster):
    """``cluster.confirm_top`` (issue 45): once a 1-node slice study's budget is spent, its two best
    configs by projection run once more across the target's 2 nodes, and the recommendation is the
    best of those measurements: the projection's favourite breaks at full size, and the study
    recommends the one that holds. Run again, it queues nothing twice."""
    script = tmp_path / "breaks.py"
    script.write_text(BREAKS_AT_TARGET)
    spec = _spec(write_spec, tmp_path, 2, f'[{sys.executable}, {script}, "{{trial_file}}"]', n_trials=3)
    text = spec.read_text()
    text = text.replace(
        "nodes: 2, devices_per_node: 1}", "nodes: 2, devices_per_node: 1, probe_nodes: 1, confirm_top: 2}"
    )
    text = text.replace("sampler: random", "sampler: grid").replace("global_batch_size: 12", "global_batch_size: 16")
    for knob in ("zero_stage: [0, 1, 3]", "recompute: [none, full]"):
        text = text.replace(knob, knob.split(":")[0] + ": [" + knob.split("[")[1].split(",")[0] + "]")
    spec.write_text(text)
    argv = ["run", str(spec), "--run-dir", str(tmp_path / "run"), "--json", "--no-tracking"]
    result = CliRunner().invoke(app, [*argv, "--ray-address", cluster.address])
    assert result.exit_code == 0, result.output
    assert "measuring the best 2 config(s) by projection again at the target's full size (2 nodes)" in result.stderr
    records = [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]
    assert sorted(r["mbs"] for r in records if r["nodes"] == 1) == [1, 2, 4]
    full = [r for r in records if r["nodes"] == 2]
    assert sorted(r["mbs"] for r in full) == [2, 2, 4, 4]  # the two best by projection, on both nodes
    out = json.loads(result.stdout)
    assert out["statuses"].get("pruned", 0) == 0, out["statuses"]
    assert "cluster.confirm_top" in out["stopped_because"]
    best = out["best"][0]
    assert best["params"]["micro_batch_size"] == 2 and best["confirmed_at_target"]["nodes"] == 2
    assert "projected_from" not in best  # a measurement at full size, not a projection
    again = CliRunner().invoke(app, [*argv, "--ray-address", cluster.address])
    assert again.exit_code == 0, again.output
    assert len((tmp_path / "record.jsonl").read_text().splitlines()) == len(records)


def test_a_study_the_cluster_can_never_place_is_refused_before_its_first_trial(write_spec, tmp_path, cluster):
    """Issue #30: a 4-node study on a smaller cluster recorded every trial as `invalid` and spent
    its budget; it is refused before the first trial (exit 3) with what a trial needs and what the
    cluster has."""
    spec = _spec(write_spec, tmp_path, 3, f'[{sys.executable}, -c, "pass"]', n_trials=3, name="big.yaml")
    result = CliRunner().invoke(
        app,
        [
            "run",
            str(spec),
            "--run-dir",
            str(tmp_path / "run"),
            "--json",
            "--no-tracking",
            "--ray-address",
            cluster.address,
        ],
    )
    assert result.exit_code == 3, result.output
    assert "no trial of this study can be placed" in result.stderr
    assert "spans 3 nodes of {NPU: 1, CPU: 1} each, but only 2 node(s)" in result.stderr
    assert "3 npu device(s) over 3 nodes" in result.stderr
    report = CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--json"])
    assert report.exit_code != 0 or not json.loads(report.stdout)["trials"]  # no trial recorded, none invalid


TORCH_SPEC = """
name: two-nodes
model: tiny-llama
workload: {{kind: train, seq_len: 64, global_batch_size: 4, warmup_steps: 1, measured_steps: 2, timeout_s: 240}}
cluster: {{accelerator: cpu, nodes: {nodes}, devices_per_node: {per_node}}}
backend: {{kind: torch, launcher: torchrun}}
target: none
space: {{tp: [1], pp: [1], micro_batch_size: [2], zero_stage: [0], recompute: [none], precision: [fp32]}}
objectives: [tokens_per_s_per_device]
search: {{n_trials: 1, seed: 0, sampler: random}}
{ray}
"""


def test_a_real_two_node_torch_probe_over_gloo_has_the_one_node_loss(write_spec, tmp_path, cluster):
    """The same data-parallel config (dp 2) as 2 nodes x 1 process through the cluster, and as
    1 node x 2 processes: torchrun's c10d rendezvous on node 0, gloo between the nodes, and the
    same loss (the probe's model and data are seeded)."""
    losses = {}
    for nodes, per_node, ray in ((2, 1, ""), (1, 2, "ray: {enabled: false}")):
        spec = write_spec(TORCH_SPEC.format(nodes=nodes, per_node=per_node, ray=ray), f"t{nodes}.yaml")
        args = ["run", str(spec), "--run-dir", str(tmp_path / f"run{nodes}"), "--json", "--no-tracking"]
        if nodes > 1:
            args += ["--ray-address", cluster.address]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        best = json.loads(result.stdout)["best"][0]
        assert best["source"] == "measured", best
        losses[nodes] = best["metrics"]["loss"]
        if nodes > 1:
            report = json.loads(CliRunner().invoke(app, ["report", str(tmp_path / "run2"), "--json"]).stdout)
            assert [n["node_rank"] for n in report["trials"][0].get("info", {}).get("nodes", [])] in ([0, 1], [])
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)


SLEEPER = r"""
import json, os, sys, time
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({"rank": args["--rank"], "t": time.time(), "pid": os.getpid(),
                        "raylet": os.environ.get("RAY_RAYLET_PID")}) + "\n")
time.sleep(float(os.environ.get("SLEEP", "0")))
if args["--rank"] == "0":
    print(json.dumps({"metrics": {"tokens_per_s_per_device": 100.0 + float(os.environ.get("SLEEP", "0")), "step_time_s": 1.0}}))
"""


def _remove_rank_1_node_once_started(cluster, workers, record: Path) -> tuple[threading.Thread, dict]:
    """A started thread that waits until both nodes of the first 2-node trial have started (two
    lines in ``record``), then removes the node running rank 1, ungracefully; ``killed["port"]`` is
    that node's raylet port."""
    killed: dict = {}

    def remove() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lines = record.read_text().splitlines() if record.exists() else []
            if len(lines) >= 2:
                raylet = json.loads(next(x for x in lines if json.loads(x)["rank"] == "1"))["raylet"]
                node = next(w for w in workers if str(w.all_processes["raylet"][0].process.pid) == raylet)
                killed["port"] = node.node_manager_port
                cluster.remove_node(node, allow_graceful=False)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=remove, daemon=True)
    thread.start()
    return thread, killed


@pytest.mark.slow  # CI time (34 s): a killed Ray worker's retry has a fast test (test_infrastructure)
def test_a_node_killed_mid_trial_is_an_infrastructure_failure_retried(write_spec, tmp_path):
    """Three NPU nodes; while the first 2-node trial runs, one of its nodes is removed from the
    cluster: that trial is an infrastructure failure naming the node, its config is retried once
    on the two nodes left, and the study completes its budget with no trial lost or doubled."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20})
    workers = [c.add_node(num_cpus=1, resources={"NPU": 1}, object_store_memory=80 * 2**20) for _ in range(3)]
    c.wait_for_nodes()
    record = tmp_path / "record.jsonl"
    script = tmp_path / "sleep.py"
    script.write_text(SLEEPER)
    argv = f'[{sys.executable}, {script}, --trial, "{{trial_file}}", --rank, "{{node_rank}}"]'
    spec = _spec(write_spec, tmp_path, 2, argv, n_trials=2, name="kill.yaml")
    spec.write_text(
        spec.read_text().replace(f'RECORD: "{tmp_path / "record.jsonl"}"', f'RECORD: "{record}", SLEEP: "4"')
    )

    killer, _ = _remove_rank_1_node_once_started(c, workers, record)
    try:
        result = CliRunner().invoke(
            app,
            [
                "run",
                str(spec),
                "--run-dir",
                str(tmp_path / "run"),
                "--json",
                "--no-tracking",
                "--ray-address",
                c.address,
            ],
        )
        killer.join(timeout=5)
        assert result.exit_code == 0, result.output
        trials = json.loads(CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--json"]).stdout)["trials"]
        infra = [t for t in trials if t["status"] == "infra"]
        assert len(infra) == 1 and "retried once" in infra[0]["failure"], [(t["status"], t["failure"]) for t in trials]
        assert re.search(r"node \d of 2|infrastructure failure", infra[0]["failure"])
        ok = [t for t in trials if t["status"] == "ok"]
        assert len(ok) == 2  # the budget, measured
        assert any(t["chosen_because"].startswith(f"retry of trial {infra[0]['number']}") for t in ok)
        assert len({json.dumps(t["params"], sort_keys=True) for t in ok}) == 2
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


@pytest.mark.slow  # ~60 s; a node killed mid-trial (retried) stays in CI
def test_a_node_lost_for_good_stops_the_study_with_exit_3_and_its_configs_resume(write_spec, tmp_path):
    """Issue #30: one node of a 2-node trial is killed and does not come back. The trial is an
    infrastructure failure; the next trials are not `invalid` (fed to the search as infeasible)
    and the budget is not spent: the study stops with exit 3 naming the node, and once a node is
    back the same command measures the configs left unmeasured."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20})
    workers = [c.add_node(num_cpus=1, resources={"NPU": 1}, object_store_memory=80 * 2**20) for _ in range(2)]
    c.wait_for_nodes()
    record = tmp_path / "record.jsonl"
    script = tmp_path / "sleep.py"
    script.write_text(SLEEPER)
    argv = f'[{sys.executable}, {script}, --trial, "{{trial_file}}", --rank, "{{node_rank}}"]'
    spec = _spec(write_spec, tmp_path, 2, argv, n_trials=3, name="lost.yaml")
    spec.write_text(
        spec.read_text()
        .replace(f'RECORD: "{tmp_path / "record.jsonl"}"', f'RECORD: "{record}", SLEEP: "3"')
        .replace("target: none", "target: none\nray: {placement_timeout_s: 30}")
    )
    killer, killed = _remove_rank_1_node_once_started(c, workers, record)
    args = ["run", str(spec), "--run-dir", str(tmp_path / "run"), "--json", "--no-tracking", "--ray-address", c.address]
    try:
        result = CliRunner().invoke(app, args)
        killer.join(timeout=5)
        assert result.exit_code == 3, result.output
        assert "lost" in result.stderr and f":{killed['port']}" in result.stderr  # the node, by address and port
        trials = json.loads(CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--json"]).stdout)["trials"]
        statuses = [t["status"] for t in trials if t["status"] != "waiting"]
        assert "invalid" not in statuses and "ok" not in statuses, [(t["status"], t["failure"]) for t in trials]
        assert statuses and set(statuses) == {"infra"}
        assert "(?)" not in trials[0]["failure"]  # the node that died is named, not "node 1 of 2 (?)"
        c.add_node(num_cpus=1, resources={"NPU": 1}, object_store_memory=80 * 2**20)  # the node is back
        c.wait_for_nodes()
        again = CliRunner().invoke(app, args)
        assert again.exit_code == 0, again.output
        trials = json.loads(CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--json"]).stdout)["trials"]
        ok = [t for t in trials if t["status"] == "ok"]
        assert len(ok) == 3 and len({json.dumps(t["params"], sort_keys=True) for t in ok}) == 3
        first = trials[0]
        assert any(t["status"] == "ok" and t["params"] == first["params"] for t in trials), "\n".join(
            str((t["number"], t["status"], t["params"], t["chosen_because"], t["failure"])) for t in trials
        )
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def test_trials_pack_side_by_side_and_never_oversubscribe_a_device(write_spec, tmp_path, cluster):
    """One-node trials of one NPU each, three asked at once on a cluster with two NPU nodes: two
    run side by side, the third waits for a device (never two probes on one NPU)."""
    record = tmp_path / "record.jsonl"
    script = tmp_path / "sleep.py"
    script.write_text(
        SLEEPER.replace(
            'with open(os.environ["RECORD"], "a") as f:', 'time.sleep(0)\nwith open(os.environ["RECORD"], "a") as f:'
        )
        + r"""
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({"end": time.time(), "pid": os.getpid(), "npu": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
                        "raylet": os.environ.get("RAY_RAYLET_PID")}) + "\n")
"""
    )
    argv = f'[{sys.executable}, {script}, --trial, "{{trial_file}}", --rank, "0"]'
    spec = _spec(write_spec, tmp_path, 1, argv, n_trials=3, name="pack.yaml")
    text = spec.read_text().replace(f'RECORD: "{tmp_path / "record.jsonl"}"', f'RECORD: "{record}", SLEEP: "3"')
    spec.write_text(text.replace("sampler: random}", "sampler: random, parallel_trials: 3}"))
    result = CliRunner().invoke(
        app,
        [
            "run",
            str(spec),
            "--run-dir",
            str(tmp_path / "run"),
            "--json",
            "--no-tracking",
            "--ray-address",
            cluster.address,
        ],
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    spans = {r["pid"]: [r["t"], None, r["raylet"]] for r in rows if "t" in r}
    for r in rows:
        if "end" in r:
            spans[r["pid"]][1] = r["end"]
    assert len(spans) == 3
    events = sorted(
        [(s, 1) for s, _, _ in spans.values()] + [(e, -1) for _, e, _ in spans.values()], key=lambda x: (x[0], x[1])
    )
    running, most = 0, 0
    for _, step in events:
        running += step
        most = max(most, running)
    assert most == 2  # side by side, and never more than the two NPUs
    first_two = sorted(spans.values())[:2]
    assert first_two[0][2] != first_two[1][2]  # on different nodes


def test_a_trial_that_cannot_be_placed_in_time_is_an_infrastructure_failure(write_spec, tmp_path, cluster):
    """The cluster could hold the trial, but one of its two NPUs is held by other work: the
    placement group waits ray.placement_timeout_s, the trial is an infrastructure failure saying
    what is free, it is retried once, and after three in a row the study stops and says why."""
    import ray

    ray.init(address=cluster.address)
    try:

        @ray.remote(num_cpus=0, resources={"NPU": 1})
        class Holder:
            def ping(self):
                return 1

        holder = Holder.remote()
        ray.get(holder.ping.remote())
        spec = _spec(write_spec, tmp_path, 2, f'[{sys.executable}, -c, "pass"]', n_trials=1, name="busy.yaml")
        spec.write_text(spec.read_text() + "ray: {placement_timeout_s: 2}\n")
        result = CliRunner().invoke(
            app, ["run", str(spec), "--run-dir", str(tmp_path / "run"), "--json", "--no-tracking"]
        )
        payload = json.loads(result.stdout)
        assert "the infrastructure failed 3 trials in a row" in payload["stopped_because"], result.output
        trials = json.loads(CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--json"]).stdout)["trials"]
        statuses = [t["status"] for t in trials]
        assert statuses[:3] == ["infra", "infra", "infra"] and statuses[3:] in (
            [],
            ["waiting"],
        )  # a retry, for the resume
        assert "could not be reserved within 2 s" in trials[0]["failure"] and "free now" in trials[0]["failure"]
        assert "retried once" in trials[0]["failure"] and "not retried again" in trials[1]["failure"]
        ray.kill(holder)
    finally:
        ray.shutdown()


def test_scale_refuses_a_size_the_cluster_cannot_place_before_any_probe(write_spec, tmp_path, cluster):
    """Issue 45: `autotune scale --nodes 1,3` on a cluster of two NPU nodes: exit 3 naming the size
    and what the cluster holds, and no probe run (not even at the size that fits)."""
    script = tmp_path / "record.py"
    script.write_text(RECORDER)
    argv = f'[{sys.executable}, {script}, --trial, "{{trial_file}}", --rank, "{{node_rank}}"]'
    spec = _spec(write_spec, tmp_path, 1, argv, n_trials=1, name="one.yaml")
    run = tmp_path / "run"
    args = ["--ray-address", cluster.address]
    done = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run), "--no-tracking", *args])
    assert done.exit_code == 0, done.output
    before = (tmp_path / "record.jsonl").read_text().splitlines()
    result = CliRunner().invoke(app, ["scale", str(run), "--nodes", "1,3", "--no-tracking", *args])
    assert result.exit_code == 3, result.output
    said = " ".join(result.stderr.split())
    assert "size 3x1 (3 node(s) x 1 npu device(s)) cannot be placed" in said and "only 2 node(s)" in said
    assert (tmp_path / "record.jsonl").read_text().splitlines() == before
    ok = CliRunner().invoke(app, ["scale", str(run), "--nodes", "1,2", "--no-tracking", "--json", *args])
    assert ok.exit_code == 0, ok.output
    points = json.loads(ok.stdout)["points"]
    assert [(p["nodes"], p["readings"], p["source"]) for p in points] == [(1, 1, "measured"), (2, 1, "measured")]
    records = [json.loads(x) for x in (tmp_path / "record.jsonl").read_text().splitlines()[len(before) :]]
    assert sorted(r["argv"]["--rank"] for r in records) == ["0", "0", "1"]  # 1 node, then 2 nodes


SCALE_SPEC = """
name: scale-tiny
model: tiny-llama
workload: {kind: train, seq_len: 64, global_batch_size: 8, warmup_steps: 1, measured_steps: 2, timeout_s: 300}
cluster: {accelerator: cpu, nodes: 1, devices_per_node: 1, threads_per_rank: 1}
backend: {kind: torch, launcher: torchrun}
target: none
space: {tp: [1], pp: [1], micro_batch_size: [2, 4], zero_stage: [0], recompute: [none], precision: [fp32]}
objectives: [tokens_per_s_per_device]
search: {n_trials: 2, seed: 0, sampler: random}
"""


@pytest.mark.slow
def test_scale_on_a_local_four_node_cluster_with_the_torch_probe(write_spec, tmp_path):
    """Issue 45's acceptance: `autotune scale` on the local 4-node Ray cluster with the tiny Llama
    torch probe prints the efficiency and the communication share per size (a profiled step at
    each) and writes the plot."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from local_ray_cluster import local_cluster

    spec = write_spec(SCALE_SPEC + "ray: {enabled: false}\n")
    run = tmp_path / "run"
    done = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run), "--json", "--no-tracking"])
    assert done.exit_code == 0, done.output
    with local_cluster(4, 1) as address:
        result = CliRunner().invoke(
            app,
            ["scale", str(run), "--nodes", "1,2,4", "--ray-address", address, "--no-tracking"],
            env={"COLUMNS": "160"},
        )
    assert result.exit_code == 0, result.output
    assert re.search(r"^ *\d+ +weak +4x1 +[\d,.]+ n=1 +\d+\.\d % +\d+\.\d %", result.stdout, re.M), result.stdout
    data = json.loads((run / "scaling" / "scaling.json").read_text())
    points = {p["nodes"]: p for p in data["points"]}
    assert data["source"] == "measured" and set(points) == {1, 2, 4}
    assert points[1]["scaling_efficiency"] == pytest.approx(1.0)
    for n in (2, 4):
        assert 0.0 < points[n]["scaling_efficiency"] < 1.5
        assert 0.0 < points[n]["comm_fraction"] < 1.0  # gloo's all-reduce between the nodes, profiled
        assert points[n]["projected_tokens_per_s_per_device"] > 0
    assert (run / "scaling" / "scaling.png").stat().st_size > 5_000


def test_collectives_are_measured_across_each_node_count_of_the_cluster(cluster):
    """Issue 45, item 4: `autotune calibrate --nodes`'s measurement, one probe per node of a
    placement group, every rank in one gloo group: all-reduce seconds per size at 1 and 2 nodes,
    fitted into the links the simulator pays; a count the cluster cannot place is refused first."""
    from autotune.dispatch.node_collectives import NodesUnavailable, measure_node_counts
    from autotune.dispatch.ray_dispatch import RayDispatcher
    from autotune.workers.calibrate_nodes import fit_inter_node_links

    dispatcher = RayDispatcher(address=cluster.address)
    try:
        with pytest.raises(NodesUnavailable, match="4 node"):  # head + 2 workers hold one CPU each
            measure_node_counts(dispatcher, "cpu", 1, [2, 4], (4, 64), 2)
        said: list[str] = []
        seconds = measure_node_counts(dispatcher, "cpu", 1, [1, 2], (4, 64, 1024), 2, progress=said.append)
    finally:
        dispatcher.shutdown()
    assert set(seconds) == {1, 2} and len(said) == 2
    assert set(seconds[2]["allreduce"]) == {4 * 1024, 64 * 1024, 1024 * 1024}
    assert all(t > 0 for t in seconds[2]["allreduce"].values())
    links = fit_inter_node_links(seconds, 1)
    assert set(links) == {2} and links[2]["bandwidth_gbps"] > 0


@pytest.mark.slow
def test_calibrate_writes_the_links_measured_across_nodes(tmp_path, cluster):
    """`autotune calibrate --nodes 2 --ray-address ...`: the host's profile with the link measured
    across two nodes of the cluster, which a spec then uses as any profile file."""
    import yaml

    from autotune.workers.hardware import load_profile

    out = tmp_path / "profile.yaml"
    args = ["calibrate", "--quick", "--ranks", "1", "--nodes", "2", "--ray-address", cluster.address, "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "across 2 nodes" in result.stdout
    profile = load_profile(str(out))
    assert set(profile["inter_node_links"]) == {2} and profile["inter_node_links"][2]["bandwidth_gbps"] > 0
    assert "# across nodes (1 rank(s) per node" in out.read_text()
    assert yaml.safe_load(out.read_text())["inter_node_links"]  # plain YAML: int keys
