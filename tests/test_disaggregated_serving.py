"""Disaggregated prefill/decode serving (issue 46): the space's rules and canonical form, the
simulator's pricing of the two pools and the KV transfer beside aggregated engines, and the vllm
export's servers, KV transfer configs and proxy, read back by vLLM's own parser (``.venv-vllm``)
and by the proxies' options (tests/fixtures/vllm/disagg_proxies.py, from their sources)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from autotune.export import ExportContext
from autotune.export._vllm_disagg import placement
from autotune.finish.exports import EXPORTERS, write_exports
from autotune.finish.run_output import short
from autotune.spec.models import PRESETS
from autotune.spec.space import Space
from autotune.workers.parameters import trial_devices
from autotune.workers.simulate import resolve_hardware, simulate_configs, simulate_trial
from autotune.workers.protocol import TrialRequest
from support import VLLM_PYTHON, server_words, serving_config, vllm_parse, vllm_parse_on_tiny, vllm_stand_ins

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures" / "vllm"))
from disagg_proxies import parser as proxy_parser  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LLAMA2_70B = {"name": "llama2-70b", "arch": "llama", **PRESETS["llama2-70b"]}
CHAT = {
    "kind": "serve",
    "traffic": {
        "rates": [0.5, 1, 2, 3, 4, 6, 8],
        "prompt_len": {"low": 512, "high": 2048},
        "output_len": {"low": 128, "high": 512},
        "duration_s": 60,
    },
    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60},
    "max_model_len": 2560,
}
TWO_NODES_NPU = {"accelerator": "npu", "nodes": 2, "devices_per_node": 8}


def _simulate(configs: dict[str, list], workload: dict = CHAT, cluster: dict = TWO_NODES_NPU) -> dict:
    cols = {k: np.asarray(v) for k, v in configs.items()}
    return simulate_configs(LLAMA2_70B, workload, resolve_hardware(cluster), cluster, cols)


# ---------------------------------------------------------------------------------- the simulator
def test_a_decode_pool_has_no_prefill_interference_where_an_aggregated_engine_does():
    """Same decode instance (tp8, 256 sequences), same traffic: aggregated, its steps carry prompt
    chunks and its TPOT/ITL tails grow with the rate; disaggregated, its decode steps carry none."""
    out = _simulate({"tp": [8, 8], "replicas": [1, 1], "prefill_replicas": [0, 1], "prefill_tp": [0, 8]})
    assert out["valid"].all() and out["fits"].all()
    agg, dis = 0, 1
    assert out["itl_p99_ms"][dis] < 0.5 * out["itl_p99_ms"][agg]  # a prompt chunk's step is the aggregated ITL tail
    assert out["devices"].tolist() == [8, 16]
    # the aggregated one is stopped by TPOT, the disaggregated one by TTFT (its prefill pool's queue)
    assert out["slo_limit"][agg] == 2 and out["slo_limit"][dis] == 1
    assert out["max_rate_rps_model"][dis] > 2 * out["max_rate_rps_model"][agg]


def test_a_prefill_step_carries_the_prompts_that_arrived_during_the_step_before():
    """DistServe's worked example (a 13B model, one A100, 512-token prompts, whole prompts in a budget of
    16): at 5 prompts/s about 0.3 arrive during one prefill step, so a step carries one prompt and TTFT
    stays near its unloaded value. When a step carried the whole budget with probability lambda / mu,
    TTFT's p50 at 5 prompts/s was 4.2x the unloaded one (327 ms against 78), above a colocated engine's
    (94 ms) on the same GPU. Near capacity the steps fill up and the wait grows."""
    opt_13b = dict(
        arch="gpt",
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        intermediate_size=20480,
        vocab_size=50272,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    cluster = {"accelerator": "cuda", "nodes": 1, "devices_per_node": 8, "world_size": 8}
    hw = resolve_hardware({"accelerator": "cuda", "profile": "a100-sxm-80gb"})

    def ttft_p50(rate: float, prefill_replicas: int) -> float:
        work = {
            "kind": "serve",
            "traffic": {"rates": [rate], "prompt_len": 512, "output_len": 64, "duration_s": 600.0},
            "slo": {"ttft_p99_ms": 1e7},
            "max_model_len": 576,
        }
        cols = {
            "tp": np.array([1]),
            "enable_chunked_prefill": np.array([False]),
            "prefill_replicas": np.array([prefill_replicas]),
            "replicas": np.array([4 if prefill_replicas else 1]),
        }
        return float(simulate_configs(opt_13b, work, hw, cluster, cols)["ttft_p50_ms"][0])

    unloaded = ttft_p50(0.01, 1)
    assert ttft_p50(5.0, 1) < 1.5 * unloaded  # one prompt a step, little wait
    assert ttft_p50(5.0, 1) < 1.3 * ttft_p50(5.0, 0)  # a pool that only prefills is no slower than a colocated GPU
    assert ttft_p50(14.0, 1) > 2.5 * unloaded  # near its capacity (17 prompts/s) the queue builds


def test_the_prefill_pools_ttft_follows_a_discrete_event_run_of_its_scheduler(monkeypatch):
    """The pool's TTFT quantiles (the table, interpolated) against a fresh run of vLLM's scheduler for
    a prefill-only engine (every waiting prompt into the next step, up to the budget) with the same
    step times, another seed: within 8 % at p50 / p90 and 15 % at p99 up to 90 % of capacity, 20 % at p50 / p90 to 97 %.
    The fixed point it replaced put p90 at 2.5x the scheduler's at 58 % of capacity."""
    from autotune.workers.simulate import _serve
    from autotune.workers.simulate._prefill_queue import run_batch_queue

    seen: list[tuple] = []  # the aggregated engine's prompt stage reads the table first, the prefill pool last
    table = _serve.prefill_ttft

    def recorded(lam, t_one, t_max, n_max):
        seen.append((lam, t_one, t_max, n_max, table(lam, t_one, t_max, n_max)))
        return seen[-1][-1]

    monkeypatch.setattr(_serve, "prefill_ttft", recorded)
    workload = dict(CHAT, traffic={**CHAT["traffic"], "prompt_len": 1024, "output_len": 256})
    _simulate({"tp": [8], "prefill_replicas": [1], "replicas": [1]}, workload=workload)
    lam, t_one, t_max, n_max, got = seen[-1]  # the traffic's rates
    lam, t_one, t_max, n_max = (np.broadcast_to(x, lam.shape).ravel() for x in (lam, t_one, t_max, n_max))
    beta = 1.0 - (t_max - t_one) / (n_max - 1.0) / t_one
    rho = lam / (n_max / t_max)
    below = rho < 0.97  # beyond capacity the window's backlog decides, not the steady state
    assert rho.min() < 0.2 and 0.9 < rho[below].max() and n_max.min() > 2  # light load to near capacity, batching
    runs = run_batch_queue((lam * t_one)[below], beta[below], n_max[below], 60_000, seed=7)[:, 6_000:]
    near = rho[below] >= 0.9  # near capacity a run's figures rest on a few long excursions: its own spread
    for q, tol, tol_near in (("0.5", 0.08, 0.2), ("0.9", 0.08, 0.2), ("0.99", 0.15, None)):
        want, have = np.quantile(runs, float(q), axis=1) * t_one[below], got[q].ravel()[below]
        assert have[~near] == pytest.approx(want[~near], rel=tol), q
        if tol_near:
            assert have[near] == pytest.approx(want[near], rel=tol_near), q


