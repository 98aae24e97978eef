"""The spec: presets, HF config files, defaults, and errors that name file, line and field."""

import json
from pathlib import Path

import pytest

from autotune.cli.output import spec_summary
from autotune.spec.errors import SpecError
from autotune.spec.load import load_spec
from autotune.spec.resolve import objectives_of
from support import REPO, TINY_TRAIN


def test_tiny_spec_loads_with_defaults(write_spec):
    spec = load_spec(write_spec(TINY_TRAIN))
    assert spec.model.name == "tiny-llama" and spec.model.num_key_value_heads == 4
    assert spec.cluster.world_size == 2 and spec.cluster.profile_name == "cpu"
    assert spec.backend.kind == "simulate"
    assert objectives_of(spec) == (("tokens_per_s_per_device", "maximize"),)
    assert spec.space.choices()["zero_stage"] == [0, 1, 3]


@pytest.mark.parametrize("path", sorted((REPO / "search_spaces").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_specs_validate(path):
    spec = load_spec(path)
    assert spec_summary(spec)


def test_hf_config_json_relative_to_spec(write_spec, tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 512,
                "num_hidden_layers": 6,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "intermediate_size": 1376,
                "vocab_size": 4096,
                "max_position_embeddings": 2048,
                "rope_theta": 10000.0,
            }
        )
    )
    spec = load_spec(write_spec(TINY_TRAIN.replace("model: tiny-llama", "model: config.json")))
    assert spec.model.hidden_size == 512 and spec.model.num_key_value_heads == 2 and spec.model.arch == "llama"


def test_explicit_fields_and_preset_with_changes(write_spec):
    spec = load_spec(
        write_spec(TINY_TRAIN.replace("model: tiny-llama", "model: {preset: llama2-7b, num_hidden_layers: 8}"))
    )
    assert spec.model.num_hidden_layers == 8 and spec.model.hidden_size == 4096


def _errors(path) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return str(info.value)


def test_unknown_key_is_an_error_with_line(write_spec):
    path = write_spec(TINY_TRAIN.replace("  recompute: [none, full]", "  recompute: [none, full]\n  tensor_par: [2]"))
    msg = _errors(path)
    assert f"{path}:12: space.tensor_par: unknown field 'tensor_par'" in msg


def test_bad_enum_value_names_item_and_expected(write_spec):
    path = write_spec(TINY_TRAIN.replace("recompute: [none, full]", "recompute: [none, ful]"))
    msg = _errors(path)
    assert f"{path}:11: space.recompute[1]:" in msg
    assert "'none', 'selective' or 'full'" in msg and "'ful'" in msg


def test_missing_required_field(write_spec):
    path = write_spec(TINY_TRAIN.replace("seq_len: 128, ", ""))
    assert "workload.seq_len: required field is missing" in _errors(path)


def test_unknown_preset_lists_presets(write_spec):
    msg = _errors(write_spec(TINY_TRAIN.replace("model: tiny-llama", "model: llama9-1t")))
    assert "model: unknown model preset 'llama9-1t'" in msg and "llama2-7b" in msg


def test_yaml_syntax_error_has_line(write_spec):
    path = write_spec(TINY_TRAIN + "space: [unclosed\n")
    msg = _errors(path)
    assert f"{path}:" in msg and "invalid YAML" in msg


def test_constraint_with_unknown_name(write_spec):
    path = write_spec(TINY_TRAIN + "constraints: ['hedas % tp == 0']\n")
    msg = _errors(path)
    assert "constraints[0]" in msg and "hedas" in msg


def test_constraint_with_unsafe_code(write_spec):
    path = write_spec(TINY_TRAIN + "constraints: [\"__import__('os').getcwd() == tp\"]\n")
    assert "constraints[0]" in _errors(path)


def test_unknown_metric_and_wrong_workload_metric(write_spec):
    msg = _errors(
        write_spec(TINY_TRAIN.replace("objectives: [tokens_per_s_per_device]", "objectives: [tokens_per_sec]"))
    )
    assert "objectives[0].metric: unknown metric 'tokens_per_sec'" in msg
    msg = _errors(write_spec(TINY_TRAIN.replace("objectives: [tokens_per_s_per_device]", "objectives: [ttft_ms]")))
    assert "ttft_ms is a infer metric" in msg


