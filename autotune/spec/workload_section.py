"""The spec's workload section: what a trial runs (a training step, offline inference, or serving
under open-loop traffic judged at an SLO) and how a probe measures it.

A serving workload's durations, SLOs and burstiness are finite and bounded (a day; a probe's
timeout, a week). Its ``traffic.lengths_file`` is read by the loader (:mod:`autotune.spec.files`,
cell by cell); the traffic takes the pairs it read (``length_pairs``), or raises the problem it met
at the traffic's path. A module of its own because the serving workload and its traffic are a third
of the schema; :mod:`autotune.spec.schema` re-exports every class here.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from ..workers.trace_prefix import MOONCAKE_BLOCK_TOKENS
from .fields import Strict, read_by_the_loader

__all__ = ["InferWorkload", "LengthRange", "SLOSpec", "ServeWorkload", "TrafficSpec", "TrainWorkload", "Workload"]


# --------------------------------------------------------------------------------------- workload
class TrainWorkload(Strict):
    """A pre-training / fine-tuning step: what one optimizer step processes and how to probe it."""

    kind: Literal["train"] = "train"
    seq_len: int = Field(gt=0, description="tokens per sequence")
    global_batch_size: int = Field(gt=0, description="sequences per optimizer step, all data-parallel ranks")
    warmup_steps: int = Field(2, ge=0, description="probe steps run before timing starts")
    measured_steps: int = Field(5, gt=0, description="probe steps timed (median reported)")
    timeout_s: float = Field(900.0, gt=0, description="a probe running longer is killed and recorded as timeout")
    flash_attention: bool = Field(True, description="fused attention (no s^2 activation term)")
    profile_step: bool = Field(False, description="profile one step and report comm_fraction (torch probe)")


class InferWorkload(Strict):
    """Offline inference: one prefill of ``prompt_len`` tokens then ``gen_len`` decode steps per batch,
    measured at each of ``batch_sizes`` for every config (the points Ascend teams quote: TTFT, time for
    100 tokens, tokens/s at batch 1/4/16). A config is the deployment: tp-wide instances filling the
    cluster (``replicas``), precision, KV-cache dtype, quantization, graph mode."""

    kind: Literal["infer"] = "infer"
    prompt_len: int = Field(gt=0)
    gen_len: int = Field(gt=0)
    batch_sizes: list[int] = Field(
        default_factory=lambda: [1, 4, 16],
        min_length=1,
        description="measurement points, not a knob: every config is measured at each batch size",
    )
    ttft_bound_ms: float | None = Field(
        None, gt=0, description="latency bound: time to first token a batch point must meet (ms)"
    )
    tpot_bound_ms: float | None = Field(
        None, gt=0, description="latency bound: time per output token a batch point must meet (ms)"
    )
    warmup_steps: int = Field(1, ge=0)
    measured_steps: int = Field(3, gt=0)
    timeout_s: float = Field(600.0, gt=0)

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(b <= 0 for b in v):
            raise ValueError("batch sizes must be positive")
        if len(set(v)) != len(v):
            raise ValueError(f"batch sizes repeat: {v}")
        return sorted(v)


class LengthRange(Strict):
    """Token lengths drawn uniformly from ``low..high`` (inclusive)."""

    low: int = Field(gt=0)
    high: int = Field(gt=0)

    @model_validator(mode="after")
    def _order(self) -> "LengthRange":
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) is below low ({self.low})")
        return self


Length = Union[int, LengthRange]


# the traffic's fields the loader fills from lengths_file (autotune.spec.files), and how a spec gives them
_FILLED_BY_THE_LOADER = {
    "length_pairs": "autotune fills it from lengths_file when the spec loads; write the pairs into a lengths "
    "file (JSON lines of {prompt_len, output_len}, or a CSV with those columns) and name it in lengths_file",
    "arrival_times": "autotune fills it from lengths_file when the spec loads (a column arrival_s in seconds, "
    "or the timestamp in milliseconds of Mooncake's trace format)",
    "prefix_blocks": "autotune fills it from lengths_file when the spec loads (the hash_ids of Mooncake's "
    "trace format, each the id of a block_tokens-token block of the prompt)",
}


class TrafficSpec(Strict):
    """The request load a serving probe offers: open loop (arrivals never wait for completions).

    ``rates`` is the ladder that seeds the probe's search for the largest rate that meets the SLO:
    its rungs are bisected to a bracket (the highest met, the lowest missed), which is bisected on
    to the workload's ``rate_tolerance`` (one rate: goodput at that rate only)."""

    rates: list[float] = Field(
        min_length=1,
        description="requests/s offered to the whole deployment, ascending: the range the rate search stays in",
    )
    arrival: Literal["poisson", "gamma", "trace"] = Field(
        "poisson",
        description="inter-arrival distribution; trace: the arrival times of lengths_file, replayed at each rate "
        "(its gaps scaled so their mean is 1/rate: its bursts kept)",
    )
    burstiness: float = Field(1.0, gt=0, description="gamma shape: 1 is Poisson, below 1 burstier")
    prompt_len: Length | None = Field(None, description="prompt tokens: a number or {low, high}")
    output_len: Length | None = Field(None, description="output tokens: a number or {low, high}")
    lengths_file: str | None = Field(
        None, description="JSON lines of {prompt_len, output_len} (or a CSV with those columns), relative to the spec"
    )
    length_pairs: list[tuple[int, int]] | None = Field(
        None, description="set from lengths_file when the spec loads (never written in a spec)"
    )
    arrival_times: list[float] | None = Field(
        None, description="set from lengths_file's arrival times when the spec loads (never written in a spec)"
    )
    prefix_blocks: list[list[int]] | None = Field(
        None, description="set from lengths_file's hash_ids when the spec loads (never written in a spec)"
    )
    block_tokens: int = Field(
        MOONCAKE_BLOCK_TOKENS,
        ge=1,
        le=1 << 20,
        description="tokens per block id of lengths_file's hash_ids (Mooncake's traces: 512)",
    )
    shared_prefix: float = Field(0.0, ge=0, lt=1, description="share of each prompt that all requests share")
    duration_s: float = Field(30.0, gt=0, description="load per rate tried, seconds (at most a day)")
    warmup_requests: int = Field(4, ge=0, description="requests sent before any measurement, not recorded as load")
    seed: int = Field(0, ge=0)

    @field_validator(*_FILLED_BY_THE_LOADER, mode="before")
    @classmethod
    def _filled_by_the_loader(cls, v: Any, info: Any) -> Any:
        if v is not None:  # the loader sets it after validation; written here it would skip the file's checks
            raise ValueError(f"{info.field_name} is not a spec field: {_FILLED_BY_THE_LOADER[info.field_name]}")
        return v

    @field_validator("prompt_len", "output_len", mode="before")
    @classmethod
    def _fixed_length_positive(cls, v: Any) -> Any:
        """A length given as one number is a positive integer: a YAML ``true``/``off`` or 0 is none."""
        if isinstance(v, bool) or (isinstance(v, (int, float)) and v <= 0):
            raise ValueError("a length is a positive integer or {low, high}")
        return v

    @field_validator("duration_s")
    @classmethod
    def _duration(cls, v: float) -> float:
        return _bounded(v, "seconds", MAX_DURATION_S, "1 day")

    @field_validator("burstiness")
    @classmethod
    def _burstiness(cls, v: float) -> float:
        low, high = BURSTINESS_RANGE
        if not (math.isfinite(v) and low <= v <= high):
            raise ValueError(
                f"burstiness is the gamma shape of the gaps between arrivals: a finite number from {low:g} to "
                f"{high:g} (1 is Poisson, below 1 burstier)"
            )
        return v

    @field_validator("rates", mode="before")
    @classmethod
    def _one_rate(cls, v: Any) -> Any:
        return [v] if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @field_validator("rates")
    @classmethod
    def _ascending(cls, v: list[float]) -> list[float]:
        if any(not math.isfinite(r) or r <= 0 for r in v):
            raise ValueError(f"rates are requests per second, finite and > 0; got {v}")
        if sorted(set(v)) != v:
            raise ValueError(f"rates must ascend without repeats (the probe bisects them); got {v}")
        return v

    @model_validator(mode="after")
    def _lengths(self, info: Any) -> "TrafficSpec":
        requests = max(self.rates) * self.duration_s
        if requests > MAX_REQUESTS_PER_RATE:
            raise ValueError(
                f"the highest rate ({max(self.rates):.6g} requests/s) for duration_s ({self.duration_s:g} s) plans "
                f"{requests:.3g} requests per rate; a probe plans at most {MAX_REQUESTS_PER_RATE:,}: lower the "
                "rate or the duration"
            )
        if self.lengths_file is not None:
            if self.prompt_len is not None or self.output_len is not None:
                raise ValueError("give either lengths_file or prompt_len and output_len, not both")
            if self.length_pairs is None:
                read = read_by_the_loader(info, "lengths_file", self.lengths_file)
                if read is None:
                    raise ValueError(
                        "lengths_file is read when the spec loads (autotune.spec.load.load_spec or parse_spec); "
                        "the schema alone reads no file"
                    )
                self.length_pairs, self.arrival_times = read["pairs"], read["arrival_s"]
                self.prefix_blocks = read.get("blocks")
        elif self.length_pairs is None and (self.prompt_len is None or self.output_len is None):
            raise ValueError("the traffic needs prompt_len and output_len (a number or {low, high}), or lengths_file")
        if self.arrival == "trace":
            times = self.arrival_times or []
            if self.lengths_file is None or len(times) < 2 or times[-1] <= times[0]:
                raise ValueError(
                    "arrival trace replays the arrival times of lengths_file: it needs a lengths_file whose rows "
                    "give them (arrival_s in seconds, or Mooncake's timestamp in milliseconds), at least two, "
                    "spanning more than 0 s; "
                    + ("no lengths_file" if self.lengths_file is None else f"{len(times)} given")
                )
        return self

    def longest(self) -> tuple[int, int]:
        """The longest prompt and output this traffic sends (what the engine's context must hold)."""
        if self.length_pairs:
            return max(p for p, _ in self.length_pairs), max(o for _, o in self.length_pairs)
        return _high(self.prompt_len), _high(self.output_len)

    def mean(self) -> tuple[float, float]:
        """The mean prompt and output lengths."""
        if self.length_pairs:
            n = len(self.length_pairs)
            return sum(p for p, _ in self.length_pairs) / n, sum(o for _, o in self.length_pairs) / n
        return _mean(self.prompt_len), _mean(self.output_len)


