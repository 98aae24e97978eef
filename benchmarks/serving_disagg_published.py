"""Disaggregated serving against published figures (issue 46): what the serving model says a prefill
pool and a decode pool win over aggregated engines, beside what the papers and tools published.

Every row names its source (file and commit, or address) and the published layout, lengths and SLO.
Nothing is fitted: the bundled hardware profiles as they are (an H200 is the H100 profile with the
data sheet's memory and bandwidth, as in ``serving_fidelity.py``), the engine's defaults unless the
source names a setting. Each deployment's rate is searched on the model (bisection to 0.5 %) for the
highest Poisson rate at which every figure the source's SLO names stays within its target, at the
quantile the source uses; the goodput is that rate per device.

Three kinds of row, summarised apart:

- **measured**: figures read on GPUs (DistServe's worked example on one A100: each worker's rate
  and the two deployments' goodput per GPU; Mooncake's 3 prefill + 1 decode nodes against 4 vLLM
  nodes on long prompts);
- **another model's estimate**: NVIDIA aiconfigurator's README and CLI guide, whose figures come
  from its own operator database, not from a run. They rank the same layouts at the same SLO, so
  the ratio disaggregated / aggregated is a second opinion, not a truth;
- rows marked indicative where the published setting is only partly described (said per row).

    python benchmarks/serving_disagg_published.py [--markdown PATH] [--json PATH] [--quick]

About 35 seconds on two cores (the fitted steps' bisections take most of it); ``--quick``: seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from serving_fidelity import H200, LLAMA2_7B, hardware

from autotune.spec.models import PRESETS
from autotune.workers.simulate import columns_from_params, simulate_configs

# OPT-13B (facebook/opt-13b config.json): the 13B model of DistServe's example and evaluation
OPT_13B = dict(
    arch="gpt",
    hidden_size=5120,
    num_hidden_layers=40,
    num_attention_heads=40,
    num_key_value_heads=40,
    intermediate_size=20480,
    vocab_size=50272,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
# Qwen3-32B (Qwen/Qwen3-32B config.json: hidden 5120, 64 layers, 64 query heads of 128, 8 KV heads,
# intermediate 25600, vocab 151936). The model takes head_dim = hidden / heads, so it is given 40
# query heads: the KV cache per token (8 x 128) is exact, the query and output projections are
# 5120 wide instead of 8192 (30.7B parameters priced, not 32.8B: the weights 6 % light)
QWEN3_32B = dict(
    arch="llama",
    hidden_size=5120,
    num_hidden_layers=64,
    num_attention_heads=40,
    num_key_value_heads=8,
    intermediate_size=25600,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)
# Mooncake's "dummy model that follows the same architecture as LLaMA2-70B", serving 8k-token prompts:
# Llama-2-70B's shape with a context long enough for them (the checkpoint's is 4,096)
LLAMA2_70B_LONG = dict(LLAMA2_7B, **dict(PRESETS["llama2-70b"], max_position_embeddings=32768))

DISTSERVE_BLOG = (
    "Throughput is Not All You Need: Maximizing Goodput in LLM Serving using Prefill-Decode Disaggregation "
    "(Hao AI Lab, 2024-03-17), hao-ai-lab/hao-ai-lab.github.io content/blogs/distserve/index.md at 821a7fe7",
    "https://hao-ai-lab.github.io/blogs/distserve",
)
MOONCAKE = (
    "Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving, section 8 (arXiv 2407.00079)",
    "https://arxiv.org/abs/2407.00079",
)
AICONFIG_README = (
    "NVIDIA aiconfigurator README.md at 93076c60 (the 1.70x example)",
    "https://github.com/ai-dynamo/aiconfigurator",
)
AICONFIG_CLI = (
    "NVIDIA aiconfigurator docs/cli_user_guide.md (examples added at 93076c60 and efaa9d97)",
    "https://github.com/ai-dynamo/aiconfigurator/blob/main/docs/cli_user_guide.md",
)

MEASURED, OTHER_MODEL = "measured", "another model's estimate"
UNBOUNDED_MS = 1e7  # a target no figure reaches: the search reads the figures, the spec's SLO decides nothing


@dataclass
class Deployment:
    """One layout of one source, priced at one rate at a time."""

    model: dict
    hw: Any
    params: dict
    prompt: int | tuple[int, int]  # tokens, or uniform integers low..high (the spec's ``{low, high}``)
    output: int | tuple[int, int]
    nodes: int = 1
    devices_per_node: int = 8
    accelerator: str = "cuda"
    steps: dict | None = None  # the profile's serving_steps: an engine's measured corrections (none: as it is)
    profile: dict = field(init=False, repr=False)  # ``hw``'s profile, loaded once (the bisections price hundreds)

    def __post_init__(self) -> None:
        self.profile = hardware(self.hw)

    def with_steps(self, steps: dict | None) -> "Deployment":
        """The same layout priced with the engine's ``steps`` (a copy: this one is left as it is)."""
        return replace(self, steps=steps)

    def at(self, rate: float, duration: float = 600.0) -> dict[str, float]:
        """The model's figures (ms, quantiles 50/90/99 of TTFT, TPOT, ITL, E2E) at ``rate`` requests/s
        offered to the whole deployment, over a window of ``duration`` seconds (10 minutes)."""

        def lengths(x: int | tuple[int, int]) -> Any:
            return {"low": x[0], "high": x[1]} if isinstance(x, tuple) else x

        def longest(x: int | tuple[int, int]) -> int:
            return x[1] if isinstance(x, tuple) else x

        work = {
            "kind": "serve",
            "traffic": {
                "rates": [rate],
                "prompt_len": lengths(self.prompt),
                "output_len": lengths(self.output),
                "duration_s": duration,
            },
            "slo": {"ttft_p99_ms": UNBOUNDED_MS},
            "batch_sweep": [],
            "max_model_len": longest(self.prompt) + longest(self.output),
        }
        cluster = {
            "accelerator": self.accelerator,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "world_size": self.nodes * self.devices_per_node,
        }
        profile = self.profile
        if self.steps:
            profile = {**profile, "serving_steps": {"engine": "fit", **self.steps}}
        out = simulate_configs(self.model, work, profile, cluster, columns_from_params([self.params]))
        if not out["valid"][0] or not out["fits"][0]:
            raise RuntimeError(f"the model refuses this published layout: {self.params}")
        figures = {k: float(v[0]) for k, v in out.items() if k.endswith("_ms")}
        figures["devices"] = float(out["devices"][0])
        return figures

    def max_rate(self, slo: dict[str, float], tolerance: float = 0.005) -> float:
        """The highest rate (requests/s, the whole deployment) at which every ``slo`` figure
        (``ttft_p90_ms``: 400, ...) is within its target; 0 when none is at a hundredth of a request/s.
        The figures rise with the rate, so a doubling brackets it and a bisection narrows it."""

        def meets(rate: float) -> bool:
            got = self.at(rate)
            return all(got[k] <= target for k, target in slo.items())

        lo, hi = 0.01, 0.02
        if not meets(lo):
            return 0.0
        while meets(hi):
            lo, hi = hi, hi * 2
            if hi > 1e5:
                raise RuntimeError("no rate breaks the SLO: the deployment's figures do not grow with the load")
        while (hi - lo) / lo > tolerance:
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if meets(mid) else (lo, mid)
        return lo

    @property
    def devices(self) -> float:
        return self.at(0.01)["devices"]


