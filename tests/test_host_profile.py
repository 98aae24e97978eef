"""Calibration happens when it must (issue #17 item 2): a real-backend study on a data-sheet
profile measures the host first, once per host and software; plan says which profile it ranks
with and how old it is."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from typer.testing import CliRunner

from autotune.study import host_profile
from autotune.cli.commands import app
from autotune.spec.load import load_spec
from support import calibration_in_child, command_spec


@pytest.fixture
def auto_calibration(tmp_path, monkeypatch):
    """The user's default (auto) with a throwaway profile cache."""
    monkeypatch.delenv(host_profile.CALIBRATE_ENV, raising=False)
    monkeypatch.setenv(host_profile.PROFILE_CACHE_ENV, str(tmp_path / "profiles"))
    return tmp_path / "profiles"


def _spec(write_spec, tmp_path):
    path = command_spec(write_spec, tmp_path, n_trials=2, parallel=1, ray="ray: {enabled: false}", sleep=0.05)
    # fp32 and micro-batch 1: the fake launcher's throughput stays plausible on this CPU's measured
    # peak (bf16 here runs at a few GFLOPS, and the sanity check would call it a crash)
    path.write_text(
        path.read_text().replace("micro_batch_size: [1, 2, 4]", "micro_batch_size: [1]\n  precision: [fp32]")
    )
    return path


def test_who_calibrates_and_who_is_told_why_not(write_spec, tmp_path, auto_calibration, monkeypatch):
    spec = load_spec(_spec(write_spec, tmp_path))
    assert host_profile.why_not_calibrated(spec, simulated=False) is None
    assert "simulator" in host_profile.why_not_calibrated(spec, simulated=True)
    never = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"calibrate": "never"})})
    assert "never" in host_profile.why_not_calibrated(never, simulated=False)
    monkeypatch.setenv(host_profile.CALIBRATE_ENV, "never")
    assert "never" in host_profile.why_not_calibrated(spec, simulated=False)
    monkeypatch.setenv(host_profile.CALIBRATE_ENV, "sometimes")
    with pytest.raises(ValueError, match="AUTOTUNE_CALIBRATE='sometimes': expected auto or never"):
        host_profile.why_not_calibrated(spec, simulated=False)
    monkeypatch.delenv(host_profile.CALIBRATE_ENV)
    # trials on a Ray cluster: calibrated there (a node's task), cached per cluster, not per driver
    remote = spec.model_copy(
        update={"ray": spec.ray.model_copy(update={"enabled": True, "address": "ray://head:10001"})}
    )
    assert host_profile.why_not_calibrated(remote, simulated=False) is None
    assert host_profile.calibration_key(remote)["ray_cluster"] == "ray://head:10001"
    assert "host" not in host_profile.calibration_key(remote)
    assert host_profile.cached_profile_path(remote) != host_profile.cached_profile_path(spec)


def test_the_cache_key_follows_the_host_software_and_calibration_shape(write_spec, tmp_path, auto_calibration):
    spec = load_spec(_spec(write_spec, tmp_path))
    path = host_profile.cached_profile_path(spec)
    assert path.parent == auto_calibration and path.name.startswith("cpu-")
    assert host_profile.cached_profile_path(spec) == path  # stable
    threads = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"threads_per_rank": 1})})
    assert host_profile.cached_profile_path(threads) != path
    key = host_profile.calibration_key(spec)
    assert key["software"]["torch"] and key["base_profile"] == "cpu" and key["ranks"] == 2


def test_profile_origin_says_data_sheet_or_measured_and_how_old(tmp_path):
    assert not host_profile.profile_origin("ascend-910b").measured
    assert "data-sheet figures" in host_profile.profile_origin("ascend-910b").describe()
    from autotune.workers.hardware import load_profile

    profile = load_profile("cpu")
    when = dt.datetime(2026, 11, 20, 8, 0, tzinfo=dt.timezone.utc)
    import yaml

    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump({**profile, "calibrated_at": when.isoformat()}))
    origin = host_profile.profile_origin(str(path))
    assert origin.measured_at == when
    assert origin.describe(now=when + dt.timedelta(days=3, hours=2)).endswith("(measured 2026-11-20 08:00, 3 days ago)")
    # a file written before calibrated_at existed: its header line
    old = tmp_path / "old.yaml"
    old.write_text(
        "# Hardware profile written by `autotune calibrate` on 2026-11-01T10:00:00.\n" + yaml.safe_dump(profile)
    )
    assert host_profile.profile_origin(str(old)).measured_at.replace(tzinfo=None) == dt.datetime(2026, 11, 1, 10)


def test_a_failed_calibration_is_said_and_the_data_sheet_kept(write_spec, tmp_path, auto_calibration, monkeypatch):
    import autotune.workers.calibrate as calibrate_module

    def broken(*args, **kwargs):
        raise RuntimeError("gloo could not bind")

    monkeypatch.setattr(calibrate_module, "calibrate", broken)
    spec = load_spec(_spec(write_spec, tmp_path))
    said: list[str] = []
    assert host_profile.ensure_measured_profile(spec, False, said.append) is spec
    assert "calibration failed (RuntimeError: gloo could not bind)" in said[-1]
    assert not any(auto_calibration.glob("*.yaml")) if auto_calibration.exists() else True


