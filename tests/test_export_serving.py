"""A serving study's exports launch what was measured (issue #33), read back by the engines' own code.

- vLLM / vLLM-Ascend: ``serve_vllm.sh`` is run by bash with a stand-in ``vllm`` (and ``python``
  on CPU) that records each server's argv and devices; vLLM 0.32's own parser
  (``make_arg_parser`` on a ``FlexibleArgumentParser``, then ``AsyncEngineArgs.from_cli_args``, in
  ``.venv-vllm``: tests/fixtures/vllm/parse_serve_args.py) parses every recorded command line and
  every measured setting reads back equal; changing one rendered setting makes the comparison
  fail. The ``vllm`` preset's ``engine.json`` carries the same engine arguments.
- MindIE: the exported fragment merged into MindIE's own default config.json (golden,
  tests/fixtures/mindie/) reads back at the documented paths, within MindIE's documented ranges;
  the ``mindie`` preset's per-replica config.json is that merge with the probe's ports; the metric
  names the probe reads are in MindIE's (and vLLM's) golden ``/metrics``.
- A serving study never exports a training launch and a training study never a serving one; the
  stacks' rules refuse what the engines cannot launch, with the engines' reasons.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from autotune import stacks
from autotune.export import ExportContext, ExportRefused
from autotune.export._base import script_arrays
from autotune.export._mindie import MINDIE_DEFAULT_CONFIG, MINDIE_KEYS, merge_config, mindie_settings, setting_path
from autotune.export._vllm import vllm_engine_args
from autotune.finish.exports import EXPORTERS, default_formats, write_exports
from autotune.spec.models import PRESETS as MODELS
from autotune.dispatch.stack_presets import preset_launch
from autotune.stacks import STACKS
from autotune.stacks.mindie import METRICS_NAMES as MINDIE_METRICS, STARTUP_FAILURES as MINDIE_FAILURES
from autotune.stacks.vllm import METRICS_NAMES as VLLM_METRICS, STARTUP_FAILURES as VLLM_FAILURES, user_arg_conflicts
from autotune.workers.protocol import TrialRequest
from support import VLLM_PYTHON, server_words, vllm_parse, vllm_stand_ins

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
LLAMA2_7B = {"name": "llama2-7b", "arch": "llama", **MODELS["llama2-7b"]}
WORKLOAD = {
    "kind": "serve",
    "traffic": {"rates": [0.5, 1.0, 2.0, 4.0], "prompt_len": {"low": 256, "high": 1024}, "output_len": 256},
    "slo": {"ttft_p99_ms": 2000.0, "tpot_p99_ms": 100.0},
    "max_model_len": 1280,
    "startup_timeout_s": 300.0,
}
TRAIN_WORKLOAD = {"kind": "train", "seq_len": 4096, "global_batch_size": 64}


def serve(**changes: Any) -> dict[str, Any]:
    """A canonical serving config (the space's form: world_size derived)."""
    config = {
        "tp": 1,
        "pp": 1,
        "replicas": 1,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "block_size": 128,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "memory_utilization": 0.9,
        "graph_mode": "graph",
        "kv_cache_dtype": "auto",
        "quantization": "none",
        "precision": "bf16",
        "env.HCCL_BUFFSIZE": "200",
        **changes,
    }
    config["world_size"] = config["replicas"] * config["tp"] * config["pp"]
    return config


def context(config: dict[str, Any], accelerator: str, target: str = "vllm", **changes: Any) -> ExportContext:
    fields = {
        "study": "serve",
        "trial": 5,
        "config": dict(config),
        "metrics": {"goodput_rps_per_device": 0.75},
        "source": "measured",
        "model": dict(LLAMA2_7B),
        "workload": dict(WORKLOAD),
        "cluster": {"accelerator": accelerator, "nodes": 1, "devices_per_node": 8, "world_size": 8},
        "target": target,
        **changes,
    }
    return ExportContext(**fields)


# ------------------------------------------------------------------------------ vLLM's own parser
# measured configs, each with the accelerator it was measured on (every one launchable: no refusal)
VLLM_CONFIGS = {
    "npu-2x-tp2-chunked-prefix": (
        "npu",
        serve(
            tp=2,
            replicas=2,
            max_num_seqs=64,
            max_num_batched_tokens=4096,
            memory_utilization=0.85,
            **{"engine.async_scheduling": True, "engine.additional_config": '{"enable_cpu_binding": false}'},
        ),
    ),
    "npu-w8a8-int8kv-eager": (
        "npu",
        serve(tp=4, quantization="w8a8", kv_cache_dtype="int8", graph_mode="eager", enable_prefix_caching=False),
    ),
    "npu-4x-tp2-noprefix-fp16": ("npu", serve(tp=2, replicas=4, enable_prefix_caching=False, precision="fp16")),
    "cuda-tp4-pp2-fp8kv-block16": (
        "cuda",
        serve(
            tp=4,
            pp=2,
            block_size=16,
            kv_cache_dtype="fp8",
            enable_chunked_prefill=False,
            max_num_batched_tokens=2048,
            graph_mode="eager",
            precision="fp16",
        ),
    ),
    "cuda-int8kv-int4": ("cuda", serve(tp=2, replicas=2, kv_cache_dtype="int8", quantization="int4")),
    "cpu-2x-block32-eager": (
        "cpu",
        serve(replicas=2, block_size=32, graph_mode="eager", max_num_seqs=8, max_num_batched_tokens=2048),
    ),
}


def expected_engine(config: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """What vLLM must build from the exported command line: the measured config, in vLLM's terms
    (written out here independently of the exporter)."""
    kv = config["kv_cache_dtype"]
    if kv == config["precision"] or accelerator == "npu":  # vLLM-Ascend: int8 KV is the checkpoint's C8
        kv = "auto"
    additional = json.loads(config.get("engine.additional_config", "{}"))
    return {
        "tensor_parallel_size": config["tp"],
        "pipeline_parallel_size": config["pp"],
        "max_num_seqs": config["max_num_seqs"],
        "max_num_batched_tokens": config["max_num_batched_tokens"],
        "block_size": config["block_size"],
        "enable_chunked_prefill": config["enable_chunked_prefill"],
        "enable_prefix_caching": config["enable_prefix_caching"],
        "gpu_memory_utilization": config["memory_utilization"],
        "enforce_eager": config["graph_mode"] == "eager",
        "kv_cache_dtype": {"bf16": "bfloat16", "fp16": "float16", "int8": "int8_per_token_head"}.get(kv, kv),
        "quantization": None
        if config["quantization"] == "none"
        else ("ascend" if accelerator == "npu" else "compressed-tensors"),
        "dtype": {"bf16": "bfloat16", "fp16": "float16"}[config["precision"]],
        "additional_config": additional,
        "max_model_len": WORKLOAD["max_model_len"],
        "async_scheduling": config.get("engine.async_scheduling"),
    }


def readback(engine: dict[str, Any]) -> dict[str, Any]:
    return {k: engine[k] for k in expected_engine(serve(), "cuda")}


def run_script(script: Path, tmp_path: Path, *extra: str) -> list[dict[str, Any]]:
    """Run an exported serve_vllm.sh with the stand-ins; each server's record, by port."""
    records = tmp_path / "records"
    records.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PATH": f"{vllm_stand_ins(tmp_path)}:{os.environ['PATH']}",
        "RECORD_DIR": str(records),
        "MODEL": "/ckpt/llama2-7b",
        "PORT": "9100",
        "ASCEND_HOME": str(tmp_path / "no-ascend"),
    }
    subprocess.run(["bash", str(script), *extra], env=env, check=True, timeout=60, cwd=tmp_path)
    out = [json.loads(p.read_text()) for p in records.glob("*.json")]
    return sorted(out, key=lambda r: int(r["argv"][r["argv"].index("--port") + 1]))


needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"vLLM is not installed at {VLLM_PYTHON} (the README's install command makes .venv-vllm): "
    "vLLM's own parser cannot check the vllm export",
)
# one rendered setting changed, per measured setting: the flag words before and after
MUTATIONS = {
    "tensor_parallel_size": ("--tensor-parallel-size", lambda v: str(int(v) * 2)),
    "pipeline_parallel_size": ("--pipeline-parallel-size", lambda v: str(int(v) + 1)),
    "max_num_seqs": ("--max-num-seqs", lambda v: str(int(v) + 1)),
    "max_num_batched_tokens": ("--max-num-batched-tokens", lambda v: str(int(v) * 2)),
    "block_size": ("--block-size", lambda v: "64"),
    "gpu_memory_utilization": ("--gpu-memory-utilization", lambda v: "0.5"),
    "kv_cache_dtype": ("--kv-cache-dtype", lambda v: "fp8_e5m2"),
    "dtype": ("--dtype", lambda v: "float32"),
    "max_model_len": ("--max-model-len", lambda v: "999"),
    "additional_config": ("--additional-config", lambda v: '{"changed": 1}'),
}
FLIPS = {
    "enable_chunked_prefill": ("--enable-chunked-prefill", "--no-enable-chunked-prefill"),
    "enable_prefix_caching": ("--enable-prefix-caching", "--no-enable-prefix-caching"),
    "enforce_eager": ("--enforce-eager", "--no-enforce-eager"),
}


