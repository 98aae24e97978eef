"""The serving model's queueing against a discrete-event run of vLLM's scheduler on the model's own
step times (issue 46: "validate the queueing model against measured per-rate percentiles").

The serving model prices an engine in two parts: the time of one engine step T(B, c) (B decoding
sequences, c prompt tokens) and a queueing estimate of what Poisson traffic does with those steps
(the running concurrency, the prompts mixed into decode steps, the waits: ``workers/simulate/_serve.py``).
A measured engine mixes errors of both parts. This run isolates the second: it replays vLLM V1's
scheduler (``vllm/v1/core/sched/scheduler.py``: the running requests first, a decode token each or
their prompt's next chunk, then the waiting requests in arrival order while a slot and the token
budget last; without chunked prefill a waiting prompt that does not fit the budget stops the
admission), each step taking the model's own T(B, c), and reads the percentiles off the requests. Where
the model's figures differ from the scheduler's here, the queueing estimate is wrong, whatever the
hardware does. Left out of the replay as of the model: preemption (the cases hold their KV cache), the
prefix cache, speculative decoding.

Cases: DistServe's colocated OPT-13B on one A100 (512 in / 64 out, whole prompts), Llama-2-70B chat on
8 x 910B at tp 8 (this repository's disaggregated spec's aggregated layout, prompts 512-2048 and outputs
128-512, chunked prefill), Llama-2-7B on one A100 (chunked, short prompts, a large batch); and two
disaggregated deployments, DistServe's 2P1D of the same OPT-13B and the spec's prefill tp8 + decode tp8
of the 70B on two nodes, replayed pool by pool (:func:`replay_disaggregated`: each instance under the
same scheduler, the KV transfer as the model prices it). Each at rates from light load to past the SLO's
limit, a 600 s window, two seeds.

    python benchmarks/serving_queue_vs_scheduler.py [--quick] [--json PATH]

About 25 seconds on two cores (``--quick``: one case, three rates, under a second).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from serving_disagg_published import OPT_13B, Deployment

from autotune.spec.models import PRESETS
from autotune.workers.simulate import _serve

LLAMA2_70B = {"name": "llama2-70b", "arch": "llama", **PRESETS["llama2-70b"]}
LLAMA2_7B = {"name": "llama2-7b", "arch": "llama", **PRESETS["llama2-7b"]}
QUANTILES = (50, 90, 99)


@dataclass
class Case:
    """One engine (one replica), its traffic's lengths (uniform integers, low..high, as the spec's
    ``prompt_len: {low, high}``) and the rates and p99 targets (ms) it is read at."""

    name: str
    model: dict
    hw: str
    params: dict
    prompt: tuple[int, int]
    output: tuple[int, int]
    rates: tuple[float, ...]
    slo: dict[str, float]
    accelerator: str = "cuda"
    nodes: int = 1

    def at(self, rate: float, duration: float = 600.0) -> dict[str, float]:
        """The model's figures (ms) at ``rate`` requests/s over a window of ``duration`` seconds."""
        return self.deployment.at(rate, duration)

    @cached_property
    def deployment(self) -> Deployment:
        """The case as the model prices it (its profile loaded once)."""
        return Deployment(
            self.model, self.hw, self.params, self.prompt, self.output, nodes=self.nodes, accelerator=self.accelerator
        )


