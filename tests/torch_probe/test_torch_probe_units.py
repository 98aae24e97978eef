"""Pure logic of the torch probe, no torch and no device needed: plan validation, failure
classification, device/backend/environment selection for cpu, cuda and npu (with a fake
``importlib``), the launcher's argv, statistics and the ZeRO-1 partition."""

from __future__ import annotations

import subprocess
import sys
import types
from types import SimpleNamespace

import pytest

from autotune.workers.protocol import TrialRequest
from autotune.workers.torch_probe import _device, launch, measure
from autotune.workers.torch_probe.failures import ProbeFailure, classify_exception
from autotune.workers.torch_probe.plan import ModelConfig, resolve_plan

MODEL = dict(
    arch="llama",
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=1024,
    max_position_embeddings=256,
)


def request(params=None, world=2, model=None, **workload):
    wl = dict(kind="train", seq_len=64, global_batch_size=8, warmup_steps=1, measured_steps=2)
    wl.update(workload)
    return TrialRequest(
        params=params or {},
        model=dict(MODEL, **(model or {})),
        workload=wl,
        cluster=dict(accelerator="cpu", nodes=1, devices_per_node=world, world_size=world),
    )


# -- plan ---------------------------------------------------------------------------------------


def test_plan_derives_dp_and_grad_accum():
    plan = resolve_plan(request({"tp": 2, "micro_batch_size": 2}, world=4), 4)
    assert (plan.tp, plan.dp, plan.micro_batch_size, plan.grad_accum) == (2, 2, 2, 2)
    assert plan.loss_parallel and plan.dp_cp == 2


def test_plan_sequence_parallel_without_tp_is_ignored_with_a_note():
    plan = resolve_plan(request({"sequence_parallel": True}), 2)
    assert plan.sequence_parallel is False and plan.notes


@pytest.mark.parametrize(
    "params,model,world,needle",
    [
        (
            {"tp": 2},
            {"num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 128},
            2,
            "num_key_value_heads 1 not divisible by tp 2",
        ),
        (
            {"tp": 4},
            {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 96},
            4,
            "num_attention_heads 6 not divisible by tp 4",
        ),
        ({"pp": 2, "vpp": 4}, {}, 2, "num_hidden_layers 4 not divisible by pp*vpp = 2*4"),
        ({"tp": 2, "pp": 1, "dp": 2}, {}, 2, "!= world size 2"),
        ({"tp": 3}, {}, 2, "not divisible by tp*pp*cp"),
        ({"micro_batch_size": 3}, {}, 2, "not divisible by micro_batch_size 3"),
        ({"micro_batch_size": 2, "grad_accum": 3}, {}, 2, "!= global_batch_size"),
        ({"pp": 2, "micro_batch_size": 8}, {}, 2, "grad_accum (micro-batches) 1 >= pp 2"),
        ({"recompute": "some"}, {}, 2, "recompute='some'"),
        ({"zero_stage": 4}, {}, 2, "zero_stage=4"),
        ({"vpp": 2}, {}, 2, "vpp 2 needs pp > 1"),
    ],
)
def test_plan_rejects_invalid_configs(params, model, world, needle):
    with pytest.raises(ProbeFailure) as err:
        resolve_plan(request(params, world, model), world)
    assert err.value.status == "invalid"
    assert needle in err.value.reason and err.value.reason.startswith("invalid config")


def test_plan_inference_needs_tp_only_and_takes_batch_size():
    req = request({"batch_size": 4, "tp": 2}, kind="infer", prompt_len=32, gen_len=8, batch_sizes=[1, 4])
    plan = resolve_plan(req, 2)
    assert (plan.kind, plan.batch_size, plan.seq_len) == ("infer", 4, 40)
    with pytest.raises(ProbeFailure, match="tp \\(and dp replicas\\) only"):
        resolve_plan(request({"pp": 2}, kind="infer"), 2)


def test_nan_injection_from_param_or_env():
    assert resolve_plan(request({"inject_nan_at_step": 3}), 2).inject_nan_at_step == 3
    assert resolve_plan(request(), 2, {"AUTOTUNE_INJECT_NAN_STEP": "1"}).inject_nan_at_step == 1
    assert resolve_plan(request(), 2, {}).inject_nan_at_step is None


def test_model_config_defaults_kv_heads_and_requires_fields():
    cfg = ModelConfig.from_dict(dict(MODEL, num_key_value_heads=None))
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 32
    with pytest.raises(ProbeFailure, match="'vocab_size' is missing"):
        ModelConfig.from_dict({k: v for k, v in MODEL.items() if k != "vocab_size"})


# -- failures -----------------------------------------------------------------------------------


class OutOfMemoryError(RuntimeError):  # stands in for torch.OutOfMemoryError (matched by name)
    pass


@pytest.mark.parametrize(
    "exc,size",
    [
        (OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity"), "2.00 GiB"),
        (RuntimeError("NPU out of memory. Tried to allocate 512.00 MiB (NPU 3; 60.00 GiB total)"), "512.00 MiB"),
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 70368744177664 bytes. Error code 12"
            ),
            "70368744177664 bytes",
        ),
    ],
)
def test_allocator_oom_names_rank_and_requested_size(exc, size):
    status, reason, report = classify_exception(exc, rank=3)
    assert status == "oom" and report
    assert "rank 3" in reason and size in reason


