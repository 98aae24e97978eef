"""`autotune calibrate`: measured profiles the simulator can use, and specs that point at them."""

from __future__ import annotations

import json
import math
import os

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.spec.errors import SpecError
from autotune.spec.load import load_spec
from autotune.workers.calibrate import (
    OVERHEAD_SHAPE,
    PLATEAU_HEADROOM,
    device_bound,
    fit_gemm_curve,
    fit_half_dim,
    fit_latency_bandwidth,
    gemm_seconds,
)
from autotune.workers.calibrate_layer import COLLECTIVES_PER_LAYER, fit_tp_latency
from autotune.workers.hardware import PROFILE_KEYS, load_profile
from autotune.workers.torch_probe._device import driver_version
from support import TINY_TRAIN

pytest.importorskip("torch")


@pytest.mark.parametrize("half", [0.0, 32.0, 300.0])
def test_fit_half_dim_recovers_the_curve(half):
    # measured up to where the curve flattens (the fit extrapolates no further than PLATEAU_HEADROOM)
    rates = {d: 5.0 * (d / (d + half)) ** 3 for d in (64, 128, 256, 512, 1024, 2048, 4096, 8192)}
    assert fit_half_dim(rates) == pytest.approx(half, rel=0.1, abs=1.0)


def test_fit_gemm_curve_shares_half_and_keeps_a_plateau_per_precision():
    shapes = [(256, 256, 512), (1024, 128, 256), (512, 512, 512), (256, 688, 256), (2048, 2048, 2048)]
    eff = {s: (s[0] / (s[0] + 48.0)) * (s[1] / (s[1] + 48.0)) * (s[2] / (s[2] + 48.0)) for s in shapes}
    half, plateaus = fit_gemm_curve(
        {"fp32": {s: 0.2 * e for s, e in eff.items()}, "bf16": {s: 0.014 * e for s, e in eff.items()}}
    )
    assert half == pytest.approx(48.0, rel=0.1)
    assert plateaus["fp32"] == pytest.approx(0.2, rel=0.05) and plateaus["bf16"] == pytest.approx(0.014, rel=0.05)


# bf16 TFLOP/s of a linear layer's forward and backward as the quick calibration read them on one
# NVIDIA H200 (torch 2.11.0+cu130), 2026-11-28: the first run of benchmarks/accelerator_check.py on a GPU
H200_BF16 = {
    (512, 512, 512): 4.689,
    (1024, 1024, 1024): 39.74,
    (2048, 2048, 2048): 320.4,
    (2048, 4096, 4096): 728.8,
    (2048, 4096, 8192): 695.8,
    (2048, 4096, 22016): 707.3,
    (2048, 11008, 4096): 641.0,
}
H200_OVERHEAD_S = 160e-6  # what the 512^3 and 1024^3 steps took: the host's share of every step


def test_host_bound_gemms_are_left_out_of_the_plateau_fit():
    """Fitted with the launch-bound small squares, the plateau went to 2,734 TFLOP/s on an H200
    (dense bf16 is ~990 on its data sheet); without them it lies at what the large shapes sustain."""
    kept, left = device_bound({"bf16": H200_BF16}, {"bf16": H200_OVERHEAD_S})
    assert {(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048)} <= set(left["bf16"])
    assert len(kept["bf16"]) >= 2 and all(shape[2] >= 4096 for shape in kept["bf16"])
    half, plateaus = fit_gemm_curve(kept)
    assert 700 < plateaus["bf16"] <= PLATEAU_HEADROOM * max(kept["bf16"].values())
    at_7b_mlp = plateaus["bf16"] * math.prod(d / (d + half) for d in (4096, 4096, 11008))
    assert 600 < at_7b_mlp < 900  # the large shapes ran at 641-729


