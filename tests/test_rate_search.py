"""The serving probe's rate search (workers/serve_probe/rates.py, issue 44 item 4): the highest rate
meeting the SLO bracketed from the ladder and bisected to ``workload.rate_tolerance``, an undecided
rate run again with more requests and else counted as not met (saying why), the operating rate
confirmed by a repeat; and the probe reporting it, against the fake engine with a known SLO cliff."""

from __future__ import annotations

import math
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_serve_probe import _load_steps, _nothing_left, _run, _trial

from autotune.objectives import serving
from autotune.objectives.intervals import quantile_interval
from autotune.workers.serve_probe.rates import LONGER, Load, RateSearch, Tried, between, check_tolerance

LADDER = [1.0, 2.0, 4.0, 6.0, 8.0]


def _search(search: RateSearch, verdict: Callable[[Load], str | tuple[str, str]]) -> RateSearch:
    """Run ``search`` to its end, each run's verdict (and why) from ``verdict``."""
    while (load := search.next()) is not None:
        said = verdict(load)
        search.report(*(said if isinstance(said, tuple) else (said,)))
    return search


def _cliff(at: float) -> Callable[[Load], str]:
    return lambda load: "met" if load.rate <= at else "missed"


# ---------------------------------------------------------------------- the search, pure
def test_the_search_converges_to_the_tolerance_on_a_known_slo_cliff():
    s = _search(RateSearch(LADDER, 0.05), _cliff(5.7))
    met, missed = s.bracket
    assert met <= 5.7 < missed and (missed - met) / met <= 0.05 and s.converged
    assert abs(s.max_rate - 5.7) / 5.7 <= 0.05  # the ladder alone said 4: 29 % low
    assert s.confirmed and not s.at_least and s.stopped is None
    # the ladder first (its middle rung, then up), then the bracket (4, 6) bisected, then one repeat
    assert [(t.rate, t.purpose) for t in s.tried][:2] == [(4.0, "ladder"), (6.0, "ladder")]
    assert {t.purpose for t in s.tried[2:-1]} == {"bisect"} and s.tried[-1] == Tried(met, 1, "confirm", "met", True)
    assert all(4.0 < t.rate < 6.0 for t in s.tried[2:])  # inside the bracket the ladder seeded
    summary = s.summary()
    assert summary["bracket"] == [met, missed] and summary["tolerance_reached"] <= 0.05
    assert [t["rate"] for t in summary["tried"]] == [t.rate for t in s.tried]


@pytest.mark.parametrize("tolerance", [0.01, 0.05, 0.2])
@pytest.mark.parametrize("cliff", [1.0, 1.3, 2.0, 3.3, 5.7, 6.0, 7.99])
def test_every_cliff_inside_the_ladder_is_bracketed_within_the_tolerance_in_log_many_runs(cliff, tolerance):
    s = _search(RateSearch(LADDER, tolerance), _cliff(cliff))
    met, missed = s.bracket
    assert met <= cliff < missed and (missed - met) / met <= tolerance and s.confirmed
    # the ladder's bisection, then about log2(ln(gap) / ln(1 + tolerance)) halvings, then the repeat
    gap = 2.0  # the widest ratio between neighbouring rungs of LADDER
    halvings = math.ceil(math.log2(math.log(gap) / math.log1p(tolerance))) + 1  # +1: rounded midpoints
    assert len(s.tried) <= math.ceil(math.log2(len(LADDER) + 1)) + halvings + 1


@settings(max_examples=200, deadline=None)
@given(
    ladder=st.lists(st.floats(0.01, 1e4), min_size=1, max_size=8, unique=True).map(sorted),
    share=st.floats(0.0, 1.0),
    tolerance=st.floats(0.001, 0.9),
)
def test_any_monotone_verdict_ends_in_a_bracket_around_its_cliff(ladder, share, tolerance):
    cliff = ladder[0] * 0.5 + share * (ladder[-1] * 1.5 - ladder[0] * 0.5)  # below, inside and above the ladder
    s = _search(RateSearch(ladder, tolerance), _cliff(cliff))
    met, missed = s.bracket
    assert s.stopped is None and all(ladder[0] <= t.rate <= ladder[-1] for t in s.tried)
    if met is None:
        assert cliff < ladder[0] and missed == ladder[0]
    elif missed is None:
        assert cliff >= ladder[-1] and met == ladder[-1] and s.confirmed
    else:
        assert met <= cliff < missed and (missed - met) / met <= tolerance and s.confirmed


