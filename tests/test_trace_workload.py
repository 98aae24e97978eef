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
        (
            ['{"timestamp": 0, "input_length": 10}'],
            "line 1, record 1: expected prompt_len and output_len (or Mooncake's",
        ),
        (['{"timestamp": 0, "input_length": 10}'], "the object has no output_length"),
        (['{"arrival_s": 0, "output_len": 2}'], "the object has no prompt_len"),
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


# ---------------------------------------------------------------------------------- shared prefixes (hash_ids)
MULTITURN = REPO / "search_spaces" / "traces" / "synthetic_multiturn_trace.jsonl"


def test_a_requests_reuse_is_the_leading_run_of_its_blocks_sent_before():
    from autotune.workers.trace_prefix import reuse_share, reused_tokens

    blocks = [[0, 1], [0, 2, 3], [0, 2, 4, 5], [6], [0, 7, 2]]
    prompts = [1000, 1500, 1800, 300, 1400]
    # the 2nd reuses block 0; the 3rd blocks 0 and 2; the 4th nothing; the 5th only 0 (7 breaks the run)
    assert reused_tokens(blocks, prompts, 512) == [0, 512, 1024, 0, 512]
    assert reused_tokens([[0, 1], [0, 1]], [600, 600], 512) == [0, 600]  # never more than the prompt
    assert reuse_share(blocks, prompts, 512) == pytest.approx(2048 / 6000)
    # runs of one request reuse nothing; runs as long as the trace, what the trace does
    assert reuse_share(blocks, prompts, 512, window=1) == 0.0
    assert reuse_share(blocks, prompts, 512, window=5) == pytest.approx(2048 / 6000)
    assert 0.0 < reuse_share(blocks, prompts, 512, window=3) < 2048 / 6000


def test_the_shipped_multiturn_trace_loads_its_prompts_blocks():
    traffic = _traffic(_spec({"lengths_file": str(MULTITURN), "arrival": "trace"}, REPO))
    rows = [json.loads(line) for line in MULTITURN.read_text().splitlines()]
    assert traffic["prefix_blocks"] == [r["hash_ids"] for r in rows]
    assert traffic["block_tokens"] == 512
    # a conversation's later turn names its earlier turn's complete blocks first
    later = next(i for i, r in enumerate(rows) if r["hash_ids"][0] in {b for s in rows[:i] for b in s["hash_ids"]})
    assert later > 0