@dataclass
class Row:
    id: str
    source: tuple[str, str]
    where: str
    config: str
    metric: str
    published: float
    predict: Callable[[], float]
    kind: str = MEASURED
    note: str = ""
    indicative: bool = False
    tags: list[str] = field(default_factory=list)
    calibrated: Callable[[], float] | None = None  # the same figure with the engine's steps fitted to a fit set
    fit: bool = False  # in that fit set: its calibrated figure is the fit, not a prediction


def per_device(deployment: Deployment, slo: dict[str, float]) -> float:
    return deployment.max_rate(slo) / deployment.devices


def fit_worker_steps(prefill: Deployment, decode: Deployment, prefill_rate: float, decode_rate: float) -> dict:
    """The engine's prompt and decode factors (``serving_steps``' ``prefill_scale`` and ``decode_scale``,
    what ``autotune calibrate --serving`` measures on a host) that make the two workers' modelled rates
    the published ones: each factor found by bisection with the other held, twice round."""
    steps = {"prefill_scale": 1.0, "decode_scale": 1.0}
    for _ in range(2):
        for key, worker, target, slo in (
            ("prefill_scale", prefill, prefill_rate, {"ttft_p90_ms": 400.0}),
            ("decode_scale", decode, decode_rate, {"tpot_p90_ms": 40.0}),
        ):
            lo, hi = 0.02, 50.0  # the rate falls as the factor grows
            while hi / lo > 1.01:
                mid = math.sqrt(lo * hi)
                rate = worker.with_steps({**steps, key: mid}).max_rate(slo, tolerance=0.01)
                lo, hi = (mid, hi) if rate > target else (lo, mid)
            steps[key] = math.sqrt(lo * hi)
    return steps