def test_the_search_stays_inside_the_ladder():
    top = _search(RateSearch(LADDER), _cliff(50.0))  # the top rung meets: at least 8, nothing tried above
    assert top.max_rate == 8.0 and top.at_least and top.bracket == (8.0, None) and top.converged
    assert max(t.rate for t in top.tried) == 8.0 and top.tried[-1].purpose == "confirm"
    low = _search(RateSearch(LADDER), _cliff(0.5))  # the lowest misses: (0, 1), nothing tried below
    assert low.max_rate is None and low.bracket == (None, 1.0) and low.summary()["below_ladder"]
    assert min(t.rate for t in low.tried) == 1.0 and not low.confirmed
    one = _search(RateSearch([3.0]), _cliff(5.0))  # one rate: goodput at that rate
    assert [(t.rate, t.purpose) for t in one.tried] == [(3.0, "ladder"), (3.0, "confirm")]


def test_an_undecided_rate_is_run_longer_and_if_still_undecided_counts_as_not_met_saying_why():
    why = "TTFT p99 90 ms, its 95 % interval (no upper end) holds the target 100 ms"

    def verdict(load: Load):
        if load.rate == 4.0:  # too few requests at 4 req/s, however many the cap allows
            return "undecided", why
        return "met" if load.rate < 4.0 else "missed"

    s = _search(RateSearch(LADDER, 0.05), verdict)
    first, longer = s.tried[0], s.tried[1]
    assert (first.rate, first.scale, first.purpose, first.verdict, first.counted) == (
        4.0,
        1,
        "ladder",
        "undecided",
        None,
    )
    assert (longer.rate, longer.scale, longer.purpose, longer.verdict) == (4.0, LONGER, "longer", "undecided")
    assert longer.counted is False and why in longer.why and "counted by its measured p99s: not met" in longer.why
    assert f"{LONGER}x the planned requests (the cap)" in longer.why and "run again" in first.why
    assert s.bracket[1] == 4.0 and s.max_rate < 4.0  # not met: the search went below it
    assert [(t.rate, t.purpose) for t in s.tried[2:4]] == [(1.0, "ladder"), (2.0, "ladder")]  # on down the ladder


def test_a_longer_run_that_decides_counts_and_the_repeat_uses_as_many_requests():
    def verdict(load: Load):
        if load.rate == 8.0 and load.scale == 1:
            return "undecided", "too few requests"
        return "met"

    s = _search(RateSearch(LADDER), verdict)
    assert [(t.rate, t.scale, t.purpose, t.counted) for t in s.tried] == [
        (4.0, 1, "ladder", True),
        (6.0, 1, "ladder", True),
        (8.0, 1, "ladder", None),
        (8.0, LONGER, "longer", True),
        (8.0, LONGER, "confirm", True),  # the repeat runs as long as the run that decided the rate
    ]
    assert s.max_rate == 8.0 and s.confirmed


def test_the_operating_rate_is_confirmed_by_a_repeat_and_a_failed_repeat_steps_down():
    repeats: list[float] = []

    def verdict(load: Load):
        if load.purpose == "confirm":
            repeats.append(load.rate)
            return "missed" if len(repeats) == 1 else "met"  # the first repeat misses (noise at the edge)
        return "met" if load.rate <= 5.7 else "missed"

    s = _search(RateSearch(LADDER, 0.05), verdict)
    first, second = repeats
    assert second < first and s.max_rate == second and s.confirmed
    overturned = next(t for t in s.tried if t.purpose == "confirm")
    assert overturned.counted is False and "the repeat did not meet the SLO" in overturned.why
    assert s.bracket == (second, first) and s.width <= 0.05  # the failed repeat is the new top


