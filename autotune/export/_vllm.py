"""vLLM and vLLM-Ascend: ``serve_vllm.sh``, one OpenAI-compatible server per replica.

One source of truth: :func:`vllm_engine_args` renders a serving config into vLLM's engine
arguments, for this script and for the ``vllm`` stack preset's ``engine.json``
(:mod:`autotune.stacks.vllm`), so what a probe launches is what is exported. The names are vLLM's
own (checked by vLLM 0.32's argument parser, ``vllm/entrypoints/launchers/cli_args.py``
``make_arg_parser`` + ``AsyncEngineArgs.from_cli_args``, in tests/test_export_serving.py):

- ``tp``/``pp`` -> ``--tensor-parallel-size``/``--pipeline-parallel-size``; ``replicas``: one
  server per replica on its own ``tp x pp`` devices and port (a load balancer goes in front);
- ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size`` -> the same flags;
  ``enable_chunked_prefill``/``enable_prefix_caching`` -> ``--[no-]enable-...``;
  ``memory_utilization`` -> ``--gpu-memory-utilization`` (vLLM-Ascend's NPU share, the CPU
  backend's share of memory too);
- ``graph_mode``: ``eager`` -> ``--enforce-eager``; ``graph`` -> ``--no-enforce-eager`` (CUDA
  graphs, vLLM-Ascend's ACLGraph); ``torchair`` -> vLLM-Ascend's ``--additional-config``
  ``torchair_graph_config`` (v0.9.1-v0.11.x, DeepSeek-series models only: refused by the stack's
  rules for a dense Llama);
- ``precision`` -> ``--dtype``; ``kv_cache_dtype`` -> ``--kv-cache-dtype`` (``int8`` on CUDA is
  vLLM's ``int8_per_token_head``; vLLM-Ascend's int8 KV cache is C8 from a ModelSlim checkpoint,
  not a flag); ``quantization`` -> ``--quantization ascend`` on Ascend (ModelSlim W8A16 / W8A8 /
  W4A16 checkpoints), ``compressed-tensors`` elsewhere (LLM-Compressor checkpoints of the same
  schemes): vLLM reads the scheme from the checkpoint;
- ``engine.NAME`` -> ``--NAME`` (dashes for underscores; a boolean ``--NAME`` / ``--no-NAME``);
  ``engine.additional_config`` (JSON) is merged into ``--additional-config``.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from ..workers.parameters import instance_devices, prefill_tensor_parallel, serving_default, value as param

from ._base import ExportContext, Exporter, args_written, bash_array, header_lines, json_text, one_line, unsafe_settings
from ._env import env_exports, env_written
from ._vllm_disagg import (
    MULTINODE_ARGS,
    SHARED_STORAGE_PATH,
    connector_class,
    disaggregated_lines,
    instances_across_nodes,
)
from ._vllm_multinode import MULTINODE_CPU_REFUSAL, multinode_lines, spans_nodes

__all__ = [
    "VllmExporter",
    "VLLM_SET_BY_AUTOTUNE",
    "additional_config",
    "replica_devices",
    "vllm_dtype",
    "vllm_engine_args",
    "vllm_kv_cache_dtype",
    "vllm_quantization",
]

# vLLM's own names (argparse dests) of the settings autotune renders from its canonical names:
# an engine.NAME of one of them would set it twice
VLLM_SET_BY_AUTOTUNE = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "enforce_eager",
    "kv_cache_dtype",
    "quantization",
    "dtype",
    "max_model_len",
    "model",
    "port",
    "host",
    "served_model_name",
)

# the flag each knob is written as (in VLLM_ARGS): the header names it beside a value the evidence
# did not choose
VLLM_FLAGS = {
    "tp": "--tensor-parallel-size",
    "pp": "--pipeline-parallel-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "enable_chunked_prefill": "--enable-chunked-prefill",
    "enable_prefix_caching": "--enable-prefix-caching",
    "memory_utilization": "--gpu-memory-utilization",
    "graph_mode": "--enforce-eager",
    "precision": "--dtype",
    "kv_cache_dtype": "--kv-cache-dtype",
    "quantization": "--quantization",
}

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_KV_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "fp8", "int8": "int8_per_token_head"}


def vllm_dtype(config: dict[str, Any]) -> str:
    """``--dtype`` of the config's precision."""
    return _DTYPES.get(param(config, "precision"), "bfloat16")


