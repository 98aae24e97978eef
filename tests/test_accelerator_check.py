"""benchmarks/accelerator_check.py (issue #42) at its smallest size on this CPU: the tiny model, one
gloo rank, every step (sweep, calibration, memory profile, full probe, comparison) run as it runs on
a GPU, with optuna, Ray and MLflow made unimportable (the device machine has none of them), and
the JSON and Markdown it writes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

SCRIPT = REPO / "benchmarks" / "accelerator_check.py"
STEPS = ("sweep", "calibrate", "memory_profile", "full_probe", "comparison")


def _module():
    spec = importlib.util.spec_from_file_location("accelerator_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocked(tmp_path: Path) -> dict[str, str]:
    """An environment in which ``import optuna`` (ray, mlflow) fails, in every child process too."""
    stubs = tmp_path / "blocked"
    for name in ("optuna", "ray", "mlflow"):
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(
            f"raise ImportError('{name} is blocked: the accelerator check must not need it')\n"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stubs), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in ("AUTOTUNE_MEMORY_LIMIT_GIB", "AUTOTUNE_INJECT_NAN_STEP"):
        env.pop(key, None)
    return env


# slow: it times the device's GEMM plateau, then steps against it; beside another test (the suite runs two
# at a time) the two readings see different loads (a CI run read an MFU of 5.0): it runs alone, with -n 0
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_tiny_check_on_the_cpu_writes_its_json_and_markdown(tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, str(SCRIPT), "--device", "cpu", "--size", "tiny", "--out", str(out)]
    argv += ["--configs", "2", "--budget-s", "1500", "--quiet"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_blocked(tmp_path), timeout=1700, cwd=tmp_path)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    report = json.loads((out / "accelerator_check.json").read_text())
    for key in ("check", "schema", "device", "size", "model", "budget_s", "wall_s", "steps", "ok", "exit_code"):
        assert key in report, key
    assert report["device"] | {"requested": "cpu", "resolved": "cpu"} == report["device"]
    assert report["imports_seen"] == [] and report["exit_code"] == proc.returncode
    steps = report["steps"]
    assert {name: steps[name]["status"] for name in STEPS} == dict.fromkeys(STEPS, "ok"), json.dumps(steps, indent=1)

    configs = steps["sweep"]["configs"]
    assert [c["name"] for c in configs] == ["mbs2-none-fp32", "mbs2-full-fp32"]
    for row in configs:
        assert row["status"] == "ok" and row["peak_memory_counts"] == "device"
        assert row["step_time_s"] > 0 and row["tokens_per_s_per_device"] > 0 and row["peak_memory_gib"] > 0
        assert 0 < row["mfu_calibrated"] < 1  # against the calibrated fp32 plateau
    assert set(steps["calibrate"]["figures"]["peak_tflops"]) >= {"bf16", "fp16", "fp32"}
    # the simulator's reading of the sweep, with the calibrated profile and the data sheet's
    sim = report["simulator"]
    assert sim["data_sheet_profile"] == "cpu" and [r["name"] for r in sim["configs"]] == [c["name"] for c in configs]
    for label in ("calibrated", "data_sheet"):
        assert sim[label]["configs"] == 2 and sim[label]["median_ratio_predicted_over_measured"] > 0, sim
    assert (out / "calibrated_profile.yaml").exists()

    profile = steps["memory_profile"]
    assert profile["layers_per_stage"] == [1, 2] and profile["full_layers_per_stage"] == 4
    assert [r["status"] for r in profile["runs"]] == ["ok", "ok"]
    low, high = profile["band_gib"]
    assert low < profile["predicted_peak_gib"] < high
    comparison = steps["comparison"]
    for key in ("measured_peak_gib", "predicted_peak_gib", "band_gib", "in_band", "error_rel", "z", "sweep_repeat_gib"):
        assert key in comparison, key
    assert comparison["measured_peak_gib"] == steps["full_probe"]["peak_memory_gib"]
    assert report["ok"] == comparison["in_band"]

    text = (out / "accelerator_check.md").read_text()
    for words in ("# Accelerator check", "## Sweep", "## Calibration", "## Memory profile and full probe", "band"):
        assert words in text, words
    assert all(f"| {name} | ok |" in text for name in STEPS)


def test_no_such_device_is_said_and_written_not_a_traceback(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "out"
    argv = [sys.executable, str(SCRIPT), "--device", "cuda", "--size", "tiny", "--out", str(out), "--quiet"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_blocked(tmp_path), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    report = json.loads((out / "accelerator_check.json").read_text())
    assert report["device"]["resolved"] is None and "no CUDA device" in report["device"]["words"]
    assert all(report["steps"][name]["status"] == "skipped" for name in STEPS)
    assert "nothing ran" in (out / "accelerator_check.md").read_text()


def test_the_comparison_reads_the_band_as_a_study_records_it():
    compare = _module().compare
    profile = {"status": "ok", "predicted_peak_gib": 10.0, "sd_gib": 0.2, "band_gib": [9.4, 10.6]}
    full = {"status": "ok", "name": "ref", "peak_memory_gib": 10.3, "peak_memory_counts": "allocated"}
    full["tokens_per_s_per_device"] = 42667.6  # the H200's full probe and sweep run, 2026-11-30
    sweep = {"configs": [{"name": "ref", "status": "ok", "peak_memory_gib": 10.2, "tokens_per_s_per_device": 42964.3}]}
    inside = compare(profile, full, sweep)
    assert inside["in_band"] and inside["error_rel"] == 0.03 and inside["z"] == 1.5
    assert inside["repeat_delta_rel"] == pytest.approx(0.0098, abs=1e-4)
    assert inside["repeat_tokens_delta_rel"] == pytest.approx(-0.0069, abs=1e-4)
    assert "repeat_tokens_delta_rel" not in compare(profile, {**full, "tokens_per_s_per_device": None}, sweep)
    outside = compare(profile, {**full, "peak_memory_gib": 11.0}, {})
    assert not outside["in_band"] and "OUT OF the band" in outside["message"]
    assert compare({"status": "failed"}, full, sweep)["status"] == "skipped"


def test_the_1b_sweep_covers_micro_batch_recompute_precision_and_the_allocator():
    module = _module()
    configs = module.sweep_configs("1b", "cuda")
    assert module.reference_config("1b", "cuda") == configs[0]
    assert {c["params"]["micro_batch_size"] for c in configs} == {1, 4}
    assert {c["params"]["recompute"] for c in configs} == {"none", "selective", "full"}
    assert {c["params"]["precision"] for c in configs} == {"bf16", "fp32"}
    assert any(c["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} for c in configs)
    request = module.make_request("1b", "cuda", configs[0], 0)
    assert request.backend == {"launcher": "spawn"} and request.cluster["world_size"] == 1
    assert module.plan_profile(request.model, request.params) == (1, 4)  # 16 layers: profiles at 1 and 4


def test_a_bare_checkout_gets_the_installed_layout(tmp_path):
    """On a device machine where the project was copied, not installed, ``autotune.workers`` is
    still the repo's ``workers/`` (a folder of symlinks, on PYTHONPATH for the probes it starts)."""
    code = f"""
import importlib.util, os, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
for name in [m for m in sys.modules if m.startswith("autotune")]:
    del sys.modules[name]
spec = importlib.util.spec_from_file_location("accelerator_check", {str(SCRIPT)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
import autotune.workers.command, autotune.objectives, subprocess
from pathlib import Path
where = autotune.workers.command.__file__
# a child as a probe starts (no site-packages, so no editable install: only PYTHONPATH and its
# working folder), in the folder the check starts its children in and, for contrast, in the checkout
child = [sys.executable, "-S", "-c", "import autotune.workers.protocol"]
rcs = [subprocess.run(child, cwd=cwd, capture_output=True).returncode for cwd in (module.CHILD_CWD, module.REPO)]
print(where, Path(where).resolve(), os.environ.get("PYTHONPATH", ""), *rcs)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, resolved, pythonpath, in_child_cwd, in_checkout = proc.stdout.split()
    # the first GPU run failed so: every probe started in the checkout, whose bare autotune/ has no workers
    assert (in_child_cwd, in_checkout) == ("0", "1")
    assert where.endswith("autotune/workers/command.py") and Path(resolved) == REPO / "workers" / "command.py"
    assert where.startswith(pythonpath.split(os.pathsep)[0])


H200_RUN = REPO / "benchmarks" / "data" / "accelerator_check_h200"


def test_the_h200_run_is_read_again_by_the_simulator(tmp_path):
    """The check's run on one NVIDIA H200 (2026-11-28; the files as the device wrote them): the
    calibrated plateau lies below the data sheet's dense bf16 peak (the first run's fit put it at
    2,734 TFLOP/s, see test_calibrate), and the simulator with that profile reads the sweep's
    tokens/s within 20 % (median) and ranks it (the data-sheet H100 profile, 20 % optimistic)."""
    import shutil

    import yaml

    out = tmp_path / "h200"
    shutil.copytree(H200_RUN, out)
    profile = yaml.safe_load((out / "calibrated_profile.yaml").read_text())
    assert 600 < profile["peak_tflops"]["bf16"] < 990 and 40 < profile["peak_tflops"]["fp32"] < 67
    assert "not fitted, host-bound" in (out / "calibrated_profile.yaml").read_text()
    assert _module().resimulate(out) == 0
    sim = json.loads((out / "accelerator_check.json").read_text())["simulator"]
    assert sim["data_sheet_profile"] == "h100-sxm-80gb" and len(sim["configs"]) == 6
    calibrated, sheet = sim["calibrated"], sim["data_sheet"]
    assert calibrated["median_abs_error_tokens_per_s"] < 0.2 and calibrated["spearman_tokens_per_s"] >= 0.8
    assert calibrated["median_abs_error_tokens_per_s"] < sheet["median_abs_error_tokens_per_s"]
    assert calibrated["median_abs_error_peak"] < 0.02  # the probe's allocated peak, by the probe's memory rule
    assert "## The simulator against the sweep" in (out / "accelerator_check.md").read_text()


def test_an_mfu_above_one_is_kept_and_said_to_be_no_reading():
    """A sweep faster than the calibrated plateau (the load changed between them: a CI run beside
    another test read 5.0) is reported with why, not as a utilisation."""
    check = _module()
    assert check.mfu_reading(1000.0, 6e9, 12.0) == (0.5, "")
    mfu, note = check.mfu_reading(10_000.0, 6e9, 12.0)
    assert mfu == 5.0 and "load" in note and "idle" in note
