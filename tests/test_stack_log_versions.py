"""The stack log readers against each stack version's own lines (issue #30).

One golden log per version (tests/fixtures/stack_logs/, each naming the source files and the
commit whose format strings built it): Megatron-LM core_r0.8.0, core_v0.12.0 and main,
MindSpeed-LLM 2.0.0 and 2.3.0, torchtitan v0.2.2 and main, DeepSpeed 0.19.5, with the version's
NaN behaviour beside them where it differs. Each is read for its metrics (warm-up and skipped
iterations left out) and each NaN ends as ``nan``, never ``crash``, ``invalid`` or ``ok``."""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import pytest

from autotune.workers.command import run_probe_process
from autotune.workers.stack_logs import stack_log

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "stack_logs"


def _lines(name: str) -> list[str]:
    return [line for line in (GOLDEN / name).read_text().splitlines() if not line.startswith("#")]


def _read(name: str, kind: str, lines: list[str] | None = None, **options):
    reader = stack_log({"kind": kind, "warmup": 1, **options})
    steps = [e for line in (lines if lines is not None else _lines(name)) for e in reader.parse(line)]
    return reader, steps


def _replay(tmp_path: Path, name: str, kind: str, rc: int = 0, **options):
    """The golden log printed by a process that exits ``rc``, read through the command runner."""
    script = tmp_path / "replay.py"
    script.write_text(f"import sys\nsys.stdout.write(''.join(l + '\\n' for l in {_lines(name)!r}))\nsys.exit({rc})\n")
    reader = stack_log({"kind": kind, "warmup": 1, **options})
    return run_probe_process(
        [sys.executable, str(script)], {}, tmp_path / "t.json", 30, watchdog=False, log_reader=reader
    )


MEGATRON_LOGS = {  # golden log: (kind, the iterations' true times in ms, as its header says)
    "megatron.log": ("megatron", [19138.8, 13105.3, 13098.7, 13112.4, 13101.0]),
    "megatron_core_r0.8.log": ("megatron", [1623.4, 1101.5, 1098.2, 1102.9, 1100.1]),
    "megatron_core_r0.12.log": ("megatron", [1598.7, 1087.3, 1090.1, 1088.4, 1089.9]),
    "mindspeed_2.0.0.log": ("mindspeed", [4821.6, 2318.4, 2320.9, 2316.2, 2319.5]),
    "mindspeed_2.3.0.log": ("mindspeed", [4821.6, 2318.4, 2320.9, 2316.2, 2319.5]),
}
ALL_LOGS = sorted(p.name for p in GOLDEN.glob("*.log"))


# ------------------------------------------------------------------------------------ provenance
@pytest.mark.parametrize("name", ALL_LOGS)
def test_each_golden_log_names_its_source_files_and_commit(name):
    header = "\n".join(line for line in (GOLDEN / name).read_text().splitlines() if line.startswith("#"))
    assert re.search(r"\b[0-9a-f]{40}\b", header), name
    assert re.search(r"\b[\w/]+\.py\b", header), name


def test_there_is_a_golden_log_for_each_version_and_its_nan():
    expected = {
        "megatron_core_r0.8.log",
        "megatron_core_r0.8_nan.log",
        "megatron_core_r0.12.log",
        "megatron_core_r0.12_nan.log",
        "megatron.log",
        "megatron_main_nan.log",
        "megatron_main_nan_validate.log",
        "megatron_main_fp16_skip.log",
        "mindspeed_2.0.0.log",
        "mindspeed_2.0.0_nan.log",
        "mindspeed_2.3.0.log",
        "mindspeed_2.3.0_nan.log",
        "torchtitan_0.2.2.log",
        "torchtitan_0.2.2_nan.log",
        "torchtitan.log",
        "torchtitan_main_nan.log",
        "deepspeed_0.19.5.log",
        "deepspeed_0.19.5_fp16_overflow.log",
    }
    assert expected <= set(ALL_LOGS)


# ------------------------------------------------------------------------- Megatron / MindSpeed
@pytest.mark.parametrize("name", sorted(MEGATRON_LOGS))
def test_megatron_versions_step_time_is_the_true_iteration_time(name):
    """The step time is the median of the iterations after warm-up as they really took, whichever
    way the version averages: main's iteration-2 line (the mean of iterations 1 and 2) is left out."""
    kind, true_ms = MEGATRON_LOGS[name]
    reader, steps = _read(name, kind, tokens_per_iteration=64 * 4096, devices=8)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    metrics = reader.metrics(steps)
    clean = true_ms[2:] if name == "megatron.log" else true_ms[1:]
    assert metrics["step_time_s"] == pytest.approx(statistics.median(clean) / 1000.0, abs=1e-4)
    assert metrics["measured_steps"] == len(clean)
    assert metrics["tokens_per_s_per_device"] == pytest.approx(64 * 4096 / metrics["step_time_s"] / 8)
    assert metrics["peak_memory_gib"] > 10 and metrics["peak_reserved_gib"] >= metrics["peak_memory_gib"]
    assert reader.verdict(steps) is None


