"""The fault matrix (issue #13; docs/FAILURES.md): a study
whose probes fail in every way a real launcher fails, each fault once, on the default journal
storage and on PostgreSQL, through Ray and without it. For every trial the status and reason in
Optuna storage and in MLflow agree with the fault; nothing is lost or logged twice; a re-run of the
finished study probes nothing and changes nothing in MLflow.

The driver's own faults (SIGKILL, SIGTERM, SIGINT and resume) are in test_cli.py, the tracking
server's death in test_tracking.py, a damaged journal in test_storage.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from support import TINY_TRAIN, free_port, mlflow_runs

# A launcher that fails in the way named by the first unclaimed fault (each fault once, whatever
# order the trials run in); it logs which trial got which fault outside the run directory.
FAULTY_PROBE = r"""
import json, os, signal, subprocess, sys, time
trial = json.load(open(sys.argv[sys.argv.index("--trial") + 1]))
faults = os.environ["FAULTS"].split(",")
root = os.environ["FAULT_DIR"]
for fault in faults:
    try:
        os.close(os.open(os.path.join(root, "claim-" + fault), os.O_CREAT | os.O_EXCL))
        break
    except FileExistsError:
        continue
else:
    fault = "ok"
with open(os.path.join(root, "log.jsonl"), "a") as f:
    f.write(json.dumps({"trial": trial["number"], "fault": fault}) + "\n")
good = json.dumps({"metrics": {"tokens_per_s_per_device": 100.0 + trial["number"], "step_time_s": 1.0}})
if fault == "ok":
    print(good)
elif fault == "crash":
    print("Traceback (most recent call last):\nValueError: bad things", flush=True)
    sys.exit(3)
elif fault == "segfault":
    os.kill(os.getpid(), signal.SIGSEGV)
elif fault == "hang":  # a child that ignores SIGTERM keeps the group alive
    subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    time.sleep(600)
elif fault == "oom":
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
          "79.10 GiB of which 1.05 GiB is free.", flush=True)
    sys.exit(1)
elif fault == "nan":
    print(json.dumps({"event": "step", "step": 0, "loss": float("nan")}))
    print("loss is nan, stopping training", flush=True)
    sys.exit(1)
elif fault == "garbage":
    sys.stdout.buffer.write(bytes(range(256)) + b"\n{not json\n\x00\x00\n")
    print(good)
elif fault == "partial":
    sys.stdout.write('{"metrics": {"tokens_per_s_per_dev')
elif fault == "markup":
    print("[/bold] [red]rank0[/red]: $(touch /tmp/autotune-pwned); `id`; \"quoted\" 'x' \\n", flush=True)
    sys.exit(2)
elif fault == "kill-worker":  # the Ray worker running this trial dies (only under Ray: the parent is its worker)
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(30)
elif fault == "implausible":
    print(json.dumps({"metrics": {"tokens_per_s_per_device": 1e15, "step_time_s": -1.0}}))
