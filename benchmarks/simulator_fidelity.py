"""Predicted vs measured for every row of the published training runs
(benchmarks/data/training_measured.csv, each row with its published source).

Prints one line per row (tokens/s/device where the source published it, else step time) and
the mean absolute percentage error. No parameter is fitted here: the predictions use the bundled
hardware profiles as they are. Exits 0 with a message when the validation data is absent.

    python benchmarks/simulator_fidelity.py
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from autotune.workers.hardware import load_profile
from autotune.workers.simulate import columns_from_params, simulate_configs

VALIDATION = Path(__file__).resolve().parent / "data"


def row_inputs(row: dict[str, str]) -> tuple[dict, dict, dict, dict]:
    """(model, workload, cluster, params) of one CSV row. Two model facts the CSV leaves out come
    from the sources: GPT rows (Megatron GPT, MPT) tie the embeddings, Llama-2 does not; MPT
    (llm-foundry) trains without dropout, Megatron's GPT with it."""
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
        tie_word_embeddings=arch == "gpt",
    )
    workload = dict(
        kind="train",
        seq_len=int(row["seq"]),
        global_batch_size=int(row["global_batch_size"]),
        flash_attention=row["flash_attention"].strip().lower() == "true",
        dropout=arch == "gpt" and "llm-foundry" not in row["source"],
    )
    devices = int(row["devices"])
    cluster = dict(
        accelerator="npu" if row["hardware"].startswith("ascend") else "cuda",
        devices_per_node=min(8, devices),
        nodes=max(1, devices // 8),
        world_size=devices,
    )
    params = dict(
        tp=int(row["tp"]),
        pp=int(row["pp"]),
        vpp=int(row["vpp"] or 1),
        dp=int(row["dp"]),
        micro_batch_size=int(row["micro_batch_size"]),
        grad_accum=int(row["global_batch_size"]) // (int(row["micro_batch_size"]) * int(row["dp"])),
        sequence_parallel=row["sp"].strip().lower() == "true",
        recompute=row["recompute"],
        zero_stage=int(row["zero_stage"]),
        precision=row["precision"],
    )
    return model, workload, cluster, params


def main() -> int:
    path = VALIDATION / "training_measured.csv"
    if not path.exists():
        print(f"validation data not found at {path}; nothing to compare")
        return 0
    rows = list(csv.DictReader(path.open()))
    errors = []
    print(f"{'row':<22} {'metric':<24} {'predicted':>10} {'measured':>10} {'error %':>8}  {'MFU pred':>8}  peak GiB")
    for row in rows:
        model, workload, cluster, params = row_inputs(row)
        hardware = load_profile(row["hardware"])
        out = simulate_configs(model, workload, hardware, cluster, columns_from_params([params]))
        if row["measured_tokens_per_s_per_device"]:
            metric, measured = "tokens_per_s_per_device", float(row["measured_tokens_per_s_per_device"])
        elif row["measured_step_time_s"]:
            metric, measured = "step_time_s", float(row["measured_step_time_s"])
        else:
            continue
        predicted = float(out[metric][0])
        err = (predicted - measured) / measured * 100.0
        errors.append(abs(err))
        print(
            f"{row['id']:<22} {metric:<24} {predicted:>10.2f} {measured:>10.2f} {err:>+8.1f}  "
            f"{float(out['mfu'][0]):>8.3f}  {float(out['peak_memory_gib'][0]):.1f}"
        )
    if errors:
        print(f"\nMAPE over {len(errors)} rows: {sum(errors) / len(errors):.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
