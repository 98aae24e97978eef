"""A check on a real accelerator (issue #42): the torch probe, calibration and memory profiles on one device.

    python benchmarks/accelerator_check.py --device auto --size 1b --out acc-check/     # one GPU, <= 8 min
    python benchmarks/accelerator_check.py --device cpu --size tiny --out /tmp/acc     # CI: tiny model, gloo

On one device (``--device auto``: CUDA, else an Ascend NPU, else the CPU), in order, within
``--budget-s`` (480 s by default; each phase gets a share and hands what it leaves to the next):

1. **sweep**: the torch probe on a random-weight Llama (``--size 1b``: Llama-3.2-1B's shape, 16
   layers, hidden 2048, seq 2048; ``tiny``: the ``tiny-llama`` preset, seq 64) over a handful of
   configs (micro-batch, recompute none/selective/full, bf16/fp32, the allocator's
   ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_NPU_ALLOC_CONF``), each run as the dispatcher runs a
   trial: a trial file, ``launch.probe_argv`` (the ``spawn`` launcher, fresh processes; one rank,
   so on the CPU a gloo process group of one) and ``workers.command.run_probe_process``;
2. **calibrate**: ``python -m autotune.workers.calibrate --quick --ranks 1`` (GEMM plateaus per
   precision, memory bandwidth, attention, dispatch): the device profile the simulator would use;
   each sweep config's MFU is then read against the measured plateau;
3. **memory_profile**: the reference config (the sweep's second) with 1 and then a quarter of
   its layers per stage, 4 at least (``memory_profile.plan_profile`` / ``profile_request``, one
   warm-up and one measured step each), the line through their peaks read at the full model
   (``extrapolate_peak``, this accelerator's profile noise): the predicted peak and its band,
   mean +- ``profiling.BAND_SD`` sd, as a study records it; on a device also the allocator's
   reserved peak and P(fits) against the memory the allocator could use, as ``MemoryProfiler``
   decides;
4. **full_probe**: the reference config in full, a fresh process;
5. **comparison**: the full probe's measured peak against the band (in or out, the error, z).

Writes ``accelerator_check.json`` and ``accelerator_check.md`` into ``--out``. Only torch and the
project's own probe code are imported (no optuna, Ray or MLflow: the device machine may have none;
``imports_seen`` in the JSON lists any that were loaded); calibration also needs PyYAML and numpy,
and says so when they are missing. A step that cannot run (no such device, a probe that crashed,
the time budget spent) is recorded with the reason and the next steps still run where they can.
Exit 0: every step ran and the measured peak fell in the band; 1: the check ran, something
failed, was skipped or fell outside the band; 2: nothing could run (no torch, no such device).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _project_importable() -> Path:
    """The project's code from this checkout, installed or not; returns the folder the child
    processes (probes, calibration) start in. Installed, ``autotune.workers`` and
    ``autotune.objectives`` are the repo's ``workers/`` and ``objectives/`` (pyproject's
    package-dir), and the children start in the checkout. A bare copy of the tree (a device machine
    where nothing was installed) gets the same layout from a folder of symlinks, put on
    ``PYTHONPATH`` so the probes it starts see it too, and the children start in that folder: a
    ``python -m`` child puts its working folder first on its path, and in the checkout that is the
    bare ``autotune/`` without ``workers`` (the first GPU run of this check failed so)."""
    import importlib
    import os

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        importlib.import_module("autotune.workers.torch_probe.launch")
        importlib.import_module("autotune.objectives")
        return REPO
    except ImportError:
        pass
    import atexit
    import shutil

    shim = Path(tempfile.mkdtemp(prefix="autotune-layout-"))
    atexit.register(shutil.rmtree, shim, True)
    package = shim / "autotune"
    package.mkdir()
    for item in (REPO / "autotune").iterdir():
        if item.name not in ("workers", "objectives", "__pycache__"):
            (package / item.name).symlink_to(item)
    (package / "workers").symlink_to(REPO / "workers")
    (package / "objectives").symlink_to(REPO / "objectives")
    for name in [m for m in sys.modules if m == "autotune" or m.startswith("autotune.")]:
        del sys.modules[name]
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    return shim


CHILD_CWD = _project_importable()

from autotune.guide.memory_profile import (  # noqa: E402
    extrapolate_peak,
    layers_per_stage,
    plan_profile,
    profile_noise,
    profile_points,
    profile_request,
)
from autotune.study.profiling import BAND_SD  # noqa: E402
from autotune.workers.command import run_probe_process  # noqa: E402
from autotune.workers.protocol import (  # noqa: E402
    PEAK_COUNTS_KEY,
    PEAK_LEAVES_OUT,
    USABLE_KEY,
    TrialRequest,
    write_trial_file,
)
from autotune.workers.torch_probe.launch import probe_argv  # noqa: E402

SCHEMA = 1
HEAVY = ("optuna", "ray", "mlflow")  # what the device machine does not have

# The tiny-llama preset (autotune/spec/models.py) and Llama-3.2-1B's shape, random weights either way
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
LLAMA_1B = dict(
    name="llama3.2-1b-shape",
    arch="llama",
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
SIZES: dict[str, dict[str, Any]] = {
    # seconds: the most one probe may take (its share of the budget permitting)
    "tiny": dict(model=TINY, seq_len=64, mbs=(1, 2), warmup=1, measured=2, probe_cap_s=300, min_probe_s=20),
    "1b": dict(model=LLAMA_1B, seq_len=2048, mbs=(1, 4), warmup=2, measured=3, probe_cap_s=240, min_probe_s=45),
}
SHARES = {"sweep": 0.45, "calibrate": 0.15, "memory": 0.40}  # of the budget; what a phase leaves moves on
ALLOC_ENV = {"cuda": "PYTORCH_CUDA_ALLOC_CONF", "npu": "PYTORCH_NPU_ALLOC_CONF", "cpu": "PYTORCH_CUDA_ALLOC_CONF"}
STEP_NAMES = ("sweep", "calibrate", "memory_profile", "full_probe", "comparison")


# --------------------------------------------------------------------------------------- configs
def sweep_configs(size: str, device: str) -> list[dict[str, Any]]:
    """The sweep, the reference config (what the memory profile predicts) first. On the tiny
    (CPU) size the reference runs fp32: a CPU without native bf16 runs bf16 10-50x slower."""
    lo, hi = SIZES[size]["mbs"]
    alloc = ALLOC_ENV[device]
    main = "fp32" if size == "tiny" else "bf16"
    other = "bf16" if main == "fp32" else "fp32"
    configs = [
        (f"mbs{hi}-none-{main}", {"micro_batch_size": hi, "recompute": "none", "precision": main}, {}),
        (f"mbs{hi}-full-{main}", {"micro_batch_size": hi, "recompute": "full", "precision": main}, {}),
        (
            f"mbs{hi}-none-{main}-expandable",
            {"micro_batch_size": hi, "recompute": "none", "precision": main},
            {alloc: "expandable_segments:True"},
        ),
        (f"mbs{lo}-none-{other}", {"micro_batch_size": lo, "recompute": "none", "precision": other}, {}),
        (f"mbs{hi}-selective-{main}", {"micro_batch_size": hi, "recompute": "selective", "precision": main}, {}),
        (f"mbs{lo}-none-{main}", {"micro_batch_size": lo, "recompute": "none", "precision": main}, {}),
    ]
    return [{"name": n, "params": p, "env": e} for n, p, e in configs]


def reference_config(size: str, device: str) -> dict[str, Any]:
    return sweep_configs(size, device)[0]


def make_request(size: str, device: str, config: dict[str, Any], number: int) -> TrialRequest:
    """A trial as the runner resolves one: canonical params (env.* included), the model mapping,
    the workload and the cluster; one rank, the ``spawn`` launcher (fresh processes)."""
    s = SIZES[size]
    params = {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0, "grad_accum": 1, **config["params"]}
    params.update({f"env.{k}": v for k, v in config["env"].items()})
    mbs = int(params["micro_batch_size"])
    return TrialRequest(
        params=params,
        model=dict(s["model"]),
        workload=dict(
            kind="train",
            seq_len=s["seq_len"],
            global_batch_size=mbs,
            warmup_steps=s["warmup"],
            measured_steps=s["measured"],
            timeout_s=float(s["probe_cap_s"]),
            profile_step=False,
        ),
        cluster=dict(accelerator=device, nodes=1, devices_per_node=1, world_size=1, hardware={}),
        study="accelerator-check",
        number=number,
        backend={"launcher": "spawn"},
    )


# ------------------------------------------------------------------------------------- the clock
class Clock:
    """The budget: each phase may run until its deadline (the budget's end less the shares of the
    phases after it), so a slow phase cannot eat the memory comparison's time."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.budget_s = float(budget_s)

    def deadline(self, phase: str) -> float:
        later = {"sweep": SHARES["calibrate"] + SHARES["memory"], "calibrate": SHARES["memory"], "memory": 0.0}
        return self.start + self.budget_s * (1.0 - later[phase])

    def left(self, phase: str) -> float:
        return self.deadline(phase) - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


