"""A synthetic "true world" for the search benchmark, and the launcher that measures in it.

A world is the analytical simulator with hidden perturbations drawn from a seed: hardware
efficiencies and bandwidths (GEMM, flash attention, memory bandwidth, all-reduce, all-gather,
inter-node, latencies), extra factors on single time components (recompute, pipeline bubble,
optimizer, TP/DP/PP communication), fragmentation, runtime reserve and activation memory,
per-value effects the model does not price at all (a micro-batch size whose kernels run
slower, an allocator setting), and measurement noise. The simulator the search uses knows none
of it: against the nominal model a world is off by 10-40 % in places, like a real machine.

    python benchmarks/true_world.py TRIAL_FILE      (with AUTOTUNE_BENCH_WORLD=world.json)

is a user's launcher for the ``command`` backend: it reads the trial file, "runs" the config in
the world, and prints the probe protocol's lines — a metrics line, or an OOM failure in the
words a real allocator uses (so autotune's classifier, not a shortcut, sees it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HW_FACTORS = {  # multiplicative ranges on profile fields
    "gemm_efficiency": (0.75, 1.12),
    "flash_attention_efficiency": (0.6, 1.4),
    "memory_bandwidth_efficiency": (0.7, 1.3),
    "allreduce_efficiency": (0.5, 1.4),
    "allgather_efficiency": (0.5, 1.3),
    "inter_node_efficiency": (0.5, 1.2),
    "collective_latency_us": (0.5, 3.0),
    "kernel_launch_us": (0.5, 2.0),
}
HW_VALUES = {  # absolute ranges
    "comm_overlap_slowdown": (0.0, 0.3),
    "fragmentation_default": (0.05, 0.25),
    "fragmentation_expandable": (0.0, 0.08),
    "runtime_reserve_gib": (2.5, 6.0),
}
TIME_FACTORS = {
    "recompute": (0.7, 1.5),
    "pp_bubble": (0.8, 1.6),
    "optimizer": (0.5, 2.0),
    "tp_comm": (0.7, 1.6),
    "dp_comm": (0.7, 1.5),
    "pp_p2p": (0.5, 2.0),
    "zero3_comm": (0.7, 1.6),
}
MEM_FACTORS = {"activations": (0.9, 1.25), "comm_buffers": (0.5, 2.0), "logits": (0.9, 1.3)}
VALUE_EFFECTS = {"micro_batch_size": (0.92, 1.08), "env.PYTORCH_NPU_ALLOC_CONF": (0.97, 1.03), "vpp": (0.95, 1.05)}
NOISE = 0.02  # relative sd of a measured step time (a median of steps, not one step)

# Memory that behaves unlike the simulator's structure, not only with other coefficients (issue #12):
# each family adds a term the analytical model does not have, with a strength drawn per world.
STRUCTURE_FAMILIES = {
    # a second, unsharded fp32 gradient buffer (DDP-style buckets) whenever gradients are not sharded
    "fp32-grads": (0.6, 1.0),
    # fragmentation that depends on the allocator setting *and* grows with the micro-batch (larger
    # blocks fragment more), as a share of the dynamic memory
    "alloc-frag": (0.10, 0.22),
    # usable HBM below nominal (runtime, HCCL): a constant GiB off the capacity, plus a buffer per
    # communicator the rank belongs to
    "usable-below": (3.0, 7.0),
    # the first pipeline stage keeps fp32 copies of the embedding and its gradient unsharded
    "stage-imbalance": (1.0, 2.0),
    # an activation term not reduced by tensor or sequence parallelism (masks, rotary caches, the
    # recomputation's own buffers): bytes per token per layer, times the micro-batches in flight
    "act-extra": (6.0, 14.0),
    # the probe reports what torch's caching allocator saw (max_memory_allocated, as Megatron-LM's
    # and DeepSpeed's logs and autotune's own probes on a device do): its peak leaves out the
    # allocator's fragmentation, the runtime's context and the communication buffers, which the
    # device still holds; the memory itself is the simulator's (strength: unused)
    "allocator-peak": (1.0, 1.0),
    # not memory: a family of layouts runs this much slower than its components say, every config
    # of it alike (a stack whose pipeline schedule or unsharded-optimizer step overlaps worse than
    # the model assumes: issue #35's world where the pipelined ZeRO-1 configs ran 1.35x slower than
    # predicted and ZeRO-3 with full recompute won); which family, from the seed (SLOW_GROUPS)
    "family-slow": (1.25, 1.5),
}
# the layout families "family-slow" may slow down: pipelined with unsharded optimizer states, any
# unsharded optimizer, any pipeline
SLOW_GROUPS = {
    "pp>1,zero<=1": lambda c: int(c.get("pp") or 1) > 1 and int(c.get("zero_stage") or 0) <= 1,
    "zero<=1": lambda c: int(c.get("zero_stage") or 0) <= 1,
    "pp>1": lambda c: int(c.get("pp") or 1) > 1,
}


@dataclass
class World:
    seed: int
    hardware: dict[str, Any]
    time_factors: dict[str, float]
    mem_factors: dict[str, float]
    value_effects: dict[str, dict[str, float]] = field(default_factory=dict)
    structure: dict[str, float] = field(default_factory=dict)  # family -> strength (STRUCTURE_FAMILIES)

    @classmethod
    def draw(
        cls, seed: int, hardware: dict[str, Any], space: dict[str, list[Any]], families: tuple[str, ...] = ()
    ) -> "World":
        """A world; ``families`` adds memory terms of those structural families (strength drawn
        from the seed), on top of the coefficient perturbations every world has."""
        world = cls._draw(seed, hardware, space)
        rng = np.random.default_rng([seed, 7])
        world.structure = {f: float(rng.uniform(*STRUCTURE_FAMILIES[f])) for f in families}
        return world

    @classmethod
    def _draw(cls, seed: int, hardware: dict[str, Any], space: dict[str, list[Any]]) -> "World":
        rng = np.random.default_rng(seed)
        hw = dict(hardware)
        for key, (lo, hi) in HW_FACTORS.items():
            if key in hw:
                hw[key] = float(hw[key]) * float(rng.uniform(lo, hi))
        for key, (lo, hi) in HW_VALUES.items():
            if key in hw:
                hw[key] = float(rng.uniform(lo, hi))
        effects = {
            name: {repr(v): float(rng.uniform(*VALUE_EFFECTS[name])) for v in space[name]}
            for name in VALUE_EFFECTS
            if name in space
        }
        return cls(
            seed,
            hw,
            {k: float(rng.uniform(*r)) for k, r in TIME_FACTORS.items()},
            {k: float(rng.uniform(*r)) for k, r in MEM_FACTORS.items()},
            effects,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "hardware": self.hardware,
            "time_factors": self.time_factors,
            "mem_factors": self.mem_factors,
            "value_effects": self.value_effects,
            "structure": self.structure,
        }

    def structural_memory(
        self, model: dict, workload: dict, configs: list[dict[str, Any]], p: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(extra GiB per config, usable capacity lost in GiB per config) of the world's structural
        families; zeros without any."""
        n = len(configs)
        extra, lost = np.zeros(n), np.zeros(n)
        col = {
            k: np.array([c.get(k, d) for c in configs])
            for k, d in (("zero_stage", 0), ("micro_batch_size", 1), ("tp", 1), ("pp", 1), ("dp", 1), ("cp", 1))
        }
        mem = lambda k: np.nan_to_num(np.asarray(p[f"mem_{k}"], dtype=float))  # noqa: E731
        for family, strength in self.structure.items():
            if family == "fp32-grads":
                # an unsharded fp32 copy of the gradients: grads of a bf16/fp16 Megatron-style model are
                # priced at 4 (or 2) bytes; the copy is 4 bytes per parameter
                extra += np.where(col["zero_stage"] < 2, strength * mem("weights") * 2.0, 0.0)
            elif family == "alloc-frag":
                alloc = np.array([str(c.get("env.PYTORCH_NPU_ALLOC_CONF", "")) for c in configs])
                base = np.where(
                    np.char.find(alloc, "expandable_segments:True") >= 0,
                    0.25,
                    np.where(np.char.find(alloc, "max_split") >= 0, 0.6, 1.0),
                )
                dynamic = mem("activations") + mem("logits") + mem("zero3_gather")
                extra += strength * base * np.log2(2.0 * col["micro_batch_size"]) * dynamic
            elif family == "usable-below":
                groups = ((col["tp"] > 1) + (col["dp"] > 1) + 2 * (col["pp"] > 1) + (col["cp"] > 1)).astype(float)
                buf = np.array([float(c.get("env.HCCL_BUFFSIZE", 200)) for c in configs]) / 1024.0
                lost += strength + groups * 2.0 * buf
            elif family == "stage-imbalance":
                embed = float(model["vocab_size"]) * float(model["hidden_size"]) / col["tp"]
                extra += np.where(col["pp"] > 1, strength * embed * 8.0 / 2**30, 0.0)
            elif family == "act-extra":
                layers = float(model["num_hidden_layers"]) / col["pp"]
                tokens = float(workload["seq_len"]) / col["cp"] * col["micro_batch_size"]
                inflight = np.minimum(col["pp"], 4)  # micro-batches a first stage holds, roughly
                extra += strength * float(model["hidden_size"]) * tokens * layers * inflight / 2**30
        return extra, lost

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "World":
        return cls(**data)

    def truth(self, model: dict, workload: dict, cluster: dict, configs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        """Noise-free step time, peak memory and whether it fits, for many configs at once."""
        from autotune.workers.simulate import (
            TRAIN_MEM_COMPONENTS,
            TRAIN_TIME_COMPONENTS,
            columns_from_params,
            simulate_configs,
        )

        p = simulate_configs(model, workload, self.hardware, cluster, columns_from_params(configs))
        step = sum(np.nan_to_num(p[f"time_{k}"]) * self.time_factors.get(k, 1.0) for k in TRAIN_TIME_COMPONENTS)
        for name, effects in self.value_effects.items():
            step = step * np.array([effects.get(repr(c.get(name)), 1.0) for c in configs])
        if "family-slow" in self.structure:
            group = SLOW_GROUPS[sorted(SLOW_GROUPS)[self.seed % len(SLOW_GROUPS)]]
            step = step * np.array([self.structure["family-slow"] if group(c) else 1.0 for c in configs])
        part = {k: np.nan_to_num(p[f"mem_{k}"]) * self.mem_factors.get(k, 1.0) for k in TRAIN_MEM_COMPONENTS}
        mem = sum(part.values())
        outside = part["fragmentation"] + part["comm_buffers"] + part["runtime_reserve"]
        extra, lost = self.structural_memory(model, workload, configs, p)
        mem = mem + extra
        valid = np.asarray(p["valid"], dtype=bool)
        limit = np.asarray(p["memory_limit_gib"], dtype=float) - lost
        world = np.asarray(p["tokens_per_s"] / p["tokens_per_s_per_device"], dtype=float)
        tokens = float(workload["global_batch_size"]) * float(workload["seq_len"])
        return {
            "step_time_s": np.where(valid, step, np.nan),
            "peak_memory_gib": np.where(valid, mem, np.nan),
            "fits": valid & (mem <= limit),
            "valid": valid,
            "devices": world,
            "tokens_per_s_per_device": np.where(valid, tokens / step / world, np.nan),
            "limit": limit,
            "capacity": np.asarray(p["memory_limit_gib"], dtype=float),
            "outside_allocator_gib": np.where(valid, outside, np.nan),
        }

    def measure(
        self, model: dict, workload: dict, cluster: dict, config: dict[str, Any], run: int = 0
    ) -> dict[str, Any]:
        """One probe: the truth plus noise. The noise is fixed by world, config and ``run`` (the
        trial number): a repeated benchmark sees the same numbers, a re-measurement new noise."""
        t = self.truth(model, workload, cluster, [config])
        if not t["valid"][0]:
            return {"failure": "invalid"}
        if not t["fits"][0]:
            # an allocation partway through the step fails: in use + requested lies between the usable
            # limit and the whole need (a lower bound of it, as in a real allocator message)
            rng = np.random.default_rng([self.seed, run, 99])
            need, usable, capacity = float(t["peak_memory_gib"][0]), float(t["limit"][0]), float(t["capacity"][0])
            in_use = usable - float(rng.uniform(0.1, 0.6))
            requested = max(0.05, float(rng.uniform(0.3, 1.0)) * (need - in_use))
            # the allocator's own counts leave out what is outside it; "free" is the device's
            outside = float(t["outside_allocator_gib"][0]) if "allocator-peak" in self.structure else 0.0
            return {
                "failure": "oom",
                "need": need,
                "limit": usable,
                "capacity": capacity,
                "in_use": in_use,
                "requested": requested,
                "allocated": in_use - outside,
            }
        key = json.dumps(config, sort_keys=True, default=str)
        rng = np.random.default_rng([self.seed, int(hashlib.sha256(key.encode()).hexdigest()[:8], 16), run])
        noise = float(np.clip(rng.normal(1.0, NOISE), 0.9, 1.1))
        step = float(t["step_time_s"][0]) * noise
        tps_dev = float(t["tokens_per_s_per_device"][0]) / noise
        peak = float(t["peak_memory_gib"][0]) * float(rng.uniform(0.99, 1.01))
        out: dict[str, Any] = {
            "metrics": {
                "step_time_s": step,
                "tokens_per_s_per_device": tps_dev,
                "tokens_per_s": tps_dev * float(t["devices"][0]),
                "peak_memory_gib": peak,
            }
        }
        if "allocator-peak" in self.structure:
            out["metrics"]["peak_memory_gib"] = peak - float(t["outside_allocator_gib"][0])
            out["info"] = {"peak_memory_counts": "allocated"}
        return out


def oom_message(out: dict[str, Any]) -> str:
    """torch_npu's words and byte counts for a failed allocation."""
    free = max(0.0, out["capacity"] - out["in_use"])
    allocated = out.get("allocated", out["in_use"])
    return (
        f"RuntimeError: NPU out of memory. Tried to allocate {out['requested']:.2f} GiB (NPU 0; "
        f"{out['capacity']:.2f} GiB total capacity; {allocated:.2f} GiB already allocated; "
        f"{allocated:.2f} GiB current active; {free:.2f} GiB free; {allocated:.2f} GiB reserved in "
        f"total by PyTorch)"
    )


def main(argv: list[str]) -> int:
    trial = json.loads(open(argv[0]).read())
    world = World.from_json(json.loads(open(os.environ["AUTOTUNE_BENCH_WORLD"]).read()))
    out = world.measure(
        trial["model"], trial["workload"], trial["cluster"], trial["params"], int(trial.get("number", 0))
    )
    if out.get("failure") == "oom":
        print(oom_message(out), flush=True)
        return 1
    if out.get("failure"):
        print(json.dumps({"event": "failure", "status": "invalid", "reason": "not a valid config"}), flush=True)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