def test_command_backend_needs_argv(write_spec):
    msg = _errors(write_spec(TINY_TRAIN.replace("backend: simulate", "backend: {kind: command}")))
    assert "backend" in msg and "needs argv" in msg


def test_profile_override_unknown_key(write_spec):
    msg = _errors(
        write_spec(
            TINY_TRAIN.replace("devices_per_node: 2}", "devices_per_node: 2, overrides: {device_memory_gb: 32}}")
        )
    )
    assert "cluster.overrides" in msg and "device_memory_gb" in msg


def test_profile_override_applies(write_spec):
    from autotune.spec.resolve import probe_context

    spec = load_spec(
        write_spec(
            TINY_TRAIN.replace("devices_per_node: 2}", "devices_per_node: 2, overrides: {device_memory_gib: 3}}")
        )
    )
    assert probe_context(spec).hardware["device_memory_gib"] == 3


def test_tp_values_must_divide_world(write_spec):
    msg = _errors(write_spec(TINY_TRAIN.replace("tp: [1, 2]", "tp: [3]")))
    assert "space.tp: no value of [3] divides the world size 2" in msg


def test_env_values_flatten(write_spec):
    spec = load_spec(
        write_spec(
            TINY_TRAIN.replace(
                "  recompute: [none, full]\n",
                "  recompute: [none, full]\n  env:\n    HCCL_BUFFSIZE: [120, 200]\n    FLAG: [true]\n",
            )
        )
    )
    choices = spec.space.choices()
    assert choices["env.HCCL_BUFFSIZE"] == ["120", "200"] and choices["env.FLAG"] == ["1"]


def test_int_range(write_spec):
    spec = load_spec(
        write_spec(TINY_TRAIN.replace("micro_batch_size: [1, 2, 4]", "micro_batch_size: {low: 1, high: 4}"))
    )
    assert spec.space.choices()["micro_batch_size"] == [1, 2, 3, 4]


def test_missing_file():
    with pytest.raises(SpecError, match="cannot read the spec"):
        load_spec(Path("/nonexistent/spec.yaml"))


@pytest.mark.parametrize(
    "constraint,message",
    [
        ("9**9**9 > tp", "constant whole exponent"),
        ("recompute * 2 > 1", "cannot be evaluated"),  # a string parameter in arithmetic: found at validation
        ("'x' + tp == 1", "strings only compare"),
    ],
)
def test_unbounded_or_ill_typed_constraints_fail_validation(write_spec, constraint, message):
    path = write_spec(TINY_TRAIN + f'constraints: ["{constraint}"]\n')
    msg = _errors(path)
    assert "constraints[0]" in msg and message in msg


# ------------------------------------------------------ issue #13, item 9: what used to pass validate
def _problem(write_spec, text: str) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(text, "gap.yaml"))
    message = str(info.value)
    assert "gap.yaml" in message
    return message


@pytest.mark.parametrize(
    "old, new, where, says",
    [
        (
            "micro_batch_size: [1, 2, 4]",
            "micro_batch_size: [1, 2, 9223372036854775808]",
            "space.micro_batch_size[2]",
            "too large an integer",
        ),
        ("seq_len: 128", "seq_len: 9223372036854775808", "workload.seq_len", "too large an integer"),
        ("seed: 1}", "seed: 4294967296}", "search.seed", "less than 4294967296"),
        ("seed: 1}", "seed: 1e30}", "search.seed", "valid integer"),
        (
            "micro_batch_size: [1, 2, 4]",
            "micro_batch_size: {low: 1, high: 1000000000000}",
            "space.micro_batch_size",
            "1,000,000,000,000 values; at most 100,000",
        ),
        (
            "search: {",
            "baseline: {tp: 1, pp: 1, micro_batch_size: 3, zero_stage: 0, recompute: none}\nsearch: {",
            "baseline.micro_batch_size",
            "3 is not a value of space.micro_batch_size [1, 2, 4]",
        ),
        (
            "backend: simulate",
            "backend: {kind: command, argv: [echo], metric_patterns: {tokens_per_s: '([0-9'}}",
            "backend.metric_patterns",
            "not a regular expression",
        ),
        (
            "backend: simulate",
            "backend: {kind: command, argv: [echo], metric_patterns: {tokens_per_s: 'tps [0-9]+'}}",
            "backend.metric_patterns",
            "needs a group",
        ),
    ],
)
def test_values_no_field_can_use_are_located_errors(write_spec, old, new, where, says):
    assert old in TINY_TRAIN
    message = _problem(write_spec, TINY_TRAIN.replace(old, new, 1))
    assert f": {where}: " in message and says in message, message
    assert message.count("\n") == 0  # one problem, said once (not the union's every branch)


