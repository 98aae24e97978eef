"""Text that came from a probe (a failure reason) or a spec (the model's name, env and engine
values) reaches the terminal escaped (issue 42): an ESC, BEL, NUL or U+202E in it is written as
``\\x1b``, ``\\x07``, ``\\x00``, ``\\u202e``, never as the byte that would set the window's title,
clear the screen, colour the rest of the output or reverse it; a newline in it is ``\\n``, never a
line break that splits a table's row. Ordinary text is printed as it is (see
test_cli_text_safety.py: brackets are text, never rich markup)."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app

RAW = ("\x1b", "\x07", "\x00", "\u202e")

# a failure reason that would set the window title, clear the screen, colour and reverse the text
REASON = "boom \x1b]0;TITLE\x07 \x1b[2J \x1b[31mred\x1b[0m \u202e[bold]rev[/bold]\nNEXTREASON"
PROBE = f"""
import json
print(json.dumps({{"event": "failure", "reason": {REASON!r}}}))
"""


def _assert_safe(text: str, *continuations: str) -> None:
    """No raw control, bidi or NUL character in ``text``, and each of ``continuations`` (the words
    after a newline of the original text) on the line of the words before it, after a ``\\n``."""
    for ch in RAW:
        assert ch not in text, (ch, text)
    for word in continuations:
        for line in text.splitlines():
            if word in line:
                assert f"\\n{word}" in line, (word, line)


def _invoke(args: list[str]):
    return CliRunner().invoke(app, args)


@pytest.fixture
def failing_study(write_spec, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    spec = write_spec(f"""
        name: unsafe-reason
        model: tiny-llama
        workload: {{kind: train, seq_len: 64, global_batch_size: 4, timeout_s: 30}}
        cluster: {{accelerator: cpu, devices_per_node: 1}}
        backend: {{kind: command, argv: ["{sys.executable}", "{probe}", "{{trial_file}}"]}}
        space: {{micro_batch_size: [1, 2]}}
        search: {{n_trials: 2, sampler: random}}
        ray: {{enabled: false}}
    """)
    return spec, tmp_path / "run"


def test_a_probes_failure_reason_is_escaped_in_run_and_report(failing_study):
    spec, run_dir = failing_study
    result = _invoke(["run", str(spec), "--run-dir", str(run_dir), "--no-tracking"])
    assert result.exit_code == 1, result.output  # no trial succeeded
    _assert_safe(result.stderr, "NEXTREASON")
    _assert_safe(result.stdout, "NEXTREASON")
    # the progress line of the failed trial: the reason whole, on one line, escaped
    assert "boom \\x1b]0;TITLE\\x07 \\x1b[2J \\x1b[31mred\\x1b[0m \\u202e[bold]rev[/bold]\\nNEXTREASON" in result.stderr
    report = _invoke(["report", str(run_dir)])
    assert report.exit_code == 0, report.output
    _assert_safe(report.stdout, "NEXTREASON")
    _assert_safe(report.stderr, "NEXTREASON")
    assert "why failed: boom \\x1b]0;TITLE\\x07 \\x1b[2J" in report.stdout
    assert "\\u202e[bold]rev[/bold]\\nNEXTREASON" in report.stdout  # brackets are text, not markup


# a model name, env values and engine values that hold ESC, NUL, BEL and newlines
SPEC_VALUES = r"""
name: unsafe-values
model: {preset: tiny-llama, name: "tiny\e[31m\0\u202e\nNEXTNAME"}
workload:
  kind: serve
  traffic: {rates: [1, 2], prompt_len: 64, output_len: 16}
  slo: {ttft_p99_ms: 1000, tpot_p99_ms: 100}
cluster: {accelerator: cpu, profile: cpu, devices_per_node: 2}
target: none
backend: simulate
space:
  tp: [1, 2]
  env: {MY_FLAG: ["[bold]a[/bold]", "b"]}
  engine: {myFlag: ["x[red]y", "z"]}
search: {n_trials: 4, seed: 1}
ray: {enabled: false}
"""
CONTINUATIONS = ("NEXTNAME",)


@pytest.fixture
def unsafe_spec(write_spec):
    return write_spec(SPEC_VALUES)


def test_spec_values_are_escaped_by_validate(unsafe_spec):
    result = _invoke(["validate", str(unsafe_spec)])
    assert result.exit_code == 0, result.output
    _assert_safe(result.output, *CONTINUATIONS)
    assert "ok  unsafe-values: tiny\\x1b[31m\\x00\\u202e\\nNEXTNAME (" in result.stdout


def test_spec_values_are_escaped_by_plan(unsafe_spec):
    result = _invoke(["plan", str(unsafe_spec)])
    assert result.exit_code == 0, result.output
    _assert_safe(result.stdout, *CONTINUATIONS)
    _assert_safe(result.stderr, *CONTINUATIONS)
    assert "unsafe-values: tiny\\x1b[31m\\x00\\u202e\\nNEXTNAME (" in result.stdout
    assert "engine.myFlag=x[red]y" in result.stdout or "engine.myFlag=z" in result.stdout  # text, not markup
    assert "MY_FLAG=[bold]a[/bold]" in result.stdout or "MY_FLAG=b" in result.stdout


def test_spec_values_are_escaped_by_run_and_report(unsafe_spec, tmp_path):
    run_dir = tmp_path / "run"
    result = _invoke(["run", str(unsafe_spec), "--run-dir", str(run_dir), "--no-tracking"])
    assert result.exit_code == 0, result.output
    _assert_safe(result.stdout, *CONTINUATIONS)
    _assert_safe(result.stderr, *CONTINUATIONS)
    assert "engine.myFlag=" in result.stdout
    report = _invoke(["report", str(run_dir)])
    assert report.exit_code == 0, report.output
    _assert_safe(report.stdout, *CONTINUATIONS)
    _assert_safe(report.stderr, *CONTINUATIONS)
    assert "engine.myFlag=x[red]y" in report.stdout and "MY_FLAG=[bold]a[/bold]" in report.stdout


def test_ordinary_text_is_printed_as_it_is(write_spec):
    spec = write_spec(SPEC_VALUES.replace(r'"tiny\e[31m\0\u202e\nNEXTNAME"', '"naïve-模型 [bold]x[/bold]"'))
    result = _invoke(["validate", str(spec)])
    assert result.exit_code == 0, result.output
    assert "ok  unsafe-values: naïve-模型 [bold]x[/bold] (" in result.stdout


def test_control_characters_in_env_and_engine_values_are_refused_and_said_escaped(write_spec):
    """The spec refuses them (issue 42 #8: bash would drop a NUL, a terminal would act on an ESC), and
    its error quotes them escaped."""
    spec = write_spec(
        SPEC_VALUES.replace('MY_FLAG: ["[bold]a[/bold]", "b"]', 'MY_FLAG: ["a\\e]0;TITLE\\a", "b\\nNEXTENV"]')
    )
    result = _invoke(["validate", str(spec)])
    assert result.exit_code == 2, result.output
    _assert_safe(result.output)
    assert "space.env.MY_FLAG" in result.output


def test_values_of_an_older_study_are_escaped_in_the_tables():
    """A record written before the spec refused them (or by hand) still prints escaped."""
    from autotune.finish.run_output import short

    text = short({"tp": 1, "env.MY_FLAG": "a\x1b]0;TITLE\x07", "engine.myFlag": "x\x00y\nNEXT"})
    _assert_safe(text, "NEXT")
    assert "MY_FLAG=a\\x1b]0;TITLE\\x07" in text and "engine.myFlag=x\\x00y\\nNEXT" in text
