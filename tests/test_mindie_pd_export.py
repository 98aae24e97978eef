"""MindIE's PD separation (issue 46): the ``mindie`` export of a disaggregated config is MindIE-Motor's
``user_config.json``, read back by MindIE-Motor's own deploy script (tests/fixtures/mindie_motor, with a
stand-in kubectl), and what that script writes passes the checks MindIE's C++ applies to it; the
``mindie`` stack's rules say which disaggregated layouts MindIE cannot launch, and its probe refuses
one it cannot start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autotune.export import ExportContext
from autotune.export._mindie_pd import MOTOR_USER_CONFIG, PD_FILENAME, WEIGHTS_PLACEHOLDER, hardware_type, pd_rates
from autotune.finish.exports import EXPORTERS, write_exports
from autotune.spec.models import PRESETS
from autotune.stacks import STACKS
from support import CHAT_70B as CHAT, serving_config, serving_preset_run

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MOTOR = FIXTURES / "mindie_motor"
MODEL = {"name": "llama2-70b", "arch": "llama", "path": "/mnt/weights/llama2-70b", **PRESETS["llama2-70b"]}
# MindIE's prefix cache and SplitFuse do not take a Llama 2 (the mindie rules): both off
# MindIE-Motor assigns the roles of one-pod instances itself: both pools on the same NPUs (the mindie rules)
PD = {
    "tp": 4,
    "pp": 1,
    "replicas": 2,
    "prefill_replicas": 1,
    "prefill_tp": 4,
    "kv_connector": "auto",
    "block_size": 128,
    "max_num_seqs": 96,
    "max_num_batched_tokens": 6144,
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
}


def _context(**changes: Any) -> ExportContext:
    return ExportContext(
        study="pd",
        trial=7,
        config=serving_config(**{**PD, **changes}),
        metrics={"goodput_rps_per_device": 0.13},
        source="simulated",
        model=dict(MODEL),
        workload=dict(CHAT),
        cluster={"accelerator": "npu", "nodes": 2, "devices_per_node": 8},
        target="mindie",
    )


def _deploy(user_config: Path, work: Path) -> dict[str, Any]:
    """MindIE-Motor's deploy_ac_job.py on ``user_config``, as its README runs it: its folder as the
    working directory, conf/ holding MindIE's config.json (as config.json, config_p.json and
    config_d.json) beside MindIE-Motor's own, every file mode 640 (its safe_open refuses more)."""
    scripts = work / "deploy_scripts"
    shutil.copytree(MOTOR / "deploy_scripts", scripts)
    for name in ("ms_controller.json", "ms_coordinator.json", "node_manager.json", "http_client_ctl.json"):
        shutil.copy(MOTOR / "conf" / name, scripts / "conf" / name)
    for name in ("config.json", "config_p.json", "config_d.json"):
        shutil.copy(FIXTURES / "mindie" / "config.json", scripts / "conf" / name)
    shutil.copy(user_config, scripts / "user_config.json")
    for path in scripts.rglob("*"):
        if path.is_file():
            path.chmod(0o640)
    bin_dir = work / "bin"
    bin_dir.mkdir()
    shutil.copy(MOTOR / "kubectl", bin_dir / "kubectl")
    (bin_dir / "kubectl").chmod(0o755)
    log = work / "kubectl.jsonl"
    config = json.loads(user_config.read_text())["deploy_config"]
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "KUBECTL_LOG": str(log),
        "FAKE_NPUS_P": str(config["p_pod_npu_num"]),
        "FAKE_NPUS_D": str(config["d_pod_npu_num"]),
    }
    out = work / "output"
    run = subprocess.run(
        [sys.executable, "deploy_ac_job.py", "--user_config_path", "user_config.json", "--output_path", str(out)],
        cwd=scripts,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    patches = [c for c in calls if c[:3] == ["patch", "configmap", "global-ranktable"]]
    ranktable = json.loads(json.loads(patches[-1][-1])["data"]["global_ranktable.json"]) if patches else None
    conf = {p.name: json.loads(p.read_text()) for p in (out / "conf").glob("*.json")} if out.exists() else {}
    return {"run": run, "calls": calls, "ranktable": ranktable, "conf": conf}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("mindie_pd")
    ctx = _context()
    assert EXPORTERS["mindie"].unsupported(ctx) == []
    path = write_exports(ctx, tmp / "export", ["mindie"])["mindie"]
    return {"path": path, "ctx": ctx, **_deploy(path, tmp)}


def test_the_export_is_motors_user_config_named_and_guarded_as_its_script_reads_it(deployed):
    path = deployed["path"]
    assert path.name == PD_FILENAME
    assert path.stat().st_mode & 0o777 == 0o640  # deploy_ac_job.py's safe_open refuses a more permissive file
    written = json.loads(path.read_text())
    assert "deploy_ac_job.py" in written["_autotune"]["launch"]
    assert written["_autotune"]["env"]["mindie_common_env"]["NPU_MEMORY_FRACTION"]


def test_the_base_is_motors_own_sample():
    sample = json.loads((MOTOR / "deploy_scripts" / "user_config.json").read_text())
    assert {k: sample[k] for k in MOTOR_USER_CONFIG} == MOTOR_USER_CONFIG


def test_motors_deploy_script_runs_it_to_the_end_and_starts_one_job_per_instance(deployed):
    run = deployed["run"]
    assert run.returncode == 0, run.stderr[-3000:]
    assert "all deploy end" in run.stderr + run.stdout
    applied = sorted(Path(c[2]).name for c in deployed["calls"] if c[:2] == ["apply", "-f"])
    assert applied == [
        "mindie_ms_controller.yaml",
        "mindie_ms_coordinator.yaml",
        "mindie_server_d0.yaml",
        "mindie_server_d1.yaml",
        "mindie_server_p0.yaml",
    ]


def _check_instance_config(config: dict[str, Any]) -> list[str]:
    """MindIE-LLM 3.0.0.beta.1's checks of an instance's config.json that PD touches
    (tests/fixtures/mindie_motor/README.md names each source file)."""
    server, backend = config["ServerConfig"], config["BackendConfig"]
    deploy, schedule = backend["ModelDeployConfig"], backend["ScheduleConfig"]
    model = deploy["ModelConfig"][0]
    errors = []
    if server["inferMode"] not in ("standard", "dmi"):
        errors.append("inferMode")
    if "distDPServerEnabled" not in server:
        errors.append("distDPServerEnabled missing")
    ids = backend["npuDeviceIds"]
    if len(ids) != backend["modelInstanceNumber"] or any(len(set(i)) != model["worldSize"] for i in ids):
        errors.append("npuDeviceIds vs modelInstanceNumber x worldSize")
    if not 1 <= schedule["maxPrefillBatchSize"] <= schedule["maxBatchSize"] <= 5000:
        errors.append("maxPrefillBatchSize <= maxBatchSize <= 5000")
    if not 1 <= schedule["cacheBlockSize"] <= 128:
        errors.append("cacheBlockSize")
    if schedule["maxPrefillTokens"] < deploy["maxInputTokenLen"]:
        errors.append("maxPrefillTokens >= maxInputTokenLen")
    if schedule["maxIterTimes"] == 0:
        errors.append("maxIterTimes != 0")
    if any(model.get(k, 1) < 1 for k in ("dp", "sp", "cp")) or model["worldSize"] < 1:
        errors.append("dp, sp, cp, worldSize >= 1")
    return errors


def test_each_pools_config_json_has_its_role_settings_and_passes_mindies_checks(deployed):
    conf = deployed["conf"]
    config = deployed["ctx"].config
    for name, tp in (("config_p.json", 4), ("config_d.json", 4)):
        instance = conf[name]
        assert _check_instance_config(instance) == [], name
        assert instance["ServerConfig"]["inferMode"] == "dmi"
        # one node per instance: no RANK_TABLE_FILE needed by MindIE-LLM (config_manager_impl.cpp)
        assert instance["BackendConfig"]["multiNodesInferEnabled"] is False
        assert instance["BackendConfig"]["ScheduleConfig"]["distributedEnable"] is False
        model = instance["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
        assert (model["worldSize"], model["tp"]) == (tp, tp)
        assert model["modelWeightPath"] == MODEL["path"]
        schedule = instance["BackendConfig"]["ScheduleConfig"]
        assert schedule["maxBatchSize"] == config["max_num_seqs"]
        assert schedule["maxPrefillTokens"] == config["max_num_batched_tokens"]
        assert schedule["cacheBlockSize"] == config["block_size"]
    # the script gives prefill decode's maxIterTimes: they agree from the start
    p, d = (conf[n]["BackendConfig"]["ScheduleConfig"]["maxIterTimes"] for n in ("config_p.json", "config_d.json"))
    assert p == d == 512
    # the two pools' files are the same: MindIE-Motor may give either role to any instance
    assert conf["config_p.json"] == conf["config_d.json"]


def test_the_controller_gets_the_pools_ratio_sizes_and_slo_and_passes_its_checks(deployed):
    controller = deployed["conf"]["ms_controller.json"]
    assert controller["deploy_mode"] == "pd_separate"
    assert controller["role_decision_methods"] == "digs" and controller["transfer_type"] == "D2DTransfer"
    # the roles by the config's ratio (1 prefill : 2 decode), not DIGS's, and never switched later
    assert (controller["default_p_rate"], controller["default_d_rate"]) == (1, 2)
    assert controller["digs_periodic_role_decision"]["auto_pd_role_switching_enable"] is False
    multi = controller["multi_node_infer_config"]
    assert multi["multi_node_infer_enable"] is True
    for role, tp in (("p_node_config", 4), ("d_node_config", 4)):
        node = multi[role]
        assert node["tp_size"] == tp and node["node_machine_num"] == 1
        assert 1 <= node["tp_size"] <= 16 and 1 <= node["dp_size"] <= 512
        assert all(node[k] >= 1 for k in ("dp_size", "cp_size", "tp_size", "sp_size"))
        assert not (node["dp_size"] > 1 and node["cp_size"] > 1)
    assert (controller["digs_prefill_slo"], controller["digs_decode_slo"]) == (2000, 60)


def test_the_rank_table_holds_one_group_per_instance_with_its_role_and_devices(deployed):
    groups = deployed["ranktable"]["server_group_list"]
    servers = [g for g in groups if int(g["group_id"]) >= 2]
    roles = sorted((g["deploy_server"], len(g["server_list"][0]["device"])) for g in servers)
    assert roles == [("1", 4), ("1", 4), ("2", 4)]  # RankTableLoader: "2" prefill, "1" decode
    assert {g["group_id"] for g in groups if int(g["group_id"]) < 2} == {"0", "1"}  # coordinator, controller


def test_a_config_the_script_refuses_is_refused_by_the_rules_first(tmp_path):
    # 21 decode instances: MindIE-Motor's validate_config.py allows 1-20; the rules say so before any file
    ctx = _context(replicas=21)
    reasons = EXPORTERS["mindie"].unsupported(ctx)
    assert any("1-20 prefill and 1-20 decode" in r for r in reasons)
    # and the script itself would have refused it: the rules mirror it, not a guess
    raw = write_exports(_context(), tmp_path / "ok", ["mindie"])["mindie"]
    data = json.loads(raw.read_text())
    data["deploy_config"]["d_instances_num"] = 21
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    result = _deploy(bad, tmp_path)
    assert result["run"].returncode != 0 and "d_instances_num" in result["run"].stderr


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"kv_connector": "nixl"}, "moves the KV cache itself"),
        ({"tp": 32, "prefill_tp": 32}, "at most 16 NPUs"),
        ({"prefill_replicas": 21}, "1-20 prefill"),
        ({"prefill_tp": 8}, "prefill_tp must equal tp"),
        ({"prefill_replicas": 16, "replicas": 1}, "at most 15 each and 16 together"),
        ({"tp": 16, "prefill_tp": 16, "replicas": 1}, "one pod on one node"),  # 16 NPUs over two 8-NPU nodes
    ],
)
def test_a_pd_layout_mindie_cannot_launch_is_refused_with_the_reason(changes, words):
    assert any(words in r for r in EXPORTERS["mindie"].unsupported(_context(**changes)))


