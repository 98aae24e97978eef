"""MindIE Service (MindIE-LLM's ``mindieservice_daemon``): Ascend's own serving engine.

A target of serving studies when named (``target: mindie``, or its preset ``backend: {kind:
mindie}``): its rules say what MindIE's ``config.json`` cannot hold or its features do not support
(MindIE-LLM 3.0.0.beta.1, gitcode/GitHub ``Ascend/MindIE-LLM`` at 5e896196: ``src/config_manager/``,
``docs/zh/user_guide/user_manual/service_parameter_configuration.md``, ``feature/prefix_cache.md``,
``feature/splitFuse.md``); its exporter writes the ``config.json`` settings
(``export._mindie.mindie_settings``). As the probe: one daemon per replica, each started with
``MIES_CONFIG_JSON_PATH`` naming its rendered config.json (MindIE's default config with the trial's
settings, plain HTTP on 127.0.0.1 and the probe's ports: the OpenAI ``/v1/completions`` on
``port``, ``/health`` on ``managementPort``, Prometheus ``/metrics`` on ``metricsPort`` with
``MIES_SERVICE_MONITOR_MODE=1``: ``src/server/endpoint/http_wrapper/http_handler.cpp``,
``http_server.cpp``, ``prometheus_metrics.cpp``), ``ASCEND_RT_VISIBLE_DEVICES`` its devices and
``MINDIE_LOG_TO_STDOUT=1`` so the probe reads MindIE's words. MindIE loads real weights: the model
must name its checkpoint (``model.path``). An instance wider than a node is MindIE's multi-node
inference: ranked and exported (the config.json every node merges, the rank table its nodes share),
not probed (the probe would need every NPU's device IP for the rank table).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from autotune.workers.parameters import instance_nodes, prefill_tp_or_tp, serving_default, value
from autotune.export._mindie_export import MindIEExporter
from autotune.export._mindie_pd import INSTANCES_MAX, POD_NPUS_MAX, RATE_MAX, RATE_SUM_MAX, pd_rates
from autotune.export._mindie import (
    MINDIE_DEFAULT_CONFIG,
    MINDIE_KEYS,
    MINDIE_SET_BY_AUTOTUNE,
    MULTINODE_DOC,
    MULTINODE_NODES_MAX,
    merge_config,
    mindie_env,
    mindie_settings,
)

from ._base import (
    PresetLaunch,
    PresetRun,
    Rule,
    SERVED_MODEL_NAME,
    Stack,
    col,
    disaggregated,
    engine_names,
    fact,
    longest_lengths,
    param,
    param_on_device,
    serving_engine_launch,
)

__all__ = ["METRICS_NAMES", "SERVED_MODEL_NAME", "STACK", "STARTUP_FAILURES", "mindie_config_text", "mindie_rules"]

DEFAULT_ENTRY = "mindieservice_daemon"
# MindIE's Prometheus names (prometheus_metrics.cpp InitPrometheusMetrics; tests/fixtures/mindie/metrics.txt)
METRICS_NAMES = {
    "kv_cache_usage": ["npu_cache_usage_perc"],
    "preemptions": ["num_preemptions_total"],
    "running": ["num_requests_running"],
    "waiting": ["num_requests_waiting"],
}
# MindIE's words at startup (mindie_llm/text_generator/generator.py, utils/npu_mem_tool.py,
# src/include/config/param_checker.h, src/server/daemon/llm_daemon.cpp), in order
STARTUP_FAILURES = [
    [r"Warmup failed", "oom", "MindIE's warm-up ran out of NPU memory (NPU_MEMORY_FRACTION, maxPrefillTokens)"],
    [r"NPU out of memory", "oom", "out of NPU memory at startup"],
    [r"\] is out of bound \[|\] is less than \[", "invalid", "MindIE's config check refused a setting"],
    [r"The templateType must be|Backend type only supports", "invalid", "MindIE's config check refused a setting"],
    [r"Failed to init endpoint", "crash", "the MindIE daemon failed to start"],
]
# the models MindIE's features support (prefix_cache.md, splitFuse.md "限制与约束"), by model name
PREFIX_CACHE_MODELS = re.compile(r"qwen2|qwen3|deepseek", re.IGNORECASE)
SPLITFUSE_MODELS = re.compile(r"qwen2|qwen3|llama-?3\.1-70b", re.IGNORECASE)


def _known(c: dict[str, np.ndarray], n: int, pattern: re.Pattern[str]) -> np.ndarray:
    """The model is named and is not one ``pattern`` matches."""
    names = fact(c, "model", n).astype(str)
    return np.array([bool(m) and not pattern.search(m) for m in names], dtype=bool)


def _engine(c: dict[str, np.ndarray], name: str, n: int) -> np.ndarray | None:
    value = c.get(f"engine.{name}")
    return None if value is None else np.asarray(value)


def _number(value: Any) -> float:
    """An engine setting as a number (one MindIE's uint32 check refuses at startup counts as 0 here)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def mindie_rules(n: int) -> list[Rule]:
    def block(c):
        return param_on_device(c, "block_size", n).astype(int)

    def quant(c):
        return param(c, "quantization", n).astype(str)

    def kv(c):
        kv = param(c, "kv_cache_dtype", n).astype(str)
        return np.where(kv == param(c, "precision", n).astype(str), "auto", kv)

    def prefix(c):
        return np.asarray(col(c, "enable_prefix_caching", serving_default("enable_prefix_caching"), n)).astype(bool)

    def chunked(c):
        return np.asarray(col(c, "enable_chunked_prefill", serving_default("enable_chunked_prefill"), n)).astype(bool)

    def over(c, name: str, limit) -> np.ndarray:
        value = _engine(c, name, n)
        if value is None:
            return np.zeros(n, dtype=bool)
        return np.array([_number(v) > float(m) for v, m in zip(value, np.broadcast_to(limit, (n,)))], dtype=bool)

    def prefill_tp(c) -> np.ndarray:
        return prefill_tp_or_tp(param(c, "prefill_tp", n).astype(int), param(c, "tp", n).astype(int))

    def rates_over(c) -> np.ndarray:
        p_rate, d_rate = pd_rates(param(c, "prefill_replicas", n).astype(int), param(c, "replicas", n).astype(int))
        return (p_rate > RATE_MAX) | (d_rate > RATE_MAX) | (p_rate + d_rate > RATE_SUM_MAX)

    def instance_nodes_of(c) -> np.ndarray:
        per = fact(c, "devices_per_node", n).astype(int)
        return np.where(per > 0, instance_nodes(param(c, "tp", n).astype(int), np.maximum(per, 1)), 1)

    def max_iter_over(c) -> np.ndarray:
        context = fact(c, "max_model_len", n).astype(int)
        return over(c, "maxIterTimes", context) & (context > 0)

    return [
        (
            "MindIE's PD separation moves the KV cache itself (MindIE-Motor's D2DTransfer): kv_connector d2d "
            "(auto), not one of vLLM's connectors",
            lambda c: disaggregated(c, n) & ~np.isin(param(c, "kv_connector", n).astype(str), ["auto", "d2d"]),
        ),
        (
            f"MindIE-Motor's deploy script takes 1-{INSTANCES_MAX} prefill and 1-{INSTANCES_MAX} decode instances "
            "(p_instances_num, d_instances_num: utils/validate_config.py)",
            lambda c: (
                disaggregated(c, n)
                & (
                    (param(c, "prefill_replicas", n).astype(int) > INSTANCES_MAX)
                    | (param(c, "replicas", n).astype(int) > INSTANCES_MAX)
                )
            ),
        ),
        (
            f"a MindIE PD instance is exported as one pod of at most {POD_NPUS_MAX} NPUs (p_pod_npu_num, "
            "d_pod_npu_num: utils/validate_config.py); an instance across nodes (multiNodesInferEnabled) is not",
            lambda c: disaggregated(c, n) & (param(c, "tp", n).astype(int) > POD_NPUS_MAX),
        ),
        (
            "a MindIE PD instance is one pod on one node: MindIE's PD separation does not combine with multi-node "
            "inference (MindIE-Motor 3402b154 pd_separation_service_deployment.md, 多机PD分离: "
            "不支持和...多机推理...同时使用); tp at most the devices of a node",
            lambda c: (
                disaggregated(c, n)
                & (fact(c, "devices_per_node", n).astype(int) > 0)
                & (param(c, "tp", n).astype(int) > fact(c, "devices_per_node", n).astype(int))
            ),
        ),
        (
            f"MindIE's multi-node inference takes at most {MULTINODE_NODES_MAX} nodes an instance (Atlas 800I A2, "
            f"at most 4 nodes / 32 NPUs: {MULTINODE_DOC}, 使用限制)",
            lambda c: ~disaggregated(c, n) & (instance_nodes_of(c) > MULTINODE_NODES_MAX),
        ),
        (
            "MindIE-Motor assigns the prefill and decode roles itself when every instance is one pod "
            "(RoleManagerInitializer.cpp keeps the rank table's roles only for pools of different pod counts), "
            "so both pools take the same NPUs: prefill_tp must equal tp",
            lambda c: disaggregated(c, n) & (prefill_tp(c) != param(c, "tp", n).astype(int)),
        ),
        (
            f"MindIE-Motor's prefill:decode ratio (default_p_rate:default_d_rate, the pools' instances over their "
            f"common divisor) is at most {RATE_MAX} each and {RATE_SUM_MAX} together (controller.md)",
            lambda c: disaggregated(c, n) & rates_over(c),
        ),
        (
            "MindIE Service runs on Ascend NPUs only",
            lambda c: np.isin(fact(c, "accelerator", n).astype(str), ["cuda", "cpu"]),
        ),
        (
            "MindIE has no pipeline parallelism: ModelConfig's worldSize is the tensor-parallel size "
            "(src/config_manager/model_deploy_config.cpp)",
            lambda c: param(c, "pp", n).astype(int) > 1,
        ),
        (
            "MindIE's cacheBlockSize is at most 128 and a multiple of 16 (service_parameter_configuration.md, "
            "schedule_config.cpp)",
            lambda c: (block(c) > 128) | (block(c) % 16 != 0),
        ),
        (
            "MindIE runs its own (ATB) graph: graph_mode eager and torchair are vLLM / vLLM-Ascend settings",
            lambda c: param(c, "graph_mode", n).astype(str) != "graph",
        ),
        (
            "MindIE's KV cache is the model dtype, or int8 (C8) from msModelSlim weights: no bf16/fp16/fp8 setting",
            lambda c: np.isin(kv(c), ["bf16", "fp16", "fp8"]),
        ),
        (
            "an int8 KV cache in MindIE is C8 from msModelSlim-quantized weights: quantization none cannot have it",
            lambda c: (kv(c) == "int8") & (quant(c) == "none"),
        ),
        (
            "MindIE needs maxPrefillTokens (max_num_batched_tokens) >= maxInputTokenLen, the longest prompt "
            "(service_parameter_configuration.md)",
            lambda c: (
                (fact(c, "max_prompt_len", n).astype(int) > 0)
                & (
                    col(c, "max_num_batched_tokens", serving_default("max_num_batched_tokens"), n).astype(int)
                    < fact(c, "max_prompt_len", n).astype(int)
                )
            ),
        ),
        (
            "MindIE's prefix cache supports Qwen2/2.5/3 and DeepSeek-R1/V3 models only "
            "(docs/zh/user_guide/feature/prefix_cache.md)",
            lambda c: prefix(c) & _known(c, n, PREFIX_CACHE_MODELS),
        ),
        (
            "MindIE's prefix cache supports W8A8 and W4A8 quantization only (prefix_cache.md), "
            "not weight-only int8/int4",
            lambda c: prefix(c) & np.isin(quant(c), ["int8", "int4"]),
        ),
        (
            "MindIE's SplitFuse (chunked prefill) supports LLaMA3.1-70B and Qwen2/2.5/3 models only "
            "(docs/zh/user_guide/feature/splitFuse.md)",
            lambda c: chunked(c) & _known(c, n, SPLITFUSE_MODELS),
        ),
        (
            "MindIE's SplitFuse (chunked prefill) supports W8A8 quantization only (splitFuse.md)",
            lambda c: chunked(c) & np.isin(quant(c), ["int8", "int4"]),
        ),
        (
            "MindIE's maxPrefillBatchSize must be at most maxBatchSize (max_num_seqs) (schedule_config.cpp)",
            lambda c: over(
                c, "maxPrefillBatchSize", col(c, "max_num_seqs", serving_default("max_num_seqs"), n).astype(int)
            ),
        ),
        ("MindIE's maxIterTimes must be at most maxSeqLen, the workload's max_model_len", max_iter_over),
        (
            "MindIE settings autotune renders from its own names (maxBatchSize <- max_num_seqs, "
            "maxPrefillTokens, cacheBlockSize, worldSize, npuMemSize, plugin_params, templateType, ...) "
            "cannot also be set as engine.NAME",
            lambda c: np.full(n, any(name in MINDIE_SET_BY_AUTOTUNE for name in engine_names(c))),
        ),
        (
            "engine.NAME is not a MindIE config.json setting (MindIE-LLM 3.0.0.beta.1: ServerConfig, BackendConfig, "
            "ModelDeployConfig, ModelConfig, ScheduleConfig)",
            lambda c: np.full(n, any(name not in MINDIE_KEYS for name in engine_names(c))),
        ),
    ]


# the daemon's ports are the probe's placeholders (JSON numbers once filled in)
_PORTS = {"port": "{port}", "managementPort": "{management_port}", "metricsPort": "{metrics_port}"}


def mindie_config_text(
    config: dict[str, Any], model: dict[str, Any], workload: dict[str, Any], weight_path: str, model_name: str
) -> str:
    """One replica's config.json: MindIE's default with the trial's settings, plain HTTP on
    127.0.0.1, and the probe's ``{port}``/``{management_port}``/``{metrics_port}`` (unquoted: numbers)."""
    prompt, output = longest_lengths(workload)
    settings = mindie_settings(
        config,
        max_model_len=int(workload.get("max_model_len") or 0),
        max_prompt_len=prompt,
        max_output_len=output,
        model_name=model_name,
        weight_path=weight_path,
    )
    server = {
        "ServerConfig": {
            "ipAddress": "127.0.0.1",
            "managementIpAddress": "127.0.0.1",
            **_PORTS,
            "httpsEnabled": False,
            "interCommTLSEnabled": False,
        },
        "BackendConfig": {"interNodeTLSEnabled": False},
    }
    text = json.dumps(merge_config(merge_config(MINDIE_DEFAULT_CONFIG, settings), server), indent=1)
    for placeholder in _PORTS.values():
        text = text.replace(json.dumps(placeholder), placeholder)
    return text


def mindie_launch(run: PresetRun) -> PresetLaunch:
    """``engine.json`` for the serving probe: one ``mindieservice_daemon`` per replica."""
    config, model, workload = run.config, run.model, run.workload
    weight_path = model.get("path")
    if value(config, "prefill_replicas") > 0:
        raise ValueError(
            "the mindie probe starts mindieservice_daemon replicas; MindIE's PD separation runs under MindIE-Motor's "
            "controller and coordinator, which it does not start: tune a disaggregated layout on the simulator or "
            "through the command backend (the export writes MindIE-Motor's user_config.json)"
        )
    per = int(run.cluster.get("devices_per_node") or 0)
    if per and value(config, "tp") > per:
        raise ValueError(
            f"the mindie probe starts its daemons on one node, and tp {value(config, 'tp')} is wider than a node "
            f"({per} NPUs): MindIE's multi-node inference needs the rank table of the instance's nodes with every "
            "NPU's device IP, which the probe does not write; rank it with backend simulate (target: mindie) or "
            "measure it through backend command (the export writes the config.json and the rank table to fill)"
        )
    if not weight_path:
        raise ValueError(
            "MindIE loads real weights: the model must name its checkpoint (model.path, the folder of its config.json)"
        )
    text = mindie_config_text(config, model, workload, str(weight_path), SERVED_MODEL_NAME)
    argv = [*(run.entry or [DEFAULT_ENTRY]), *run.user]
    env = {
        "MIES_CONFIG_JSON_PATH": "{replica_dir}/config.json",
        "ASCEND_RT_VISIBLE_DEVICES": "{devices}",
        "MINDIE_LOG_TO_STDOUT": "1",
        **mindie_env(config),
    }
    tp = value(config, "tp")
    devices = [list(range(k * tp, (k + 1) * tp)) for k in range(value(config, "replicas"))]
    replicas = [{"argv": list(argv), "env": dict(env), "devices": d, "files": {"config.json": text}} for d in devices]
    return serving_engine_launch(
        "mindie", replicas, {}, ("metrics_port", "management_port"), METRICS_NAMES, STARTUP_FAILURES, workload, ""
    )


STACK = Stack(
    name="mindie",
    rules=mindie_rules,
    memory_rule=None,
    exporter=MindIEExporter(),
    supported_versions="MindIE-LLM 3.0 (checked: the 3.0.0.beta.1 source and docs, Ascend/MindIE-LLM at 5e896196)",
    workloads=("serve",),
    default_when=lambda backend, accelerator, searched: backend == "mindie",  # only when named
    launch=mindie_launch,
    default_entry=DEFAULT_ENTRY,
    entry_example=DEFAULT_ENTRY,
)