def distserve_rows(fitted: dict[str, float] | None = None) -> list[Row]:
    """DistServe's worked example: "a 13B LLM on a single A100-80GB GPU with a synthetic workload of
    inputs of length 512 and output length 64 following Poisson arrival", SLO P90 TTFT 0.4 s and P90
    TPOT 0.04 s. Colocated: the rate that holds the TTFT target (2.3 req/s), the TPOT target (1.6),
    so a goodput of 1.6 per GPU. Disaggregated: "one prefill worker achieves roughly 5.6 rps and one
    decode worker achieves roughly 10 rps", so 2 prefill + 1 decode GPUs hold min(2 x 5.6, 10) = 10
    req/s, 3.3 per GPU, "2x". Priced here as a vLLM-style engine (whole prompts, the defaults) on the
    A100 profile; a worker alone is its pool with the other pool made four times larger, so that
    only its own phase binds.

    Each row is priced twice: by the model as it is, and with the engine's prompt and decode factors
    set from the two workers' published rates (:func:`fit_worker_steps`), as a team would measure its
    engine's steps before a study; the colocated rates and the two deployments' goodput are then
    predictions of figures the fit never saw. ``fitted`` (a dict) receives the two factors."""
    hw = "a100-sxm-80gb"
    base = {"tp": 1, "enable_chunked_prefill": False}
    ttft, tpot = {"ttft_p90_ms": 400.0}, {"tpot_p90_ms": 40.0}
    both = {**ttft, **tpot}
    layouts = {
        "colocated": Deployment(OPT_13B, hw, dict(base), 512, 64),
        "prefill": Deployment(OPT_13B, hw, dict(base, prefill_replicas=1, replicas=4), 512, 64),
        "decode": Deployment(OPT_13B, hw, dict(base, prefill_replicas=4, replicas=1), 512, 64),
        "2p1d": Deployment(OPT_13B, hw, dict(base, prefill_replicas=2, replicas=1), 512, 64),
    }
    fitted = {} if fitted is None else fitted

    def as_is(figure: Callable[[dict], float]) -> Callable[[], float]:
        return lambda: figure(layouts)

    def calibrated(figure: Callable[[dict], float]) -> Callable[[], float]:
        def run() -> float:
            if not fitted:
                fitted.update(fit_worker_steps(layouts["prefill"], layouts["decode"], 5.6, 10.0))
            return figure({name: d.with_steps(dict(fitted)) for name, d in layouts.items()})

        return run

    where = "section 'Disaggregating Prefill and Decoding', the worked example"
    config = "OPT-13B (the 13B of the paper) on A100-80GB, 512 in / 64 out, Poisson"
    figures = (
        (
            "colocated-ttft-rate",
            ", 1 GPU colocated",
            "req/s at P90 TTFT 0.4 s",
            2.3,
            lambda d: d["colocated"].max_rate(ttft),
        ),
        (
            "colocated-tpot-rate",
            ", 1 GPU colocated",
            "req/s at P90 TPOT 0.04 s",
            1.6,
            lambda d: d["colocated"].max_rate(tpot),
        ),
        ("prefill-worker", ", 1 prefill GPU", "req/s at P90 TTFT 0.4 s", 5.6, lambda d: d["prefill"].max_rate(ttft)),
        ("decode-worker", ", 1 decode GPU", "req/s at P90 TPOT 0.04 s", 10.0, lambda d: d["decode"].max_rate(tpot)),
        (
            "colocated-goodput",
            ", 1 GPU colocated",
            "goodput req/s/GPU (both SLOs)",
            1.6,
            lambda d: per_device(d["colocated"], both),
        ),
        (
            "2p1d-goodput",
            ", 2 prefill + 1 decode GPUs",
            "goodput req/s/GPU (both SLOs)",
            10.0 / 3.0,
            lambda d: per_device(d["2p1d"], both),
        ),
        (
            "ratio",
            ": 2P1D / colocated",
            "goodput per GPU, disaggregated / aggregated",
            (10.0 / 3.0) / 1.6,
            lambda d: per_device(d["2p1d"], both) / per_device(d["colocated"], both),
        ),
    )
    notes = {
        "colocated-ttft-rate": "the text also says 'roughly 3 rps'; its formula uses 2.3",
        "2p1d-goodput": "published as min(2 x 5.6, 10) / 3, the workers' rates combined",
        "prefill-worker": "the calibrated column's fit set",
        "decode-worker": "the calibrated column's fit set",
    }
    return [
        Row(
            f"distserve-{name}",
            DISTSERVE_BLOG,
            where,
            config + suffix,
            metric,
            published,
            as_is(figure),
            note=notes.get(name, ""),
            tags=["ratio"] if name == "ratio" else [],
            calibrated=calibrated(figure),
            fit="worker" in name,
        )
        for name, suffix, metric, published, figure in figures
    ]