def test_a_failed_repeat_of_the_only_rate_met_goes_back_to_the_rungs_below():
    def verdict(load: Load):
        if load.purpose == "confirm" and load.rate >= 2.0:
            return "missed"
        return "met" if load.rate <= 2.0 else "missed"

    s = _search(RateSearch([1.0, 2.0, 4.0], 0.05), verdict)
    purposes = [(t.rate, t.purpose) for t in s.tried]
    failed = purposes.index((2.0, "confirm"))
    assert purposes[:2] == [(2.0, "ladder"), (4.0, "ladder")] and s.tried[failed].counted is False
    assert purposes[failed + 1] == (1.0, "ladder")  # the rung never tried, then the bracket (1, 2) bisected
    assert {p for _, p in purposes[failed + 2 : -1]} == {"bisect"} and purposes[-1][1] == "confirm"
    met, missed = s.bracket
    assert missed == 2.0 and s.max_rate == met < 2.0 and (missed - met) / met <= 0.05 and s.confirmed


def test_the_search_can_be_stopped_and_caps_its_runs():
    s = RateSearch(LADDER)
    s.report("met") if s.next() else None
    s.stop("the probe's time is up")
    assert s.next() is None and s.max_rate == 4.0 and not s.confirmed and s.summary()["stopped"]

    flip = iter(range(1000))
    capped = _search(RateSearch(LADDER, 0.01, max_runs=6), lambda load: "met" if next(flip) % 2 == 0 else "missed")
    assert len(capped.tried) == 6 and "6 runs" in capped.stopped
    short = _search(RateSearch(LADDER, max_runs=1), lambda load: "undecided")  # the cap before a longer run
    assert [(t.rate, t.counted) for t in short.tried] == [(4.0, False)] and "not met" in short.tried[0].why


def test_stopping_before_an_undecided_rates_longer_run_counts_it_as_not_met():
    s = RateSearch(LADDER)
    s.next()
    s.report("met")  # 4 req/s
    s.next()
    s.report("undecided", "too few requests")  # 6 req/s
    assert s.next() == Load(6.0, LONGER, "longer")
    s.stop("no time")  # the longer run is not made
    assert s.tried[-1].counted is False and s.tried[-1].why.endswith("no time: counted as not met")
    assert s.bracket == (4.0, 6.0) and s.next() is None and s.stopped == "no time"


def test_the_protocol_and_the_fields_are_checked():
    s = RateSearch(LADDER)
    with pytest.raises(RuntimeError):
        s.report("met")
    s.next()
    with pytest.raises(RuntimeError):
        s.next()
    with pytest.raises(ValueError, match="one of met, missed, undecided"):
        s.report(True)  # type: ignore[arg-type]
    for bad in (0, 0.0, 1, 1.5, -0.05, "x", None, True, float("nan")):
        with pytest.raises(ValueError, match="workload.rate_tolerance"):
            check_tolerance(bad)
    with pytest.raises(ValueError, match="traffic.rates"):
        RateSearch([])
    with pytest.raises(ValueError, match="strictly ascending"):
        RateSearch([2.0, 2.0])


def test_midpoints_are_readable_and_strictly_inside():
    assert between(4.0, 6.0, 0.05) == 4.899
    assert between(100.0, 160.0, 0.1) == 126.0
    for low, high in ((1.0, 1.0001), (5.561, 5.562), (1e-3, 2e-3)):
        assert low < between(low, high, 0.00001) < high


# ---------------------------------------------------------------------- the figures it is read with
def test_a_p99_needs_368_requests_to_be_met_at_95_percent():
    assert serving.requests_to_bound() == 368
    assert math.isinf(quantile_interval(range(367), 99)[1]) and math.isfinite(quantile_interval(range(368), 99)[1])


