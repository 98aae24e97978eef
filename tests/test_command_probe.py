"""run_probe_process: one probe as its own process group (workers/command.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autotune.workers.command import MAX_LINE_BYTES, run_probe_process
from support import GRANDCHILD_THEN, grandchild_probe, read_pid, script, wait_dead

PY = sys.executable


@pytest.fixture
def trial_file(tmp_path: Path) -> Path:
    path = tmp_path / "trial.json"
    path.write_text(json.dumps({"params": {"tp": 2}}))
    return path


def test_metrics_steps_and_log_tail(tmp_path, trial_file):
    argv = script(
        tmp_path,
        """
        import json
        print("loading model")
        for i in range(3):
            print(json.dumps({"event": "step", "step": i, "loss": 2.0 - i / 10}))
        print(json.dumps({"metrics": {"tokens_per_s": 1234.5, "peak_mem_gb": "3.25", "mode": "train"},
                          "info": {"torch": "2.13"}}))
    """,
    )
    events = []
    result = run_probe_process(argv, {}, trial_file, 30, on_event=events.append)
    assert result.status == "ok", result
    assert result.metrics == {"tokens_per_s": 1234.5, "peak_mem_gb": 3.25}
    assert result.info["non_numeric_metrics"] == {"mode": "train"}
    assert result.info["torch"] == "2.13"
    assert [s["step"] for s in result.steps] == [0, 1, 2]
    assert [e["step"] for e in events] == [0, 1, 2]
    assert "loading model" in result.log_tail
    assert '"event": "step"' not in result.log_tail  # steps are in .steps, not the tail
    assert result.source == "measured" and result.wall_s > 0


def test_steps_are_streamed_while_the_probe_runs(tmp_path, trial_file):
    marker = tmp_path / "go"
    argv = script(
        tmp_path,
        f"""
        import json, os, time
        print(json.dumps({{"event": "step", "step": 0}}))
        while not os.path.exists({str(marker)!r}):
            time.sleep(0.01)
        print(json.dumps({{"metrics": {{"x": 1}}}}))
    """,
    )

    def on_event(event):  # the probe only goes on once its first step has been seen
        marker.write_text("1")

    result = run_probe_process(argv, {}, trial_file, 30, on_event=on_event)
    assert result.status == "ok", result


def test_env_trial_file_and_templating(tmp_path, trial_file):
    argv = script(
        tmp_path,
        """
        import json, os, sys
        print(json.dumps({"metrics": {"argc": len(sys.argv)}, "info": {
            "argv": sys.argv[1:], "env": os.environ.get("MY_SETTING"), "home": os.environ.get("HOME"),
            "trial_env": os.environ["AUTOTUNE_TRIAL_FILE"],
            "content": json.load(open(os.environ["AUTOTUNE_TRIAL_FILE"]))}}))
    """,
    ) + ["--config={trial_file}", "{not_a_placeholder}", "{trial_file}"]
    result = run_probe_process(argv, {"MY_SETTING": "expandable_segments:True"}, trial_file, 30)
    assert result.status == "ok", result
    info = result.info
    assert info["argv"] == [f"--config={trial_file}", "{not_a_placeholder}", str(trial_file)]
    assert info["env"] == "expandable_segments:True"
    assert info["home"] == os.environ.get("HOME")  # os.environ is inherited
    assert info["trial_env"] == str(trial_file)
    assert info["content"] == {"params": {"tp": 2}}


def test_cwd(tmp_path, trial_file):
    work = tmp_path / "work"
    work.mkdir()
    argv = script(
        tmp_path,
        """
        import json, os
        print(json.dumps({"metrics": {"x": 1}, "info": {"cwd": os.getcwd()}}))
    """,
    )
    result = run_probe_process(argv, {}, trial_file, 30, cwd=work)
    assert result.status == "ok" and Path(result.info["cwd"]) == work
    missing = run_probe_process(argv, {}, trial_file, 30, cwd=tmp_path / "nope")
    assert missing.status == "invalid" and "does not exist" in missing.reason


def test_out_of_memory_exit_is_oom(tmp_path, trial_file):
    argv = script(
        tmp_path,
        """
        import sys
        print("step 1 ok")
        print("RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
        sys.exit(1)
    """,
    )
    result = run_probe_process(argv, {}, trial_file, 30)
    assert result.status == "oom", result
    assert "out of memory" in result.reason
    assert result.info["returncode"] == 1
    assert "step 1 ok" in result.log_tail  # stderr and stdout both reach the tail


# one rank's OOM, as modelscope/FunASR issue 2006 logged it: the other ranks then wait in a collective
_RANK_OOM = (
    "[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 336.00 MiB. GPU 2 has a total capacity "
    "of 79.15 GiB of which 141.25 MiB is free. Including non-PyTorch memory, this process has 78.99 GiB memory in "
    "use. Of the allocated memory 77.21 GiB is allocated by PyTorch, and 283.51 MiB is reserved by PyTorch but "
    "unallocated."
)


def test_an_oom_the_probe_does_not_exit_after_is_stopped_and_recorded_as_oom(tmp_path, trial_file):
    pid_file = tmp_path / "grandchild.pid"
    # a rank fails, and the launcher and its other ranks (a grandchild here) wait in a collective
    argv = grandchild_probe(tmp_path, pid_file, f"print({_RANK_OOM!r}, flush=True)\ntime.sleep(60)")
    result = run_probe_process(argv, {}, trial_file, 60, oom_exit_grace_s=0.5)
    assert result.status == "oom", result
    assert result.info["stopped_after_oom_s"] == 0.5
    assert "Tried to allocate 336.00 MiB" in result.reason and "stopped the probe 0.5 s after" in result.reason
    assert result.info["oom"]["requested"] == pytest.approx(336 / 1024, abs=1e-3)  # the allocator's numbers kept
    assert wait_dead(read_pid(pid_file)), "a rank outlived the stop"


def test_an_oom_the_launcher_recovers_from_or_a_warning_about_memory_is_not_stopped(tmp_path, trial_file):
    argv = script(
        tmp_path,
        f"""
        import json, time
        print("WARNING: this config may run out of memory; try expandable_segments", flush=True)
        print({_RANK_OOM!r}, flush=True)
        time.sleep(0.1)  # caught, and the launcher goes on
        print(json.dumps({{"event": "step", "step": 1, "step_time_s": 0.1}}), flush=True)
        time.sleep(2.5)  # longer than the grace: the step cancelled the stop
        print(json.dumps({{"metrics": {{"tokens_per_s": 10.0}}}}), flush=True)
    """,
    )
    result = run_probe_process(argv, {}, trial_file, 30, oom_exit_grace_s=1.0)
    assert result.status == "ok", result
    assert "stopped_after_oom_s" not in result.info


def test_an_oom_waits_for_the_deadline_when_the_grace_is_off(tmp_path, trial_file):
    argv = script(tmp_path, f"import time\nprint({_RANK_OOM!r}, flush=True)\ntime.sleep(60)\n")
    result = run_probe_process(argv, {}, trial_file, 1.5, oom_exit_grace_s=None)
    assert result.status == "timeout" and "stopped_after_oom_s" not in result.info


def test_device_oom_raised_reads_the_allocators_errors_not_warnings():
    from autotune.workers.protocol import device_oom_raised

    raised = [
        _RANK_OOM,
        "RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.97 GiB total capacity; ...)",
        "RuntimeError: CUDA error: out of memory",
        "Out of Memory!!! Request memory size: 1073741824B, Memory Statistic:",
        "E39999: Inner Error! EL0004: Failed to allocate memory.",
    ]
    not_raised = [
        "WARNING: may run out of memory",
        "set PYTORCH_NPU_ALLOC_CONF=expandable_segments:True to avoid out of memory",
        "iteration 3 | memory (MB) | allocated: 51234 | max allocated: 60123",
    ]
    assert all(device_oom_raised(line) for line in raised)
    assert not any(device_oom_raised(line) for line in not_raised)


def test_failure_event_is_honoured(tmp_path, trial_file):
    code = """
        import json, sys
        print(json.dumps({"event": "failure", "status": "oom", "reason": "KV cache does not fit"}))
        for i in range(1500):
            print("teardown noise", i)
        sys.exit(%d)
    """
    for rc in (0, 3):
        events = []
        result = run_probe_process(script(tmp_path, code % rc), {}, trial_file, 30, on_event=events.append)
        assert result.status == "oom", (rc, result)
        assert result.reason == "KV cache does not fit"
        assert events and events[0]["event"] == "failure"


def test_exit_zero_without_metrics_is_crash(tmp_path, trial_file):
    result = run_probe_process(script(tmp_path, "print('done, but no metrics')"), {}, trial_file, 30)
    assert result.status == "crash"
    assert result.reason == "probe exited 0 without a metrics line"


def test_nonzero_exit_is_crash_with_last_line(tmp_path, trial_file):
    result = run_probe_process(script(tmp_path, "import sys; print('segfault-ish'); sys.exit(7)"), {}, trial_file, 30)
    assert result.status == "crash"
    assert "status 7" in result.reason and "segfault-ish" in result.reason


def test_regex_metric_extraction(tmp_path, trial_file):
    argv = script(
        tmp_path,
        """
        for it, tput in ((10, 101.5), (20, 120.25), (30, 118.0)):
            print(f" iteration {it}/30 | throughput per GPU (TFLOP/s/GPU): {tput} | tokens/s: 4,{it}00 |")
        print("training finished")
    """,
    )
    patterns = {
        "tflops": r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)",
        "tokens_per_s": r"tokens/s: ([0-9,]+)",
        "absent": r"never printed: (\d+)",
    }
    result = run_probe_process(argv, {}, trial_file, 30, metric_patterns=patterns)
    assert result.status == "ok", result
    assert result.metrics == {"tflops": 118.0, "tokens_per_s": 43000.0}  # last match wins; "4,3000"
    bad = run_probe_process(argv, {}, trial_file, 30, metric_patterns={"x": "(unclosed"})
    assert bad.status == "invalid" and "x" in bad.reason


def test_missing_executable_is_invalid(tmp_path, trial_file):
    result = run_probe_process(["/definitely/not/here/launcher", "{trial_file}"], {}, trial_file, 30)
    assert result.status == "invalid"
    assert "not found" in result.reason and "launcher" in result.reason
    not_exec = tmp_path / "not_exec.sh"
    not_exec.write_text("#!/bin/sh\necho hi\n")
    result = run_probe_process([str(not_exec)], {}, trial_file, 30)
    assert result.status == "invalid" and "not executable" in result.reason
    assert run_probe_process([], {}, trial_file, 30).status == "invalid"


def test_timeout_kills_the_whole_group(tmp_path, trial_file):
    pid_file = tmp_path / "grandchild.pid"
    result = run_probe_process(grandchild_probe(tmp_path, pid_file, GRANDCHILD_THEN), {}, trial_file, 3)
    assert result.status == "timeout", result
    assert "started" in result.log_tail
    assert wait_dead(read_pid(pid_file)), "the grandchild outlived the timeout"


def test_sigterm_ignored_gets_sigkill(tmp_path, trial_file):
    argv = script(
        tmp_path,
        """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        time.sleep(60)
    """,
    )
    result = run_probe_process(argv, {}, trial_file, 0.5, kill_grace_s=0.5)
    assert result.status == "timeout"
    assert result.info["returncode"] == -signal.SIGKILL


def test_should_stop_prunes_with_partial_steps(tmp_path, trial_file):
    pid_file = tmp_path / "grandchild.pid"
    argv = grandchild_probe(
        tmp_path,
        pid_file,
        """
        i = 0
        while True:  # steps only once the grandchild is up, so that pruning finds it
            print(json.dumps({"event": "step", "step": i, "tokens_per_s": 10.0 * i}))
            i += 1
            time.sleep(0.02)
    """,
    )
    seen = []
    result = run_probe_process(argv, {}, trial_file, 60, on_event=seen.append, should_stop=lambda: len(seen) >= 3)
    assert result.status == "pruned", result
    assert len(result.steps) >= 3
    assert [s["step"] for s in result.steps] == list(range(len(result.steps)))
    assert wait_dead(read_pid(pid_file))


def test_leftover_processes_are_killed_when_the_probe_exits(tmp_path, trial_file):
    pid_file = tmp_path / "straggler.pid"
    argv = grandchild_probe(
        tmp_path,
        pid_file,
        """
        print(json.dumps({"metrics": {"x": 1}}))
    """,
        grandchild_output=", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL",
    )
    result = run_probe_process(argv, {}, trial_file, 30)
    assert result.status == "ok", result
    assert wait_dead(read_pid(pid_file))


def test_garbage_output_does_not_break_the_reader(tmp_path, trial_file):
    argv = script(
        tmp_path,
        f"""
        import json, os, sys
        out = sys.stdout.buffer
        out.write(os.urandom(100_000))            # binary, no newline
        out.write(b"\\n\\xff\\xfe\\x00 not utf-8\\n")
        out.write(b"x" * ({MAX_LINE_BYTES} * 3) + b"\\n")    # one huge line
        out.write(b'{{"metrics": [1, 2]}}\\n')     # malformed protocol message: ignored
        out.write(b'{{"event": "step", "step": 0}}\\n')
        out.write(json.dumps({{"metrics": {{"ok": 1}}}}).encode() + b"\\n")
        out.flush()
    """,
    )
    result = run_probe_process(argv, {}, trial_file, 60)
    assert result.status == "ok", result.reason
    assert result.metrics == {"ok": 1.0}
    assert len(result.steps) == 1
    assert "not utf-8" in result.log_tail
    assert len(result.log_tail) < 1_000_000  # lines are cut in the tail


def test_log_tail_is_bounded(tmp_path, trial_file):
    argv = script(
        tmp_path,
        """
        import json
        for i in range(5000):
            print("line", i)
        print(json.dumps({"metrics": {"x": 1}}))
    """,
    )
    result = run_probe_process(argv, {}, trial_file, 30, log_tail_lines=20)
    assert result.status == "ok"
    lines = result.log_tail.splitlines()
    assert len(lines) == 20 and lines[-2] == "line 4999"


def test_callback_error_still_kills_the_group(tmp_path, trial_file):
    pid_file = tmp_path / "grandchild.pid"
    argv = grandchild_probe(
        tmp_path,
        pid_file,
        """
        print(json.dumps({"event": "step", "step": 0}), flush=True)
        time.sleep(60)
    """,
    )

    def on_event(event):
        raise RuntimeError("callback bug")

    with pytest.raises(RuntimeError, match="callback bug"):
        run_probe_process(argv, {}, trial_file, 60, on_event=on_event, kill_grace_s=1)
    assert wait_dead(read_pid(pid_file))


def test_watchdog_kills_the_group_when_the_runner_dies(tmp_path, trial_file):
    """A Ray worker killed by ray.cancel(force=True) takes only its direct children with it."""
    pid_file = tmp_path / "grandchild.pid"
    probe = grandchild_probe(tmp_path, pid_file, GRANDCHILD_THEN)
    runner = tmp_path / "runner.py"
    runner.write_text(
        textwrap.dedent(f"""
        from autotune.workers.command import run_probe_process
        run_probe_process({probe!r}, {{}}, {str(trial_file)!r}, 120, kill_grace_s=0.5)
    """)
    )
    proc = subprocess.Popen([PY, str(runner)])
    try:
        pid = read_pid(pid_file, within_s=30)
        proc.kill()  # SIGKILL: no cleanup in the runner
        proc.wait(timeout=10)
        assert wait_dead(pid), "the probe's grandchild outlived its runner"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_nonstop_output_does_not_starve_the_deadline(tmp_path, trial_file):
    argv = ["sh", "-c", "yes 'a line of log text that never ends'"]
    result = run_probe_process(argv, {}, trial_file, 1.0, log_tail_lines=5)
    assert result.status == "timeout"
    assert result.log_tail.splitlines()[-1].startswith("a line of log")


def test_a_one_node_trial_fills_the_node_placeholders_with_one_nodes_values():
    """Issue 45: the launcher argv a multi-node trial gets its rendezvous in runs at one node too
    (a scaling study's smallest size): 1 node, rank 0, this host, a free port."""
    from autotune.workers.command import single_node_values

    argv = single_node_values(
        ["run", "--nnodes={nnodes}", "{node_rank}", "{master_addr}:{master_port}", "{rdzv_endpoint}", "x"]
    )
    assert argv[:3] == ["run", "--nnodes=1", "0"]
    host, port = argv[3].split(":")
    assert host == "127.0.0.1" and 1024 <= int(port) < 65536 and argv[4] == argv[3] and argv[5] == "x"
    assert single_node_values(["a", "{trial_file}"]) == ["a", "{trial_file}"]  # nothing else touched
