"""MindIE Service: the ``config.json`` settings of a tuned serving config.

One source of truth: :func:`mindie_settings` renders a serving config into MindIE's own
``config.json`` keys, for the exported fragment (``mindie_config.json``, :mod:`._mindie_export`: only the keys the trial
sets, merged into a team's config.json by :func:`merge_config`) and for the ``mindie`` stack
preset's ``engine.json`` (:mod:`autotune.stacks.mindie`: MindIE's default config.json,
:data:`MINDIE_DEFAULT_CONFIG`, with the same settings and the probe's ports). Names, paths and
ranges are MindIE-LLM 3.0.0.beta.1's (gitcode/GitHub Ascend/MindIE-LLM at 5e896196:
``src/server/conf/config.json``, ``src/config_manager/schedule_config.cpp``,
``model_deploy_config.cpp``, ``docs/zh/user_guide/user_manual/service_parameter_configuration.md``,
``docs/zh/user_guide/feature/prefix_cache.md``, ``splitFuse.md``):

- ``max_num_seqs`` -> ``ScheduleConfig.maxBatchSize`` (and ``maxPrefillBatchSize`` unless
  ``engine.maxPrefillBatchSize`` sets it: MindIE needs it in ``[1, maxBatchSize]``);
  ``max_num_batched_tokens`` -> ``maxPrefillTokens``; ``block_size`` -> ``cacheBlockSize``;
- ``tp`` -> ``ModelConfig[0].worldSize`` and ``BackendConfig.npuDeviceIds`` ``[[0..tp-1]]``
  (logical ids under the replica's ``ASCEND_RT_VISIBLE_DEVICES``); ``replicas``: one
  ``mindieservice_daemon`` per replica, each with its own devices and ports; an instance wider than a
  node is MindIE's multi-node inference (:func:`multinode_settings`);
- ``memory_utilization`` -> ``npuMemSize: -1`` (KV cache sized from free memory) with
  ``NPU_MEMORY_FRACTION`` (MindIE's memory share, default 0.8);
- ``enable_prefix_caching`` / ``enable_chunked_prefill`` -> ``ModelConfig[0].plugin_params``
  ``{"plugin_type": "prefix_cache,splitfuse"}``; SplitFuse also takes ``templateType: Mix``;
- the traffic: ``maxSeqLen`` = ``max_model_len``, ``maxInputTokenLen`` = the longest prompt,
  ``maxIterTimes`` = the longest output (``engine.maxIterTimes`` overrides);
- ``engine.NAME`` -> the key NAME in the section MindIE reads it from (``ScheduleConfig``,
  ``ModelDeployConfig``, ``ModelConfig[0]``, ``BackendConfig``, ``ServerConfig``).

Quantization and an int8 (C8) KV cache are properties of msModelSlim-quantized weights
(``modelWeightPath``), not of config.json.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from ..workers.parameters import instance_nodes, serving_default, value as param
from ._base import one_line


__all__ = [
    "MINDIE_DEFAULT_CONFIG",
    "MINDIE_KEYS",
    "MINDIE_SET_BY_AUTOTUNE",
    "MINDIE_WRITTEN",
    "MULTINODE_DOC",
    "MULTINODE_NODES_MAX",
    "merge_config",
    "mindie_settings",
    "multinode_settings",
    "rank_table",
    "mindie_env",
    "setting_path",
    "setting_where",
    "weights_note",
]

# MindIE-LLM 3.0.0.beta.1's src/server/conf/config.json (the daemon's default; tests/fixtures/mindie/config.json)
MINDIE_DEFAULT_CONFIG: dict[str, Any] = {
    "Version": "1.0.0",
    "ServerConfig": {
        "ipAddress": "127.0.0.1",
        "managementIpAddress": "127.0.0.2",
        "port": 1025,
        "managementPort": 1026,
        "metricsPort": 1027,
        "allowAllZeroIpListening": False,
        "maxLinkNum": 1000,
        "httpsEnabled": True,
        "fullTextEnabled": False,
        "tlsCaPath": "security/ca/",
        "tlsCaFile": ["ca.pem"],
        "tlsCert": "security/certs/server.pem",
        "tlsPk": "security/keys/server.key.pem",
        "tlsCrlPath": "security/certs/",
        "tlsCrlFiles": ["server_crl.pem"],
        "managementTlsCaFile": ["management_ca.pem"],
        "managementTlsCert": "security/certs/management/server.pem",
        "managementTlsPk": "security/keys/management/server.key.pem",
        "managementTlsCrlPath": "security/management/certs/",
        "managementTlsCrlFiles": ["server_crl.pem"],
        "metricsTlsCaFile": ["metrics_ca.pem"],
        "metricsTlsCert": "security/certs/metrics/server.pem",
        "metricsTlsPk": "security/keys/metrics/server.key.pem",
        "metricsTlsCrlPath": "security/metrics/certs/",
        "metricsTlsCrlFiles": ["server_crl.pem"],
        "inferMode": "standard",
        "interCommTLSEnabled": True,
        "interCommPort": 1121,
        "interCommTlsCaPath": "security/grpc/ca/",
        "interCommTlsCaFiles": ["ca.pem"],
        "interCommTlsCert": "security/grpc/certs/server.pem",
        "interCommPk": "security/grpc/keys/server.key.pem",
        "interCommTlsCrlPath": "security/grpc/certs/",
        "interCommTlsCrlFiles": ["server_crl.pem"],
        "openAiSupport": "vllm",
        "tokenTimeout": 600,
        "e2eTimeout": 600,
        "distDPServerEnabled": False,
        "layerwiseDisaggregated": False,
        "layerwiseDisaggregatedRoleType": "",
        "layerwiseDisaggregatedMasterIpAddress": "127.0.0.3",
        "layerwiseDisaggregatedSlaveIpAddress": ["127.0.0.4"],
        "layerwiseDisaggregatedDataPort": 10024,
        "layerwiseDisaggregatedCrtlPort": [10001, 10002],
    },
    "BackendConfig": {
        "backendName": "mindieservice_llm_engine",
        "modelInstanceNumber": 1,
        "npuDeviceIds": [[0, 1, 2, 3]],
        "tokenizerProcessNumber": 8,
        "multiNodesInferEnabled": False,
        "multiNodesInferPort": 1120,
        "interNodeTLSEnabled": True,
        "interNodeTlsCaPath": "security/grpc/ca/",
        "interNodeTlsCaFiles": ["ca.pem"],
        "interNodeTlsCert": "security/grpc/certs/server.pem",
        "interNodeTlsPk": "security/grpc/keys/server.key.pem",
        "interNodeTlsCrlPath": "security/grpc/certs/",
        "interNodeTlsCrlFiles": ["server_crl.pem"],
        "kvPoolConfig": {"backend": "", "configPath": ""},
        "ModelDeployConfig": {
            "maxSeqLen": 2560,
            "maxInputTokenLen": 2048,
            "truncation": False,
            "ModelConfig": [
                {
                    "modelInstanceType": "Standard",
                    "modelName": "llama_65b",
                    "modelWeightPath": "/data/atb_testdata/weights/llama1-65b-safetensors",
                    "worldSize": 4,
                    "cpuMemSize": 0,
                    "npuMemSize": -1,
                    "backendType": "atb",
                    "trustRemoteCode": False,
                    "async_scheduler_wait_time": 120,
                    "kv_trans_timeout": 10,
                    "kv_link_timeout": 1080,
                    "models": {"layerwiseDisaggregatedMasterDeviceNum": 2, "layerwiseDisaggregatedSlaveDeviceNum": 8},
                }
            ],
        },
        "ScheduleConfig": {
            "templateType": "Standard",
            "templateName": "Standard_LLM",
            "cacheBlockSize": 128,
            "maxPrefillBatchSize": 50,
            "maxPrefillTokens": 8192,
            "prefillTimeMsPerReq": 150,
            "prefillPolicyType": 0,
            "decodeTimeMsPerReq": 50,
            "decodePolicyType": 0,
            "maxBatchSize": 200,
            "maxIterTimes": 512,
            "maxPreemptCount": 0,
            "supportSelectBatch": False,
            "maxQueueDelayMicroseconds": 5000,
            "maxFirstTokenWaitTime": 2500,
        },
    },
    "LogConfig": {"dynamicLogLevel": "", "dynamicLogLevelValidHours": 2, "dynamicLogLevelValidTime": ""},
    "EnableDynamicAdjustTimeoutConfig": False,
}

# where MindIE reads each of its keys (an engine.NAME goes there): the sections of the default
# config.json, ScheduleConfig's optional keys (schedule_config.cpp g_scheduleParamsConstraint,
# LoadChunkedPrefillConfig) and ModelConfig's (model_deploy_config.cpp, service_parameter_configuration.md)
_MODEL_CONFIG = ("BackendConfig", "ModelDeployConfig", "ModelConfig", 0)
MINDIE_KEYS: dict[str, tuple[Any, ...]] = {
    **{k: ("ServerConfig",) for k in MINDIE_DEFAULT_CONFIG["ServerConfig"]},
    **{
        k: ("BackendConfig",)
        for k, v in MINDIE_DEFAULT_CONFIG["BackendConfig"].items()
        if k not in ("ModelDeployConfig", "ScheduleConfig")
    },
    **{k: ("BackendConfig", "ModelDeployConfig") for k in ("maxSeqLen", "maxInputTokenLen", "truncation")},
    **{k: ("BackendConfig", "ModelDeployConfig") for k in ("maxLoras", "maxLoraRank")},
    **{k: _MODEL_CONFIG for k in MINDIE_DEFAULT_CONFIG["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]},
    **{k: _MODEL_CONFIG for k in ("plugin_params", "tp", "dp", "sp", "cp")},
    **{k: ("BackendConfig", "ScheduleConfig") for k in MINDIE_DEFAULT_CONFIG["BackendConfig"]["ScheduleConfig"]},
    **{
        k: ("BackendConfig", "ScheduleConfig")
        for k in (
            "stageSelectPolicy",
            "dynamicBatchSizeEnable",
            "enablePrefixCache",
            "enableSplit",
            "enablChunkedPrefill",
            "policyType",
            "splitType",
            "splitStartType",
            "splitChunkTokens",
            "splitStartBatchSize",
            "prefillExpectedTime",
            "decodeExpectedTime",
            "bufferResponseEnabled",
            "distributedEnable",
            "maxN",
            "prefillChunkSize",
            "maxNumPartialPrefills",
            "maxLongPartialPrefills",
            "longPrefillTokenThreshold",
        )
    },
}
# MindIE keys autotune sets from its own names (an engine.NAME of one would set it twice), and
# those that only say where the daemon listens or loads from
MINDIE_SET_BY_AUTOTUNE = {
    "maxBatchSize": "max_num_seqs",
    "maxPrefillTokens": "max_num_batched_tokens",
    "cacheBlockSize": "block_size",
    "worldSize": "tp",
    "tp": "tp (an instance across nodes)",
    "multiNodesInferEnabled": "tp (an instance across nodes)",
    "npuDeviceIds": "tp and replicas",
    "modelInstanceNumber": "replicas (one daemon each)",
    "npuMemSize": "memory_utilization (NPU_MEMORY_FRACTION)",
    "plugin_params": "enable_prefix_caching and enable_chunked_prefill",
    "templateType": "enable_chunked_prefill",
    "enablePrefixCache": "enable_prefix_caching",
    "enableSplit": "enable_chunked_prefill",
    "enablChunkedPrefill": "enable_chunked_prefill",
    "maxSeqLen": "the workload's max_model_len",
    "maxInputTokenLen": "the traffic's longest prompt",
    "modelName": "the model",
    "modelWeightPath": "the model's path",
    "ipAddress": "the deployment",
    "managementIpAddress": "the deployment",
    "port": "the deployment",
    "managementPort": "the deployment",
    "metricsPort": "the deployment",
}
# MindIE's multi-node inference ("多机混部", MindIE-LLM 5e896196 docs/zh/user_guide/user_manual/
# prefill_decode_mixed_deployment.md, 使用限制): Atlas 800I A2 only, at most 4 nodes / 32 NPUs an instance
# (the code allows 2-60 servers: ranktable_config.cpp MIN_SERVER_COUNT, MAX_SERVER_COUNT)
MULTINODE_NODES_MAX = 4
# MindIE's ModelConfig dp of a dense instance across nodes: the whole instance is one tensor-parallel
# group (tp the instance's NPUs), not one data-parallel rank per node (MindIE's own key, not autotune's dp)
ONE_DATA_PARALLEL_GROUP = 1
MULTINODE_DOC = "MindIE-LLM's prefill_decode_mixed_deployment.md, 多机混部"
SERVED_NAME = re.compile(r"[^A-Za-z0-9._-]+")
# where each knob is written (the header names it beside a value the evidence did not choose)
MINDIE_WRITTEN = {
    "tp": "ModelConfig[0].worldSize, npuDeviceIds (across nodes: ModelConfig[0].tp, multiNodesInferEnabled)",
    "replicas": "_autotune.replicas: one mindieservice_daemon each",
    "max_num_seqs": "ScheduleConfig.maxBatchSize, maxPrefillBatchSize",
    "max_num_batched_tokens": "ScheduleConfig.maxPrefillTokens",
    "block_size": "ScheduleConfig.cacheBlockSize",
    "memory_utilization": "_autotune.env.NPU_MEMORY_FRACTION",
    "enable_prefix_caching": "ModelConfig[0].plugin_params",
    "enable_chunked_prefill": "ModelConfig[0].plugin_params, ScheduleConfig.templateType",
    "quantization": "_autotune.weights: msModelSlim weights",
    "kv_cache_dtype": "_autotune.weights: msModelSlim weights",
}


def setting_where(name: str) -> str:
    """``ScheduleConfig.maxIterTimes``: where config.json holds MindIE's own key ``name``."""
    path = [str(p) if not isinstance(p, int) else f"[{p}]" for p in setting_path(name)]
    return ".".join(path[-3:]).replace(".[", "[")