def test_an_aggregated_config_still_exports_a_config_json_fragment(tmp_path):
    ctx = _context(prefill_replicas=0, prefill_tp=0)
    path = write_exports(ctx, tmp_path, ["mindie"])["mindie"]
    assert path.name == "mindie_config.json"
    assert "deploy_config" not in json.loads(path.read_text())


def test_the_mindie_probe_refuses_a_pd_config_saying_what_runs_it():
    with pytest.raises(ValueError, match="MindIE-Motor"):
        STACKS["mindie"].launch(serving_preset_run(_context()))


def test_the_hardware_type_follows_the_profile():
    assert hardware_type({"profile": "ascend-910b"}) == "800I_A2"
    assert hardware_type({}) == "800I_A2"
    assert hardware_type({"profile": "atlas-a3-910c"}) == "800I_A3"


def test_the_shipped_mindie_spec_ranks_pd_beside_aggregated_with_what_limits_each():
    """search_spaces/llama2_70b_chat_2x8npu_mindie_pd.yaml: MindIE's own transfer, both pools on the
    same NPUs (MindIE-Motor assigns one-pod instances' roles itself)."""
    from typer.testing import CliRunner

    from autotune.cli.commands import app

    spec = Path(__file__).resolve().parents[1] / "search_spaces" / "llama2_70b_chat_2x8npu_mindie_pd.yaml"
    result = CliRunner().invoke(app, ["plan", str(spec), "--json", "--top", "10"])
    assert result.exit_code == 0, result.output
    top = json.loads(result.stdout)["top"]
    kinds = [r["params"].get("prefill_replicas", 0) > 0 for r in top]
    assert any(kinds) and not all(kinds)
    assert {r["params"]["kv_connector"] for r in top if r["params"].get("prefill_replicas")} == {"d2d"}
    assert all(r["params"]["prefill_tp"] == r["params"]["tp"] for r in top if r["params"].get("prefill_replicas"))
    assert all(r["limited_by"] for r in top)


