"""The requests of one offered rate: when each is sent and what it asks for, decided before any is sent.

Arrival times are drawn up front (an open loop): a request's send time never depends on how fast
earlier ones completed, so a server that falls behind sees its queue grow, as it would in
production, instead of a client that politely waits (a closed loop hides the overload that the
SLO is about). Gaps are gamma-distributed with shape = burstiness and mean 1/rate, vLLM's
``benchmarks/serve.py`` rule: shape 1 is a Poisson process, below 1 burstier, above 1 more even. A
trace (``arrival: trace``) is replayed instead: its own gaps, scaled to the rate, with its own lengths.

Lengths are fixed, uniform over an inclusive range, or drawn (with replacement) from the
workload's length pairs. A shared prefix is the first ``shared_prefix`` share of every prompt,
the same tokens in every request, so prefix caching has something to reuse; a trace with block ids
(Mooncake's ``hash_ids``) builds each prompt from its blocks' tokens instead, the same block id the
same tokens, so a conversation's later turns share their history as they did in production. Everything is drawn
from a generator seeded by (seed, rate, run): a rate's requests are the same whichever order the
rate search tries it in, and the same in every trial of a study, so configs are compared on
identical traffic. A rate's later runs (the longer run of an undecided rate, the repeat that
confirms the operating rate) draw their own arrivals (``salt``): a repeat of the same requests would
only confirm the engine's determinism, not that the rate holds under the traffic's randomness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = [
    "Planned",
    "arrival_times",
    "trace_requests",
    "draw_lengths",
    "draw_rows",
    "plan_rate",
    "plan_batch",
    "mean_lengths",
    "rng_for",
    "burstiness_of",
]

_FIRST_ID = 10  # token ids below this are left alone (BOS/EOS/PAD of most vocabularies)
# for engines given text prompts: short common words, about one token each in BPE vocabularies
_WORDS = ("the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "at", "by", "from", "this", "that", "it")


@dataclass
class Planned:
    """One request to send: ``at_s`` after the rate's start, ``prompt`` (token ids or text)."""

    id: int
    at_s: float
    prompt: list[int] | str
    prompt_len: int
    output_len: int


def rng_for(seed: int, rate: float | None, salt: int = 0) -> np.random.Generator:
    """The generator of one rate's (or one closed-loop batch's) traffic: depends only on the seed
    and the rate, never on what was drawn before."""
    key = 0 if rate is None else int(round(float(rate) * 1_000_000))
    return np.random.default_rng([int(seed), key, int(salt)])


def arrival_times(rate: float, duration_s: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Send times in [0, duration_s): the first at 0, then gamma gaps (shape ``burstiness``,
    mean 1/rate). At least one request, however short the window."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    scale = 1.0 / (rate * burstiness)
    times = [0.0]
    # draw in blocks: the expected count is rate * duration
    while True:
        gaps = rng.gamma(shape=burstiness, scale=scale, size=max(16, int(rate * duration_s * 1.5) + 1))
        for gap in gaps:
            t = times[-1] + float(gap)
            if t >= duration_s:
                return times
            times.append(t)


def _length(spec: Any, n: int, rng: np.random.Generator, what: str) -> np.ndarray:
    if isinstance(spec, Mapping):
        low, high = int(spec["low"]), int(spec["high"])
        if low < 1 or high < low:
            raise ValueError(f"{what}: need 1 <= low <= high, got {dict(spec)}")
        return rng.integers(low, high + 1, size=n)
    value = int(spec)
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {spec!r}")
    return np.full(n, value, dtype=int)


def draw_lengths(traffic: Mapping[str, Any], n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """``n`` (prompt_len, output_len) pairs: from ``length_pairs`` when given, else from
    ``prompt_len`` and ``output_len`` (ints or ``{low, high}`` inclusive ranges)."""
    return draw_rows(traffic, n, rng)[0]


def draw_rows(
    traffic: Mapping[str, Any], n: int, rng: np.random.Generator
) -> tuple[list[tuple[int, int]], list[int | None]]:
    """:func:`draw_lengths`, and the row of ``length_pairs`` each pair came from (None for drawn
    lengths): a trace's row also names its prompt's blocks."""
    pairs = traffic.get("length_pairs")
    if pairs:
        idx = rng.integers(0, len(pairs), size=n)
        return [(int(pairs[i][0]), int(pairs[i][1])) for i in idx], [int(i) for i in idx]
    prompts = _length(traffic.get("prompt_len", 128), n, rng, "prompt_len")
    outputs = _length(traffic.get("output_len", 128), n, rng, "output_len")
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)], [None] * n


