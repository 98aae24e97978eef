"""The longest silence a user meets in `autotune run`, `calibrate` and `doctor`.

Each command runs with its stderr and stdout on a pipe (the strict case: off a terminal there is
no spinner, so only printed lines count as signs of life); every line's arrival is timestamped,
and the longest gap is reported, counting the start of the process to its first line and its
last line to its exit. Goal (#34): no gap over 5 s on an idle machine. The machine's load
average is printed with the figures, as a loaded machine stretches every gap.

    python benchmarks/silences.py            # all commands
    python benchmarks/silences.py --only run-simulated
"""

from __future__ import annotations

import argparse
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands(tmp: Path) -> dict[str, list[str]]:
    return {
        "run-simulated": [
            "autotune",
            "run",
            str(ROOT / "search_spaces/llama2_7b_8npu.yaml"),
            "--run-dir",
            str(tmp / "sim"),
        ],
        # real torch probes on this CPU, the host's calibration first (cache emptied below)
        "run-torch": [
            "autotune",
            "run",
            str(ROOT / "search_spaces/tiny_llama_cpu.yaml"),
            "--run-dir",
            str(tmp / "torch"),
            "--n-trials",
            "3",
        ],
        "calibrate": ["autotune", "calibrate", "--quick", "--out", str(tmp / "host.yaml")],
        "doctor": ["autotune", "doctor"],
    }


def longest_silence(argv: list[str], env: dict[str, str]) -> tuple[float, str, float, int]:
    """(longest gap s, the line after it, total s, exit code)."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    sel = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ)
    last, worst, after = started, 0.0, "(first line)"
    open_streams = 2
    pending = {proc.stdout: b"", proc.stderr: b""}
    while open_streams:
        for key, _ in sel.select():
            chunk = key.fileobj.read()
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            pending[key.fileobj] += chunk
            *lines, pending[key.fileobj] = pending[key.fileobj].split(b"\n")
            for line in lines:
                now = time.monotonic()
                if now - last > worst:
                    worst, after = now - last, line.decode(errors="replace")[:100]
                last = now
    code = proc.wait()
    end = time.monotonic()
    if end - last > worst:
        worst, after = end - last, "(exit)"
    return worst, after, end - started, code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="one command: " + ", ".join(commands(Path("."))))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="autotune-silences-") as d:
        tmp = Path(d)
        env = {
            **os.environ,
            "AUTOTUNE_CACHE": str(tmp / "results.sqlite"),  # no cached result: every probe runs
            "AUTOTUNE_PROFILE_CACHE": str(tmp / "profiles"),  # no cached calibration: the run measures first
            "XDG_CACHE_HOME": str(tmp / "xdg"),  # no cached MLflow schema
        }
        print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
        print(f"{'command':<15} {'longest silence':>16} {'total':>8}  exit  the line after it")
        for name, argv in commands(tmp).items():
            if args.only and name != args.only:
                continue
            worst, after, total, code = longest_silence(argv, env)
            flag = "" if worst <= 5.0 else "  > 5 s"
            print(f"{name:<15} {worst:>14.1f} s {total:>6.1f} s  {code:>4}  {after}{flag}", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
