"""The parameter table (``autotune.workers.parameters``, issue 43): every reader of a serving default
or of the rule ``max_num_batched_tokens >= max_num_seqs`` agrees with it (the space, the simulator,
the vLLM and MindIE stacks, both exports); every reader of a training default or of the training
rules does too (the space, the simulator, the stacks' rules, the Megatron, DeepSpeed, torchtitan and
MindFormers exports, the torch and MindSpore probes' plans). And no module restates a default."""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest
import yaml
from support import REPO

from autotune.export import ExportContext
from autotune.export._base import script_arrays
from autotune.export._deepspeed import DeepSpeedExporter
from autotune.export._megatron import MegatronExporter
from autotune.export._mindformers import MindFormersExporter
from autotune.export._mindie import mindie_settings
from autotune.export._torchtitan import TorchtitanExporter
from autotune.export._vllm import vllm_engine_args
from autotune.space import INFER_DEFAULTS, SERVE_DEFAULTS, TRAIN_DEFAULTS
from autotune.spec_space import SpaceSpec
from autotune.stacks import unsupported_reasons
from autotune.workers.parameters import (
    BATCHED_COVERS_SEQS,
    SERVING,
    STACKS,
    TRAINING,
    batched_below_seqs,
    data_parallel,
    default,
    effective_vpp,
    grad_accum,
    sequence_parallel_on,
    serving_default,
    spellings,
    value,
)
from autotune.workers.protocol import TrialRequest
from autotune.workers.simulate._checks import prepare
from autotune.workers.simulate._columns import (
    COMPILE_CODES,
    DEFAULTS as SIMULATOR_DEFAULTS,
    PRECISION_CODES,
    RECOMPUTE_CODES,
    columns_from_params,
)
from autotune.workers.torch_probe.plan import COMPILE_MODES, PRECISIONS, RECOMPUTE_MODES, resolve_plan


def test_the_space_and_the_simulator_take_their_serving_defaults_from_the_table():
    for name, parameter in SERVING.items():
        assert SERVE_DEFAULTS[name] == parameter.default, name
        assert SIMULATOR_DEFAULTS[name] == parameter.default, name


def test_the_vllm_launch_says_the_tables_defaults_under_vllms_flags():
    args = vllm_engine_args({}, "cuda")
    for name, parameter in SERVING.items():
        default = parameter.default
        if isinstance(default, bool):
            assert (parameter.vllm_flag if default else parameter.vllm_flag.replace("--", "--no-", 1)) in args, name
        else:
            assert args[args.index(parameter.vllm_flag) + 1] == f"{default:g}", name


def test_mindies_config_says_the_tables_defaults_under_its_keys():
    settings = mindie_settings({})
    schedule = settings["BackendConfig"]["ScheduleConfig"]
    for name, parameter in SERVING.items():
        for key in parameter.mindie_keys:
            assert schedule[key] == parameter.default, (name, key)
    assert schedule["templateType"] == ("Mix" if serving_default("enable_chunked_prefill") else "Standard")


def test_every_reader_of_the_rule_draws_the_same_line():
    """At the line (batched == seqs) every reader accepts; one token below it, every reader refuses."""
    for seqs in (8, 256):
        assert not batched_below_seqs(seqs, seqs) and batched_below_seqs(seqs - 1, seqs)
        ok = {"max_num_seqs": seqs, "max_num_batched_tokens": max(seqs, 4096), "enable_chunked_prefill": True}
        below = dict(ok, max_num_batched_tokens=seqs - 1)
        facts = {"accelerator": "cuda", "model": {"max_position_embeddings": 4096}, "workload": {"kind": "serve"}}
        assert not any("max_num_seqs" in r for r in unsupported_reasons("vllm", ok, facts))
        assert any(BATCHED_COVERS_SEQS in r for r in unsupported_reasons("vllm", below, facts))