def test_why_a_rate_is_undecided_says_which_interval_and_how_many_requests():
    record = {"ok": True, "sent_s": 0.0, "output_tokens": 2, "ttft_ms": 50.0, "e2e_ms": 60.0, "itl_ms": [10.0]}
    slo = {"ttft_p99_ms": 100.0}
    few = serving.summarize_rate([record] * 40, slo, 4.0, 10.0)
    why = serving.undecided_why(few, slo)
    assert few["slo_verdict"] == "undecided" and "TTFT p99 50 ms" in why and "no upper end" in why
    assert "40 completed requests cannot bound a p99 from above (it takes at least 368)" in why
    many = serving.summarize_rate([record] * 400, slo, 4.0, 100.0)
    assert many["slo_verdict"] == "met" and serving.undecided_why(many, slo) == ""


def test_a_run_whose_client_sent_late_says_the_load_generator_fell_behind():
    # 100 requests planned at 10 req/s, the client 2 ms behind its plan: it kept up
    on_time = [
        {
            "ok": True,
            "scheduled_s": i / 10,
            "sent_s": i / 10 + 0.002,
            "output_tokens": 2,
            "ttft_ms": 50.0,
            "e2e_ms": 60.0,
        }
        for i in range(100)
    ]
    slo = {"ttft_p99_ms": 400.0}
    assert serving.send_lag(on_time, 10.0) == (pytest.approx(2.0), "")
    # a stall of 0.6 s: six requests planned 4.0-4.5 s sent together at 4.6 s, up to 600 ms late
    late = [dict(r, sent_s=4.6) if 40 <= i < 46 else r for i, r in enumerate(on_time)]
    lag, why = serving.send_lag(late, 10.0)
    assert lag > 400 and why.startswith("the load generator fell behind") and "at 10 req/s" in why
    assert serving.send_lag(late, 1.0)[1] == ""  # at 1 req/s the same lag is within one gap between arrivals
    assert serving.send_lag(on_time, 1000.0)[1] == ""  # nor is 2 ms behind, however high the rate
    summary = serving.summarize_rate(late, slo, 10.0, 10.0)
    assert summary["generator_behind"] == why and summary["send_lag_p99_ms"] == pytest.approx(lag)
    kept = serving.summarize_rate(on_time, slo, 10.0, 10.0)
    assert "generator_behind" not in kept
    assert serving.serving_metrics([kept, summary], devices=1)["load_generator_behind_runs"] == 1.0
    assert serving.send_lag([{"ok": True, "sent_s": 1.0}], 10.0) == (None, "")  # a record without its plan


def test_a_closed_loop_batch_says_how_much_of_its_stream_came_piled_up():
    def request(
        apart: int,
    ) -> dict:  # 32 tokens: the last ``apart`` - 1 each 3 ms after the one before, the rest at once
        gaps = [0.0] * (32 - apart) + [3.0] * (apart - 1)
        return {
            "ok": True,
            "sent_s": 0.0,
            "output_tokens": 32,
            "ttft_ms": 98.0,
            "e2e_ms": 98.0 + sum(gaps),
            "itl_ms": gaps,
        }

    assert serving.batch_summary([request(32)], 1)["tokens_apart_share"] == 1.0  # a step a token
    piled = serving.batch_summary([request(1)], 1)  # the whole answer in one read, 98 ms after sending
    assert piled["tokens_apart_share"] == 0.0 and piled["time_for_100_tokens_s"] == pytest.approx(0.098)
    assert serving.tokens_apart_share(request(17)) == pytest.approx(16 / 31)
    assert serving.batch_summary([request(32), request(1)], 2)["tokens_apart_share"] == 0.0  # its worst request's
    assert serving.tokens_apart_share(dict(request(1), output_tokens=1)) is None  # nothing decoded after the first


