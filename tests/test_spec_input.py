"""What a spec file may be, byte by byte (issue #31): duplicate keys, environment variable names
wherever they come from, encodings and special files, the values the simulator reads, and
characters that must not reach a terminal as they are. Each is an error naming the file (exit 2),
never an "internal error" (exit 70), a traceback, or a hang."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.spec.errors import SpecError
from autotune.spec.load import load_spec
from support import TINY_TRAIN

MAX_SPEC_BYTES = 1 << 20  # autotune.spec.load.MAX_SPEC_BYTES (test_the_size_limit_is_the_documented_one)

SPEC = textwrap.dedent(TINY_TRAIN).lstrip()  # line 1 is "name: tiny"


def cli(*args: str):
    """``autotune ARGS`` in-process. An exception that escapes the command is what ``main()``
    turns into exit 70 ("a bug in autotune"); it is reported as such here."""
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return 70, f"{type(result.exception).__name__}: {result.exception}\n{result.output}"
    return result.exit_code, result.output


def write(tmp_path: Path, text: str | bytes, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def refused(path: Path, *says: str, command: str = "validate") -> str:
    code, output = cli(command, str(path))
    assert code == 2, output
    assert "Traceback" not in output and "internal error" not in output, output
    assert path.name in output, output
    for text in says:
        assert text in output, output
    return output


def lines_of(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error ")]


# ------------------------------------------------------------------------ duplicate keys (#3)
def test_two_backend_keys_at_the_top_level_are_refused(tmp_path):
    path = write(tmp_path, SPEC + "backend: {kind: command, argv: [echo]}\n")
    second = SPEC.count("\n") + 1
    out = refused(path, f"spec.yaml:{second}: backend: duplicate key 'backend': already at line 5")
    assert len(lines_of(out)) == 1


@pytest.mark.parametrize(
    "old, new, where, line",
    [
        ("  tp: [1, 2]\n", "  tp: [1, 2]\n  tp: [2]\n", "space.tp", 8),  # depth 2, block style
        ("search: {n_trials: 6, seed: 1}", "search: {n_trials: 6, seed: 1, seed: 2}", "search.seed", 13),  # flow style
        (
            "objectives: [tokens_per_s_per_device]",
            "objectives:\n  - {metric: tokens_per_s_per_device, metric: ttft_ms}",
            "objectives[0].metric",
            13,
        ),  # in a list
        ("search: {n_trials: 6, seed: 1}", "search: {n_trials: 6, seed: 1, 'seed': 2}", "search.seed", 13),  # quoted
        (
            "cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2}",
            "cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2, overrides: {1: a, 0x1: b}}",
            "cluster.overrides.0x1",
            4,
        ),  # the same key once read: 1 == 0x1
    ],
)
def test_a_key_written_twice_at_any_depth_is_refused_with_its_line_and_path(tmp_path, old, new, where, line):
    assert old in SPEC
    out = refused(write(tmp_path, SPEC.replace(old, new)), f"spec.yaml:{line}: {where}: duplicate key")
    assert len(lines_of(out)) == 1


def test_a_second_merge_key_in_one_mapping_is_a_duplicate(tmp_path):
    text = SPEC.replace("search: {n_trials: 6, seed: 1}", "search:\n  <<: {n_trials: 6}\n  <<: {seed: 1}")
    refused(write(tmp_path, text), "search.<<: a second merge key '<<'", "<<: [*first, *second]")


def test_merge_keys_and_aliases_stay_allowed_and_a_written_key_overrides_a_merged_one(tmp_path):
    text = (
        SPEC.replace(
            "search: {n_trials: 6, seed: 1}",
            textwrap.dedent("""\
        search:
          <<: [{n_trials: 6, seed: 1, timeout_s: 30}, {seed: 3, parallel_trials: 2}]
          seed: 2"""),
        )
        .replace("tp: [1, 2]", "tp: &two [1, 2]")
        .replace("pp: [1, 2]", "pp: *two")
    )
    spec = load_spec(write(tmp_path, text))
    # the written key wins; of the merged ones, the first mapping in the list wins (YAML's merge rules)
    assert (spec.search.seed, spec.search.n_trials, spec.search.timeout_s, spec.search.parallel_trials) == (2, 6, 30, 2)
    assert spec.space.choices()["pp"] == [1, 2]


def test_an_error_in_a_merged_mapping_points_at_the_written_key(tmp_path):
    text = SPEC.replace("search: {n_trials: 6, seed: 1}", "search:\n  <<: {n_trials: 6, seed: 1}\n  seed: x")
    refused(write(tmp_path, text), "spec.yaml:15: search.seed:")  # line 14 is the merge


def test_a_structure_that_contains_itself_is_refused(tmp_path):
    refused(write(tmp_path, SPEC + "baseline: &a {x: *a}\n"), "contains itself")


# ----------------------------------------------------------------- environment variable names (#2)
INJECTIONS = ["X=1;touch PWNED;#", "$(touch PWNED2)", "`touch PWNED3`", "A B", "1X", "É", "X\u202eY", ""]


@pytest.mark.parametrize("name", INJECTIONS, ids=range(len(INJECTIONS)))
@pytest.mark.parametrize("where", ["baseline", "backend.env", "backend.secret_env", "space.env"])
def test_one_name_rule_for_every_env_name(tmp_path, monkeypatch, where, name):
    monkeypatch.chdir(tmp_path)
    quoted = '"' + name.replace("\u202e", "\\u202e") + '"'
    text = {
        "baseline": SPEC + f'baseline: {{"env.{quoted[1:-1]}": v}}\n',
        "backend.env": SPEC.replace("backend: simulate", f"backend: {{kind: simulate, env: {{{quoted}: v}}}}"),
        "backend.secret_env": SPEC.replace("backend: simulate", f"backend: {{kind: simulate, secret_env: [{quoted}]}}"),
        "space.env": SPEC.replace("  tp: [1, 2]\n", f"  tp: [1, 2]\n  env: {{{quoted}: [v]}}\n"),
    }[where]
    out = refused(write(tmp_path, text), "not an environment variable name", f": {where}")
    assert "\u202e" not in out
    assert not list(tmp_path.glob("PWNED*"))


def test_the_injection_examples_of_the_issue_are_spec_errors(tmp_path):
    text = SPEC + 'baseline: {"env.X=1;touch PWNED;#": v, "env.$(touch PWNED2)": w}\n'
    out = refused(
        write(tmp_path, text),
        "baseline.env.X=1;touch PWNED;#: not an environment variable name",
        "baseline.env.$(touch PWNED2): not an environment variable name",
    )
    assert len(lines_of(out)) == 2


def test_valid_env_names_everywhere_still_load(tmp_path):
    text = (
        SPEC.replace(
            "backend: simulate", "backend: {kind: simulate, env: {_A1: x, hf_token: y}, secret_env: [_A1]}"
        ).replace("  tp: [1, 2]\n", "  tp: [1, 2]\n  env: {lower_ok: [a, b]}\n")
        + "baseline: {env.OTHER: 1}\n"
    )
    spec = load_spec(write(tmp_path, text))
    assert spec.backend.env == {"_A1": "x", "hf_token": "y"} and spec.space.choices()["env.lower_ok"] == ["a", "b"]


@pytest.mark.parametrize("where", ["baseline", "backend.env", "space.env"])
def test_an_env_value_no_process_can_hold_is_refused(tmp_path, where):
    text = {
        "baseline": SPEC + 'baseline: {env.A: "a\\0b"}\n',
        "backend.env": SPEC.replace("backend: simulate", 'backend: {kind: simulate, env: {A: "a\\0b"}}'),
        "space.env": SPEC.replace("  tp: [1, 2]\n", '  tp: [1, 2]\n  env: {A: ["a\\0b"]}\n'),
    }[where]
    refused(write(tmp_path, text), "NUL character", f": {where}")


def test_a_baseline_env_value_is_a_scalar(tmp_path):
    refused(write(tmp_path, SPEC + "baseline: {env.A: [1, 2]}\n"), "baseline.env.A: an environment variable's value")


# -------------------------------------------------- values the simulator reads, at validate (#8)
NPU = SPEC.replace("accelerator: cpu", "accelerator: npu")


@pytest.mark.parametrize(
    "env, where",
    [
        ("MULTI_STREAM_MEMORY_REUSE: ['1', x]", "space.env.MULTI_STREAM_MEMORY_REUSE[1]"),
        ("MULTI_STREAM_MEMORY_REUSE: ['1.5']", "space.env.MULTI_STREAM_MEMORY_REUSE[0]"),
        ("HCCL_BUFFSIZE: [200, big]", "space.env.HCCL_BUFFSIZE[1]"),
        ("HCCL_BUFFSIZE: [.nan]", "space.env.HCCL_BUFFSIZE[0]"),
        ("HCCL_BUFFSIZE: [-5]", "space.env.HCCL_BUFFSIZE[0]"),
        ("PYTORCH_NPU_ALLOC_CONF: ['max_split_size_mb:lots']", "space.env.PYTORCH_NPU_ALLOC_CONF[0]"),
        (
            "PYTORCH_NPU_ALLOC_CONF: ['expandable_segments:True', 'garbage_collection_threshold:']",
            "space.env.PYTORCH_NPU_ALLOC_CONF[1]",
        ),
        ("PYTORCH_CUDA_ALLOC_CONF: ['expandable_segments:perhaps']", "space.env.PYTORCH_CUDA_ALLOC_CONF[0]"),
    ],
)
@pytest.mark.parametrize("command", ["validate", "plan"])
def test_env_values_the_model_reads_are_checked_at_validate(tmp_path, env, where, command):
    text = NPU.replace("  tp: [1, 2]\n", f"  tp: [1, 2]\n  env: {{{env}}}\n")
    out = refused(write(tmp_path, text), f"spec.yaml:8: {where}:", command=command)
    assert "invalid literal" not in out


def test_the_baseline_env_values_the_model_reads_are_checked(tmp_path):
    refused(
        write(tmp_path, NPU + "baseline: {env.MULTI_STREAM_MEMORY_REUSE: x}\n"),
        "baseline.env.MULTI_STREAM_MEMORY_REUSE: MULTI_STREAM_MEMORY_REUSE is one of 0, 1, 2",
        command="plan",
    )


def test_the_shipped_env_values_still_plan(tmp_path):
    text = NPU.replace(
        "  tp: [1, 2]\n",
        "  tp: [1, 2]\n  env:\n    MULTI_STREAM_MEMORY_REUSE: ['0', 1, '2']\n"
        "    HCCL_BUFFSIZE: [120, 200.5]\n    PYTORCH_NPU_ALLOC_CONF: ['expandable_segments:True', "
        "'max_split_size_mb:512,garbage_collection_threshold:0.8', '']\n",
    )
    code, output = cli("plan", str(write(tmp_path, text)), "--json")
    assert code in (0, 1), output


# ------------------------------------------------------------- encodings and special files (#7)
@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-16-le", "utf-16-be", "utf-32-le"])
def test_utf16_and_utf32_are_refused_with_the_way_to_convert(tmp_path, encoding):
    out = refused(
        write(tmp_path, SPEC.encode(encoding)),
        encoding.upper() if encoding in ("utf-16", "utf-32") else "not UTF-8",
        "iconv",
    )
    assert "UnicodeDecodeError" not in out


def test_latin1_and_binary_are_refused_with_the_line(tmp_path):
    text = SPEC + "description: café\n"
    refused(
        write(tmp_path, text.encode("latin-1")),
        f"spec.yaml:{text.count(chr(10))}: the spec is not UTF-8 text: byte 0xe9",
    )
    refused(write(tmp_path, bytes(range(256)) * 4), "not UTF-8 text")
    refused(write(tmp_path, b"\x89PNG\r\n\x1a\n" + os.urandom(64).replace(b"\0", b"")), "not UTF-8 text")


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    assert load_spec(write(tmp_path, b"\xef\xbb\xbf" + SPEC.encode())).name == "tiny"


def test_yaml_values_pyyaml_cannot_build_are_located_errors(tmp_path):
    for extra, says in [
        ("description: !!int abc", "cannot read the int value 'abc'"),
        ("description: !!float abc", "cannot read the float value"),
        ("description: 2001-02-30", "day is out of range"),
        ("description: !!python/object:os.system {}", "could not determine a constructor"),
        ("description: !custom x", "could not determine a constructor"),
    ]:
        refused(write(tmp_path, SPEC + extra + "\n"), f"spec.yaml:{SPEC.count(chr(10)) + 1}: invalid YAML", says)
    refused(write(tmp_path, SPEC.replace("seq_len: 128", "seq_len: " + "9" * 5000)), "spec.yaml:3: invalid YAML")


def test_the_size_limit_is_the_documented_one():
    from autotune.spec import load as spec

    assert spec.MAX_SPEC_BYTES == MAX_SPEC_BYTES and "1 MiB" in spec.__doc__


def test_a_spec_above_the_size_limit_is_refused(tmp_path):
    path = write(tmp_path, SPEC + "description: " + "x" * MAX_SPEC_BYTES + "\n")
    refused(path, "above the limit of 1,048,576 bytes")


def test_a_long_list_is_refused_for_its_size_not_called_an_alias_bomb(tmp_path):
    text = SPEC.replace("micro_batch_size: [1, 2, 4]", "micro_batch_size: [" + ", ".join(["1"] * 150_000) + "]")
    out = refused(write(tmp_path, text), "the YAML holds more than 100,000 values", "{low, high, step}")
    assert "alias" not in out


def test_special_spec_paths_are_refused_not_read(tmp_path):
    refused(tmp_path, "a directory")
    refused(tmp_path / "missing.yaml", "No such file")
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    refused(loop, "symbolic links")
    null = tmp_path / "null.yaml"
    null.symlink_to("/dev/null")
    refused(null, "a character device, not a regular file")


@pytest.mark.timeout(30)
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    refused(fifo, "a FIFO (named pipe), not a regular file")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/dev/zero").exists() or sys.platform != "linux", reason="no /dev/zero")
def test_dev_zero_is_refused_not_read(tmp_path):
    """In a child process whose memory is capped: reading /dev/zero to its end never ends."""
    import resource
    import subprocess

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "validate", "/dev/zero"],
        capture_output=True,
        text=True,
        timeout=50,
        preexec_fn=cap,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "/dev/zero: cannot read the spec: it is a character device" in proc.stderr


@pytest.mark.parametrize(
    "old, new, says",
    [
        ("model: tiny-llama", "model: " + "m" * 300, "too long for a file name"),
        ("model: tiny-llama", "model: " + "m/" * 3000, "too long for a path"),
        ("model: tiny-llama", "model: " + "m" * 300 + ".json", "too long for a file name"),
        ("cluster: {accelerator: cpu,", "cluster: {profile: " + "p" * 300 + ".yaml, accelerator: cpu,", "too long"),
        ("backend: simulate", "backend: {kind: torch, cwd: " + "c" * 300 + "}", "too long"),
    ],
)
def test_a_string_too_long_for_a_path_is_a_field_error(tmp_path, old, new, says):
    assert old in SPEC
    out = refused(write(tmp_path, SPEC.replace(old, new)), says)
    assert max(map(len, out.splitlines())) < 2000  # the value is quoted shortened, not in full


def test_a_config_json_the_reader_cannot_use_is_a_model_error(tmp_path):
    (tmp_path / "config.json").write_text('{"n_embd": {}, "model_type": "gpt2"}')
    refused(write(tmp_path, SPEC.replace("model: tiny-llama", "model: config.json")), "model: config.json file")
    (tmp_path / "config.json").write_bytes(b'{"model_type": "caf\xe9"}')
    refused(write(tmp_path, SPEC.replace("model: tiny-llama", "model: config.json")), "is not UTF-8")


# ------------------------------------------------------------- control and bidi characters (#13)
@pytest.mark.parametrize(
    "key, shown",
    [
        ('"\\u202etp"', "\\u202etp"),
        ('"\\x1b[31mtp"', "\\x1b[31mtp"),
        ('"t\\u200bp"', "t\\u200bp"),
        ('"a\\nb"', "a\\nb"),
        ('"\\u2066x\\u2069"', "\\u2066x\\u2069"),
    ],
)
def test_control_and_bidi_characters_in_a_field_path_are_escaped(tmp_path, key, shown):
    path = write(tmp_path, SPEC.replace("  tp: [1, 2]\n", f"  tp: [1, 2]\n  {key}: [1]\n"))
    out = refused(path, f"spec.yaml:8: space.{shown}: unknown field")
    assert all(line.isprintable() for line in out.splitlines()), out
    assert len(lines_of(out)) == 1


def test_escape_text_keeps_letters_and_escapes_the_invisible():
    from autotune.spec.errors import escape_text

    assert escape_text("naïve 🙂 tp") == "naïve 🙂 tp"
    assert (
        escape_text("a\u202eb\u2067c\x00d\x7fe\x85f\ud800g\u2028")
        == "a\\u202eb\\u2067c\\x00d\\x7fe\\x85f\\ud800g\\u2028"
    )


def test_a_problem_renders_on_one_line_whatever_its_text(tmp_path):
    """The message too: it may quote a value as it is (a path the spec names)."""
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, SPEC.replace("model: tiny-llama", 'model: "x\\u202e\\ny.json"')))
    rendered = [p.render(info.value.file) for p in info.value.problems]
    assert len(rendered) == 1 and rendered[0].isprintable(), rendered
    assert "config.json file" in rendered[0] and "x\\u202e\\ny.json" in rendered[0], rendered
