"""Canonical trial params (docs/ARCHITECTURE.md names) as numeric columns, one entry per config.

The simulator works on columns so a whole sampled population (or a grid of 100k configs) is
priced in one vectorised pass. Categorical params get small integer codes; environment strings
are parsed once per distinct value (there are only a handful in any study).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from ..alloc_conf import parse_alloc_conf, truthy as _truthy
from ..parameters import default as table_default, serving_default, serving_parameter

__all__ = [
    "RECOMPUTE_CODES",
    "PRECISION_CODES",
    "QUANT_CODES",
    "COMPILE_CODES",
    "GRAPH_MODE_CODES",
    "KV_DTYPE_CODES",
    "KV_CONNECTOR_CODES",
    "columns_from_params",
    "fill_defaults",
]

RECOMPUTE_CODES = {"none": 0, "selective": 1, "full": 2}
PRECISION_CODES = {"bf16": 0, "fp16": 1, "fp32": 2}
QUANT_CODES = {"none": 0, "int8": 1, "w8a8": 2, "int4": 3}
COMPILE_CODES = {"none": 0, "default": 1, "reduce-overhead": 1, "max-autotune": 2}
KV_BYTES = {"bf16": 2.0, "fp16": 2.0, "auto": 2.0, "fp8": 1.0, "int8": 1.0}
# Serving: eager (vLLM --enforce-eager), the engine's graph capture (CUDA graphs / vLLM-Ascend
# aclgraph), vLLM-Ascend's torchair graph. kv_cache_dtype 'auto' (code 0) = the compute dtype.
GRAPH_MODE_CODES = {"eager": 0, "graph": 1, "torchair": 2}
KV_DTYPE_CODES = {"auto": 0, "bf16": 1, "fp16": 2, "fp8": 3, "int8": 4}
# disaggregated serving's KV connector, in the parameter table's order (auto: the accelerator's own)
KV_CONNECTOR_CODES = {name: i for i, name in enumerate(serving_parameter("kv_connector").allowed)}

# column -> default: the parameter table's (autotune.workers.parameters; the study's, accelerator None),
# categorical ones as their codes (dp and grad_accum: -1 = derive from the cluster and the workload;
# recompute_layers: -1 = every layer of the stage; first_stage_layers: -1 = an even split; batch_size: 0 =
# training workload)
DEFAULTS: dict[str, Any] = {
    **{name: table_default(name) for name in ("tp", "pp")},
    "dp": -1,
    **{name: table_default(name) for name in ("cp", "vpp", "micro_batch_size")},
    "first_stage_layers": -1 if table_default("first_stage_layers") is None else table_default("first_stage_layers"),
    "grad_accum": -1,
    "sequence_parallel": table_default("sequence_parallel"),
    "recompute": RECOMPUTE_CODES[table_default("recompute")],
    "recompute_layers": -1 if table_default("recompute_layers") is None else table_default("recompute_layers"),
    "zero_stage": table_default("zero_stage"),
    "precision": PRECISION_CODES[table_default("precision")],
    "alloc_expandable_segments": False,
    "alloc_max_split_size_mb": 0.0,
    "alloc_gc_threshold": 0.0,
    "hccl_buffsize_mb": 200.0,
    "multi_stream_memory_reuse": 1,
    "compile": COMPILE_CODES[table_default("compile")],
    "graph_kernel": bool(table_default("graph_kernel_flags")),
    "batch_size": 0,
    "kv_cache_bytes": KV_BYTES[serving_default("kv_cache_dtype")],
    "quantization": QUANT_CODES[serving_default("quantization")],
    # serving (issue #33; block_size 0 = the engine's default on the accelerator, resolved where it is
    # known: workers.parameters, "block_size")
    "replicas": serving_default("replicas"),
    "max_num_seqs": serving_default("max_num_seqs"),
    "max_num_batched_tokens": serving_default("max_num_batched_tokens"),
    "block_size": 0,
    "enable_chunked_prefill": serving_default("enable_chunked_prefill"),
    "enable_prefix_caching": serving_default("enable_prefix_caching"),
    "memory_utilization": serving_default("memory_utilization"),
    "graph_mode": GRAPH_MODE_CODES[serving_default("graph_mode")],
    "kv_cache_dtype": KV_DTYPE_CODES[serving_default("kv_cache_dtype")],
    # disaggregated serving (issue 46): prefill_replicas 0 = aggregated; prefill_tp 0 = the decode tp
    "prefill_replicas": serving_default("prefill_replicas"),
    "prefill_tp": serving_default("prefill_tp"),
    "kv_connector": KV_CONNECTOR_CODES[serving_default("kv_connector")],
}
_BOOL = {
    "sequence_parallel",
    "alloc_expandable_segments",
    "graph_kernel",
    "enable_chunked_prefill",
    "enable_prefix_caching",
}
_FLOAT = {"alloc_max_split_size_mb", "alloc_gc_threshold", "hccl_buffsize_mb", "kv_cache_bytes", "memory_utilization"}
_CODES = {
    "recompute": RECOMPUTE_CODES,
    "precision": PRECISION_CODES,
    "quantization": QUANT_CODES,
    "compile": COMPILE_CODES,
    "graph_mode": GRAPH_MODE_CODES,
    "kv_cache_dtype": KV_DTYPE_CODES,
    "kv_connector": KV_CONNECTOR_CODES,
}
_PLAIN = (
    "tp",
    "pp",
    "dp",
    "cp",
    "vpp",
    "first_stage_layers",
    "micro_batch_size",
    "grad_accum",
    "recompute_layers",
    "zero_stage",
    "batch_size",
    "replicas",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "prefill_replicas",
    "prefill_tp",
)


def _code(table: dict[str, int], value: Any, name: str) -> int:
    if value is None:  # the parameter table's default (graph_mode's is graph, code 1, not 0)
        return int(DEFAULTS[name])
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    key = str(value).lower()
    if key not in table:
        raise ValueError(f"{name}: unknown value {value!r}; expected one of {', '.join(table)}")
    return table[key]


def _row_env(p: dict[str, Any]) -> tuple[bool, float, float, float, int]:
    conf = p.get("env.PYTORCH_NPU_ALLOC_CONF")
    if conf is None:
        conf = p.get("env.PYTORCH_CUDA_ALLOC_CONF")
    exp, split, gc = parse_alloc_conf(str(conf)) if conf not in (None, "") else (False, 0.0, 0.0)
    buf = p.get("env.HCCL_BUFFSIZE")
    reuse = p.get("env.MULTI_STREAM_MEMORY_REUSE")
    return exp, split, gc, float(buf) if buf not in (None, "") else 200.0, int(reuse) if reuse not in (None, "") else 1


def columns_from_params(params_list: Iterable[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Canonical param dicts -> simulator columns, defaults filled (cp=1, vpp=1, no sequence
    parallel, no recompute, all layers when full recompute, ZeRO 0, bf16, env unset; serving: one
    replica, 256 sequences, 8192 batched tokens, the engine's block size, chunked prefill and
    prefix caching on, 0.9 of the device memory, graph capture, the compute dtype's KV cache)."""
    rows = list(params_list)
    cols: dict[str, np.ndarray] = {}
    for name in _PLAIN:
        default = DEFAULTS[name]
        cols[name] = np.array([default if (v := p.get(name)) is None else v for p in rows], dtype=np.int64)
    for name in ("sequence_parallel", "enable_chunked_prefill", "enable_prefix_caching"):
        default = DEFAULTS[name]
        cols[name] = np.array([default if (v := p.get(name)) is None else _truthy(v) for p in rows], dtype=bool)
    cols["memory_utilization"] = np.array(
        [DEFAULTS["memory_utilization"] if (v := p.get("memory_utilization")) is None else float(v) for p in rows],
        dtype=np.float64,
    )
    for name, table in _CODES.items():
        default = DEFAULTS[name]
        cols[name] = np.array(
            [default if (v := p.get(name)) is None else _code(table, v, name) for p in rows], dtype=np.int64
        )
    cols["graph_kernel"] = np.array([bool(p.get("graph_kernel_flags")) for p in rows], dtype=bool)
    kv = []
    for p in rows:
        value = p.get("kv_cache_dtype")
        key = serving_default("kv_cache_dtype") if value is None else str(value).lower()
        if key not in KV_BYTES:
            raise ValueError(f"kv_cache_dtype: unknown value {value!r}; expected one of {', '.join(KV_BYTES)}")
        kv.append(KV_BYTES[key])
    cols["kv_cache_bytes"] = np.array(kv, dtype=np.float64)
    env = [_row_env(p) for p in rows]
    if env:
        exp, split, gc, buf, reuse = zip(*env, strict=True)
    else:
        exp = split = gc = buf = reuse = ()
    cols["alloc_expandable_segments"] = np.array(exp, dtype=bool)
    cols["alloc_max_split_size_mb"] = np.array(split, dtype=np.float64)
    cols["alloc_gc_threshold"] = np.array(gc, dtype=np.float64)
    cols["hccl_buffsize_mb"] = np.array(buf, dtype=np.float64)
    cols["multi_stream_memory_reuse"] = np.array(reuse, dtype=np.int64)
    return cols


