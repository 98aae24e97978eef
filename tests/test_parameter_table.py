"""The parameter table (``autotune.workers.parameters``, issue 43): every reader of a serving default
or of the rule ``max_num_batched_tokens >= max_num_seqs`` agrees with it (the space, the simulator,
the vLLM and MindIE stacks, both exports); every reader of a training default or of the training
rules does too (the space, the simulator, the stacks' rules, the Megatron, DeepSpeed, torchtitan and
MindFormers exports, the torch and MindSpore probes' plans). And no module restates a default.

The serving rows are checked the way each engine renders them: a number or a ``--[no-]flag`` for
the numeric and boolean rows, the value after the flag (``--kv-cache-dtype auto``), no flag at all
for the default where vLLM's own default is "not given" (``quantization`` none), a boolean flag a
value maps to (``graph_mode`` graph: ``--no-enforce-eager``), and nothing for ``replicas`` (one
server per replica, no engine flag)."""

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
from autotune.export._mindie_export import MindIEExporter
from autotune.export._torchtitan import TorchtitanExporter
from autotune.export._vllm import replica_devices, vllm_engine_args
from autotune.spec.space import DISAGGREGATION_PARAMS, INFER_DEFAULTS, SERVE_DEFAULTS, TRAIN_DEFAULTS
from autotune.spec.space_section import SpaceSpec
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
    _CODES as SIMULATOR_CODES,
    COMPILE_CODES,
    DEFAULTS as SIMULATOR_DEFAULTS,
    GRAPH_MODE_CODES,
    KV_DTYPE_CODES,
    PRECISION_CODES,
    QUANT_CODES,
    RECOMPUTE_CODES,
    columns_from_params,
    fill_defaults,
)
from autotune.workers.torch_probe.plan import COMPILE_MODES, PRECISIONS, RECOMPUTE_MODES, resolve_plan


# the simulator's codes of the serving rows with string values (a new one: the simulator codes it too)
SERVING_CODES = {name: SIMULATOR_CODES[name] for name, p in SERVING.items() if p.type is str}


def test_the_space_and_the_simulator_take_their_serving_defaults_from_the_table():
    # disaggregation's rows: a config names them only where the spec does, the rules read the table's
    assert set(SERVING) - set(SERVE_DEFAULTS) == set(DISAGGREGATION_PARAMS)
    for name, parameter in SERVING.items():
        assert SERVE_DEFAULTS.get(name, parameter.default) == parameter.default, name
        # a default that differs per device is 0 in the simulator's columns, "the engine's own",
        # resolved where the accelerator is known (test_block_size_...); a string one is its code
        if parameter.type is str:
            want = SERVING_CODES[name][parameter.default]
        else:
            want = 0 if parameter.by_accelerator else parameter.default
        assert SIMULATOR_DEFAULTS[name] == want, name
    # the simulator knows the values the table allows, no more and no fewer
    assert (SERVING_CODES["graph_mode"], SERVING_CODES["kv_cache_dtype"]) == (GRAPH_MODE_CODES, KV_DTYPE_CODES)
    assert SERVING_CODES["quantization"] == QUANT_CODES
    for name, codes in SERVING_CODES.items():
        assert set(codes) == set(SERVING[name].allowed), name
    # a config naming none of them is priced as one naming every default (not the per-device ones:
    # test_block_size_...), and a string column holding None as one holding the default
    every = {name: p.default for name, p in SERVING.items() if not p.by_accelerator}
    bare, explicit = columns_from_params([{}]), columns_from_params([every])
    for name in bare:
        assert np.array_equal(bare[name], explicit[name]), name
    given, _ = fill_defaults({name: np.array([None], dtype=object) for name in SERVING_CODES})
    for name, codes in SERVING_CODES.items():
        assert given[name][0] == codes[SERVING[name].default], name


