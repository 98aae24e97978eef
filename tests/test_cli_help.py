"""The CLI's help says what the code does (issue #34): every backend ``run --backend`` accepts,
every export format and the file it writes, flags shown as flags (never ``--json <bool>``), and
the options a user meets in the README documented. The lists are read from the code, never
written here, so a new backend or exporter that the help forgets fails this test."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app

runner = CliRunner()
COMMANDS = ["doctor", "validate", "plan", "calibrate", "run", "report", "export", "ui", "scale"]


def _help(*args: str) -> str:
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "120", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    # one line of words: rich's panel borders and its wrapping out
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.stdout).split())


def test_run_help_lists_every_backend_the_code_accepts():
    from autotune.dispatch.backends import select_backend
    from autotune.spec.load import load_spec
    from support import REPO

    text = _help("run")
    with pytest.raises(ValueError) as refused:  # the list select_backend itself gives for a wrong name
        select_backend(load_spec(REPO / "search_spaces" / "tiny_llama_cpu.yaml"), "no-such-backend")
    kinds = str(refused.value).split("expected one of ", 1)[1].split(", got", 1)[0].split(", ")
    assert len(kinds) >= 5
    listed = text.split("--backend", 1)[1].split("(overrides", 1)[0]
    assert [k.strip() for k in listed.replace("<str>", "").split("|")] == kinds


def test_export_help_lists_every_format_and_its_file():
    from autotune.finish.exports import EXPORTERS

    text = _help("export")
    for name, exporter in EXPORTERS.items():
        assert f"{name} ({exporter.filename})" in text, name
    assert "TOML" not in text  # torchtitan's export is a launch script (launch_torchtitan.sh)


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_show_as_plain_flags(command):
    assert "<bool>" not in _help(command)


def test_documented_options():
    assert "--top <int range> [x>=1] trials shown in the table" in _help("report")
    text = _help("run")
    assert "--no-tracking write no MLflow runs" in text
    text = _help("ui")
    for option in ("--host", "--port", "--open", "--no-open", "--print-url"):
        assert option in text