def mooncake_rows() -> list[Row]:
    """Mooncake section 8: "Mooncake-[3P+1D] achieves throughput improvements of 20% and 40%,
    respectively, over vLLM-[4M] while satisfying SLOs" (ArXiv Summarization, L-Eval); a dummy
    LLaMA2-70B, one instance per node of 8 A800-80GB on NVLink, 800 Gbps RDMA between nodes. The SLO is
    P90 TTFT and TBT at 10x and 5x their values at the lowest rate. ArXiv Summarization's mean lengths
    (8,088 in / 229 out, almost no prefix reuse) are priced as fixed; L-Eval is left out (over 80 % of
    its prompts hit the prefix cache, which the disaggregated model does not price on the decode side).
    Indicative: Mooncake's prefill runs chunked pipeline parallelism over nodes and vLLM of mid-2024
    had no chunked prefill; here both are tp 8 engines with whole prompts."""
    hw = ("a800-sxm4-80gb", {"inter_node_bandwidth_gbps": 100.0})  # 800 Gbps RDMA per node
    # whole prompts: the step's token budget is the context, as vLLM sets it without chunked prefill
    base = {"tp": 8, "enable_chunked_prefill": False, "max_num_batched_tokens": 8088 + 229}
    # one vLLM node: the four of vLLM-[4M] serve a quarter of the rate each, the same per device
    vllm = Deployment(LLAMA2_70B_LONG, hw, dict(base), 8088, 229)
    mooncake = Deployment(
        LLAMA2_70B_LONG, hw, dict(base, prefill_replicas=3, prefill_tp=8, replicas=1), 8088, 229, nodes=4
    )

    def ratio() -> float:
        low = vllm.at(0.01)  # "the lowest RPS" of the aggregated baseline sets the SLO
        slo = {"ttft_p90_ms": 10 * low["ttft_p90_ms"], "tpot_p90_ms": 5 * low["tpot_p90_ms"]}
        return per_device(mooncake, slo) / per_device(vllm, slo)

    return [
        Row(
            "mooncake-3p1d-vs-4m-arxiv",
            MOONCAKE,
            "section 8.1, end-to-end on public datasets (ArXiv Summarization)",
            "LLaMA2-70B, 4 nodes of 8 A800: 3 prefill + 1 decode tp8 instances vs 4 vLLM tp8, 8,088 in / 229 out",
            "SLO-compliant throughput per GPU, disaggregated / aggregated",
            1.20,
            ratio,
            indicative=True,
            note="Mooncake's own prefill scheduling and 2024 vLLM; mean lengths priced as fixed",
            tags=["ratio"],
        )
    ]


