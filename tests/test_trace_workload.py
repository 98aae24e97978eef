"""A serving workload replayed from a trace (issue 46, "workloads as teams see them"): Mooncake's
trace format or our columns read by the spec's loader, bad trace files refused naming the file, the
line and what was expected, the probe's plan replaying the trace's gaps at each rate, and the
simulator pricing its burstiness."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from autotune.spec.errors import SpecError
from autotune.spec.load import parse_spec
from autotune.workers.serve_probe.traffic import plan_rate
from autotune.workers.simulate import resolve_hardware, simulate_configs
from autotune.spec.models import PRESETS

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "search_spaces" / "traces" / "synthetic_chat_trace.jsonl"


def _spec(traffic: dict, base: Path):
    data = {
        "name": "trace",
        "model": "llama2-7b",
        "workload": {"kind": "serve", "traffic": {"rates": [1, 2, 4], **traffic}, "slo": {"ttft_p99_ms": 2000}},
        "cluster": {"accelerator": "npu", "nodes": 1, "devices_per_node": 8},
        "space": {"tp": [1, 2]},
        "objectives": [{"metric": "goodput_rps_per_device", "direction": "maximize"}],
    }
    return parse_spec(data, file=str(base / "spec.yaml"), base_dir=base)


def _traffic(spec) -> dict:
    return spec.workload.model_dump()["traffic"]


def test_the_shipped_trace_loads_with_its_arrival_times_in_seconds():
    traffic = _traffic(_spec({"lengths_file": str(TRACE), "arrival": "trace"}, REPO))
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()]
    assert len(traffic["length_pairs"]) == len(rows) == 400
    assert traffic["length_pairs"][2] == (rows[2]["input_length"], rows[2]["output_length"])
    assert traffic["arrival_times"][:3] == [0.0, 1.169, 1.176]  # Mooncake's timestamp is in ms
    assert traffic["arrival_times"] == sorted(traffic["arrival_times"])


@pytest.mark.parametrize(
    "lines, words",
    [
        (
            [
                '{"timestamp": 5, "input_length": 10, "output_length": 2}',
                '{"timestamp": 1, "input_length": 10, "output_length": 2}',
            ],
            "line 2, record 2: timestamp goes back in time",
        ),
        (
            ['{"arrival_s": 0, "prompt_len": 10, "output_len": 2}', '{"prompt_len": 10, "output_len": 2}'],
            "line 2, record 2: no arrival_s",
        ),
        (
            ['{"arrival_s": "soon", "prompt_len": 10, "output_len": 2}'],
            "line 1, record 1: arrival_s is 'soon', not a number",
        ),
        (['{"arrival_s": -1, "prompt_len": 10, "output_len": 2}'], "arrival_s is -1, below 0"),
        (['{"timestamp": 0, "timestamp": 1, "input_length": 10, "output_length": 2}'], "names timestamp twice"),
        (
            ['{"prompt_len": 10, "output_len": 2}', '{"prompt_len": 12, "output_len": 3}'],
            "arrival trace replays the arrival times of lengths_file",
        ),
    ],
)
def test_a_bad_trace_is_refused_naming_the_file_the_line_and_what_was_expected(tmp_path, lines, words):
    (tmp_path / "trace.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecError) as err:
        _spec({"lengths_file": "trace.jsonl", "arrival": "trace"}, tmp_path)
    text = str(err.value)
    assert words in text, text
    assert "workload.traffic" in text


def test_arrival_times_are_the_loaders_never_the_specs(tmp_path):
    with pytest.raises(SpecError) as err:
        _spec({"prompt_len": 10, "output_len": 2, "arrival_times": [0, 1]}, tmp_path)
    assert "arrival_times is not a spec field" in str(err.value)


def test_a_csv_trace_with_our_columns_replays_too(tmp_path):
    (tmp_path / "trace.csv").write_text("arrival_s,prompt_len,output_len\n0,100,10\n0.5,200,20\n2.5,300,30\n")
    traffic = _traffic(_spec({"lengths_file": "trace.csv", "arrival": "trace"}, tmp_path))
    assert traffic["arrival_times"] == [0.0, 0.5, 2.5] and traffic["length_pairs"][1] == (200, 20)


def test_the_probe_replays_the_traces_gaps_scaled_to_the_rate_with_its_own_lengths():
    traffic = _traffic(_spec({"lengths_file": str(TRACE), "arrival": "trace", "duration_s": 120}, REPO))
    plan = plan_rate(traffic, 4.0, vocab_size=32000)
    gaps = np.diff([p.at_s for p in plan])
    assert 0.6 * 480 < len(plan) < 1.4 * 480  # 4 req/s for 120 s, as bursty as the trace
    assert gaps.var() / gaps.mean() ** 2 > 2.5  # the trace's bursts kept (Poisson: 1)
    pairs = traffic["length_pairs"]
    first = pairs.index((plan[0].prompt_len, plan[0].output_len))
    assert [(p.prompt_len, p.output_len) for p in plan[1:4]] == pairs[first + 1 : first + 4]
    poisson = plan_rate({**traffic, "arrival": "poisson"}, 4.0, vocab_size=32000)
    poisson_gaps = np.diff([p.at_s for p in poisson])
    assert poisson_gaps.var() / poisson_gaps.mean() ** 2 < 1.5
    again = plan_rate(traffic, 4.0, vocab_size=32000, salt=1)  # a rate's later run starts elsewhere in the trace
    assert [p.at_s for p in again[:5]] != [p.at_s for p in plan[:5]]


def test_the_simulator_prices_the_traces_bursts():
    traffic = _traffic(_spec({"lengths_file": str(TRACE), "arrival": "trace", "rates": [4, 8, 12]}, REPO))
    cluster = {"accelerator": "npu", "nodes": 1, "devices_per_node": 8}
    model = {"name": "llama2-7b", "arch": "llama", **PRESETS["llama2-7b"]}
    out = {}
    for arrival in ("trace", "poisson"):
        workload = {"kind": "serve", "traffic": {**traffic, "arrival": arrival}, "slo": {"ttft_p99_ms": 2000}}
        out[arrival] = simulate_configs(model, workload, resolve_hardware(cluster), cluster, {"tp": np.array([1])})
    assert out["trace"]["ttft_p99_ms"][0] > out["poisson"]["ttft_p99_ms"][0]