def engines_of(case: Case) -> list[_serve.Engine]:
    """The model's engines for one case (priced at a light rate), recorded on the way: the aggregated
    one, then for a disaggregated layout its prefill pool's and its decode pool's."""
    from autotune.workers.simulate import _serve_disagg

    seen: list[_serve.Engine] = []
    original = _serve.Engine

    class Recorded(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            seen.append(self)

    _serve.Engine = _serve_disagg.Engine = Recorded
    try:
        case.at(0.1)
    finally:
        _serve.Engine = _serve_disagg.Engine = original
    return seen


def engine_of(case: Case) -> _serve.Engine:
    return engines_of(case)[0]


def transfer_time(pre: _serve.Engine, dec: _serve.Engine, case: Case):
    """A prompt's KV transfer (s) from a prefill instance to a decode instance, as the model prices it
    (``_serve_disagg``: the connector's path, its efficiency and handshake, the links both pools use)."""
    from autotune.workers.simulate import _serve_disagg as dg

    hw = dec.hw
    path, eff, hand = dg.TRANSPORTS[dg.kv_connector_on(dg.CONNECTORS[0], hw.accelerator)]
    devices = (float(dec.r.ravel()[0]) * dec.t + case.params["prefill_replicas"] * pre.t) * dec.p
    links = float((np.minimum(pre.t, dec.t) * dec.p).ravel()[0])
    link = (hw.intra if float(devices.ravel()[0]) <= hw.dpn else hw.inter) * eff * links
    bw = dg.STORAGE_BYTES_PER_S if path == "storage" else link
    kv_tok = float(np.ravel(dg._kv_bytes_per_token(dec.s, dec))[0])
    return lambda tokens: hand + tokens * kv_tok / bw


def replay_disaggregated(case: Case, lam: float, duration: float, seed: int) -> dict[str, np.ndarray]:
    """A disaggregated deployment under vLLM's scheduler on each instance: every request to a prefill
    instance (drawn at random, as the model's even split of Poisson arrivals), its prompt prefilled
    there (a prompt-only engine), its KV cache sent, then to a decode instance (at random), which
    computes the prompt's last token and decodes. TTFT ends at the decode instance's first token."""
    _, pre, dec = engines_of(case)
    arrival, prompts, outs, rng = traffic(lam, duration, case.prompt, case.output, seed)
    n = arrival.size
    r_p, r_d = int(case.params["prefill_replicas"]), int(case.params.get("replicas", 1))
    ready = np.empty(n)
    where = rng.integers(0, r_p, n)
    for i in range(r_p):
        mine = np.flatnonzero(where == i)
        first, _, _ = serve(
            step_time(pre),
            arrival[mine],
            prompts[mine],
            np.ones(mine.size, dtype=np.int64),
            int(float(pre.mns.ravel()[0])),
            int(float(pre.mbt.ravel()[0])),
            bool(pre.chunked.ravel()[0]),
        )
        ready[mine] = first
    ready += transfer_time(pre, dec, case)(prompts.astype(float))
    first, done_at, gaps = np.empty(n), np.empty(n), []
    where = rng.integers(0, r_d, n)
    slots = int(min(float(dec.mns.ravel()[0]), float(dec.B_kv.ravel()[0])))
    for j in range(r_d):
        mine = np.flatnonzero(where == j)
        mine = mine[np.argsort(ready[mine], kind="stable")]
        f, d, g = serve(
            step_time(dec),
            ready[mine],
            np.ones(mine.size, dtype=np.int64),
            outs[mine],
            slots,
            int(float(dec.mbt.ravel()[0])),
            True,
        )
        first[mine], done_at[mine] = f, d
        gaps += g
    return figures(arrival, first, done_at, outs, gaps, dec.api)


def step_time(engine: _serve.Engine):
    """T(B, c) of one step of the model's engine, in seconds, memoised (the replay asks for the same
    shapes again and again)."""
    cache: dict[tuple[int, int], float] = {}

    def t(b: int, c: int) -> float:
        key = (b, c)
        if key not in cache:
            cache[key] = float(engine.iteration(np.full((1, 1), float(b)), np.full((1, 1), float(c))).ravel()[0])
        return cache[key]

    return t


def serve(
    step, arrival: np.ndarray, prompts: np.ndarray, outs: np.ndarray, slots: int, budget: int, chunked: bool
) -> tuple[np.ndarray, np.ndarray, list[tuple[float, int]]]:
    """One engine under vLLM V1's scheduler, the requests arriving at ``arrival`` (sorted) with
    ``prompts`` tokens still to compute and ``outs`` tokens to produce, served to the last: each
    request's first-token and last-token times, and the steps' (length, decoding sequences)."""
    n = arrival.size
    left = prompts.copy()  # prompt tokens not yet computed
    made = np.zeros(n, dtype=np.int64)  # output tokens
    first = np.full(n, np.nan)
    done_at = np.full(n, np.nan)
    waiting: deque[int] = deque()
    running: list[int] = []
    t, a, finished = 0.0, 0, 0
    gaps: list[tuple[float, int]] = []
    while finished < n:
        while a < n and arrival[a] <= t:
            waiting.append(a)
            a += 1
        if not running and not waiting:
            t = arrival[a]
            continue
        room, decodes, chunks = budget, [], []
        for r in running:  # the running requests first
            if room <= 0:
                break
            k = 1 if left[r] == 0 else min(int(left[r]), room)
            (decodes if left[r] == 0 else chunks).append((r, k))
            room -= k
        while waiting and room > 0 and len(running) < slots:
            r = waiting[0]
            if not chunked and left[r] > room:
                break  # an unchunked prompt only whole: admission stops
            waiting.popleft()
            running.append(r)
            k = min(int(left[r]), room)
            chunks.append((r, k))
            room -= k
        dt = step(len(decodes), sum(k for _, k in chunks))
        t += dt
        if decodes:  # every decoding sequence's inter-token latency is this step
            gaps.append((dt, len(decodes)))
        ended = []
        for r, _ in decodes:
            made[r] += 1
            if made[r] >= outs[r]:
                ended.append(r)
        for r, k in chunks:
            left[r] -= k
            if left[r] == 0:
                first[r] = t
                made[r] = 1
                if made[r] >= outs[r]:
                    ended.append(r)
        for r in ended:
            done_at[r] = t
            running.remove(r)
            finished += 1
    return first, done_at, gaps


def traffic(lam: float, duration: float, prompt: tuple[int, int], output: tuple[int, int], seed: int):
    """Poisson arrivals at ``lam`` over ``duration`` seconds, uniform integer lengths."""
    rng = np.random.default_rng(seed)
    n = max(1, rng.poisson(lam * duration))
    arrival = np.sort(rng.uniform(0.0, duration, n))
    return arrival, rng.integers(prompt[0], prompt[1] + 1, n), rng.integers(output[0], output[1] + 1, n), rng


def figures(arrival, first, done_at, outs, gaps, api: float) -> dict[str, np.ndarray]:
    ttft = first - arrival + api
    tpot = np.where(outs > 1, (done_at - first) / np.maximum(outs - 1, 1), np.nan)
    itl = np.array(gaps, dtype=float).reshape(-1, 2)
    return {"ttft": ttft, "tpot": tpot[outs > 1], "itl": itl[:, 0], "itl_weight": itl[:, 1]}


def replay(
    step,
    lam: float,
    duration: float,
    prompt: tuple[int, int],
    output: tuple[int, int],
    slots: int,
    budget: int,
    chunked: bool,
    api: float,
    seed: int,
) -> dict[str, np.ndarray]:
    """vLLM V1's scheduler over Poisson arrivals at ``lam`` for ``duration`` seconds, served to the
    last request: every request's TTFT, TPOT and inter-token gaps (s)."""
    arrival, prompts, outs, _ = traffic(lam, duration, prompt, output, seed)
    first, done_at, gaps = serve(step, arrival, prompts, outs, slots, budget, chunked)
    return figures(arrival, first, done_at, outs, gaps, api)


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The q-th percentile of values each counted ``weights`` times (a step's gap, once per sequence in it)."""
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, q / 100.0 * cum[-1])])


