"""Every phase of the CLI a user waits on announces itself and moves (issue #34: 12-23 s of
silence after "opening the MLflow store", calibration silent for 55 s, doctor for 22-26 s).

The commands run as a user runs them (the installed entry point, output on a pipe, where no
spinner draws) with the progress interval at 20 ms, so each phase that lasts longer than that
must print its name, then a line that moves (still ..., a new step, or done in ...). How long
the phases take is measured in benchmarks/silences.py, not asserted here."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from autotune.tracking.progress import PROGRESS_EVERY_ENV

ROOT = Path(__file__).resolve().parents[1]


def _stderr(args: list[str], tmp_path: Path, timeout: int = 300) -> list[str]:
    exe = shutil.which("autotune")
    assert exe, "the autotune entry point is installed with the package"
    env = {**os.environ, PROGRESS_EVERY_ENV: "0.02", "AUTOTUNE_MLFLOW_SCHEMA_CACHE": str(tmp_path / "schema")}
    done = subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr.splitlines()


def _moves(lines: list[str], name: str) -> None:
    """``name`` is announced on a line of its own, and a later line of the same phase moves."""
    starts = [i for i, line in enumerate(lines) if line.startswith(name)]
    assert starts, f"{name!r} never announced in:\n" + "\n".join(lines)
    after = lines[starts[0] + 1 :]
    moving = [line for line in after if line.startswith(("  … ", f"  {name}"))]
    assert moving, f"{name!r} announced but never moved:\n" + "\n".join(lines)


def test_a_run_announces_and_moves_through_the_store_the_ranking_and_the_writing(tmp_path):
    lines = _stderr(
        ["run", str(ROOT / "search_spaces/llama2_7b_8npu.yaml"), "--run-dir", str(tmp_path / "run"), "--n-trials", "4"],
        tmp_path,
    )
    for name in ("opening the MLflow store", "ranking the space", "writing the results"):
        _moves(lines, name)


def test_calibration_announces_each_step(tmp_path):
    pytest.importorskip("torch")
    lines = _stderr(["calibrate", "--quick", "--ranks", "1", "--out", str(tmp_path / "host.yaml")], tmp_path)
    _moves(lines, "measuring cpu")
    steps = [line for line in lines if line.startswith("  measuring cpu (quick): GEMM")]
    assert len(steps) >= 3  # one per GEMM shape and precision: the detail changes as it goes


def test_doctor_announces_ray_and_each_node(tmp_path):
    lines = _stderr(["doctor"], tmp_path)
    _moves(lines, "starting or joining")
    _moves(lines, "asking each node")
    assert any("1/1 node(s) answered" in line for line in lines)