def mutate(words: list[str], field: str) -> list[str]:
    words = list(words)
    if field in FLIPS:
        a, b = FLIPS[field]
        i = next(i for i, w in enumerate(words) if w in (a, b))
        words[i] = b if words[i] == a else a
    elif field == "quantization":
        if "--quantization" in words:
            i = words.index("--quantization")
            del words[i : i + 2]
        else:
            words += ["--quantization", "compressed-tensors"]
    elif field == "async_scheduling":
        words = [w for w in words if w not in ("--async-scheduling", "--no-async-scheduling")] + [
            "--no-async-scheduling"
        ]
    else:
        flag, change = MUTATIONS[field]
        if flag in words:
            i = words.index(flag)
            words[i + 1] = change(words[i + 1])
        else:
            words += [flag, change("1")]
    return words


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Any]:
    """Every VLLM_CONFIGS export run by bash, each server's recorded command line, and vLLM's own
    parse of them (and of each one-setting mutation of the first server's)."""
    out: dict[str, Any] = {}
    cases: list[list[str]] = []
    for name, (accelerator, config) in VLLM_CONFIGS.items():
        tmp = tmp_path_factory.mktemp(name)
        ctx = context(config, accelerator)
        assert EXPORTERS["vllm"].unsupported(ctx) == [], name
        script = write_exports(ctx, tmp / "export", ["vllm"])["vllm"]
        records = run_script(script, tmp)
        words = [server_words(r) for r in records]
        mutated = {field: mutate(words[0], field) for field in expected_engine(config, accelerator)}
        out[name] = {"script": script, "records": records, "words": words, "mutated": mutated, "first": len(cases)}
        cases += words + list(mutated.values())
    results = vllm_parse(cases) if VLLM_PYTHON.exists() else []
    for entry in out.values():
        n = len(entry["words"])
        entry["parsed"] = results[entry["first"] : entry["first"] + n]
        entry["parsed_mutated"] = dict(
            zip(entry["mutated"], results[entry["first"] + n : entry["first"] + n + len(entry["mutated"])])
        )
    return out