def _literal(value) -> str:
    """A default as code writes it: a string in either quotes, anything else as repr."""
    if isinstance(value, str):
        return rf"[\"']{re.escape(value)}[\"']"
    return re.escape(repr(value)) + r"(?![\w.])"


def _restatements(table: dict, defaults_of) -> list[str]:
    """Every ``"name", <default>`` / ``"name": <default>`` in autotune/ and workers/ but the table."""
    here = REPO / "workers" / "parameters.py"
    found = []
    for root in ("autotune", "workers"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path == here:
                continue
            text = path.read_text()
            for name, parameter in table.items():
                for literal in defaults_of(parameter):
                    for hit in re.finditer(rf"[\"']{name}[\"']\s*[:,]\s*{_literal(literal)}", text):
                        found.append(f"{path.relative_to(REPO)}:{text.count(chr(10), 0, hit.start()) + 1}: {name}")
    return found


def test_no_module_restates_a_serving_default():
    """A default written as a literal beside its name (``"max_num_seqs", 256`` or ``"max_num_seqs": 256``)
    anywhere but the table: the six files that each had a copy read the table now."""
    found = _restatements(SERVING, lambda p: [p.default])
    assert not found, found


def test_no_module_restates_a_training_default():
    """A training default (every accelerator's) written as a literal beside its name (``config.get("zero_stage",
    0)``, ``"precision": "bf16"``, ``_choice(params, "precision", "fp32", ...)``) anywhere but the table: the
    space, the simulator, the stacks, the exports and both probes read the table now."""
    found = _restatements(TRAINING, lambda p: [p.default, *(v for _, v in p.by_accelerator)])
    assert not found, found


def test_the_restatement_check_finds_a_restatement(tmp_path, monkeypatch):
    """The check above can fail: a module with ``config.get("zero_stage", 0)`` or ``"precision": "fp32"``."""
    import support

    fake = tmp_path / "repo"
    (fake / "workers").mkdir(parents=True)
    (fake / "autotune").mkdir()
    (fake / "workers" / "parameters.py").write_text('TRAINING = {"zero_stage": 0}\n')
    (fake / "autotune" / "a.py").write_text('x = config.get("zero_stage", 0)\ny = {"precision": "fp32"}\n')
    monkeypatch.setattr(support, "REPO", fake)
    monkeypatch.setitem(globals(), "REPO", fake)
    found = _restatements(TRAINING, lambda p: [p.default, *(v for _, v in p.by_accelerator)])
    assert found == ["autotune/a.py:1: zero_stage", "autotune/a.py:2: precision"]


# ---------------------------------------------------------------------------------------- training
def test_the_table_holds_every_canonical_training_parameter_the_spec_searches():
    fields = SpaceSpec.model_fields
    for name, parameter in TRAINING.items():
        assert parameter.type in (int, bool, str), name
        if not parameter.derived:
            assert name in fields, name
        if parameter.allowed:
            assert parameter.default in parameter.allowed, name
            for _, there in parameter.by_accelerator:
                assert there in parameter.allowed, name
    # the spec's allowed values are the table's
    for name in ("recompute", "zero_stage", "precision", "compile", "mode", "jit_level"):
        (listed, _none) = fields[name].annotation.__args__
        assert tuple(listed.__args__[0].__args__) == TRAINING[name].allowed, name


def test_precision_has_a_default_per_accelerator():
    """bf16: the study's (every accelerator) and a probe's on npu/cuda; fp32: a probe's on a CPU (MindSpore's
    CPU backend has no bf16 kernels)."""
    assert default("precision") == "bf16"
    assert default("precision", "npu") == default("precision", "cuda") == "bf16"
    assert default("precision", "cpu") == "fp32"
    assert value({}, "precision", "cpu") == "fp32" and value({"precision": "fp16"}, "precision", "cpu") == "fp16"


def test_value_reads_the_type_or_the_default():
    assert value({}, "tp") == 1 and value({"tp": "None"}, "tp") == 1 and value({"tp": ""}, "tp") == 1
    assert value({"tp": 0}, "tp") == 1 and value({"zero_stage": 0}, "zero_stage") == 0
    assert value({"tp": "4"}, "tp") == 4 and value({"recompute_layers": None}, "recompute_layers") is None
    assert value({"sequence_parallel": "false"}, "sequence_parallel") is False
    assert value({"sequence_parallel": "1"}, "sequence_parallel") is True
    assert value({"max_num_seqs": None}, "max_num_seqs") == serving_default("max_num_seqs")
    with pytest.raises(ValueError):
        value({"tp": "two"}, "tp")


def test_the_space_and_the_simulator_take_their_training_defaults_from_the_table():
    for name, v in TRAIN_DEFAULTS.items():
        assert v == default(name), name
    for name in ("tp", "precision"):
        assert INFER_DEFAULTS[name] == default(name) and SERVE_DEFAULTS[name] == default(name), name
    codes = {"recompute": RECOMPUTE_CODES, "precision": PRECISION_CODES, "compile": COMPILE_CODES}
    for name in ("tp", "pp", "cp", "vpp", "micro_batch_size", "sequence_parallel", "zero_stage", *codes):
        want = codes[name][default(name)] if name in codes else default(name)
        assert SIMULATOR_DEFAULTS[name] == want, name
    # a config naming none of them is priced as one naming every default
    every = {name: p.default for name, p in TRAINING.items() if not p.derived and p.default is not None}
    bare, explicit = columns_from_params([{}]), columns_from_params([every])
    for name in bare:
        assert np.array_equal(bare[name], explicit[name]), name


def _context(config, world=1):
    return ExportContext(
        study="table",
        trial=0,
        config=config,
        metrics={},
        source="simulated",
        model={"name": "tiny", "num_hidden_layers": 8, "hidden_size": 256, "num_attention_heads": 4},
        workload={"kind": "train", "seq_len": 128, "global_batch_size": world},
        cluster={"accelerator": "npu", "nodes": 1, "devices_per_node": world, "world_size": world},
    )


def _at(body, path):
    for key in path.split("."):
        body = body[key]
    return body


def test_the_megatron_launch_says_the_tables_defaults_under_its_flags():
    args = script_arrays(MegatronExporter().render(_context({})))["AUTOTUNE_ARGS"]
    flags = spellings("megatron")
    for name in ("tp", "pp"):
        assert args[args.index(flags[name]) + 1] == str(default(name)), name
    assert f"--{default('precision')}" in args and f"--{default('precision')}" in flags["precision"]
    # the rest are Megatron's own defaults when absent: cp 1, no interleaving, no SP, no recompute, no ZeRO
    for name in ("cp", "vpp", "sequence_parallel", "recompute", "recompute_layers", "zero_stage"):
        assert flags[name] not in args, name
    assert (default("cp"), default("vpp"), default("sequence_parallel")) == (1, 1, False)
    assert (default("recompute"), default("zero_stage")) == ("none", 0)
    # and every flag the table names is the one written when the parameter is set
    config = {"tp": 2, "pp": 2, "vpp": 2, "cp": 2, "micro_batch_size": 2, "sequence_parallel": True}
    config.update(recompute="full", recompute_layers=2, zero_stage=1, precision="fp16")
    args = script_arrays(MegatronExporter().render(_context(config, world=16)))["AUTOTUNE_ARGS"]
    for name, flag in flags.items():
        assert any(f in args for f in (flag if isinstance(flag, tuple) else (flag,))), name


def test_the_deepspeed_config_says_the_tables_defaults_under_its_keys():
    ds = json.loads(DeepSpeedExporter().render(_context({})))
    keys = spellings("deepspeed")
    mbs, ga = default("micro_batch_size"), default("grad_accum")
    assert _at(ds, keys["micro_batch_size"]) == mbs and _at(ds, keys["grad_accum"]) == ga
    assert _at(ds, keys["dp"]) == mbs * ga * default("dp")
    assert _at(ds, keys["zero_stage"]) == default("zero_stage")
    assert ds[default("precision")] == {"enabled": True}
    assert keys["recompute"] not in ds and default("recompute") != "full"
    full = json.loads(DeepSpeedExporter().render(_context({"recompute": "full"})))
    assert keys["recompute"] in full


def test_the_torchtitan_launch_says_the_tables_defaults_under_its_flags():
    args = script_arrays(TorchtitanExporter().render(_context({})))["AUTOTUNE_ARGS"]
    flags = spellings("torchtitan")
    for name in ("tp", "pp", "cp", "micro_batch_size"):
        assert args[args.index(flags[name]) + 1] == str(default(name)), name
    assert args[args.index(flags["precision"]) + 1] == {"bf16": "bfloat16", "fp32": "float32"}[default("precision")]
    assert flags["sequence_parallel"][default("sequence_parallel") is False] in args
    assert flags["compile"][default("compile") == "none"] in args
    assert args[args.index(flags["zero_stage"]) + 1] == "never" and default("zero_stage") < 3
    script = TorchtitanExporter().render(_context({}))
    assert f"AUTOTUNE_AC={flags['recompute']}{default('recompute')}" in script


def test_the_mindformers_yaml_says_the_tables_defaults_under_its_keys():
    body = yaml.safe_load(MindFormersExporter().render(_context({})))
    keys = spellings("mindformers")
    for name in ("tp", "pp", "cp", "dp", "micro_batch_size", "sequence_parallel"):
        assert _at(body, keys[name]) == default(name), name
    assert _at(body, keys["vpp"]) == default("vpp")
    assert _at(body, keys["zero_stage"]) == (default("zero_stage") >= 1)
    assert _at(body, keys["precision"]) == {"bf16": "bfloat16", "fp32": "float32"}[default("precision")]
    assert _at(body, keys["mode"]) == {"graph": 0, "pynative": 1}[default("mode")]
    assert _at(body, keys["jit_level"]) == default("jit_level")
    recompute = _at(body, keys["recompute"])
    assert default("recompute") == "none" and recompute["recompute"] is False and recompute["select_recompute"] is False
    assert _at(body, keys["grad_accum"][1]) == default("grad_accum")


def _torch_request(accelerator="cpu", params=None, world=2):
    return TrialRequest(
        params=params or {},
        model=dict(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=512,
            vocab_size=1024,
        ),
        workload=dict(kind="train", seq_len=64, global_batch_size=8),
        cluster=dict(accelerator=accelerator, nodes=1, devices_per_node=world, world_size=world),
    )


def _mindspore_probe():
    spec = importlib.util.spec_from_file_location("table_mindspore_probe", REPO / "workers/mindspore_probe/probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_probes_plans_read_the_tables_defaults_on_their_accelerator():
    for accelerator in ("cpu", "cuda", "npu"):
        plan = resolve_plan(_torch_request(accelerator), 2)
        for name in ("tp", "pp", "cp", "vpp", "sequence_parallel", "recompute", "recompute_layers", "zero_stage"):
            assert getattr(plan, name) == default(name), name
        assert plan.precision == default("precision", accelerator), accelerator
        assert plan.compile == default("compile")
    assert resolve_plan(_torch_request("cpu"), 2).precision == "fp32"
    assert RECOMPUTE_MODES == TRAINING["recompute"].allowed and PRECISIONS == TRAINING["precision"].allowed
    assert set(COMPILE_MODES) <= set(TRAINING["compile"].allowed)
    probe = _mindspore_probe()
    for accelerator in ("cpu", "npu"):
        trial = {"params": {}, "workload": {"global_batch_size": 2}, "cluster": {"accelerator": accelerator}}
        plan = probe.resolve_plan(trial, 1)
        for name in ("micro_batch_size", "recompute", "zero_stage", "mode", "graph_kernel_flags"):
            assert plan[name] == default(name), name
        assert plan["precision"] == default("precision", accelerator), accelerator


def test_every_reader_of_the_training_rules_derives_the_same():
    """dp, grad_accum, sequence parallel at tp 1, vpp at pp 1: the simulator, the torch probe's plan and
    the exports derive them by the table's rules."""
    world, gbs = 8, 32
    assert data_parallel(world, 2, 2, 1) == 2 and grad_accum(gbs, 2, 2) == 8
    assert not sequence_parallel_on(True, 1) and sequence_parallel_on(True, 2)
    assert effective_vpp(4, 1) == 1 and effective_vpp(4, 2) == 4
    assert list(effective_vpp(np.array([4, 4]), np.array([1, 2]))) == [1, 4]
    model = {"hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4}
    model.update(intermediate_size=512, vocab_size=1024)
    workload = {"kind": "train", "seq_len": 128, "global_batch_size": gbs}
    cols = columns_from_params([{"tp": 2, "pp": 2, "micro_batch_size": 2, "sequence_parallel": True}, {"tp": 1}])
    _, c, _, _ = prepare(model, workload, {"world_size": world}, cols)
    assert list(c["dp"]) == [data_parallel(world, 2, 2, 1), data_parallel(world, 1, 1, 1)]
    assert list(c["grad_accum"]) == [grad_accum(gbs, 2, 2), grad_accum(gbs, 1, 8)]
    assert list(c["sp"]) == [True, False]
    plan = resolve_plan(_torch_request(params={"tp": 2, "sequence_parallel": True, "micro_batch_size": 2}, world=4), 4)
    assert plan.dp == data_parallel(4, 2, 1, 1) and plan.grad_accum == grad_accum(8, 2, plan.dp)
    assert not resolve_plan(_torch_request(params={"sequence_parallel": True}, world=2), 2).sequence_parallel
    # one stage: no interleaving and no sequence parallel at tp 1, in every launch
    config = {"vpp": 2, "sequence_parallel": True}
    args = script_arrays(MegatronExporter().render(_context(config)))["AUTOTUNE_ARGS"]
    assert "--num-layers-per-virtual-pipeline-stage" not in args and "--sequence-parallel" not in args
    args = script_arrays(TorchtitanExporter().render(_context(config)))["AUTOTUNE_ARGS"]
    assert (
        "--parallelism.no-enable-sequence-parallel" in args and "--parallelism.pipeline_parallel_schedule" not in args
    )
    body = yaml.safe_load(MindFormersExporter().render(_context(config)))
    assert _at(body, spellings("mindformers")["vpp"]) == effective_vpp(2, 1)


def test_every_stack_spelling_is_one_the_table_names():
    assert set(STACKS) == {"megatron", "deepspeed", "torchtitan", "mindformers"}
    for stack in STACKS:
        assert spellings(stack), stack


def test_every_reader_of_a_configs_devices_counts_them_by_the_table():
    """The dispatcher's reservation (``parameters.trial_devices``: trial_run, backends), the serving
    probe's per-device figures and the metrics' instance size all follow DEVICES_RULE: a config that
    names no tp/pp/cp counts them as 1, and serving multiplies the replicas."""
    from autotune.workers.parameters import instance_devices, trial_devices

    assert trial_devices("train", {"tp": 2, "pp": 2, "dp": 2}) == 8
    assert trial_devices("train", {"tp": 2, "pp": 2, "cp": 2, "dp": 2}) == 16
    assert trial_devices("serve", {"replicas": 3, "tp": 2}) == 6
    assert trial_devices("serve", {"tp": 2, "pp": 2}) == 4
    assert trial_devices("infer", {"tp": 4, "pp": 2}) == 4
    assert instance_devices({"tp": "None", "pp": 2}) == 2