def vllm_kv_cache_dtype(config: dict[str, Any], accelerator: str) -> str:
    """``--kv-cache-dtype``: ``auto`` for the compute dtype; on Ascend always ``auto`` (a quantized
    KV cache comes from the checkpoint there: vLLM-Ascend's C8)."""
    kv = param(config, "kv_cache_dtype")
    if kv in ("auto", param(config, "precision")) or accelerator == "npu":
        return "auto"
    return _KV_DTYPES.get(kv, kv)


def vllm_quantization(config: dict[str, Any], accelerator: str) -> str | None:
    """``--quantization``: the method that loads the config's quantized checkpoint, None for none."""
    quant = param(config, "quantization")
    if quant == "none":
        return None
    return "ascend" if accelerator == "npu" else "compressed-tensors"


def _engine_settings(config: dict[str, Any]) -> dict[str, Any]:
    return {k[len("engine.") :]: v for k, v in sorted(config.items()) if k.startswith("engine.")}


def _no_constant(word: str) -> Any:
    raise ValueError(f"engine.additional_config holds {word}, which strict JSON (and vLLM's parser) does not read")


def additional_config(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``--additional-config`` (a platform plugin's own settings): vLLM-Ascend's torchair
    graph for ``graph_mode: torchair`` and the user's ``engine.additional_config`` (JSON) on top."""
    out: dict[str, Any] = {}
    if param(config, "graph_mode") == "torchair":  # vLLM-Ascend <= v0.11: torchair runs with its ascend scheduler
        out["torchair_graph_config"] = {"enabled": True}
        out["ascend_scheduler_config"] = {"enabled": True}
    user = _engine_settings(config).get("additional_config")
    if user not in (None, ""):
        extra = json.loads(user, parse_constant=_no_constant) if isinstance(user, str) else user
        if not isinstance(extra, dict):
            raise ValueError(f"engine.additional_config must be a JSON object, got {user!r}")
        out.update(extra)
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _setting(config: dict[str, Any], name: str) -> Any:
    """A serving setting of the config, else the parameter table's default."""
    return config.get(name, serving_default(name))


def vllm_engine_args(config: dict[str, Any], accelerator: str, max_model_len: int | None = None) -> list[str]:
    """vLLM's engine arguments for a serving config (no model, host or port): the one rendering
    the ``vllm`` preset runs and ``serve_vllm.sh`` exports."""
    args = [
        "--tensor-parallel-size",
        str(param(config, "tp")),
        "--pipeline-parallel-size",
        str(param(config, "pp")),
        "--max-num-seqs",
        str(int(config.get("max_num_seqs", serving_default("max_num_seqs")))),
        "--max-num-batched-tokens",
        str(int(config.get("max_num_batched_tokens", serving_default("max_num_batched_tokens")))),
        "--block-size",
        str(param(config, "block_size", accelerator)),
        "--enable-chunked-prefill" if _setting(config, "enable_chunked_prefill") else "--no-enable-chunked-prefill",
        "--enable-prefix-caching" if _setting(config, "enable_prefix_caching") else "--no-enable-prefix-caching",
        "--gpu-memory-utilization",
        f"{float(_setting(config, 'memory_utilization')):g}",
        "--enforce-eager" if param(config, "graph_mode") == "eager" else "--no-enforce-eager",
        "--dtype",
        vllm_dtype(config),
        "--kv-cache-dtype",
        vllm_kv_cache_dtype(config, accelerator),
    ]
    quantization = vllm_quantization(config, accelerator)
    if quantization:
        args += ["--quantization", quantization]
    if max_model_len:
        args += ["--max-model-len", str(int(max_model_len))]
    unsafe = unsafe_settings({k: v for k, v in config.items() if k.startswith("engine.")}, flags=True)
    if unsafe:  # the spec refuses these; a config from elsewhere never reaches a command line with one
        raise ValueError(f"cannot render vLLM's arguments: {'; '.join(unsafe)}")
    extra = additional_config(config)
    if extra:
        args += ["--additional-config", json_text(extra, sort_keys=True, separators=(",", ":"))]
    for name, value in _engine_settings(config).items():
        if name == "additional_config":
            continue
        if isinstance(value, bool):
            args.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
        else:
            args += [_flag(name), str(value)]
    return args


def replica_devices(config: dict[str, Any]) -> list[list[int]]:
    """Each replica's devices (indices into the trial's, or the node's): ``tp x pp`` apiece, in order."""
    per = param(config, "tp") * param(config, "pp")
    return [list(range(k * per, (k + 1) * per)) for k in range(param(config, "replicas"))]


# each accelerator's device-visibility variable, and the command that starts one server
DEVICE_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's CPU backend: the cores of a tp=pp=1 engine


class VllmExporter(Exporter):
    name = "vllm"
    filename = "serve_vllm.sh"
    shell = True
    executable = True
    launches = "serve"
    engine_values = "flags"  # engine.NAME -> --NAME VALUE

    def unsupported(self, ctx: ExportContext) -> list[str]:
        reasons = super().unsupported(ctx)
        try:
            additional_config(ctx.config)
        except ValueError as exc:  # not a JSON object, or NaN in it: vLLM would not start
            reasons.append(one_line(exc))
        accelerator = str(ctx.cluster.get("accelerator", "") or "cuda")
        prefill_wide = param(ctx.config, "prefill_replicas") > 0 and spans_nodes(
            {**ctx.config, "tp": prefill_tensor_parallel(ctx.config)}, self._per_node(ctx)
        )
        if accelerator == "cpu" and (spans_nodes(ctx.config, self._per_node(ctx)) or prefill_wide):
            reasons.append(MULTINODE_CPU_REFUSAL)
        return reasons

    @staticmethod
    def _per_node(ctx: ExportContext) -> int:
        return int(ctx.cluster.get("devices_per_node") or ctx.world_size or 1)

    def render(self, ctx: ExportContext) -> str:
        config = ctx.config
        accelerator = str(ctx.cluster.get("accelerator", "") or "cuda")
        if param(config, "prefill_replicas") > 0:
            return self._render_disaggregated(ctx, accelerator)
        if spans_nodes(config, self._per_node(ctx)):
            return self._render_multinode(ctx, accelerator)
        devices = replica_devices(config)
        per = len(devices[0]) if devices else 1
        max_model_len = ctx.workload.get("max_model_len")
        args = vllm_engine_args(config, accelerator, max_model_len)
        written = self._written(ctx, args)
        written["replicas"] = f"{len(devices)} server(s) in REPLICA_DEVICES"
        what = (
            f"{len(devices)} server(s), one per replica, {per} device(s) each (tp {param(config, 'tp')} x pp "
            f"{param(config, 'pp')}), on ports PORT, PORT+1, ...; put your load balancer in front of them."
        )
        lines = self._preamble(ctx, accelerator, written, what)
        lines += [
            "PORT=${PORT:-8000}  # replica k listens on PORT+k",
            "",
            *bash_array("VLLM_ARGS", args),
            "# each server's devices",
            "REPLICA_DEVICES=(",
            *(f"    {','.join(map(str, d))}" for d in devices),
            ")",
            "",
            "pids=()",
            "trap 'kill \"${pids[@]}\" 2>/dev/null || true' INT TERM",
            'for k in "${!REPLICA_DEVICES[@]}"; do',
        ]
        if accelerator == "cpu":
            # the `vllm` console script of the vllm-cpu distribution looks up a package named vllm and fails
            bind = (
                f'    {CPU_BIND_ENV}="${{REPLICA_DEVICES[$k]}}" \\\n'
                if per == 1
                else ""  # tp/pp > 1 on CPU: vLLM's own binding ('|' between ranks)
            )
            lines.append(
                f"{bind}"
                '    "${PYTHON:-python}" -m vllm.entrypoints.openai.api_server --model "$MODEL" \\\n'
                '        --host "$HOST" --port $((PORT + k)) "${VLLM_ARGS[@]}" "$@" &'
            )
        else:
            lines.append(
                f'    {DEVICE_ENV.get(accelerator, "CUDA_VISIBLE_DEVICES")}="${{REPLICA_DEVICES[$k]}}" \\\n'
                '        vllm serve "$MODEL" --host "$HOST" --port $((PORT + k)) "${VLLM_ARGS[@]}" "$@" &'
            )
        lines += ['    pids+=("$!")', "done", 'wait "${pids[@]}"']
        return "\n".join(lines) + "\n"

    def _render_multinode(self, ctx: ExportContext, accelerator: str) -> str:
        """Instances wider than a node (:mod:`._vllm_multinode`): this node's rank of its instance."""
        config = ctx.config
        args = vllm_engine_args(config, accelerator, ctx.workload.get("max_model_len"))
        written = self._written(ctx, args)
        per_node = self._per_node(ctx)
        nodes = instance_devices(config) // per_node
        written["replicas"] = f"{param(config, 'replicas')} instance(s) of {nodes} node(s), NODE / {nodes}"
        what = (
            f"{param(config, 'replicas')} instance(s) of tp {param(config, 'tp')} x pp {param(config, 'pp')}, each "
            f"over {nodes} whole nodes of {per_node} devices; run this script on every node with NODE set; each "
            "instance serves on PORT of its first node: put your load balancer in front of them."
        )
        lines = self._preamble(ctx, accelerator, written, what)
        lines += multinode_lines(
            config, per_node, args, DEVICE_ENV.get(accelerator, "CUDA_VISIBLE_DEVICES"), bash_array
        )
        return "\n".join(lines) + "\n"

    @staticmethod
    def _written(ctx: ExportContext, args: list[str]) -> dict[str, str]:
        """How the script writes each setting (the header names one the evidence did not choose):
        the environment's, and each vLLM flag in ``args`` (the engine.* ones by their own flags)."""
        engine_flags = {n: _flag(n[len("engine.") :]) for n in ctx.config if n.startswith("engine.")}
        return {**env_written(ctx), **args_written(args, {**VLLM_FLAGS, **engine_flags})}

    def _preamble(self, ctx: ExportContext, accelerator: str, written: dict[str, str], what: str) -> list[str]:
        """The script's start: header, what it runs, environment, CANN on Ascend, the quantized checkpoint's
        note, MODEL, HOST and PORT."""
        config = ctx.config
        flavour = {"npu": "vLLM-Ascend", "cpu": "vLLM's CPU build (vllm-cpu)"}.get(accelerator, "vLLM")
        model = re.sub(r"[^\w.+-]", "_", str(ctx.model.get("name") or "the_model"))
        lines = [
            "#!/usr/bin/env bash",
            *header_lines(ctx, written=written),
            f"# {flavour} serving on {one_line(accelerator)}, as {ctx.how}: {what}",
            "# vLLM 0.10 and later (checked: vLLM 0.32's own argument parser); extra flags after the script's name "
            "are passed to every server.",
            "set -euo pipefail",
            "",
            *env_exports(ctx),
        ]
        if accelerator == "npu":
            lines += [
                "# vLLM-Ascend needs CANN and its ATB library (vllm-ascend docs/source/installation.md)",
                "ASCEND_HOME=${ASCEND_HOME:-/usr/local/Ascend}",
                "set +u",
                '[ -f "$ASCEND_HOME/ascend-toolkit/set_env.sh" ] && source "$ASCEND_HOME/ascend-toolkit/set_env.sh"',
                '[ -f "$ASCEND_HOME/nnal/atb/set_env.sh" ] && source "$ASCEND_HOME/nnal/atb/set_env.sh"',
                "set -u",
            ]
            if vllm_quantization(config, accelerator):
                lines.append(
                    "# --quantization ascend: MODEL must be a ModelSlim-quantized checkpoint of the trial's scheme "
                    f"({one_line(config.get('quantization'))}"
                    + (", with the C8 int8 KV cache" if config.get("kv_cache_dtype") == "int8" else "")
                    + f", as {ctx.how})"
                )
        elif vllm_quantization(config, accelerator):
            lines.append(
                "# --quantization compressed-tensors: MODEL must be an LLM-Compressor checkpoint of the trial's "
                f"scheme ({one_line(config.get('quantization'))}, as {ctx.how})"
            )
        path = ctx.model.get("path")
        lines += [
            f"MODEL=${{MODEL:-{shlex.quote(str(path))}}}  # the checkpoint: a Hugging Face id or a local path"
            if path
            else "MODEL=${MODEL:?"
            + shlex.quote(f"set MODEL to the checkpoint of {model} (a Hugging Face id or a path)")
            + "}",
            "HOST=${HOST:-0.0.0.0}",
        ]
        return lines

    def _render_disaggregated(self, ctx: ExportContext, accelerator: str) -> str:
        """A disaggregated deployment (:mod:`._vllm_disagg`): the prefill and decode servers this node
        runs, with their KV transfer configs, and the proxy on node 0."""
        config = ctx.config
        max_model_len = ctx.workload.get("max_model_len")
        prefill_tp = prefill_tensor_parallel(config)
        decode_args = vllm_engine_args(config, accelerator, max_model_len)
        prefill_args = vllm_engine_args({**config, "tp": prefill_tp}, accelerator, max_model_len)
        written = self._written(ctx, decode_args)
        connector = connector_class(config, accelerator)
        written.update(
            replicas=f"{param(config, 'replicas')} decode server(s) in SERVER_POOL",
            prefill_replicas=f"{param(config, 'prefill_replicas')} prefill server(s) in SERVER_POOL",
            prefill_tp=f"--tensor-parallel-size {prefill_tp} in PREFILL_ARGS",
            kv_connector=f"--kv-transfer-config kv_connector {connector} in SERVER_KV",
        )
        dpn = int(ctx.cluster.get("devices_per_node") or ctx.world_size or 1)
        what = (
            f"disaggregated prefill, {param(config, 'prefill_replicas')} prefill server(s) of tp {prefill_tp} x pp "
            f"{param(config, 'pp')} and {param(config, 'replicas')} decode server(s) of tp {param(config, 'tp')}, "
            f"the KV cache sent by {connector}, a proxy on PORT in front."
        )
        lines = self._preamble(ctx, accelerator, written, what)
        lines.append(
            "PORT=${PORT:-8000}  # the proxy's; prefill server i listens on PORT+100+i, decode server j on PORT+200+j"
        )
        if connector == "ExampleConnector":
            lines.append(
                f"# the shared-storage example connector passes the KV cache through {SHARED_STORAGE_PATH}: on more "
                "than one node, every node must see the same files there"
            )
        nixl = (
            '    VLLM_NIXL_SIDE_CHANNEL_HOST="${NODES[$NODE]}" VLLM_NIXL_SIDE_CHANNEL_PORT=$((5600 + k)) \\\n'
            if connector == "NixlConnector"
            else ""
        )
        across = f"{MULTINODE_ARGS} " if instances_across_nodes(config, dpn) else ""
        tail = (
            f'--port $((PORT + SERVER_PORT[k])) "${{args[@]}}" --kv-transfer-config "${{SERVER_KV[$k]}}" {across}"$@" &'
        )
        if accelerator == "cpu":
            single = prefill_tp * param(config, "pp") == 1 and param(config, "tp") * param(config, "pp") == 1
            bind = f'    {CPU_BIND_ENV}="${{SERVER_DEVICES[$k]}}" \\\n' if single else ""
            serve = (
                f"{nixl}{bind}"
                '    "${PYTHON:-python}" -m vllm.entrypoints.openai.api_server --model "$MODEL" \\\n'
                f'        --host "$HOST" {tail}'
            )
        else:
            serve = (
                f"{nixl}"
                f'    {DEVICE_ENV.get(accelerator, "CUDA_VISIBLE_DEVICES")}="${{SERVER_DEVICES[$k]}}" \\\n'
                f'        vllm serve "$MODEL" --host "$HOST" {tail}'
            )
        lines += disaggregated_lines(config, accelerator, dpn, prefill_args, decode_args, bash_array, serve)
        return "\n".join(lines) + "\n"