def mean_lengths(traffic: Mapping[str, Any]) -> tuple[int, int]:
    """The traffic's mean prompt and output lengths (rounded): the closed-loop batches' lengths."""
    pairs = traffic.get("length_pairs")
    if pairs:
        return (
            max(1, round(sum(int(p[0]) for p in pairs) / len(pairs))),
            max(1, round(sum(int(p[1]) for p in pairs) / len(pairs))),
        )

    def mean(spec: Any) -> int:
        if isinstance(spec, Mapping):
            return max(1, round((int(spec["low"]) + int(spec["high"])) / 2))
        return max(1, int(spec))

    return mean(traffic.get("prompt_len", 128)), mean(traffic.get("output_len", 128))


class _Prompts:
    """Builds prompts of a given length whose first ``share`` is common to all requests."""

    def __init__(
        self, share: float, vocab_size: int, mode: str, rng: np.random.Generator, seed: int = 0, block_tokens: int = 512
    ) -> None:
        self.share = min(max(float(share or 0.0), 0.0), 1.0)
        self.high = max(int(vocab_size) - 1, _FIRST_ID + 1)
        self.mode = mode
        self.prefix_rng = rng  # the shared prefix: the seed's alone, the same in every run
        self.rng = rng  # the rest of each prompt: the run's (plan_rate, plan_batch set it)
        self.prefix: list[int] = []
        self.block_tokens = max(int(block_tokens), 1)
        self.block_key: tuple[int, ...] = (int(seed),)  # whose blocks: a run's own (plan_rate sets it)
        self.blocks: dict[int, list[int]] = {}  # a trace's block id -> its tokens

    def _ids(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(_FIRST_ID, self.high, size=n)]

    def make(self, length: int, blocks: Sequence[int] | None = None) -> list[int] | str:
        """A prompt of ``length`` tokens: the traffic's shared prefix then fresh tokens; or, with a
        trace's block ids, each block's tokens (the same for the same id: its prefix shared with every
        request that names it), then fresh tokens where the blocks end first."""
        if blocks is not None:
            ids = [t for block in blocks for t in self._block(int(block))][:length]
            ids += self._ids(length - len(ids))
        else:
            shared = int(round(self.share * length))
            if len(self.prefix) < shared:
                self.prefix += [
                    int(x) for x in self.prefix_rng.integers(_FIRST_ID, self.high, size=shared - len(self.prefix))
                ]
            ids = self.prefix[:shared] + self._ids(length - shared)
        if self.mode == "text":
            return " ".join(_WORDS[i % len(_WORDS)] for i in ids)
        return ids

    def _block(self, block: int) -> list[int]:
        if block not in self.blocks:
            rng = np.random.default_rng([*self.block_key, 11, block])
            self.blocks[block] = [int(x) for x in rng.integers(_FIRST_ID, self.high, size=self.block_tokens)]
        return self.blocks[block]


def _prompt_source(traffic: Mapping[str, Any], vocab_size: int, mode: str) -> _Prompts:
    # the shared prefix is the same for every rate of the study: drawn from the seed alone
    seed = int(traffic.get("seed", 0))
    return _Prompts(
        traffic.get("shared_prefix", 0.0),
        vocab_size,
        mode,
        rng_for(seed, None, salt=7),
        seed,
        int(traffic.get("block_tokens") or 512),
    )