def test_the_scheduler_run_with_one_prompt_a_step_is_pollaczek_khinchines_queue():
    """A budget of one prompt is an M/D/1 queue: the mean wait is rho S / (2 (1 - rho))."""
    from autotune.workers.simulate._prefill_queue import run_batch_queue

    rho = np.array([0.3, 0.6, 0.8])
    ttft = run_batch_queue(rho, np.full(3, 0.4), np.ones(3), 100_000, seed=1)[:, 10_000:]
    assert ttft.mean(axis=1) - 1.0 == pytest.approx(rho / (2.0 * (1.0 - rho)), rel=0.08)
    assert ttft.min() == pytest.approx(1.0)  # an arrival to an idle engine waits for nothing


def test_the_kv_transfer_is_priced_by_its_path():
    """The same deployment's TTFT: the KV cache through a file system is slower than over the links,
    and over the inter-node NICs than within a node (both pools on one node when they fit)."""
    cuda_one = {"accelerator": "cuda", "nodes": 1, "devices_per_node": 8}
    base = {"tp": [4, 4], "replicas": [1, 1], "prefill_replicas": [1, 1], "prefill_tp": [4, 4]}
    out = _simulate({**base, "kv_connector": ["nixl", "shared_storage"]}, cluster=cuda_one)
    assert out["fits"].all()
    assert out["ttft_p50_ms"][1] > out["ttft_p50_ms"][0] + 50  # ~0.5 GB per prompt at 2 GB/s
    cuda_two = {"accelerator": "cuda", "nodes": 2, "devices_per_node": 4}
    across = _simulate({**base, "kv_connector": ["nixl", "nixl"]}, cluster=cuda_two)
    assert across["ttft_p50_ms"][0] > out["ttft_p50_ms"][0]