@needs_vllm
@pytest.mark.parametrize("name", sorted(VLLM_CONFIGS))
def test_vllms_parser_reads_back_every_measured_setting_of_each_server(name, exported):
    accelerator, config = VLLM_CONFIGS[name]
    entry = exported[name]
    assert len(entry["records"]) == config["replicas"]  # one server per replica
    for k, (record, parsed) in enumerate(zip(entry["records"], entry["parsed"])):
        assert parsed["ok"], parsed.get("error")
        engine = parsed["engine"]
        assert readback(engine) == expected_engine(config, accelerator), (name, k)
        assert engine["model"] == "/ckpt/llama2-7b" and engine["port"] == 9100 + k
        per = config["tp"] * config["pp"]
        devices = ",".join(str(d) for d in range(k * per, (k + 1) * per))
        variable = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}.get(
            accelerator, "VLLM_CPU_OMP_THREADS_BIND"
        )
        assert record["env"][variable] == devices  # each server on its own devices
        assert record["env"]["HCCL_BUFFSIZE"] == "200"  # the config's env settings reach every server


@needs_vllm
@pytest.mark.parametrize("field", sorted(expected_engine(serve(), "npu")))
def test_a_changed_setting_fails_the_comparison(field, exported):
    """The read-back catches a wrong rendering of each measured setting: one flag changed in the
    command line makes exactly that setting differ."""
    name = "npu-2x-tp2-chunked-prefix"
    accelerator, config = VLLM_CONFIGS[name]
    parsed = exported[name]["parsed_mutated"][field]
    assert parsed["ok"], parsed.get("error")
    got, want = readback(parsed["engine"]), expected_engine(config, accelerator)
    assert got != want
    assert [k for k in want if got[k] != want[k]] == [field]


@needs_vllm
def test_vllms_parser_refuses_a_command_line_it_does_not_know(exported):
    words = exported["cuda-int8kv-int4"]["words"][0]
    result = vllm_parse([[*words, "--no-such-flag", "1"]])[0]
    assert not result["ok"] and "SystemExit" in result["error"]


def test_the_script_passes_the_users_flags_to_every_server(tmp_path):
    accelerator, config = VLLM_CONFIGS["npu-4x-tp2-noprefix-fp16"]
    script = write_exports(context(config, accelerator), tmp_path / "export", ["vllm"])["vllm"]
    assert os.access(script, os.X_OK)
    records = run_script(script, tmp_path, "--api-key", "my key")
    assert len(records) == 4
    for record in records:
        assert record["argv"][-2:] == ["--api-key", "my key"]  # last, a space survives
    text = script.read_text()
    assert "vLLM-Ascend" in text and "ascend-toolkit/set_env.sh" in text and "nnal/atb/set_env.sh" in text