def aiconfigurator_rows() -> list[Row]:
    """aiconfigurator's examples, Qwen3-32B in FP8 on H200 SXM with TensorRT-LLM: the best aggregated
    and disaggregated layouts it found and their output tokens/s per GPU at the SLA. Its SLA is the
    mean TTFT and TPOT of a batch; here the p50 under Poisson arrivals. FP8 is priced as w8a8 weights
    and an fp8 KV cache; each layout's batch is its max_num_seqs. Its estimates, not measurements."""
    out: list[Row] = []
    fp8 = {"quantization": "w8a8", "kv_cache_dtype": "fp8"}
    cases = (
        # id, source, where, isl, osl, slo, (agg tp, agg replicas per node, agg bs, published),
        # (prefill workers, prefill tp, decode workers, decode tp, decode bs, nodes, published), layout
        (
            "aiconfigurator-4000-500",
            AICONFIG_README,
            "'Best Experiment Chosen: disagg at 812.92 tokens/s/gpu (1.70x better)'",
            4000,
            500,
            {"ttft_p50_ms": 300.0, "tpot_p50_ms": 10.0},
            (4, 2, 20, 478.57),
            (4, 1, 1, 4, 60, 1, 812.92),
            "32 GPUs: 8 x tp4 (batch 20) vs 4 x (4 prefill tp1 + 1 decode tp4, batch 60)",
        ),
        (
            "aiconfigurator-3000-512",
            AICONFIG_CLI,
            "'disagg will be 1.43x of agg'",
            3000,
            512,
            {"ttft_p50_ms": 1000.0, "tpot_p50_ms": 10.0},
            (4, 2, 28, 638.28),
            (4, 1, 1, 4, 64, 1, 913.82),
            "32 GPUs: 8 x tp4 (batch 28) vs 4 x (4 prefill tp1 + 1 decode tp4, batch 64)",
        ),
        (
            "aiconfigurator-latency-12s",
            AICONFIG_CLI,
            "'Best Experiment Chosen: disagg at 932.91 tokens/s/gpu (disagg 1.09x better)'",
            4000,
            500,
            {"ttft_p50_ms": 4000.0, "e2e_p50_ms": 12000.0},
            (2, 4, 40, 852.23),
            (10, 1, 3, 2, 128, 2, 932.91),
            "16 GPUs: 8 x tp2 (batch 40) vs 10 prefill tp1 + 3 decode tp2 (batch 128)",
        ),
    )
    for cid, src, where, isl, osl, slo, (atp, arep, abs_, apub), disagg_layout, layout in cases:
        np_, ptp, decode_replicas, dtp, dbs, nodes, dpub = disagg_layout
        agg = Deployment(QWEN3_32B, H200, dict(fp8, tp=atp, replicas=arep, max_num_seqs=abs_), isl, osl)
        disagg = Deployment(
            QWEN3_32B,
            H200,
            dict(fp8, tp=dtp, replicas=decode_replicas, max_num_seqs=dbs, prefill_replicas=np_, prefill_tp=ptp),
            isl,
            osl,
            nodes=nodes,
        )
        config = f"Qwen3-32B FP8, H200, {isl} in / {osl} out, {layout}"
        metric = "output tokens/s/GPU at " + ", ".join(
            f"{k[:-3].replace('_', ' ')} <= {v:g} ms" for k, v in slo.items()
        )
        out += [
            Row(
                f"{cid}-agg",
                src,
                where,
                config + " (aggregated)",
                metric,
                apub,
                lambda d=agg, s=slo, o=osl: per_device(d, s) * o,
                kind=OTHER_MODEL,
            ),
            Row(
                f"{cid}-disagg",
                src,
                where,
                config + " (disaggregated)",
                metric,
                dpub,
                lambda d=disagg, s=slo, o=osl: per_device(d, s) * o,
                kind=OTHER_MODEL,
            ),
            Row(
                f"{cid}-ratio",
                src,
                where,
                config,
                "tokens/s/GPU, disaggregated / aggregated",
                dpub / apub,
                lambda a=agg, d=disagg, s=slo: per_device(d, s) / per_device(a, s),
                kind=OTHER_MODEL,
                tags=["ratio"],
            ),
        ]
    return out


def rows(fitted: dict[str, float] | None = None) -> list[Row]:
    return distserve_rows(fitted) + mooncake_rows() + aiconfigurator_rows()


