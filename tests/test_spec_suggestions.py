"""Spec errors that say what to write (issue #40): an unknown key names the close known field at
its level (``did you mean 'micro_batch_size'?``) or the fields expected there, and a value that
fits no branch of a union (``list[int] | IntRange``) is one line in plain words, never one line
per branch ("Input should be a valid dictionary or instance of IntRange")."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.spec.errors import SpecError, SpecProblem
from autotune.spec.load import load_spec
from support import TINY_TRAIN

SPEC = textwrap.dedent(TINY_TRAIN).lstrip()  # line 1 is "name: tiny"; line 7 "  tp: [1, 2]"

SERVE = textwrap.dedent(
    """
    name: serve-test
    model: tiny-llama
    workload:
      kind: serve
      traffic:
        rates: [1, 2, 4]
        prompt_len: {low: 64, high: 192}
        output_len: 32
      slo: {ttft_p99_ms: 1000, tpot_p99_ms: 100}
    cluster: {accelerator: cpu, profile: cpu, devices_per_node: 4}
    target: none
    space:
      tp: [1, 2, 4]
      replicas: [1, 2, 4]
    """
).lstrip()  # line 5 is "  traffic:", line 7 "    prompt_len: ..."


def short_id(value: object) -> str:
    """A test id of the spec's changed text, not of the whole spec."""
    if value == SERVE:
        return "serve"
    if value == SPEC:
        return "train"
    return str(value).strip()[:40]


def write(tmp_path: Path, base: str, old: str, new: str) -> Path:
    text = base.replace(old, new)
    assert text != base, f"{old!r} is not in the spec"
    path = tmp_path / "spec.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def problems(path: Path) -> list[SpecProblem]:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value.problems


def rendered(path: Path) -> list[str]:
    return [p.render(path.name) for p in problems(path)]


def validate(path: Path) -> str:
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    return result.output


# ---------------------------------------------------------------------------- unknown fields
@pytest.mark.parametrize(
    "base, old, new, line",
    ids=short_id,
    argvalues=[
        (
            SPEC,
            "  micro_batch_size: [1, 2, 4]",
            "  micro_batch_sise: [1, 2, 4]",
            "spec.yaml:9: space.micro_batch_sise: unknown field 'micro_batch_sise'; did you mean 'micro_batch_size'?",
        ),
        (
            SPEC,
            "objectives: [tokens_per_s_per_device]",
            "objectivs: [tokens_per_s_per_device]",
            "spec.yaml:12: objectivs: unknown field 'objectivs'; did you mean 'objectives'?",
        ),
        (  # under a discriminated union (kind: serve): the serve workload's fields, and no 'serve' in the path
            SERVE,
            "  traffic:",
            "  trafic:",
            "spec.yaml:5: workload.trafic: unknown field 'trafic'; did you mean 'traffic'?",
        ),
        (
            SERVE,
            "slo: {ttft_p99_ms: 1000, tpot_p99_ms: 100}",
            "slo: {ttft_p99_ms: 1000, tpot_p99_mx: 100}",
            "spec.yaml:9: workload.slo.tpot_p99_mx: unknown field 'tpot_p99_mx'; did you mean 'tpot_p99_ms'?",
        ),
        (  # in a union's range branch (IntRange | list[int])
            SPEC,
            "  tp: [1, 2]",
            "  tp: {low: 1, high: 2, stp: 1}",
            "spec.yaml:7: space.tp.stp: unknown field 'stp'; did you mean 'step'?",
        ),
        (  # in a list of models
            SPEC,
            "objectives: [tokens_per_s_per_device]",
            "objectives: [{metrc: tokens_per_s_per_device}]",
            "spec.yaml:12: objectives[0].metrc: unknown field 'metrc'; did you mean 'metric'?",
        ),
        (  # `preset` is taken by the model field's own validator
            SPEC,
            "model: tiny-llama",
            "model: {presett: tiny-llama}",
            "spec.yaml:2: model.presett: unknown field 'presett'; did you mean 'preset'?",
        ),
        (SPEC, "  tp: [1, 2]", "  TP: [1, 2]", "spec.yaml:7: space.TP: unknown field 'TP'; did you mean 'tp'?"),
    ],
)
def test_an_unknown_field_close_to_a_known_one_gets_the_suggestion(tmp_path, base, old, new, line):
    path = write(tmp_path, base, old, new)
    assert line in rendered(path)
    assert line in validate(path)


def test_the_suggestion_reaches_autotune_validate(tmp_path):
    path = write(tmp_path, SPEC, "  micro_batch_size:", "  micro_batch_sise:")
    out = validate(path)
    assert "space.micro_batch_sise: unknown field 'micro_batch_sise'; did you mean 'micro_batch_size'?" in out
    assert "Extra inputs are not permitted" not in out