def setting_path(name: str) -> tuple[Any, ...]:
    """Where MindIE reads ``name`` in config.json (a KeyError for a name it does not have)."""
    return (*MINDIE_KEYS[name], name)


def _put(tree: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = tree
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(key, int):
            while len(node) <= key:
                node.append({})
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    node[path[-1]] = value


def mindie_settings(
    config: dict[str, Any],
    *,
    max_model_len: int = 0,
    max_prompt_len: int = 0,
    max_output_len: int = 0,
    model_name: str | None = None,
    weight_path: str | None = None,
    devices_per_node: int = 0,
) -> dict[str, Any]:
    """The config.json keys a serving config sets, as a nested fragment (``plugin_params: None``
    = no plugin: remove the key). The one rendering the ``mindie`` preset runs and the export writes;
    an instance wider than ``devices_per_node`` gets :func:`multinode_settings`."""
    tp = param(config, "tp")
    seqs = int(config.get("max_num_seqs", serving_default("max_num_seqs")))
    engine = {k[len("engine.") :]: v for k, v in sorted(config.items()) if k.startswith("engine.")}
    plugins = [
        name
        for name, on in (
            ("prefix_cache", config.get("enable_prefix_caching", serving_default("enable_prefix_caching"))),
            ("splitfuse", config.get("enable_chunked_prefill", serving_default("enable_chunked_prefill"))),
        )
        if on
    ]
    out: dict[str, Any] = {}
    settings: dict[str, Any] = {
        "npuDeviceIds": [list(range(tp))],
        "modelInstanceNumber": 1,
        "worldSize": tp,
        "npuMemSize": -1,
        "plugin_params": json.dumps({"plugin_type": ",".join(plugins)}) if plugins else None,
        "templateType": "Mix"
        if config.get("enable_chunked_prefill", serving_default("enable_chunked_prefill"))
        else "Standard",
        "cacheBlockSize": param(config, "block_size", "npu"),
        "maxBatchSize": seqs,
        "maxPrefillBatchSize": seqs,
        "maxPrefillTokens": int(config.get("max_num_batched_tokens", serving_default("max_num_batched_tokens"))),
    }
    if devices_per_node > 0 and instance_nodes(tp, devices_per_node) > 1:
        settings.update(multinode_settings(tp, devices_per_node))
    if max_model_len:
        settings["maxSeqLen"] = int(max_model_len)
    if max_prompt_len:
        settings["maxInputTokenLen"] = int(max_prompt_len)
    if max_output_len:
        settings["maxIterTimes"] = int(max_output_len)
    if model_name:
        settings["modelName"] = SERVED_NAME.sub("-", model_name).strip("-._") or "model"
    if weight_path:
        settings["modelWeightPath"] = weight_path
    settings.update(engine)  # MindIE's own settings by their own names (maxIterTimes, maxPrefillBatchSize, ...)
    for name, value in settings.items():
        _put(out, setting_path(name), value)
    return out


def multinode_settings(tp: int, devices_per_node: int) -> dict[str, Any]:
    """MindIE's multi-node inference: one instance of ``tp`` NPUs over ``tp / devices_per_node`` whole
    nodes, every node running a daemon with the same config.json. With ``multiNodesInferEnabled`` MindIE
    takes the devices and the world from the rank table (:func:`rank_table`): ``worldSize`` and
    ``npuDeviceIds`` stay one node's (backend_config.cpp still checks that they agree;
    ranktable_config.cpp sets the world per node from the table), and ``ModelConfig[0].tp`` says the
    tensor-parallel group is the whole instance: without it, executor.cpp takes one data-parallel rank
    per node (``npuNumPerDP`` = the node's NPUs), and with ``dp`` 1 that is refused ("Invalid DP number
    per node"). MindIE-LLM 5e896196: src/executor/executor.cpp, src/config_manager/ranktable_config.cpp,
    docs/zh/user_guide/user_manual/prefill_decode_mixed_deployment.md ("多机混部")."""
    per = int(devices_per_node)
    return {
        "multiNodesInferEnabled": True,
        "npuDeviceIds": [list(range(per))],
        "modelInstanceNumber": 1,  # "单模型多机推理场景，该值需为1" (service_parameter_configuration.md)
        "worldSize": per,
        "tp": int(tp),
        "dp": ONE_DATA_PARALLEL_GROUP,
    }


def rank_table(nodes: int, devices_per_node: int) -> dict[str, Any]:
    """The ``ranktable.json`` of one multi-node instance, as MindIE's docs give it
    (prefill_decode_mixed_deployment.md, "ranktable文件样例"): one server per node, its devices'
    ``rank_id`` counted over the instance, the node with rank 0 (the first) the master, the only one
    that takes requests. The addresses are the cluster's (placeholders: ``${nodeN_ip}``, each NPU's
    ``${nodeN_deviceD_ip}`` from ``hccn_tool -i D -ip -g``)."""
    per = int(devices_per_node)
    return {
        "version": "1.0",
        "server_count": str(int(nodes)),
        "server_list": [
            {
                "server_id": f"${{node{n}_ip}}",
                "container_ip": f"${{node{n}_ip}}",
                "device": [
                    {"device_id": str(d), "device_ip": f"${{node{n}_device{d}_ip}}", "rank_id": str(n * per + d)}
                    for d in range(per)
                ],
            }
            for n in range(int(nodes))
        ],
        "status": "completed",
    }


def mindie_env(config: dict[str, Any]) -> dict[str, str]:
    """The environment MindIE reads the trial's settings from: the NPU memory share
    (``NPU_MEMORY_FRACTION``, with ``npuMemSize: -1``) and the Prometheus ``/metrics`` switch. A
    config without a share gets the study's default (the parameter table's, what the simulator
    priced), not MindIE's own 0.8."""
    return {"NPU_MEMORY_FRACTION": f"{float(param(config, 'memory_utilization')):g}", "MIES_SERVICE_MONITOR_MODE": "1"}


def weights_note(config: dict[str, Any]) -> str | None:
    """What modelWeightPath must hold for a quantized config or a C8 KV cache (None: plain weights):
    MindIE reads both from msModelSlim's weights, not from config.json."""
    if param(config, "quantization") == "none" and config.get("kv_cache_dtype") != "int8":
        return None
    return one_line(
        f"modelWeightPath must hold msModelSlim-quantized weights ({config.get('quantization')}"
        + (", C8 int8 KV cache" if config.get("kv_cache_dtype") == "int8" else "")
        + ")"
    )


def merge_config(base: dict[str, Any], fragment: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a MindIE config.json) with ``fragment`` merged in: mappings key by key, the
    ``ModelConfig`` list element by element, a ``None`` value removes the key; ``_autotune`` is skipped."""
    out = copy.deepcopy(base)

    def merge(into: Any, part: Any) -> Any:
        if isinstance(part, dict) and isinstance(into, dict):
            for k, v in part.items():
                if k == "_autotune":
                    continue
                if v is None:
                    into.pop(k, None)
                else:
                    into[k] = merge(into.get(k), v)
            return into
        if isinstance(part, list) and isinstance(into, list) and part and all(isinstance(x, dict) for x in part):
            for i, item in enumerate(part):
                if i < len(into):
                    into[i] = merge(into[i], item)
                else:
                    into.append(copy.deepcopy(item))
            return into
        return copy.deepcopy(part)

    return merge(out, fragment)
