"""Where a torch-probe trial's wall time goes: launcher, worker start, model build, warm-up, measured steps.

    python benchmarks/torch_probe_overhead.py [--modes dp2,tp2,pp2,zero3] [--launchers warm,spawn,torchrun]
                                              [--warmup 2] [--measured 5] [--repeats 3]
                                              [--seq-len 256] [--global-batch 8]

Each trial runs exactly as the dispatcher runs it (``launch.warm_argv``, ``launch.spawn_argv`` or
``launch.torchrun_argv``, 2 CPU processes, gloo, through the command backend's runner
``workers.command.run_probe_process``) on the ``tiny-llama`` preset. The wall time is
measured from outside; the probe's own metrics split it:

- launcher: the launcher's start (torchrun imports torch; spawn.py and warm.py's client do not),
  rendezvous, spawning, teardown (= wall − the worker-side parts below);
- worker start: interpreter + ``import torch`` + process group + mesh, up to the model build
  (``time_startup_s``, the worker process' age when the build starts);
- build: meta model → parallelise → materialise → optimizer (``time_model_build_s``);
- warm-up and measured: the steps (``time_warmup_s``, ``time_measure_s``).

The warm launcher's server is started by one untimed trial first (its cold start is printed); a
study pays that once, not per trial. Fixed overhead = everything but the measured steps, as a share
of the wall time (target of issue #4: <= 25 % on the tiny CPU spec). Medians over ``--repeats``;
timings on this CPU vary by up to +-30 % between identical runs, so read the shares, not the third
digit."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from autotune.workers.command import run_probe_process
from autotune.workers.protocol import TrialRequest, write_trial_file
from autotune.workers.torch_probe import warm
from autotune.workers.torch_probe.launch import spawn_argv, torchrun_argv, warm_argv

try:
    from autotune.spec.models import PRESETS

    TINY = dict(PRESETS["tiny-llama"], name="tiny-llama", arch="llama")
except ImportError:  # the preset's published values, should autotune.spec.models move
    TINY = dict(
        name="tiny-llama",
        arch="llama",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=2048,
        max_position_embeddings=1024,
    )

MODES = {
    "dp2": {"dp": 2, "zero_stage": 0},
    "zero3": {"dp": 2, "zero_stage": 3},
    "tp2": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2},
    "dp2-bf16": {"dp": 2, "zero_stage": 0, "precision": "bf16"},
}
PARTS = ("launcher", "worker_start", "build", "warmup", "measured")


LAUNCHERS = {"warm": warm_argv, "spawn": spawn_argv, "torchrun": torchrun_argv}


def run_trial(params: dict, launcher: str, args: argparse.Namespace, workdir: Path, number: int) -> dict:
    request = TrialRequest(
        params=dict(params, micro_batch_size=params.get("micro_batch_size", 1)),
        model=TINY,
        workload=dict(
            kind="train",
            seq_len=args.seq_len,
            global_batch_size=args.global_batch,
            warmup_steps=args.warmup,
            measured_steps=args.measured,
            timeout_s=300,
        ),
        cluster=dict(accelerator="cpu", nodes=1, devices_per_node=2, world_size=2),
        study="bench",
        number=number,
    )
    trial = write_trial_file(request, workdir / f"trial_{number}.json")
    t0 = time.perf_counter()
    # through the command backend's runner, as a study's probe runs: its process group, the probe's
    # mark and the kill of whatever carries the mark afterwards (which once took the warm server too)
    result = run_probe_process(LAUNCHERS[launcher](request, sys.executable, str(trial)), {}, trial, timeout_s=600)
    wall = time.perf_counter() - t0
    if not result.ok:
        raise SystemExit(f"trial {params} failed ({result.status}: {result.reason}):\n{result.log_tail[-3000:]}")
    m = result.metrics
    worker = m.get("time_startup_s", 0.0)
    parts = {
        "worker_start": worker,
        "build": m["time_model_build_s"],
        "warmup": m["time_warmup_s"],
        "measured": m["time_measure_s"],
    }
    parts["launcher"] = wall - sum(parts.values())
    parts["wall"] = wall
    parts["tokens_per_s"] = m["tokens_per_s"]
    parts["step_time_spread"] = m["step_time_spread"]
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="dp2,zero3,tp2,pp2")
    ap.add_argument("--launchers", default="warm,spawn,torchrun")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--measured", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    args = ap.parse_args()

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    launchers = [m.strip() for m in args.launchers.split(",") if m.strip()]
    keys = [(mode, launcher) for mode in modes for launcher in launchers]
    rows: dict[tuple[str, str], list[dict]] = {k: [] for k in keys}
    cold_start = None
    with tempfile.TemporaryDirectory() as tmp:
        n = 0
        if "warm" in launchers:
            warm.shutdown_server()
            time.sleep(0.5)
            cold_start = run_trial(MODES[modes[0]], "warm", args, Path(tmp), n)["wall"]
            n += 1
        for _ in range(args.repeats):  # interleave: drifts in machine load hit every row alike
            for mode, launcher in keys:
                rows[(mode, launcher)].append(run_trial(MODES[mode], launcher, args, Path(tmp), n))
                n += 1

    print(
        f"tiny-llama, seq {args.seq_len}, global batch {args.global_batch}, "
        f"{args.warmup} warm-up + {args.measured} measured steps, 2 CPU processes, median of {args.repeats}"
    )
    if cold_start is not None:
        print(f"warm launcher: first trial (starts the server) {cold_start:.2f} s, not counted below")
    print(
        f"{'mode':9} {'launcher':9} {'wall s':>7} "
        + " ".join(f"{p:>12}" for p in PARTS)
        + f" {'overhead':>9} {'tok/s':>8}"
    )
    summary = {}
    for mode, launcher in keys:
        rs = rows[(mode, launcher)]
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        overhead = 1.0 - med["measured"] / med["wall"]
        print(
            f"{mode:9} {launcher:9} {med['wall']:7.2f} "
            + " ".join(f"{med[p]:6.2f} ({med[p] / med['wall']:3.0%})".rjust(12) for p in PARTS)
            + f" {overhead:9.0%} {med['tokens_per_s']:8.0f}"
        )
        summary[f"{mode}/{launcher}"] = dict(med, fixed_overhead_share=overhead)
    print(
        json.dumps(
            {
                "benchmark": "torch_probe_overhead",
                "args": vars(args),
                "warm_cold_start_s": cold_start,
                "median": summary,
            }
        )
    )
    if "warm" in launchers:
        warm.shutdown_server()


if __name__ == "__main__":
    main()