def test_mindies_d2d_transfer_is_priced_on_the_npus_links_and_runs_only_there():
    base = {"tp": [4, 4], "replicas": [1, 1], "prefill_replicas": [1, 1], "prefill_tp": [8, 8]}
    out = _simulate({**base, "kv_connector": ["d2d", "mooncake"]})
    assert out["valid"].all() and out["fits"].all()
    assert out["ttft_p50_ms"][0] == pytest.approx(out["ttft_p50_ms"][1])  # RDMA over the devices' links, as Mooncake
    cuda = _simulate({**base, "kv_connector": ["d2d", "nixl"]}, cluster={**TWO_NODES_NPU, "accelerator": "cuda"})
    assert cuda["valid"].tolist() == [False, True]


def test_an_aggregated_config_is_priced_as_before_a_prefill_pool_existed():
    plain = _simulate({"tp": [4, 8], "replicas": [2, 1]})
    named = _simulate({"tp": [4, 8], "replicas": [2, 1], "prefill_replicas": [0, 0], "prefill_tp": [4, 8]})
    for key in ("goodput_rps", "ttft_p99_ms", "tpot_p99_ms", "max_rate_rps_model", "peak_memory_gib"):
        assert np.allclose(plain[key], named[key], equal_nan=True), key


def test_a_simulated_disaggregated_trial_says_its_pools_and_what_limits_it():
    config = {"tp": 8, "replicas": 1, "prefill_replicas": 1, "prefill_tp": 8, "kv_connector": "mooncake"}
    result = simulate_trial(TrialRequest(params=config, model=LLAMA2_70B, workload=CHAT, cluster=TWO_NODES_NPU))
    assert result.status == "ok", result.reason
    serving = result.info["serving"]
    assert serving["limited_by"] == "ttft"
    assert serving["deployment"] == {
        "kind": "disaggregated",
        "prefill": {"instances": 1, "tp": 8, "pp": 1},
        "decode": {"instances": 1, "tp": 8, "pp": 1},
        "kv_connector": "mooncake",
        "devices": 16,
    }
    assert trial_devices("serve", config) == 16


@pytest.mark.parametrize(
    "config, cluster, words",
    [
        ({"tp": 8, "prefill_replicas": 1, "kv_connector": "nixl"}, TWO_NODES_NPU, "kv_connector nixl runs on cuda"),
        (
            {"tp": 8, "prefill_replicas": 1, "prefill_tp": 4, "kv_connector": "mooncake"},
            TWO_NODES_NPU,
            "prefill_tp >= tp and pp = 1",
        ),
        ({"tp": 8, "replicas": 2, "prefill_replicas": 1}, TWO_NODES_NPU, "exceed the cluster's 16"),
        (  # 20 devices: two nodes and a half
            {"tp": 4, "pp": 5, "prefill_replicas": 1, "kv_connector": "nixl"},
            {"accelerator": "cuda", "nodes": 8, "devices_per_node": 8},
            "an instance wider than a node takes whole nodes",
        ),
        (  # 15 devices of 16, but three instances of 5 need three nodes of 8
            {"tp": 1, "pp": 5, "replicas": 2, "prefill_replicas": 1, "kv_connector": "nixl"},
            {"accelerator": "cuda", "nodes": 2, "devices_per_node": 8},
            "the pools' instances take more nodes than the cluster's 2",
        ),
        ({"tp": 1, "prefill_replicas": -1}, TWO_NODES_NPU, "prefill_replicas and prefill_tp must be integers >= 0"),
    ],
)
def test_a_disaggregated_layout_the_engines_cannot_launch_is_invalid_with_the_reason(config, cluster, words):
    result = simulate_trial(TrialRequest(params=config, model=LLAMA2_70B, workload=CHAT, cluster=cluster))
    assert result.status == "invalid"
    assert words in result.reason, result.reason


# ---------------------------------------------------------------------------------- the space
def _spec(space: dict, cluster: dict | None = None, target: str | None = None):
    from autotune.spec.load import parse_spec

    data = {
        "name": "disagg",
        "model": "llama2-70b",
        "workload": {k: v for k, v in CHAT.items() if k != "max_model_len"},
        "cluster": cluster or {"accelerator": "npu", "nodes": 2, "devices_per_node": 8},
        "space": space,
        "objectives": [{"metric": "goodput_rps_per_device", "direction": "maximize"}],
        "backend": "simulate",
    }
    if target:
        data["target"] = target
    return parse_spec(data)


