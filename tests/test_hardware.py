"""Hardware profiles: bundled data, the loader's checks, and the public figures they carry."""

from __future__ import annotations

from importlib import resources

import pytest
from autotune.workers.hardware import PROFILE_KEYS, available_profiles, load_profile

REQUIRED = (
    "name",
    "accelerator",
    "device_memory_gib",
    "peak_tflops",
    "memory_bandwidth_gbps",
    "intra_node_bandwidth_gbps",
    "inter_node_bandwidth_gbps",
    "devices_per_node",
    "runtime_reserve_gib",
)


def test_bundled_profiles_are_package_data():
    names = available_profiles()
    assert {"ascend-910b", "a100-sxm-80gb", "h100-sxm-80gb", "cpu"} <= set(names)
    folder = resources.files("autotune.workers.hardware")
    for name in names:
        assert folder.joinpath(f"{name}.yaml").is_file()


@pytest.mark.parametrize("name", ["ascend-910b", "a100-sxm-80gb", "a800-sxm4-80gb", "h100-sxm-80gb", "cpu"])
def test_profile_has_every_key(name):
    profile = load_profile(name)
    assert isinstance(profile, dict)
    for key in REQUIRED:
        assert key in profile
    assert set(profile) <= set(PROFILE_KEYS)
    assert profile["name"] == name
    assert profile["accelerator"] in ("npu", "cuda", "cpu")
    assert {"bf16", "fp16", "fp32"} <= set(profile["peak_tflops"])
    for key in (
        "gemm_efficiency",
        "memory_bandwidth_efficiency",
        "allreduce_efficiency",
        "allgather_efficiency",
        "inter_node_efficiency",
        "flash_attention_efficiency",
    ):
        assert 0 < profile[key] <= 1, key


def test_the_a800_is_the_a100_with_its_nvlink_cut_to_400_gb_s():
    a100, a800 = load_profile("a100-sxm-80gb"), load_profile("a800-sxm4-80gb")
    assert a800["intra_node_bandwidth_gbps"] == 200  # 400 GB/s total, per direction
    different = {k for k in a100 if a100[k] != a800[k]}
    assert different == {"name", "description", "intra_node_bandwidth_gbps"}


def test_public_figures():
    npu = load_profile("ascend-910b")
    assert npu["accelerator"] == "npu"
    assert npu["device_memory_gib"] == 64
    assert npu["intra_node_bandwidth_gbps"] == 196  # 392 GB/s HCCS total, per direction
    assert npu["peak_tflops"]["bf16"] == pytest.approx(24 * 8192 * 1.85e9 / 1e12, rel=1e-3)
    # measured bus bandwidths of the 8-card collectives
    assert npu["allreduce_efficiency"] * npu["intra_node_bandwidth_gbps"] == pytest.approx(72, rel=0.01)
    assert npu["allgather_efficiency"] * npu["intra_node_bandwidth_gbps"] == pytest.approx(149, rel=0.01)
    a100 = load_profile("a100-sxm-80gb")
    assert a100["peak_tflops"]["bf16"] == 312 and a100["memory_bandwidth_gbps"] == 2039
    h100 = load_profile("h100-sxm-80gb")
    assert h100["peak_tflops"]["bf16"] == 989 and h100["memory_bandwidth_gbps"] == 3350


def test_unknown_profile_lists_available():
    with pytest.raises(ValueError) as exc:
        load_profile("tpu-v9")
    for name in available_profiles():
        assert name in str(exc.value)


def test_unknown_override_key_names_key_and_valid_keys():
    with pytest.raises(ValueError) as exc:
        load_profile("ascend-910b", {"device_memory": 32})
    msg = str(exc.value)
    assert "device_memory" in msg and "device_memory_gib" in msg and "peak_tflops" in msg


@pytest.mark.parametrize(
    "overrides",
    [
        {"device_memory_gib": "32"},
        {"device_memory_gib": True},
        {"devices_per_node": 2.5},
        {"gemm_efficiency": 1.5},
        {"accelerator": "tpu"},
        {"peak_tflops": 300},
        {"peak_tflops": {"bf8": 1.0}},
        {"memory_bandwidth_gbps": -1},
    ],
)
def test_override_values_are_type_checked(overrides):
    with pytest.raises(ValueError):
        load_profile("a100-sxm-80gb", overrides)


def test_overrides_apply_and_do_not_leak():
    custom = load_profile("ascend-910b", {"device_memory_gib": 32, "peak_tflops": {"bf16": 313.0}})
    assert custom["device_memory_gib"] == 32.0
    assert custom["peak_tflops"]["bf16"] == 313.0
    assert custom["peak_tflops"]["fp32"] == load_profile("ascend-910b")["peak_tflops"]["fp32"]
    custom["peak_tflops"]["fp16"] = 1.0
    fresh = load_profile("ascend-910b")
    assert fresh["device_memory_gib"] == 64.0 and fresh["peak_tflops"]["fp16"] > 300