def _high(length: Length | None) -> int:
    return int(length.high if isinstance(length, LengthRange) else length or 0)


def _mean(length: Length | None) -> float:
    return (length.low + length.high) / 2.0 if isinstance(length, LengthRange) else float(length or 0)


MAX_DURATION_S = 86_400  # a day: traffic.duration_s, workload.startup_timeout_s
MAX_PROBE_TIMEOUT_S = 7 * 86_400  # a week: workload.timeout_s of a serving probe (every rate and the batch sweep)
MAX_SLO_MS = 86_400_000  # a day, in ms: an SLO's latency bound
MAX_REQUESTS_PER_RATE = 10_000_000  # rate x duration_s: the requests a probe plans (and holds) for one rate
BURSTINESS_RANGE = (1e-3, 1e3)  # below, a rate's request count explodes (~1/(2 shape)); above, gaps underflow


def _bounded(value: float, unit: str, cap: float, cap_words: str) -> float:
    """``value`` if finite and at most ``cap``; a ValueError saying so otherwise (a probe computes
    request counts, deadlines and timeouts from these: ``.inf`` made every trial crash)."""
    if not math.isfinite(value) or value > cap:
        raise ValueError(f"expected a finite number of {unit}, at most {cap:,} ({cap_words})")
    return value


class SLOSpec(Strict):
    """The latency targets a served request must meet (p99 over the requests of one rate)."""

    ttft_p99_ms: float = Field(gt=0, description="time to first token, p99, ms")
    tpot_p99_ms: float | None = Field(None, gt=0, description="time per output token after the first, p99, ms")
    itl_p99_ms: float | None = Field(None, gt=0, description="inter-token latency, p99, ms")
    e2e_p99_ms: float | None = Field(None, gt=0, description="end-to-end latency, p99, ms")

    @field_validator("ttft_p99_ms", "tpot_p99_ms", "itl_p99_ms", "e2e_p99_ms")
    @classmethod
    def _bounded_ms(cls, v: float | None) -> float | None:
        return None if v is None else _bounded(v, "milliseconds", MAX_SLO_MS, "1 day")