# ------------------------------------------------------------------------------------ the device
def resolve_device(requested: str) -> tuple[str | None, str]:
    """(device, words): the device to check, or None and why none can be. Imports torch (no
    device context is created: the probes are the ones that use the device)."""
    try:
        import torch
    except ImportError as exc:
        return None, f"torch is not importable ({exc}); the check needs torch"
    if requested in ("auto", "cuda"):
        if torch.cuda.is_available():
            return "cuda", f"CUDA ({torch.cuda.device_count()} device(s) visible, torch {torch.__version__})"
        if requested == "cuda":
            return None, f"--device cuda: no CUDA device is visible to torch {torch.__version__}"
    if requested in ("auto", "npu"):
        try:
            import torch_npu  # noqa: F401

            if torch.npu.is_available():  # type: ignore[attr-defined]
                return "npu", f"Ascend NPU (torch_npu, torch {torch.__version__})"
            why = "torch_npu sees no NPU"
        except Exception as exc:  # no torch_npu, or one that cannot start
            why = f"torch_npu is not usable ({type(exc).__name__}: {str(exc)[:200]})"
        if requested == "npu":
            return None, f"--device npu: {why}"
    return "cpu", f"CPU (torch {torch.__version__}, gloo)" + (
        "; --device auto found no CUDA or NPU device" if requested == "auto" else ""
    )