def test_deep_nesting_and_alias_bombs_are_errors_not_crashes(write_spec):
    deep = _problem(write_spec, TINY_TRAIN + "description: " + "[" * 50_000 + "]" * 50_000 + "\n")
    assert "nested too deeply" in deep
    bomb = (
        TINY_TRAIN
        + "baseline:\n  env.A: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"  env.A{i}: &a{i} [{', '.join([f'*a{i - 1}' if i > 1 else '*a'] * 9)}]\n" for i in range(1, 9))
    )
    assert "expands to more than 100,000 values" in _problem(write_spec, bomb + "  tp: *a8\n")
    # aliases as such are fine: a value written once and used twice
    shared = TINY_TRAIN.replace("tp: [1, 2]", "tp: &two [1, 2]").replace("pp: [1, 2]", "pp: *two")
    assert load_spec(write_spec(shared, "shared.yaml")).space.choices()["pp"] == [1, 2]


@pytest.mark.parametrize(
    "field, bad",
    [
        ("tie_tolerance", 0),
        ("tie_tolerance", 1.5),
        ("max_readings", 1),
        ("confidence", 0),
        ("confidence", 1),
        ("confirm_budget", 0),
        ("confirm_budget", 2.5),  # a share is below 1, a count whole
        ("confirm_budget", 21),  # above the budget (n_trials 20)
    ],
)
def test_the_race_settings_are_checked_and_reach_the_guide(write_spec, field, bad):
    """Issue 44's search.tie_tolerance, confidence, confirm_budget and max_readings: a value outside
    its range is an error naming the field; a valid one is what the guide races with."""
    from autotune.guide.spec_settings import guide_settings

    with pytest.raises(SpecError) as err:
        load_spec(write_spec(TINY_TRAIN.replace("search: {n_trials: 6, seed: 1}", f"search: {{{field}: {bad}}}")))
    assert f"search.{field}" in str(err.value)
    spec = load_spec(
        write_spec(
            TINY_TRAIN.replace(
                "search: {n_trials: 6, seed: 1}",
                "search: {tie_tolerance: 0.05, max_readings: 4, confidence: 0.9, confirm_budget: 0.3, n_trials: 10}",
            )
        )
    )
    settings = guide_settings(spec)
    assert (settings.tie_tolerance, settings.max_readings, settings.confidence) == (0.05, 4, 0.9)
    assert settings.confirm_readings == 3  # 0.3 of 10


def test_the_llama3_70b_space_ranks_mindspeeds_published_layout_first():
    """Split evenly, tp8 pp4 without recompute does not fit a 64 GB 910B (its first stage: pp
    micro-batches and the 128k-vocabulary embedding); with 17 layers on the first stage it does, and
    the simulator ranks it first: the layout MindSpeed-LLM publishes (--num-layer-list 17,20,22,21)."""
    from autotune.guide.ranking import rank_space
    from autotune.spec.resolve import probe_context
    from autotune.spec.space import Space

    spec = load_spec(REPO / "search_spaces" / "llama3_70b_32npu.yaml")
    space = Space(spec)
    ranking = rank_space(space.enumerate(), probe_context(spec), objectives_of(spec))
    configs = space.enumerate().configs
    fits = [bool(f) for f in ranking.predictions["fits"]]
    speed = list(ranking.predictions["tokens_per_s_per_device"])
    best = max((i for i in range(len(fits)) if fits[i]), key=lambda i: speed[i])
    top = configs[best]
    assert (top["tp"], top["pp"], top.get("first_stage_layers"), top["recompute"]) == (8, 4, 17, "none")
    even = [i for i in range(len(fits)) if configs[i].get("first_stage_layers") is None]
    assert not any(
        fits[i] and configs[i]["tp"] == 8 and configs[i]["pp"] == 4 and configs[i]["recompute"] == "none" for i in even
    )