def test_the_space_writes_a_disaggregated_config_whole_and_an_aggregated_one_without_a_pool():
    space = Space(_spec({"tp": [4, 8], "prefill_replicas": [0, 1], "prefill_tp": [0, 8]}))
    configs = space.enumerate().configs
    aggregated = [c for c in configs if c["prefill_replicas"] == 0]
    disaggregated = [c for c in configs if c["prefill_replicas"] == 1]
    # aggregated: no pool of its own (prefill_tp 0, connector auto) whatever the spec listed: one config per tp
    assert sorted(c["tp"] for c in aggregated) == [4, 8]
    assert {(c["prefill_tp"], c["kv_connector"]) for c in aggregated} == {(0, "auto")}
    # disaggregated: prefill_tp 0 resolved to tp, auto to the accelerator's connector; Mooncake on Ascend
    # needs prefill_tp >= tp (tp 8 with prefill_tp 4 is not in the space)
    assert sorted((c["tp"], c["prefill_tp"], c["kv_connector"]) for c in disaggregated) == [
        (4, 4, "mooncake"),
        (4, 8, "mooncake"),
        (8, 8, "mooncake"),
    ]
    assert {c["world_size"] for c in disaggregated} == {8, 12, 16}


def test_a_spec_without_a_prefill_pool_writes_its_configs_as_before():
    space = Space(_spec({"tp": [4, 8]}))
    assert all("prefill_replicas" not in c and "kv_connector" not in c for c in space.enumerate().configs)


def test_a_connector_listed_without_a_prefill_pool_makes_no_configs_that_differ_by_it_alone():
    configs = Space(_spec({"tp": [4, 8], "kv_connector": ["auto", "mooncake"]})).enumerate().configs
    assert sorted((c["tp"], c["prefill_replicas"], c["kv_connector"]) for c in configs) == [
        (4, 0, "auto"),
        (8, 0, "auto"),
    ]


def test_a_negative_prefill_pool_is_a_spec_error_naming_the_field():
    with pytest.raises(Exception) as err:
        _spec({"prefill_replicas": [-1, 1]})
    assert "prefill_replicas" in str(err.value) and ">= 0" in str(err.value)


def test_mindie_ranks_pd_separation_beside_aggregated_and_refuses_a_vllm_connector():
    # MindIE's PD separation (tests/test_mindie_pd_export.py: the export MindIE-Motor deploys)
    layouts = {"prefill_replicas": [0, 1], "tp": [4, 8], "prefill_tp": [4, 8], "kv_connector": ["auto", "nixl"]}
    # MindIE's prefix cache and SplitFuse do not take a Llama 2 (the mindie rules)
    space = Space(
        _spec({**layouts, "enable_prefix_caching": [False], "enable_chunked_prefill": [False]}, target="mindie")
    )
    enumeration = space.enumerate()
    assert {c["prefill_replicas"] for c in enumeration.configs} == {0, 1}
    # auto is MindIE's own transfer; MindIE-Motor assigns one-pod instances' roles itself: equal pools
    pd = [c for c in enumeration.configs if c["prefill_replicas"]]
    assert {c["kv_connector"] for c in pd} == {"d2d"}
    assert sorted((c["tp"], c["prefill_tp"]) for c in pd) == [(4, 4), (8, 8)]
    assert any("prefill_tp must equal tp" in reason for reason in enumeration.invalid_reasons)
    assert any("moves the KV cache itself" in reason for reason in enumeration.invalid_reasons)


@pytest.mark.parametrize("target", ["vllm", "none"])
def test_mindies_d2d_transfer_needs_target_mindie(target):
    space = {"prefill_replicas": [1], "tp": [4], "kv_connector": ["d2d"]}
    enumeration = Space(_spec(space, target=target)).enumerate()
    assert not enumeration.configs
    assert any("d2d is MindIE's own" in reason for reason in enumeration.invalid_reasons)


def test_the_layout_line_names_both_pools_and_the_connector():
    line = short({"tp": 4, "pp": 1, "replicas": 2, "prefill_replicas": 1, "prefill_tp": 8, "kv_connector": "mooncake"})
    assert line.startswith("prefill 1 x tp8 + decode 2 x tp4, KV by mooncake")


# ---------------------------------------------------------------------------------- the export
def _context(config: dict[str, Any], accelerator: str, nodes: int, per_node: int) -> ExportContext:
    return ExportContext(
        study="disagg",
        trial=3,
        config=dict(config),
        metrics={"goodput_rps_per_device": 0.13},
        source="simulated",
        model={"name": "llama2-70b", "arch": "llama", **PRESETS["llama2-70b"]},
        workload={**CHAT, "max_model_len": 2560},
        cluster={"accelerator": accelerator, "nodes": nodes, "devices_per_node": per_node},
        target="vllm",
    )


def _serving(**changes: Any) -> dict[str, Any]:
    layout = {"tp": 4, "pp": 1, "replicas": 2, "prefill_replicas": 1, "prefill_tp": 4, "kv_connector": "nixl"}
    return serving_config(**{**layout, **changes})


