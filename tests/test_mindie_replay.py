"""MindIE through the serving probe, replayed: MindIE does not install here, so a fake
``mindieservice_daemon`` (tests/fixtures/fake_engine, ``--mindie``) reads the ``config.json`` the
``mindie`` preset renders, from ``$MIES_CONFIG_JSON_PATH`` as the daemon does, listens on its three
ports, and answers ``/metrics`` with a real MindIE page (tests/fixtures/mindie/metrics.txt, named
in that folder's README). What is checked is autotune's side: the launch form, the file's mode,
the ports, the health and metrics endpoints, and the MindIE metric names the probe reads."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from autotune.workers.command import run_probe_process
from autotune.workers.protocol import TrialRequest, write_trial_file
from support import REPO
from test_export_serving import MINDIE_CONFIGS, QWEN, engine_json

FAKE = REPO / "tests" / "fixtures" / "fake_engine" / "server.py"
MINDIE_METRICS = REPO / "tests" / "fixtures" / "mindie" / "metrics.txt"


def test_the_mindie_launch_runs_under_the_probe_with_mindies_config_ports_and_metrics(tmp_path, caplog):
    config = MINDIE_CONFIGS["2x-tp2-noplugins"]
    engine = engine_json("mindie", config, "npu", model=QWEN)
    for k, replica in enumerate(engine["replicas"]):  # the daemon's place taken by the fake, nothing else changed
        replica["argv"] = [sys.executable, str(FAKE), "--mindie", "--metrics-file", str(MINDIE_METRICS)]
        replica["argv"] += ["--config-echo", str(tmp_path / f"config{k}.json")]
        replica["env"]["ASCEND_RT_VISIBLE_DEVICES"] = ""  # no NPU here: the probe maps no devices
        replica["devices"] = []
    engine["startup_timeout_s"] = 30.0
    folder = tmp_path / "trial"
    workload = {
        "kind": "serve",
        "traffic": {
            "rates": [4.0],
            "arrival": "poisson",
            "burstiness": 1.0,
            "prompt_len": 16,
            "output_len": 4,
            "length_pairs": None,
            "shared_prefix": 0.0,
            "duration_s": 1.0,
            "warmup_requests": 1,
            "seed": 1,
        },
        "slo": {"ttft_p99_ms": 2000.0, "tpot_p99_ms": 500.0, "itl_p99_ms": None, "e2e_p99_ms": None},
        "batch_sweep": [],
        "max_model_len": 1280,
        "startup_timeout_s": 30.0,
        "timeout_s": 60.0,
    }
    request = TrialRequest(
        params=dict(config),
        model=dict(QWEN),
        workload=workload,
        cluster={"accelerator": "cpu", "devices_per_node": 8, "nodes": 1},
    )
    trial = write_trial_file(request, folder / "trial.json")
    (folder / "engine.json").write_text(json.dumps(engine))
    with caplog.at_level(logging.WARNING):
        result = run_probe_process(
            [sys.executable, "-m", "autotune.workers.serve_probe", "--engine", str(folder / "engine.json")],
            {},
            trial,
            90.0,
        )
    assert result.status == "ok", (result.reason, result.log_tail[-2000:])
    # the probe read MindIE's own names: npu_cache_usage_perc, num_preemptions_total
    assert 0 <= result.metrics["kv_cache_usage"] <= 1 and "preemptions" in result.metrics
    assert result.metrics["requests_failed"] == 0 and result.info["serving"]["replicas"] == 2
    # each daemon read a config.json with the trial's settings and distinct ports filled in
    configs = [json.loads((tmp_path / f"config{k}.json").read_text()) for k in range(2)]
    ports = [
        (c["ServerConfig"]["port"], c["ServerConfig"]["managementPort"], c["ServerConfig"]["metricsPort"])
        for c in configs
    ]
    assert all(isinstance(p, int) for triple in ports for p in triple) and len({p for t in ports for p in t}) == 6
    schedule = configs[0]["BackendConfig"]["ScheduleConfig"]
    assert schedule["maxBatchSize"] == config["max_num_seqs"]
    written = sorted(Path(folder).glob("replica*/config.json"))
    assert len(written) == 2 and all(p.stat().st_mode & 0o777 == 0o640 for p in written)