def test_the_goodput_interval_spans_the_good_share_and_the_bracket():
    assert serving.share_interval(0, 10)[0] == 0.0 and serving.share_interval(10, 10)[1] == 1.0
    low, high = serving.share_interval(380, 400)
    assert low < 0.95 < high and serving.share_interval(1, 0) is None
    point = {"rate": 100.0, "requests": 400, "good": 380, "window_s": 4.0, "goodput_rps": 95.0}
    at_rate = serving.goodput_interval(point)
    assert at_rate == pytest.approx((100.0 * low, 100.0 * high), rel=1e-5) and at_rate[0] < 95.0 < at_rate[1]
    # every good: the rate itself is the high end, whatever the window (the goodput is no count / window)
    every = {"rate": 100.0, "requests": 400, "good": 400, "window_s": 2.006231, "goodput_rps": 100.0}
    assert serving.goodput_interval(every)[1] == 100.0
    assert serving.goodput_interval(dict(point, good=0, goodput_rps=0.0))[0] == 0.0
    bracketed = serving.goodput_interval(point, 105.0)  # the maximum lies below 105 req/s
    assert bracketed[0] == at_rate[0] and bracketed[1] == pytest.approx(105.0 * high, rel=1e-5)


# ---------------------------------------------------------------------- the probe, on the fake engine
@pytest.mark.timeout(240)
def test_the_probe_finds_the_fake_engines_slo_cliff_within_the_tolerance(tmp_path, caplog):
    """A known SLO cliff: 50 requests decode at once, each 400 ms (200 ms to the first token, one
    more token 200 ms later), and arrivals nearly periodic (gamma shape 1000), a D/D/c queue: below
    capacity nothing waits; above it by a share e, the queue grows so that a request arriving at t
    waits e x t. The p99 TTFT of a D-second run crosses the target when e x D reaches the margin
    (target - unqueued TTFT), so the cliff is capacity / service time x (1 + margin / D): about
    131 req/s. Service time and unqueued TTFT are read from the run at the lowest rung (nothing
    waits there): the machine's own overhead moves the cliff a little, not the search. The margin
    is 200 ms: with 60 ms, a CI host busy with the other test worker delayed more than 1 % of the
    lowest rung's first tokens past the target, and that rung read "undecided" (CI, 2026-12-03)."""
    capacity, duration_s, target_ms, tolerance = 50, 4.0, 400.0, 0.1
    trial = _trial(
        tmp_path,
        args=("--capacity", str(capacity), "--ttft-ms", "200", "--token-ms", "200"),
        rates=(100.0, 150.0),  # 400 requests at the lowest: every met run can be decided (368)
        duration_s=duration_s,
        output_len=2,
        arrival="gamma",
        burstiness=1000.0,
        slo={"ttft_p99_ms": target_ms},
        warmup=2,
        rate_tolerance=tolerance,
    )
    result = _run(trial, caplog, timeout_s=200.0)
    assert result.status == "ok", (result.reason, result.log_tail)
    info, m = result.info["serving"], result.metrics
    unloaded = info["rates"][0]
    assert unloaded["rate"] == 100.0 and unloaded["slo_verdict"] == "met"
    service_s, ttft_ms = unloaded["e2e_p50_ms"] / 1000.0, unloaded["ttft_p50_ms"]
    cliff = capacity / service_s * (1.0 + (target_ms - ttft_ms) / 1000.0 / duration_s)

    search = info["search"]
    assert info["rate_tolerance"] == search["tolerance"] == tolerance  # the spec's field reached the probe
    met, missed = search["bracket"]
    assert search["converged"] and search["confirmed"] and (missed - met) / met <= tolerance
    assert m["max_rate_rps"] == met == info["operating_rate"]
    assert (cliff - met) / cliff <= tolerance and met <= 1.03 * cliff and missed >= 0.97 * cliff, (met, cliff, missed)
    assert (m["max_rate_rps_ci_low"], m["max_rate_rps_ci_high"]) == (met, missed)
    assert m["rate_tolerance_reached"] == pytest.approx((missed - met) / met)
    assert m["goodput_rps_ci_low"] <= m["goodput_rps"] <= m["goodput_rps_ci_high"] <= missed

    runs = info["rates"]
    steps = _load_steps(result)  # each run a step event, numbered in order, with its verdict
    assert [(s["step"], s["rate"], s["slo_verdict"]) for s in steps] == [
        (k, s["rate"], s["slo_verdict"]) for k, s in enumerate(runs)
    ]
    assert [(s["rate"], s["purpose"]) for s in runs][:2] == [(100.0, "ladder"), (150.0, "ladder")]
    assert all(100.0 < s["rate"] < 150.0 for s in runs[2:]) and runs[-1]["purpose"] == "confirm"
    assert all(s["slo_verdict"] != "met" or s["counted_as_met"] for s in runs)
    assert m["preemptions"] > 0  # the fake counts requests that had to wait: above the cliff, many
    assert 0 < m["kv_cache_usage"] <= 1  # seconds of queueing: sampled under load
    _nothing_left(tmp_path, caplog)