def test_megatron_main_iteration_2_is_not_measured_as_it_averages_in_warm_up():
    """Megatron-LM main logs iteration 1 without resetting its interval timer (training_log's
    is_first_iteration): its iteration-2 line says 16122.1 ms, the mean of 19138.8 and 13105.3."""
    reader, steps = _read("megatron.log", "megatron")
    second = steps[1]
    assert second["step_time_s"] == pytest.approx(16.1221) and second["phase"] == "warmup"
    assert second["covers_from"] == 1
    assert reader.metrics(steps)["step_time_s"] == pytest.approx(13.1010)


def test_megatron_main_with_two_measured_iterations_measures_the_clean_one():
    """Warm-up 1 and 2 measured iterations (the issue's case): 1.604 s (iterations 1 and 2
    averaged) was recorded where the iteration took 1.101 s."""
    lines = [x for x in _lines("megatron_main_fp16_skip.log") if not re.search(r"iteration\s+[45]/", x)]
    reader, steps = _read("", "megatron", lines=lines)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[1]["step_time_s"] == pytest.approx(1.6041)
    metrics = reader.metrics(steps)
    assert metrics["step_time_s"] == pytest.approx(1.1008) and metrics["measured_steps"] == 1


@pytest.mark.parametrize(
    "name", ["megatron_core_r0.8.log", "megatron_core_r0.12.log", "mindspeed_2.0.0.log", "mindspeed_2.3.0.log"]
)
def test_versions_that_reset_the_timer_measure_from_iteration_2(name):
    reader, steps = _read(name, MEGATRON_LOGS[name][0])
    assert [s["phase"] for s in steps] == ["warmup", "measure", "measure", "measure", "measure"]
    assert "covers_from" not in steps[1]


def _relabel(lines: list[str], iterations: list[int]) -> list[str]:
    """The golden log's iteration lines renumbered (a run with another --log-interval)."""
    its = [x for x in lines if re.search(r"\biteration\s+\d+/", x)]
    return [re.sub(r"iteration\s+\d+/", f"iteration {i:8d}/", x) for x, i in zip(its, iterations)]


def test_megatron_log_interval_above_1_leaves_out_the_line_that_averages_in_warm_up():
    # main, --log-interval 2: iteration 1 (first iteration, no reset), then 2 (covering 1-2), 4, 6
    reader, steps = _read("", "megatron", lines=_relabel(_lines("megatron.log"), [1, 2, 4, 6]))
    assert [(s["step"], s["phase"]) for s in steps] == [(1, "warmup"), (2, "warmup"), (4, "measure"), (6, "measure")]
    # core_r0.8, --log-interval 2: the first line (iteration 2) covers iterations 1 and 2
    reader, steps = _read("", "megatron", lines=_relabel(_lines("megatron_core_r0.8.log"), [2, 4, 6]))
    assert [(s["step"], s["phase"]) for s in steps] == [(2, "warmup"), (4, "measure"), (6, "measure")]


def test_a_first_line_off_the_log_interval_grid_did_not_reset_the_timer():
    """A main between c40b6ea0 and 6cf285b2 logs the first iteration without resetting but with
    the old timestamp: a version that resets prints on multiples of --log-interval only."""
    lines = _relabel(_lines("megatron_core_r0.8.log"), [1, 3, 6, 9])
    reader, steps = _read("", "megatron", lines=lines)
    assert [(s["step"], s["phase"]) for s in steps] == [(1, "warmup"), (3, "warmup"), (6, "measure"), (9, "measure")]


def test_a_skipped_fp16_iteration_is_neither_the_trials_loss_nor_its_time():
    """Megatron main prints 'lm loss: 0.000000E+00' for an iteration fp16 loss scaling skipped
    (the mean over no advanced iteration); the skipped iteration did no optimizer step either."""
    reader, steps = _read("megatron_main_fp16_skip.log", "megatron")
    last = steps[-1]
    assert last["skipped"] is True and "loss" not in last
    metrics = reader.metrics(steps)
    assert metrics["loss"] == pytest.approx(9.55)  # not 0.0
    assert metrics["step_time_s"] == pytest.approx((1.1008 + 1.1010) / 2)  # 1.0524 (skipped) left out
    assert metrics["measured_steps"] == 2
    assert reader.verdict(steps) is None  # one skipped iteration is fp16 loss scaling at work, not a failure


