"""The warm launcher (workers/torch_probe/warm.py): ranks forked from a server with torch
imported. Checked with a small rank module instead of the probe (the probe through this launcher
is in tests/torch_probe): environment, working directory, output, exit status, and that a
failing rank, a stopped client and a killed client each leave no rank behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support import read_pid

RANK_MODULE = """
import os, sys, time
from pathlib import Path
rank = int(os.environ["RANK"])
out = Path(os.environ["OUT_DIR"])
(out / f"pid{rank}").write_text(str(os.getpid()))
print(f"rank {rank}/{os.environ['WORLD_SIZE']} arg={sys.argv[1]} cwd={os.getcwd()} "
      f"mine={os.environ.get('MINE')} store={bool(os.environ.get('AUTOTUNE_DIST_INIT_FILE'))}", flush=True)
mode = os.environ.get("MODE", "ok")
if mode == "many":  # both ranks print at once, a line at a time
    for k in range(3000):
        print(f"rank {rank} line {k} " + "x" * 60, flush=True)
if mode == "fail" and rank == 1:
    # fail once rank 0 has said who it is: the test checks that exactly that process is stopped
    # (failing first raced it, and under load rank 0 was stopped before it wrote its pid)
    deadline = time.monotonic() + 60
    while not (out / "pid0").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)
if mode in ("fail", "hang"):
    time.sleep(600)
