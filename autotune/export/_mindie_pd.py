"""MindIE PD separation: the ``user_config.json`` MindIE-Motor's deploy script launches a tuned
disaggregated serving config from (issue 46).

MindIE serves prefill and decode on separate instances under MindIE-Motor: a controller
(``mindie_motor_controller``, ``ms_controller.json``) fixes each instance's role and tells a
coordinator (``mindie_motor_coordinator``, ``ms_coordinator.json``, the user-facing port) where they
are; each instance is a ``mindie_llm_server`` whose ``config.json`` sets ``inferMode: dmi``, and the
KV cache moves from a prefill to a decode instance by MindIE's own device-to-device transfer
(``transfer_type: D2DTransfer``), not by one of vLLM's connectors. The deployment is written for
MindIE-Motor's deploy script (``mindie_motor/src/example/deploy_scripts/deploy_ac_job.py`` at
Ascend/MindIE-Motor 3402b154, its ``user_config.json`` sample the base here): it merges
``mindie_server_prefill_config`` / ``mindie_server_decode_config`` into the team's MindIE
``config.json`` (``conf/config_p.json``, ``conf/config_d.json``: mappings key by key, a list
replaced whole, so ``ModelConfig[0]`` is written whole), fills ``ms_controller.json``'s
``p_node_config`` / ``d_node_config`` from their ``tp``/``dp``/``sp``/``cp``, renders one k8s job per
instance and starts them. What is set from the config:

- ``prefill_replicas`` -> ``deploy_config.p_instances_num``; ``replicas`` -> ``d_instances_num``
  (MindIE-Motor's ``utils/validate_config.py``: each in [1, 20]);
- ``prefill_tp`` / ``tp`` -> each pool's ``p_pod_npu_num`` / ``d_pod_npu_num`` (one pod, one node,
  at most 16 NPUs), its ``worldSize``, ``tp`` and ``npuDeviceIds``;
- the engine settings of :func:`autotune.export._mindie.mindie_settings` in both pools' config.json;
- the SLO -> ``digs_prefill_slo`` (TTFT p99, ms) and ``digs_decode_slo`` (TPOT p99, ms);
- ``memory_utilization`` -> ``NPU_MEMORY_FRACTION`` in ``mindie_env.json``'s ``mindie_common_env``
  (the header's ``env``: MindIE-Motor's boot.sh applies the per-role env to distributed-DP instances only).

Which instance prefills is MindIE-Motor's decision: the deploy script lists one rank-table group per
instance (``multi_node_infer_enable``, as its sample has it), and the controller keeps a group's
``deploy_server`` role only when prefill and decode instances span different numbers of pods
(``RoleManagerInitializer.cpp``: ``is_skip_decision_for_cross_node_mode``); with one pod each it assigns
the roles itself, by ``default_p_rate:default_d_rate`` where both are set
(``InstanceRoleManager::AssignRoleByDefiniteRatio``). So both pools take the same NPUs and the same
config.json (the ``mindie`` rules: ``prefill_tp = tp``), any instance can take either role, the ratio is
the config's (reduced: MindIE's docs allow at most 15 each and 16 together), and periodic role switching
is off. How the controller splits instances that sit in groups of their own by that ratio was read
from its source, not run (its C++ needs Ascend's runtime).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import numpy as np

from ..workers.parameters import prefill_tensor_parallel, value as param
from ._base import ExportContext, header_fields, json_text, longest_lengths
from ._mindie import MINDIE_DEFAULT_CONFIG, mindie_env, mindie_settings, weights_note

__all__ = [
    "INSTANCES_MAX",
    "RATE_MAX",
    "RATE_SUM_MAX",
    "MOTOR_DEPLOY_SCRIPT",
    "MOTOR_USER_CONFIG",
    "PD_FILE_MODE",
    "PD_FILENAME",
    "POD_NPUS_MAX",
    "hardware_type",
    "pd_rates",
    "pd_user_config",
    "render_pd",
]

MOTOR_DEPLOY_SCRIPT = (
    "MindIE-Motor's mindie_motor/src/example/deploy_scripts/deploy_ac_job.py (Ascend/MindIE-Motor 3402b154)"
)
PD_FILENAME = "mindie_pd_user_config.json"
# deploy_ac_job.py reads its files through utils/file_utils.safe_open, which refuses a file whose
# permissions exceed 0o640
PD_FILE_MODE = 0o640
# the most NPUs a pod of an instance takes (validate_config.py: p_pod_npu_num, d_pod_npu_num in [1, 16])
POD_NPUS_MAX = 16
INSTANCES_MAX = 20  # p_instances_num, d_instances_num in [1, 20] (validate_config.py)
# default_p_rate / default_d_rate as MindIE-Motor's docs allow them (docs/zh/user_guide/
# cluster_management_component/controller.md: each in [0, 15], together at most 16; the code allows more)
RATE_MAX, RATE_SUM_MAX = 15, 16
WEIGHTS_PLACEHOLDER = "${model_weight_path}"  # the model names no checkpoint: the team fills it

# MindIE-Motor 3402b154's mindie_motor/src/example/deploy_scripts/user_config.json without its server
# configs (tests/fixtures/mindie_motor/user_config.json holds the whole file; a test compares the two):
# the deployment's own settings, which a team fills (image, mounts, certificates) and autotune overrides
# where the config decides (instances, NPUs per pod, the SLO)
MOTOR_USER_CONFIG: dict[str, Any] = {
    "version": "v1.0",
    "deploy_config": {
        "p_instances_num": 1,
        "d_instances_num": 1,
        "single_p_instance_pod_num": 2,
        "single_d_instance_pod_num": 8,
        "p_pod_npu_num": 8,
        "d_pod_npu_num": 8,
        "p_instances_scale_num": 0,
        "d_instances_scale_num": 0,
        "model_id": "",
        "prefill_distribute_enable": 0,
        "decode_distribute_enable": 1,
        "image_name": "mindie:dev-2.0.RC1.B091-800I-A2-py311-ubuntu22.04-aarch64",
        "job_id": "mindie",
        "hardware_type": "800I_A2",
        "mindie_env_path": "./conf/mindie_env.json",
        "mindie_host_log_path": "/root/log/ascend_log",
        "mindie_container_log_path": "/root/mindie",
        "weight_mount_path": "/mnt/mindie_data/deepseek_diff_level/deepseek_r1_w8a8_ep_level2",
        "coordinator_backup_cfg": {"function_enable": False},
        "controller_backup_cfg": {"function_sw": False},
        "deploy_mount_path": {
            "ms_controller_mount": {"${user_define_host_path}": "${user_define_container_path}"},
            "ms_coordinator_mount": {"${user_define_host_path}": "${user_define_container_path}"},
            "prefill_server_mount": {
                "${user_define_host_path1}": "${user_define_container_path}",
                "${user_define_host_path2}": "${user_define_container_path}",
            },
            "decode_server_mount": {
                "${user_define_host_path1}": "${user_define_container_path}",
                "${user_define_host_path2}": "${user_define_container_path}",
            },
        },
        "tls_config": {
            "tls_enable": True,
            "infer_tls_enable": True,
            "infer_tls_items": {
                "ca_cert": "./security/infer/security/certs/ca.pem",
                "tls_cert": "./security/infer/security/certs/cert.pem",
                "tls_key": "./security/infer/security/keys/cert.key.pem",
                "tls_passwd": "./security/infer/security/pass/key_pwd.txt",
                "tls_crl": "",
            },
            "management_tls_enable": True,
            "management_tls_items": {
                "ca_cert": "./security/management/security/certs/management_ca.pem",
                "tls_cert": "./security/management/security/certs/cert.pem",
                "tls_key": "./security/management/security/keys/cert.key.pem",
                "tls_passwd": "./security/management/security/pass/key_pwd.txt",
                "tls_crl": "",
            },
            "metrics_tls_enable": True,
            "metrics_tls_items": {
                "ca_cert": "./security/metrics/security/certs/metrics_ca.pem",
                "tls_cert": "./security/metrics/security/certs/cert.pem",
                "tls_key": "./security/metrics/security/keys/cert.key.pem",
                "tls_passwd": "./security/metrics/security/pass/key_pwd.txt",
                "tls_crl": "",
            },
            "cluster_tls_enable": True,
            "cluster_tls_items": {
                "ca_cert": "./security/clusterd/security/certs/ca.pem",
                "tls_cert": "./security/clusterd/security/certs/cert.pem",
                "tls_key": "./security/clusterd/security/keys/cert.key.pem",
                "tls_passwd": "./security/clusterd/security/pass/key_pwd.txt",
                "tls_crl": "",
            },
            "etcd_server_tls_enable": True,
            "etcd_server_tls_items": {
                "ca_cert": "./security/etcd_server/security/certs/ca.pem",
                "tls_cert": "./security/etcd_server/security/certs/cert.pem",
                "tls_key": "./security/etcd_server/security/keys/cert.key.pem",
                "tls_passwd": "./security/etcd_server/security/pass/key_pwd.txt",
                "tls_crl": "",
            },
        },
    },
    "mindie_ms_controller_config": {
        "deploy_mode": "pd_separate",
        "digs_prefill_slo": 1000,
        "digs_decode_slo": 50,
        "multi_node_infer_config": {"multi_node_infer_enable": True},
    },
    "mindie_ms_coordinator_config": {
        "http_config": {
            "predict_ip": "127.0.0.1",
            "predict_port": "1025",
            "manage_ip": "127.0.0.1",
            "manage_port": "1026",
            "alarm_port": "1027",
            "server_thread_num": 10,
            "client_thread_num": 10,
            "http_timeout_seconds": 10,
            "keep_alive_seconds": 180,
        },
        "request_limit": {"single_node_max_requests": 4096, "max_requests": 10000},
        "exception_config": {"first_token_timeout": 600, "schedule_timeout": 600, "infer_timeout": 3600},
    },
}

# what the PD file writes for each knob (the header's "written")
PD_WRITTEN = {
    "prefill_replicas": "deploy_config.p_instances_num",
    "replicas": "deploy_config.d_instances_num",
    "prefill_tp": "deploy_config.p_pod_npu_num, mindie_server_prefill_config ModelConfig[0].worldSize, tp",
    "tp": "deploy_config.d_pod_npu_num, mindie_server_decode_config ModelConfig[0].worldSize, tp",
    "kv_connector": "d2d: MindIE moves the KV cache itself (ms_controller transfer_type D2DTransfer)",
    "max_num_seqs": "ScheduleConfig.maxBatchSize, maxPrefillBatchSize (both pools)",
    "max_num_batched_tokens": "ScheduleConfig.maxPrefillTokens (both pools)",
    "block_size": "ScheduleConfig.cacheBlockSize (both pools)",
    "memory_utilization": "_autotune.env: NPU_MEMORY_FRACTION in mindie_env.json's mindie_common_env",
    "enable_prefix_caching": "ModelConfig[0].plugin_params (both pools)",
    "enable_chunked_prefill": "ModelConfig[0].plugin_params, ScheduleConfig.templateType (both pools)",
}


def hardware_type(cluster: dict[str, Any]) -> str:
    """MindIE-Motor's ``hardware_type`` (``800I_A2`` | ``800I_A3``) of the study's cluster: A3 for a
    910C profile (Atlas A3), else A2 (the 910B of Atlas 800I A2, the bundled Ascend profile)."""
    words = re.split(r"[^a-z0-9]+", str(cluster.get("profile") or "").lower())
    return "800I_A3" if "910c" in words or "a3" in words else "800I_A2"


def pd_rates(prefill: Any, decode: Any) -> tuple[Any, Any]:
    """``default_p_rate``, ``default_d_rate``: the pools' instance counts over their common divisor
    (scalars or numpy arrays)."""
    common = np.gcd(prefill, decode)
    common = np.where(common > 0, common, 1)
    return prefill // common, decode // common


def _pool(config: dict[str, Any], tp: int, common: dict[str, Any]) -> dict[str, Any]:
    """One pool's ``mindie_server_*_config``: the trial's settings at the pool's tp, PD's keys, and
    ``ModelConfig[0]`` whole (the deploy script replaces a list, it does not merge it)."""
    fragment = mindie_settings({**config, "tp": tp}, **common)
    backend = fragment["BackendConfig"]
    model = copy.deepcopy(MINDIE_DEFAULT_CONFIG["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0])
    for key, value in backend["ModelDeployConfig"].pop("ModelConfig")[0].items():
        if value is None:
            model.pop(key, None)
        else:
            model[key] = value
    model.pop("models", None)  # a model family's own options (the default's are layerwise disaggregation's)
    if not common.get("weight_path"):  # never MindIE's sample checkpoint
        model["modelWeightPath"] = WEIGHTS_PLACEHOLDER
    model.update(tp=tp, dp=1, sp=1, cp=1, pp=1)
    backend["ModelDeployConfig"]["ModelConfig"] = [model]
    backend["multiNodesInferEnabled"] = False  # an instance on one node
    backend.setdefault("ScheduleConfig", {})["distributedEnable"] = False
    fragment["ServerConfig"] = {**fragment.get("ServerConfig", {}), "inferMode": "dmi", "distDPServerEnabled": False}
    return fragment


def pd_user_config(ctx: ExportContext) -> dict[str, Any]:
    """The whole ``user_config.json`` of a disaggregated config (its header apart)."""
    config = ctx.config
    prompt, output = longest_lengths(ctx.workload)
    common = {
        "max_model_len": int(ctx.workload.get("max_model_len") or 0),
        "max_prompt_len": prompt,
        "max_output_len": output,
        "model_name": str(ctx.model.get("name") or ""),
        "weight_path": ctx.model.get("path"),
    }
    prefill_tp, decode_tp = prefill_tensor_parallel(config), param(config, "tp")
    out = copy.deepcopy(MOTOR_USER_CONFIG)
    deploy = out["deploy_config"]
    deploy.update(
        p_instances_num=param(config, "prefill_replicas"),
        d_instances_num=param(config, "replicas"),
        single_p_instance_pod_num=1,
        single_d_instance_pod_num=1,
        p_pod_npu_num=prefill_tp,
        d_pod_npu_num=decode_tp,
        prefill_distribute_enable=0,
        decode_distribute_enable=0,
        job_id="autotune",
        hardware_type=hardware_type(ctx.cluster),
    )
    deploy["weight_mount_path"] = str(ctx.model.get("path") or WEIGHTS_PLACEHOLDER)
    slo = ctx.workload.get("slo") or {}
    controller = out["mindie_ms_controller_config"]
    p_rate, d_rate = pd_rates(param(config, "prefill_replicas"), param(config, "replicas"))
    controller["default_p_rate"], controller["default_d_rate"] = int(p_rate), int(d_rate)
    controller["digs_periodic_role_decision"] = {"auto_pd_role_switching_enable": False}
    for key, name in (("digs_prefill_slo", "ttft_p99_ms"), ("digs_decode_slo", "tpot_p99_ms")):
        if slo.get(name):  # ms_controller.json: an integer in [1, 65535]
            controller[key] = min(max(int(round(float(slo[name]))), 1), 65535)
    out["mindie_server_prefill_config"] = _pool(config, prefill_tp, common)
    out["mindie_server_decode_config"] = _pool(config, decode_tp, common)
    return out


def render_pd(ctx: ExportContext, written: dict[str, str]) -> str:
    """The file: ``_autotune`` (the header: what to fill, how to launch, each pool's env) and the
    deploy script's keys."""
    config = ctx.config
    deployment = pd_user_config(ctx)
    controller = deployment["mindie_ms_controller_config"]
    header = header_fields(ctx, {**written, **PD_WRITTEN})
    header["launch"] = (
        f"{MOTOR_DEPLOY_SCRIPT}: save this file as its user_config.json (mode 640 or stricter: the script "
        "refuses a more permissive file), put your MindIE config.json in its conf/ as config.json, config_p.json "
        "and config_d.json beside MindIE-Motor's ms_controller.json, ms_coordinator.json, node_manager.json and "
        "http_client_ctl.json, then python3 deploy_ac_job.py --user_config_path user_config.json. Requests go to "
        "the coordinator's predict_port."
    )
    header["fill"] = (
        "deploy_config: image_name (your MindIE image), deploy_mount_path, tls_config (or turn TLS off), and "
        f"weight_mount_path and both pools' modelWeightPath where the model names no path ({WEIGHTS_PLACEHOLDER}); "
        "ModelConfig[0] is written whole (the script replaces the list): add your model's own keys (models, ...) "
        "to both pools'"
    )
    header["instances"] = (
        f"{param(config, 'prefill_replicas')} prefill instance(s) of {prefill_tensor_parallel(config)} NPU(s) and "
        f"{param(config, 'replicas')} decode instance(s) of {param(config, 'tp')} NPU(s), one pod each"
    )
    header["roles"] = (
        f"MindIE-Motor assigns them: default_p_rate:default_d_rate "
        f"{controller['default_p_rate']}:{controller['default_d_rate']}, no periodic switching; "
        "both pools run the same config.json on the same NPUs, so any instance can take either role"
    )
    header["env"] = {"mindie_common_env": mindie_env(config)}
    header["env_file"] = (
        "merge into mindie_env.json's mindie_common_env (deploy_config.mindie_env_path): MindIE-Motor's boot.sh "
        "applies the per-role server env only to distributed-DP instances"
    )
    note = weights_note(config)
    if note:
        header["weights"] = note
    return json_text({"_autotune": header, **deployment}, indent=1, default=str) + "\n"