def test_a_skipped_iteration_without_a_printed_loss_keeps_the_trials_loss():
    # up to core_v0.16 training_log prints no loss for a line that counts only skipped iterations
    lines = _lines("megatron_core_r0.8.log")
    last = re.sub(r" lm loss: [^|]*\| (loss scale: [^|]*\|) grad norm: [^|]*\|", r" \1", lines[-1])
    last = last.replace("number of skipped iterations:   0", "number of skipped iterations:   1")
    reader, steps = _read("", "megatron", lines=[*lines[:-1], last])
    metrics = reader.metrics(steps)
    assert metrics["loss"] == pytest.approx(9.8861) and metrics["measured_steps"] == 3


def test_every_measured_iteration_skipped_is_nan_not_a_crash(tmp_path):
    lines = []
    for line in _lines("megatron_core_r0.8.log"):
        if re.search(r"iteration\s+[2-5]/", line):
            line = re.sub(r" lm loss: [^|]*\|", "", line).replace(
                "number of skipped iterations:   0", "number of skipped iterations:   1"
            )
        lines.append(line)
    (tmp_path / "all_skipped.log").write_text("\n".join(lines) + "\n")
    script = tmp_path / "replay.py"
    script.write_text(f"import sys\nsys.stdout.write(open({str(tmp_path / 'all_skipped.log')!r}).read())\n")
    reader = stack_log({"kind": "megatron", "warmup": 1})
    result = run_probe_process(
        [sys.executable, str(script)], {}, tmp_path / "t.json", 30, watchdog=False, log_reader=reader
    )
    assert result.status == "nan" and "skipped every measured iteration" in result.reason


@pytest.mark.parametrize(
    "name, kind, rc",
    [
        ("megatron_core_r0.8_nan.log", "megatron", 1),  # AssertionError from pretrain_gpt.py
        ("mindspeed_2.0.0_nan.log", "mindspeed", 1),  # ValueError from MindSpeed-LLM's pretrain_gpt.py
        ("megatron_core_r0.12_nan.log", "megatron", 1),  # RuntimeError from the rerun state machine
        ("mindspeed_2.3.0_nan.log", "mindspeed", 1),
        ("megatron_main_nan.log", "megatron", 1),  # --rerun-mode disabled
        ("megatron_main_nan_validate.log", "megatron", 16),  # main's default: logged, rerun, exit 16
    ],
)
def test_megatron_nan_check_is_nan_not_crash(tmp_path, name, kind, rc):
    result = _replay(tmp_path, name, kind, rc)
    assert result.status == "nan", (result.status, result.reason)
    assert "found NaN in local forward loss calculation" in result.reason


def test_megatron_nan_assertion_is_not_a_validate_args_assertion():
    """core_r0.8's NaN check is an AssertionError too; an arguments.py line shortly before it
    (a warning of the argument checks, a NaN at the first iteration) does not make it invalid."""
    lines = [
        "/workspace/Megatron-LM/megatron/training/arguments.py:612: UserWarning: Disabling sequence parallelism",
        "  warnings.warn(",
        *_lines("megatron_core_r0.8_nan.log")[-4:],
    ]
    assert stack_log({"kind": "megatron"}).failure(lines)[0] == "nan"


def test_megatron_validate_args_is_still_invalid():
    lines = [
        '  File "/workspace/Megatron-LM/megatron/training/arguments.py", line 432, in validate_args',
        "    assert args.world_size % total_model_size == 0, (",
        "AssertionError: world size (8) is not divisible by total_model_size (total_model_size=3)",
    ]
    assert stack_log({"kind": "megatron"}).failure(lines)[0] == "invalid"


# ------------------------------------------------------------------------------------ torchtitan
def test_torchtitan_0_2_2_metrics():
    reader, steps = _read("torchtitan_0.2.2.log", "torchtitan", tokens_per_iteration=64 * 4096, devices=8)
    metrics = reader.metrics(steps)
    assert metrics["tokens_per_s_per_device"] == (4870 + 4871) / 2  # steps 2-5: 4,871 4,869 4,875 4,870
    assert metrics["peak_memory_gib"] == pytest.approx(38.47)
    assert metrics["loss"] == pytest.approx(10.40188)
    assert reader.verdict(steps) is None


def test_torchtitan_0_2_2_nan_loss_is_nan_not_ok(tmp_path):
    """torchtitan 0.2.2 logs 'loss:      nan  grad_norm:     nan' at full throughput and exits 0."""
    reader, steps = _read("torchtitan_0.2.2_nan.log", "torchtitan", tokens_per_iteration=64 * 4096, devices=8)
    assert len(steps) == 5 and all(s["loss"] != s["loss"] for s in steps[2:])  # the regex reads 'nan'
    result = _replay(tmp_path, "torchtitan_0.2.2_nan.log", "torchtitan", 0, tokens_per_iteration=64 * 4096, devices=8)
    assert result.status == "nan", (result.status, result.reason)
    assert "step 3" in result.reason