def compare(case: Case, seeds: int = 2, duration: float = 600.0) -> list[dict[str, Any]]:
    """Per rate: the model's TTFT and TPOT percentiles (ms) beside the scheduler's (seeds pooled)."""
    eng = engine_of(case)
    step = step_time(eng)
    slots = int(min(float(eng.mns.ravel()[0]), float(eng.B_kv.ravel()[0])))
    budget, chunked = int(eng.mbt.ravel()[0]), bool(eng.chunked.ravel()[0])
    rows = []
    for lam in case.rates:
        model = case.at(lam, duration)
        if case.params.get("prefill_replicas"):
            runs = [replay_disaggregated(case, lam, duration, s) for s in range(seeds)]
        else:
            runs = [
                replay(step, lam, duration, case.prompt, case.output, slots, budget, chunked, eng.api, s)
                for s in range(seeds)
            ]
        ttft = np.concatenate([r["ttft"] for r in runs]) * 1e3
        tpot = np.concatenate([r["tpot"] for r in runs]) * 1e3
        itl, weight = (np.concatenate([r[k] for r in runs]) for k in ("itl", "itl_weight"))
        row = {"case": case.name, "rate": lam, "requests": int(ttft.size)}
        for q in QUANTILES:
            row[f"model_ttft_p{q}"] = model[f"ttft_p{q}_ms"]
            row[f"des_ttft_p{q}"] = float(np.percentile(ttft, q))
            row[f"model_tpot_p{q}"] = model[f"tpot_p{q}_ms"]
            row[f"des_tpot_p{q}"] = float(np.percentile(tpot, q))
            row[f"model_itl_p{q}"] = model[f"itl_p{q}_ms"]
            row[f"des_itl_p{q}"] = weighted_percentile(itl * 1e3, weight, q)
        row["model_meets"] = all(model[f"{k}"] <= v for k, v in case.slo.items())
        row["des_meets"] = all(row[f"des_{k.replace('_ms', '')}"] <= v for k, v in case.slo.items())
        rows.append(row)
    return rows