def _vllm_writes_the_default(name: str, parameter, accelerator: str) -> str:
    """How ``vllm serve`` is told a string row's default: ``value`` (the flag, then the default),
    ``absent`` (no flag: vLLM's own default is the flag not given) or ``boolean`` (the default maps
    to ``--no-FLAG``); in the last two, another allowed value writes the flag (the spelling is real)."""
    default = serving_default(name, accelerator)
    args = vllm_engine_args({}, accelerator)
    assert args == vllm_engine_args({name: default}, accelerator), name  # a bare config launches the default
    others = [vllm_engine_args({name: v}, accelerator) for v in parameter.allowed if v != default]
    flag = parameter.vllm_flag
    if flag in args:
        assert args[args.index(flag) + 1] == default, name
        return "value"
    negated = flag.replace("--", "--no-", 1)
    if negated in args:
        assert any(flag in other for other in others), name
        return "boolean"
    assert any(flag in other for other in others), name
    return "absent"


@pytest.mark.parametrize("accelerator", ["cuda", "npu", "cpu"])
def test_the_vllm_launch_says_the_tables_defaults_under_vllms_flags(accelerator):
    args = vllm_engine_args({}, accelerator)
    forms = {}
    for name, parameter in SERVING.items():
        default = serving_default(name, accelerator)
        if parameter.vllm_flag is None:  # no engine flag (replicas: one server each): none is written
            assert not any(name.replace("_", "-") in a or name in a for a in args), name
        elif parameter.type is str:
            forms[name] = _vllm_writes_the_default(name, parameter, accelerator)
        elif isinstance(default, bool):
            assert (parameter.vllm_flag if default else parameter.vllm_flag.replace("--", "--no-", 1)) in args, name
        else:
            assert args[args.index(parameter.vllm_flag) + 1] == f"{default:g}", name
    # what vLLM does with each: its cache_dtype "auto" is passed, its quantization None is no flag,
    # its enforce_eager False is --no-enforce-eager (a new row needs no entry here)
    pinned = {"graph_mode": "boolean", "kv_cache_dtype": "value", "quantization": "absent"}
    assert {name: forms[name] for name in pinned} == pinned


def test_mindies_environment_says_the_tables_memory_share():
    """MindIE reads the memory share from NPU_MEMORY_FRACTION: a config without one launches the
    study's default (it once wrote MindIE's own 0.8 while the simulator priced 0.9)."""
    from autotune.export._mindie import mindie_env

    assert mindie_env({})["NPU_MEMORY_FRACTION"] == f"{serving_default('memory_utilization'):g}"
    assert mindie_env({"memory_utilization": 0.85})["NPU_MEMORY_FRACTION"] == "0.85"


def test_mindies_config_says_the_tables_defaults_under_its_keys():
    settings = mindie_settings({})
    schedule = settings["BackendConfig"]["ScheduleConfig"]
    for name, parameter in SERVING.items():
        for key in parameter.mindie_keys:
            assert schedule[key] == serving_default(name, "npu"), (name, key)
        if not parameter.mindie_keys:  # no key (replicas, graph_mode, the weights' quantization): nothing set
            assert mindie_settings({name: serving_default(name, "npu")}) == settings, name
    assert schedule["templateType"] == ("Mix" if serving_default("enable_chunked_prefill") else "Standard")
    # the default weights and KV cache need no msModelSlim weights; a quantized scheme does
    bare = json.loads(MindIEExporter().render(_serve_context({})))["_autotune"]
    assert "weights" not in bare and len(bare["replicas"]) == default("replicas")
    quantized = json.loads(MindIEExporter().render(_serve_context({"quantization": "w8a8"})))["_autotune"]
    assert "msModelSlim" in quantized["weights"]


def _serve_context(config, accelerator="npu"):
    return ExportContext(
        study="table",
        trial=0,
        config=config,
        metrics={},
        source="simulated",
        model={"name": "tiny", "num_hidden_layers": 8, "hidden_size": 256, "num_attention_heads": 4},
        workload={"kind": "serve", "max_model_len": 1024},
        cluster={"accelerator": accelerator, "nodes": 1, "devices_per_node": 8, "world_size": 8},
    )