def test_a_model_without_a_path_gets_a_placeholder_not_mindies_sample_checkpoint(tmp_path):
    ctx = _context()
    ctx.model.pop("path")
    data = json.loads(write_exports(ctx, tmp_path, ["mindie"])["mindie"].read_text())
    paths = {
        data[f"mindie_server_{pool}_config"]["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"]
        for pool in ("prefill", "decode")
    }
    assert paths == {WEIGHTS_PLACEHOLDER} and data["deploy_config"]["weight_mount_path"] == WEIGHTS_PLACEHOLDER
    assert WEIGHTS_PLACEHOLDER in data["_autotune"]["fill"]


def test_the_header_puts_the_memory_share_where_every_pod_reads_it_and_says_what_weights_to_mount(tmp_path):
    data = json.loads(write_exports(_context(quantization="w8a8"), tmp_path, ["mindie"])["mindie"].read_text())
    header = data["_autotune"]
    # boot.sh applies mindie_server_{prefill,decode}_env only to distributed-DP instances
    assert list(header["env"]) == ["mindie_common_env"]
    assert header["env"]["mindie_common_env"]["NPU_MEMORY_FRACTION"]
    assert "msModelSlim" in header["weights"]


def test_pd_rates_are_the_pools_over_their_common_divisor():
    assert pd_rates(2, 4) == (1, 2)
    assert pd_rates(3, 2) == (3, 2)