def cases(quick: bool) -> list[Case]:
    a100, npu = "a100-sxm-80gb", "ascend-910b"
    out = [
        Case(
            "OPT-13B, 1 x A100, 512/64, whole prompts",
            OPT_13B,
            a100,
            {"tp": 1, "enable_chunked_prefill": False},
            (512, 512),
            (64, 64),
            (1.0, 2.0, 4.0) if quick else (0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0),
            {"ttft_p99_ms": 400.0, "tpot_p99_ms": 40.0},
        )
    ]
    if quick:
        return out
    out += [
        Case(
            "Llama-2-70B chat, tp8 on 910B, 512-2048 / 128-512, chunked",
            LLAMA2_70B,
            npu,
            {"tp": 8, "max_num_seqs": 256, "max_num_batched_tokens": 4096},
            (512, 2048),
            (128, 512),
            (0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0),
            {"ttft_p99_ms": 2000.0, "tpot_p99_ms": 60.0},
            accelerator="npu",
        ),
        Case(
            "Llama-2-7B, 1 x A100, 128-512 / 64-256, chunked",
            LLAMA2_7B,
            a100,
            {"tp": 1, "max_num_seqs": 256, "max_num_batched_tokens": 2048},
            (128, 512),
            (64, 256),
            (2.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0),
            {"ttft_p99_ms": 500.0, "tpot_p99_ms": 30.0},
        ),
        Case(
            "OPT-13B, 2 prefill + 1 decode A100s (DistServe's 2P1D)",
            OPT_13B,
            a100,
            {"tp": 1, "enable_chunked_prefill": False, "prefill_replicas": 2, "replicas": 1},
            (512, 512),
            (64, 64),
            (2.0, 4.0, 6.0, 8.0, 9.0),
            {"ttft_p99_ms": 400.0, "tpot_p99_ms": 40.0},
        ),
        Case(
            "Llama-2-70B chat, prefill tp8 + decode tp8 on 2 x 8 910B",
            LLAMA2_70B,
            npu,
            {"tp": 8, "prefill_replicas": 1, "prefill_tp": 8, "max_num_seqs": 256, "max_num_batched_tokens": 4096},
            (512, 2048),
            (128, 512),
            (0.5, 1.0, 2.0, 3.0, 3.5),
            {"ttft_p99_ms": 2000.0, "tpot_p99_ms": 60.0},
            accelerator="npu",
            nodes=2,
        ),
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one case, three rates (a smoke run)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    for case in cases(args.quick):
        rows += compare(case, seeds=1 if args.quick else 2, duration=120.0 if args.quick else 600.0)
    print(
        "| case | req/s | TTFT p50 model / scheduler | TTFT p99 | TPOT p50 | TPOT p99 | ITL p99 "
        "| SLO met: model / scheduler |"
    )
    print("|---|---:|---|---|---|---|---|---|")
    for r in rows:
        cells = [
            f"{r[f'model_{m}_p{q}']:.0f} / {r[f'des_{m}_p{q}']:.0f}"
            for m, q in (("ttft", 50), ("ttft", 99), ("tpot", 50), ("tpot", 99), ("itl", 99))
        ]
        met = f"{'yes' if r['model_meets'] else 'no'} / {'yes' if r['des_meets'] else 'no'}"
        print(f"| {r['case']} | {r['rate']:g} | " + " | ".join(cells) + f" | {met} |")
    agree = sum(r["model_meets"] == r["des_meets"] for r in rows)
    print(f"\nthe SLO verdict agrees at {agree} of {len(rows)} rates", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