def test_peer_failure_is_not_reported_as_the_cause():
    status, _, report = classify_exception(
        RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"), 1
    )
    assert status == "crash" and report is False
    assert classify_exception(ValueError("boom"), 0) == ("crash", "rank 0: ValueError: boom", True)
    failure = ProbeFailure("nan", "non-finite loss", collective=True)
    assert classify_exception(failure, 2) == ("nan", "non-finite loss", True) and failure.collective


# -- device, backend, environment ----------------------------------------------------------------


def test_backends_per_accelerator():
    assert {k: v.backend for k, v in _device.ACCELERATORS.items()} == {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
    assert _device.accelerator_of({"accelerator": "GPU"}) == "cuda"
    with pytest.raises(ProbeFailure):
        _device.accelerator_of({"accelerator": "tpu"})


def test_prepare_env_sets_trial_env_and_copies_npu_alloc_conf_on_cuda():
    env = {"PYTORCH_NPU_ALLOC_CONF": "old"}
    applied = _device.prepare_env(
        {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "HCCL_BUFFSIZE": "200"}, "cuda", env
    )
    assert env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"  # the trial's value wins
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert applied["HCCL_BUFFSIZE"] == "200"
    env = {}
    _device.prepare_env({"PYTORCH_NPU_ALLOC_CONF": "a", "PYTORCH_CUDA_ALLOC_CONF": "b"}, "cuda", env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "b"  # an explicit cuda setting is kept
    env = {}
    _device.prepare_env({"PYTORCH_NPU_ALLOC_CONF": "a"}, "npu", env)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env
    env = {}
    _device.prepare_env({}, "cpu", env)
    assert env == {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


def test_visibility_variables_set_by_ray_are_respected():
    env = {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}
    assert _device.visible_devices("npu", env) == ["4", "5", "6", "7"]
    assert _device.local_device_index("npu", 3, env) == 3  # logical index, renumbered from 0
    with pytest.raises(ProbeFailure, match="ASCEND_RT_VISIBLE_DEVICES='4,5,6,7' exposes only 4"):
        _device.local_device_index("npu", 4, env)
    assert _device.visible_devices("cuda", env) is None  # npu's variable says nothing about cuda
    assert _device.local_device_index("cuda", 1, {"CUDA_VISIBLE_DEVICES": "2,3"}) == 1
    with pytest.raises(ProbeFailure):
        _device.local_device_index("cuda", 2, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert _device.local_device_index("cpu", 5, env) is None


def test_threads_per_rank():
    assert _device.threads_per_rank({}, 2, cpus=16) == 8
    assert _device.threads_per_rank({}, 4, cpus=2) == 1
    assert _device.threads_per_rank({"threads_per_rank": 3}, 8, cpus=2) == 3


class _FakeDeviceModule:
    def __init__(self):
        self.calls = []

    def set_device(self, index):
        self.calls.append(("set_device", index))


def _fake_importer(imported, torch_attrs):
    fake_torch = types.SimpleNamespace(**torch_attrs)

    def importer(name):
        imported.append(name)
        if name == "torch":
            return fake_torch
        if name == "torch_npu":
            fake_torch.npu = torch_attrs.get("npu_after_import")
            return types.ModuleType("torch_npu")
        raise ImportError(name)

    return importer


def test_setup_device_npu_imports_torch_npu_then_sets_device():
    imported, npu = [], _FakeDeviceModule()
    info = _device.setup_device(
        "npu", 2, {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}, importer=_fake_importer(imported, {"npu_after_import": npu})
    )
    assert imported[0] == "torch_npu"
    assert npu.calls == [("set_device", 2)]
    assert (info.backend, info.name) == ("hccl", "npu:2")


def test_setup_device_cuda_and_cpu():
    imported, cuda = [], _FakeDeviceModule()
    info = _device.setup_device("cuda", 1, {}, importer=_fake_importer(imported, {"cuda": cuda}))
    assert "torch_npu" not in imported and cuda.calls == [("set_device", 1)]
    assert (info.backend, info.name) == ("nccl", "cuda:1")
    info = _device.setup_device("cpu", 1, {}, importer=_fake_importer(imported, {}))
    assert (info.backend, info.name, info.index) == ("gloo", "cpu", None)


def test_setup_device_npu_without_torch_npu_is_a_clear_crash():
    def importer(name):
        raise ImportError("No module named 'torch_npu'")

    with pytest.raises(ProbeFailure, match="needs torch_npu"):
        _device.setup_device("npu", 0, {}, importer=importer)


def test_device_module_cpu_stand_in():
    mod = _device.device_module("cpu")
    assert mod.synchronize() is None and mod.max_memory_allocated() is None


# -- launcher -----------------------------------------------------------------------------------


def test_torchrun_argv_single_node_standalone():
    argv = launch.torchrun_argv(request({"tp": 2}, world=2), "/py")
    assert argv[:3] == ["/py", "-m", "torch.distributed.run"]
    assert "--standalone" in argv and argv[argv.index("--nproc-per-node") + 1] == "2"
    assert argv[-3:] == ["-m", "autotune.workers.torch_probe", "{trial_file}"]
    pinned = launch.torchrun_argv(request(world=2), "/py", "/t.json", master_port=29555)
    assert "--standalone" not in pinned and pinned[pinned.index("--master-port") + 1] == "29555"
    assert pinned[-1] == "/t.json"


def test_torchrun_argv_multi_node():
    req = request(world=16)
    req.cluster.update(nodes=2, devices_per_node=8)
    argv = launch.torchrun_argv(req, "/py", rdzv_endpoint="node0:29400")
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--nproc-per-node") + 1] == "8"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "node0:29400" and "--standalone" not in argv
    # without one: torchrun's static rendezvous, node rank and node 0's address filled in per node
    static = launch.torchrun_argv(req, "/py")
    assert static[static.index("--node-rank") + 1] == "{node_rank}" and "--rdzv-endpoint" not in static
    assert static[static.index("--master-addr") + 1] == "{master_addr}"
    assert static[static.index("--master-port") + 1] == "{master_port}"


def test_launch_imports_no_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import autotune.workers.torch_probe.launch as l, autotune.workers.torch_probe as p\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


# -- statistics ---------------------------------------------------------------------------------


def test_summarize_times_median_and_spread():
    stats = measure.summarize_times([1.0, 2.0, 3.0, 4.0, 10.0])
    assert stats["step_time_s"] == 3.0
    assert stats["step_time_p10_s"] == pytest.approx(1.4)
    assert stats["step_time_p90_s"] == pytest.approx(7.6)
    assert stats["step_time_spread"] == pytest.approx((7.6 - 1.4) / 3.0)
    assert measure.summarize_times([2.0])["step_time_spread"] == 0.0


def _ev(name, start, end):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_comm_fraction_unions_overlapping_and_nested_events():
    events = [
        _ev("aten::mm", 0, 100),
        _ev("gloo:all_reduce", 10, 30),
        _ev("c10d::allreduce_", 12, 28),  # nested in the one above: not counted twice
        _ev("nccl:all_gather", 25, 40),  # overlaps
        _ev("aten::broadcast_tensors", 50, 90),  # compute, not communication
        _ev("_c10d_functional::wait_tensor", 95, 120),  # clipped to the step
    ]
    frac, comm = measure.comm_fraction(events, 0, 100)
    assert comm == pytest.approx(30 + 5)
    assert frac == pytest.approx(0.35)


def test_memory_limit_env():
    assert measure.memory_limit_gib({"AUTOTUNE_MEMORY_LIMIT_GIB": "1.5"}) == 1.5
    assert measure.memory_limit_gib({}) is None


def test_zero1_partition_balances_and_is_deterministic():
    pytest.importorskip("torch")
    from autotune.workers.torch_probe.zero1 import partition

    owners = partition([100, 10, 60, 50, 5], 2)
    loads = [sum(s for s, o in zip([100, 10, 60, 50, 5], owners) if o == r) for r in range(2)]
    assert owners == partition([100, 10, 60, 50, 5], 2)
    assert max(loads) - min(loads) <= 10
