"""What an export says about its numbers is what the run did (issue 40, items 1 and 4).

An export is read by people who never saw the run, so each sentence of its header and comments is
generated from the study: a simulated study's files never say "measured" (only "not measured"),
a measured study's header says the metrics were measured and names them (and a result answered
from the cache says it was measured in an earlier run), and every value the model could not tell
apart (the trial's "not distinguished by the model (probe to choose): ..." list) is marked as not
chosen by evidence in every format: in the format's own comment syntax, or the ``_autotune`` key
of a JSON file. Every registered exporter is rendered: the training launches with a training
study, the serving launches with a serving study.
"""

from __future__ import annotations

import json
import re

import pytest

from autotune.export import ExportContext
from autotune.finish.exports import EXPORTERS
from autotune.trial_attrs import UNDISTINGUISHED

MODEL = {
    "name": "llama2-7b",
    "arch": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
ALLOC = "expandable_segments:True"
# a parallel training config (Megatron/MindSpeed, MindFormers) and a data-parallel one (DeepSpeed,
# torchtitan): each training format launches one of them
TRAIN_PARALLEL = {
    "tp": 2,
    "pp": 2,
    "vpp": 2,
    "cp": 1,
    "dp": 2,
    "micro_batch_size": 2,
    "grad_accum": 16,
    "sequence_parallel": True,
    "recompute": "full",
    "recompute_layers": 4,
    "zero_stage": 1,
    "precision": "bf16",
    "env.PYTORCH_NPU_ALLOC_CONF": ALLOC,
    "env.HCCL_BUFFSIZE": "200",
}
TRAIN_PLAIN = {
    "tp": 1,
    "pp": 1,
    "cp": 1,
    "vpp": 1,
    "dp": 8,
    "micro_batch_size": 2,
    "grad_accum": 4,
    "zero_stage": 0,
    "precision": "fp32",
    "recompute": "none",
    "env.PYTORCH_NPU_ALLOC_CONF": ALLOC,
    "env.HCCL_BUFFSIZE": "200",
}
TRAIN_WORKLOAD = {"kind": "train", "seq_len": 4096, "global_batch_size": 64}
# the knobs the model could not tell apart for the trial's layout (a value may hold commas)
TRAIN_UNDISTINGUISHED = {
    "env.HCCL_BUFFSIZE": "120|200|400",
    "env.PYTORCH_NPU_ALLOC_CONF": f"expandable_segments:False|{ALLOC}|max_split_size_mb:512,garbage_collection_threshold:0.8",
    "micro_batch_size": "1|2|4",
    "recompute": "none|full",
}
SERVE = {
    "tp": 2,
    "pp": 1,
    "replicas": 2,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 8192,
    "block_size": 128,
    "enable_chunked_prefill": False,
    "enable_prefix_caching": False,  # MindIE's prefix cache is for Qwen and DeepSeek models
    "memory_utilization": 0.95,
    "graph_mode": "graph",
    "kv_cache_dtype": "auto",
    "quantization": "w8a8",  # the checkpoint sentence of serve_vllm.sh
    "precision": "bf16",
    "world_size": 4,
    "env.HCCL_BUFFSIZE": "200",
}
SERVE_WORKLOAD = {
    "kind": "serve",
    "traffic": {"rates": [1.0, 2.0], "prompt_len": 512, "output_len": 128},
    "max_model_len": 640,
}
SERVE_UNDISTINGUISHED = {
    "replicas": "1|2",
    "enable_chunked_prefill": "False|True",
    "memory_utilization": "0.85|0.9|0.95",
    "env.HCCL_BUFFSIZE": "120|200|400",
}
TRAIN_FORMATS = {"yaml", "env", "megatron", "deepspeed", "torchtitan", "mindformers"}
SERVE_FORMATS = {"npu": {"yaml", "env", "vllm", "mindie"}, "cuda": {"yaml", "env", "vllm"}}
TRAIN_METRICS = {"tokens_per_s_per_device": 2901.5, "step_time_s": 11.29, "peak_memory_gib": 51.2}
SERVE_METRICS = {"goodput_rps_per_device": 0.75, "ttft_p99_ms": 812.0}
SOFTWARE = {"torch": "2.13.0", "torch_npu": "2.13.0", "cann": "8.1.RC1"}
# "measured", except in "not measured" (an identifier such as measured_steps is no claim)
CLAIMS_MEASURED = re.compile(r"(?<!not )\bmeasured\b")


def _reason(undistinguished: dict[str, str]) -> str:
    listed = ", ".join(f"{k} {v}" for k, v in undistinguished.items())
    return f"rank 1 by model; {UNDISTINGUISHED}{listed}; predicted 700 ± 30"


def _context(kind: str, source: str, accelerator: str = "npu", config: dict | None = None, **changes) -> ExportContext:
    train = kind == "train"
    fields = {
        "study": f"{kind}-study",
        "trial": 7,
        "config": dict(config or (TRAIN_PARALLEL if train else SERVE)),
        "metrics": dict(TRAIN_METRICS if train else SERVE_METRICS),
        "source": source,
        "model": dict(MODEL),
        "workload": dict(TRAIN_WORKLOAD if train else SERVE_WORKLOAD),
        "cluster": {"accelerator": accelerator, "nodes": 1, "devices_per_node": 8, "world_size": 8},
        "software": {} if source == "simulated" else dict(SOFTWARE),
        "target": "megatron" if train else "",
        "chosen_because": _reason(TRAIN_UNDISTINGUISHED if train else SERVE_UNDISTINGUISHED),
        **changes,
    }
    return ExportContext(**fields)


def render_all(kind: str, source: str, accelerator: str = "npu", **changes) -> dict[str, str]:
    """``{format: file text}`` of every registered exporter of the study's kind that launches its
    config (the training formats try the parallel config, then the data-parallel one)."""
    out = {}
    for name, exporter in EXPORTERS.items():
        if exporter.targets and exporter.launches != kind:
            continue
        configs = [TRAIN_PARALLEL, TRAIN_PLAIN] if kind == "train" else [SERVE]
        for config in configs:
            ctx = _context(kind, source, accelerator, config=config, **changes)
            if not exporter.unsupported(ctx):
                out[name] = exporter.render(ctx)
                break
    return out


STUDIES = [("train", "npu"), ("serve", "npu"), ("serve", "cuda")]


def _expected(kind: str, accelerator: str) -> set[str]:
    return TRAIN_FORMATS if kind == "train" else SERVE_FORMATS[accelerator]


def _header(name: str, text: str) -> str:
    """The file's header: the ``_autotune`` key of a JSON file, else its leading comment lines."""
    if name in ("deepspeed", "mindie"):
        return json.dumps(json.loads(text)["_autotune"], indent=1)
    lines = text.splitlines()
    lines = lines[1:] if lines and lines[0].startswith("#!") else lines
    head = []
    for line in lines:
        if not line.startswith("#"):
            break
        head.append(line)
    return "\n".join(head)


@pytest.mark.parametrize("kind,accelerator", STUDIES)
def test_every_format_renders(kind, accelerator):
    assert set(render_all(kind, "simulated", accelerator)) >= _expected(kind, accelerator)
    assert set(render_all(kind, "measured", accelerator)) >= _expected(kind, accelerator)


@pytest.mark.parametrize("kind,accelerator", STUDIES)
def test_a_simulated_study_never_says_measured(kind, accelerator):
    rendered = render_all(kind, "simulated", accelerator)
    claims = [
        f"{name}: {line.strip()}"
        for name, text in rendered.items()
        for line in text.splitlines()
        if CLAIMS_MEASURED.search(line)
    ]
    assert claims == []
    for name, text in rendered.items():  # and each says what its numbers are
        assert "not measured" in _header(name, text), name
        assert "simulat" in _header(name, text), name


@pytest.mark.parametrize("kind,accelerator", STUDIES)
def test_a_study_of_unknown_source_never_says_measured(kind, accelerator):
    rendered = render_all(kind, "", accelerator)
    assert rendered
    claims = [f"{n}: {line}" for n, t in rendered.items() for line in t.splitlines() if CLAIMS_MEASURED.search(line)]
    assert claims == []


@pytest.mark.parametrize("kind,accelerator", STUDIES)
def test_a_measured_study_says_what_was_measured_and_where(kind, accelerator):
    rendered = render_all(kind, "measured", accelerator)
    metrics = TRAIN_METRICS if kind == "train" else SERVE_METRICS
    for name, text in rendered.items():
        head = _header(name, text)
        assert CLAIMS_MEASURED.search(head), name
        assert "simulat" not in head.replace("not reported (simulated", ""), name
        if name in ("deepspeed", "mindie"):
            header = json.loads(text)["_autotune"]
            assert header["metrics"] == metrics and header["source"] == "measured"
            assert any(
                isinstance(v, str) and CLAIMS_MEASURED.search(v) and accelerator in v for v in header.values()
            ), (name, header)
        else:
            # one line says the metrics were measured, on which accelerator, and names their values
            first = next(iter(metrics))
            line = next((ln for ln in head.splitlines() if f"{first}={metrics[first]:.6g}" in ln), "")
            assert CLAIMS_MEASURED.search(line) and accelerator in line, (name, head)
            assert all(f"{k}={v:.6g}" in line for k, v in metrics.items()), (name, line)


@pytest.mark.parametrize(
    "changes",
    [{"source": "cache"}, {"chosen_because": "rank 1 by model; answered from the result cache (study older, trial 3)"}],
    ids=["source-cache", "answered-from-cache"],
)
def test_a_cached_result_says_it_was_measured_in_an_earlier_run(changes):
    rendered = render_all("train", changes.pop("source", "measured"), "npu", **changes)
    assert set(rendered) >= TRAIN_FORMATS
    for name, text in rendered.items():
        head = _header(name, text)
        assert "earlier run" in head and CLAIMS_MEASURED.search(head), (name, head)
        if "chosen_because" in changes:
            assert "study older, trial 3" in head, (name, head)


@pytest.mark.parametrize("source", ["simulated", "measured"])
@pytest.mark.parametrize("kind,accelerator", STUDIES)
def test_every_format_marks_the_values_the_evidence_did_not_choose(kind, accelerator, source):
    undistinguished = TRAIN_UNDISTINGUISHED if kind == "train" else SERVE_UNDISTINGUISHED
    rendered = render_all(kind, source, accelerator)
    assert set(rendered) >= _expected(kind, accelerator)
    for name, text in rendered.items():
        lines = text.splitlines()
        for knob, values in undistinguished.items():
            marked = [ln for ln in lines if knob in ln and "probe to choose" in ln]
            assert marked, f"{name} does not mark {knob} as not chosen by evidence:\n{text}"
            assert any(values in ln for ln in marked), (name, knob, marked)
        if name not in ("deepspeed", "mindie", "yaml", "mindformers"):
            # a shell file: every marking is a comment (sourcing it runs none of it)
            assert all(ln.lstrip().startswith("#") or " # " in ln or "  #" in ln for ln in lines if "probe" in ln)


def test_nothing_is_marked_when_the_model_told_every_value_apart():
    rendered = render_all("serve", "measured", "npu", chosen_because="rank 1 by model")
    assert set(rendered) >= SERVE_FORMATS["npu"]
    assert not [n for n, t in rendered.items() if "probe to choose" in t or "not chosen by evidence" in t]


def test_the_parser_reads_every_knob_not_only_env_settings():
    from autotune.export._base import undistinguished_knobs

    ctx = _context("serve", "simulated")
    assert undistinguished_knobs(ctx) == SERVE_UNDISTINGUISHED
    ctx = _context("train", "simulated")
    assert undistinguished_knobs(ctx) == TRAIN_UNDISTINGUISHED
    assert undistinguished_knobs(_context("train", "simulated", chosen_because="rank 2 by model")) == {}
