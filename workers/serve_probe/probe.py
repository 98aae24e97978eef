"""The serving probe: engine up, warm-up, open-loop load at the rates the rate search picks, the
closed-loop batch sweep, engine down; the protocol's lines on stdout and ``requests.jsonl``.

Order of a run (docs/ARCHITECTURE.md, "The probe protocol"):

1. read the trial file and ``engine.json`` beside it (what the stack preset rendered: the
   engine's own launch, per replica);
2. start the replicas and wait for every health check (``startup_timeout_s``), a heartbeat step
   every 5 s so the driver sees it alive;
3. warm up: ``warmup_requests`` one at a time, round-robin over replicas (at least one each), not
   recorded: first requests pay for lazy initialisation, which is no property of the config;
4. for each run the rate search asks for (workers/serve_probe/rates.py: the ladder seeds a
   bracket, bisected to ``workload.rate_tolerance``; an undecided rate run again with 4x the
   requests; the operating rate repeated): the run's planned arrivals sent open-loop, the
   engine's ``/metrics`` sampled meanwhile, a step event with the run's summary; requests that
   failed end the probe as ``crash`` (the engine's answer quoted) unless the engine itself died
   (``crash`` with its exit and its own last error). The search stops early, with what it found,
   when the next run would end past ``TIME_SHARE`` of ``workload.timeout_s`` (the rest is the
   batch sweep's and the shutdown's: the driver kills a probe at ``timeout_s`` and would lose every
   rate measured);
5. the closed-loop batches of ``batch_sweep``;
6. one ``{"metrics": ..., "info": {"serving": ...}}`` line: the operating point's metrics
   (objectives/serving.py) with the maximum rate's bracket and the goodput's interval, every run
   made (``rates``, in order) and the search's account (``search``), the per-request records file.

Whatever happens (a failure, SIGTERM from the driver's deadline or pruning, Ctrl-C), ``finally``
stops every replica and every process they started before the probe exits. Workers import
nothing of the driver: this module needs the standard library, numpy, aiohttp, prometheus_client
and ``autotune.objectives.serving``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import aiohttp

from autotune.objectives import serving
from autotune.objectives.intervals import ci_keys

from ..parameters import trial_devices
from ..protocol import TRIAL_FILE_ENV, TrialRequest, read_trial_file
from . import traffic as traffic_mod
from .client import Endpoint, LeastOutstanding, closed_batch, new_session, open_loop, send_request
from .engine import Engines, fit, node_values
from .failure import ProbeFailure, Terminated
from .prom import MetricsSampler
from .rates import TOLERANCE, Load, RateSearch, Tried, check_tolerance

__all__ = ["main", "ENGINE_FILE", "REQUESTS_FILE"]

ENGINE_FILE = "engine.json"
REQUESTS_FILE = "requests.jsonl"
HEARTBEAT_S = 5.0
STOP_GRACE_S = 10.0  # a normal end: time for the engine to shut down cleanly
TERM_GRACE_S = 1.5  # after SIGTERM: the driver SIGKILLs the probe 3 s after it (workers/command.py)
TIME_SHARE = 0.8  # of workload.timeout_s the rate search may use: no run starts that would end past it


def emit(obj: Mapping[str, Any]) -> None:
    """One protocol line on stdout, flushed (the driver reads it live)."""
    sys.stdout.write(json.dumps(obj, default=float) + "\n")
    sys.stdout.flush()


def log(text: str) -> None:
    sys.stderr.write(f"[serve_probe] {text}\n")
    sys.stderr.flush()


class Run:
    """One trial's serving measurement (everything but the engines' lifetime)."""

    def __init__(
        self,
        request: TrialRequest,
        spec: Mapping[str, Any],
        engines: Engines,
        trial_dir: Path,
        started: float | None = None,
    ) -> None:
        self.request = request
        self.spec = spec
        self.engines = engines
        self.trial_dir = trial_dir
        self.workload = request.workload
        self.traffic = dict(self.workload.get("traffic") or {})
        self.slo = {k: (self.workload.get("slo") or {}).get(k) for k in serving.SLO_KEYS}
        self.api = dict(spec.get("api") or {})
        self.model_name = str(self.api.get("model", "autotune-model"))
        self.prompt_mode = "text" if spec.get("prompt") == "text" else "token_ids"
        self.vocab = int(request.model.get("vocab_size") or 32000)
        self.records_path = trial_dir / REQUESTS_FILE
        self.records_path.write_text("")
        self.duration_s = float(self.traffic.get("duration_s", 30.0))
        # an unanswered request is given up this long after the rate's last planned arrival
        self.grace_s = float(self.workload.get("request_timeout_s") or max(30.0, 2.0 * self.duration_s))
        self.tolerance = check_tolerance(_tolerance(self.workload))
        # the clock (time.monotonic) the probe started on: the search's runs end by TIME_SHARE of timeout_s
        start = time.monotonic() if started is None else float(started)
        self.search_deadline = start + TIME_SHARE * float(self.workload.get("timeout_s") or 3600.0)
        self.search: RateSearch | None = None

    # ------------------------------------------------------------------ helpers
    def _write(self, records: list[dict[str, Any]]) -> None:
        with open(self.records_path, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    @staticmethod
    def _step(**fields: Any) -> None:
        """A step event. Only a rate's carries ``step`` (its place in the order tried) and the
        per-rate figures the driver keeps as the trial's metric history; heartbeats and
        closed-loop batches carry other names, so that history stays one point per rate."""
        emit({"event": "step", **fields})

    def _check_engines(self, when: str) -> None:
        dead = self.engines.dead()
        if dead is not None:
            raise ProbeFailure(*dead.exit_reason(when))

    def _fail_on_errors(self, records: list[dict[str, Any]], what: str, overload: bool = False) -> None:
        """Requests the engine answered with an error (or whose connection broke) end the trial:
        the engine's exit when it died, else the engine's own answer. Requests given up at the
        deadline are a measurement (an overloaded server), not a failure; so are, under open-loop
        load (``overload``), connections an engine that is alive and answering the other requests
        dropped (vLLM 0.32's CPU server at 16 req/s with 17 requests waiting closed 5 of 129): the
        rate's SLO is missed (a failed request is never good), and the rate search goes lower."""
        broken = [r for r in records if not r["ok"] and r.get("error_kind") != "timeout"]
        if not broken:
            return
        self._check_engines(f"during {what}")
        answered = len(records) - len(broken)
        if overload and answered > 0 and all(r.get("error_kind") == "connection" for r in broken):
            log(f"{len(broken)} of {len(records)} connections dropped during {what}: the SLO is missed there")
            return
        first = broken[0]
        raise ProbeFailure(
            "crash",
            fit(
                f"{len(broken)} of {len(records)} requests failed during {what} "
                f"(replica {first['replica']}): {first['error']}"
            ),
        )

    # ------------------------------------------------------------------ phases
    async def run(self) -> dict[str, Any]:
        endpoints = [
            Endpoint(r.index, self.engines.url(r, "completions")) for r in self.engines.replicas if r.role != "prefill"
        ]
        prefill = [
            Endpoint(r.index, self.engines.url(r, "completions")) for r in self.engines.replicas if r.role == "prefill"
        ]
        metrics_urls = [self.engines.url(r, "metrics") for r in self.engines.replicas]
        names = dict(self.spec.get("metrics_names") or {})
        async with new_session() as session:
            balancer = LeastOutstanding(endpoints, LeastOutstanding(prefill) if prefill else None)
            sampler = MetricsSampler(session, metrics_urls, names)
            version = await self._version(session)
            await self._warmup(session, balancer)
            summaries, engine_view = await self._rates(session, balancer, sampler)
            closed = await self._batches(session, balancer)
        return self._result(summaries, engine_view, closed, version, sampler)

    async def _version(self, session: Any) -> str:
        said = str(self.spec.get("version") or "")
        if said:
            return said
        try:  # vLLM answers GET /version
            url = self.engines.url(self.engines.replicas[0], "completions").split("/v1/")[0] + "/version"
            async with session.get(url, timeout=_timeout(3)) as resp:
                if resp.status == 200:
                    data = await resp.json(content_type=None)
                    if isinstance(data, dict) and data.get("version"):
                        return f"{self.spec.get('engine', '')} {data['version']}".strip()
        except Exception:  # the version is a courtesy
            pass
        return str(self.spec.get("engine", ""))

    async def _warmup(self, session: Any, balancer: LeastOutstanding) -> None:
        n = max(int(self.traffic.get("warmup_requests", 4) or 0), len(self.engines.replicas))
        plan = traffic_mod.plan_batch(self.traffic, n, self.vocab, self.prompt_mode, salt=99)
        records = []
        for i, p in enumerate(plan):  # one at a time, round-robin: every replica is warm
            first = balancer.prefill
            if first is not None:  # a disaggregated deployment: every prefill server is warmed too
                first = LeastOutstanding([first.endpoints[i % len(first.endpoints)]])
            pinned = LeastOutstanding([balancer.endpoints[i % len(balancer.endpoints)]], first)
            start = time.perf_counter()
            records.append(await send_request(session, pinned, p, self.model_name, start, start + self.grace_s))
        failed = [r for r in records if not r["ok"]]
        if failed:
            self._check_engines("during the warm-up")
            raise ProbeFailure(
                "crash",
                fit(
                    f"{len(failed)} of {len(records)} warm-up requests failed (replica {failed[0]['replica']}): "
                    f"{failed[0]['error']}"
                ),
            )
        self._step(phase="warmup", requests=len(records))

    async def _rates(
        self, session: Any, balancer: LeastOutstanding, sampler: MetricsSampler
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        self.search = search = RateSearch(self.traffic.get("rates") or [], self.tolerance)
        summaries: list[dict[str, Any]] = []
        peak_kv: float | None = None
        preemptions = 0.0
        cache = [0.0, 0.0]  # prefix-cache tokens looked up and served, over every run
        runs_at: dict[float, int] = {}  # a rate's runs so far: each later one draws its own arrivals
        while (load := search.next()) is not None:
            rate, duration = load.rate, self.duration_s * load.scale
            if time.monotonic() + duration > self.search_deadline:
                search.stop(
                    f"no time for {duration:g} s more at {rate:g} req/s ({load.purpose}): the rate search ends by "
                    f"{TIME_SHARE:.0%} of workload.timeout_s"
                )
                log(f"{search.stopped}; the answer is what the runs before found")
                if not summaries:
                    raise ProbeFailure(
                        "timeout",
                        f"workload.timeout_s leaves no time for one rate of traffic.duration_s ({self.duration_s:g} s) "
                        "after the engine started: raise timeout_s or shorten duration_s",
                    )
                break
            plan = traffic_mod.plan_rate(
                self.traffic, rate, self.vocab, self.prompt_mode, salt=runs_at.get(rate, 0), duration_s=duration
            )
            runs_at[rate] = runs_at.get(rate, 0) + 1
            count_cpu = self._cpu_used()
            records, seen = await self._load(session, balancer, sampler, plan, rate)
            used = count_cpu()
            for r in records:
                r.update(rate=rate, run=len(summaries), phase="load", batch=None)
            records = [_ordered(r) for r in sorted(records, key=lambda r: r["id"])]
            self._write(records)
            self._fail_on_errors(records, f"the load at {rate:g} req/s", overload=True)
            summary = serving.summarize_rate(records, self.slo, rate, duration)
            if summary.get("generator_behind"):  # an open loop that could not keep up says so
                log(f"{rate:g} req/s: {summary['generator_behind']}")
            summary.update(used)
            if "kv_cache_usage" in seen:
                summary["kv_cache_usage"] = seen["kv_cache_usage"]
                peak_kv = seen["kv_cache_usage"] if peak_kv is None else max(peak_kv, seen["kv_cache_usage"])
            if "preemptions" in seen:
                summary["preemptions"] = seen["preemptions"]
                preemptions += seen["preemptions"]
            for key in ("running", "waiting"):
                if key in seen:
                    summary[f"max_{key}"] = seen[key]
            if seen.get("prefix_cache_queries"):
                summary["prefix_cache_hit_rate"] = seen.get("prefix_cache_hits", 0.0) / seen["prefix_cache_queries"]
                cache[0] += seen["prefix_cache_queries"]
                cache[1] += seen.get("prefix_cache_hits", 0.0)
            search.report(
                summary["slo_verdict"],
                serving.undecided_why(summary, self.slo),
                measured_met=bool(summary.get("slo_met")),
                # a longer run decides only if it completes the requests a p99 needs to be bounded
                extendable=(summary.get("completed") or 0) * search.longer / load.scale >= serving.requests_to_bound(),
            )
            summaries.append(_with_search(summary, len(summaries), load, duration, search.tried[-1]))
            log(_run_line(summaries[-1]))
            self._step(step=len(summaries) - 1, phase="load", **{k: summary.get(k) for k in _STEP_FIELDS})
        for summary, tried in zip(summaries, search.tried):  # a stop may have settled the last run's count
            summary.update(counted_as_met=tried.counted, why=tried.why)
        view: dict[str, float] = {}
        if peak_kv is not None:
            view["kv_cache_usage"] = peak_kv
        if "preemptions" in sampler.found:
            view["preemptions"] = preemptions
        if cache[0] > 0:
            view["prefix_cache_hit_rate"] = cache[1] / cache[0]
        return summaries, view

    def _cpu_used(self) -> Any:
        """Starts a count of the host's cores the engines and this process (the client) use; calling
        what it returns ends it: ``engine_cpu_cores`` (every process of the engines),
        ``server_cpu_cores`` (the processes the probe launched: vLLM's API server, which streams
        every token), ``client_cpu_cores`` (CPU seconds over the wall seconds between),
        ``client_cpu_wait_share`` (seconds the client's event loop waited for a core, a second) and
        ``host_cpu_cores`` (the cores this process may run on). On a host
        where the engine and its client share the cores, their sum near the host's says the figures
        are the host's as much as the engine's (vLLM's CPU engine on 2 cores: benchmarks/README.md)."""
        engine0, client0, wall0 = self.engines.cpu_s(), _own_cpu_s(), time.perf_counter()
        waited0 = _own_runqueue_wait_s()

        def end() -> dict[str, float]:
            wall = time.perf_counter() - wall0
            engine = self.engines.cpu_s()
            if wall <= 0:
                return {}
            out = {"client_cpu_cores": round((_own_cpu_s() - client0) / wall, 3)}
            waited = _own_runqueue_wait_s()
            if waited is not None and waited0 is not None:
                out["client_cpu_wait_share"] = round((waited - waited0) / wall, 3)
            if engine is not None and engine0 is not None:
                out["engine_cpu_cores"] = round((engine[0] - engine0[0]) / wall, 3)
                out["server_cpu_cores"] = round((engine[1] - engine0[1]) / wall, 3)
            out["host_cpu_cores"] = float(
                len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            )
            return out

        return end

    async def _load(
        self, session: Any, balancer: LeastOutstanding, sampler: MetricsSampler, plan: list, rate: float
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        t0 = time.perf_counter() + 0.05
        deadline = t0 + (plan[-1].at_s if plan else 0.0) + self.grace_s

        async def send(p: Any, start: float) -> dict[str, Any]:
            return await send_request(session, balancer, p, self.model_name, start, deadline)

        tasks = await open_loop(plan, send, t0)
        everything = asyncio.gather(*tasks)
        sampling = asyncio.ensure_future(sampler.during(everything))
        next_beat = time.perf_counter() + HEARTBEAT_S
        try:
            while not everything.done():
                await asyncio.wait([everything], timeout=0.5)
                if self.engines.dead() is not None and not everything.done():
                    # the engine is gone: what is in flight cannot complete, stop waiting for it
                    await asyncio.wait([everything], timeout=2.0)
                    if not everything.done():
                        for t in tasks:
                            t.cancel()
                        await asyncio.gather(*tasks, return_exceptions=True)
                        self._check_engines(f"during the load at {rate:g} req/s")
                now = time.perf_counter()
                if now >= next_beat and not everything.done():
                    finished = sum(1 for t in tasks if t.done())
                    self._step(phase="loading", at_rps=rate, sent=_sent(plan, now - t0), finished=finished)
                    next_beat = now + HEARTBEAT_S
            records = everything.result()
        finally:
            seen = await sampling
        return records, seen

    async def _batches(self, session: Any, balancer: LeastOutstanding) -> dict[str, dict[str, Any]]:
        """Each ``batch_sweep`` size b: b requests of the traffic's mean lengths sent at once to the
        deployment (spread by the balancer), answered before the next size starts."""
        closed: dict[str, dict[str, Any]] = {}
        for b in self.workload.get("batch_sweep") or []:
            b = int(b)
            plan = traffic_mod.plan_batch(self.traffic, b, self.vocab, self.prompt_mode)

            async def send(p: Any, start: float) -> dict[str, Any]:
                return await send_request(
                    session, balancer, p, self.model_name, start, time.perf_counter() + self.grace_s
                )

            records = await closed_batch(plan, send)
            for r in records:
                r.update(rate=None, phase="batch", batch=b)
            records = [_ordered(r) for r in records]
            self._write(records)
            self._fail_on_errors(records, f"the closed-loop batch of {b}")
            summary = serving.batch_summary(records, b)
            closed[str(b)] = summary
            self._step(phase="batch", **{k if k == "batch" else f"batch_{k}": v for k, v in summary.items()})
        return closed

    def _result(
        self,
        summaries: list[dict[str, Any]],
        engine_view: dict[str, float],
        closed: dict[str, dict[str, Any]],
        version: str,
        sampler: MetricsSampler,
    ) -> dict[str, Any]:
        p = self.request.params
        devices = int(p.get("world_size") or trial_devices("serve", p))
        point, met = _operating_point(summaries, self.search)
        metrics = serving.metrics_at(point, met, summaries, devices)
        metrics.update(engine_view)
        for b, s in closed.items():
            for key in ("ttft_ms", "time_for_100_tokens_s", "output_tokens_per_s", "tokens_apart_share"):
                if s.get(key) is not None:
                    metrics[f"batch{b}_{key}"] = float(s[key])
        if self.search is not None:
            metrics.update(_search_metrics(self.search, point if met else None, devices))
        info = {
            "serving": {
                "slo": self.slo,
                "duration_s": self.duration_s,
                "rate_tolerance": self.tolerance,
                "rates": summaries,
                "search": None if self.search is None else self.search.summary(),
                "operating_rate": None if point is None else point["rate"],
                "slo_met": met,
                "requests_file": str(self.records_path),
                "engine": version,
                "closed_loop": closed,
                "devices": devices,
                "replicas": len(self.engines.replicas),
                "metrics_read": sorted(sampler.found),
                "metrics_errors": sampler.errors,
            }
        }
        name, _, number = str(version or "").partition(" ")
        if name and number:  # what the exports' headers and the result cache name as the software
            info["software"] = {name: number}
        return {"metrics": metrics, "info": info}


_STEP_FIELDS = (
    "rate",
    "purpose",
    "scale",
    "slo_met",
    "slo_verdict",
    "counted_as_met",
    "goodput_rps",
    "slo_attainment",
    "requests",
    "failed",
    "ttft_p99_ms",
    "tpot_p99_ms",
    "itl_p99_ms",
    "e2e_p99_ms",
    "output_tokens_per_s",
    "kv_cache_usage",
    "preemptions",
)
_RECORD_ORDER = (
    "rate",
    "run",
    "phase",
    "batch",
    "id",
    "replica",
    "scheduled_s",
    "sent_s",
    "prompt_tokens",
    "asked_tokens",
    "output_tokens",
    "ttft_ms",
    "itl_ms",
    "e2e_ms",
    "ok",
    "error",
    "error_kind",
)


def _own_cpu_s() -> float:
    """CPU seconds (user + system) this process, the probe and its client, has used."""
    t = os.times()
    return t.user + t.system


def _own_runqueue_wait_s() -> float | None:
    """Seconds this process's main thread (the client's event loop) has waited, runnable, for a
    core (Linux ``/proc/self/schedstat``'s second field, ns); None where the kernel does not say.
    The client's lateness on a host whose cores the engine holds is this wait, not its own work:
    on the 2-core machine it used 0.03-0.1 of a core and waited 0.1-1.0 s a second for one."""
    try:
        with open("/proc/self/schedstat", encoding="ascii") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _with_search(summary: dict[str, Any], run: int, load: Load, duration_s: float, tried: Tried) -> dict[str, Any]:
    """A run's summary with what the search made of it: its place in the order of runs (``run``, as
    its requests in ``requests.jsonl`` carry it), why it was made (``purpose``), its length
    (``scale`` x ``duration_s``), whether the search counted the rate as met (``counted_as_met``;
    None: a longer run decides) and why, when it was undecided or overturned."""
    summary.update(
        run=run,
        purpose=load.purpose,
        scale=load.scale,
        duration_s=duration_s,
        counted_as_met=tried.counted,
        why=tried.why,
    )
    return summary


def _run_line(summary: Mapping[str, Any]) -> str:
    counted = {True: "counted as met", False: "counted as not met", None: "a longer run decides"}
    why = f" ({summary['why']})" if summary.get("why") else ""
    return (
        f"{summary['rate']:g} req/s, {summary['purpose']}, {summary['requests']} requests: "
        f"{summary['slo_verdict']}, {counted[summary.get('counted_as_met')]}{why}"
    )


def _operating_point(summaries: list[dict[str, Any]], search: RateSearch | None) -> tuple[dict[str, Any] | None, bool]:
    """(the run the trial's metrics are read from, whether its rate met the SLO): the last run at
    the search's maximum rate that counted as met (the repeat that confirmed it), else, as
    :func:`autotune.objectives.serving.operating_point` says, the lowest rate tried (its last run)."""
    if not summaries:
        return None, False
    best = None if search is None else search.max_rate
    if best is not None:
        runs = [s for s in summaries if s["rate"] == best and s.get("counted_as_met")]
        if runs:
            return runs[-1], True
    lowest = min(float(s["rate"]) for s in summaries)
    return [s for s in summaries if float(s["rate"]) == lowest][-1], False


def _search_metrics(search: RateSearch, point: Mapping[str, Any] | None, devices: int) -> dict[str, float]:
    """The search's figures: the maximum rate's bracket as its interval (``max_rate_rps_ci_low`` the
    highest rate met, ``_ci_high`` the lowest missed; none above when the top rung met, 0 below when
    none met), the relative width reached, and the goodput's interval
    (:func:`autotune.objectives.serving.goodput_interval`: the good share's Clopper-Pearson interval
    at the operating rate, its high end carried up to the lowest rate missed), per device too."""
    low, high = search.bracket
    out: dict[str, float] = {}
    ci_low, ci_high = ci_keys("max_rate_rps")
    out[ci_low] = float(low) if low is not None else 0.0
    if high is not None:
        out[ci_high] = float(high)
    if search.width is not None:
        out["rate_tolerance_reached"] = float(search.width)
    if point is not None:
        interval = serving.goodput_interval(point, high)
        if interval is not None:
            devices = max(int(devices), 1)
            for name, scale in (("goodput_rps", 1.0), ("goodput_rps_per_device", 1.0 / devices)):
                keys = ci_keys(name)
                out[keys[0]], out[keys[1]] = interval[0] * scale, interval[1] * scale
    return out


def _ordered(record: dict[str, Any]) -> dict[str, Any]:
    out = {k: record.get(k) for k in _RECORD_ORDER}
    out.update({k: v for k, v in record.items() if k not in out})
    return out


def _sent(plan: list, elapsed: float) -> int:
    return sum(1 for p in plan if p.at_s <= elapsed)


def _timeout(seconds: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=seconds)


# ---------------------------------------------------------------------- entry point
def _install_signals() -> None:
    def handler(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)


def _quiet_signals() -> None:
    """While stopping the engines: a second signal must not cut the cleanup short."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def _load_engine_spec(trial_dir: Path) -> dict[str, Any]:
    path = trial_dir / ENGINE_FILE
    try:
        spec = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProbeFailure(
            "invalid", f"no {ENGINE_FILE} beside the trial file ({path}): the serving stack preset writes it"
        ) from None
    except ValueError as exc:
        raise ProbeFailure("invalid", f"{path} is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ProbeFailure("invalid", f"{path} must hold a JSON object")
    return spec


def _tolerance(workload: Mapping[str, Any]) -> Any:
    """``workload.rate_tolerance``, the default where a trial file (written before the field
    existed) has none; checked by :func:`autotune.workers.serve_probe.rates.check_tolerance`."""
    value = workload.get("rate_tolerance")
    return TOLERANCE if value is None else value


def _check_workload(request: TrialRequest) -> None:
    """A workload the probe cannot drive fails as ``invalid`` before any engine starts."""
    traffic = dict(request.workload.get("traffic") or {})
    try:
        search = RateSearch(traffic.get("rates") or [], _tolerance(request.workload))
        traffic_mod.plan_rate(traffic, search.ladder[0], 1000, duration_s=0.0)
        traffic_mod.mean_lengths(traffic)
        for b in request.workload.get("batch_sweep") or []:
            if int(b) < 1:
                raise ValueError(f"batch_sweep sizes must be at least 1, got {b}")
    except (ValueError, TypeError, KeyError) as exc:
        raise ProbeFailure("invalid", f"the serving workload cannot be driven: {exc}") from None


def _print_engine_tail(engines: Engines | None, lines: int = 40) -> None:
    if engines is None:
        return
    for replica in engines.replicas:
        tail = replica.log_lines()[-lines:]
        if tail:
            log(f"--- engine replica {replica.index}: last {len(tail)} lines of {replica.log_path} ---")
            for line in tail:
                sys.stderr.write(line[:2000] + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """``python -m autotune.workers.serve_probe [TRIAL_FILE] [--engine ENGINE_JSON]`` (default
    ``$AUTOTUNE_TRIAL_FILE``, and ``engine.json`` beside it). The folder of ``engine.json`` is the
    probe's own (replica folders, ``requests.jsonl``): the dispatcher writes a launch's files into a
    folder of the trial's (``{trial_dir}``). Exit 0 with a metrics line, 1 with a failure event,
    128 + n when terminated by signal n."""
    args = list(sys.argv[1:] if argv is None else argv)
    engine_file: Path | None = None
    if "--engine" in args:
        at = args.index("--engine")
        if at + 1 >= len(args):
            emit({"event": "failure", "status": "invalid", "reason": "--engine needs the path of engine.json"})
            return 2
        engine_file = Path(args[at + 1])
        del args[at : at + 2]
    path = args[0] if args else os.environ.get(TRIAL_FILE_ENV)
    if not path:
        emit({"event": "failure", "status": "invalid", "reason": f"no trial file: pass it or set {TRIAL_FILE_ENV}"})
        return 2
    trial_file = Path(path)
    started = time.monotonic()  # the driver's timeout_s counts from about here: the search's runs end before it
    engines: Engines | None = None
    terminated: Terminated | None = None
    code = 1
    _install_signals()
    try:
        request = read_trial_file(trial_file)
        trial_dir = engine_file.resolve().parent if engine_file else trial_file.resolve().parent
        spec = _load_engine_spec(trial_dir)
        _check_workload(request)
        engines = Engines(spec, trial_dir, request.cluster, request.env(), node_values(os.environ))
        timeout = float(spec.get("startup_timeout_s") or request.workload.get("startup_timeout_s") or 600.0)
        engines.start()
        if engines.follower:  # node 0 runs the API and the load; this node's workers serve it
            log(f"node {engines.node['node_rank']} of {engines.node['nnodes']}: serving node 0's instance")
            gone = engines.serve_node_0()
            if gone.returncode() != 0:
                status, reason = gone.exit_reason("while node 0's instance served", spec.get("startup_failures") or ())
                raise ProbeFailure(status, reason)
            return 0
        log(f"started {len(engines.replicas)} engine replica(s); logs in {trial_dir}/replica*/engine.log")
        priority = engines.priority()
        if priority.get("priority_note"):  # the client may then wait for the engine's cores: say so
            log(f"the engine keeps its priority over the client: {priority['priority_note']}")

        def beat(elapsed: float, waiting: list[int]) -> None:
            emit({"event": "step", "phase": "startup", "elapsed_s": round(elapsed, 1), "waiting_for": waiting})

        startup_s = engines.wait_healthy(timeout, beat)
        log(f"engines healthy after {startup_s:.1f} s")
        result = asyncio.run(Run(request, spec, engines, trial_dir, started).run())
        result["info"]["serving"]["startup_s"] = round(startup_s, 3)
        result["info"]["serving"]["engine_priority"] = priority
        emit(result)
        code = 0
    except ProbeFailure as failure:
        _print_engine_tail(engines)
        emit({"event": "failure", "status": failure.status, "reason": fit(failure.reason)})
        code = 1
    except Terminated as sig:
        terminated = sig
        code = 128 + sig.signum
    finally:
        _quiet_signals()
        if engines is not None:
            log(engines.stop(TERM_GRACE_S if terminated is not None else STOP_GRACE_S))
    return code
