"""Predicted vs measured for every row of the published training runs, each row with its
published source: benchmarks/data/training_measured.csv (the rows the model was built against)
and benchmarks/data/training_heldout.csv (rows collected after it, never used to set a figure of
the model: its held-out error).

Prints one line per row (tokens/s/device where the source published it, else step time; the
peak memory per device where the source published it) and, per file, the mean absolute
percentage error of each. No parameter is fitted here: the predictions use the bundled hardware
profiles as they are. Says so and goes on when a file is absent.

    python benchmarks/simulator_fidelity.py
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

from autotune.workers.hardware import load_profile
from autotune.workers.simulate import columns_from_params, simulate_configs

VALIDATION = Path(__file__).resolve().parent / "data"


def row_inputs(row: dict[str, str]) -> tuple[dict, dict, dict, dict]:
    """(model, workload, cluster, params) of one CSV row. Two model facts the CSV leaves out come
    from the sources: GPT rows (Megatron GPT, MPT) tie the embeddings, Llama does not (unless the
    row's ``tie_embeddings`` column says otherwise); MPT (llm-foundry) trains without dropout,
    Megatron's GPT with it. The optional columns: ``cp`` (the context-parallel size),
    ``first_stage_layers`` (the first pipeline stage's layers; empty: an even split),
    ``memory_rule`` (the stack's; empty: Megatron's) and ``overlap_grad_reduce`` (Megatron-LM's
    ``--overlap-grad-reduce``, off by default there; empty: on)."""
    arch = row["arch"]
    model = dict(
        arch=arch,
        hidden_size=int(row["hidden"]),
        num_hidden_layers=int(row["layers"]),
        num_attention_heads=int(row["heads"]),
        num_key_value_heads=int(row["kv_heads"]),
        intermediate_size=int(row["ffn"]),
        vocab_size=int(row["vocab"]),
        max_position_embeddings=int(row["seq"]),
        tie_word_embeddings=(row.get("tie_embeddings") or str(arch == "gpt")).strip().lower() == "true",
    )
    workload = dict(
        kind="train",
        seq_len=int(row["seq"]),
        global_batch_size=int(row["global_batch_size"]),
        flash_attention=row["flash_attention"].strip().lower() == "true",
        dropout=arch == "gpt" and "llm-foundry" not in row["source"],
    )
    if row.get("memory_rule"):
        workload["memory_rule"] = row["memory_rule"]
    if row.get("overlap_grad_reduce"):
        workload["overlap_grad_reduce"] = row["overlap_grad_reduce"].strip().lower() == "true"
    devices = int(row["devices"])
    cluster = dict(
        accelerator="npu" if row["hardware"].startswith("ascend") else "cuda",
        devices_per_node=min(8, devices),
        nodes=max(1, devices // 8),
        world_size=devices,
    )
    cp = int(row.get("cp") or 1)
    params = dict(
        tp=int(row["tp"]),
        pp=int(row["pp"]),
        cp=cp,
        first_stage_layers=int(row["first_stage_layers"]) if row.get("first_stage_layers") else None,
        vpp=int(row["vpp"] or 1),
        dp=int(row["dp"]),
        micro_batch_size=int(row["micro_batch_size"]),
        grad_accum=max(1, int(row["global_batch_size"]) // (int(row["micro_batch_size"]) * int(row["dp"]))),
        sequence_parallel=row["sp"].strip().lower() == "true",
        recompute=row["recompute"],
        zero_stage=int(row["zero_stage"]),
        precision=row["precision"],
    )
    return model, workload, cluster, params


def compare(rows: list[dict[str, str]]) -> tuple[dict[str, float], dict[str, float]]:
    """Print one line per row and return the signed relative errors of throughput (or step time)
    and of peak memory per device, by row id (memory only where the source published it)."""
    speed: dict[str, float] = {}
    memory: dict[str, float] = {}
    print(
        f"{'row':<44} {'metric':<24} {'predicted':>10} {'measured':>10} {'error %':>8}  {'MFU pred':>8}"
        f"  {'peak GiB':>8} {'measured':>8} {'error %':>7}"
    )
    for row in rows:
        model, workload, cluster, params = row_inputs(row)
        hardware = load_profile(row["hardware"])
        out = simulate_configs(model, workload, hardware, cluster, columns_from_params([params]))
        line = f"{row['id']:<44} "
        if row["measured_tokens_per_s_per_device"]:
            metric, measured = "tokens_per_s_per_device", float(row["measured_tokens_per_s_per_device"])
        elif row["measured_step_time_s"]:
            metric, measured = "step_time_s", float(row["measured_step_time_s"])
        else:
            metric, measured = "", 0.0
        if metric:
            predicted = float(out[metric][0])
            speed[row["id"]] = (predicted - measured) / measured
            line += f"{metric:<24} {predicted:>10.2f} {measured:>10.2f} {speed[row['id']] * 100:>+8.1f}  "
        else:
            line += f"{'(memory only)':<24} {'':>10} {'':>10} {'':>8}  "
        peak = float(out["peak_memory_gib"][0])
        line += f"{float(out['mfu'][0]):>8.3f}  {peak:>8.1f}"
        if row.get("measured_memory_gib"):
            measured_mem = float(row["measured_memory_gib"])
            memory[row["id"]] = (peak - measured_mem) / measured_mem
            line += f" {measured_mem:>8.1f} {memory[row['id']] * 100:>+7.1f}"
        print(line)
    return speed, memory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows",
        type=Path,
        action="append",
        help="a CSV of published runs (default: data/training_measured.csv and data/training_heldout.csv); "
        "repeat for several",
    )
    args = parser.parse_args(argv)
    paths = args.rows or [VALIDATION / "training_measured.csv", VALIDATION / "training_heldout.csv"]
    for path in paths:
        if not path.exists():
            print(f"validation data not found at {path}; nothing to compare")
            continue
        print(f"\n== {path.name}")
        speed, memory = compare(list(csv.DictReader(path.open())))
        if speed:
            values = [abs(v) for v in speed.values()]
            mape, median, signed = (
                sum(values) / len(values),
                statistics.median(values),
                statistics.fmean(speed.values()),
            )
            print(f"\n{path.name}: MAPE over {len(values)} rows: {mape * 100:.1f} %", end="")
            print(f" (median {median * 100:.1f} %, mean signed {signed * 100:+.1f} %)")
        if memory:
            values = [abs(v) for v in memory.values()]
            mae, signed = sum(values) / len(values), statistics.fmean(memory.values())
            print(
                f"{path.name}: memory, mean absolute error over {len(values)} rows: "
                f"{mae * 100:.1f} % (mean signed {signed * 100:+.1f} %)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
