"""The serving probe (workers/serve_probe) against a fake engine (tests/fixtures/fake_engine), run
as the driver runs it: ``run_probe_process`` with the probe's argv, a trial file, ``engine.json``
beside it. Each case checks the verdict and that no process the probe started is left: the fake
engine's pid and its grandchild's are dead, and the driver's own last-resort sweep found nothing
(the probe cleaned up by itself)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from support import REPO, read_pid, wait_dead

from autotune.objectives import serving
from autotune.stacks.vllm import METRICS_NAMES
from autotune.workers.command import run_probe_process
from autotune.workers.protocol import TrialRequest, write_trial_file
from autotune.workers.serve_probe import prom, traffic
from autotune.workers.serve_probe.rates import RateSearch

pytest.importorskip("prometheus_client")

FAKE = REPO / "tests" / "fixtures" / "fake_engine" / "server.py"
GOLDEN_METRICS = REPO / "tests" / "fixtures" / "fake_engine" / "vllm_metrics.prom"
PROBE = [sys.executable, "-m", "autotune.workers.serve_probe"]
KV_RULE = [
    "No available memory for the cache blocks|KV cache is needed, which is larger than the available",
    "oom",
    "not enough memory for the KV cache",
]
VLLM_NAMES = METRICS_NAMES  # what the vllm preset writes into engine.json


def _trial(
    tmp_path: Path,
    *,
    mode: str = "healthy",
    args: tuple = (),
    replicas: int = 1,
    rates: tuple = (4.0,),
    duration_s: float = 1.0,
    prompt_len=16,
    output_len=4,
    slo: dict | None = None,
    batch_sweep: tuple = (),
    warmup: int = 1,
    startup_timeout_s: float = 20.0,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    roles: tuple = (),
    **workload_fields,
) -> Path:
    """A trial folder: the trial file and an engine.json starting the fake engine (``roles``: each
    replica's role in a disaggregated deployment, "prefill" or "decode"; its own request log)."""
    folder = tmp_path / "trial"
    launches = []
    for k in range(replicas):
        argv = [sys.executable, str(FAKE), "--port", "{port}", "--mode", mode, *args]
        argv += ["--pid-file", str(tmp_path / f"engine{k}.pid")]
        launch = {"argv": argv, "env": {"FAKE_REPLICA": "{replica}"}, "devices": [], "files": {}}
        if roles:
            launch["role"] = roles[k]
            argv += ["--request-log", str(tmp_path / f"requests{k}.jsonl")]
        launches.append(launch)
    engine = {
        "engine": "fake",
        "replicas": launches,
        "files": {},
        "api": {
            "completions": "/v1/completions",
            "health": "/health",
            "metrics": "/metrics",
            "metrics_port": "port",
            "health_port": "port",
            "model": "autotune-model",
        },
        "metrics_names": VLLM_NAMES,
        "startup_failures": [KV_RULE],
        "prompt": "token_ids",
        "startup_timeout_s": startup_timeout_s,
        "version": "fake 0.1",
    }
    workload = {
        "kind": "serve",
        "traffic": {
            "rates": list(rates),
            "arrival": arrival,
            "burstiness": burstiness,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "length_pairs": None,
            "shared_prefix": 0.25,
            "duration_s": duration_s,
            "warmup_requests": warmup,
            "seed": 3,
        },
        "slo": slo or {"ttft_p99_ms": 2000.0, "tpot_p99_ms": 500.0, "itl_p99_ms": None, "e2e_p99_ms": None},
        "batch_sweep": list(batch_sweep),
        "max_model_len": 512,
        "startup_timeout_s": startup_timeout_s,
        "timeout_s": 120.0,
        **workload_fields,
    }
    request = TrialRequest(
        params={"tp": 1, "pp": 1, "replicas": replicas, "max_num_seqs": 8},
        model={"vocab_size": 512, "hidden_size": 128},
        workload=workload,
        cluster={"accelerator": "cpu", "devices_per_node": 2, "nodes": 1, "cost_per_device_hour": None},
    )
    path = write_trial_file(request, folder / "trial.json")
    (folder / "engine.json").write_text(json.dumps(engine))
    return path


def _run(trial: Path, caplog, timeout_s: float = 90.0):
    caplog.set_level(logging.WARNING, logger="autotune.workers.command")
    return run_probe_process(PROBE, {}, trial, timeout_s)


def _nothing_left(tmp_path: Path, caplog, pids: list[int] = ()) -> None:
    for pid_file in tmp_path.glob("*.pid"):
        pid = int(pid_file.read_text())
        assert wait_dead(pid, 10), f"{pid_file.name}: process {pid} is still running"
    for pid in pids:
        assert wait_dead(pid, 10), f"process {pid} is still running"
    swept = [r.getMessage() for r in caplog.records if "outside its process group" in r.getMessage()]
    assert not swept, f"the driver had to sweep what the probe left: {swept}"


def _records(trial: Path) -> list[dict]:
    return [json.loads(line) for line in (trial.parent / "requests.jsonl").read_text().splitlines()]


def _load_steps(result) -> list[dict]:
    return [s for s in result.steps if s.get("phase") == "load"]


# ---------------------------------------------------------------------- whole runs
def test_a_disaggregated_deployment_sends_each_request_to_a_prefill_server_first(tmp_path, caplog):
    """1 prefill + 1 decode server (issue 46): each request visits the prefill server (one token,
    not streamed, a remote decode asked for), then streams from the decode server with the
    kv_transfer_params the prefill answered; its TTFT holds the prefill's time; nothing is left."""
    trial = _trial(
        tmp_path, replicas=2, roles=("prefill", "decode"), args=("--ttft-ms", "40"), rates=(4.0,), duration_s=1.0
    )
    result = _run(trial, caplog)
    assert result.status == "ok", result.reason
    records = [r for r in _records(trial) if r["ok"]]
    assert records and all(r["prefill_replica"] == 0 and r["replica"] == 1 for r in records)
    assert all(r["prefill_ms"] >= 40 and r["ttft_ms"] >= r["prefill_ms"] + 40 for r in records)
    prefill = [json.loads(x) for x in (tmp_path / "requests0.jsonl").read_text().splitlines()]
    decode = [json.loads(x) for x in (tmp_path / "requests1.jsonl").read_text().splitlines()]
    assert len(prefill) == len(decode) >= len(records)
    assert all(e["stream"] is False and e["max_tokens"] == 1 for e in prefill)
    assert all(e["kv_transfer_params"]["do_remote_decode"] is True for e in prefill)
    port = prefill[0]["port"]
    assert all(e["stream"] is True and e["kv_transfer_params"]["remote_engine_id"] == f"fake-{port}" for e in decode)
    _nothing_left(tmp_path, caplog)


def test_healthy_run_reports_metrics_and_the_verdict_recomputes_from_the_records(tmp_path, caplog):
    # 429 and 912 requests: enough for every p99 to have an upper end (368), so "met" is decided
    log = tmp_path / "requests_seen.jsonl"
    trial = _trial(
        tmp_path,
        args=("--grandchild", str(tmp_path / "grandchild.pid"), "--request-log", str(log)),
        replicas=2,
        rates=(100.0, 200.0),
        duration_s=4.5,
        batch_sweep=(1, 2),
        warmup=2,
        output_len={"low": 3, "high": 6},
    )
    result = _run(trial, caplog)
    assert result.status == "ok", (result.reason, result.log_tail)
    m = result.metrics
    for name in (
        "goodput_rps",
        "goodput_rps_per_device",
        "max_rate_rps",
        "slo_attainment",
        "request_throughput_rps",
        "output_tokens_per_s",
        "output_tokens_per_s_per_device",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "tpot_p99_ms",
        "itl_p99_ms",
        "e2e_p99_ms",
        "kv_cache_usage",
        "preemptions",
        "requests_failed",
        "batch1_ttft_ms",
        "batch2_time_for_100_tokens_s",
        "batch2_output_tokens_per_s",
    ):
        assert name in m, name
    assert m["goodput_rps"] > 0 and m["max_rate_rps"] == 200.0 and m["requests_failed"] == 0
    assert m["goodput_rps_per_device"] == pytest.approx(m["goodput_rps"] / 2)
    assert 0 <= m["kv_cache_usage"] <= 1  # sampled: short requests may all fall between two samples
    # the top rung met: the maximum is at least 200 req/s (not searched beyond the ladder), no upper end
    assert m["max_rate_rps_ci_low"] == 200.0 and "max_rate_rps_ci_high" not in m
    assert m["goodput_rps_ci_low"] <= m["goodput_rps"] <= m["goodput_rps_ci_high"]

    serving_info = result.info["serving"]
    assert serving_info["engine"] == "fake 0.1" and serving_info["operating_rate"] == 200.0
    tried = [(s["rate"], s["purpose"], s["slo_verdict"]) for s in serving_info["rates"]]
    assert [s["rate"] for s in _load_steps(result)] == [s["rate"] for s in serving_info["rates"]]
    assert tried == [(100.0, "ladder", "met"), (200.0, "ladder", "met"), (200.0, "confirm", "met")]
    search = serving_info["search"]
    assert search["at_least"] and search["confirmed"] and search["bracket"] == [200.0, None]
    assert {s["phase"] for s in result.steps} >= {"warmup", "load", "batch"}

    # the verdict, recomputed from the stored records alone (each run's own: the repeat drew its own arrivals)
    records = _records(trial)
    load = [r for r in records if r["phase"] == "load"]
    assert {r["replica"] for r in load} == {0, 1}  # the balancer used both replicas
    recomputed = []
    for run, reported in enumerate(serving_info["rates"]):
        mine = [r for r in load if r["run"] == run]
        assert {r["rate"] for r in mine} == {reported["rate"]}
        again = serving.summarize_rate(mine, serving_info["slo"], reported["rate"], reported["duration_s"])
        assert {k: reported[k] for k in again} == again
        recomputed.append(again)
    arrivals = {run: [r["scheduled_s"] for r in load if r["run"] == run] for run in (1, 2)}
    assert arrivals[1] != arrivals[2]  # the repeat at 200 req/s is fresh traffic, not a replay
    # the metrics are the confirming run's (the last at the operating rate)
    expected = serving.metrics_at(recomputed[-1], True, recomputed, devices=2)
    assert {k: m[k] for k in expected} == expected
    assert {r["batch"] for r in records if r["phase"] == "batch"} == {1, 2}

    # what was sent: token ids, exactly the asked length
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(s["prompt_type"] == "token_ids" and s["ignore_eos"] is True and s["stream"] is True for s in seen)
    assert all(s["max_tokens"] == s["min_tokens"] for s in seen)
    assert all(r["output_tokens"] == r["asked_tokens"] for r in records)
    _nothing_left(tmp_path, caplog, [read_pid(tmp_path / "grandchild.pid")])


def test_open_loop_sends_at_the_planned_times_whatever_is_in_flight(tmp_path, caplog):
    # every request takes ~1 s; 10 req/s for 1 s: a closed loop would send one at a time
    trial = _trial(tmp_path, args=("--token-ms", "100"), rates=(10.0,), output_len=10, slo={"ttft_p99_ms": 5000.0})
    result = _run(trial, caplog)
    assert result.status == "ok", (result.reason, result.log_tail)
    # 10 requests cannot decide a p99, nor could 4x as many: no longer run; counted by its measured p99s
    # (under target), the rate is confirmed by a repeat (run 1)
    assert [(s["run"], s["purpose"], s["scale"]) for s in result.info["serving"]["rates"]] == [
        (0, "ladder", 1),
        (1, "confirm", 1),
    ]
    load = sorted((r for r in _records(trial) if r["phase"] == "load" and r["run"] == 0), key=lambda r: r["id"])
    planned = traffic.plan_rate(json.loads(trial.read_text())["workload"]["traffic"], 10.0, 512)
    assert [r["scheduled_s"] for r in load] == [round(p.at_s, 6) for p in planned]
    assert all(abs(r["sent_s"] - r["scheduled_s"]) < 0.25 for r in load), [
        (r["sent_s"], r["scheduled_s"]) for r in load
    ]
    assert result.info["serving"]["rates"][0]["send_lag_p99_ms"] < 250
    # the cores the engine's processes and the client used over the run, beside the host's
    run = result.info["serving"]["rates"][0]
    assert run["host_cpu_cores"] >= 1 and "generator_behind" not in run
    for used in (run["engine_cpu_cores"], run["client_cpu_cores"]):
        assert 0.0 <= used <= run["host_cpu_cores"] + 0.5
    assert 0.0 <= run["server_cpu_cores"] <= run["engine_cpu_cores"]  # the launched process is one of the engine's
    if sys.platform.startswith("linux"):  # how long the client's event loop waited for a core, a second
        assert 0.0 <= run["client_cpu_wait_share"] <= run["host_cpu_cores"]
    # the engine yields the host to the client: its group at the lowest priority, in the probe's session
    assert result.info["serving"]["engine_priority"]["niceness"] == 19
    in_flight = max(sum(1 for o in load if o["sent_s"] <= r["sent_s"] < o["sent_s"] + o["e2e_ms"] / 1000) for r in load)
    assert len(load) >= 5 and in_flight >= 4
    _nothing_left(tmp_path, caplog)


def test_slo_missed_at_every_rate_is_a_measurement(tmp_path, caplog):
    trial = _trial(tmp_path, rates=(1.0, 2.0, 4.0), slo={"ttft_p99_ms": 0.001, "tpot_p99_ms": 100.0})
    result = _run(trial, caplog)
    assert result.status == "ok", (result.reason, result.log_tail)
    assert [(s["rate"], s["slo_met"]) for s in _load_steps(result)] == [(2.0, False), (1.0, False)]
    m = result.metrics
    assert m["goodput_rps"] == 0 and m["max_rate_rps"] == 0 and m["slo_attainment"] == 0
    assert result.info["serving"]["operating_rate"] == 1.0 and m["ttft_p99_ms"] > 0
    _nothing_left(tmp_path, caplog)


def test_never_healthy_is_a_timeout_with_the_reason(tmp_path, caplog):
    trial = _trial(
        tmp_path,
        mode="never_healthy",
        args=("--grandchild", str(tmp_path / "grandchild.pid"), "--grandchild-setsid"),
        startup_timeout_s=2.0,
    )
    result = _run(trial, caplog)
    assert result.status == "timeout"
    assert "never became healthy within 2 s" in result.reason and "HTTP 503" in result.reason
    _nothing_left(tmp_path, caplog, [read_pid(tmp_path / "grandchild.pid")])


def test_engine_dying_under_load_is_a_crash_with_its_exit(tmp_path, caplog):
    trial = _trial(
        tmp_path,
        mode="die_after",
        args=("--after", "3", "--grandchild", str(tmp_path / "grandchild.pid")),
        rates=(8.0,),
    )
    result = _run(trial, caplog)
    assert result.status == "crash"
    assert "exited with status 3 during the load at 8 req/s" in result.reason
    assert "fake engine core died" in result.reason
    assert (trial.parent / "replica0" / "engine.log").exists()
    _nothing_left(tmp_path, caplog, [read_pid(tmp_path / "grandchild.pid")])


def test_kv_cache_refusal_at_startup_is_oom_in_the_engines_words(tmp_path, caplog):
    trial = _trial(tmp_path, mode="kv_refuse")
    result = _run(trial, caplog)
    assert result.status == "oom"
    assert result.reason.startswith("not enough memory for the KV cache: ValueError: To serve at least one request")
    assert "KV cache is needed, which is larger than the available KV cache memory" in result.reason
    assert "exited with status 1 before it was healthy" in result.reason
    assert result.feasible is False
    _nothing_left(tmp_path, caplog)


def test_requests_the_engine_rejects_are_a_crash_saying_so(tmp_path, caplog):
    trial = _trial(tmp_path, mode="reject", args=("--after", "1"), rates=(4.0,))
    result = _run(trial, caplog)
    assert result.status == "crash"
    assert "requests failed during the load at 4 req/s" in result.reason
    assert "HTTP 400: This model's maximum context length is 512 tokens" in result.reason
    assert _records(trial) and not any(r["ok"] for r in _records(trial))
    _nothing_left(tmp_path, caplog)


def test_the_drivers_deadline_stops_the_engines_and_their_children(tmp_path, caplog):
    trial = _trial(
        tmp_path,
        args=("--grandchild", str(tmp_path / "grandchild.pid"), "--grandchild-setsid", "--token-ms", "50"),
        rates=(4.0,),
        duration_s=30.0,
        output_len=20,
    )
    result = _run(trial, caplog, timeout_s=4.0)
    assert result.status == "timeout"
    _nothing_left(tmp_path, caplog, [read_pid(tmp_path / "grandchild.pid")])


def test_a_workload_it_cannot_drive_is_invalid_before_any_engine_starts(tmp_path, caplog):
    trial = _trial(tmp_path, rates=(4.0, 2.0))
    result = _run(trial, caplog)
    assert result.status == "invalid" and "strictly ascending" in result.reason
    assert not list(tmp_path.glob("*.pid"))


def test_metrics_replayed_from_a_real_vllm_page(tmp_path, caplog):
    trial = _trial(tmp_path, args=("--metrics-file", str(GOLDEN_METRICS)), rates=(2.0,))
    result = _run(trial, caplog)
    assert result.status == "ok", (result.reason, result.log_tail)
    golden = prom.parse_metrics(GOLDEN_METRICS.read_text(), VLLM_NAMES)
    assert result.metrics["kv_cache_usage"] == golden["kv_cache_usage"]
    assert result.metrics["preemptions"] == 0  # a replayed page never changes
    assert set(result.info["serving"]["metrics_read"]) == set(VLLM_NAMES)
    _nothing_left(tmp_path, caplog)


# ---------------------------------------------------------------------- the pieces
def test_prometheus_names_are_read_from_vllms_own_page():
    values = prom.parse_metrics(GOLDEN_METRICS.read_text(), VLLM_NAMES)
    assert values == {
        "kv_cache_usage": 0.2698412698412699,
        "preemptions": 0.0,
        "running": 8.0,
        "waiting": 4.0,
        "prefix_cache_queries": 1520.0,  # prompt tokens looked up in the prefix cache
        "prefix_cache_hits": 896.0,  # of them, served from it
    }
    # a renamed metric falls back to the next name; an unknown one is simply absent
    renamed = prom.parse_metrics(
        '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{engine="0"} 0.25\n'
        'vllm:gpu_cache_usage_perc{engine="1"} 0.5\n',
        VLLM_NAMES,
    )
    assert renamed == {"kv_cache_usage": 0.5}


def test_the_ladder_is_bisected_first_then_the_bracket_between_its_rungs():
    b = RateSearch([1, 2, 4, 8, 16, 32, 64])
    verdicts = {1: True, 2: True, 4: True, 8: True, 16: False, 32: False, 64: False}
    while (load := b.next()) is not None:
        b.report("met" if load.rate <= 8 else "missed")
    assert [t.rate for t in b.tried][:3] == [8, 32, 16] and all(verdicts[t.rate] == t.counted for t in b.tried[:3])
    assert b.max_rate == 8 and b.bracket[1] < 16 and b.width <= 0.05 and b.confirmed
    assert [t.purpose for t in b.tried][:3] == ["ladder"] * 3 and b.tried[-1].purpose == "confirm"
    with pytest.raises(ValueError, match="strictly ascending"):
        RateSearch([2, 1])


def test_arrivals_have_the_asked_rate_and_burstiness_and_are_seeded():
    import numpy as np

    poisson = traffic.arrival_times(50.0, 200.0, 1.0, traffic.rng_for(0, 50.0))
    bursty = traffic.arrival_times(50.0, 200.0, 0.25, traffic.rng_for(0, 50.0))
    assert len(poisson) == pytest.approx(10_000, rel=0.05) and len(bursty) == pytest.approx(10_000, rel=0.1)

    def cv(times):  # coefficient of variation of the gaps: 1 for Poisson, 1/sqrt(shape) for gamma
        return np.std(np.diff(times)) / np.mean(np.diff(times))

    assert cv(poisson) == pytest.approx(1.0, abs=0.05) and cv(bursty) == pytest.approx(2.0, abs=0.2)
    spec = {"rates": [3.0], "duration_s": 5.0, "prompt_len": {"low": 8, "high": 12}, "output_len": 4}
    spec |= {"shared_prefix": 0.5, "seed": 1}
    a, b = traffic.plan_rate(spec, 3.0, 512), traffic.plan_rate(spec, 3.0, 512)
    assert [(p.at_s, p.prompt) for p in a] == [(p.at_s, p.prompt) for p in b]
    assert all(8 <= p.prompt_len <= 12 and len(p.prompt) == p.prompt_len for p in a)
    shared = min(round(0.5 * p.prompt_len) for p in a)
    assert len({tuple(p.prompt[:shared]) for p in a}) == 1


def test_serving_definitions():
    slo = {"ttft_p99_ms": 100.0, "tpot_p99_ms": 10.0}
    good = {"ok": True, "sent_s": 0.0, "output_tokens": 11, "ttft_ms": 50.0, "e2e_ms": 150.0, "itl_ms": [10.0] * 10}
    slow = dict(good, e2e_ms=300.0, itl_ms=[25.0] * 10)  # TPOT 25 ms
    one = dict(good, output_tokens=1, e2e_ms=50.0, itl_ms=[])  # no TPOT: meets the TPOT target
    failed = {"ok": False, "sent_s": 0.5, "output_tokens": 0, "ttft_ms": None, "e2e_ms": 10.0, "itl_ms": []}
    assert serving.request_tpot_ms(good) == 10.0 and serving.request_tpot_ms(one) is None
    assert serving.request_good(good, slo) and not serving.request_good(slow, slo) and serving.request_good(one, slo)
    assert not serving.request_good(failed, slo)
    s = serving.summarize_rate([good, slow, one], slo, 1.0, 0.2)  # the last response ends after the window
    # goodput: the offered rate x the good share, whatever the window; the traffic: per second of the window
    assert s["good"] == 2 and s["window_s"] == 0.3 and s["goodput_rps"] == pytest.approx(2 / 3, rel=1e-5)
    assert s["request_throughput_rps"] == pytest.approx(3 / 0.3, rel=1e-6)
    assert serving.summarize_rate([good, slow, one], slo, 1.0, 4.0)["request_throughput_rps"] == 0.75
    # 18 arrivals of a Poisson 1.3 req/s in 8 s (10.4 expected), all good: 1.3 req/s, not 18 / 8
    lucky = serving.summarize_rate([good] * 18, slo, 1.3, 8.0)
    assert lucky["goodput_rps"] == pytest.approx(1.3) and lucky["request_throughput_rps"] == pytest.approx(18 / 8)
    assert s["slo_met"] is False  # p99 TPOT 24.7 ms > 10 ms
    assert serving.summarize_rate([good, good], slo, 1.0, 1.0)["slo_met"] is True
    assert serving.summarize_rate([good, failed], slo, 1.0, 1.0)["slo_met"] is False  # a failed request
    low = dict(serving.summarize_rate([good], slo, 1.0, 1.0))
    high = dict(serving.summarize_rate([slow], slo, 2.0, 1.0))
    assert serving.operating_point([low, high])[0]["rate"] == 1.0
    assert serving.serving_metrics([high], 2)["goodput_rps"] == 0.0
    assert serving.cost_per_million_output_tokens(2.0, 4, 1000.0) == pytest.approx(8.0 / 3.6)
    assert serving.percentile([], 99) is None


def test_placeholders_ports_and_devices_of_each_replica(tmp_path, monkeypatch):
    from autotune.workers.serve_probe.engine import Engines

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    launch = {
        "argv": ["engine", "--port", "{port}", "--metrics", "{metrics_port}", "--dir", "{replica_dir}"],
        "env": {"CUDA_VISIBLE_DEVICES": "{devices}", "R": "{replica}"},
        "files": {"config.json": '{"port": {port}, "mgmt": {management_port}, "model": "{trial_dir}/model"}'},
    }
    spec = {
        "replicas": [dict(launch, devices=[0, 1]), dict(launch, devices=[2, 3])],
        "files": {"model/config.json": '{"path": "{trial_dir}"}'},
        "api": {"metrics_port": "metrics_port"},
    }
    engines = Engines(spec, tmp_path, {"accelerator": "cuda"}, {"X": "1"})
    first, second = engines.replicas
    assert first.env == {"CUDA_VISIBLE_DEVICES": "4,5", "R": "0"} and second.env["CUDA_VISIBLE_DEVICES"] == "6,7"
    ports = [p for r in engines.replicas for p in r.ports.values()]
    assert len(set(ports)) == 6
    assert first.argv[2] == str(first.ports["port"]) and second.argv[6] == str(tmp_path / "replica1")
    assert json.loads(first.files["config.json"]) == {
        "port": first.ports["port"],
        "mgmt": first.ports["management_port"],
        "model": f"{tmp_path}/model",
    }
    assert engines.url(second, "metrics") == f"http://127.0.0.1:{second.ports['metrics_port']}/metrics"
    assert engines.url(second, "health") == f"http://127.0.0.1:{second.ports['port']}/health"
    bad = dict(spec, replicas=[dict(launch, devices=[4])])
    with pytest.raises(Exception, match="wants devices"):
        Engines(bad, tmp_path, {"accelerator": "cuda"}, {})


def test_connections_dropped_under_load_are_a_measurement_but_engine_errors_end_the_trial():
    """Under open-loop overload a live engine that drops a few connections has missed the SLO at
    that rate (a failed request is never good); an HTTP error, or every request failing, ends it."""
    from types import SimpleNamespace

    from autotune.workers.serve_probe.failure import ProbeFailure
    from autotune.workers.serve_probe.probe import Run

    alive = SimpleNamespace(_check_engines=lambda when: None)
    ok = {"ok": True, "replica": 0, "error": None, "error_kind": None}
    dropped = {"ok": False, "replica": 0, "error": "ServerDisconnectedError", "error_kind": "connection"}
    rejected = {"ok": False, "replica": 0, "error": "HTTP 400: too long", "error_kind": "http"}
    Run._fail_on_errors(alive, [ok, ok, dropped], "the load at 16 req/s", overload=True)  # a measurement
    for records, overload in (([ok, dropped], False), ([dropped, dropped], True), ([ok, rejected], True)):
        with pytest.raises(ProbeFailure) as info:
            Run._fail_on_errors(alive, records, "the load at 16 req/s", overload=overload)
        assert info.value.status == "crash"
    assert (
        serving.summarize_rate(
            [
                {
                    **ok,
                    "rate": 1.0,
                    "phase": "load",
                    "sent_s": 0.0,
                    "ttft_ms": 1.0,
                    "e2e_ms": 2.0,
                    "itl_ms": [],
                    "output_tokens": 1,
                },
                dropped,
            ],
            {"ttft_p99_ms": 100.0},
            1.0,
            1.0,
        )["slo_met"]
        is False
    )


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="POSIX priorities")
def test_a_replica_yields_the_host_to_the_client_and_what_it_forks_later_does_too(tmp_path):
    from autotune.workers.serve_probe.engine import ENGINE_NICENESS, Replica

    script = (
        "import os, sys, time\n"
        "time.sleep(0.5)\n"  # forks after the probe lowered its priority, as vLLM's workers do
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(pid))\n"
        "time.sleep(30)\n"
    )
    own = os.getpriority(os.PRIO_PROCESS, 0)
    replica = Replica(0, [sys.executable, "-c", script], {}, tmp_path / "replica0", {})
    replica.start(os.environ, "test-marker")
    leader = replica.proc
    try:
        assert replica.priority == {"niceness": ENGINE_NICENESS} and ENGINE_NICENESS == 19
        assert os.getpriority(os.PRIO_PROCESS, leader.pid) == 19
        # a group of its own to kill, in the probe's session: one scheduling group with the client
        assert os.getpgid(leader.pid) == leader.pid != os.getpgid(0)
        assert os.getsid(leader.pid) == os.getsid(0)
        pid_file = tmp_path / "child.pid"
        deadline = time.monotonic() + 20
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and leader.poll() is None
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert os.getpriority(os.PRIO_PROCESS, child) == 19 and os.getpgid(child) == leader.pid
        assert os.getpriority(os.PRIO_PROCESS, 0) == own  # the probe (the client) keeps its own
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_the_engines_priority_names_every_replica_that_kept_its_own():
    """The trial's ``engine_priority`` speaks for every replica, not the first one only."""
    from types import SimpleNamespace

    from autotune.workers.serve_probe.engine import Engines

    def replica(index, priority, started=True):
        return SimpleNamespace(index=index, priority=priority, proc=object() if started else None)

    fine = [replica(0, {"niceness": 19}), replica(1, {"niceness": 19})]
    assert Engines.priority(SimpleNamespace(replicas=fine)) == {"niceness": 19}
    one_kept = [*fine, replica(2, {"priority_note": "niceness not set: denied"})]
    assert Engines.priority(SimpleNamespace(replicas=one_kept)) == {
        "priority_note": "replica 2: niceness not set: denied"
    }
    assert Engines.priority(SimpleNamespace(replicas=[replica(0, {}, started=False)])) == {}
