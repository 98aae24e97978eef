"""MindIE's multi-node inference (issue 46, "instances across nodes"): an aggregated MindIE instance wider
than a node is exported as the config.json every node of it merges and the rank table its nodes share,
as MindIE's docs run it (MindIE-LLM 3.0.0.beta.1, 5e896196: docs/zh/user_guide/user_manual/
prefill_decode_mixed_deployment.md, "多机混部"). MindIE does not install here (Ascend only): what it
writes is checked against MindIE's default config.json and the docs' rank table (tests/fixtures/mindie),
and against the checks MindIE's code applies, mirrored below with their source; the rules refuse what
MindIE cannot run across nodes, the probe one it cannot start."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any

import pytest

from autotune.export import ExportContext
from autotune.export._mindie import MULTINODE_NODES_MAX, merge_config
from autotune.finish.exports import EXPORTERS, write_exports
from autotune.spec.models import PRESETS
from autotune.stacks import STACKS
from support import CHAT_70B as CHAT, serving_config, serving_preset_run

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "mindie"
MODEL = {"name": "llama2-70b", "arch": "llama", "path": "/mnt/weights/llama2-70b", **PRESETS["llama2-70b"]}
# MindIE's prefix cache and SplitFuse do not take a Llama 2 (the mindie rules): both off
WIDE = {
    "tp": 16,
    "pp": 1,
    "replicas": 2,
    "block_size": 128,
    "max_num_seqs": 96,
    "max_num_batched_tokens": 6144,
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
}


def _context(cluster: dict[str, Any] | None = None, **changes: Any) -> ExportContext:
    return ExportContext(
        study="wide",
        trial=3,
        config=serving_config(**{**WIDE, **changes}),
        metrics={"goodput_rps_per_device": 0.09},
        source="simulated",
        model=dict(MODEL),
        workload=dict(CHAT),
        cluster=cluster or {"accelerator": "npu", "nodes": 4, "devices_per_node": 8, "profile": "ascend-910b"},
        target="mindie",
    )


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Any]:
    ctx = _context()
    assert EXPORTERS["mindie"].unsupported(ctx) == []
    path = write_exports(ctx, tmp_path_factory.mktemp("mindie_wide"), ["mindie"])["mindie"]
    written = json.loads(path.read_text())
    header = written.pop("_autotune")
    return {"header": header, "fragment": written, "config": merge_config(_default_config(), written)}


def _default_config() -> dict[str, Any]:
    return json.loads((FIXTURES / "config.json").read_text())


def _filled(table: dict[str, Any], node_ips: list[str], device_ips: list[list[str]]) -> dict[str, Any]:
    """The exported rank table with the cluster's addresses, as a team fills it."""
    text = json.dumps(table)
    for n, ip in enumerate(node_ips):
        text = text.replace(f"${{node{n}_ip}}", ip)
        for d, dip in enumerate(device_ips[n]):
            text = text.replace(f"${{node{n}_device{d}_ip}}", dip)
    return json.loads(text)


def _ranktable_errors(table: dict[str, Any]) -> list[str]:
    """MindIE-LLM 5e896196 src/config_manager/ranktable_config.cpp, CheckParam and the device checks:
    2-60 servers, server_count the list's length, 1-32 devices on every node and the same count on each,
    a container_ip on each, device_id in [0, 63], device_ip an IP address, rank_id in [0, 511]; and
    FillServerEle: the master is the server holding rank_id "0"."""
    errors = []
    servers = table["server_list"]
    if not 2 <= int(table["server_count"]) <= 60:
        errors.append("server_count in [2, 60]")
    if int(table["server_count"]) != len(servers):
        errors.append("server_count = len(server_list)")
    local = len(servers[0]["device"])
    if not 1 <= local <= 32 or any(len(s["device"]) != local for s in servers):
        errors.append("devices per node in [1, 32], equal on every node")
    for server in servers:
        if not server.get("container_ip"):
            errors.append("container_ip")
        for device in server["device"]:
            if not 0 <= int(device["device_id"]) <= 63 or not 0 <= int(device["rank_id"]) <= 511:
                errors.append("device_id in [0, 63], rank_id in [0, 511]")
            try:
                ipaddress.ip_address(device["device_ip"])
            except ValueError:
                errors.append(f"device_ip {device['device_ip']!r}")
    return errors