@pytest.mark.parametrize("accelerator", ["cuda", "npu", "cpu"])
def test_the_stacks_rules_judge_a_bare_config_as_one_naming_every_serving_default(accelerator):
    facts = {"accelerator": accelerator, "model": {"max_position_embeddings": 4096}, "workload": {"kind": "serve"}}
    every = {name: serving_default(name, accelerator) for name in SERVING}
    for stack in ("vllm", "mindie"):
        assert unsupported_reasons(stack, {}, facts) == unsupported_reasons(stack, every, facts), stack


def test_every_reader_of_replicas_counts_the_tables_default():
    """``replicas`` has no engine flag: each replica is a server the export and the preset start."""
    from autotune.dispatch.stack_presets import _serving_launch
    from autotune.workers.parameters import trial_devices

    n = default("replicas")
    assert SERVING["replicas"].vllm_flag is None and not SERVING["replicas"].mindie_keys
    assert len(replica_devices({})) == n and trial_devices("serve", {}) == n
    assert len(replica_devices({"replicas": None})) == n and trial_devices("serve", {"replicas": "None"}) == n
    from types import SimpleNamespace

    from autotune.stacks import get

    request = TrialRequest(
        params={},
        model={"name": "tiny", "num_hidden_layers": 2, "path": "/models/tiny"},
        workload={"kind": "serve", "max_model_len": 1024},
        cluster={"accelerator": "npu", "nodes": 1, "devices_per_node": 8, "world_size": 8},
    )
    backend = SimpleNamespace(entry=None, args=[])
    for stack in ("vllm", "mindie"):
        launch = _serving_launch(get(stack), backend, request, "python")
        assert len(json.loads(launch["files"]["engine.json"])["replicas"]) == n, stack


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
    found = _restatements(SERVING, lambda p: [p.default, *(v for _, v in p.by_accelerator)])
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


def test_the_restatement_check_finds_a_restated_serving_default(tmp_path, monkeypatch):
    """And for the serving rows: the forms the readers had (``col(c, "quantization", "none", n)``,
    ``config.get("replicas", 1)``, ``"kv_cache_dtype": "auto"``, ``'graph_mode': 'graph'``), not
    ``"replicas": 10``."""
    import support

    fake = tmp_path / "repo"
    (fake / "workers").mkdir(parents=True)
    (fake / "autotune").mkdir()
    (fake / "workers" / "parameters.py").write_text('SERVING = {"replicas": 1}\n')
    (fake / "workers" / "b.py").write_text(
        'q = col(c, "quantization", "none", n)\nr = int(config.get("replicas", 1) or 1)\n'
        'd = {"kv_cache_dtype": "auto",\n     \'graph_mode\': \'graph\', "replicas": 10}\n'
    )
    monkeypatch.setattr(support, "REPO", fake)
    monkeypatch.setitem(globals(), "REPO", fake)
    found = _restatements(SERVING, lambda p: [p.default, *(v for _, v in p.by_accelerator)])
    assert sorted(found) == [
        "workers/b.py:1: quantization",
        "workers/b.py:2: replicas",
        "workers/b.py:3: kv_cache_dtype",
        "workers/b.py:4: graph_mode",
    ]


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
    for name, parameter in SERVING.items():  # a serving parameter with finitely many values: the same
        assert name in fields, name
        if parameter.allowed:
            (listed, _none) = fields[name].annotation.__args__
            assert tuple(listed.__args__[0].__args__) == parameter.allowed, name
            assert {parameter.default, *(v for _, v in parameter.by_accelerator)} <= set(parameter.allowed), name


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
    for name in ("cp", "vpp", "first_stage_layers", "sequence_parallel", "recompute", "recompute_layers", "zero_stage"):
        assert not set(flags[name] if isinstance(flags[name], tuple) else (flags[name],)) & set(args), name
    assert (default("cp"), default("vpp"), default("sequence_parallel")) == (1, 1, False)
    assert (default("recompute"), default("zero_stage")) == ("none", 0)
    # and every flag the table names is the one written when the parameter is set
    config = {"tp": 2, "pp": 2, "vpp": 2, "cp": 2, "micro_batch_size": 2, "sequence_parallel": True}
    config.update(recompute="full", recompute_layers=2, zero_stage=1, precision="fp16")
    args = script_arrays(MegatronExporter().render(_context(config, world=16)))["AUTOTUNE_ARGS"]
    # a first stage of its own size needs vpp 1: written from a config of its own
    args += script_arrays(MegatronExporter().render(_context({"pp": 2, "first_stage_layers": 1})))["AUTOTUNE_ARGS"]
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
        names = ("tp", "pp", "cp", "vpp", "first_stage_layers", "sequence_parallel", "recompute", "recompute_layers")
        for name in (*names, "zero_stage"):
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