def test_an_unknown_field_with_nothing_close_names_the_fields_expected_there(tmp_path):
    path = write(tmp_path, SPEC, "  tp: [1, 2]", "  banana: [1, 2]")
    (line,) = rendered(path)
    assert line.startswith("spec.yaml:7: space.banana: unknown field 'banana'; expected one of: tp, pp, cp, ")
    assert "micro_batch_size" in line and "did you mean" not in line


def test_an_unknown_top_level_section_with_nothing_close_gets_no_suggestion(tmp_path):
    path = write(tmp_path, SPEC, "name: tiny", "name: tiny\nzzzzzz: 1")
    (line,) = rendered(path)
    assert line.startswith("spec.yaml:2: zzzzzz: unknown field 'zzzzzz'; expected one of: name, description, model")
    assert "did you mean" not in line


# ------------------------------------------------------------------- a wrong type: one line
@pytest.mark.parametrize(
    "base, old, new, line",
    ids=short_id,
    argvalues=[
        (
            SPEC,
            "  tp: [1, 2]",
            "  tp: abc",
            "spec.yaml:7: space.tp: expected a list of integers or a {low, high} range (got 'abc')",
        ),
        (
            SPEC,
            "  tp: [1, 2]",
            "  tp: 4",
            "spec.yaml:7: space.tp: expected a list of integers or a {low, high} range (got 4)",
        ),
        (
            SPEC,
            "  micro_batch_size: [1, 2, 4]",
            "  micro_batch_size: 1.5",
            "spec.yaml:9: space.micro_batch_size: expected a list of integers or a {low, high} range (got 1.5)",
        ),
        (
            SERVE,
            "prompt_len: {low: 64, high: 192}",
            "prompt_len: abc",
            "spec.yaml:7: workload.traffic.prompt_len: expected an integer or a {low, high} range (got 'abc')",
        ),
    ],
)
def test_a_value_that_fits_no_branch_of_a_union_is_one_plain_line(tmp_path, base, old, new, line):
    path = write(tmp_path, base, old, new)
    lines = rendered(path)
    assert lines == [line]
    out = validate(path)
    assert "instance of" not in out and "valid dictionary" not in out and line in out


@pytest.mark.parametrize(
    "base, old, new, line",
    ids=short_id,
    argvalues=[
        # the list branch took the value: its item's error only, not the range branch's
        (
            SPEC,
            "  tp: [1, 2]",
            "  tp: [1, x]",
            "spec.yaml:7: space.tp[1]: Input should be a valid integer, unable to parse string as an integer (got 'x')",
        ),
        # the range branch took the mapping: its missing field only, not the list branch's "valid list"
        (SPEC, "  tp: [1, 2]", "  tp: {low: 1}", "spec.yaml:7: space.tp.high: required field is missing"),
        (
            SERVE,
            "prompt_len: {low: 64, high: 192}",
            "prompt_len: {low: 64}",
            "spec.yaml:7: workload.traffic.prompt_len.high: required field is missing",
        ),
        # a union in a list in a mapping: no branch labels ('.str', '.int') in the path
        (
            SPEC,
            "  tp: [1, 2]",
            "  tp: [1, 2]\n  env: {A: [{x: 1}]}",
            "spec.yaml:8: space.env.A[0]: expected a string, an integer, a number or a boolean (true or false) "
            "(got {'x': 1})",
        ),
    ],
)
def test_a_union_branch_that_took_the_value_gives_the_one_error(tmp_path, base, old, new, line):
    path = write(tmp_path, base, old, new)
    assert rendered(path) == [line]


def test_one_problem_per_wrong_field_and_each_at_its_line(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.replace("  tp: [1, 2]", "  tp: abc").replace("micro_batch_size:", "micro_batch_sise:"))
    assert rendered(path) == [
        "spec.yaml:7: space.tp: expected a list of integers or a {low, high} range (got 'abc')",
        "spec.yaml:9: space.micro_batch_sise: unknown field 'micro_batch_sise'; did you mean 'micro_batch_size'?",
    ]


def test_errors_that_were_one_clear_line_stay_as_they_were(tmp_path):
    path = write(tmp_path, SPEC, "recompute: [none, full]", "recompute: [none, ful]")
    assert rendered(path) == [
        "spec.yaml:11: space.recompute[1]: Input should be 'none', 'selective' or 'full' (got 'ful')"
    ]
    path = write(tmp_path, SPEC, "  tp: [1, 2]", "  tp: {low: 4, high: 1}")
    assert rendered(path) == ["spec.yaml:7: space.tp: high (1) is below low (4)"]
