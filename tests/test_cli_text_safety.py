"""Text that did not come from autotune (a probe's output, a spec's values) is printed as text:
brackets in it are never read as rich markup, which crashed the CLI (``[/bold]``) or swallowed
words (``[tp for x in (1,2)] == 1`` shown as ``' == 1'``)."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from support import TINY_TRAIN

PROBE = r"""
import sys
print("[rank0]: [W init.cpp:767] warning: [/bold] is not a tag [red]")
print("RuntimeError: a failure with [/bold] and [link=x] in it")
sys.exit(1)
"""


def test_probe_output_with_markup_does_not_crash_the_study(write_spec, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    spec = write_spec(f"""
        name: markup
        model: tiny-llama
        workload: {{kind: train, seq_len: 64, global_batch_size: 4, timeout_s: 30}}
        cluster: {{accelerator: cpu, devices_per_node: 1}}
        backend: {{kind: command, argv: ["{sys.executable}", "{probe}", "{{trial_file}}"]}}
        space: {{micro_batch_size: [1, 2]}}
        search: {{n_trials: 2, sampler: random}}
        ray: {{enabled: false}}
    """)
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "run"), "--no-tracking"])
    assert result.exit_code == 1, result.output  # no trial succeeded: the documented exit, not a crash
    assert "[/bold] and [link=x]" in result.output  # the probe's words, verbatim
    report = CliRunner().invoke(app, ["report", str(tmp_path / "run")])
    assert report.exit_code == 0 and "[/bold]" in report.output


def test_spec_text_with_brackets_is_reported_verbatim(write_spec):
    spec = write_spec("""
        name: brackets
        model: tiny-llama
        workload: {kind: train, seq_len: 64, global_batch_size: 4}
        cluster: {accelerator: cpu, devices_per_node: 1}
        constraints: ["[tp for x in (1,2)] == 1", "tp [/bold] 2"]
    """)
    result = CliRunner().invoke(app, ["validate", str(spec)])
    assert result.exit_code == 2
    assert "[tp for x in (1,2)] == 1" in result.output and "[/bold]" in result.output


def test_an_uncaught_error_is_exit_70_in_one_line_not_1(write_spec, monkeypatch, capsys):
    """Exit 1 means "no trial succeeded"; a bug in autotune is 70 (sysexits EX_SOFTWARE), one line
    on stderr, and the traceback only with AUTOTUNE_DEBUG=1 (issue #13, item 11)."""
    import autotune.cli.commands as cli

    def broken(*args, **kwargs):
        raise RuntimeError("something [/bold] broke")

    monkeypatch.setattr(cli, "load_spec", broken)
    monkeypatch.setattr(cli, "_install_sigterm", lambda: None)  # leave pytest's own SIGTERM handling alone
    monkeypatch.setattr(sys, "argv", ["autotune", "validate", str(write_spec(TINY_TRAIN))])
    monkeypatch.delenv("AUTOTUNE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 70
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: something [/bold] broke" in err.replace("\n", " ") and "Traceback" not in err
    monkeypatch.setenv("AUTOTUNE_DEBUG", "1")
    with pytest.raises(RuntimeError):
        cli.main()
