"""A stand-in for your own training launcher, driven by autotune's `command` backend.

autotune runs it once per trial as `python my_launcher.py --trial <trial.json>` (see spec.yaml).
The trial file holds the resolved config: {"params": {...}, "model": {...}, "workload": {...},
"cluster": {...}}. A real launcher would start MindSpeed-LLM / Megatron / torchtitan with these
parameters and parse its log; this one only computes a made-up throughput so the example runs
anywhere in seconds.

The protocol (docs/ARCHITECTURE.md): print `{"event": "step", ...}` lines while running (progress and
pruning), then one `{"metrics": {...}}` line; exit non-zero on failure. Printing "out of memory"
makes autotune record the trial as `oom` and treat the config as infeasible. A launcher that
cannot print JSON can be read with `metric_patterns` (regexes) in the spec instead.
"""

import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trial", required=True)
    trial = json.load(open(ap.parse_args().trial))
    p = trial["params"]
    seq = trial["workload"]["seq_len"]
    cluster = trial["cluster"]
    world = cluster.get("world_size") or cluster["nodes"] * cluster["devices_per_node"]
    # one step is one training step: the whole global batch (what autotune compares across trials)
    tokens_per_step = trial["workload"]["global_batch_size"] * seq
    # made up: bigger micro-batches are faster until they run out of memory; tp costs communication
    if p["micro_batch_size"] * seq / p["tp"] > 8192 and p["recompute"] == "none":
        print("RuntimeError: NPU out of memory. Tried to allocate 3.50 GiB", flush=True)
        return 1
    efficiency = {1: 0.7, 2: 0.85, 4: 0.95}.get(p["micro_batch_size"], 1.0)
    step_time = (
        tokens_per_step
        / (8000.0 * efficiency * (0.85 if p["recompute"] == "full" else 1.0))
        * (1 + 0.15 * (p["tp"] - 1))
    )
    for step in range(3):
        time.sleep(0.05)
        print(json.dumps({"event": "step", "step": step, "step_time_s": step_time, "loss": 10.0 - step}), flush=True)
    print(
        json.dumps(
            {"metrics": {"step_time_s": step_time, "tokens_per_s_per_device": tokens_per_step / step_time / world}}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
