"""Collectives measured per node count (issue 45, item 4): the fit of the link across nodes from
the seconds measured at each count, the profile's ``inter_node_links``, the simulator paying the
link measured at a trial's node count, and saying when a count was not measured. The measurement
on a local Ray cluster is in tests/test_multinode.py."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.workers.calibrate_nodes import fit_inter_node_links, metric_name, parse_metrics
from autotune.workers.hardware import links_at, links_note, load_profile, validate_profile
from autotune.workers.protocol import TrialRequest
from autotune.workers.simulate import simulate_trial

TINY = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_hidden_layers": 4,
    "intermediate_size": 688,
    "vocab_size": 32000,
}


def _ring_seconds(latency_s: float, bus_bytes_per_s: float, world: int) -> dict[int, float]:
    """What the simulator's all-reduce model says at each size: 2 latency + 2(g-1)/g n / bus."""
    return {n: 2 * latency_s + 2 * (world - 1) / world * n / bus_bytes_per_s for n in (4096, 65536, 1 << 20, 8 << 20)}


def test_the_fit_recovers_the_link_of_each_node_count():
    ranks = 2
    seconds = {
        1: {"allreduce": _ring_seconds(20e-6, 10e9, 2)},  # one node: the host's calibration, no link
        2: {"allreduce": _ring_seconds(150e-6, 2.0e9, 2 * ranks)},
        4: {"allreduce": _ring_seconds(300e-6, 1.2e9, 4 * ranks)},
    }
    links = fit_inter_node_links(seconds, ranks)
    assert set(links) == {2, 4}
    assert links[2]["latency_us"] == pytest.approx(150, rel=1e-3)
    assert links[2]["bandwidth_gbps"] == pytest.approx(2.0 / ranks, rel=1e-3)  # each rank's share of the bus
    assert links[4]["bandwidth_gbps"] == pytest.approx(1.2 / ranks, rel=1e-3)
    assert fit_inter_node_links({2: {"allreduce": {4096: 1e-3}}}, ranks) == {}  # one size fits nothing


def test_the_protocol_metrics_round_trip():
    metrics = {metric_name("allreduce", 4096): 0.001, metric_name("allgather", 1 << 20): 0.01, "other": 1.0}
    assert parse_metrics(metrics) == {"allreduce": {4096: 0.001}, "allgather": {1 << 20: 0.01}}


def _profile(links=None):
    profile = load_profile("ascend-910b")
    if links is not None:
        profile["inter_node_links"] = links
    return validate_profile(profile, "test")


def test_a_profile_holds_links_per_node_count_checked():
    profile = _profile(
        {2: {"bandwidth_gbps": 20.0, "latency_us": 30.0}, "4": {"bandwidth_gbps": 12.0, "latency_us": 45}}
    )
    assert set(profile["inter_node_links"]) == {2, 4}  # a JSON key (a string) read as the count
    for bad, why in (
        ({1: {"bandwidth_gbps": 1.0, "latency_us": 1.0}}, "node counts >= 2"),
        ({2: {"bandwidth_gbps": 0.0, "latency_us": 1.0}}, "must be > 0"),
        ({2: {"bandwidth_gbps": 1.0}}, "{bandwidth_gbps, latency_us}"),
    ):
        with pytest.raises(ValueError, match="inter_node_links") as caught:
            _profile(bad)
        assert why in str(caught.value)


def test_a_node_count_reads_its_own_link_else_the_nearest_below_and_says_so():
    profile = _profile({2: {"bandwidth_gbps": 20.0, "latency_us": 30.0}, 4: {"bandwidth_gbps": 12.0, "latency_us": 45}})
    assert links_at(profile, 1) is None and links_note(profile, 1) is None
    assert links_at(profile, 4)[0] == 4 and "measured there" in links_note(profile, 4)
    assert links_at(profile, 3)[0] == 2
    assert links_at(profile, 16)[0] == 4 and "extrapolated from the 4-node measurement" in links_note(profile, 16)
    assert "not measured per node count" in links_note(_profile(), 4)


def _dp_comm(profile, nodes: int) -> float:
    request = TrialRequest(
        params={"tp": 1, "pp": 1, "micro_batch_size": 1, "zero_stage": 0, "precision": "bf16", "recompute": "none"},
        model=TINY,
        workload={"kind": "train", "seq_len": 128, "global_batch_size": 8 * nodes},
        cluster={"accelerator": "npu", "nodes": nodes, "devices_per_node": 8, "hardware": profile},
    )
    result = simulate_trial(request)
    assert result.ok, result.reason
    return result.info["time_s"]["dp_comm"]


def test_the_simulator_pays_the_link_measured_at_the_trials_node_count():
    fast = {2: {"bandwidth_gbps": 25.0, "latency_us": 10.0}, 4: {"bandwidth_gbps": 25.0, "latency_us": 10.0}}
    slow_at_4 = {2: {"bandwidth_gbps": 25.0, "latency_us": 10.0}, 4: {"bandwidth_gbps": 2.0, "latency_us": 200.0}}
    assert _dp_comm(_profile(fast), 2) == pytest.approx(_dp_comm(_profile(slow_at_4), 2))  # 2 nodes: the same link
    assert _dp_comm(_profile(slow_at_4), 4) > 2 * _dp_comm(_profile(fast), 4)  # the 4-node link is the slow one
    assert _dp_comm(_profile(slow_at_4), 1) == pytest.approx(_dp_comm(_profile(), 1))  # one node: no link


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "2,4"], "--ray-address"),
        (["--nodes", "2,x", "--ray-address", "auto"], "--nodes: expected node counts"),
    ],
)
def test_calibrate_across_nodes_refuses_bad_input_before_measuring(tmp_path, args, message):
    result = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "p.yaml"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and not (tmp_path / "p.yaml").exists()