def test_a_precision_with_no_long_step_keeps_its_two_longest():
    """A curve needs two points: where every step is host-bound, the two longest are fitted."""
    rates = {(64, 64, 64): 0.01, (128, 128, 128): 0.05, (256, 256, 256): 0.2}
    kept, left = device_bound({"fp32": rates}, {"fp32": 1.0})
    assert sorted(kept["fp32"]) == [(128, 128, 128), (256, 256, 256)] and left["fp32"] == [(64, 64, 64)]
    assert gemm_seconds(OVERHEAD_SHAPE, 1e-6) == pytest.approx(6 * 8**3 / 1e6)


@pytest.mark.parametrize(
    "line, version",
    [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024", "550.54.15"),
        # the open kernel module, as an H200 machine's /proc/driver/nvidia/version reads (2026-11-28)
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)",
            "580.159.04",
        ),
        ("Version=24.1.rc2\n", "24.1.rc2"),
    ],
)
def test_driver_version_reads_each_driver_file(tmp_path, line, version):
    path = tmp_path / "version"
    path.write_text(line + "\n")
    assert driver_version("cuda", str(path)) == version


@pytest.mark.parametrize("latency, bw", [(300e-6, 2e9), (20e-6, 40e9), (0.0, 5e9)])
def test_fit_latency_bandwidth_recovers_the_collective_model(latency, bw):
    sizes = [4096, 32768, 262144, 1048576, 8388608]
    times = {n: latency + 1.0 * n / bw for n in sizes}
    got_latency, got_bw = fit_latency_bandwidth(times, 1.0)
    assert got_latency == pytest.approx(latency, rel=0.02, abs=1e-7)
    assert got_bw == pytest.approx(bw, rel=0.02)


@pytest.mark.parametrize("latency", [3.5e-3, 20e-6, 0.0])
def test_fit_tp_latency_recovers_what_each_collective_pays_beyond_its_bytes(latency):
    bw, layers = 1e9, 2
    rows = []
    for nbytes in (262144, 524288, 1048576):
        local = 0.01 * nbytes / 262144  # compute grows with the micro-batch, the same on both sides
        per_collective = 2 * latency + 2 * (2 - 1) / 2 * nbytes / bw
        rows.append(
            {
                "allreduce_bytes": nbytes,
                "local_s": local,
                "sharded_s": local + COLLECTIVES_PER_LAYER * layers * per_collective,
            }
        )
    assert fit_tp_latency({"tp": 2, "layers": layers, "rows": rows}, bw) == pytest.approx(latency, abs=1e-9)


def test_the_simulator_prices_tensor_parallel_collectives_at_the_measured_latency():
    """``tp_collective_latency_us`` moves tp > 1 configs' tensor-parallel time, and nothing else."""
    import numpy as np

    from autotune.spec.models import PRESETS
    from autotune.workers.simulate import columns_from_params, simulate_configs

    params = [{"tp": t, "pp": 1, "micro_batch_size": 1, "recompute": "none", "zero_stage": 0} for t in (1, 2)]
    model = {"arch": "llama", **PRESETS["tiny-llama"]}
    workload = {"kind": "train", "seq_len": 256, "global_batch_size": 8}
    cluster = {"accelerator": "cpu", "nodes": 1, "devices_per_node": 2, "world_size": 2}
    base = load_profile("cpu")

    def run(profile):
        return simulate_configs(model, workload, profile, cluster, columns_from_params(params))

    plain, measured = run(base), run({**base, "tp_collective_latency_us": 3000.0})
    assert np.allclose(plain["time_tp_comm"][0], 0) and np.allclose(measured["time_tp_comm"][0], 0)
    # tiny-llama: 4 layers x 4 all-reduces (2 latencies each) + the boundary ones, 2.9 ms more each
    assert measured["time_tp_comm"][1] - plain["time_tp_comm"][1] > 16 * 2 * 2.9e-3
    for key in ("time_gemm", "time_pp_p2p", "time_dp_comm"):
        assert np.allclose(plain[key], measured[key]), key


