"""Input that validated but broke a probe, an export or a spreadsheet (issue #42, defects 3, 4 and
6-10): non-finite engine/env values and the JSON they made, a lengths file's numbers, booleans,
duplicate columns and quoted contents, serving durations and SLOs, a hand-written ``length_pairs``,
flag-like and control-character engine values, and formula cells in results.csv. Each is a spec
error naming the field (exit 2) or a refused export, never an internal error (exit 70)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.export import ExportContext
from autotune.spec.errors import SpecError
from autotune.spec.load import load_spec

SERVE = """
name: serve-hardening
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
  tp: [1, 2]
"""
LENGTHS = "    prompt_len: {low: 64, high: 192}\n    output_len: 32\n"


def cli(*args: str) -> tuple[int, str]:
    """``autotune ARGS`` in-process; an exception escaping the command is exit 70 (an internal error)."""
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return 70, f"{type(result.exception).__name__}: {result.exception}\n{result.output}"
    return result.exit_code, result.output


def errors(write_spec, text: str) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(text))
    return str(info.value)


def with_space(text: str) -> str:
    return SERVE.replace("  tp: [1, 2]\n", "  tp: [1, 2]\n" + text)


def with_lengths_file(name: str) -> str:
    return SERVE.replace(LENGTHS, f"    lengths_file: {name}\n")


def serve_context(config: dict[str, Any], accelerator: str = "npu", target: str = "vllm") -> ExportContext:
    return ExportContext(
        study="serve",
        trial=3,
        config={"tp": 1, "pp": 1, "replicas": 1, "max_num_seqs": 64, **config},
        metrics={"goodput_rps_per_device": 0.5},
        source="measured",
        model={"name": "llama2-7b"},
        workload={
            "kind": "serve",
            "traffic": {"rates": [1.0], "prompt_len": 128, "output_len": 32},
            "slo": {"ttft_p99_ms": 1000.0},
            "max_model_len": 160,
        },
        cluster={"accelerator": accelerator, "nodes": 1, "devices_per_node": 8, "world_size": 8},
        target=target,
    )


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


# --------------------------------------------------------- 3: non-finite engine / env values
@pytest.mark.parametrize(
    "space, where",
    [
        ("  engine: {prefillExpectedTime: [.nan, .inf]}\n", "space.engine.prefillExpectedTime[0]"),
        ("  engine: {prefillExpectedTime: [1.5, -.inf]}\n", "space.engine.prefillExpectedTime[1]"),
        ("  env: {MY_SETTING: [1, .inf]}\n", "space.env.MY_SETTING[1]"),
    ],
)
def test_non_finite_engine_and_env_values_are_spec_errors(write_spec, space, where):
    out = errors(write_spec, with_space(space))
    assert where in out and "finite" in out, out


def test_a_non_finite_baseline_env_value_is_a_spec_error(write_spec):
    out = errors(write_spec, with_space("  env: {MY_SETTING: ['1', inf]}\n") + "baseline: {env.MY_SETTING: .inf}\n")
    assert "baseline.env.MY_SETTING" in out and "finite" in out, out


def test_the_mindie_export_refuses_non_finite_values_and_never_writes_nan():
    from autotune.finish.exports import EXPORTERS

    mindie = EXPORTERS["mindie"]
    ctx = serve_context(
        {"engine.prefillExpectedTime": math.nan, "engine.decodeExpectedTime": -math.inf}, target="mindie"
    )
    reasons = " ".join(mindie.unsupported(ctx))
    assert "engine.prefillExpectedTime" in reasons and "engine.decodeExpectedTime" in reasons, reasons
    with pytest.raises(ValueError):  # the last guard: never NaN / -Infinity in the file
        mindie.render(ctx)
    good = serve_context({"engine.prefillExpectedTime": 1500}, target="mindie")
    assert not [r for r in mindie.unsupported(good) if "finite" in r]
    json.loads(mindie.render(good), parse_constant=_no_constants)  # strict JSON


def test_vllm_additional_config_must_be_a_finite_json_object(write_spec):
    out = errors(write_spec, with_space("""  engine: {additional_config: ['{"x": NaN}', '[1]']}\n"""))
    assert "engine.additional_config" in out and "NaN" in out and "JSON object" in out, out


# ------------------------------------------------------------ 4 and 6: a lengths file's numbers
@pytest.mark.parametrize(
    "name, body, line, cell",
    [
        (
            "lengths.jsonl",
            '{"prompt_len": 10, "output_len": 5}\n{"prompt_len": Infinity, "output_len": 5}\n',
            2,
            "prompt_len",
        ),
        (
            "lengths.jsonl",
            '{"prompt_len": 10, "output_len": 5}\n\n{"prompt_len": 1e300, "output_len": 5}\n',
            3,
            "prompt_len",
        ),
        ("lengths.jsonl", '{"prompt_len": 10, "output_len": NaN}\n', 1, "output_len"),
        ("lengths.jsonl", '{"prompt_len": 10, "output_len": 12.5}\n', 1, "output_len"),
        ("lengths.csv", "prompt_len,output_len\n10,5\nInfinity,5\n", 3, "prompt_len"),
        ("lengths.csv", "prompt_len,output_len\n10,1e300\n", 2, "output_len"),
    ],
)
def test_a_lengths_file_number_out_of_range_is_a_spec_error(write_spec, tmp_path, name, body, line, cell):
    (tmp_path / name).write_text(body)
    code, out = cli("validate", str(write_spec(with_lengths_file(name))))
    assert code == 2, out
    assert "Traceback" not in out and "internal error" not in out, out
    assert name in out and f"line {line}" in out and cell in out and "integer" in out, out


@pytest.mark.parametrize(
    "name, body, line",
    [
        ("lengths.jsonl", '{"prompt_len": 10, "output_len": 5}\n{"prompt_len": true, "output_len": 5}\n', 2),
        ("lengths.jsonl", '{"prompt_len": 10, "output_len": false}\n', 1),
        ("lengths.jsonl", '{"prompt_len": "true", "output_len": 4}\n', 1),
        ("lengths.csv", "prompt_len,output_len\n10,5\n12,TRUE\n", 3),
    ],
)
def test_a_boolean_length_is_refused(write_spec, tmp_path, name, body, line):
    (tmp_path / name).write_text(body)
    out = errors(write_spec, with_lengths_file(name))
    assert f"line {line}" in out and "boolean" in out, out


def test_a_csv_with_a_repeated_column_is_refused_with_its_name(write_spec, tmp_path):
    (tmp_path / "lengths.csv").write_text("prompt_len,output_len,prompt_len\n10,5,900\n")
    out = errors(write_spec, with_lengths_file("lengths.csv"))
    assert "'prompt_len'" in out and "twice" in out, out


def test_good_lengths_files_still_load(write_spec, tmp_path):
    (tmp_path / "a.jsonl").write_text(
        '{"prompt_len": 100, "output_len": 20}\n\n{"prompt_len": 300.0, "output_len": "60"}\n'
    )
    assert load_spec(write_spec(with_lengths_file("a.jsonl"))).workload.traffic.length_pairs == [(100, 20), (300, 60)]
    (tmp_path / "b.csv").write_text("\ufeffid,prompt_len,output_len\nx,100, 20\n\ny,300,60\n")
    assert load_spec(write_spec(with_lengths_file("b.csv"))).workload.traffic.length_pairs == [(100, 20), (300, 60)]


# -------------------------------------------------------- 9: errors do not quote a file's contents
PASSWD = (
    "root:x:0:0:root:/root:/bin/bash\n"
    "daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
    "secretuser:x:1000:1000:Secret User,,,:/home/secretuser:/bin/bash\n"
)


def test_a_lengths_file_error_does_not_quote_its_lines(write_spec, tmp_path):
    target = tmp_path / "passwd"
    target.write_text(PASSWD)
    (tmp_path / "lengths.csv").symlink_to(target)
    code, out = cli("validate", str(write_spec(with_lengths_file("lengths.csv"))))
    assert code == 2, out
    for secret in ("root:x:0:0", "/bin/bash", "daemon", "secretuser", "/usr/sbin"):
        assert secret not in out, out
    assert "prompt_len" in out and "line 1" in out, out


def test_a_lengths_file_cell_is_quoted_short_and_escaped(write_spec, tmp_path):
    long_cell = "A" * 30 + "\x1b[2J" + "B" * 200 + "SECRETTAIL"
    (tmp_path / "lengths.jsonl").write_text(json.dumps({"prompt_len": long_cell, "output_len": 3}) + "\n")
    out = errors(write_spec, with_lengths_file("lengths.jsonl"))
    assert "SECRETTAIL" not in out and "\x1b" not in out and "B" * 60 not in out, out
    assert "line 1" in out and "prompt_len" in out, out
    (tmp_path / "lengths.jsonl").write_text('["root:x:0:0:root:/root:/bin/bash", 3]\n')
    out = errors(write_spec, with_lengths_file("lengths.jsonl"))
    assert "root:x:0:0" not in out and "line 1" in out and "JSON object" in out, out


# ------------------------------------------------ 6: serving durations and SLOs a probe uses
@pytest.mark.parametrize(
    "change, where, words",
    [
        (
            ("    output_len: 32\n", "    output_len: 32\n    duration_s: .inf\n"),
            "workload.traffic.duration_s",
            "finite",
        ),
        (
            ("    output_len: 32\n", "    output_len: 32\n    duration_s: 1e9\n"),
            "workload.traffic.duration_s",
            "86,400",
        ),
        (
            ("    output_len: 32\n", "    output_len: 32\n    burstiness: .inf\n"),
            "workload.traffic.burstiness",
            "finite",
        ),
        (
            ("    output_len: 32\n", "    output_len: 32\n    burstiness: 1e-300\n"),
            "workload.traffic.burstiness",
            "0.001",
        ),
        (("rates: [1, 2, 4]", "rates: [1, 2, 1e300]"), "workload.traffic", "requests"),
        (("ttft_p99_ms: 1000", "ttft_p99_ms: .inf"), "workload.slo.ttft_p99_ms", "finite"),
        (("tpot_p99_ms: 100", "tpot_p99_ms: 1e300"), "workload.slo.tpot_p99_ms", "86,400,000"),
        (("kind: serve\n", "kind: serve\n  startup_timeout_s: .inf\n"), "workload.startup_timeout_s", "finite"),
        (("kind: serve\n", "kind: serve\n  timeout_s: 1e12\n"), "workload.timeout_s", "604,800"),
    ],
)
def test_serving_durations_and_slos_are_finite_and_bounded(write_spec, change, where, words):
    code, out = cli("validate", str(write_spec(SERVE.replace(*change))))
    assert code == 2, out
    assert where in out and words in out, out


def test_length_pairs_cannot_be_written_in_a_spec(write_spec):
    text = SERVE.replace(LENGTHS, "    length_pairs: [[100, 10], [-5, 0]]\n")
    out = errors(write_spec, text)
    assert "workload.traffic.length_pairs" in out and "lengths_file" in out, out
    both = SERVE.replace(LENGTHS, LENGTHS + "    length_pairs: [[100, 10]]\n")
    assert "workload.traffic.length_pairs" in errors(write_spec, both)


# ------------------------------------------------------------------- 7 and 8: engine values
@pytest.mark.parametrize("value", ["'--model=/etc/passwd'", "'-h'", "'-5'"])
def test_a_flag_like_engine_value_is_a_spec_error(write_spec, value):
    out = errors(write_spec, with_space(f"  engine: {{weird: [{value}]}}\n"))
    assert "space.engine.weird[0]" in out and "'-'" in out, out


def test_negative_numbers_as_numbers_stay_allowed(write_spec):
    spec = load_spec(write_spec(with_space("  engine: {weird: [-5, -1.5, x-y]}\n  env: {MY_SETTING: ['-1', -2]}\n")))
    assert spec.space.engine["weird"] == [-5, -1.5, "x-y"] and spec.space.env["MY_SETTING"] == ["-1", "-2"]


@pytest.mark.parametrize(
    "space, where, words",
    [
        ('  engine: {weird: ["a\\0b"]}\n', "space.engine.weird[0]", "NUL character"),
        ('  engine: {weird: [ok, "a\\nb"]}\n', "space.engine.weird[1]", "control character U+000A"),
        ('  engine: {weird: ["a\\x1b[2Jb"]}\n', "space.engine.weird[0]", "control character U+001B"),
        ('  engine: {weird: ["a\\x85b"]}\n', "space.engine.weird[0]", "control character U+0085"),
        ('  engine: {weird: ["a\\u2028b"]}\n', "space.engine.weird[0]", "invisible character U+2028"),
        ('  engine: {weird: ["\\u202eevil"]}\n', "space.engine.weird[0]", "invisible character U+202E"),
        ('  env: {MY_SETTING: ["a\\tb"]}\n', "space.env.MY_SETTING[0]", "control character U+0009"),
        ('  env: {MY_SETTING: ["a\\rb"]}\n', "space.env.MY_SETTING[0]", "control character U+000D"),
    ],
)
def test_control_characters_in_engine_and_env_values_are_spec_errors(write_spec, space, where, words):
    out = errors(write_spec, with_space(space))
    assert where in out and words in out, out


def test_ordinary_unicode_in_engine_and_env_values_stays_allowed(write_spec):
    spec = load_spec(
        write_spec(with_space("  engine: {served_model_name: [naïve-模型]}\n  env: {MY_SETTING: ['🙂 x']}\n"))
    )
    assert spec.space.engine["served_model_name"] == ["naïve-模型"] and spec.space.env["MY_SETTING"] == ["🙂 x"]


def test_a_nul_in_a_command_line_word_is_a_spec_error(write_spec):
    text = SERVE.replace(
        "target: none\n", 'target: none\nbackend: {kind: vllm, args: [--trust-remote-code, "--a\\0b"]}\n'
    )
    out = errors(write_spec, text)
    assert "backend.args" in out and "word 2" in out and "NUL character" in out, out


def test_the_vllm_export_refuses_flag_like_and_nul_engine_values():
    from autotune.export._vllm import vllm_engine_args
    from autotune.finish.exports import EXPORTERS

    vllm = EXPORTERS["vllm"]
    for value in ("--model=/etc/passwd", "a\x00b", "x\ny"):
        ctx = serve_context({"engine.weird": value})
        reasons = " ".join(vllm.unsupported(ctx))
        assert "engine.weird" in reasons, reasons
        with pytest.raises(ValueError, match="engine.weird"):
            vllm_engine_args(ctx.config, "npu")
    ok = serve_context({"engine.weird": -5, "engine.flag": True})
    assert not [r for r in vllm.unsupported(ok) if "engine." in r]
    args = vllm_engine_args(ok.config, "npu")
    assert args[args.index("--weird") + 1] == "-5" and "--flag" in args


def test_a_shell_export_refuses_a_nul_in_an_env_value():
    from autotune.finish.exports import EXPORTERS

    ctx = serve_context({"env.MY_SETTING": "a\x00b"})
    for name in ("env", "vllm"):
        assert any("MY_SETTING" in r for r in EXPORTERS[name].unsupported(ctx)), name


# ---------------------------------------------------------------- 10: formulas in results.csv
def test_results_csv_neutralises_formula_cells(tmp_path: Path):
    from autotune.finish.report import write_results_csv

    rows = [
        {
            "trial": 0,
            "status": "ok",
            "goodput": -1.5,
            "env.A": "=cmd|' /C calc'!A0",
            "env.B": "+1",
            "env.C": "@SUM(1+1)*cmd|' /C calc'!A0",
            "env.D": "-2+3",
            "env.E": "\tx",
            "env.F": "\rx",
            "engine.n": -5,
            "env.G": "plain=value",
            "reason": "",
        }
    ]
    path = write_results_csv(rows, tmp_path / "results.csv")
    back = next(csv.DictReader(path.open(newline="")))
    assert back["env.A"] == "'=cmd|' /C calc'!A0" and back["env.B"] == "'+1"
    assert back["env.C"].startswith("'@SUM") and back["env.D"] == "'-2+3"
    assert back["env.E"] == "'\tx" and back["env.F"] == "'\rx"
    assert back["goodput"] == "-1.5" and back["engine.n"] == "-5" and back["trial"] == "0"
    assert back["env.G"] == "plain=value" and back["reason"] == ""


@pytest.mark.parametrize(
    "traffic, cluster, field",
    [
        ("{rates: [1], prompt_len: 64, output_len: 0}", "", "workload.traffic.output_len"),
        ("{rates: [1], prompt_len: -5, output_len: 16}", "", "workload.traffic.prompt_len"),
        ("{rates: [1], prompt_len: 64, output_len: true}", "", "workload.traffic.output_len"),
        (
            "{rates: [1], prompt_len: 64, output_len: 16}",
            ", cost_per_device_hour: .inf",
            "cluster.cost_per_device_hour",
        ),
    ],
)
def test_fuzzed_serving_lengths_and_costs_are_refused(write_spec, traffic, cluster, field):
    """The serving fuzzer's two findings: a plain length <= 0 or a YAML boolean (plan then ranked with
    max_model_len 27 and printed NaN costs), and an infinite device-hour cost (Infinity in plan --json)."""
    from typer.testing import CliRunner

    from autotune.cli.commands import app

    spec = write_spec(
        f"""
name: r
model: tiny-llama
workload:
  kind: serve
  traffic: {traffic}
  slo: {{ttft_p99_ms: 1000}}
cluster: {{accelerator: cpu, profile: cpu, devices_per_node: 1{cluster}}}
target: none
"""
    )
    result = CliRunner().invoke(app, ["validate", str(spec)])
    assert result.exit_code == 2 and field in result.output, result.output