@pytest.mark.parametrize(
    "lines, words",
    [
        (
            [
                '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}',
                '{"timestamp": 1, "input_length": 10, "output_length": 2}',
            ],
            "line 2, record 2: no hash_ids, which the first record gives",
        ),
        (
            ['{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0, true]}'],
            "hash_ids holds true, not an integer block id",
        ),
        (
            ['{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [-3]}'],
            "hash_ids holds -3, not a block id from 0",
        ),
        (['{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": "0,1"}'], "not a list of block ids"),
    ],
)
def test_bad_block_ids_are_refused_naming_the_line(tmp_path, lines, words):
    (tmp_path / "trace.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecError) as err:
        _spec({"lengths_file": "trace.jsonl"}, tmp_path)
    assert words in str(err.value), str(err.value)


def test_block_ids_in_a_csv_or_in_the_spec_are_refused(tmp_path):
    (tmp_path / "trace.csv").write_text('prompt_len,output_len,hash_ids\n10,2,"[0]"\n')
    with pytest.raises(SpecError) as err:
        _spec({"lengths_file": "trace.csv"}, tmp_path)
    assert "a CSV cell cannot hold" in str(err.value)
    with pytest.raises(SpecError) as err:
        _spec({"prompt_len": 10, "output_len": 2, "prefix_blocks": [[0]]}, tmp_path)
    assert "prefix_blocks is not a spec field" in str(err.value)


def test_the_probe_builds_each_prompt_from_its_blocks_so_turns_share_their_history():
    traffic = _traffic(_spec({"lengths_file": str(MULTITURN), "arrival": "trace", "duration_s": 600}, REPO))
    blocks, pairs = traffic["prefix_blocks"], traffic["length_pairs"]
    plan = plan_rate(traffic, 2.0, vocab_size=32000)
    by_row = {}
    for p in plan:
        row = pairs.index((p.prompt_len, p.output_len))
        by_row.setdefault(row, p.prompt)
    rows = sorted(by_row)
    shared = [(a, b) for a in rows for b in rows if a < b and blocks[a][0] == blocks[b][0]]
    assert shared  # two turns of one conversation in the plan
    for a, b in shared:
        run = 0
        while run < min(len(blocks[a]), len(blocks[b])) and blocks[a][run] == blocks[b][run]:
            run += 1
        n = min(run * 512, len(by_row[a]), len(by_row[b]))
        assert by_row[a][:n] == by_row[b][:n]  # their common blocks, token for token
        if run * 512 < min(len(by_row[a]), len(by_row[b])):
            assert by_row[a][run * 512 : run * 512 + 8] != by_row[b][run * 512 : run * 512 + 8]
    # the same traffic plans the same prompts in every trial (the block tokens from the seed and the id)
    assert [p.prompt for p in plan_rate(traffic, 2.0, vocab_size=32000)] == [p.prompt for p in plan]


def test_the_simulator_prices_the_reuse_a_prefix_cache_gets_from_the_traces_blocks():
    spec = _spec({"lengths_file": str(MULTITURN), "arrival": "trace", "rates": [2, 4, 8]}, REPO)
    workload = spec.workload.model_dump()  # its max_model_len holds the trace's longest prompt and output
    cluster = {"accelerator": "npu", "nodes": 1, "devices_per_node": 8}
    model = {"name": "llama2-7b", "arch": "llama", **PRESETS["llama2-7b"]}
    configs = {"tp": np.array([1, 1]), "enable_prefix_caching": np.array([True, False])}
    out = {}
    traffic = workload["traffic"]
    for name, t in (("blocks", traffic), ("no blocks", {**traffic, "prefix_blocks": None})):
        out[name] = simulate_configs(model, {**workload, "traffic": t}, resolve_hardware(cluster), cluster, configs)
        assert out[name]["valid"].all() and out[name]["fits"].all()
    cached, uncached = 0, 1
    # with the blocks, the cache skips the turns' history: a faster prefill than without them
    assert out["blocks"]["ttft_p50_ms"][cached] < 0.8 * out["no blocks"]["ttft_p50_ms"][cached]
    # without prefix caching the blocks change nothing
    assert out["blocks"]["ttft_p50_ms"][uncached] == pytest.approx(out["no blocks"]["ttft_p50_ms"][uncached])


@pytest.mark.slow  # ~25 s: two serving probes; the counters' parse and the window share are checked in CI
def test_the_probe_reports_the_prefix_cache_hits_the_engine_counted(tmp_path):
    """The serving probe reads vLLM's prefix-cache counters (here the fake engine's, counted as vLLM
    counts them: full 16-token blocks, chained) over each rate's load: replaying the multi-turn
    trace, a large share of the prompt tokens is served from the cache; random prompts, none."""
    import sys

    from autotune.stacks.vllm import METRICS_NAMES
    from autotune.workers.trace_prefix import reuse_share
    from autotune.workers.command import run_probe_process
    from autotune.workers.protocol import TrialRequest, write_trial_file

    fake = REPO / "tests" / "fixtures" / "fake_engine" / "server.py"
    spec = _spec({"lengths_file": str(MULTITURN), "arrival": "trace", "rates": [8], "duration_s": 4}, REPO)
    rates = {}
    for name, extra in (("trace", {}), ("random", {"prefix_blocks": None})):
        folder = tmp_path / name
        folder.mkdir()
        argv = [sys.executable, str(fake), "--port", "{port}", "--ttft-ms", "2", "--token-ms", "0.2"]
        engine = {
            "engine": "fake",
            "replicas": [{"argv": argv, "env": {}, "devices": [], "files": {}}],
            "api": {"metrics_port": "port", "health_port": "port", "model": "autotune-model"},
            "metrics_names": METRICS_NAMES,
            "prompt": "token_ids",
            "startup_timeout_s": 20,
        }
        (folder / "engine.json").write_text(json.dumps(engine))
        workload = spec.workload.model_dump()
        workload["traffic"] = {**workload["traffic"], "warmup_requests": 1, **extra}
        workload.update(timeout_s=120.0, batch_sweep=[])
        request = TrialRequest(
            params={"tp": 1, "replicas": 1, "max_num_seqs": 64},
            model={"vocab_size": 2048, "hidden_size": 128},
            workload=workload,
            cluster={"accelerator": "cpu", "nodes": 1, "devices_per_node": 1},
        )
        trial = write_trial_file(request, folder / "trial.json")
        result = run_probe_process([sys.executable, "-m", "autotune.workers.serve_probe", str(trial)], {}, trial, 120.0)
        assert result.status == "ok", (result.reason, result.log_tail)
        rates[name] = result.metrics.get("prefix_cache_hit_rate")
    assert rates["random"] is not None and rates["random"] < 0.02, rates
    # a run of 8 req/s x 4 s replays 32 consecutive requests: the turns of a conversation inside it
    # share their history, the conversations begun before it do not (the model's window share)
    traffic = spec.workload.model_dump()["traffic"]
    window = reuse_share(traffic["prefix_blocks"], [p for p, _ in traffic["length_pairs"]], 512, window=32)
    assert rates["trace"] is not None and rates["trace"] > 0.05, rates
    assert abs(rates["trace"] - window) < 0.1, (rates, window)