class ServeWorkload(Strict):
    """Serving: an engine (vLLM / vLLM-Ascend, MindIE) under open-loop traffic, judged at an SLO."""

    kind: Literal["serve"] = "serve"
    traffic: TrafficSpec
    slo: SLOSpec
    batch_sweep: list[int] = Field(
        default_factory=lambda: [1, 4, 16],
        description="closed-loop concurrencies measured too (TTFT, time for 100 tokens, tokens/s); [] skips",
    )
    max_model_len: int | None = Field(None, gt=0, description="the engine's context; default: longest prompt + output")
    startup_timeout_s: float = Field(600.0, gt=0, description="an engine not healthy by then is recorded as timeout")
    timeout_s: float = Field(3600.0, gt=0, description="a probe running longer is killed and recorded as timeout")
    rate_tolerance: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="the rate search stops when (lowest rate missed - highest met) / highest met is at most this; "
        "each halving costs one more rate of duration_s",
    )

    @field_validator("batch_sweep")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(b <= 0 for b in v):
            raise ValueError("batch sizes must be positive")
        return v

    @field_validator("startup_timeout_s")
    @classmethod
    def _startup(cls, v: float) -> float:
        return _bounded(v, "seconds", MAX_DURATION_S, "1 day")

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, v: float) -> float:
        return _bounded(v, "seconds", MAX_PROBE_TIMEOUT_S, "a week")

    @model_validator(mode="after")
    def _context(self) -> "ServeWorkload":
        prompt, output = self.traffic.longest()
        if self.max_model_len is None:
            self.max_model_len = prompt + output
        elif self.max_model_len < prompt + output:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is below the longest prompt + output the traffic sends "
                f"({prompt} + {output}); raise it or shorten the traffic"
            )
        return self


Workload = Union[TrainWorkload, InferWorkload, ServeWorkload]
