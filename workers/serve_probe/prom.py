"""The engine's own view of the load, from its Prometheus ``/metrics`` page.

KV-cache use and preemptions are things only the engine knows (the client sees latencies, not
why). The page is parsed with ``prometheus_client``'s own parser, not regexes: label sets,
escaping, ``_total`` suffixes and exponent formats are its problem. Which names to read comes from
``engine.json`` (``metrics_names``: vLLM's ``vllm:kv_cache_usage_perc``, MindIE's own names...),
a list per quantity, the first name the page has wins (an engine renames its metrics between
versions). Label sets are combined per quantity: the highest KV-cache use, the sum of the rest
(several engines in one server report one series each).
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["parse_metrics", "MetricsSampler"]

_MAX = frozenset({"kv_cache_usage"})  # combined as the highest value; the others are summed
_COUNTERS = frozenset(
    {"preemptions", "prefix_cache_queries", "prefix_cache_hits"}
)  # cumulative: a phase's count is its increase


def parse_metrics(text: str, names: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """``{quantity: value}`` for each quantity of ``names`` that the page ``text`` has. A name
    matches a sample's name (``vllm:num_preemptions_total``) or its family's
    (``vllm:num_preemptions``: the parser strips a counter's ``_total``)."""
    samples: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # a counter's creation time, not its value
            samples.setdefault(sample.name, []).append(float(sample.value))
            if sample.name != family.name:
                samples.setdefault(family.name, []).append(float(sample.value))
    out: dict[str, float] = {}
    for quantity, candidates in names.items():
        if isinstance(candidates, str):
            candidates = [candidates]
        for name in candidates:
            values = samples.get(name)
            if values:
                out[quantity] = max(values) if quantity in _MAX else sum(values)
                break
    return out


class MetricsSampler:
    """Scrapes every replica's metrics page every ``interval_s`` while a phase runs: the highest
    KV-cache use seen, and the counters at the start and the end (their difference is the phase's
    count). A page that cannot be read is noted, never fatal: latencies are the measurement."""

    def __init__(self, session: Any, urls: Sequence[str], names: Mapping[str, Sequence[str]], interval_s: float = 0.5):
        self.session = session
        self.urls = list(urls)
        self.names = names
        self.interval_s = interval_s
        self.errors: list[str] = []
        self.found: set[str] = set()

    async def scrape(self) -> list[dict[str, float]]:
        """One reading per replica (an empty dict for a page that could not be read)."""

        async def one(url: str) -> dict[str, float]:
            try:
                async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}")
                    text = await resp.text()
                values = parse_metrics(text, self.names)
                self.found.update(values)
                return values
            except Exception as exc:  # any failure to read is only noted
                if len(self.errors) < 5:
                    self.errors.append(f"{url}: {type(exc).__name__}: {exc}"[:300])
                return {}

        return list(await asyncio.gather(*(one(u) for u in self.urls)))

    async def during(self, phase: "asyncio.Future[Any]") -> dict[str, float]:
        """Sample until ``phase`` is done. Counters (``preemptions``) give their increase over
        the phase, summed over replicas; gauges their highest value seen: KV-cache use the
        highest of any replica, queue lengths (``running``, ``waiting``) summed over replicas."""
        first = await self.scrape()
        peaks: dict[str, float] = {}

        def note(readings: list[dict[str, float]]) -> None:
            for quantity in self.names:
                if quantity in _COUNTERS:
                    continue
                values = [r[quantity] for r in readings if quantity in r]
                if values:
                    value = max(values) if quantity in _MAX else sum(values)
                    peaks[quantity] = max(peaks.get(quantity, value), value)

        note(first)
        while not phase.done():
            await asyncio.wait([phase], timeout=self.interval_s)
            if not phase.done():
                note(await self.scrape())
        last = await self.scrape()
        note(last)
        out = dict(peaks)
        for quantity in self.names:
            if quantity in _COUNTERS:
                pairs = [(a[quantity], b[quantity]) for a, b in zip(first, last) if quantity in a and quantity in b]
                if pairs:
                    out[quantity] = sum(max(b - a, 0.0) for a, b in pairs)
        return out