def test_a_damaged_cached_profile_is_measured_again(write_spec, tmp_path, auto_calibration, monkeypatch):
    import autotune.workers.calibrate as calibrate_module
    from autotune.workers.hardware import load_profile

    calls = []

    def fake(accelerator, **kwargs):
        calls.append(kwargs)
        measured = {"software": {}, "threads_per_device": 1, "gemm_tflops": {}, "memory_bandwidth_gbps": 1.0}
        return {
            "profile": {**load_profile(kwargs["base"]), "calibrated_at": "2026-11-24T10:00:00+00:00"},
            "measured": measured,
        }

    monkeypatch.setattr(calibrate_module, "calibrate", fake)
    spec = load_spec(_spec(write_spec, tmp_path))
    path = host_profile.cached_profile_path(spec)
    path.parent.mkdir(parents=True)
    path.write_text("name: cpu\ngemm_efficiency: 7\n")  # edited by hand
    said: list[str] = []
    measured = host_profile.ensure_measured_profile(spec, False, said.append)
    assert "the cached profile is unusable" in said[0] and len(calls) == 1
    assert calls[0]["quick"] and calls[0]["ranks"] == 2 and calls[0]["base"] == "cpu"
    assert measured.cluster.profile == str(path) and load_profile(str(path))["calibrated_at"]
    assert not list(path.parent.glob(".*.tmp"))  # written whole, then moved into place


def test_a_real_study_calibrates_once_and_plan_says_which_profile(write_spec, tmp_path, auto_calibration):
    """Real calibration (quick, ~20 s on 2 cores), then a command-backend study that ranks with it;
    a second study on the same host reuses it; plan says before and after."""
    spec_path = _spec(write_spec, tmp_path)
    runner = CliRunner()
    before = runner.invoke(app, ["plan", str(spec_path), "--json", "--top", "1"])
    assert before.exit_code == 0, before.output
    assert json.loads(before.stdout)["profile"] == {"profile": "cpu", "measured_at": None, "calibrates_first": True}

    first = runner.invoke(app, ["run", str(spec_path), "--run-dir", str(tmp_path / "run1"), "--no-tracking"])
    assert first.exit_code == 0, first.output
    assert "calibrating this host first" in first.stderr and "measured in" in first.stderr
    cached = list(auto_calibration.glob("*.yaml"))
    assert len(cached) == 1
    from autotune.workers.hardware import load_profile

    profile = load_profile(str(cached[0]))
    assert profile["calibrated_at"] and profile["tp_collective_latency_us"] >= profile["collective_latency_us"]

    second = runner.invoke(app, ["run", str(spec_path), "--run-dir", str(tmp_path / "run2"), "--no-tracking"])
    assert second.exit_code == 0, second.output
    assert "calibrating" not in second.stderr and "this host's cached calibration" in second.stderr
    after = runner.invoke(app, ["plan", str(spec_path), "--json", "--top", "1"])
    planned = json.loads(after.stdout)["profile"]
    assert planned["profile"] == str(cached[0]) and planned["measured_at"] and not planned["calibrates_first"]
    text = runner.invoke(app, ["plan", str(spec_path), "--top", "1"])
    assert "this host's cached calibration" in text.stdout and " ago)" in text.stdout


@pytest.mark.slow  # ~20 s; calibrating once per host stays in CI
def test_trials_on_a_ray_cluster_calibrate_on_one_of_its_nodes(write_spec, tmp_path, auto_calibration):
    """A local two-node cluster (ray.cluster_utils): the calibration runs as a Ray task reserving
    a node's devices, not in the driver; a cluster without such a node is said, not waited for."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        cluster.add_node(num_cpus=2)
        path = _spec(write_spec, tmp_path)
        spec = load_spec(path)
        spec = spec.model_copy(
            update={"ray": spec.ray.model_copy(update={"enabled": True, "address": cluster.address})}
        )
        said: list[str] = []
        measured = host_profile.ensure_measured_profile(spec, False, said.append)
        assert said[0].startswith(f"calibrating a node of the Ray cluster at {cluster.address} first")
        assert "measured in" in said[1] and "this cluster" in said[1]
        assert measured.cluster.profile == str(host_profile.cached_profile_path(spec))
        from autotune.workers.hardware import load_profile

        assert load_profile(measured.cluster.profile)["calibrated_at"]
        # four devices per node: no node of this cluster can hold the calibration
        wide = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"devices_per_node": 4})})
        said.clear()
        assert host_profile.ensure_measured_profile(wide, False, said.append) is wide
        assert "calibration failed (RuntimeError: no node of the Ray cluster has 4 CPU)" in said[-1]
    finally:
        cluster.shutdown()


def test_a_device_is_calibrated_in_a_process_that_ends_with_it():
    """On a device, the calibration runs in a child process, so its runtime context and cached
    blocks leave with it instead of staying in the study's process for every probe to do without;
    its progress still reaches the user."""
    import os

    seen: list[str] = []
    found = host_profile._calibration_apart("cuda", 2, None, "h100-sxm-80gb", seen.append, task=calibration_in_child)
    assert found["accelerator"] == "cuda" and found["ranks"] == 2
    assert found["pid"] != os.getpid() and seen == ["measuring cuda"]