def test_torchtitan_main_non_finite_check_is_nan_not_crash(tmp_path):
    result = _replay(tmp_path, "torchtitan_main_nan.log", "torchtitan", 1, tokens_per_iteration=64 * 4096, devices=8)
    assert result.status == "nan", (result.status, result.reason)
    assert "not finite on at least one rank at step 3" in result.reason


def test_torchtitan_main_device_side_assertion_is_nan_too():
    # on CUDA, torch._assert_async's message is the kernel assertion's: the same words
    lines = [
        "trainer.py:950: block: [0,0,0], thread: [0,0,0] Assertion `Loss or gradient norm is not finite on at "
        "least one rank at step 3. Stopping training before the optimizer update.` failed.",
        "RuntimeError: CUDA error: device-side assert triggered",
    ]
    assert stack_log({"kind": "torchtitan"}).failure(lines)[0] == "nan"


# ------------------------------------------------------------------------------------- DeepSpeed
def test_deepspeed_0_19_5_metrics():
    reader, steps = _read("deepspeed_0.19.5.log", "deepspeed", samples_per_iteration=16, devices=8)
    assert [s["step"] for s in steps] == [3, 4, 5, 6]
    metrics = reader.metrics(steps)
    assert metrics["step_time_s"] == pytest.approx((0.3021 + 0.3032) / 2, abs=1e-5)
    assert metrics["peak_memory_gib"] == pytest.approx(3.49)
    assert reader.verdict(steps) is None


def test_deepspeed_0_19_5_fp16_overflow_at_every_step_is_nan(tmp_path):
    result = _replay(
        tmp_path, "deepspeed_0.19.5_fp16_overflow.log", "deepspeed", 0, samples_per_iteration=16, devices=8
    )
    assert result.status == "nan" and "fp16 loss scaling skipped" in result.reason


def test_deepspeed_a_skipped_step_is_not_timed():
    reader, steps = _read("deepspeed_0.19.5_fp16_one_skip.log", "deepspeed", samples_per_iteration=16, devices=8)
    assert [s.get("skipped", False) for s in steps] == [False, True, False, False]
    metrics = reader.metrics(steps)
    assert metrics["step_time_s"] == pytest.approx(0.3021, abs=1e-5)  # 0.2511 (no optimizer step) left out
    assert metrics["measured_steps"] == 3 and reader.verdict(steps) is None


def test_a_memory_report_joined_to_an_iteration_line_still_gives_the_peak():
    """Rank 0's memory report goes to another stream than the iteration line; read through one pipe
    the two can join without a newline. Both are read: the step and the peak (a loaded test run lost
    the peak of its first trial this way)."""
    lines = _lines("megatron.log")
    report = next(line for line in lines if "memory (MB)" in line)
    alone = [line for line in lines if "memory (MB)" not in line]  # the one report, on its own line
    first = next(i for i, line in enumerate(alone) if " iteration " in line)
    apart, apart_steps = _read("megatron.log", "megatron", alone[: first + 1] + [report] + alone[first + 1 :])
    joined = alone[:first] + [alone[first] + report] + alone[first + 1 :]
    together, together_steps = _read("megatron.log", "megatron", joined)
    assert len(together_steps) == len(apart_steps)
    peak = apart.metrics(apart_steps)["peak_memory_gib"]
    assert peak > 0 and together.metrics(together_steps).get("peak_memory_gib") == pytest.approx(peak)


def test_an_iteration_line_joined_after_a_memory_report_still_counts_its_step():
    """The other order: the memory report first, the iteration line joined to its end. The report's
    fields end where the iteration line begins; the step is read too (a loaded full-suite run counted
    2 measured steps of 3 through the Megatron preset this way: the iteration was cut off with the
    report's tail)."""
    lines = _lines("megatron.log")
    report = next(line for line in lines if "memory (MB)" in line)
    alone = [line for line in lines if "memory (MB)" not in line]
    first = next(i for i, line in enumerate(alone) if " iteration " in line)
    second = next(i for i, line in enumerate(alone) if " iteration " in line and i > first)
    apart, apart_steps = _read("megatron.log", "megatron", alone[:second] + [report] + alone[second:])
    joined = alone[:second] + [report + alone[second]] + alone[second + 1 :]
    together, together_steps = _read("megatron.log", "megatron", joined)
    assert len(together_steps) == len(apart_steps)
    assert together.metrics(together_steps)["measured_steps"] == apart.metrics(apart_steps)["measured_steps"]
    peak = apart.metrics(apart_steps)["peak_memory_gib"]
    assert peak > 0 and together.metrics(together_steps).get("peak_memory_gib") == pytest.approx(peak)