def test_the_simulator_adds_the_measured_optimizer_cost_per_parameter_tensor():
    import numpy as np

    from autotune.spec.models import PRESETS
    from autotune.workers.simulate import columns_from_params, simulate_configs

    params = [{"tp": 1, "pp": p, "micro_batch_size": 1, "recompute": "none", "zero_stage": 0} for p in (1, 2)]
    model = {"arch": "llama", **PRESETS["tiny-llama"]}
    workload = {"kind": "train", "seq_len": 256, "global_batch_size": 8}
    cluster = {"accelerator": "cpu", "nodes": 1, "devices_per_node": 2, "world_size": 2}
    base = load_profile("cpu")
    plain = simulate_configs(model, workload, base, cluster, columns_from_params(params))
    measured = simulate_configs(
        model, workload, {**base, "optimizer_us_per_tensor": 100.0}, cluster, columns_from_params(params)
    )
    # 4 layers x 9 tensors + embedding, final norm, head; a pipeline stage holds half the layers
    extra = measured["time_optimizer"] - plain["time_optimizer"]
    assert np.allclose(extra, [39 * 100e-6, 21 * 100e-6])
    assert np.allclose(measured["time_gemm"], plain["time_gemm"])


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
    # the device check writes usable memory; calibrate --nodes the links across nodes; --serving the engine's steps
    assert set(PROFILE_KEYS) - {"description", "usable_memory_gib", "inter_node_links", "serving_steps"} <= set(profile)
    # GEMMs at squares and at transformer-layer shapes; the plateau is the fitted curve's
    shapes = [tuple(map(int, k.split("x"))) for k in measured["gemm_tflops"]["fp32"]]
    assert any(m != k or k != n for m, k, n in shapes) and any(m == k == n for m, k, n in shapes)
    host_bound = measured["gemm_host_bound"]  # the steps no longer than the host's share of one
    assert set(measured["gemm_host_overhead_us"]) == {"fp32", "bf16", "fp16"}
    half, plateaus = fit_gemm_curve(
        {
            p: {tuple(map(int, k.split("x"))): v for k, v in table.items() if k not in host_bound.get(p, ())}
            for p, table in measured["gemm_tflops"].items()
        }
    )
    assert profile["gemm_half_dim"] == half
    assert profile["peak_tflops"]["bf16"] == pytest.approx(plateaus["bf16"], rel=1e-3)
    # collectives at several sizes: a latency and a bandwidth, both in the profile
    fit = measured["collective_fit"]
    assert set(fit) == {"allreduce", "allgather", "p2p"} and len(measured["collective_seconds"]["allreduce"]) >= 3
    assert profile["collective_latency_us"] > 0 and profile["intra_node_bandwidth_gbps"] > 0
    # the tensor-parallel layer step in context: sharded and local, latency never below the idle one
    rows = measured["tp_layer_step"]["rows"]
    assert len(rows) >= 2 and all(r["sharded_s"] > 0 and r["local_s"] > 0 for r in rows)
    assert profile["tp_collective_latency_us"] >= profile["collective_latency_us"]
    assert profile["calibrated_at"]
    # attention, elementwise work, dispatch and the optimizer's per-tensor cost, each measured
    assert measured["attention"]["tflops"] > 0 and measured["elementwise"]["gbps"] > 0
    assert 0 < profile["flash_attention_efficiency"] <= 1 and 0 < profile["memory_bandwidth_efficiency"] <= 1
    assert profile["kernel_launch_us"] == pytest.approx(measured["dispatch_us"], rel=1e-3)
    assert profile["optimizer_us_per_tensor"] > 0
    assert profile["gemm_efficiency"] == 1.0
    assert profile["memory_bandwidth_gbps"] == pytest.approx(measured["memory_bandwidth_gbps"], rel=0.01)
    assert out.read_text().startswith("# Hardware profile written by `autotune calibrate`")
    # only what was measured (issue #30: 64 GiB written on a 24 GiB host, a send/recv at 1 PB/s)
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert profile["device_memory_gib"] == pytest.approx(host_gib, rel=0.01)
    for name, busbw in measured["collective_busbw_gbps"].items():
        assert busbw is None or busbw <= measured["memory_bandwidth_gbps"], (name, busbw)
    assert (
        "inter_node_bandwidth_gbps" in measured["not_measured"] and "device_memory_gib" not in measured["not_measured"]
    )
    assert "not measured, kept from the base profile 'cpu'" in out.read_text()

    # a spec names the file relative to itself; plan uses it
    spec_path = write_spec(
        TINY_TRAIN.replace(
            "cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2}",
            "cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2, profile: profiles/host.yaml}",
        )
    )
    spec = load_spec(spec_path)
    assert spec.cluster.profile == str(out.resolve())
    plan = CliRunner().invoke(app, ["plan", str(spec_path), "--json", "--top", "1"])
    assert plan.exit_code == 0, plan.output
    assert json.loads(plan.stdout)["top"][0]["metrics"]["tokens_per_s_per_device"] > 0


