"""A failed trial's one-line reason says why (issue #30): a crashed MindSpore worker's reason named
only "Response is empty." while the cause (an AKG ``Check failed``) sat in log_tail.txt; a timeout
named neither the limit nor the spec field that sets it."""

from __future__ import annotations

import sys

from autotune.workers.command import run_probe_process
from autotune.workers.protocol import native_cause

# What a MindSpore 2.10 CPU run printed when AKG's kernel build failed in a worker: the C++ log
# line with the cause, then the Python exception of the scheduler that lost the worker.
AKG_CRASH = r"""
import json, sys
sys.stderr.write("[WARNING] ME(4242:140111,MainProcess):2026-11-22-10:00:00.000.000 [mindspore/run_check] ok\n")
sys.stderr.write("[ERROR] KERNEL(4242,7f1c,python):2026-11-22-10:00:01.123.456 [mindspore/ccsrc/kernel/graph_kernel/"
                 "akg/akg_kernel_build.cc:370] AkgKernelBuild] AKG compile failed: Check failed: "
                 "attr->IsInstance<StringImm>(): the op Fused_Cast_Mul_fusion has a non-string attr\n")
sys.stderr.write("Traceback (most recent call last):\n  File \"probe.py\", line 1\nRuntimeError: Response is empty.\n")
print(json.dumps({"event": "failure", "status": "crash", "reason": "rank 0: RuntimeError: Response is empty."}))
sys.exit(1)
"""


def test_a_crash_reason_carries_the_runtimes_own_error_line(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(AKG_CRASH)
    trial = tmp_path / "trial.json"
    trial.write_text("{}")
    result = run_probe_process([sys.executable, str(script)], {}, trial, 60, watchdog=False)
    assert result.status == "crash"
    assert result.reason.startswith("rank 0: RuntimeError: Response is empty.")
    assert "Check failed: attr->IsInstance<StringImm>()" in result.reason
    assert "[WARNING]" not in result.reason


def test_the_native_cause_is_the_first_error_line_and_never_repeats_the_reason():
    lines = ["step 1", "[ERROR] RUNTIME(1): EE9999 device error", "[ERROR] echo of it", "RuntimeError: boom"]
    assert native_cause(lines, "rank 0: RuntimeError: boom") == "[ERROR] RUNTIME(1): EE9999 device error"
    assert native_cause(lines, "[ERROR] RUNTIME(1): EE9999 device error") == "[ERROR] echo of it"
    assert native_cause(["Traceback", "ValueError: x"], "ValueError: x") is None


def test_a_timeout_names_the_limit_and_the_spec_field(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\ntime.sleep(30)\n")
    trial = tmp_path / "trial.json"
    trial.write_text("{}")
    result = run_probe_process([sys.executable, str(script)], {}, trial, 1.5, watchdog=False, kill_grace_s=1)
    assert result.status == "timeout"
    assert "1.5 s" in result.reason and "workload.timeout_s" in result.reason and "backend.timeout_s" in result.reason


ESCAPER = r"""
import json, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                  "time.sleep(120)", sys.argv[1]], start_new_session=True,  # leaves the probe's process group
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while True:
    try:
        if open(sys.argv[1]).read():
            break
    except OSError:
        pass
    time.sleep(0.01)
print(json.dumps({"metrics": {"tokens_per_s_per_device": 1.0}}))
"""


def test_a_grandchild_that_calls_setsid_does_not_outlive_the_probe(tmp_path):
    """Issue #31: killing the probe's process group misses a descendant that started its own
    session; the probe's environment mark finds it."""
    import os
    import time

    script = tmp_path / "escaper.py"
    script.write_text(ESCAPER)
    pid_file = tmp_path / "escaped.pid"
    trial = tmp_path / "trial.json"
    trial.write_text("{}")
    result = run_probe_process([sys.executable, str(script), str(pid_file)], {}, trial, 60, watchdog=False)
    assert result.status == "ok", result
    pid = int(pid_file.read_text())
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{pid}/stat").read().split()[2] == "Z":  # killed, waiting for its reaper
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        raise AssertionError("the setsid grandchild outlived its probe")