def evaluate(quick: bool = False, fitted: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Every row priced; ``quick``: DistServe's rows only, and not with fitted steps (a smoke run);
    ``fitted`` receives the engine's factors fitted to the fit set."""
    results = []
    for row in distserve_rows(fitted) if quick else rows(fitted):
        predicted = float(row.predict())
        calibrated = float(row.calibrated()) if row.calibrated and not quick else None
        results.append(
            {
                "calibrated": calibrated,
                "calibrated_ratio": calibrated / row.published if calibrated is not None else None,
                "fit": row.fit,
                "id": row.id,
                "source": list(row.source),
                "where": row.where,
                "config": row.config,
                "metric": row.metric,
                "published": row.published,
                "predicted": predicted,
                "ratio": predicted / row.published,
                "kind": row.kind,
                "indicative": row.indicative,
                "note": row.note,
                "is_ratio": "ratio" in row.tags,
                # the winner: does the model put disaggregation on the same side of 1 as the source
                "same_winner": (predicted > 1) == (row.published > 1) if "ratio" in row.tags else None,
            }
        )
    return results


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: the mean absolute error of predicted / published over the clean rows, and how many
    disaggregated / aggregated ratios name the same winner."""
    out: dict[str, Any] = {}
    for kind in (MEASURED, OTHER_MODEL):
        clean = [r for r in results if r["kind"] == kind and not r["indicative"]]
        ratios = [r for r in results if r["kind"] == kind and r["is_ratio"]]
        out[kind] = {
            "rows": len(clean),
            "mape": sum(abs(r["ratio"] - 1) for r in clean) / len(clean) if clean else None,
            "ratio_rows": len(ratios),
            "same_winner": sum(bool(r["same_winner"]) for r in ratios),
        }
    return out


def markdown(results: list[dict[str, Any]], fitted: dict[str, float] | None = None) -> str:
    s = summary(results)
    lines = [
        "| row | kind | configuration | metric | published | model (/ published) | the engine's steps fitted "
        "(/ published) |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in results:
        tag = " (indicative)" if r["indicative"] else ""
        with_steps = "" if r["calibrated"] is None else f"{r['calibrated']:.3g} ({r['calibrated_ratio']:.2f})"
        if r["fit"]:
            with_steps += ", fit set"
        lines.append(
            f"| {r['id']}{tag} | {r['kind']} | {r['config']} | {r['metric']} | {r['published']:.3g} | "
            f"{r['predicted']:.3g} ({r['ratio']:.2f}) | {with_steps} |"
        )
    lines.append("")
    held = [r for r in results if r["calibrated"] is not None and not r["fit"]]
    if held:
        mape = sum(abs(r["calibrated_ratio"] - 1) for r in held) / len(held)
        factors = f" (prompt x{fitted['prefill_scale']:.2f}, decode x{fitted['decode_scale']:.2f})" if fitted else ""
        ratios = [r for r in held if r["is_ratio"]]
        same = sum((r["calibrated"] > 1) == (r["published"] > 1) for r in ratios)
        lines.append(
            f"- with the engine's prompt and decode factors fitted to the fit set{factors}: {len(held)} rows it did "
            f"not see, mean absolute error {mape * 100:.0f} %; the same winner in {same} of {len(ratios)} comparisons"
        )
    for kind, t in s.items():
        mape = "none" if t["mape"] is None else f"{t['mape'] * 100:.0f} %"
        lines.append(
            f"- {kind}: {t['rows']} clean rows, mean absolute error {mape}; the same winner (disaggregated or "
            f"aggregated) in {t['same_winner']} of {t['ratio_rows']} comparisons"
        )
    lines.append("")
    lines.append("Sources:")
    seen: list[list[str]] = []
    for r in results:
        if r["source"] not in seen:
            seen.append(r["source"])
            lines.append(f"- {r['source'][0]}, <{r['source'][1]}>")
    for r in results:
        if r["note"]:
            lines.append(f"- {r['id']}: {r['note']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--json", help="every row and the summary as JSON")
    parser.add_argument("--quick", action="store_true", help="DistServe's rows as the model prices them (seconds)")
    args = parser.parse_args(argv)
    fitted: dict[str, float] = {}
    results = evaluate(args.quick, fitted)
    text = markdown(results, fitted)
    print(text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": results, "summary": summary(results)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