"""


@pytest.fixture
def warm_env(tmp_path: Path):
    """A private server: its own state dir, the rank module on PYTHONPATH (part of the server's key)."""
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    (mod_dir / "fake_rank.py").write_text(textwrap.dedent(RANK_MODULE))
    out = tmp_path / "out"
    out.mkdir()
    env = dict(
        os.environ,
        AUTOTUNE_WARM_DIR=str(tmp_path / "warm"),
        PYTHONPATH=str(mod_dir),
        OUT_DIR=str(out),
        AUTOTUNE_WARM_IDLE_S="30",
    )
    yield env, out
    subprocess.run([sys.executable, "-m", "autotune.workers.torch_probe.warm", "--shutdown"], env=env, timeout=30)


def _client(env: dict, *extra: str, **kw) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "autotune.workers.torch_probe.warm",
        "--nproc-per-node",
        "2",
        "--module",
        "fake_rank",
        "the-trial.json",
    ]
    return subprocess.Popen(
        argv,
        env=dict(env, **dict(kw)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=extra[0] if extra else None,
    )


def _gone(pid: int, within_s: float = 15.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie still answers kill(0): look at its state
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_two_ranks_printing_at_once_never_merge_a_line(warm_env, tmp_path: Path):
    """The ranks share the client's stdout; under ``PYTHONUNBUFFERED=1`` (which the command backend
    sets) a print was two writes, text then newline, and two ranks' lines merged. Each line must
    arrive whole: a probe's metrics line is one of them."""
    env, out = warm_env
    proc = _client(env, str(tmp_path), MODE="many", PYTHONUNBUFFERED="1")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    lines = [line for line in stdout.splitlines() if "/2 arg=" not in line]  # each rank's greeting apart
    want = {f"rank {r} line {k} " + "x" * 60 for r in (0, 1) for k in range(3000)}
    assert set(lines) == want and len(lines) == len(want)


def test_ranks_get_the_clients_env_cwd_and_stdout(warm_env, tmp_path: Path):
    env, out = warm_env
    proc = _client(env, str(tmp_path), MINE="from-client")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    lines = sorted(stdout.splitlines())
    assert lines == [f"rank {r}/2 arg=the-trial.json cwd={tmp_path} mine=from-client store=True" for r in (0, 1)]
    # a second trial reuses the server (same socket) and sees its own environment
    proc = _client(env, str(tmp_path), MINE="second")
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and stdout.count("mine=second") == 2


def test_a_failing_rank_stops_the_other_and_gives_its_status(warm_env):
    env, out = warm_env
    proc = _client(env, MODE="fail")
    proc.communicate(timeout=120)
    assert proc.returncode == 3
    assert _gone(int((out / "pid0").read_text()))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_or_killed_client_leaves_no_rank(warm_env, sig):
    env, out = warm_env
    proc = _client(env, MODE="hang")
    pids = [read_pid(out / f"pid{r}", within_s=120) for r in (0, 1)]
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    assert proc.returncode == (128 + signal.SIGTERM if sig == signal.SIGTERM else -signal.SIGKILL)
    assert all(_gone(pid) for pid in pids)


def test_the_server_is_keyed_by_import_time_environment(monkeypatch, tmp_path):
    from autotune.workers.torch_probe import warm

    monkeypatch.setenv(warm.WARM_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = warm.socket_path()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # read by the OpenMP runtime when torch loads
    assert warm.socket_path() != before
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # read later, in the rank
    assert warm.socket_path() == before
    assert len(str(before)) < 100  # AF_UNIX path limit


def test_auto_launcher_choice():
    from autotune.workers.protocol import TrialRequest
    from autotune.workers.torch_probe.launch import probe_argv

    def argv(accelerator: str, nodes: int = 1, launcher: str | None = None) -> list[str]:
        req = TrialRequest(
            params={},
            model={},
            workload={},
            cluster=dict(accelerator=accelerator, nodes=nodes, devices_per_node=2),
            backend={"launcher": launcher} if launcher else {},
        )
        return probe_argv(req, "py", "t.json")

    assert argv("cpu")[:3] == ["py", "-m", "autotune.workers.torch_probe.warm"]
    assert argv("npu")[:3] == ["py", "-m", "autotune.workers.torch_probe.spawn"]
    assert argv("cuda", launcher="warm")[2] == "autotune.workers.torch_probe.warm"
    across = argv("cpu", nodes=2)  # across nodes: torchrun, with the dispatcher's rendezvous per node
    assert "torch.distributed.run" in across and "{node_rank}" in across
    with pytest.raises(ValueError, match="one node"):
        argv("cpu", nodes=2, launcher="warm")
    with pytest.raises(ValueError, match="unknown launcher"):
        argv("cpu", launcher="fork")


def test_a_socket_directory_others_can_enter_is_refused(tmp_path, monkeypatch):
    """A warm-start directory someone else could have made (world-writable, a symlink) is refused
    with what is wrong and how to fix it; a fresh one is created private."""
    from autotune.workers.torch_probe import warm

    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    monkeypatch.setenv(warm.WARM_DIR_ENV, str(open_dir))
    with pytest.raises(PermissionError, match="mode 0777 lets other users in"):
        warm.socket_path()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    monkeypatch.setenv(warm.WARM_DIR_ENV, str(link))
    with pytest.raises(PermissionError, match="not a directory"):
        warm.socket_path()
    fresh = tmp_path / "mine"
    monkeypatch.setenv(warm.WARM_DIR_ENV, str(fresh))
    assert warm.socket_path().parent == fresh and (fresh.stat().st_mode & 0o777) == 0o700


def test_the_server_outlives_the_probe_that_started_it(warm_env):
    """The command backend kills, once a probe ends, every process that carries the probe's mark
    (``AUTOTUNE_PROBE_MARK``: a descendant that left its process group). The server is started by the
    first probe's client and is meant to serve the next trials: it must not carry that mark. (It
    did: every probe of a study started a cold server and logged "left 1 process(es) outside its
    process group (setsid): killed".) The ranks, forked for the trial, do carry it."""
    from autotune.workers.process_group import kill_marked

    env, out = warm_env
    client = _client(env, AUTOTUNE_PROBE_MARK="probe-1")
    stdout, stderr = client.communicate(timeout=120)
    assert client.returncode == 0, stderr
    assert "rank 1/2" in stdout
    assert kill_marked("AUTOTUNE_PROBE_MARK", "probe-1") == 0  # nothing of the probe's is left to kill
    server = subprocess.run(
        [sys.executable, "-c", "from autotune.workers.torch_probe.warm import socket_path; print(socket_path())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    serving = [
        pid
        for pid in os.listdir("/proc")
        if pid.isdigit() and server.encode() in _cmdline(pid) and b"--serve" in _cmdline(pid)
    ]
    assert serving  # the server is still there for the next probe
    again = _client(env, AUTOTUNE_PROBE_MARK="probe-2")
    stdout, stderr = again.communicate(timeout=120)
    assert again.returncode == 0 and "rank 0/2" in stdout, stderr


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