def _run(script: Path, tmp_path: Path, node: int, nodes: str) -> list[dict[str, Any]]:
    records = tmp_path / f"records{node}"
    records.mkdir()
    env = {
        **os.environ,
        "PATH": f"{vllm_stand_ins(tmp_path)}:{os.environ['PATH']}",
        "RECORD_DIR": str(records),
        "MODEL": "/ckpt/llama2-70b",
        "PORT": "9000",
        "NODE": str(node),
        "NODES": nodes,
        "PROXY": "/opt/proxy.py",
        "ASCEND_HOME": str(tmp_path / "no-ascend"),
    }
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=60, cwd=tmp_path)
    return [json.loads(p.read_text()) for p in records.glob("*.json")]


def _servers_and_proxy(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    proxy = [r for r in records if "/opt/proxy.py" in r["argv"]]
    servers = [r for r in records if "/opt/proxy.py" not in r["argv"]]
    return sorted(servers, key=lambda r: int(r["argv"][r["argv"].index("--port") + 1])), proxy


def test_servers_are_placed_first_fit_prefill_first_each_on_one_node():
    assert placement(_serving(), 8) == [
        ("prefill", 0, 0, 1, [0, 1, 2, 3]),
        ("decode", 0, 0, 1, [4, 5, 6, 7]),
        ("decode", 1, 1, 1, [0, 1, 2, 3]),
    ]


def test_an_instance_wider_than_a_node_takes_whole_nodes_of_its_own():
    every = list(range(8))
    assert placement(_serving(tp=16, replicas=2, prefill_tp=4), 8) == [
        ("prefill", 0, 0, 1, [0, 1, 2, 3]),
        ("decode", 0, 1, 2, every),  # not the rest of node 0
        ("decode", 1, 3, 2, every),
    ]


def test_the_nodes_a_layout_takes_are_its_placements_and_a_typo_is_bounded_not_placed():
    from autotune.workers.parameters import pd_nodes

    nodes = pd_nodes(
        np.array([1, 1, 2, 10**7]), np.array([4, 8, 4, 8]), np.array([2, 1, 1, 1]), np.array([4, 16, 16, 8]), 8
    )
    assert nodes.tolist()[:3] == [2, 3, 3]  # as placed: see the placements above
    assert nodes[3] == 10**7 + 1  # ten million prefill instances: their devices' nodes, without placing each


def test_a_decode_instance_across_nodes_is_priced_with_its_collectives_over_the_nics():
    """The same pools (prefill and decode tp16) on 8-NPU nodes (each instance over two of them, its
    tensor-parallel all-reduces over the NICs) and on 16-NPU nodes (within one): both valid, the first
    needs its four nodes and decodes slower."""
    config = {"tp": [16], "prefill_replicas": [1], "prefill_tp": [16]}
    across = _simulate(config, cluster={"accelerator": "npu", "nodes": 4, "devices_per_node": 8})
    within = _simulate(config, cluster={"accelerator": "npu", "nodes": 2, "devices_per_node": 16})
    assert across["valid"][0] and within["valid"][0]
    assert across["tpot_p50_ms"][0] > 1.1 * within["tpot_p50_ms"][0]
    assert across["capacity_rps"][0] < within["capacity_rps"][0]


@pytest.fixture(scope="module")
def deployments(tmp_path_factory) -> dict[str, Any]:
    """Three exported deployments run as their nodes would run them: 1 prefill + 2 decode NIXL
    servers on two 8-GPU nodes (both nodes), a Mooncake one on two Ascend nodes (node 0), a
    shared-storage 1P1D on one CPU node; with vLLM, its parse of every server's command line (one
    interpreter start for all)."""
    tmp = tmp_path_factory.mktemp("deployments")
    out: dict[str, Any] = {}
    ctx = _context(_serving(), "cuda", 2, 8)
    assert EXPORTERS["vllm"].unsupported(ctx) == []
    script = write_exports(ctx, tmp / "nixl", ["vllm"])["vllm"]
    out["nixl"] = [_servers_and_proxy(_run(script, tmp / "nixl", node, "gpu-a gpu-b")) for node in (0, 1)]
    ascend = _serving(tp=4, prefill_tp=8, replicas=1, kv_connector="auto", block_size=128)
    script = write_exports(_context(ascend, "npu", 2, 8), tmp / "npu", ["vllm"])["vllm"]
    out["npu"] = _servers_and_proxy(_run(script, tmp / "npu", 0, "npu-a npu-b"))
    cpu = _serving(tp=1, prefill_tp=1, replicas=1, kv_connector="shared_storage", block_size=128)
    script = write_exports(_context(cpu, "cpu", 1, 2), tmp / "cpu", ["vllm"])["vllm"]
    out["cpu"] = _servers_and_proxy(_run(script, tmp / "cpu", 0, "localhost"))
    servers = {"nixl": out["nixl"][0][0] + out["nixl"][1][0], "npu": out["npu"][0], "cpu": out["cpu"][0]}
    out["parsed"] = {}
    if VLLM_PYTHON.exists():
        cases = [(name, server_words(r)) for name, records in servers.items() for r in records]
        parsed = vllm_parse([words for _, words in cases])
        for (name, _), result in zip(cases, parsed, strict=True):
            out["parsed"].setdefault(name, []).append(result)
    return out


def test_each_node_starts_the_servers_placed_on_it_and_node_0_the_proxy(deployments):
    (servers0, proxy0), (servers1, proxy1) = deployments["nixl"]
    assert [r["env"]["CUDA_VISIBLE_DEVICES"] for r in servers0] == ["0,1,2,3", "4,5,6,7"]
    assert [r["env"]["CUDA_VISIBLE_DEVICES"] for r in servers1] == ["0,1,2,3"]
    ports = [int(r["argv"][r["argv"].index("--port") + 1]) for r in servers0 + servers1]
    assert ports == [9100, 9200, 9201]
    # NIXL's side channel: unique per server, on the host the server runs on
    assert [r["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] for r in servers0 + servers1] == ["gpu-a", "gpu-a", "gpu-b"]
    assert len({r["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] for r in servers0 + servers1}) == 3
    assert len(proxy0) == 1 and proxy1 == []
    args = proxy_parser("toy").parse_args(proxy0[0]["argv"][2:])
    assert (args.port, args.prefiller_hosts, args.prefiller_ports) == (9000, ["gpu-a"], [9100])
    assert (args.decoder_hosts, args.decoder_ports) == (["gpu-a", "gpu-b"], [9200, 9201])


def test_the_ascend_and_cpu_deployments_start_their_servers_and_proxies(deployments):
    servers, proxy = deployments["npu"]
    assert [r["env"]["ASCEND_RT_VISIBLE_DEVICES"] for r in servers] == ["0,1,2,3,4,5,6,7"]  # prefill tp8 on node 0
    ascend_proxy = proxy_parser("ascend").parse_args(proxy[0]["argv"][2:])
    assert (ascend_proxy.prefiller_hosts, ascend_proxy.decoder_hosts) == (["npu-a"], ["npu-b"])
    cpu_servers, cpu_proxy = deployments["cpu"]
    assert [r["env"]["VLLM_CPU_OMP_THREADS_BIND"] for r in cpu_servers] == ["0", "1"]
    demo = proxy_parser("demo").parse_args(cpu_proxy[0]["argv"][2:])
    assert (demo.model, demo.prefill, demo.decode) == ("/ckpt/llama2-70b", ["localhost:9100"], ["localhost:9200"])


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"vLLM is not installed at {VLLM_PYTHON}")
def test_vllms_parser_reads_each_servers_pool_and_kv_transfer_config(deployments):
    parsed = deployments["parsed"]
    assert all(p["ok"] for results in parsed.values() for p in results), parsed
    engines = [p["engine"] for p in parsed["nixl"]]
    assert [e["tensor_parallel_size"] for e in engines] == [4, 4, 4]
    assert [e["kv_transfer_config"]["kv_role"] for e in engines] == ["kv_producer", "kv_consumer", "kv_consumer"]
    assert {e["kv_transfer_config"]["kv_connector"] for e in engines} == {"NixlConnector"}
    assert all(e["kv_transfer_config"]["registered"] for e in engines)
    assert {(e["max_num_seqs"], e["max_num_batched_tokens"], e["max_model_len"]) for e in engines} == {
        (128, 4096, 2560)
    }
    npu_kv = parsed["npu"][0]["engine"]["kv_transfer_config"]
    assert npu_kv["kv_connector"] == "MooncakeConnectorV1" and npu_kv["kv_role"] == "kv_producer"
    assert parsed["npu"][0]["engine"]["tensor_parallel_size"] == 8
    assert npu_kv["kv_connector_extra_config"] == {
        "prefill": {"dp_size": 1, "tp_size": 8},
        "decode": {"dp_size": 1, "tp_size": 4},
    }
    cpu_kv = [p["engine"]["kv_transfer_config"] for p in parsed["cpu"]]
    assert [(k["kv_connector"], k["kv_role"], k["registered"]) for k in cpu_kv] == [
        ("ExampleConnector", "kv_producer", True),
        ("ExampleConnector", "kv_consumer", True),
    ]


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, Any]:
    """A NIXL deployment on three 8-GPU nodes whose decode instance (tp16) spans two of them: prefill
    tp8 on node 0, decode ranks on nodes 1 and 2; the script run as each node runs it and, with vLLM,
    its parse and engine config of every server's command line (a tiny Llama's config.json with 16
    heads, so that vLLM checks the parallel layout and not the weights)."""
    tmp = tmp_path_factory.mktemp("wide")
    ctx = _context(_serving(tp=16, replicas=1, prefill_tp=8), "cuda", 3, 8)
    assert EXPORTERS["vllm"].unsupported(ctx) == []
    script = write_exports(ctx, tmp / "export", ["vllm"])["vllm"]
    out: dict[str, Any] = {"nodes": [_servers_and_proxy(_run(script, tmp, n, "gpu-a gpu-b gpu-c")) for n in range(3)]}
    records = [record for servers, _ in out["nodes"] for record in servers]
    out["parsed"] = vllm_parse_on_tiny(records, tmp) if VLLM_PYTHON.exists() else []
    return out


def test_a_decode_instance_over_two_nodes_starts_a_rank_on_each_and_serves_from_the_first(wide):
    (prefill, proxy0), (rank0, proxy1), (rank1, proxy2) = wide["nodes"]
    assert len(prefill) == len(rank0) == len(rank1) == 1 and proxy1 == proxy2 == []
    assert "--nnodes" not in prefill[0]["argv"]  # within its node: a plain server
    for node, (record,) in enumerate((rank0, rank1), start=1):
        argv = record["argv"]
        option = lambda name: argv[argv.index(name) + 1]  # noqa: E731
        assert (option("--nnodes"), option("--node-rank")) == ("2", str(node - 1))
        assert (option("--master-addr"), option("--master-port")) == ("gpu-b", "29502")
        assert option("--distributed-executor-backend") == "mp"
        assert ("--headless" in argv) == (node == 2)
        assert record["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
        assert json.loads(option("--kv-transfer-config"))["kv_role"] == "kv_consumer"
    args = proxy_parser("toy").parse_args(proxy0[0]["argv"][2:])
    assert (args.prefiller_hosts, args.prefiller_ports) == (["gpu-a"], [9100])
    assert (args.decoder_hosts, args.decoder_ports) == (["gpu-b"], [9200])  # the instance's first node


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"vLLM is not installed at {VLLM_PYTHON}")
def test_vllm_reads_the_wide_decode_instance_as_one_engine_over_two_nodes(wide):
    prefill, rank0, rank1 = wide["parsed"]
    assert all(p["ok"] for p in wide["parsed"]), wide["parsed"]
    for result in wide["parsed"]:
        assert "engine_config_error" not in result["engine"], result["engine"]["engine_config_error"]
    assert prefill["engine"]["tensor_parallel_size"] == 8
    assert prefill["engine"]["kv_transfer_config"]["kv_role"] == "kv_producer"
    for rank, result in enumerate((rank0, rank1)):
        engine = result["engine"]
        assert engine["tensor_parallel_size"] == 16 and engine["headless"] == (rank == 1)
        assert engine["parallel"] == {"world_size": 16, "nnodes": 2, "node_rank": rank, "backend": "mp"}
        assert engine["kv_transfer_config"]["kv_role"] == "kv_consumer"


def test_the_export_refuses_a_cpu_prefill_instance_across_nodes():
    from autotune.export._vllm_multinode import MULTINODE_CPU_REFUSAL

    config = _serving(tp=1, prefill_tp=2, replicas=1, kv_connector="shared_storage", block_size=128)
    assert MULTINODE_CPU_REFUSAL in EXPORTERS["vllm"].unsupported(_context(config, "cpu", 2, 1))


def test_the_script_asks_for_every_node_of_the_deployment(tmp_path):
    script = write_exports(_context(_serving(), "cuda", 2, 8), tmp_path / "export", ["vllm"])["vllm"]
    env = {**os.environ, "MODEL": "/m", "PROXY": "/opt/proxy.py", "NODES": "only-one"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "NODES lists 1 host(s); the deployment spans 2 nodes" in proc.stderr


def test_the_script_asks_for_the_proxy_it_cannot_know(tmp_path):
    script = write_exports(_context(_serving(), "cuda", 2, 8), tmp_path / "export", ["vllm"])["vllm"]
    env = {
        **os.environ,
        "PATH": f"{vllm_stand_ins(tmp_path)}:{os.environ['PATH']}",
        "MODEL": "/m",
        "RECORD_DIR": "/nonexistent",
    }
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "toy_proxy_server.py" in proc.stderr


# ---------------------------------------------------------------------------------- the shipped spec
def test_the_70b_chat_plan_ranks_both_kinds_and_says_what_limits_each():
    """The shipped 2 x 8 910B chat spec: the simulator's top 10 holds disaggregated and aggregated
    layouts, each row with what stops its rate; at the spec's tight TPOT a disaggregated one leads."""
    from typer.testing import CliRunner

    from autotune.cli.commands import app

    spec = REPO / "search_spaces" / "llama2_70b_chat_2x8npu_disagg.yaml"
    result = CliRunner().invoke(app, ["plan", str(spec), "--json", "--top", "10"])
    assert result.exit_code == 0, result.output
    top = json.loads(result.stdout)["top"]
    kinds = [r["params"].get("prefill_replicas", 0) > 0 for r in top]
    assert any(kinds) and not all(kinds)
    assert kinds[0], "the tight TPOT target favours the disaggregated deployment"
    assert all(r["metrics"].get("slo_limit") in (0, 1, 2, 3, 4) for r in top)
    assert top[0]["limited_by"] == "TTFT p99" and any(r["limited_by"] == "TPOT p99" for r in top)
    table = CliRunner().invoke(app, ["plan", str(spec), "--top", "10"])
    assert "limited by" in table.stdout and "prefill 1 x tp8 + decode 1 x tp8, KV by mooncake" in table.stdout


# ---------------------------------------------------------------------------------- the probe's launch
def test_the_vllm_preset_starts_both_pools_with_their_roles_and_kv_configs():
    """engine.json of a disaggregated trial: the prefill servers (their pool's tp) then the decode
    servers, each with its role, --kv-transfer-config and consecutive devices; the user's args last;
    the shared-storage connector's files in the trial's folder."""
    from types import SimpleNamespace

    from autotune.dispatch.stack_presets import preset_launch

    config = _serving(tp=1, prefill_tp=2, replicas=2, kv_connector="shared_storage", block_size=128)
    request = TrialRequest(
        params=config,
        model=dict(LLAMA2_70B),
        workload={**CHAT, "max_model_len": 2560},
        cluster={"accelerator": "cpu", "nodes": 1, "devices_per_node": 4},
    )
    user = ["--load-format", "dummy"]
    launch = preset_launch("vllm", SimpleNamespace(entry=None, args=user), request, 0, 0, python="py")
    servers = json.loads(launch["files"]["engine.json"])["replicas"]
    assert [s["role"] for s in servers] == ["prefill", "decode", "decode"]
    assert [s["devices"] for s in servers] == [[0, 1], [2], [3]]
    for server in servers:
        argv = server["argv"]
        assert argv[-4:-2] == user and argv[-2] == "--kv-transfer-config"
        kv = json.loads(argv[-1])
        assert kv["kv_connector"] == "ExampleConnector"
        assert kv["kv_role"] == ("kv_producer" if server["role"] == "prefill" else "kv_consumer")
        assert kv["kv_connector_extra_config"] == {"shared_storage_path": "{trial_dir}/kv_cache"}
        tp = argv[argv.index("--tensor-parallel-size") + 1]
        assert tp == ("2" if server["role"] == "prefill" else "1")
    # one-rank decode servers are bound to their core; the two-rank prefill server binds itself
    assert [s["env"].get("VLLM_CPU_OMP_THREADS_BIND") for s in servers] == [None, "{devices}", "{devices}"]


def test_the_vllm_preset_refuses_a_deployment_wider_than_a_node_saying_why():
    from types import SimpleNamespace

    from autotune.dispatch.stack_presets import preset_launch

    config = _serving(tp=4, prefill_tp=4, replicas=2)  # 12 devices on 8-device nodes
    request = TrialRequest(
        params=config, model=dict(LLAMA2_70B), workload={**CHAT, "max_model_len": 2560}, cluster=TWO_NODES_NPU
    )
    with pytest.raises(ValueError, match="takes 12 devices, more than a node's 8"):
        preset_launch("vllm", SimpleNamespace(entry=None, args=[]), request, 0, 0, python="py")


def test_a_disaggregated_deployment_follows_a_replay_of_its_pools():
    """DistServe's 2P1D of OPT-13B against a replay of vLLM's scheduler on each instance, pool by pool
    (benchmarks/serving_queue_vs_scheduler.py: prefill, the KV transfer, then a decode instance that
    computes the prompt's last token): TTFT p50 within 10 %, its p99 and TPOT's within 20 %. Without the
    decode instance's own first step TTFT's p50 read 0.81x."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import serving_queue_vs_scheduler as replay

    case = next(c for c in replay.cases(quick=False) if "2P1D" in c.name)
    case.rates = (4.0, 8.0)
    for row in replay.compare(case, seeds=2, duration=300.0):
        assert row["model_ttft_p50"] == pytest.approx(row["des_ttft_p50"], rel=0.1), row["rate"]
        for metric in ("ttft_p99", "tpot_p99"):
            assert row[f"model_{metric}"] == pytest.approx(row[f"des_{metric}"], rel=0.2), (row["rate"], metric)