@pytest.mark.parametrize("accelerator", ["cuda", "npu", "cpu"])
def test_block_size_has_a_default_per_accelerator_and_every_reader_takes_it(accelerator):
    """Adding a parameter to the table (docs/ARCHITECTURE.md, "Adding a parameter"), shown on
    ``block_size``: one row, a default per device (vLLM's 16; its CPU platform's and Ascend's 128).
    The space's defaults, the vLLM launch, the stacks' rules and the simulator read it; before the
    row, the vLLM export and the simulator gave a CPU config without one 16 while the space gave 128."""
    from types import SimpleNamespace

    from autotune.spec.space import workload_defaults
    from autotune.workers.simulate import simulate_trial
    from autotune.workers.protocol import TrialRequest

    want = serving_default("block_size", accelerator)
    assert want == (16 if accelerator == "cuda" else 128)
    spec = SimpleNamespace(workload=SimpleNamespace(kind="serve"), cluster=SimpleNamespace(accelerator=accelerator))
    assert workload_defaults(spec)["block_size"] == want
    args = vllm_engine_args({}, accelerator)
    assert args[args.index("--block-size") + 1] == str(want)
    # the stacks' rules judge a config that names no block as one naming the device's default
    facts = {"accelerator": accelerator, "model": {"max_position_embeddings": 4096}, "workload": {"kind": "serve"}}
    bare = {"max_num_seqs": 8, "max_num_batched_tokens": 4096, "enable_chunked_prefill": True}
    for stack in ("vllm", "mindie") if accelerator == "npu" else ("vllm",):
        assert unsupported_reasons(stack, bare, facts) == unsupported_reasons(
            stack, dict(bare, block_size=want), facts
        ), stack
    # the simulator prices a config without a block as one with the device's default
    from autotune.workers.hardware import load_profile

    profile = {"cuda": "a100-sxm-80gb", "npu": "ascend-910b", "cpu": "cpu"}[accelerator]
    cluster = {"accelerator": accelerator, "nodes": 1, "devices_per_node": 1, "world_size": 1}
    cluster["hardware"] = load_profile(profile)
    workload = {
        "kind": "serve",
        "traffic": {"rates": [1.0], "arrival": "poisson", "burstiness": 1.0, "prompt_len": 128, "output_len": 32},
        "slo": {"ttft_p99_ms": 2000.0, "tpot_p99_ms": 100.0},
        "batch_sweep": [1],
        "max_model_len": 1024,
    }
    model = {"arch": "llama", "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8}
    model.update(num_key_value_heads=8, intermediate_size=1376, vocab_size=32000, max_position_embeddings=2048)
    priced = [
        simulate_trial(TrialRequest(params=dict(bare, tp=1, **extra), model=model, workload=workload, cluster=cluster))
        for extra in ({}, {"block_size": want})
    ]
    assert priced[0].status == priced[1].status
    assert priced[0].metrics == priced[1].metrics