"""

# fault -> (status in Optuna and MLflow, a piece of the recorded reason)
EXPECTED = {
    "ok": ("ok", ""),
    "crash": ("crash", "ValueError: bad things"),
    "segfault": ("crash", "signal 11"),
    "hang": ("timeout", "timeout"),
    "oom": ("oom", "CUDA out of memory"),
    "nan": ("nan", "loss is nan"),
    "garbage": ("ok", ""),
    "partial": ("crash", "without a metrics line"),
    "markup": ("crash", "[/bold] [red]rank0[/red]: $(touch /tmp/autotune-pwned); `id`;"),
    "implausible": ("crash", "implausible metrics"),
}


# under Ray also: the worker process running a trial is killed, an infrastructure failure (its
# config is retried once, spending no budget)
EXPECTED_RAY = {**EXPECTED, "kill-worker": ("infra", "infrastructure failure on node")}


def _spec(write_spec, tmp_path: Path, *, ray: str, storage: str | None, faults: dict) -> Path:
    probe = tmp_path / "faulty_probe.py"
    probe.write_text(FAULTY_PROBE)
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir()
    tracking = f"tracking: {{storage: '{storage}'}}\n" if storage else ""
    text = TINY_TRAIN.replace(
        "backend: simulate",
        f"""backend:
  kind: command
  argv: [{sys.executable}, {probe}, --trial, "{{trial_file}}"]
  timeout_s: 4
  resources: {{num_cpus: 1}}
  env: {{FAULTS: "{",".join(faults)}", FAULT_DIR: "{fault_dir}"}}
{tracking}{ray}""",
    ).replace(
        "search: {n_trials: 6, seed: 1}",
        f"search: {{n_trials: {len(faults) + 1}, parallel_trials: 2, sampler: random, seed: 7, prune: false}}",
    )
    return write_spec(text, "faults.yaml")


def _mlflow_children(run_dir: Path) -> dict[int, object]:
    children = mlflow_runs(run_dir, "tiny")[1]
    numbers = [int(c.data.tags["autotune.trial"]) for c in children]
    assert len(numbers) == len(set(numbers)), f"a trial logged twice: {sorted(numbers)}"  # duplicated: 0
    return {int(c.data.tags["autotune.trial"]): c for c in children}


def _fault_matrix(write_spec, tmp_path: Path, *, ray: str, storage: str | None = None) -> None:
    faults = EXPECTED_RAY if "num_cpus" in ray else EXPECTED
    spec = _spec(write_spec, tmp_path, ray=ray, storage=storage, faults=faults)
    run_dir = tmp_path / "study"
    cli = CliRunner()
    result = cli.invoke(app, ["run", str(spec), "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert not Path("/tmp/autotune-pwned").exists()

    log = [json.loads(line) for line in (tmp_path / "faults" / "log.jsonl").read_text().splitlines()]
    fault_of = {e["trial"]: e["fault"] for e in log}
    assert set(faults) <= set(fault_of.values()), f"not every fault ran: {sorted(fault_of.values())}"
    report = json.loads(cli.invoke(app, ["report", str(spec), "--run-dir", str(run_dir), "--json"]).stdout)
    trials = {t["number"]: t for t in report["trials"]}
    children = _mlflow_children(run_dir)
    for number, fault in fault_of.items():  # lost: 0 (every probe is a trial, in Optuna and MLflow)
        status, reason = faults[fault]
        trial, child = trials[number], children[number]
        assert trial["status"] == status and child.data.tags["autotune.status"] == status, (fault, trial)
        if reason:
            assert reason in trial["failure"] and reason in child.data.tags["autotune.failure_reason"], (fault, trial)
        assert child.info.status == ("FINISHED" if status == "ok" else "FAILED")
    probed = {n for n, t in trials.items() if t["probed"] and t["status"] not in ("duplicate", "interrupted")}
    assert probed == set(fault_of) == set(children)  # counts equal in Optuna and MLflow

    # the best is never the implausible trial, and a re-run of the finished study changes nothing
    implausible = next(n for n, f in fault_of.items() if f == "implausible")
    assert report["best"] and report["best"][0]["number"] != implausible
    before = {n: c.info.run_id for n, c in children.items()}
    again = cli.invoke(app, ["run", str(spec), "--run-dir", str(run_dir)])
    assert again.exit_code == 0, again.output
    assert len((tmp_path / "faults" / "log.jsonl").read_text().splitlines()) == len(log)  # nothing probed again
    assert {n: c.info.run_id for n, c in _mlflow_children(run_dir).items()} == before


@pytest.mark.parametrize(
    "ray",
    # CI time: through Ray the same matrix takes 23 s; Ray's own fault paths (a killed worker, a cancelled
    # probe) have fast tests of their own (test_infrastructure, test_dispatcher_contract)
    ["ray: {enabled: false}", pytest.param("ray: {num_cpus: 2}", marks=pytest.mark.slow)],
    ids=["subprocess", "ray"],
)
def test_every_probe_fault_is_recorded_alike_in_optuna_and_mlflow(write_spec, tmp_path, ray):
    _fault_matrix(write_spec, tmp_path, ray=ray)


# ---------------------------------------------------------------------------------- PostgreSQL
def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    return str(versions[-1]) if versions else None


@pytest.fixture
def postgres():
    """A throwaway PostgreSQL server on loopback (initdb + pg_ctl from the Debian package, run as
    the ``postgres`` user when the tests run as root); skipped, with the reason, where it cannot start."""
    pytest.importorskip("psycopg2", reason="psycopg2 is not installed (pip install psycopg2-binary)")
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))  # pytest's tmp is private to root: postgres cannot enter it
    data = root / "data"
    run_as: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        if not shutil.which("runuser"):
            pytest.skip("running as root without runuser: cannot start PostgreSQL as another user")
        run_as = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres")
    port = free_port()
    try:
        subprocess.run(
            [*run_as, initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        subprocess.run(
            [
                *run_as,
                pg_ctl,
                "-D",
                str(data),
                "-l",
                str(root / "server.log"),
                "-w",
                "-t",
                "60",
                "-o",
                f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off",
                "start",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, LookupError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"PostgreSQL did not start: {exc} {detail.decode(errors='replace')[-300:]}")
    try:
        import psycopg2

        deadline = time.monotonic() + 30
        while True:
            try:
                conn = psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres")
                break
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        conn.autocommit = True
        conn.cursor().execute("CREATE DATABASE autotune")
        conn.close()
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/autotune"
    finally:
        subprocess.run([*run_as, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def test_the_fault_matrix_on_postgresql(write_spec, tmp_path, postgres):
    _fault_matrix(write_spec, tmp_path, ray="ray: {enabled: false}", storage=postgres)