def _multinode_errors(config: dict[str, Any], table: dict[str, Any]) -> list[str]:
    """What MindIE-LLM 5e896196 checks of a node's config.json in multi-node inference:
    backend_config.cpp (npuDeviceIds: modelInstanceNumber subsets of worldSize devices; the port in
    [1024, 65535]), config_manager_impl.cpp (the endpoint's port is not multiNodesInferPort), and after
    UpdateMultiNodesInfer has taken the world from the rank table: model_wrapper/utils/config.py
    (tp * dp * cp = the rank table's world) and executor.cpp (tp * cp above the node's NPUs: the
    tensor-parallel group spans the nodes, and dp 1 is then valid)."""
    server, backend = config["ServerConfig"], config["BackendConfig"]
    model = backend["ModelDeployConfig"]["ModelConfig"][0]
    errors = []
    if backend["multiNodesInferEnabled"] is not True:
        errors.append("multiNodesInferEnabled")
    ids = backend["npuDeviceIds"]
    if len(ids) != backend["modelInstanceNumber"] or any(len(set(i)) != model["worldSize"] for i in ids):
        errors.append("npuDeviceIds vs modelInstanceNumber x worldSize")
    if backend["modelInstanceNumber"] != 1:
        errors.append("modelInstanceNumber 1 in multi-node inference (service_parameter_configuration.md)")
    port = backend["multiNodesInferPort"]
    if not 1024 <= port <= 65535 or port == server["port"]:
        errors.append("multiNodesInferPort in [1024, 65535], not the endpoint's port")
    per_node = len(table["server_list"][0]["device"])
    world = sum(len(s["device"]) for s in table["server_list"])
    tp, dp, cp = (int(model.get(k, 1)) for k in ("tp", "dp", "cp"))
    if tp * dp * cp != world:
        errors.append(f"tp * dp * cp = {tp * dp * cp}, the rank table's world {world}")
    if "tp" not in model or tp * cp <= per_node:
        errors.append("tp spans the nodes (executor.cpp npuNumPerDP > npuNumPerNode)")
    return errors