def test_the_script_asks_for_the_checkpoint_it_cannot_know(tmp_path):
    accelerator, config = VLLM_CONFIGS["cuda-int8kv-int4"]
    script = write_exports(context(config, accelerator), tmp_path / "export", ["vllm"])["vllm"]
    env = {k: v for k, v in os.environ.items() if k != "MODEL"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "set MODEL to the checkpoint of llama2-7b" in proc.stderr
    assert "LLM-Compressor checkpoint" in script.read_text()  # what --quantization compressed-tensors loads
    with_path = context(config, accelerator, model={**LLAMA2_7B, "path": "/models/llama 2"})
    text = EXPORTERS["vllm"].render(with_path)
    assert "MODEL=${MODEL:-'/models/llama 2'}" in text


# ----------------------------------------------------------------------- the vllm preset's launch
def request(config: dict[str, Any], accelerator: str, model: dict[str, Any] | None = None) -> TrialRequest:
    return TrialRequest(
        params=dict(config),
        model=dict(model or LLAMA2_7B),
        workload=dict(WORKLOAD),
        cluster={"accelerator": accelerator, "nodes": 1, "devices_per_node": 8},
        study="serve",
        number=5,
    )


def engine_json(kind: str, config: dict[str, Any], accelerator: str, args=(), model=None, python=None):
    backend = SimpleNamespace(entry=None, args=list(args))
    launch = preset_launch(kind, backend, request(config, accelerator, model), 0, 0, python=python)
    assert launch["argv"] == [
        sys.executable,
        "-m",
        "autotune.workers.serve_probe",
        "--engine",
        "{trial_dir}/engine.json",
    ]
    assert launch["stack_log"] is None
    return json.loads(launch["files"]["engine.json"])


@pytest.mark.parametrize("name", sorted(VLLM_CONFIGS))
def test_the_vllm_launch_runs_what_the_export_writes(name):
    """engine.json's engine arguments are the exported script's VLLM_ARGS (one rendering), with the
    engine's interpreter, the user's args last, and each replica's devices."""
    accelerator, config = VLLM_CONFIGS[name]
    user = ["--load-format", "dummy", "--skip-tokenizer-init", "--kv-cache-memory-bytes", "1073741824"]
    engine = engine_json("vllm", config, accelerator, user, python=str(VLLM_PYTHON))
    exported_args = script_arrays(EXPORTERS["vllm"].render(context(config, accelerator)))["VLLM_ARGS"]
    assert len(engine["replicas"]) == config["replicas"]
    per = config["tp"] * config["pp"]
    for k, replica in enumerate(engine["replicas"]):
        argv = replica["argv"]
        assert argv[:3] == [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
        assert argv[argv.index("--port") + 1] == "{port}" and argv[argv.index("--model") + 1] == "{trial_dir}/model"
        start = argv.index("--tensor-parallel-size")
        assert argv[start : start + len(exported_args)] == exported_args
        assert argv[-len(user) :] == user
        assert replica["devices"] == list(range(k * per, (k + 1) * per))
    assert engine["api"]["model"] == "autotune-model" and engine["api"]["health"] == "/health"
    assert engine["metrics_names"] == VLLM_METRICS and engine["startup_failures"] == VLLM_FAILURES
    assert engine["version"] == ("vllm 0.32.0" if VLLM_PYTHON.exists() else "")
    hf = json.loads(engine["files"]["model/config.json"])
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["num_hidden_layers"] == 32
    assert hf["num_key_value_heads"] == 32 and hf["torch_dtype"] == expected_engine(config, accelerator)["dtype"]


def test_the_vllm_launch_uses_a_checkpoint_when_the_model_names_one():
    engine = engine_json("vllm", serve(), "cuda", model={**LLAMA2_7B, "path": "/ckpt/llama2"})
    argv = engine["replicas"][0]["argv"]
    assert argv[argv.index("--model") + 1] == "/ckpt/llama2" and engine["files"] == {}
    own = engine_json("vllm", serve(), "cuda", args=["--model", "/mine"])  # the user's --model
    assert "--model" not in own["replicas"][0]["argv"][:-2] and own["files"] == {}


def test_the_users_args_cannot_override_what_the_trial_decides():
    assert user_arg_conflicts(["--load-format", "dummy", "--skip-tokenizer-init"]) == []
    assert user_arg_conflicts(["--enforce-eager", "-tp", "2", "--max-num-seqs=8"]) == [
        "--enforce-eager",
        "--max-num-seqs",
        "--tensor-parallel-size",
    ]
    with pytest.raises(ValueError, match="backend.args sets --enforce-eager"):
        engine_json("vllm", serve(), "cpu", args=["--enforce-eager"])


def test_the_cpu_launch_binds_each_single_rank_replica_to_its_cores():
    engine = engine_json("vllm", serve(replicas=2, block_size=32), "cpu")
    assert [r["env"] for r in engine["replicas"]] == [{"VLLM_CPU_OMP_THREADS_BIND": "{devices}"}] * 2
    assert engine_json("vllm", serve(tp=2, block_size=32), "cpu")["replicas"][0]["env"] == {}


def test_vllms_metric_names_and_startup_words_are_its_own():
    """The names the probe reads are in a real vLLM 0.32 /metrics, and a real startup failure
    (--block-size 16 on CPU) is classified by the first matching rule."""
    metrics = (FIXTURES / "vllm" / "metrics.txt").read_text()
    present = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", metrics, re.MULTILINE))
    for what, names in VLLM_METRICS.items():
        assert names[0] in present, what  # the current name first; older ones after it
    log = (FIXTURES / "vllm" / "startup_block_size_16.log").read_text()
    matched = [(status, text) for pattern, status, text in VLLM_FAILURES if re.search(pattern, log)]
    assert matched[0] == ("invalid", "the attention backend does not support block_size")
    assert ("crash", "vLLM's engine core failed to start") in matched  # the generic words come later


# ------------------------------------------------------------------------------------------ MindIE
GOLDEN_CONFIG = json.loads((FIXTURES / "mindie" / "config.json").read_text())
# where MindIE reads each setting (service_parameter_configuration.md), written out independently
DOCUMENTED = {
    "maxBatchSize": ("BackendConfig", "ScheduleConfig", "maxBatchSize"),
    "maxPrefillBatchSize": ("BackendConfig", "ScheduleConfig", "maxPrefillBatchSize"),
    "maxPrefillTokens": ("BackendConfig", "ScheduleConfig", "maxPrefillTokens"),
    "cacheBlockSize": ("BackendConfig", "ScheduleConfig", "cacheBlockSize"),
    "templateType": ("BackendConfig", "ScheduleConfig", "templateType"),
    "maxIterTimes": ("BackendConfig", "ScheduleConfig", "maxIterTimes"),
    "maxQueueDelayMicroseconds": ("BackendConfig", "ScheduleConfig", "maxQueueDelayMicroseconds"),
    "worldSize": ("BackendConfig", "ModelDeployConfig", "ModelConfig", 0, "worldSize"),
    "npuMemSize": ("BackendConfig", "ModelDeployConfig", "ModelConfig", 0, "npuMemSize"),
    "plugin_params": ("BackendConfig", "ModelDeployConfig", "ModelConfig", 0, "plugin_params"),
    "npuDeviceIds": ("BackendConfig", "npuDeviceIds"),
    "modelInstanceNumber": ("BackendConfig", "modelInstanceNumber"),
    "maxSeqLen": ("BackendConfig", "ModelDeployConfig", "maxSeqLen"),
    "maxInputTokenLen": ("BackendConfig", "ModelDeployConfig", "maxInputTokenLen"),
}
QWEN = {"name": "Qwen2.5-7B-Instruct", "arch": "llama", **MODELS["llama2-7b"], "path": "/ckpt/qwen2.5-7b"}
MINDIE_CONFIGS = {
    "tp4-prefix-splitfuse": serve(
        tp=4,
        max_num_seqs=128,
        max_num_batched_tokens=16384,
        **{"engine.maxQueueDelayMicroseconds": 2000, "engine.maxPrefillBatchSize": 32},
    ),
    "2x-tp2-noplugins": serve(
        tp=2, replicas=2, enable_chunked_prefill=False, enable_prefix_caching=False, block_size=64, max_num_seqs=200
    ),
    "8x-tp1-w8a8-c8": serve(replicas=8, quantization="w8a8", kv_cache_dtype="int8", **{"engine.maxIterTimes": 200}),
}


def at(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def expected_mindie(config: dict[str, Any]) -> dict[str, Any]:
    """The measured config in MindIE's terms (the documented mapping)."""
    plugins = [
        p
        for p, on in (
            ("prefix_cache", config["enable_prefix_caching"]),
            ("splitfuse", config["enable_chunked_prefill"]),
        )
        if on
    ]
    return {
        "maxBatchSize": config["max_num_seqs"],
        "maxPrefillBatchSize": config.get("engine.maxPrefillBatchSize", config["max_num_seqs"]),
        "maxPrefillTokens": config["max_num_batched_tokens"],
        "cacheBlockSize": config["block_size"],
        "templateType": "Mix" if config["enable_chunked_prefill"] else "Standard",
        "maxIterTimes": config.get("engine.maxIterTimes", 256),  # the traffic's longest output
        "maxQueueDelayMicroseconds": config.get("engine.maxQueueDelayMicroseconds", 5000),
        "worldSize": config["tp"],
        "npuMemSize": -1,
        "plugin_params": {"plugin_type": ",".join(plugins)} if plugins else None,
        "npuDeviceIds": [list(range(config["tp"]))],
        "modelInstanceNumber": 1,
        "maxSeqLen": 1280,
        "maxInputTokenLen": 1024,  # the traffic's longest prompt
    }


def mindie_readback(config_json: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, path in DOCUMENTED.items():
        try:
            value = at(config_json, path)
        except KeyError:
            value = None
        out[name] = json.loads(value) if name == "plugin_params" and value is not None else value
    return out


def check_mindie_ranges(merged: dict[str, Any]) -> None:
    """MindIE's own checks of these keys (schedule_config.cpp CheckParam, model_deploy_config.cpp,
    service_parameter_configuration.md)."""
    schedule = merged["BackendConfig"]["ScheduleConfig"]
    deploy = merged["BackendConfig"]["ModelDeployConfig"]
    model = deploy["ModelConfig"][0]
    assert 1 <= schedule["cacheBlockSize"] <= 128 and schedule["cacheBlockSize"] % 16 == 0
    assert 1 <= schedule["maxBatchSize"] <= 819200
    assert 1 <= schedule["maxPrefillBatchSize"] <= schedule["maxBatchSize"]
    assert deploy["maxInputTokenLen"] <= schedule["maxPrefillTokens"] <= 4194304
    assert 1 <= schedule["maxIterTimes"] <= deploy["maxSeqLen"]
    assert schedule["templateType"] in ("Standard", "Mix") and schedule["templateName"] == "Standard_LLM"
    assert model["npuMemSize"] == -1 or model["npuMemSize"] > 0
    assert model["worldSize"] == len(merged["BackendConfig"]["npuDeviceIds"][0])
    if "plugin_params" in model:
        plugins = re.split(r",\s*", json.loads(model["plugin_params"])["plugin_type"])
        assert set(plugins) <= {"prefix_cache", "splitfuse"}
        assert ("splitfuse" in plugins) == (schedule["templateType"] == "Mix")  # splitFuse.md


def test_the_embedded_default_config_is_mindies_own():
    assert MINDIE_DEFAULT_CONFIG == GOLDEN_CONFIG


@pytest.mark.parametrize("name", sorted(MINDIE_CONFIGS))
def test_the_mindie_export_merged_into_its_config_reads_back_at_the_documented_paths(name, tmp_path):
    config = MINDIE_CONFIGS[name]
    ctx = context(config, "npu", target="mindie", model=QWEN)
    assert EXPORTERS["mindie"].unsupported(ctx) == []
    fragment = json.loads(write_exports(ctx, tmp_path, ["mindie"])["mindie"].read_text())
    header = fragment["_autotune"]
    assert header["study"] == "serve" and header["trial"] == 5 and header["source"] == "measured"
    assert header["env"] == {"NPU_MEMORY_FRACTION": "0.9", "MIES_SERVICE_MONITOR_MODE": "1"}
    tp = config["tp"]
    assert [r["ASCEND_RT_VISIBLE_DEVICES"] for r in header["replicas"]] == [
        ",".join(str(d) for d in range(k * tp, (k + 1) * tp)) for k in range(config["replicas"])
    ]
    merged = merge_config(GOLDEN_CONFIG, fragment)
    assert "_autotune" not in merged
    assert mindie_readback(merged) == expected_mindie(config)
    check_mindie_ranges(merged)
    model = at(merged, DOCUMENTED["worldSize"][:-1])
    assert model["modelWeightPath"] == "/ckpt/qwen2.5-7b" and model["modelName"] == "Qwen2.5-7B-Instruct"
    assert model["backendType"] == "atb"  # what the export does not set stays MindIE's
    if config["quantization"] != "none":
        assert "msModelSlim" in header["weights"]


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_a_changed_mindie_setting_fails_the_comparison(name):
    config = MINDIE_CONFIGS["tp4-prefix-splitfuse"]
    merged = merge_config(
        GOLDEN_CONFIG, mindie_settings(config, max_model_len=1280, max_prompt_len=1024, max_output_len=256)
    )
    path = DOCUMENTED[name]
    parent = at(merged, path[:-1])
    value = parent[path[-1]]
    parent[path[-1]] = (
        json.dumps({"plugin_type": "prefix_cache"})
        if name == "plugin_params"
        else [[0]]
        if name == "npuDeviceIds"
        else "Standard"
        if name == "templateType"
        else value + 1
    )
    got, want = mindie_readback(merged), expected_mindie(config)
    assert [k for k in want if got[k] != want[k]] == [name]


def test_every_setting_has_the_path_mindie_reads_it_from():
    for name, path in DOCUMENTED.items():
        assert setting_path(name) == path, name
        parent = at(GOLDEN_CONFIG, path[:-1])  # the section exists in MindIE's own config.json
        assert isinstance(parent, dict)
    for name in MINDIE_KEYS:
        section = at(GOLDEN_CONFIG, MINDIE_KEYS[name])
        assert isinstance(section, dict), name


def test_the_mindie_launch_renders_the_same_config_with_the_probes_ports():
    config = MINDIE_CONFIGS["2x-tp2-noplugins"]
    engine = engine_json("mindie", config, "npu", args=["--expert-parallel", "false"], model=QWEN)
    assert engine["engine"] == "mindie" and len(engine["replicas"]) == 2
    api = engine["api"]
    assert (api["health_port"], api["metrics_port"]) == ("management_port", "metrics_port")
    for k, replica in enumerate(engine["replicas"]):
        assert replica["argv"] == ["mindieservice_daemon", "--expert-parallel", "false"]
        assert replica["devices"] == [2 * k, 2 * k + 1]
        env = replica["env"]
        assert env["MIES_CONFIG_JSON_PATH"] == "{replica_dir}/config.json"
        assert env["ASCEND_RT_VISIBLE_DEVICES"] == "{devices}" and env["MIES_SERVICE_MONITOR_MODE"] == "1"
        assert env["NPU_MEMORY_FRACTION"] == "0.9" and env["MINDIE_LOG_TO_STDOUT"] == "1"
        text = replica["files"]["config.json"]
        for placeholder, port in (("{port}", 9000), ("{management_port}", 9001), ("{metrics_port}", 9002)):
            text = text.replace(placeholder, str(port))
        rendered = json.loads(text)  # the probe's filled-in file is MindIE JSON
        server = rendered["ServerConfig"]
        assert (server["port"], server["managementPort"], server["metricsPort"]) == (9000, 9001, 9002)
        assert server["ipAddress"] == server["managementIpAddress"] == "127.0.0.1" and not server["httpsEnabled"]
        assert mindie_readback(rendered) == expected_mindie(config)
        check_mindie_ranges(rendered)
        # what the export writes, merged into MindIE's default, is what the launch runs (ports aside)
        fragment = json.loads(EXPORTERS["mindie"].render(context(config, "npu", target="mindie", model=QWEN)))
        exported = merge_config(GOLDEN_CONFIG, fragment)
        for section in ("ScheduleConfig", "npuDeviceIds", "modelInstanceNumber"):
            assert rendered["BackendConfig"][section] == exported["BackendConfig"][section]
        ours = rendered["BackendConfig"]["ModelDeployConfig"]
        theirs = exported["BackendConfig"]["ModelDeployConfig"]
        assert {**ours["ModelConfig"][0], "modelName": None} == {**theirs["ModelConfig"][0], "modelName": None}
        assert ours["maxSeqLen"] == theirs["maxSeqLen"] and ours["maxInputTokenLen"] == theirs["maxInputTokenLen"]
    with pytest.raises(ValueError, match="MindIE loads real weights"):
        engine_json("mindie", config, "npu", model=LLAMA2_7B)


def test_mindies_metric_names_are_in_its_metrics_and_its_words_classify_its_failures():
    metrics = (FIXTURES / "mindie" / "metrics.txt").read_text()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", metrics, re.MULTILINE))
    values = dict(re.findall(r"^([a-z_]+)\{[^}]*\} (\S+)$", metrics, re.MULTILINE))
    assert types[MINDIE_METRICS["kv_cache_usage"][0]] == "gauge"
    assert types[MINDIE_METRICS["preemptions"][0]] == "counter"  # a delta over the run
    assert types[MINDIE_METRICS["running"][0]] == types[MINDIE_METRICS["waiting"][0]] == "gauge"
    assert float(values["npu_cache_usage_perc"]) == 0.1 and float(values["num_preemptions_total"]) == 1274
    words = {
        "Warmup failed due to NPU out of memory when `npuMemSize` set to -1.": "oom",
        "Warmup failed. This issue could be caused by setting both `max_prefill_tokens` and": "oom",
        "scheduleParam.cacheBlockSize [256] is out of bound [128]": "invalid",
        "Failed to init endpoint! Please check the service log or console output.": "crash",
    }
    for line, status in words.items():
        first = next(s for pattern, s, _ in MINDIE_FAILURES if re.search(pattern, line))
        assert first == status, line


# ------------------------------------------------------------------------ refusals, both ways
SERVING_FORMATS = [f for f, e in EXPORTERS.items() if e.launches == "serve" and e.targets]
TRAINING_FORMATS = [f for f, e in EXPORTERS.items() if e.launches == "train" and e.targets]


def test_a_serving_study_never_exports_a_training_launch(tmp_path):
    ctx = context(serve(tp=2), "npu")
    assert set(SERVING_FORMATS) == {"vllm", "mindie"} and {"megatron", "deepspeed"} <= set(TRAINING_FORMATS)
    for fmt in TRAINING_FORMATS:
        reasons = EXPORTERS[fmt].unsupported(ctx)
        assert reasons and "writes a training launch, and this study tuned a serve workload" in reasons[0], fmt
    with pytest.raises(ExportRefused, match="megatron writes a training launch"):
        write_exports(ctx, tmp_path / "out", ["yaml", "vllm", "megatron"])
    assert not (tmp_path / "out").exists()
    assert set(write_exports(ctx, tmp_path / "ok", ["yaml", "env", "vllm"])) == {"yaml", "env", "vllm"}
    assert default_formats("vllm", "serve") == ("yaml", "env", "vllm")


def test_a_training_study_never_exports_a_serving_launch():
    train = {"tp": 2, "pp": 1, "cp": 1, "dp": 4, "micro_batch_size": 1, "grad_accum": 16, "precision": "bf16"}
    for kind in ("train", "infer"):
        ctx = context(train, "npu", target="mindspeed", workload={**TRAIN_WORKLOAD, "kind": kind})
        for fmt in SERVING_FORMATS:
            reasons = EXPORTERS[fmt].unsupported(ctx)
            assert reasons == [
                f"{fmt} writes a serving launch, and this study tuned a {kind} workload: its config is in best_config.yaml and best.env"
            ], fmt
    assert default_formats("mindspeed") == ("yaml", "env", "megatron")


# ------------------------------------------------------------ rules: what the engines cannot launch
RULES = [
    ("vllm", "cuda", {"max_num_seqs": 512, "max_num_batched_tokens": 256}, "max_num_batched_tokens >= max_num_seqs"),
    (
        "vllm",
        "cuda",
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 1024},
        "without chunked prefill vLLM needs max_num_batched_tokens >= max_model_len",
    ),
    ("vllm", "npu", {"graph_mode": "torchair"}, "for DeepSeek-series and PanguProMoE models only"),
    ("vllm", "cuda", {"graph_mode": "torchair"}, "vLLM-Ascend's torchair graph"),
    ("vllm", "npu", {"block_size": 16}, "block_size 128 whenever prefix caching or chunked prefill is on"),
    ("vllm", "cpu", {"block_size": 16}, "needs a block_size multiple of 32"),
    ("vllm", "cpu", {"block_size": 32, "kv_cache_dtype": "int8"}, "model dtype or fp8 only"),
    ("vllm", "cpu", {"block_size": 32, "kv_cache_dtype": "fp16"}, "model dtype or fp8 only"),
    ("vllm", "npu", {"kv_cache_dtype": "fp8"}, "vLLM-Ascend takes no --kv-cache-dtype"),
    ("vllm", "npu", {"kv_cache_dtype": "int8"}, "quantization none cannot have it"),
    ("vllm", "npu", {"engine.maxIterTimes": 64}, "a camelCase engine.NAME is another engine's"),
    ("vllm", "npu", {"engine.max_num_seqs": 64}, "cannot also be set as engine.NAME"),
    ("mindie", "cuda", {}, "runs on Ascend NPUs only"),
    ("mindie", "npu", {"pp": 2}, "no pipeline parallelism"),
    ("mindie", "npu", {"block_size": 256}, "at most 128 and a multiple of 16"),
    ("mindie", "npu", {"graph_mode": "eager"}, "runs its own (ATB) graph"),
    ("mindie", "npu", {"graph_mode": "torchair"}, "runs its own (ATB) graph"),
    ("mindie", "npu", {"kv_cache_dtype": "fp8"}, "no bf16/fp16/fp8 setting"),
    ("mindie", "npu", {"kv_cache_dtype": "int8"}, "quantization none cannot have it"),
    (
        "mindie",
        "npu",
        {"max_num_batched_tokens": 512, "max_num_seqs": 64},
        "maxPrefillTokens (max_num_batched_tokens) >= maxInputTokenLen",
    ),
    ("mindie", "npu", {"quantization": "int8"}, "W8A8 and W4A8 quantization only"),
    ("mindie", "npu", {"engine.maxPrefillBatchSize": 512}, "at most maxBatchSize"),
    ("mindie", "npu", {"engine.maxIterTimes": 4096}, "at most maxSeqLen"),
    ("mindie", "npu", {"engine.maxBatchSize": 8}, "cannot also be set as engine.NAME"),
    ("mindie", "npu", {"engine.async_scheduling": True}, "not a MindIE config.json setting"),
]


@pytest.mark.parametrize("target, accelerator, change, reason", RULES)
def test_the_rules_refuse_what_the_engine_cannot_launch(target, accelerator, change, reason, tmp_path):
    model = QWEN if target == "mindie" else LLAMA2_7B
    ok = serve(block_size=32) if accelerator == "cpu" else serve()
    facts = {"accelerator": accelerator, "model": model, "workload": WORKLOAD}
    if change:  # the same config without the change launches
        assert stacks.unsupported_reasons(target, ok, facts) == []
    bad = serve(**{**ok, **change})
    reasons = stacks.unsupported_reasons(target, bad, facts)
    assert any(reason in r for r in reasons), reasons
    assert all(r.startswith(f"target {target}: ") for r in reasons)
    fmt = STACKS[target].exporter.name
    with pytest.raises(ExportRefused, match=re.escape(reason)):
        write_exports(context(bad, accelerator, target=target, model=model), tmp_path, [fmt])


def test_mindies_features_follow_its_supported_models():
    """MindIE's prefix cache and SplitFuse list the models they support: a Llama-2 has neither;
    a model the rules do not know by name (no facts) is not refused for it."""
    facts = {"accelerator": "npu", "model": LLAMA2_7B, "workload": WORKLOAD}
    reasons = stacks.unsupported_reasons("mindie", serve(), facts)
    assert any("prefix cache supports Qwen2/2.5/3 and DeepSeek" in r for r in reasons)
    assert any("SplitFuse (chunked prefill) supports LLaMA3.1-70B and Qwen2/2.5/3" in r for r in reasons)
    plain = serve(enable_prefix_caching=False, enable_chunked_prefill=False)
    assert stacks.unsupported_reasons("mindie", plain, facts) == []
    assert stacks.unsupported_reasons("mindie", serve(), {"accelerator": "npu"}) == []


def test_the_vllm_rendering_of_torchair_is_vllm_ascends_additional_config():
    """Refused for the dense models autotune tunes, but rendered as vLLM-Ascend <= v0.11 takes it."""
    args = vllm_engine_args(serve(graph_mode="torchair", **{"engine.additional_config": '{"x": 1}'}), "npu", 1024)
    config = json.loads(args[args.index("--additional-config") + 1])
    assert config == {"torchair_graph_config": {"enabled": True}, "ascend_scheduler_config": {"enabled": True}, "x": 1}
    assert "--no-enforce-eager" in args
