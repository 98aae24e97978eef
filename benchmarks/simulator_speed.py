"""Configs per second of the vectorised simulator, conversion from param dicts included.

python benchmarks/simulator_speed.py [N]
"""

from __future__ import annotations

import sys
import time

import numpy as np
from autotune.workers.hardware import load_profile
from autotune.workers.simulate import columns_from_params, simulate_configs

MODEL = dict(
    arch="llama",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    intermediate_size=11008,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
WORKLOAD = dict(kind="train", seq_len=4096, global_batch_size=256)
CLUSTER = dict(accelerator="npu", nodes=2, devices_per_node=8, world_size=16)


def population(n: int, seed: int = 0) -> list[dict]:
    """n random canonical param dicts over a typical search space (some invalid on purpose)."""
    rng = np.random.default_rng(seed)
    tp = rng.choice([1, 2, 4, 8], n)
    pp = rng.choice([1, 2, 4], n)
    mbs = rng.choice([1, 2, 4], n)
    rec = rng.choice(["none", "selective", "full"], n)
    zero = rng.choice([0, 1, 2, 3], n)
    sp = rng.random(n) < 0.5
    alloc = rng.choice(
        [
            "",
            "expandable_segments:True",
            "max_split_size_mb:512",
            "expandable_segments:True,garbage_collection_threshold:0.8",
        ],
        n,
    )
    buf = rng.choice(["100", "200", "400"], n)
    out = []
    for i in range(n):
        p = {
            "tp": int(tp[i]),
            "pp": int(pp[i]),
            "micro_batch_size": int(mbs[i]),
            "recompute": str(rec[i]),
            "zero_stage": int(zero[i]),
            "sequence_parallel": bool(sp[i]),
            "precision": "bf16",
            "env.HCCL_BUFFSIZE": str(buf[i]),
        }
        if alloc[i]:
            p["env.PYTORCH_NPU_ALLOC_CONF"] = str(alloc[i])
        out.append(p)
    return out


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    params = population(n)
    hardware = load_profile("ascend-910b")
    simulate_configs(MODEL, WORKLOAD, hardware, CLUSTER, columns_from_params(params[:100]))  # warm-up
    t0 = time.perf_counter()
    cols = columns_from_params(params)
    t1 = time.perf_counter()
    out = simulate_configs(MODEL, WORKLOAD, hardware, CLUSTER, cols)
    t2 = time.perf_counter()
    total = t2 - t0
    print(f"{n} configs: conversion {t1 - t0:.3f} s, model {t2 - t1:.3f} s, total {total:.3f} s")
    print(
        f"{n / total:,.0f} configs/s including conversion ({n / (t2 - t1):,.0f} configs/s model only); "
        f"{int(out['valid'].sum())} valid, {int(out['fits'].sum())} fit"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
