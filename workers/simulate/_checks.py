"""Which configs can run at all: the structural rules of Megatron-style parallelism, with a
reason a person can act on for the first rule a config breaks. Also derives dp and grad_accum
where the caller left them out (-1), so the rules and the model see the same numbers.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..parameters import (
    data_parallel,
    first_stage_split_divides,
    grad_accum,
    instance_splits_a_node,
    pd_nodes,
    kv_connector_rules,
    mooncake_ascend_broken,
    prefill_tp_or_tp,
    sequence_parallel_on,
)
from ._columns import KV_CONNECTOR_CODES, fill_defaults
from ._common import Shape


def world_size(cluster: Mapping[str, Any]) -> int:
    world = cluster.get("world_size")
    if not world:
        world = int(cluster.get("nodes", 1) or 1) * int(cluster.get("devices_per_node", 1) or 1)
    return int(world)


def _is_int(x: np.ndarray) -> np.ndarray:
    return np.isfinite(x) & (np.abs(x - np.round(x)) < 1e-9)


def train_checks(s: Shape, workload: Mapping[str, Any], c: dict, world: int) -> list[tuple[str, np.ndarray]]:
    """(reason, mask of configs it rules out), in the order a person would fix them."""
    seq = int(workload["seq_len"])
    gbs = int(workload["global_batch_size"])
    t, p, cp, v, d = c["tp"], c["pp"], c["cp"], c["vpp"], c["dp"]
    m, b = c["grad_accum"], c["micro_batch_size"]
    positive = [(k, c[k]) for k in ("tp", "pp", "cp", "vpp", "dp", "micro_batch_size", "grad_accum")]
    bad_int = np.zeros(t.shape, bool)
    for _, x in positive:
        bad_int |= ~_is_int(x) | (x < 1)
    flash = bool(workload.get("flash_attention", True))
    first = c["first_stage_layers"]
    uneven = (first > 0) & (p > 1)  # FIRST_STAGE_RULE
    tpc = np.maximum(t * p * cp, 1e-9)
    bd = np.maximum(b * d, 1e-9)
    return [
        (
            f"world_size {world} is not divisible by tp*pp*cp = {{tpc}}",
            np.abs(world / tpc - np.round(world / tpc)) > 1e-9,
        ),
        (f"tp*pp*cp*dp = {{prod}} does not equal world_size {world}", np.abs(t * p * cp * d - world) > 1e-9),
        (
            f"global_batch_size {gbs} is not divisible by micro_batch_size*dp = {{bd}}",
            np.abs(gbs / bd - np.round(gbs / bd)) > 1e-9,
        ),
        (f"global_batch_size {gbs} != micro_batch_size*dp*grad_accum = {{gbs}}", np.abs(b * d * m - gbs) > 1e-9),
        (
            "parallel sizes, micro_batch_size and grad_accum must be positive integers (tp={tp}, pp={pp}, "
            "cp={cp}, vpp={vpp}, dp={dp}, micro_batch_size={micro_batch_size}, grad_accum={grad_accum})",
            bad_int,
        ),
        (f"num_attention_heads {s.heads} is not divisible by tp={{tp}}", s.heads % np.maximum(t, 1) != 0),
        (f"num_key_value_heads {s.kv_heads} is not divisible by tp={{tp}}", s.kv_heads % np.maximum(t, 1) != 0),
        (f"intermediate_size {int(s.ffn)} is not divisible by tp={{tp}}", s.ffn % np.maximum(t, 1) != 0),
        (
            f"num_hidden_layers {s.layers} is not divisible by pp*vpp={{ppv}}",
            ~uneven & (s.layers % np.maximum(p * v, 1) != 0),
        ),
        (
            "first_stage_layers={first_stage_layers} needs pp > 1 and vpp = 1 (pp={pp}, vpp={vpp})",
            (first > 0) & ((p <= 1) | (v > 1)),
        ),
        (
            f"the num_hidden_layers {s.layers} less first_stage_layers={{first_stage_layers}} do not split "
            "evenly over the other pp-1 stages (pp={pp})",
            uneven & ~first_stage_split_divides(s.layers, p, first),
        ),
        ("vpp={vpp} (interleaved 1F1B) needs pp > 1", (v > 1) & (p <= 1)),
        (
            "the interleaved schedule needs grad_accum={grad_accum} divisible by pp={pp}",
            (v > 1) & (m % np.maximum(p, 1) != 0),
        ),
        (
            f"seq_len {seq} is not divisible by 2*cp={{cp2}} (load-balanced context parallel)",
            (cp > 1) & (seq % np.maximum(2 * cp, 1) != 0),
        ),
        ("context parallel (cp={cp}) needs flash attention", (cp > 1) & (not flash)),
        (
            "seq_len/cp is not divisible by tp={tp} with sequence parallel",
            c["sp"] & ((seq / np.maximum(cp, 1)) % np.maximum(t, 1) != 0),
        ),
        ("zero_stage must be 0..3, got {zero_stage}", (c["zero_stage"] < 0) | (c["zero_stage"] > 3)),
        ("recompute code {recompute} unknown", (c["recompute"] < 0) | (c["recompute"] > 2)),
        ("precision code {precision} unknown", (c["precision"] < 0) | (c["precision"] > 2)),
    ]


def infer_checks(s: Shape, c: dict, world: int) -> list[tuple[str, np.ndarray]]:
    t, p = c["tp"], c["pp"]
    return [
        ("tp and pp must be positive integers (tp={tp}, pp={pp})", ~_is_int(t) | ~_is_int(p) | (t < 1) | (p < 1)),
        ("tp*pp = {tp_pp} does not divide world_size " + str(world), world % np.maximum(t * p, 1) != 0),
        (  # 0: priced at each of the workload's batch sizes
            "batch_size must be a positive integer, got {batch_size}",
            ~_is_int(c["batch_size"]) | (c["batch_size"] < 0),
        ),
        (f"num_attention_heads {s.heads} is not divisible by tp={{tp}}", s.heads % np.maximum(t, 1) != 0),
        (
            f"num_key_value_heads {s.kv_heads} and tp={{tp}}: neither divides the other",
            (s.kv_heads % np.maximum(t, 1) != 0) & (np.maximum(t, 1) % s.kv_heads != 0),
        ),
        (f"num_hidden_layers {s.layers} is not divisible by pp={{pp}}", s.layers % np.maximum(p, 1) != 0),
    ]


def max_model_len(workload: Mapping[str, Any]) -> int:
    """The serving workload's ``max_model_len``; absent, the longest prompt plus the longest output
    the traffic sends (what the spec resolves it to)."""
    if workload.get("max_model_len"):
        return int(workload["max_model_len"])
    traffic = workload.get("traffic") or {}
    pairs = traffic.get("length_pairs")
    if pairs:
        return int(max(int(a) + int(b) for a, b in pairs))

    def top(x: Any) -> int:
        return int(x["high"]) if isinstance(x, Mapping) else int(x)

    return top(traffic.get("prompt_len", 512)) + top(traffic.get("output_len", 128))


def serve_checks(
    s: Shape, model: Mapping[str, Any], workload: Mapping[str, Any], c: dict, cluster: Mapping[str, Any]
) -> list[tuple[str, np.ndarray]]:
    """What the serving engine refuses at start-up, before it loads anything (vLLM 0.32's own
    rules where it has one). ``max_num_batched_tokens >= max_num_seqs`` and, without chunked
    prefill, ``max_num_batched_tokens >= max_model_len``: ``SchedulerConfig.verify_max_model_len``
    in ``vllm/config/scheduler.py`` raises both. Heads must split evenly over tp (vLLM's
    ``ModelConfig.verify_with_parallel_config``; K/V heads are replicated when tp exceeds them),
    layers over pp as the search space requires (vLLM itself tolerates an uneven split), and a
    trial's replicas*tp*pp devices sit on one node behind one load balancer, or, for an instance wider
    than a node, on whole nodes of the cluster (``INSTANCE_NODES_RULE``)."""
    t, p, r = c["tp"], c["pp"], c["replicas"]
    pr = c["prefill_replicas"]
    disagg = pr > 0
    tpp = np.maximum(prefill_tp_or_tp(c["prefill_tp"], t), 1)  # the prefill instances' tp
    mns, mbt, bs = c["max_num_seqs"], c["max_num_batched_tokens"], c["block_size"]
    mml = max_model_len(workload)
    dpn = int(cluster.get("devices_per_node") or cluster.get("world_size") or 1)
    world = world_size(cluster)
    nodes = max(world // dpn, 1)
    accel = str(cluster.get("accelerator", "cuda"))
    bad_int = np.zeros(t.shape, bool)
    for x in (t, p, r, mns, mbt):
        bad_int |= ~_is_int(x) | (x < 1)
    bad_int |= ~_is_int(bs) | (bs < 0)
    util = c["memory_utilization"]
    checks = [
        (
            "tp, pp, replicas, max_num_seqs and max_num_batched_tokens must be positive integers (tp={tp}, pp={pp}, "
            "replicas={replicas}, max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}, "
            "block_size={block_size})",
            bad_int,
        ),
        (
            "prefill_replicas and prefill_tp must be integers >= 0 (prefill_replicas={prefill_replicas}, "
            "prefill_tp={prefill_tp})",
            ~_is_int(pr) | (pr < 0) | ~_is_int(c["prefill_tp"]) | (c["prefill_tp"] < 0),
        ),
        (
            f"replicas*tp*pp = {{rtp}} devices exceed the {dpn} devices of a node",
            ~disagg & (t * p <= dpn) & (r * t * p > dpn),
        ),
        (
            f"an instance wider than a node takes whole nodes: tp*pp = {{tp}}*{{pp}} is not a multiple of the {dpn} "
            "devices of a node",
            ~disagg & instance_splits_a_node(t * p, dpn),
        ),
        (
            f"replicas*tp*pp = {{rtp}} devices exceed the cluster's {world}",
            ~disagg & (t * p > dpn) & (r * t * p > world),
        ),
        (
            f"a disaggregated deployment's replicas*tp*pp + prefill_replicas*prefill_tp*pp = {{rtp}} devices exceed "
            f"the cluster's {world}",
            disagg & (c["world"] > world),
        ),
        (
            f"an instance wider than a node takes whole nodes: tp*pp or prefill_tp*pp is not a multiple of the {dpn} "
            "devices of a node (tp={tp}, prefill_tp={prefill_tp}, pp={pp})",
            disagg & (instance_splits_a_node(t * p, dpn) | instance_splits_a_node(tpp * p, dpn)),
        ),
        (
            f"the pools' instances take more nodes than the cluster's {nodes}, placed first-fit, prefill first, an "
            "instance wider than a node on whole nodes of its own",
            disagg & (pd_nodes(np.where(disagg, pr, 0), tpp * p, r, t * p, dpn) > nodes),
        ),
        (f"num_attention_heads {s.heads} is not divisible by prefill_tp={{prefill_tp}}", disagg & (s.heads % tpp != 0)),
        (
            f"num_key_value_heads {s.kv_heads} and prefill_tp={{prefill_tp}}: neither divides the other",
            disagg & (s.kv_heads % tpp != 0) & (tpp % s.kv_heads != 0),
        ),
        (
            "kv_connector code {kv_connector} unknown",
            (c["kv_connector"] < 0) | (c["kv_connector"] >= len(KV_CONNECTOR_CODES)),
        ),
        *connector_checks(c["kv_connector"], disagg, accel, t, tpp, p),
        (f"num_attention_heads {s.heads} is not divisible by tp={{tp}}", s.heads % np.maximum(t, 1) != 0),
        (
            f"num_key_value_heads {s.kv_heads} and tp={{tp}}: neither divides the other",
            (s.kv_heads % np.maximum(t, 1) != 0) & (np.maximum(t, 1) % s.kv_heads != 0),
        ),
        (f"num_hidden_layers {s.layers} is not divisible by pp={{pp}}", s.layers % np.maximum(p, 1) != 0),
        (
            "max_num_batched_tokens ({max_num_batched_tokens}) must be greater than or equal to max_num_seqs "
            "({max_num_seqs})",
            mbt < mns,
        ),
        (
            f"max_num_batched_tokens ({{max_num_batched_tokens}}) is smaller than max_model_len ({mml}) without "
            "chunked prefill",
            ~c["enable_chunked_prefill"] & (mbt < mml),
        ),
        ("memory_utilization must be in (0, 1], got {memory_utilization}", ~((util > 0) & (util <= 1))),
        ("graph_mode code {graph_mode} unknown", (c["graph_mode"] < 0) | (c["graph_mode"] > 2)),
        (
            f"graph_mode torchair is vLLM-Ascend's graph mode; the accelerator here is {accel}",
            (c["graph_mode"] == 2) & (accel != "npu"),
        ),
        ("kv_cache_dtype code {kv_cache_dtype} unknown", (c["kv_cache_dtype"] < 0) | (c["kv_cache_dtype"] > 4)),
        ("quantization code {quantization} unknown", (c["quantization"] < 0) | (c["quantization"] > 3)),
        ("precision code {precision} unknown", (c["precision"] < 0) | (c["precision"] > 2)),
    ]
    if model.get("max_position_embeddings"):
        limit = int(model["max_position_embeddings"])
        checks.append(
            (f"max_model_len {mml} exceeds the model's max_position_embeddings {limit}", np.full(t.shape, mml > limit))
        )
    return checks


def connector_checks(
    codes: np.ndarray, disagg: np.ndarray, accel: str, tp: np.ndarray, prefill_tp: np.ndarray, pp: np.ndarray
) -> list[tuple[str, np.ndarray]]:
    """A disaggregated deployment's KV connector must run on the accelerator, with its own rules
    there (:func:`~autotune.workers.parameters.kv_connector_rules`)."""
    checks = []
    for name, code in KV_CONNECTOR_CODES.items():
        refusal, rule = kv_connector_rules(name, accel)
        if refusal:
            checks.append((refusal, disagg & (codes == code)))
        elif rule:
            checks.append(
                (
                    f"{rule} (prefill_tp={{prefill_tp}}, tp={{tp}}, pp={{pp}})",
                    disagg & (codes == code) & mooncake_ascend_broken(prefill_tp, tp, pp),
                )
            )
    return checks


def sanitize(c: dict, valid: np.ndarray, names: tuple[str, ...]) -> None:
    """Replace the sizes of invalid configs by 1 so the formulas stay finite (their outputs are
    masked afterwards)."""
    for k in names:
        c[k] = np.where(valid, c[k], 1.0)


def prepare(
    model: Mapping[str, Any], workload: Mapping[str, Any], cluster: Mapping[str, Any], configs: Mapping[str, Any]
):
    """Shape, columns with derived dp / grad_accum, world size and the validity checks."""
    s = Shape.of(model)
    c, n = fill_defaults(dict(configs))
    world = world_size(cluster)
    c["world"] = np.full(n, float(world))
    kind = str(workload.get("kind", "train"))
    if kind == "serve":  # a serving trial occupies its own replicas*tp*pp (+ its prefill pool's) devices
        prefill_tp = prefill_tp_or_tp(c["prefill_tp"], c["tp"])
        c["world"] = (c["replicas"] * c["tp"] + c["prefill_replicas"] * prefill_tp) * c["pp"]
        return s, c, world, serve_checks(s, model, workload, c, cluster)
    if kind == "infer":
        return s, c, world, infer_checks(s, c, world)
    t, p, cp = c["tp"], c["pp"], c["cp"]
    c["dp"] = np.where(c["dp"] < 0, data_parallel(world, t, p, cp), c["dp"])
    gbs = float(workload["global_batch_size"])
    c["grad_accum"] = np.where(c["grad_accum"] < 0, grad_accum(gbs, c["micro_batch_size"], c["dp"]), c["grad_accum"])
    c["sp"] = sequence_parallel_on(c["sequence_parallel"], c["tp"])  # Megatron turns SP off at tp = 1
    return s, c, world, train_checks(s, workload, c, world)


def row_reason(checks: list[tuple[str, np.ndarray]], c: dict) -> str:
    values = {
        k: (int(v[0]) if np.isfinite(v[0]) and float(v[0]).is_integer() else float(v[0]))
        for k, v in c.items()
        if isinstance(v, np.ndarray) and v.size and v.dtype.kind in "fiub"
    }
    values.update(
        prod=_fmt(c["tp"][0] * c["pp"][0] * c.get("cp", np.ones(1))[0] * c.get("dp", np.ones(1))[0]),
        gbs=_fmt(c["micro_batch_size"][0] * c.get("dp", np.ones(1))[0] * c.get("grad_accum", np.ones(1))[0]),
        ppv=_fmt(c["pp"][0] * c["vpp"][0]),
        cp2=_fmt(2 * c["cp"][0]),
        tp_pp=_fmt(c["tp"][0] * c["pp"][0]),
        rtp=_fmt(c["world"][0]),  # a serving trial's devices (prepare)
        tpc=_fmt(c["tp"][0] * c["pp"][0] * c.get("cp", np.ones(1))[0]),
        bd=_fmt(c["micro_batch_size"][0] * c.get("dp", np.ones(1))[0]),
    )
    for template, mask in checks:
        if bool(mask[0]):
            return template.format(**values)
    return "invalid configuration"


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
