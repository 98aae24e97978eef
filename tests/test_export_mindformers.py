"""The MindFormers export, read by MindFormers 2.1.0's own code (issue #30).

Each measured config is exported, the export put on a MindFormers Llama model YAML with
``base_config:`` (MindFormers' own merge: the model YAML is the base, the export's keys win) and the
run YAML handed to ``tests/fixtures/mindformers/readback.py`` in MindSpore's environment
(``.venv-mindspore``), which runs MindFormers' config code on CPU in the order a training run does —
``MindFormerConfig``, ``build_context``, the trainer's ``_train_dataset_preprocess``, ``set_config``
(its batch rule ``_check_global_batch_size_for_auto_parallel``), ``check_rules`` — and builds the
network without weights (the legacy ``LlamaForCausalLM``, or an mcore ``GPTModel`` from a
``TransformerConfig``), whose ``LayerSetting`` decides the pipeline chunks and the recomputed layers
of every decoder layer. What it reads back must be the measured config: global batch, micro-batch,
tp, pp, dp, cp, vpp, recomputed layers per stage, optimizer sharding, precision and sequence
length. All cases run in one subprocess (~20 s of CPU on this 2-core machine, most of it building
the two 64-layer mcore networks).

The model YAMLs (tests/fixtures/mindformers/): MindFormers' ``configs/llama2/pretrain_llama2_7b.yaml``
and ``pretrain_llama2_70b.yaml`` (branch r1.5.0, the last that ships Llama YAMLs; MindFormers 2.1.0
still runs that model, ``LlamaForCausalLM``), both at sequence length 4096 and fp16; and MindFormers
2.1.0's own ``configs/qwen3/pretrain_qwen3_32b_4k.yaml`` (an mcore model, how 2.1.0 runs a
Llama-family dense model: its config converted to a ``TransformerConfig``, uneven stages by
``offset``, a ``dataset_strategy`` naming its own data_parallel).

Needs ``.venv-mindspore`` with MindFormers (README set-up:
``.venv-mindspore/bin/pip install --no-deps -r tests/fixtures/mindformers/requirements.txt``);
skipped without.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.export import ExportContext
from autotune.finish.exports import EXPORTERS
from autotune.spec.models import PRESETS
from test_export_targets import LLAMA2_7B, LLAMA3_8B, MEGATRON_CONFIGS, cfg, launched

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "mindformers"
READBACK = FIXTURES / "readback.py"
LLAMA2_70B = {"name": "llama2-70b", "arch": "llama", **PRESETS["llama2-70b"], "rms_norm_eps": 1e-5}
QWEN3_32B = {
    "name": "qwen3-32b",
    "arch": "llama",
    "hidden_size": 5120,
    "num_hidden_layers": 64,  # the YAML's model
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 25600,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
}


def _mindformers_python() -> tuple[str | None, str]:
    """MindSpore's interpreter with MindFormers importable, or None and why not."""
    python = os.environ.get("AUTOTUNE_MINDSPORE_PYTHON") or str(REPO / ".venv-mindspore" / "bin" / "python")
    if not Path(python).is_file():
        return None, f"no MindSpore environment ({python}; README set-up: .venv-mindspore)"
    probe = subprocess.run(
        [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('mindformers') is None)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode:
        return None, (
            f"MindFormers is not installed in {python} (README set-up: .venv-mindspore/bin/pip install "
            f"--no-deps -r tests/fixtures/mindformers/requirements.txt)"
        )
    return python, ""


MF_PYTHON, WHY_NOT = _mindformers_python()
pytestmark = pytest.mark.skipif(MF_PYTHON is None, reason=WHY_NOT)


def _case(
    config: dict[str, Any], model: dict[str, Any], yaml_name: str, seq_len: int = 4096, follows_header: bool = True
) -> dict[str, Any]:
    return {
        "config": config,
        "model": model,
        "base": FIXTURES / yaml_name,
        "seq_len": seq_len,
        "follows_header": follows_header,
    }


# The configs the Megatron test launches (tests/test_export_targets.py), on the Llama2-7B model YAML;
# two of them on MindFormers 2.1.0's Qwen3 YAML (an mcore network of 64 layers takes ~4 s to build
# here: pipeline 2 and 4, interleaved, partial and full recompute, bf16 and fp16); Llama2-70B
# interleaved 5 ways (the 70B vpp 5, which ran with one chunk) and a study measured at 8192
# merged into the 4096 YAML (which trained at 4096).
CASES = {
    **{
        name: _case(
            config,
            LLAMA3_8B if config["dp"] * config["tp"] * config["pp"] * config["cp"] == 16 else LLAMA2_7B,
            "pretrain_llama2_7b.yaml",
        )
        for name, config in MEGATRON_CONFIGS.items()
    },
    **{
        f"qwen3-{name}": _case(MEGATRON_CONFIGS[name], QWEN3_32B, "pretrain_qwen3_32b_4k.yaml")
        for name in ("tp2-pp2-vpp2-rl4", "pp4-vpp2-full-fp16")
    },
    "llama2-70b-tp8-pp4-vpp5-rl10": _case(
        cfg(tp=8, pp=4, vpp=5, sp=True, rc="full", rl=10, zero=1, world=64, gbs=128),
        LLAMA2_70B,
        "pretrain_llama2_70b.yaml",
    ),
    "tp2-pp2-seq8192": _case(cfg(tp=2, pp=2, sp=True, zero=1), LLAMA2_7B, "pretrain_llama2_7b.yaml", seq_len=8192),
    # the fp16 export put on the bf16 Qwen3 YAML without the header's edit: MindFormers refuses to load it
    "qwen3-fp16-header-not-followed": _case(
        MEGATRON_CONFIGS["tp4-cp2-selective-fp16"], QWEN3_32B, "pretrain_qwen3_32b_4k.yaml", follows_header=False
    ),
}
REFUSED = {"qwen3-fp16-header-not-followed"}


def export_context(case: dict[str, Any]) -> ExportContext:
    config = case["config"]
    world = config["dp"] * config["tp"] * config["pp"] * config["cp"]
    gbs = config["micro_batch_size"] * config["grad_accum"] * config["dp"]
    return ExportContext(
        study="s",
        trial=3,
        config=dict(config),
        metrics={"tokens_per_s_per_device": 1.0},
        source="measured",
        model=case["model"],
        workload={"seq_len": case["seq_len"], "global_batch_size": gbs},
        cluster={"nodes": world // 8, "devices_per_node": 8, "world_size": world},
        target="mindformers",
    )


def run_yaml(name: str, export: str, tmp: Path) -> str:
    """The team's run YAML: the export, with the model YAML as its base. An fp16 export over a model
    YAML whose loss scale is a number comes with the header's one instruction (replace that number
    by the export's mapping), which the team follows unless the case says not."""
    base = CASES[name]["base"]
    scale = (yaml.safe_load(export).get("runner_wrapper") or {}).get("scale_sense")
    text = base.read_text()
    if isinstance(scale, dict) and CASES[name]["follows_header"]:
        edited = re.sub(
            r"(?m)^(\s+scale_sense:)\s*[-+.0-9eE]+\s*$", lambda m: f"{m.group(1)} {json.dumps(scale)}", text
        )
        if edited != text:
            base = tmp / f"{name}.model.yaml"
            base.write_text(edited)
    return f"base_config: {json.dumps(str(base))}\n{export}"


def read_back(exports: dict[str, str], tmp: Path) -> dict[str, dict[str, Any]]:
    """MindFormers' reading of each export (name -> readback.py's result), in one subprocess."""
    cases = []
    for name, text in exports.items():
        path = tmp / f"{name}.yaml"
        path.write_text(run_yaml(name, text, tmp))
        config = CASES[name]["config"]
        cases.append(
            {"name": name, "yaml": str(path), "world": config["dp"] * config["tp"] * config["pp"] * config["cp"]}
        )
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK_SIZE", "RANK_ID")}
    proc = subprocess.run(
        [MF_PYTHON, str(READBACK), str(tmp / "cases.json")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp,
        env=env,
    )  # cwd: MindFormers writes ./output (logs, strategy)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("READBACK "):
            result = json.loads(line[len("READBACK ") :])
            out[result["name"]] = result
    assert set(out) == set(exports), (
        f"readback.py exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return out


def expected(case: dict[str, Any]) -> dict[str, Any]:
    """What MindFormers must launch: the measured config (``launched`` of the Megatron test, for this
    model's layer count) at the measured sequence length."""
    config = case["config"]
    out = launched(config)
    layers = int(case["model"]["num_hidden_layers"])
    if config["recompute"] == "full":
        out["recompute_layers_per_stage"] = min(config.get("recompute_layers") or layers, layers // config["pp"])
    out["seq_length"] = case["seq_len"]
    return out


def launched_by_mindformers(got: dict[str, Any]) -> dict[str, Any]:
    """The same fields from what MindFormers built (``readback.py``)."""
    full, selective = got["recompute_layers_per_stage"], got["selective_layers_per_stage"]
    return {
        "global_batch": got["global_batch"],
        "micro_batch": got["micro_batch"],
        "tp": got["tp"],
        "pp": got["pp"],
        "cp": got["cp"],
        "dp": got["dp"],
        "vpp": got["vpp"],
        "recompute": "full" if any(full) else "selective" if any(selective) else "none",
        # one number when every stage recomputes the same count, else the per-stage list
        "recompute_layers_per_stage": full[0] if len(set(full)) == 1 else full,
        "zero_stage": 1 if got["optimizer_shard"] else 0,
        "precision": {"BFloat16": "bf16", "Float16": "fp16", "Float32": "fp32"}.get(
            got["compute_dtype"], got["compute_dtype"]
        ),
        "seq_length": got["seq_length"],
    }


def differences(name: str, got: dict[str, Any]) -> list[str]:
    """Every way MindFormers' reading of an export differs from the measured config (empty: none)."""
    if not got.get("ok"):
        return [f"MindFormers refused it: {got.get('error')}"]
    case = CASES[name]
    config = case["config"]
    want, have = expected(case), launched_by_mindformers(got)
    problems = [f"{k}: MindFormers {have[k]!r}, measured {want[k]!r}" for k in want if have[k] != want[k]]
    pp, vpp = config["pp"], config["vpp"] if config["pp"] > 1 else 1
    checks = {
        # the batch as MindFormers runs it: every micro-step the measured micro-batch, as many as measured
        "network micro-batch": (got["network_batch_size"], config["micro_batch_size"]),
        "micro-batches per step": (got["micro_batches_per_step"], config["grad_accum"]),
        "world": (got["device_num"], config["dp"] * config["tp"] * pp * config["cp"]),
        "pipeline stages in MindSpore": (got["pipeline_stages"], pp),
        # the layers' own pipeline stages: vpp chunks of equal size on every stage
        "chunks per stage": (got["chunks_per_stage"], [vpp] * pp),
        "layers per chunk": (got["layers_per_chunk"], [[got["num_layers"] // (pp * vpp)] * pp for _ in range(vpp)]),
        "sequence parallel": (got["sequence_parallel"], bool(config["sequence_parallel"])),
        # optimizer sharding as ZeRO-1: states (and MindSpore's weight slices), not the gradients
        "gradient accumulation shard": (got["grad_accumulation_shard"], False),
        # the embedding table split over model_parallel as Megatron's vocab-parallel embedding, not
        # replicated on every tp rank (the legacy Llama splits it over context_parallel too)
        "embedding table split": (
            got["embedding_split"],
            config["tp"] * (config["cp"] if got["model_kind"] == "legacy" else 1),
        ),
        "loss scaling": (got["loss_scale"], "DynamicLossScaleUpdateCell" if config["precision"] == "fp16" else 1.0),
        "semi-auto parallel": (got["parallel_mode"], "semi_auto_parallel"),
        "full batch": (got["full_batch"], True),
        "accumulation in the wrapper": (got["wrapper_micro_batch_num"], config["grad_accum"]),
        "MindSpore mode": (got["mode"], {"graph": 0, "pynative": 1}[config.get("mode", "graph")]),
        "jit level": (got["jit_level"], config.get("jit_level", "O1")),
    }
    problems += [f"{k}: MindFormers {a!r}, measured {b!r}" for k, (a, b) in checks.items() if a != b]
    return problems


@pytest.fixture(scope="module")
def mindformers_readback(tmp_path_factory) -> dict[str, dict[str, Any]]:
    exports = {}
    for name, case in CASES.items():
        ctx = export_context(case)
        assert EXPORTERS["mindformers"].unsupported(ctx) == []
        exports[name] = EXPORTERS["mindformers"].render(ctx)
    return read_back(exports, tmp_path_factory.mktemp("mindformers"))


@pytest.mark.parametrize("name", sorted(set(CASES) - REFUSED))
def test_mindformers_launches_the_measured_config(name, mindformers_readback):
    assert differences(name, mindformers_readback[name]) == []


def test_fp16_loss_scaling_over_a_numeric_one_needs_the_headers_edit(mindformers_readback):
    """MindFormers' base_config merge cannot put a mapping over a number (``_merge_a_into_b`` copies
    the base value): the export's header says to replace it, and with that edit it launches
    (``qwen3-pp4-vpp2-full-fp16``)."""
    got = mindformers_readback["qwen3-fp16-header-not-followed"]
    assert not got["ok"] and "'float' object has no attribute 'copy'" in got["error"]
    assert "replace it by the mapping below" in EXPORTERS["mindformers"].render(
        export_context(CASES["qwen3-fp16-header-not-followed"])
    )
    assert mindformers_readback["qwen3-pp4-vpp2-full-fp16"]["loss_scale"] == "DynamicLossScaleUpdateCell"


def test_interleaving_reaches_mindspore_and_layer_setting(mindformers_readback):
    """vpp > 1: MindSpore's pipeline_interleave is on and LayerSetting splits each stage into vpp
    chunks (the issue: 13B tp2 pp2 vpp2 and 70B vpp 5 ran with one chunk)."""
    got = mindformers_readback["llama2-70b-tp8-pp4-vpp5-rl10"]
    assert got["ok"], got.get("error")
    assert got["pipeline_interleave"] is True and got["pipeline_scheduler"] == "1f1b"
    assert got["vpp"] == 5 and got["chunks_per_stage"] == [5, 5, 5, 5]
    assert got["layers_per_chunk"] == [[4, 4, 4, 4]] * 5
    assert got["recompute_layers_per_stage"] == [10, 10, 10, 10]  # spread over the chunks by LayerSetting
    no_vpp = mindformers_readback["llama3-2node-pp2"]
    assert no_vpp["pipeline_interleave"] is False and no_vpp["chunks_per_stage"] == [1, 1]


def test_the_measured_sequence_length_overrides_the_model_yaml(mindformers_readback):
    """A study measured at 8192 merged into a 4096 model YAML trains at 8192."""
    assert mindformers_readback["tp2-pp2-seq8192"]["seq_length"] == 8192
    assert mindformers_readback["tp8-mbs4"]["seq_length"] == 4096


def test_selective_recompute_is_mindformers_select_recompute(mindformers_readback):
    """``select_recompute: True``: LayerSetting's default patterns (the SiLU·mul of the feed-forward)
    on every layer, no layer recomputed whole."""
    got = mindformers_readback["tp4-cp2-selective-fp16"]
    assert got["selective_layers_per_stage"] == [32] and got["recompute_layers_per_stage"] == [0]
    assert got["select_recompute_patterns"] == [r"feed_forward\.mul", r"feed_forward\.w1\.activation\.silu"]


def test_the_model_yamls_own_stage_layout_and_data_strategy_give_way(mindformers_readback):
    """MindFormers 2.1.0's Qwen3 YAML has uneven stages for its own pp 4 (``offset: [-1, -1, 1, 1]``)
    and a ``dataset_strategy`` for its own data_parallel 1: the export's even stages and full batch
    win, at any pp and dp."""
    for name in ("qwen3-tp2-pp2-vpp2-rl4", "qwen3-pp4-vpp2-full-fp16"):
        got = mindformers_readback[name]
        assert got["ok"], got.get("error")
        assert got["model_kind"] == "mcore"
        assert got["full_batch"] is True and got["dp"] == CASES[name]["config"]["dp"] > 1
        assert {n for row in got["layers_per_chunk"] for n in row} == {64 // (got["pp"] * got["vpp"])}