def burstiness_of(traffic: Mapping[str, Any]) -> float:
    """The gamma shape of the arrivals: 1 (Poisson) unless the arrival is ``gamma``."""
    if str(traffic.get("arrival", "poisson")) == "gamma":
        return float(traffic.get("burstiness", 1.0))
    return 1.0


def trace_requests(
    traffic: Mapping[str, Any], rate: float, duration_s: float, rng: np.random.Generator
) -> list[tuple[float, tuple[int, int], int]]:
    """A trace replayed at ``rate`` (``arrival: trace``): its requests in order from a row the
    generator draws (a rate's later runs start elsewhere), each with its own lengths (and its row,
    whose block ids make its prompt), the gaps between them scaled by the trace's mean gap over
    1/rate, so its bursts and quiet spells stay and their mean is the rate offered; the trace wraps
    around when the window outlasts it."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    times = np.asarray(traffic["arrival_times"], dtype=float)
    pairs = traffic["length_pairs"]
    gaps = np.diff(times)
    mean_gap = float(gaps.mean()) if gaps.size else 0.0
    if mean_gap <= 0:
        raise ValueError("the trace's arrival times span 0 s: no rate to scale")
    scale = 1.0 / (rate * mean_gap)
    i = int(rng.integers(0, len(pairs)))
    t, out = 0.0, []
    while t < duration_s:
        out.append((t, (int(pairs[i][0]), int(pairs[i][1])), i))
        t += float(gaps[i % gaps.size]) * scale
        i = (i + 1) % len(pairs)
    return out


def plan_rate(
    traffic: Mapping[str, Any],
    rate: float,
    vocab_size: int,
    mode: str = "token_ids",
    salt: int = 0,
    duration_s: float | None = None,
) -> list[Planned]:
    """Every request of one run at an offered rate, in send order: ``salt`` numbers the rate's runs
    (0: its first, the same traffic in every trial), ``duration_s`` replaces the traffic's
    (a longer run sends more requests)."""
    rng = rng_for(int(traffic.get("seed", 0)), rate, salt)
    duration = float(traffic.get("duration_s", 30.0) if duration_s is None else duration_s)
    table = traffic.get("prefix_blocks")
    if str(traffic.get("arrival", "poisson")) == "trace":
        replay = trace_requests(traffic, rate, duration, rng)
        times, lengths, rows = [t for t, _, _ in replay], [pair for _, pair, _ in replay], [r for _, _, r in replay]
    else:
        times = arrival_times(rate, duration, burstiness_of(traffic), rng)
        lengths, rows = draw_rows(traffic, len(times), rng)
    prompts = _prompt_source(traffic, vocab_size, mode)
    # each run's prompts are its own past the shared prefix and the trace's blocks: a run that re-sent
    # an earlier run's prompts would find them in the engine's prefix cache (on by default in vLLM)
    # and measure a prefill it never pays in production
    prompts.rng = rng_for(int(traffic.get("seed", 0)), rate, 1_000_000 + salt)
    # and so are the trace's blocks: within a run the turns of a conversation share their history, but
    # a later run (another rate, a repeat) replays other conversations, never ones the engine has cached
    prompts.block_key = (int(traffic.get("seed", 0)), int(round(rate * 1000)), salt)
    return [
        Planned(i, t, prompts.make(p, table[r] if table and r is not None else None), p, o)
        for i, (t, (p, o), r) in enumerate(zip(times, lengths, rows))
    ]


def plan_batch(
    traffic: Mapping[str, Any], batch: int, vocab_size: int, mode: str = "token_ids", salt: int = 1
) -> list[Planned]:
    """``batch`` requests of the traffic's mean lengths, all sent at once (a closed-loop batch)."""
    prompt_len, output_len = mean_lengths(traffic)
    prompts = _prompt_source(traffic, vocab_size, mode)
    prompts.rng = rng_for(int(traffic.get("seed", 0)), None, salt=1000 + salt * 10_000 + batch)
    return [Planned(i, 0.0, prompts.make(prompt_len), prompt_len, output_len) for i in range(batch)]