def test_every_node_merges_a_config_mindie_accepts_for_one_instance_over_two_nodes(exported):
    config, table = exported["config"], exported["header"]["rank_table"]
    filled = _filled(table, ["10.0.0.1", "10.0.0.2"], [[f"10.20.{n}.{d}" for d in range(8)] for n in range(2)])
    assert _multinode_errors(config, filled) == []
    model = config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    assert (model["worldSize"], model["tp"], model["dp"]) == (8, 16, 1)
    assert config["BackendConfig"]["npuDeviceIds"] == [list(range(8))]
    # the trial's own settings are there too
    assert config["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] == 96
    assert config["BackendConfig"]["ScheduleConfig"]["cacheBlockSize"] == 128


def test_the_checks_are_not_vacuous():
    """The same checks refuse what a single-node export of the wide instance would have written
    (worldSize 16 on one node, no tp, multi-node off): the defect this export fixes."""
    table = json.loads((FIXTURES / "ranktable_sample.json").read_text())
    single = _default_config()
    single["BackendConfig"]["npuDeviceIds"] = [list(range(16))]
    single["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["worldSize"] = 16
    errors = _multinode_errors(single, table)
    assert "multiNodesInferEnabled" in errors
    assert any("tp spans" in e for e in errors)


def test_the_rank_table_is_the_docs_sample_once_filled_and_passes_mindies_checks(exported):
    sample = json.loads((FIXTURES / "ranktable_sample.json").read_text())
    table = exported["header"]["rank_table"]
    assert "${node0_ip}" in json.dumps(table)  # the addresses are the team's: never invented
    assert _ranktable_errors(table) != []  # unfilled, MindIE would refuse it: device_ip is no address
    servers = sample["server_list"]
    filled = _filled(
        table, [s["container_ip"] for s in servers], [[d["device_ip"] for d in s["device"]] for s in servers]
    )
    assert _ranktable_errors(filled) == []
    # the docs' sample, key for key, but for server_id, which the sample gives apart from the container's
    for server in sample["server_list"]:
        server["server_id"] = server["container_ip"]
    assert filled == sample
    # the master, the only node that takes requests, holds rank 0 and comes first
    assert filled["server_list"][0]["device"][0]["rank_id"] == "0"


def test_the_header_says_how_each_node_starts_and_where_requests_go(exported):
    header = exported["header"]
    assert "RANK_TABLE_FILE" in header["launch"] and "MIES_CONTAINER_IP" in header["launch"]
    assert "rank_id 0" in header["launch"] and "mode 640" in header["launch"]
    assert header["env"]["HCCL_DETERMINISTIC"] == "true"  # the docs' setting for multi-node inference
    assert header["env"]["NPU_MEMORY_FRACTION"]
    # two instances of two nodes each, each its own master
    assert header["replicas"] == [{"nodes": [0, 1], "master": 0}, {"nodes": [2, 3], "master": 2}]
    assert "interNodeTLSEnabled" in header["fill"]


def test_an_instance_within_a_node_is_written_as_before(tmp_path):
    ctx = _context(tp=8, replicas=1)
    written = json.loads(write_exports(ctx, tmp_path, ["mindie"])["mindie"].read_text())
    backend = written["BackendConfig"]
    assert "multiNodesInferEnabled" not in backend and "rank_table" not in written["_autotune"]
    assert backend["npuDeviceIds"] == [list(range(8))]
    assert "tp" not in backend["ModelDeployConfig"]["ModelConfig"][0]
    assert written["_autotune"]["replicas"] == [{"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}]


def test_an_instance_over_more_nodes_than_mindie_supports_is_refused_with_the_docs_limit():
    two_per_node = {"accelerator": "npu", "nodes": 16, "devices_per_node": 2, "profile": "ascend-910b"}
    reasons = EXPORTERS["mindie"].unsupported(_context(two_per_node, replicas=1))  # 16 NPUs over 8 nodes
    assert any(f"at most {MULTINODE_NODES_MAX} nodes" in r for r in reasons), reasons
    four = EXPORTERS["mindie"].unsupported(_context({**two_per_node, "devices_per_node": 4}, replicas=1))
    assert not any("at most" in r for r in four), four  # 16 NPUs over 4 nodes: the limit itself


def test_multinode_inference_off_atlas_800i_a2_is_refused_naming_the_hardware():
    a3 = {"accelerator": "npu", "nodes": 4, "devices_per_node": 8, "profile": "atlas-a3-910c"}
    reasons = EXPORTERS["mindie"].unsupported(_context(a3))
    assert any("Atlas 800I A2 only" in r and "800I_A3" in r for r in reasons), reasons
    assert EXPORTERS["mindie"].unsupported(_context(a3, tp=8)) == []  # within a node it runs there


def test_a_pd_instance_across_nodes_is_refused_with_motors_own_words():
    ctx = _context(tp=16, prefill_tp=16, prefill_replicas=1, replicas=1, kv_connector="auto")
    (reason,) = [r for r in EXPORTERS["mindie"].unsupported(ctx) if "one pod on one node" in r]
    assert "does not combine with multi-node inference" in reason and "多机推理" in reason


def test_the_mindie_probe_refuses_an_instance_wider_than_a_node_saying_what_runs_it():
    with pytest.raises(ValueError, match="rank table"):
        STACKS["mindie"].launch(serving_preset_run(_context()))


def test_a_spec_probing_mindie_wider_than_a_node_is_refused_naming_the_field():
    from autotune.spec.errors import SpecError
    from autotune.spec.load import parse_spec

    data = {
        "name": "wide",
        "model": "llama2-70b",
        "workload": {k: v for k, v in CHAT.items() if k != "max_model_len"},
        "cluster": {"accelerator": "npu", "nodes": 2, "devices_per_node": 8},
        "space": {"tp": [8, 16]},
        "objectives": [{"metric": "goodput_rps_per_device", "direction": "maximize"}],
        "backend": "mindie",
    }
    with pytest.raises(SpecError) as err:
        parse_spec(data, file="wide.yaml")
    problems = [p for p in err.value.problems if p.loc == ("space", "tp")]
    assert problems and "rank table" in problems[0].message and "[16]" in problems[0].message
    parse_spec({**data, "space": {"tp": [4, 8]}})  # within a node: fine