def fill_defaults(configs: dict[str, Any]) -> tuple[dict[str, np.ndarray], int]:
    """Columns given by the caller, completed with defaults, all as arrays of one length N."""
    given = {k: np.asarray(v) for k, v in configs.items()}
    if not given:
        raise ValueError("configs: no columns given")
    n = max(int(v.size) for v in given.values())
    bad = [k for k, v in given.items() if v.size not in (1, n)]
    if bad:
        raise ValueError(f"configs: columns of different lengths: {bad}")
    out: dict[str, np.ndarray] = {}
    for name, default in DEFAULTS.items():
        value = given.get(name)
        if value is None:
            value = np.full(n, default)
        elif value.dtype.kind in "OUS":  # strings: map through the code tables
            if name in _CODES:
                value = np.array([_code(_CODES[name], x, name) for x in value.ravel()])
            elif name in _BOOL:
                value = np.array([_truthy(x) for x in value.ravel()])
            else:  # a parameter left unset (None: recompute_layers, first_stage_layers) is its default
                value = np.array([default if x is None else x for x in value.ravel()])
        value = np.broadcast_to(value, (n,))
        if name in _BOOL:
            out[name] = value.astype(bool)
        elif name in _FLOAT:
            out[name] = value.astype(np.float64)
        else:
            out[name] = value.astype(np.float64)
    return out, n
