"""`autotune calibrate`: measured profiles the simulator can use, and specs that point at them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.spec import SpecError, load_spec
from autotune.workers.calibrate import fit_half_dim
from autotune.workers.hardware import PROFILE_KEYS, load_profile
from support import TINY_TRAIN

pytest.importorskip("torch")


@pytest.mark.parametrize("half", [0.0, 32.0, 300.0])
def test_fit_half_dim_recovers_the_curve(half):
    rates = {d: 5.0 * (d / (d + half)) ** 3 for d in (64, 128, 256, 512, 1024, 2048)}
    assert fit_half_dim(rates) == pytest.approx(half, rel=0.1, abs=1.0)


def test_calibrate_writes_a_profile_a_spec_can_use(tmp_path, write_spec):
    out = tmp_path / "profiles" / "host.yaml"
    result = CliRunner().invoke(app, ["calibrate", "--out", str(out), "--quick", "--ranks", "2", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    measured = payload["measured"]
    assert set(measured["gemm_tflops"]) == {"fp32", "bf16", "fp16"}
    assert all(v > 0 for rates in measured["gemm_tflops"].values() for v in rates.values())
    assert measured["collective_busbw_gbps"]["allreduce"] > 0

    profile = load_profile(str(out))  # the file loads through the same checks as bundled ones
    assert set(PROFILE_KEYS) - {"description"} <= set(profile)
    largest = max(measured["sizes"])
    # the plateau is at least what the largest GEMM reached, and the curve is the fitted one
    assert profile["peak_tflops"]["fp32"] >= measured["gemm_tflops"]["fp32"][str(largest)] * 0.999
    assert profile["gemm_efficiency"] == 1.0
    assert profile["memory_bandwidth_gbps"] == pytest.approx(measured["memory_bandwidth_gbps"], rel=0.01)
    assert out.read_text().startswith("# Hardware profile written by `autotune calibrate`")

    # a spec names the file relative to itself; plan uses it
    spec_path = write_spec(TINY_TRAIN.replace("cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2}",
                                              "cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2, "
                                              "profile: profiles/host.yaml}"))
    spec = load_spec(spec_path)
    assert spec.cluster.profile == str(out.resolve())
    plan = CliRunner().invoke(app, ["plan", str(spec_path), "--json", "--top", "1"])
    assert plan.exit_code == 0, plan.output
    assert json.loads(plan.stdout)["top"][0]["metrics"]["tokens_per_s_per_device"] > 0


def test_missing_profile_file_is_a_spec_error(write_spec):
    path = write_spec(TINY_TRAIN.replace("devices_per_node: 2}", "devices_per_node: 2, profile: nope/host.yaml}"))
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    text = str(exc.value)
    assert "cluster.profile" in text and "does not exist" in text and "autotune calibrate" in text


def test_calibrate_rejects_a_bad_accelerator(tmp_path):
    result = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "x.yaml"), "--accelerator", "tpu"])
    assert result.exit_code == 2
    assert "--accelerator" in result.stderr