# ---------------------------------------------------------------------------------------- probes
def run_probe(request: TrialRequest, work: Path, timeout_s: float) -> dict[str, Any]:
    """One probe, as the dispatcher runs it (trial file, probe_argv, run_probe_process); its
    status, reason, wall time, metrics and info."""
    trial = write_trial_file(request, work / f"trial-{request.number:03d}.json")
    argv = probe_argv(request, sys.executable, str(trial))
    began = time.monotonic()
    result = run_probe_process(argv, request.env(), trial, timeout_s, cwd=CHILD_CWD)
    return {
        "status": result.status,
        "reason": (result.reason or "")[-600:],
        "wall_s": round(time.monotonic() - began, 2),
        "metrics": {k: v for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))},
        "info": result.info or {},
        "log_tail": "" if result.ok else (result.log_tail or "")[-1500:],
    }


def _round(value: Any, digits: int = 4) -> Any:
    return round(float(value), digits) if isinstance(value, (int, float)) and math.isfinite(float(value)) else None


def _probe_row(config: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    m = run["metrics"]
    return {
        "name": config["name"],
        "params": config["params"],
        "env": config["env"],
        "status": run["status"],
        "reason": run["reason"],
        "wall_s": run["wall_s"],
        "step_time_s": _round(m.get("step_time_s")),
        "tokens_per_s_per_device": _round(m.get("tokens_per_s_per_device"), 1),
        "peak_memory_gib": _round(m.get("peak_memory_gib")),
        "peak_reserved_gib": _round(m.get("peak_reserved_gib")),
        "peak_memory_counts": run["info"].get(PEAK_COUNTS_KEY),
        "usable_memory_gib": _round(run["info"].get(USABLE_KEY)),
        "mfu_calibrated": None,
        **({"log_tail": run["log_tail"]} if run["log_tail"] else {}),
    }


def step_sweep(args: argparse.Namespace, device: str, clock: Clock, work: Path, out: dict) -> None:
    s = SIZES[args.size]
    rows, skipped = [], []
    for i, config in enumerate(sweep_configs(args.size, device)[: args.configs]):
        left = clock.left("sweep")
        if left < s["min_probe_s"]:
            skipped.append(config["name"])
            rows.append({"name": config["name"], "params": config["params"], "env": config["env"], "status": "skipped"})
            continue
        request = make_request(args.size, device, config, i)
        run = run_probe(request, work, min(s["probe_cap_s"], left))
        rows.append(_probe_row(config, run))
        if run["info"].get("device"):
            out["device"].setdefault("name", run["info"]["device"])
            out["device"].setdefault("software", run["info"].get("software"))
        _say(args, f"sweep {config['name']}: {run['status']} in {run['wall_s']:.1f} s {_brief(rows[-1])}")
    ok = [r for r in rows if r["status"] == "ok"]
    status = "ok" if len(ok) == len(rows) else ("failed" if not ok else "partial")
    message = f"{len(ok)} of {len(rows)} configs measured"
    if skipped:
        message += f"; skipped (the sweep's share of the budget was spent): {', '.join(skipped)}"
    failed = [r for r in rows if r["status"] not in ("ok", "skipped")]
    if failed:
        message += "; " + "; ".join(f"{r['name']}: {r['status']} ({r['reason'][:160]})" for r in failed)
    if device == "cpu" and any(c["env"] for c in rows):
        message += f"; on the CPU {ALLOC_ENV[device]} only goes through the probe's env path (no allocator reads it)"
    out["steps"]["sweep"] = {"status": status, "message": message, "configs": rows}


def _brief(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return f"({row.get('reason', '')[:200]})"
    return (
        f"(step {row['step_time_s']} s, {row['tokens_per_s_per_device']} tokens/s, "
        f"peak {row['peak_memory_gib']} GiB {row['peak_memory_counts']})"
    )


def step_calibrate(args: argparse.Namespace, device: str, clock: Clock, work: Path, out: dict) -> None:
    left = clock.left("calibrate")
    if left < 15:
        out["steps"]["calibrate"] = {"status": "skipped", "message": "no time left in the budget for calibration"}
        return
    path = work / "calibrated_profile.yaml"
    argv = [sys.executable, "-m", "autotune.workers.calibrate", "--accelerator", device, "--out", str(path)]
    argv += ["--quick", "--ranks", "1"]
    began = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=left, cwd=str(CHILD_CWD))
    except subprocess.TimeoutExpired:
        out["steps"]["calibrate"] = {
            "status": "failed",
            "message": f"calibration ran past its share of the budget ({left:.0f} s)",
            "wall_s": round(time.monotonic() - began, 1),
        }
        return
    wall = round(time.monotonic() - began, 1)
    if proc.returncode != 0 or not path.exists():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        out["steps"]["calibrate"] = {
            "status": "failed",
            "message": f"calibration exited {proc.returncode}: {' | '.join(tail)[-500:]}",
            "wall_s": wall,
        }
        return
    figures: dict[str, Any] = {}
    try:
        import yaml

        profile = yaml.safe_load(path.read_text())
        figures = {
            k: profile.get(k)
            for k in (
                "peak_tflops",
                "gemm_half_dim",
                "memory_bandwidth_gbps",
                "memory_bandwidth_efficiency",
                "flash_attention_efficiency",
                "kernel_launch_us",
                "device_memory_gib",
            )
        }
    except Exception as exc:  # the profile was written; only its figures cannot be shown
        figures = {"unreadable": f"{type(exc).__name__}: {exc}"}
    out["steps"]["calibrate"] = {
        "status": "ok",
        "message": f"quick calibration, 1 rank, in {wall:.0f} s",
        "wall_s": wall,
        "profile_path": str(path),
        "figures": figures,
    }
    _say(args, f"calibrate: ok in {wall:.1f} s, peak TFLOP/s {figures.get('peak_tflops')}")
    peaks = figures.get("peak_tflops") if isinstance(figures.get("peak_tflops"), dict) else {}
    try:
        from autotune.objectives import flops_per_token

        per_token = flops_per_token(SIZES[args.size]["model"], SIZES[args.size]["seq_len"], training=True)
    except Exception:  # noqa: BLE001 - MFU is a reading of the sweep, not a step of its own
        per_token = None
    for row in out["steps"].get("sweep", {}).get("configs", []):
        peak = peaks.get(row["params"].get("precision")) if peaks else None
        tps = row.get("tokens_per_s_per_device")
        if per_token and isinstance(peak, (int, float)) and peak > 0 and isinstance(tps, (int, float)):
            row["mfu_calibrated"], note = mfu_reading(tps, per_token, peak)
            if note:
                row["mfu_note"] = note


def mfu_reading(tokens_per_s: float, flops_per_token: float, peak_tflops: float) -> tuple[float, str]:
    """The sweep's MFU against the calibrated GEMM plateau, and why it cannot be read as one where it
    exceeds 1: the steps ran faster than the plateau measured, so the load changed between the two
    (another process on the cores during the calibration), and the plateau is no ceiling here."""
    mfu = round(tokens_per_s * flops_per_token / (peak_tflops * 1e12), 4)
    if mfu <= 1:
        return mfu, ""
    return mfu, (
        f"above 1 ({mfu:.2f}): the steps ran faster than the calibration's GEMM plateau, so the device's load "
        "changed between them; run the check on an idle device"
    )


def step_memory(args: argparse.Namespace, device: str, clock: Clock, work: Path, out: dict) -> None:
    """The reference config's memory profile, then its full probe, then the comparison."""
    s = SIZES[args.size]
    config = reference_config(args.size, device)
    full = make_request(args.size, device, config, 100)
    per_stage = layers_per_stage(full.model, full.params)
    layers = plan_profile(full.model, full.params)
    steps = out["steps"]
    if layers is None:
        steps["memory_profile"] = {
            "status": "skipped",
            "message": f"{per_stage:g} layers per stage: too few to profile",
        }
    else:
        runs, peaks, reserved, usable = [], {}, {}, []
        for n, k in enumerate(layers):
            left = clock.left("memory") - s["min_probe_s"]  # the full probe's time kept back
            if left < s["min_probe_s"]:
                runs.append({"layers_per_stage": k, "status": "skipped", "reason": "the budget was spent"})
                continue
            scaled = profile_request(full, k)
            scaled.number = 200 + n
            run = run_probe(scaled, work, min(s["probe_cap_s"], left))
            runs.append(
                {
                    "layers_per_stage": k,
                    "status": run["status"],
                    "reason": run["reason"],
                    "wall_s": run["wall_s"],
                    "peak_memory_gib": _round(run["metrics"].get("peak_memory_gib")),
                    "peak_reserved_gib": _round(run["metrics"].get("peak_reserved_gib")),
                }
            )
            _say(args, f"memory profile at {k} layer(s) per stage: {run['status']} {runs[-1]['peak_memory_gib']} GiB")
            if run["status"] != "ok":
                continue
            for stage, gib in profile_points(run["metrics"], run["info"]).items():
                peaks.setdefault(stage, {})[float(k)] = gib
            r = run["metrics"].get("peak_reserved_gib")
            if isinstance(r, (int, float)) and r > 0:
                reserved[float(k)] = float(r)
            u = run["info"].get(USABLE_KEY)
            if isinstance(u, (int, float)) and u > 0:
                usable.append(float(u))
        record: dict[str, Any] = {
            "config": config["name"],
            "layers_per_stage": list(layers),
            "full_layers_per_stage": per_stage,
            "runs": runs,
            "noise_rel": profile_noise(device),
            "band_sd": BAND_SD,
        }
        try:
            estimate = extrapolate_peak(peaks, per_stage, profile_noise(device))
        except ValueError as exc:
            steps["memory_profile"] = {**record, "status": "failed", "message": f"no line to read: {exc}"}
        else:
            record.update(
                predicted_peak_gib=round(estimate.peak_gib, 4),
                sd_gib=round(estimate.sd_gib, 4),
                band_gib=[
                    round(estimate.peak_gib - BAND_SD * estimate.sd_gib, 4),
                    round(estimate.peak_gib + BAND_SD * estimate.sd_gib, 4),
                ],
            )
            if len(reserved) >= 2:  # a device's allocator: its reserved peak, as MemoryProfiler reads it
                line = extrapolate_peak({0: reserved}, per_stage, profile_noise(device))
                record.update(
                    predicted_reserved_gib=round(line.peak_gib, 4),
                    reserved_band_gib=[
                        round(line.peak_gib - BAND_SD * line.sd_gib, 4),
                        round(line.peak_gib + BAND_SD * line.sd_gib, 4),
                    ],
                )
                if usable:
                    from statistics import NormalDist

                    sd = math.hypot(line.sd_gib, 0.002 * min(usable))
                    record["usable_gib"] = round(min(usable), 4)
                    record["p_fits"] = round(NormalDist().cdf((min(usable) - line.peak_gib) / max(sd, 1e-9)), 4)
            steps["memory_profile"] = {
                **record,
                "status": "ok",
                "message": (
                    f"profiles at {', '.join(map(str, layers))} layers per stage predict "
                    f"{estimate.peak_gib:.4g} +- {estimate.sd_gib:.2g} GiB at {per_stage:g}"
                ),
            }
    # the full probe, a fresh process, whatever the profile gave
    left = clock.left("memory")
    if left < s["min_probe_s"]:
        steps["full_probe"] = {"status": "skipped", "message": "no time left in the budget for the full probe"}
    else:
        run = run_probe(full, work, min(s["probe_cap_s"], left))
        row = _probe_row(config, run)
        steps["full_probe"] = {
            **row,
            "message": f"{config['name']} in full: {run['status']}"
            + (f" ({run['reason'][:300]})" if run["reason"] else ""),
        }
        _say(args, f"full probe {config['name']}: {run['status']} {_brief(row)}")
    steps["comparison"] = compare(steps.get("memory_profile", {}), steps.get("full_probe", {}), steps.get("sweep", {}))


def compare(profile: dict[str, Any], full: dict[str, Any], sweep: dict[str, Any]) -> dict[str, Any]:
    """The full probe's measured peak against the profile's band (and its reserved peak against
    the reserved band, on a device); the sweep's run of the same config as a repeat."""
    if profile.get("status") != "ok" or full.get("status") != "ok":
        missing = [n for n, s in (("memory_profile", profile), ("full_probe", full)) if s.get("status") != "ok"]
        return {"status": "skipped", "message": f"nothing to compare: {', '.join(missing)} did not run to the end"}
    measured = full.get("peak_memory_gib")
    low, high = profile["band_gib"]
    predicted, sd = profile["predicted_peak_gib"], profile["sd_gib"]
    if not isinstance(measured, (int, float)):
        return {"status": "failed", "message": "the full probe reported no peak memory"}
    out: dict[str, Any] = {
        "status": "ok",
        "measured_peak_gib": measured,
        "counts": full.get("peak_memory_counts"),
        "predicted_peak_gib": predicted,
        "band_gib": [low, high],
        "in_band": bool(low <= measured <= high),
        "error_rel": round(measured / predicted - 1.0, 4) if predicted else None,
        "z": round((measured - predicted) / sd, 2) if sd else None,
    }
    if "reserved_band_gib" in profile and isinstance(full.get("peak_reserved_gib"), (int, float)):
        rlow, rhigh = profile["reserved_band_gib"]
        out["measured_reserved_gib"] = full["peak_reserved_gib"]
        out["reserved_band_gib"] = [rlow, rhigh]
        out["reserved_in_band"] = bool(rlow <= full["peak_reserved_gib"] <= rhigh)
    repeat = next(
        (r for r in sweep.get("configs", []) if r.get("name") == full.get("name") and r.get("status") == "ok"), None
    )
    if repeat and isinstance(repeat.get("peak_memory_gib"), (int, float)) and repeat["peak_memory_gib"] > 0:
        out["sweep_repeat_gib"] = repeat["peak_memory_gib"]
        out["repeat_delta_rel"] = round(measured / repeat["peak_memory_gib"] - 1.0, 4)
    # the same pair of runs read for throughput: the device's noise between runs, one pair (issue 44: a
    # study's noise floor is its probes' own steps; on one H200 0.7 % apart here, 0.25 % on a 3B study)
    speed, again = full.get("tokens_per_s_per_device"), (repeat or {}).get("tokens_per_s_per_device")
    if isinstance(speed, (int, float)) and isinstance(again, (int, float)) and again > 0:
        out["sweep_repeat_tokens_per_s"] = again
        out["repeat_tokens_delta_rel"] = round(speed / again - 1.0, 4)
    out["message"] = (
        f"measured {measured:.4g} GiB ({out['counts']}), predicted {predicted:.4g} GiB, band "
        f"[{low:.4g}, {high:.4g}]: {'in' if out['in_band'] else 'OUT OF'} the band "
        f"(error {out['error_rel']:+.1%}, z {out['z']})"
    )
    return out


# ------------------------------------------------------------------------------------ simulator
# the data-sheet profile the simulator would use for a device it has no calibration of
DATA_SHEET = (("H100", "h100-sxm-80gb"), ("H200", "h100-sxm-80gb"), ("A100", "a100-sxm-80gb"))
DEFAULT_SHEET = {"cuda": "a100-sxm-80gb", "npu": "ascend-910b", "cpu": "cpu"}


def data_sheet_profile(device: str, name: str) -> str:
    """The bundled profile of the device's model (an H200 is priced as the H100 it shares its
    chip with), else the accelerator's default."""
    return next((profile for key, profile in DATA_SHEET if key in name), DEFAULT_SHEET.get(device, "cpu"))


def _spearman(xs: list[float], ys: list[float]) -> float | None:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return round(cov / var, 3) if var else None


def simulator_reading(report: dict[str, Any], calibrated: Path | None) -> dict[str, Any]:
    """The analytical model against the sweep: each measured config's step time and peak predicted
    by the simulator with the calibrated profile and with the data-sheet one, the error of each
    (median absolute, tokens/s and peak) and the Spearman rank of tokens/s. A reading of what
    was measured, not a step: it needs no device and runs again on a saved report
    (``--resimulate``)."""
    from autotune.workers.hardware import load_profile
    from autotune.workers.simulate import simulate_trial

    device = report["device"].get("resolved") or "cpu"
    sheet = data_sheet_profile(device, str(report["device"].get("name") or ""))
    profiles: dict[str, Any] = {"data_sheet": sheet}
    if calibrated is not None and calibrated.exists():
        profiles["calibrated"] = load_profile(str(calibrated))
    rows, measured = [], [r for r in (report["steps"].get("sweep") or {}).get("configs", []) if r["status"] == "ok"]
    for n, row in enumerate(measured):
        out = {"name": row["name"], "measured_tokens_per_s": row["tokens_per_s_per_device"]}
        out["measured_peak_gib"] = row["peak_memory_gib"]
        for label, hardware in profiles.items():
            request = make_request(report["size"], device, {"params": row["params"], "env": row["env"]}, 300 + n)
            request.cluster["hardware"] = hardware
            request.workload["memory_rule"] = "torch-probe"  # the probe's memory, as a study of it prices it
            result = simulate_trial(request)
            metrics = result.metrics or {}
            # the peak as the probe counted it (allocated: no fragmentation, runtime or buffers)
            left_out = PEAK_LEAVES_OUT.get(str(row.get("peak_memory_counts") or "device"), ())
            memory = (result.info or {}).get("memory_gib") or {}
            counted = sum(v for k, v in memory.items() if k not in left_out) if memory else None
            out[label] = {
                "status": result.status,
                "tokens_per_s": _round(metrics.get("tokens_per_s_per_device")),
                "peak_gib": _round(counted),
            }
        rows.append(out)
    summary: dict[str, Any] = {"data_sheet_profile": sheet, "configs": rows}
    for label in profiles:
        pairs = [(r["measured_tokens_per_s"], r[label]["tokens_per_s"]) for r in rows if r[label]["tokens_per_s"]]
        peaks = [(r["measured_peak_gib"], r[label]["peak_gib"]) for r in rows if r[label]["peak_gib"]]
        errors = sorted(abs(p / m - 1.0) for m, p in pairs if m)
        peak_errors = sorted(abs(p / m - 1.0) for m, p in peaks if m)
        summary[label] = {
            "median_abs_error_tokens_per_s": round(errors[len(errors) // 2], 4) if errors else None,
            "median_ratio_predicted_over_measured": (
                round(sorted(p / m for m, p in pairs if m)[len(pairs) // 2], 3) if pairs else None
            ),
            "median_abs_error_peak": round(peak_errors[len(peak_errors) // 2], 4) if peak_errors else None,
            "spearman_tokens_per_s": _spearman([m for m, _ in pairs], [p for _, p in pairs]),
            "configs": len(pairs),
        }
    return summary


# --------------------------------------------------------------------------------------- reports
def markdown(report: dict[str, Any]) -> str:
    d, steps = report["device"], report["steps"]
    lines = [
        "# Accelerator check",
        "",
        f"- device: **{d.get('resolved') or 'none'}** (asked: {d['requested']}) {d.get('name') or ''} — {d['words']}",
        f"- model: {report['model']['name']} ({report['size']}), seq {report['model']['seq_len']}, random weights",
        f"- started {report['started_at']}, {report['wall_s']:.0f} s of a {report['budget_s']:.0f} s budget",
        f"- result: **{'ok' if report['ok'] else 'not ok'}** (exit {report['exit_code']})",
        "",
        "| step | status | what it found |",
        "|---|---|---|",
    ]
    for name in STEP_NAMES:
        step = steps.get(name) or {"status": "not run", "message": ""}
        lines.append(f"| {name} | {step.get('status')} | {str(step.get('message', '')).replace('|', '/')} |")
    configs = (steps.get("sweep") or {}).get("configs") or []
    if configs:
        lines += [
            "",
            "## Sweep",
            "",
            "| config | status | step s | tokens/s/device | peak GiB | reserved GiB | MFU (calibrated) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in configs:
            mfu = r.get("mfu_calibrated")
            lines.append(
                f"| {r['name']} | {r['status']} | {r.get('step_time_s', '')} | {r.get('tokens_per_s_per_device', '')} "
                f"| {r.get('peak_memory_gib', '')} | {r.get('peak_reserved_gib') or ''} "
                f"| {'' if mfu is None else f'{mfu:.1%}'}{' (' + r['mfu_note'] + ')' if r.get('mfu_note') else ''} |"
            )
    cal = steps.get("calibrate") or {}
    if cal.get("figures"):
        lines += ["", "## Calibration", ""]
        lines += [f"- {k}: {v}" for k, v in cal["figures"].items()]
    mp = steps.get("memory_profile") or {}
    if mp.get("runs"):
        lines += ["", "## Memory profile and full probe", ""]
        for run in mp["runs"]:
            reserved = f", reserved {run['peak_reserved_gib']} GiB" if run.get("peak_reserved_gib") else ""
            peak = run.get("peak_memory_gib")
            lines.append(f"- {run['layers_per_stage']} layer(s) per stage: {run['status']}, peak {peak} GiB{reserved}")
        if "band_gib" in mp:
            lines.append(
                f"- predicted at {mp['full_layers_per_stage']:g} per stage: {mp['predicted_peak_gib']} "
                f"+- {mp['sd_gib']} GiB, band {mp['band_gib']} ({mp['band_sd']:g} sd)"
            )
        if "p_fits" in mp:
            reserved, usable = mp["predicted_reserved_gib"], mp["usable_gib"]
            lines.append(f"- reserved {reserved} GiB against {usable} usable: P(fits) {mp['p_fits']}")
    sim = report.get("simulator") or {}
    if sim.get("configs"):
        labels = [k for k in ("calibrated", "data_sheet") if k in sim]
        lines += ["", "## The simulator against the sweep", ""]
        for label in labels:
            f = sim[label]
            name = "calibrated profile" if label == "calibrated" else f"data-sheet profile {sim['data_sheet_profile']}"
            lines.append(
                f"- {name}: tokens/s predicted/measured {f['median_ratio_predicted_over_measured']} (median), "
                f"median error {f['median_abs_error_tokens_per_s']}, Spearman {f['spearman_tokens_per_s']}; "
                f"peak median error {f['median_abs_error_peak']} ({f['configs']} configs)"
            )
        lines += [
            "",
            "| config | measured tokens/s | " + " | ".join(f"{k} tokens/s | {k} peak GiB" for k in labels) + " |",
            "|---|---|" + "---|---|" * len(labels),
        ]
        for r in sim["configs"]:
            cells = " | ".join(f"{r[k]['tokens_per_s']} | {r[k]['peak_gib']}" for k in labels)
            lines.append(f"| {r['name']} | {r['measured_tokens_per_s']} | {cells} |")
    if sim.get("error"):
        lines += ["", f"The simulator's reading failed: {sim['error']}"]
    comparison = steps.get("comparison") or {}
    if comparison.get("status") == "ok":
        lines.append(f"- **{comparison['message']}**")
        if "sweep_repeat_gib" in comparison:
            lines.append(
                f"- the sweep's run of the same config measured {comparison['sweep_repeat_gib']} GiB "
                f"({comparison['repeat_delta_rel']:+.1%})"
            )
        if "sweep_repeat_tokens_per_s" in comparison:
            lines.append(
                f"- tokens/s between those two runs: {comparison['repeat_tokens_delta_rel']:+.1%} (the full probe "
                f"against the sweep's {comparison['sweep_repeat_tokens_per_s']}): the device's noise between runs, "
                "one pair"
            )
    if report["messages"]:
        lines += ["", "## Messages", ""] + [f"- {m}" for m in report["messages"]]
    return "\n".join(lines) + "\n"


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        print(f"[accelerator-check] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    ap.add_argument("--size", choices=tuple(SIZES), default="1b")
    ap.add_argument("--out", type=Path, required=True, help="directory for accelerator_check.json and .md")
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole check's time budget (default 8 min)")
    ap.add_argument(
        "--configs", type=int, default=None, help="run only the first N configs of the sweep (the reference first)"
    )
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument(
        "--resimulate",
        action="store_true",
        help="no probes: read --out's accelerator_check.json and calibrated_profile.yaml, and write the "
        "simulator's reading of that sweep into them again (after a change to the model, say)",
    )
    args = ap.parse_args(argv)
    if args.resimulate:
        return resimulate(args.out)
    clock = Clock(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    size = SIZES[args.size]
    report: dict[str, Any] = {
        "check": "accelerator_check",
        "schema": SCHEMA,
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": {"requested": args.device},
        "size": args.size,
        "model": {**size["model"], "seq_len": size["seq_len"]},
        "budget_s": args.budget_s,
        "steps": {},
        "messages": [],
    }
    device, words = resolve_device(args.device)
    report["device"].update(resolved=device, words=words)
    _say(args, f"device: {words}")
    if device is None:
        report["messages"].append(f"nothing ran: {words}")
        for name in STEP_NAMES:
            report["steps"][name] = {"status": "skipped", "message": words}
    else:
        with tempfile.TemporaryDirectory(prefix="accelerator-check-") as scratch:
            work = Path(scratch)
            for name, step in (("sweep", step_sweep), ("calibrate", step_calibrate), ("memory", step_memory)):
                try:
                    step(args, device, clock, work, report)
                except Exception as exc:  # a step's own bug or environment: said, and the next step runs
                    report["steps"].setdefault(name if name != "memory" else "memory_profile", {}).update(
                        status="failed", message=f"{type(exc).__name__}: {exc}"
                    )
                    report["messages"].append(f"step {name} failed: {type(exc).__name__}: {exc}")
            cal = report["steps"].get("calibrate") or {}
            if cal.get("status") == "ok":  # keep the measured profile beside the reports
                kept = args.out / "calibrated_profile.yaml"
                kept.write_bytes(Path(cal["profile_path"]).read_bytes())
                cal["profile_path"] = str(kept)
    for name in STEP_NAMES:
        report["steps"].setdefault(name, {"status": "skipped", "message": "not reached"})
    if device is not None:
        report["simulator"] = _simulator_or_error(report, args.out / "calibrated_profile.yaml")
    comparison = report["steps"]["comparison"]
    ran = device is not None and all(report["steps"][n]["status"] == "ok" for n in STEP_NAMES)
    report["ok"] = bool(ran and comparison.get("in_band"))
    report["exit_code"] = 2 if device is None else (0 if report["ok"] else 1)
    if device is not None and not ran:
        report["messages"].append(
            "not every step ran to the end: "
            + ", ".join(
                f"{n} {report['steps'][n]['status']}" for n in STEP_NAMES if report["steps"][n]["status"] != "ok"
            )
        )
    elif ran and not comparison.get("in_band"):
        report["messages"].append("the full probe's peak fell outside the memory profile's band")
    report["wall_s"] = round(clock.elapsed(), 1)
    report["imports_seen"] = sorted(m for m in HEAVY if m in sys.modules)
    (args.out / "accelerator_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / "accelerator_check.md").write_text(markdown(report))
    _say(args, f"wrote {args.out / 'accelerator_check.json'} and .md: {'ok' if report['ok'] else 'not ok'}")
    print(markdown(report))
    return report["exit_code"]


def _simulator_or_error(report: dict[str, Any], calibrated: Path) -> dict[str, Any]:
    try:
        return simulator_reading(report, calibrated)
    except Exception as exc:  # noqa: BLE001 - a reading of the results, never a reason to lose them
        return {"error": f"{type(exc).__name__}: {exc}"}


def resimulate(out: Path) -> int:
    """The simulator's reading of a saved report, written back into its JSON and markdown."""
    path = out / "accelerator_check.json"
    report = json.loads(path.read_text())
    report["simulator"] = _simulator_or_error(report, out / "calibrated_profile.yaml")
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "accelerator_check.md").write_text(markdown(report))
    print(markdown(report))
    return 1 if "error" in report["simulator"] else 0


if __name__ == "__main__":
    sys.exit(main())