def test_a_spec_probing_mindie_with_a_prefill_pool_is_refused_naming_the_field():
    from autotune.spec.errors import SpecError
    from autotune.spec.load import parse_spec

    data = {
        "name": "pd",
        "model": "llama2-70b",
        "workload": {k: v for k, v in CHAT.items() if k != "max_model_len"},
        "cluster": {"accelerator": "npu", "nodes": 2, "devices_per_node": 8},
        "space": {"prefill_replicas": [0, 1], "tp": [8]},
        "objectives": [{"metric": "goodput_rps_per_device", "direction": "maximize"}],
        "backend": "mindie",
    }
    with pytest.raises(SpecError) as err:
        parse_spec(data, file="pd.yaml")
    problems = [p for p in err.value.problems if p.loc == ("space", "prefill_replicas")]
    assert problems and "MindIE-Motor" in problems[0].message
    parse_spec({**data, "space": {"prefill_replicas": [0], "tp": [8]}})  # aggregated only: fine


def test_an_engine_setting_the_evidence_did_not_choose_is_named_where_both_pools_hold_it(tmp_path):
    import dataclasses

    ctx = _context(**{"engine.maxIterTimes": 200})
    ctx = dataclasses.replace(
        ctx, chosen_because="not distinguished by the model (probe to choose): engine.maxIterTimes 200|400"
    )
    data = json.loads(write_exports(ctx, tmp_path, ["mindie"])["mindie"].read_text())
    for pool in ("prefill", "decode"):
        assert data[f"mindie_server_{pool}_config"]["BackendConfig"]["ScheduleConfig"]["maxIterTimes"] == 200
    (note,) = [n for n in data["_autotune"]["not_chosen_by_evidence"] if "engine.maxIterTimes" in n]
    assert "ScheduleConfig.maxIterTimes (both pools))" in note and "200|400" in note
