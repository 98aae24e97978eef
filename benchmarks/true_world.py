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
TIME_FACTORS = {"recompute": (0.7, 1.5), "pp_bubble": (0.8, 1.6), "optimizer": (0.5, 2.0), "tp_comm": (0.7, 1.6),
                "dp_comm": (0.7, 1.5), "pp_p2p": (0.5, 2.0), "zero3_comm": (0.7, 1.6)}
MEM_FACTORS = {"activations": (0.9, 1.25), "comm_buffers": (0.5, 2.0), "logits": (0.9, 1.3)}
VALUE_EFFECTS = {"micro_batch_size": (0.92, 1.08), "env.PYTORCH_NPU_ALLOC_CONF": (0.97, 1.03), "vpp": (0.95, 1.05)}
NOISE = 0.02  # relative sd of a measured step time (a median of steps, not one step)


@dataclass
class World:
    seed: int
    hardware: dict[str, Any]
    time_factors: dict[str, float]
    mem_factors: dict[str, float]
    value_effects: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def draw(cls, seed: int, hardware: dict[str, Any], space: dict[str, list[Any]]) -> "World":
        rng = np.random.default_rng(seed)
        hw = dict(hardware)
        for key, (lo, hi) in HW_FACTORS.items():
            if key in hw:
                hw[key] = float(hw[key]) * float(rng.uniform(lo, hi))
        for key, (lo, hi) in HW_VALUES.items():
            if key in hw:
                hw[key] = float(rng.uniform(lo, hi))
        effects = {name: {repr(v): float(rng.uniform(*VALUE_EFFECTS[name])) for v in space[name]}
                   for name in VALUE_EFFECTS if name in space}
        return cls(seed, hw, {k: float(rng.uniform(*r)) for k, r in TIME_FACTORS.items()},
                   {k: float(rng.uniform(*r)) for k, r in MEM_FACTORS.items()}, effects)

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "hardware": self.hardware, "time_factors": self.time_factors,
                "mem_factors": self.mem_factors, "value_effects": self.value_effects}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "World":
        return cls(**data)

    def truth(self, model: dict, workload: dict, cluster: dict, configs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        """Noise-free step time, peak memory and whether it fits, for many configs at once."""
        from autotune.workers.simulate import TRAIN_MEM_COMPONENTS, TRAIN_TIME_COMPONENTS, columns_from_params, \
            simulate_configs

        p = simulate_configs(model, workload, self.hardware, cluster, columns_from_params(configs))
        step = sum(np.nan_to_num(p[f"time_{k}"]) * self.time_factors.get(k, 1.0) for k in TRAIN_TIME_COMPONENTS)
        for name, effects in self.value_effects.items():
            step = step * np.array([effects.get(repr(c.get(name)), 1.0) for c in configs])
        mem = sum(np.nan_to_num(p[f"mem_{k}"]) * self.mem_factors.get(k, 1.0) for k in TRAIN_MEM_COMPONENTS)
        valid = np.asarray(p["valid"], dtype=bool)
        limit = np.asarray(p["memory_limit_gib"], dtype=float)
        world = np.asarray(p["tokens_per_s"] / p["tokens_per_s_per_device"], dtype=float)
        tokens = float(workload["global_batch_size"]) * float(workload["seq_len"])
        return {"step_time_s": np.where(valid, step, np.nan), "peak_memory_gib": np.where(valid, mem, np.nan),
                "fits": valid & (mem <= limit), "valid": valid, "devices": world,
                "tokens_per_s_per_device": np.where(valid, tokens / step / world, np.nan), "limit": limit}

    def measure(self, model: dict, workload: dict, cluster: dict, config: dict[str, Any], run: int = 0) -> dict[str, Any]:
        """One probe: the truth plus noise. The noise is fixed by world, config and ``run`` (the
        trial number): a repeated benchmark sees the same numbers, a re-measurement new noise."""
        t = self.truth(model, workload, cluster, [config])
        if not t["valid"][0]:
            return {"failure": "invalid"}
        if not t["fits"][0]:
            return {"failure": "oom", "need": float(t["peak_memory_gib"][0]), "limit": float(t["limit"][0])}
        key = json.dumps(config, sort_keys=True, default=str)
        rng = np.random.default_rng([self.seed, int(hashlib.sha256(key.encode()).hexdigest()[:8], 16), run])
        noise = float(np.clip(rng.normal(1.0, NOISE), 0.9, 1.1))
        step = float(t["step_time_s"][0]) * noise
        tps_dev = float(t["tokens_per_s_per_device"][0]) / noise
        return {"metrics": {"step_time_s": step, "tokens_per_s_per_device": tps_dev,
                            "tokens_per_s": tps_dev * float(t["devices"][0]),
                            "peak_memory_gib": float(t["peak_memory_gib"][0]) * float(rng.uniform(0.99, 1.01))}}


def main(argv: list[str]) -> int:
    trial = json.loads(open(argv[0]).read())
    world = World.from_json(json.loads(open(os.environ["AUTOTUNE_BENCH_WORLD"]).read()))
    out = world.measure(trial["model"], trial["workload"], trial["cluster"], trial["params"], int(trial.get("number", 0)))
    if out.get("failure") == "oom":
        print(f"RuntimeError: NPU out of memory. Tried to allocate {out['need'] - out['limit']:.2f} GiB "
              f"(peak {out['need']:.1f} GiB of {out['limit']:.1f} GiB)", flush=True)
        return 1
    if out.get("failure"):
        print(json.dumps({"event": "failure", "status": "invalid", "reason": "not a valid config"}), flush=True)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
