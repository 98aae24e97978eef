"""A huge search space through ``autotune plan`` (issue #42): wall time and peak RSS.

    python benchmarks/huge_space.py [--size small|medium|large|priced] [--keep DIR] [--validate]

Writes the 7B / 8-NPU space of ``search_spaces/llama2_7b_8npu.yaml`` widened with env knobs (a few
launcher settings with 3-4 values each, micro-batch up to 16): ``large`` is 2,488,320 combinations
(issue #42's acceptance: ``plan`` under 1.5 GB peak RSS and 30 s on the development machine),
``medium`` 622,080, ``small`` 4,608 (a smoke run, seconds). ``priced`` is 2,496,000 combinations
every one of which is a valid config the simulator prices apart from the others: the worst case
per combination, the one autotune's memory estimate assumes. Runs ``autotune plan`` (and with
``--validate`` ``autotune validate`` first) in a child process as a user would, under
``/usr/bin/time -v`` where it exists (``getrusage`` of the child otherwise), and prints the
command, its exit status, wall seconds and peak RSS. A benchmark, not a test: the figures depend
on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {
    # the base space (41,472 combinations) with micro-batch 16 (x 5/4) and these env knobs
    "small": {"mbs": "[1, 2, 4, 8]", "env": {}, "trim": True},
    "medium": {
        "mbs": "[1, 2, 4, 8, 16]",
        "env": {"HCCL_CONNECT_TIMEOUT": ["600", "1200", "1800"], "HCCL_EXEC_TIMEOUT": ["0", "300", "900", "1800"]},
        "trim": False,
    },
    "large": {
        "mbs": "[1, 2, 4, 8, 16]",
        "env": {
            "HCCL_CONNECT_TIMEOUT": ["600", "1200", "1800"],
            "HCCL_EXEC_TIMEOUT": ["0", "300", "900", "1800"],
            "TASK_QUEUE_ENABLE": ["0", "1", "2", "3"],
        },
        "trim": False,
    },
}


# every combination a valid config the simulator prices apart from the others (the HCCL buffer
# and the allocator's split size change the predicted memory): the worst case per combination,
# which the memory estimate of autotune.spec.space (BYTES_PER_COMBINATION) assumes
PRICED = """name: huge-space-priced
description: every combination valid and priced apart (benchmarks/huge_space.py, issue 42)
model: llama2-7b
workload: {{kind: train, seq_len: 4096, global_batch_size: 64}}
cluster: {{accelerator: npu, profile: ascend-910b, nodes: 1, devices_per_node: 8}}
backend: auto
target: none
space:
  micro_batch_size: [1, 2, 4, 8]
  recompute: [none, selective, full]
  zero_stage: [0, 1, 2, 3]
  precision: [bf16, fp16]
  env:
    HCCL_BUFFSIZE: [{buffers}]
    PYTORCH_NPU_ALLOC_CONF: [{splits}]
objectives: [tokens_per_s_per_device]
search: {{n_trials: 20, sampler: auto, seed: 0, exhaustive_limit: 3000000}}
"""


def spec_text(size: str) -> str:
    """The benchmark's spec for ``size``."""
    if size == "priced":
        return PRICED.format(
            buffers=", ".join(str(100 + 5 * i) for i in range(200)),
            splits=", ".join(f'"max_split_size_mb:{64 + 8 * i}"' for i in range(130)),
        )
    cfg = SIZES[size]
    env_extra = "".join(f"    {name}: [{', '.join(repr(v) for v in values)}]\n" for name, values in cfg["env"].items())
    # small: fewer values of the base knobs too, so the smoke run takes seconds
    base = (
        "  tp: [1, 2, 4, 8]\n  pp: [1, 2]\n  vpp: [1]\n  sequence_parallel: [false, true]\n"
        "  recompute: [none, full]\n  zero_stage: [0, 1]\n  precision: [bf16]\n"
        if cfg["trim"]
        else "  tp: [1, 2, 4, 8]\n  pp: [1, 2, 4]\n  vpp: [1, 2]\n  sequence_parallel: [false, true]\n"
        "  recompute: [none, selective, full]\n  zero_stage: [0, 1]\n  precision: [bf16, fp16]\n"
    )
    return f"""name: huge-space-{size}
description: the 7B / 8-NPU space widened with env knobs (benchmarks/huge_space.py, issue 42)
model: llama2-7b
workload: {{kind: train, seq_len: 4096, global_batch_size: 64}}
cluster: {{accelerator: npu, profile: ascend-910b, nodes: 1, devices_per_node: 8}}
backend: auto
target: mindspeed
space:
{base}  micro_batch_size: {cfg["mbs"]}
  env:
    PYTORCH_NPU_ALLOC_CONF:
      - "expandable_segments:False"
      - "expandable_segments:True"
      - "max_split_size_mb:512,garbage_collection_threshold:0.8"
    HCCL_BUFFSIZE: [120, 200, 400]
    MULTI_STREAM_MEMORY_REUSE: ["1", "2"]
{env_extra}constraints:
  - "tp <= devices_per_node"
objectives:
  - metric: tokens_per_s_per_device
    direction: maximize
search:
  n_trials: 20
  sampler: auto
  seed: 0
  exhaustive_limit: 3000000
"""


def run(argv: list[str]) -> dict:
    """Run ``argv`` in a child; its exit status, wall seconds, peak RSS (MiB) and output tail."""
    timer = Path("/usr/bin/time").exists()
    cmd = ["/usr/bin/time", "-v", *argv] if timer else argv
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    wall = time.perf_counter() - start
    rss_kib = None
    if timer:
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        rss_kib = int(match.group(1)) if match else None
    if rss_kib is None:  # the largest child so far: exact for the first run, an upper bound after
        rss_kib = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before)
    text = (proc.stdout + proc.stderr).strip().splitlines()
    tail = [line for line in text if not line.startswith("\t")][-12:]
    return {"rc": proc.returncode, "wall_s": wall, "rss_mib": rss_kib / 1024, "tail": tail}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=[*SIZES, "priced"], default="large")
    ap.add_argument("--keep", type=Path, help="write the spec into this directory (kept)")
    ap.add_argument("--validate", action="store_true", help="time `autotune validate` too")
    ap.add_argument("--top", type=int, default=10, help="plan --top")
    args = ap.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="huge_space_"))
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / f"huge_space_{args.size}.yaml"
    spec.write_text(spec_text(args.size))
    cli = [sys.executable, "-m", "autotune.cli"]
    commands = [[*cli, "validate", str(spec)]] if args.validate else []
    commands.append([*cli, "plan", str(spec), "--top", str(args.top)])
    failed = 0
    print(f"spec: {spec}")
    for argv in commands:
        result = run(argv)
        print(f"$ {' '.join(argv[1:])}")
        for line in result["tail"]:
            print(f"    {line}")
        print(f"  exit {result['rc']}, wall {result['wall_s']:.1f} s, peak RSS {result['rss_mib']:.0f} MiB")
        failed |= result["rc"] != 0
    if args.keep is None:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