def test_too_few_requests_leave_the_rate_undecided_and_the_probe_says_why(tmp_path, caplog):
    """4 requests at 4 req/s: no run within the cap (16 requests) could bound a p99 from above (it
    takes 368), so none is made; the rate is counted by its measured p99s, and its verdict says
    "undecided" and why: the maximum rests on a rate the requests cannot be sure of."""
    trial = _trial(tmp_path, rates=(4.0,), duration_s=1.0)
    result = _run(trial, caplog)
    assert result.status == "ok", (result.reason, result.log_tail)
    info, m = result.info["serving"], result.metrics
    runs = [(s["rate"], s["purpose"], s["scale"], s["slo_verdict"], s["counted_as_met"]) for s in info["rates"]]
    assert runs == [(4.0, "ladder", 1, "undecided", True), (4.0, "confirm", 1, "undecided", True)]
    assert info["rates"][0]["slo_met"]  # its p99s are under target: too few requests to be sure of it
    why = info["rates"][0]["why"]
    assert "cannot bound a p99 from above (it takes at least 368)" in why
    assert "counted by its measured p99s: met" in why and "could not bound its p99s" in why
    assert m["max_rate_rps"] == 4.0 and m["slo_undecided"] == 1.0
    _nothing_left(tmp_path, caplog)


def test_a_rate_a_longer_run_can_decide_is_run_again_with_more_requests(tmp_path, caplog):
    """100 requests at 100 req/s: undecided (a p99 takes 368 to bound), and 4x as many can decide
    it: the longer run is made."""
    trial = _trial(tmp_path, rates=(100.0,), duration_s=1.0)
    result = _run(trial, caplog)
    assert result.status == "ok", (result.reason, result.log_tail)
    runs = [(s["rate"], s["purpose"], s["scale"]) for s in result.info["serving"]["rates"]]
    assert runs[:2] == [(100.0, "ladder", 1), (100.0, "longer", LONGER)]
    _nothing_left(tmp_path, caplog)


def test_the_search_ends_with_what_it_found_when_the_probes_time_runs_short(tmp_path, caplog):
    # 80 % of timeout_s (8 s) holds the 2 s run at 100 req/s (200 requests: undecided), not its 8 s
    # longer run (800 requests could bound its p99s)
    trial = _trial(tmp_path, rates=(100.0,), duration_s=2.0, timeout_s=10.0)
    result = _run(trial, caplog)
    assert result.status == "ok", (result.reason, result.log_tail)
    info = result.info["serving"]
    assert [(s["rate"], s["purpose"], s["counted_as_met"]) for s in info["rates"]] == [(100.0, "ladder", False)]
    assert "80% of workload.timeout_s" in info["search"]["stopped"] and "counted as not met" in info["rates"][0]["why"]
    assert result.metrics["max_rate_rps"] == 0
    _nothing_left(tmp_path, caplog)


def test_a_bad_rate_tolerance_is_invalid_before_any_engine_starts(tmp_path, caplog):
    trial = _trial(tmp_path, rate_tolerance=1.5)
    result = _run(trial, caplog)
    assert result.status == "invalid" and "workload.rate_tolerance" in result.reason
    assert not list(tmp_path.glob("*.pid"))