def test_a_bandwidth_no_link_reaches_is_not_reported():
    """A fit whose times never grew with the size has no bandwidth in it: reported as None, not
    as the 1,048,576,000 GB/s a latency-bound send/recv fit gave on this host."""
    from autotune.workers.calibrate import fit_latency_bandwidth, resolved_bandwidths

    flat = {4096: 50e-6, 65536: 50e-6, 1048576: 50.000001e-6}  # latency only, to the noise
    fitted = {"p2p": fit_latency_bandwidth(flat, 1.0), "allreduce": (30e-6, 5e9)}
    assert fitted["p2p"][1] > 1e12  # what the fit says
    resolved = resolved_bandwidths(fitted, ceiling_bytes_s=20e9)
    assert resolved["p2p"][1] is None and resolved["allreduce"] == (30e-6, 5e9)


def test_a_latency_bound_all_reduce_still_writes_both_latencies():
    """A loaded 2-core host's all-reduce times may never grow with the size (no bandwidth to
    report): the latencies it measured still go into the profile, the tensor-parallel one with
    the bytes priced at the device's copy bandwidth; the bandwidth and efficiencies stay the base
    profile's. Once a CI run left ``tp_collective_latency_us`` out here."""
    from autotune.workers.calibrate import collective_fields, resolved_bandwidths

    ceiling = 20e9
    fitted = {"allreduce": (80e-6, 1e15), "allgather": (30e-6, 1e15), "p2p": (20e-6, 1e15)}
    tp_layer = {"tp": 2, "layers": 1, "rows": [{"sharded_s": 0.0105, "local_s": 0.0100, "allreduce_bytes": 1 << 20}]}
    latency_bound = collective_fields(fitted, resolved_bandwidths(fitted, ceiling), tp_layer, ceiling)
    assert set(latency_bound) == {"collective_latency_us", "tp_collective_latency_us"}
    assert latency_bound["collective_latency_us"] == 40.0
    assert latency_bound["tp_collective_latency_us"] >= latency_bound["collective_latency_us"]

    resolved_fit = {"allreduce": (80e-6, 5e9), "allgather": (30e-6, 4e9)}
    resolved = collective_fields(resolved_fit, resolved_bandwidths(resolved_fit, ceiling), tp_layer, ceiling)
    assert resolved["intra_node_bandwidth_gbps"] == 5.0 and resolved["allgather_efficiency"] == 0.8
    # the same layer rows leave less per collective once the bytes cost their measured bandwidth
    assert resolved["tp_collective_latency_us"] <= latency_bound["tp_collective_latency_us"]
    assert collective_fields({}, {}, {}, ceiling) == {}
    no_layer = collective_fields(resolved_fit, resolved_bandwidths(resolved_fit, ceiling), {}, ceiling)
    assert "tp_collective_latency_us" not in no_layer and no_layer["collective_latency_us"] == 40.0


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
