"""The search space: Optuna distributions, derived values, validity rules and canonical form.

A *config* is a plain dict of canonical parameter names (docs/ARCHITECTURE.md) with the derived values
(``dp``, ``grad_accum``) filled in. Two raw proposals that would run identically — ZeRO stage 2
with one data-parallel rank and ZeRO stage 0, say — resolve to the same canonical config and the
same :func:`config_key`, so the search never probes a config twice.

Everything here works one config at a time (:meth:`Space.resolve`, for trials the sampler
proposes) and on the whole space (:meth:`Space.enumerate`, numpy columns derived in chunks and
kept as integer codes, for ranking and ``autotune plan``: millions of configs in tens of MB; a
space whose ranking could not fit in the machine's memory is refused, :class:`SpaceTooLarge`).
``space`` starts no cluster and logs nothing. How the enumerated space is held (codes, not dicts)
is :mod:`autotune.spec.space_enumeration`.

Why one module of over 500 lines: one config (:meth:`Space.resolve`) and the whole space
(:meth:`Space.enumerate`) go through the same derivation and rules (``Space._derive``, numpy
columns of one row or of a chunk); split, each half would restate the other or reach into it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..sanity import is_finite_number as _finite
from .safe_expr import Expression, compile_expression
from .space_enumeration import ConfigRows, Enumeration, _Codes, _scalar, _unique_rows, config_key
from .schema import DERIVED_PARAMS, ServeWorkload, Spec, TrainWorkload
from ..stacks import target_of, target_violations
from ..workers.parameters import (
    INSTANCE_NODES_RULE,
    batched_below_seqs,
    instance_splits_a_node,
    pd_nodes,
    kv_connector_on,
    kv_connector_rules,
    mooncake_ascend_broken,
    prefill_tp_or_tp,
    data_parallel,
    default,
    effective_vpp,
    first_stage_split_divides,
    grad_accum as grad_accum_of,
    sequence_parallel_on,
    serving_default,
)

__all__ = [
    "Space",
    "Resolved",
    "Enumeration",
    "ConfigRows",
    "SpaceTooLarge",
    "memory_problem",
    "config_key",
    "TRAIN_DEFAULTS",
    "INFER_DEFAULTS",
    "SERVE_DEFAULTS",
    "DISAGGREGATION_PARAMS",
]

# Values of parameters the spec does not search: the parameter table's (autotune.workers.parameters);
# the study's default on every accelerator (a CPU spec names fp32 itself: search_spaces/tiny_llama_cpu*.yaml)
TRAIN_DEFAULTS: dict[str, Any] = {
    name: default(name)
    for name in (
        "tp",
        "pp",
        "cp",
        "vpp",
        "micro_batch_size",
        "sequence_parallel",
        "recompute",
        "zero_stage",
        "precision",
    )
}
# inference: the workload's batch sizes are measurement points of every config, never a knob
INFER_DEFAULTS: dict[str, Any] = {name: default(name) for name in ("tp", "precision")}
# a serving engine's settings when the spec does not search them (vLLM's defaults where it has one)
SERVE_DEFAULTS: dict[str, Any] = {
    "tp": default("tp"),
    "pp": default("pp"),
    "replicas": serving_default("replicas"),
    # the engine's defaults from the parameter table (autotune.workers.parameters), in this order
    "max_num_seqs": serving_default("max_num_seqs"),
    "max_num_batched_tokens": serving_default("max_num_batched_tokens"),
    "block_size": serving_default("block_size"),  # the accelerator's own: workload_defaults
    "enable_chunked_prefill": serving_default("enable_chunked_prefill"),
    "enable_prefix_caching": serving_default("enable_prefix_caching"),
    "memory_utilization": serving_default("memory_utilization"),
    "graph_mode": serving_default("graph_mode"),
    "kv_cache_dtype": serving_default("kv_cache_dtype"),
    "quantization": serving_default("quantization"),
    "precision": default("precision"),
}
# Disaggregated serving's settings (issue 46) are not among them: a config names them only where the
# spec does (aggregated otherwise, the configs of a spec without them as before they existed); the
# rules read the table's defaults for them (Space._derive_serving)
DISAGGREGATION_PARAMS = ("prefill_replicas", "prefill_tp", "kv_connector")


def workload_defaults(spec: Spec) -> dict[str, Any]:
    """The values of the parameters a spec of this workload does not search."""
    kind = spec.workload.kind
    if kind == "train":
        return TRAIN_DEFAULTS
    if kind == "serve":  # the engine's block on this accelerator (the parameter table: 16 on CUDA, else 128)
        return {**SERVE_DEFAULTS, "block_size": serving_default("block_size", spec.cluster.accelerator)}
    return INFER_DEFAULTS


@dataclass
class Resolved:
    """One proposal after defaults, derivation and canonicalisation."""

    config: dict[str, Any]
    violations: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.violations

    @property
    def key(self) -> str:
        return config_key(self.config)


class SpaceTooLarge(ValueError):
    """Ranking the space exhaustively would need more memory than the machine has."""


# What ranking a space exhaustively holds (``autotune plan``, a study's ranking): per combination
# in the worst case (every one a valid canonical config the simulator prices apart from the
# others: its codes, its first combination, the predictions and the ranking's working arrays),
# and once (the interpreter, numpy, the simulator, one chunk of combinations being derived).
# benchmarks/huge_space.py --size priced held ~530 B per combination (benchmarks/README.md, "Huge spaces").
BYTES_PER_COMBINATION = 700
BASE_BYTES = 512 * 2**20
CHUNK = 1 << 17  # combinations derived at once: bounds the memory of the enumeration


def machine_memory() -> int | None:
    """Bytes of memory this process may use: the physical memory, or the cgroup's limit when lower."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < 2**60:
            sizes.append(int(text))
    return min(sizes) if sizes else None


def ranking_memory(combinations: int) -> int:
    """Bytes that ranking a space of ``combinations`` exhaustively may need (the worst case)."""
    return BASE_BYTES + BYTES_PER_COMBINATION * combinations


def memory_problem(combinations: int, memory: int | None = None) -> str | None:
    """Why a space of ``combinations`` cannot be ranked exhaustively on this machine (None when it can)."""
    memory = machine_memory() if memory is None else memory
    need = ranking_memory(combinations)
    if memory is None or need <= memory:
        return None
    most = max((memory - BASE_BYTES) // BYTES_PER_COMBINATION, 0)
    return (
        f"ranking the space's {combinations:,} combinations exhaustively needs up to {_bytes_text(need)} of memory "
        f"({BYTES_PER_COMBINATION} bytes per combination, when every one is a valid config, plus "
        f"{_bytes_text(BASE_BYTES)}); this machine has {_bytes_text(memory)}, enough for about {most:,} "
        f"combinations: set search.exhaustive_limit below {combinations:,} (the sampler then explores the "
        "space without ranking it all), or narrow the space"
    )


def _bytes_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} PiB"


class Space:
    """Distributions, rules and canonical form for one spec."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.training = isinstance(spec.workload, TrainWorkload)
        self.serving = isinstance(spec.workload, ServeWorkload)
        self.choices: dict[str, list[Any]] = spec.space.choices()
        self.defaults = defaults = workload_defaults(spec)
        self.fixed: dict[str, Any] = {k: v for k, v in defaults.items() if k not in self.choices}
        self.world = spec.cluster.world_size
        model = spec.model
        self.layers = model.num_hidden_layers
        self.constants: dict[str, Any] = {
            **model.aliases(),
            "world_size": self.world,
            "nodes": spec.cluster.nodes,
            "devices_per_node": spec.cluster.devices_per_node,
        }
        w = spec.workload
        if isinstance(w, TrainWorkload):
            self.constants.update(seq_len=w.seq_len, global_batch_size=w.global_batch_size)
        elif isinstance(w, ServeWorkload):
            prompt, output = w.traffic.mean()
            self.constants.update(prompt_len=prompt, output_len=output, max_model_len=w.max_model_len)
        else:
            self.constants.update(prompt_len=w.prompt_len, gen_len=w.gen_len)
        compiled = [compile_expression(c) for c in spec.constraints]
        outcome = outcome_names(spec.workload.kind)
        # a constraint on the config is a rule of the space; one on a metric judges each result
        self.user_constraints: list[Expression] = [e for e in compiled if not e.names & outcome]
        self.outcome_constraints: list[Expression] = [e for e in compiled if e.names & outcome]
        target = target_of(spec)
        self.target: str | None = target if (self.training or self.serving) and target != "none" else None
        # what a stack's rules know of the study besides the config (autotune.stacks.fact_columns)
        self.facts = {
            "accelerator": spec.cluster.accelerator,
            "devices_per_node": spec.cluster.devices_per_node,
            "model": spec.model.model_dump(),
            "workload": spec.workload.model_dump(),
        }

    # ---- size and distributions ---------------------------------------------------------------
    @property
    def size(self) -> int:
        n = 1
        for values in self.choices.values():
            n *= len(values)
        return n

    def distributions(self) -> dict[str, Any]:
        """Optuna distributions, one per searched parameter (ranges become int distributions)."""
        import optuna.distributions as od

        from .schema import IntRange

        out: dict[str, Any] = {}
        for name, values in self.choices.items():
            raw = getattr(self.spec.space, name, None) if not name.startswith("env.") else None
            if isinstance(raw, IntRange):
                out[name] = od.IntDistribution(raw.low, raw.high, step=1 if raw.log else raw.step, log=raw.log)
            else:
                out[name] = od.CategoricalDistribution(values)
        return out

    # ---- one config -----------------------------------------------------------------------------
    def resolve(self, params: dict[str, Any]) -> Resolved:
        """Defaults + derived values + canonical form + rule check for one proposal."""
        raw = {**self.defaults, **self.fixed, **params}
        cols = {k: np.asarray([v]) for k, v in raw.items()}
        config_cols, valid, reasons = self._derive(cols)
        config = {k: _scalar(v[0]) for k, v in config_cols.items()}
        config = {k: v for k, v in config.items() if v is not None}
        violations = [msg for msg, bad in reasons.items() if bad[0]]
        return Resolved(config, violations)

    def outcome_misses(self, metrics: dict[str, Any]) -> list[str]:
        """The outcome constraints (those naming a metric) that a result's ``metrics`` miss, each
        with the values it read; one whose metric the result lacks is missed, saying so."""
        misses = []
        for e in self.outcome_constraints:
            absent = sorted(n for n in e.names - set(self.constants) if not _finite(metrics.get(n)))
            if absent:
                misses.append(f"{e.source!r}: no value of {', '.join(absent)}")
            elif not bool(e.evaluate({**self.constants, **metrics})):
                read = ", ".join(f"{n} {float(metrics[n]):.4g}" for n in sorted(e.names - set(self.constants)))
                misses.append(f"{e.source!r} ({read})")
        return misses

    def outcome_mask(self, predictions: Any) -> np.ndarray | None:
        """Which predicted rows (``predictions``: metric columns) meet every outcome constraint; a
        metric the model does not predict is not judged (its rows pass). None without any."""
        if not self.outcome_constraints:
            return None
        mask: np.ndarray | None = None
        for e in self.outcome_constraints:
            if any(n not in predictions for n in e.names - set(self.constants)):
                continue
            env = {
                **self.constants,
                **{n: np.asarray(predictions[n], dtype=float) for n in e.names if n in predictions},
            }
            ok = np.asarray(e.evaluate(env), dtype=bool)
            mask = ok if mask is None else mask & ok
        return mask

    def violated_constraints(self, config: dict[str, Any]) -> list[str]:
        return self.resolve({k: v for k, v in config.items() if k not in DERIVED_PARAMS}).violations

    # ---- the whole space ------------------------------------------------------------------------
    def enumerate(self, limit: int | None = None) -> Enumeration:
        """All valid canonical configs. Raises ValueError when the space exceeds ``limit``, and
        :class:`SpaceTooLarge` (a ValueError) when ranking it could need more memory than the machine has.

        The combinations are derived in chunks (:data:`CHUNK`), and only the valid canonical rows
        are kept, as integer codes. Knobs no rule reads (``env.*``/``engine.*`` settings: the launcher's
        environment) are not multiplied into the chunks: the other parameters' product is derived
        once and each valid row takes every combination of them, in the order the whole product
        would give (checked chunk by chunk: a rule that reads such a knob turns this off)."""
        size = self.size
        if limit is not None and size > limit:
            raise ValueError(f"the space has {size:,} combinations, more than the limit {limit:,}")
        problem = memory_problem(size)
        if problem:
            raise SpaceTooLarge(problem)
        _, free = self._split()
        try:
            return self._enumerate(free)
        except _FreeKnobRead:
            return self._enumerate([])

    def why_empty(self, limit: int | None = None) -> str | None:
        """:meth:`Enumeration.why_empty` without keeping the configs: stops at the first chunk that
        holds a valid config. None also when the space exceeds ``limit`` (the sampler explores it
        and says what it rejected); raises :class:`SpaceTooLarge` where :meth:`enumerate` would."""
        size = self.size
        if limit is not None and size > limit:
            return None
        problem = memory_problem(size)
        if problem:
            raise SpaceTooLarge(problem)
        _, free = self._split()
        try:
            return self._why_empty(free)
        except _FreeKnobRead:
            return self._why_empty([])

    def _split(self) -> tuple[list[str], list[str]]:
        """(searched parameters the rules may read, free knobs): an ``env.*``/``engine.*`` knob of
        distinct values that no user constraint names is free (the rules of autotune and of the
        target stacks read the config's canonical parameters, not the launcher's environment)."""
        names = list(self.choices)
        sources = [e.source for e in self.user_constraints]
        named = set().union(*(e.names for e in self.user_constraints)) if self.user_constraints else set()
        free = [
            n
            for n in names
            if n.startswith(("env.", "engine."))
            and len(self.choices[n]) > 1
            and len({str(v) for v in self.choices[n]}) == len(self.choices[n])
            and n not in named
            and not any(n in s or n.split(".", 1)[1] in s for s in sources)
        ]
        return [n for n in names if n not in free], free

    def _chunks(self, free: list[str]) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray], np.ndarray, dict]]:
        """The product of the searched parameters other than ``free``, derived chunk by chunk:
        (each row's first combination index in the whole product, with the free knobs at their first
        value; derived columns; valid; reasons). Raises :class:`_FreeKnobRead` when changing a free
        knob changes a rule's verdict or a derived value."""
        names = list(self.choices)
        lens = [len(self.choices[n]) for n in names]
        strides = dict(zip(names, (math.prod(lens[i + 1 :]) for i in range(len(names)))))
        values = {n: _array(self.choices[n]) for n in names}
        bound = [n for n in names if n not in free]
        bound_lens = [len(self.choices[n]) for n in bound]
        total = math.prod(bound_lens)
        for start in range(0, total, CHUNK):
            index = np.arange(start, min(start + CHUNK, total), dtype=np.int64)
            n = len(index)
            digits = dict(zip(bound, np.unravel_index(index, bound_lens))) if bound else {}
            position = np.zeros(n, dtype=np.int64)
            cols: dict[str, np.ndarray] = {}
            for name in names:
                if name in digits:
                    cols[name] = values[name][digits[name]]
                    position += digits[name].astype(np.int64) * strides[name]
                else:
                    cols[name] = values[name][np.zeros(n, dtype=np.int64)]
            for k, v in self.fixed.items():
                cols[k] = np.full(n, v, dtype=object if isinstance(v, str) else None)
            out, valid, reasons = self._derive(cols)
            if free:  # the free knobs at other values: nothing but those columns may change
                other = dict(cols)
                for j, name in enumerate(free):
                    other[name] = values[name][(np.arange(n) + j + 1) % len(values[name])]
                out2, valid2, reasons2 = self._derive(other)
                if (
                    not _same(valid, valid2)
                    or list(reasons) != list(reasons2)
                    or any(not _same(reasons[k], reasons2[k]) for k in reasons)
                    or list(out) != list(out2)
                    or any(not _same(out[k], out2[k]) for k in out if k not in free)
                    or any(not _same(out[k], cols[k]) or not _same(out2[k], other[k]) for k in free)
                ):
                    raise _FreeKnobRead
            yield position, out, valid, reasons

    def _free_product(self, free: list[str]) -> tuple[int, np.ndarray, list[np.ndarray]]:
        """(combinations of the free knobs, each one's share of the combination index, its digits)."""
        names = list(self.choices)
        lens = [len(self.choices[n]) for n in names]
        strides = dict(zip(names, (math.prod(lens[i + 1 :]) for i in range(len(names)))))
        free_lens = [len(self.choices[n]) for n in free]
        m = math.prod(free_lens)
        index = np.arange(m, dtype=np.int64)
        digits = list(np.unravel_index(index, free_lens)) if free else []
        position = np.zeros(m, dtype=np.int64)
        for name, d in zip(free, digits):
            position += d.astype(np.int64) * strides[name]
        return m, position, digits

    def _enumerate(self, free: list[str]) -> Enumeration:
        m, free_position, free_digits = self._free_product(free)
        invalid: dict[str, int] = {}
        sole: dict[str, int] = {}
        names: list[str] = []
        encoders: list[_Codes] = []
        kept_codes: list[np.ndarray] = []
        kept_position: list[np.ndarray] = []
        for position, out, valid, reasons in self._chunks(free):
            if not names:
                names = list(out)
                encoders = [_Codes() for _ in names]
            _count(reasons, invalid, sole, m)
            keep = np.flatnonzero(valid)
            if not len(keep):
                continue
            codes = np.empty((len(keep), len(names)), dtype=np.int32)
            for j, name in enumerate(names):
                codes[:, j] = 0 if name in free else encoders[j].encode(np.asarray(out[name])[keep])
            first = _unique_rows(codes)  # canonical rows de-duplicated, first occurrence kept
            kept_codes.append(codes[first])
            kept_position.append(position[keep[first]])
        searched = {n: _array(self.choices[n]) for n in self.choices}
        invalid = {k: v for k, v in invalid.items() if v}
        sole = {k: v for k, v in sole.items() if k in invalid}
        if not kept_codes or m == 0:
            return Enumeration.empty(self.size, invalid, sole)
        codes = np.concatenate(kept_codes)
        position = np.concatenate(kept_position)
        del kept_codes, kept_position
        first = _unique_rows(codes)  # across chunks: the earliest chunk's row is the first occurrence
        luts = {name: encoders[names.index(name)].encode(self.choices_array(name)) for name in free}
        widest = max((len(e.values) for e in encoders), default=0)
        dtype = np.uint8 if widest <= 2**8 else np.uint16 if widest <= 2**16 else np.int32
        codes, position = codes[first].astype(dtype), position[first]
        if free:  # each valid row with every combination of the free knobs, in combination order
            at = (position[:, None] + free_position[None, :]).ravel()
            order = np.argsort(at, kind="stable")
            position = at[order]
            del at
            codes = codes[order // m]
            combo = order % m
            del order
            for k, name in enumerate(free):
                codes[:, names.index(name)] = luts[name][free_digits[k][combo]]
        enumeration = Enumeration(
            self.size,
            names,
            codes,
            [e.values for e in encoders],
            [e.dtype if e.dtype is not None else np.dtype(object) for e in encoders],
            position,
            searched,
            invalid,
            sole,
        )
        enumeration.outcome = self.outcome_mask
        return enumeration

    def _why_empty(self, free: list[str]) -> str | None:
        m, _, _ = self._free_product(free)
        invalid: dict[str, int] = {}
        sole: dict[str, int] = {}
        for _, _, valid, reasons in self._chunks(free):
            if m and valid.any():
                return None
            _count(reasons, invalid, sole, m)
        invalid = {k: v for k, v in invalid.items() if v}
        sole = {k: v for k, v in sole.items() if k in invalid}
        return Enumeration.empty(self.size, invalid, sole).why_empty()

    def choices_array(self, name: str) -> np.ndarray:
        """The values of searched parameter ``name`` as a numpy array (ints, bools or objects)."""
        return _array(self.choices[name])

    # ---- the rules, vectorised ----------------------------------------------------------------------
    def _derive(self, cols: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, np.ndarray]]:
        """Derived columns, canonical form and rule violations for a batch of raw configs."""
        n = len(next(iter(cols.values()))) if cols else 1
        out = {k: np.asarray(v) for k, v in cols.items()}
        reasons: dict[str, np.ndarray] = {}
        tp = out.get("tp", np.ones(n, dtype=int)).astype(int)
        heads, kv_heads = self.constants["heads"], self.constants["kv_heads"]
        reasons[f"heads ({heads}) not divisible by tp"] = heads % tp != 0
        reasons[f"kv_heads ({kv_heads}) and tp: neither divides the other"] = (kv_heads % tp != 0) & (
            tp % kv_heads != 0
        )
        if self.training:
            pp, cp, vpp = (out[k].astype(int) for k in ("pp", "cp", "vpp"))
            mbs = out["micro_batch_size"].astype(int)
            model_par = tp * pp * cp
            reasons[f"tp*pp*cp does not divide the world size ({self.world})"] = self.world % model_par != 0
            probe = self.spec.cluster.probe_slice
            if probe:  # tuned on a slice: the layout must run there too
                slice_devices = probe * self.spec.cluster.devices_per_node
                reasons[
                    f"tp*pp*cp does not divide the probe slice's {slice_devices} devices (cluster.probe_nodes {probe})"
                ] = slice_devices % model_par != 0
            dp = np.maximum(data_parallel(self.world, tp, pp, cp).astype(int), 1)
            gbs = self.constants["global_batch_size"]
            reasons[f"global_batch_size ({gbs}) not divisible by micro_batch_size*dp"] = gbs % (mbs * dp) != 0
            grad_accum = np.maximum(grad_accum_of(gbs, mbs, dp).astype(int), 1)
            # canonical form: settings that cannot matter take their neutral value
            vpp = effective_vpp(vpp, pp)
            uneven = np.zeros(n, dtype=bool)
            if "first_stage_layers" in out:  # FIRST_STAGE_RULE; canonical: an even split (or one stage) is unset
                first = out["first_stage_layers"].astype(int)
                uneven = (pp > 1) & (first * pp != self.layers)
                reasons["first_stage_layers needs vpp = 1"] = uneven & (vpp > 1)
                reasons[
                    f"num layers ({self.layers}) less first_stage_layers do not split evenly over the other pp-1 stages"
                ] = uneven & ~first_stage_split_divides(self.layers, pp, first)
                out["first_stage_layers"] = np.where(uneven, first, None).astype(object)
            reasons[f"num layers ({self.layers}) not divisible by pp*vpp"] = ~uneven & (self.layers % (pp * vpp) != 0)
            reasons["interleaved schedule (vpp>1) needs grad_accum divisible by pp"] = (vpp > 1) & (
                grad_accum % pp != 0
            )
            seq = self.constants["seq_len"]
            reasons[f"seq_len ({seq}) not divisible by 2*cp"] = (cp > 1) & (seq % (2 * cp) != 0)
            sp = sequence_parallel_on(out["sequence_parallel"].astype(bool), tp)
            reasons[f"sequence_parallel needs seq_len ({seq}) divisible by tp"] = sp & (seq % tp != 0)
            zero = np.where(dp * cp == 1, 0, out["zero_stage"].astype(int))
            recompute = out["recompute"].astype(object)
            per_stage = self.layers // np.maximum(pp, 1)
            if "recompute_layers" in out:
                rl = np.minimum(out["recompute_layers"].astype(int), per_stage)
                rl_col = np.where(recompute == "full", rl, None).astype(object)
                # recomputing every layer of a stage is plain full recompute
                rl_col = np.where((recompute == "full") & (rl >= per_stage), None, rl_col)
                out["recompute_layers"] = rl_col
            out.update(
                tp=tp,
                pp=pp,
                cp=cp,
                vpp=vpp,
                dp=dp,
                micro_batch_size=mbs,
                grad_accum=grad_accum,
                sequence_parallel=sp,
                zero_stage=zero,
                recompute=recompute,
            )
        elif self.serving:
            out.update(self._derive_serving(out, tp, reasons))
        else:  # inference: tp-wide instances fill the cluster, each serving the workload's batches
            reasons[f"tp does not divide the world size ({self.world})"] = self.world % tp != 0
            out["tp"] = tp
            pp = out["pp"].astype(int) if "pp" in out else 1
            out["replicas"] = np.maximum(self.world // np.maximum(tp * pp, 1), 1)
        if self.target:  # configs the production stack cannot launch are not in the space
            reasons.update(target_violations(self.target, out, n, self.facts))
        env = {**self.constants, **out}
        for expr in self.user_constraints:
            ok = np.broadcast_to(np.asarray(expr.evaluate(env), dtype=bool), (n,))
            reasons[f"constraint {expr.source!r}"] = ~ok
        valid = np.ones(n, dtype=bool)
        for bad in reasons.values():
            valid &= ~np.broadcast_to(bad, (n,))
        reasons = {k: np.broadcast_to(v, (n,)) for k, v in reasons.items()}
        return out, valid, reasons

    def _derive_serving(
        self, out: dict[str, np.ndarray], tp: np.ndarray, reasons: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """A serving layout: ``replicas`` engines of ``tp*pp`` devices each, on one node, or an engine
        wider than a node on whole nodes (``INSTANCE_NODES_RULE``), its replicas on the cluster's; or, with a
        prefill pool (``prefill_replicas`` >= 1), ``replicas`` decode instances and ``prefill_replicas``
        prefill instances of ``prefill_tp*pp`` devices, each instance on one node or on whole nodes of its
        own, placed first-fit on the cluster's nodes (``pd_placement``), the KV connector one that runs on
        the accelerator; and the engine's own refusals (vLLM's scheduler config checks) as rules. Canonical
        form: an aggregated config has no prefill_tp (0) or connector (auto); a disaggregated one names both
        (0 and auto resolved)."""
        pp, replicas = out["pp"].astype(int), out["replicas"].astype(int)
        node = self.constants["devices_per_node"]
        n = tp.shape[0]
        col = lambda name: np.broadcast_to(np.asarray(out.get(name, serving_default(name))), (n,))  # noqa: E731
        prefill = col("prefill_replicas").astype(int)
        disagg = prefill > 0
        prefill_tp = np.where(disagg, prefill_tp_or_tp(col("prefill_tp").astype(int), tp), 0)
        accel = str(self.facts["accelerator"])
        connector = np.array([kv_connector_on(str(k), accel, self.target) for k in col("kv_connector")], dtype=object)
        connector = np.where(disagg, connector, serving_default("kv_connector")).astype(object)
        devices = (replicas * tp + prefill * prefill_tp) * pp
        # an aggregated instance within a node: its replicas share that node (the probe measures one
        # node's deployment); one wider than a node takes whole nodes, its replicas the cluster's
        spans = tp * pp > node
        reasons[f"replicas*tp*pp exceeds the devices of a node ({node})"] = ~disagg & ~spans & (devices > node)
        reasons[INSTANCE_NODES_RULE] = ~disagg & instance_splits_a_node(tp * pp, node)
        reasons[f"replicas*tp*pp exceeds the cluster's devices ({self.world})"] = (
            ~disagg & spans & (devices > self.world)
        )
        reasons[f"a disaggregated deployment's devices exceed the cluster's ({self.world})"] = disagg & (
            devices > self.world
        )
        reasons[f"a prefill or decode instance wider than a node takes whole nodes ({node} devices each)"] = disagg & (
            instance_splits_a_node(tp * pp, node) | instance_splits_a_node(prefill_tp * pp, node)
        )
        nodes = max(int(self.world) // max(int(node), 1), 1)
        reasons[
            f"the pools' instances take more nodes than the cluster's {nodes} (first-fit, prefill first, an instance "
            "wider than a node on whole nodes of its own)"
        ] = disagg & (pd_nodes(np.where(disagg, prefill, 0), prefill_tp * pp, replicas, tp * pp, node) > nodes)
        heads = self.constants["heads"]
        reasons["num_attention_heads not divisible by prefill_tp"] = disagg & (heads % np.maximum(prefill_tp, 1) != 0)
        reasons["kv_connector d2d is MindIE's own KV transfer: it needs target: mindie"] = (
            disagg & (connector == "d2d") & (self.target != "mindie")
        )
        for name in sorted(set(connector[disagg].tolist())):
            refusal, rule = kv_connector_rules(name, accel)
            if refusal:
                reasons[refusal] = disagg & (connector == name)
            elif rule:
                reasons[rule] = disagg & (connector == name) & mooncake_ascend_broken(prefill_tp, tp, pp)
        reasons[f"num layers ({self.layers}) not divisible by pp"] = self.layers % pp != 0
        if self.target is None:  # no engine in mind: vLLM's scheduler checks, the engines' common ground
            seqs = out["max_num_seqs"].astype(int)
            batched = out["max_num_batched_tokens"].astype(int)
            reasons["max_num_batched_tokens below max_num_seqs (the engine refuses it)"] = batched_below_seqs(
                batched, seqs
            )
            context = int(self.constants["max_model_len"])
            chunked = out["enable_chunked_prefill"].astype(bool)
            no_chunks = f"without chunked prefill max_num_batched_tokens must hold max_model_len ({context})"
            reasons[no_chunks + " (the engine refuses it)"] = ~chunked & (batched < context)
        # canonical form: a KV cache in the compute dtype is the engine's default ('auto')
        kv = out["kv_cache_dtype"].astype(object)
        kv = np.where(kv == out["precision"].astype(object), "auto", kv).astype(object)
        derived = {"tp": tp, "pp": pp, "replicas": replicas, "world_size": devices, "kv_cache_dtype": kv}
        if any(name in out for name in DISAGGREGATION_PARAMS):  # named by the spec: the pools' canonical form
            derived.update(prefill_replicas=prefill, prefill_tp=prefill_tp, kv_connector=connector)
        return derived


class _FreeKnobRead(Exception):
    """A rule read a knob the enumeration took for free (:meth:`Space._split`): derive the whole product."""


def _same(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype == object or b.dtype == object:
        return a.tolist() == b.tolist()
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))


def _count(reasons: dict[str, np.ndarray], invalid: dict[str, int], sole: dict[str, int], times: int) -> None:
    """Add a chunk's rejections to ``invalid`` (per rule) and ``sole`` (rejected by that rule alone),
    each row standing for ``times`` combinations."""
    if not reasons:
        return
    violations = np.sum([np.asarray(bad, dtype=np.int32) for bad in reasons.values()], axis=0)
    alone = violations == 1
    for msg, bad in reasons.items():
        invalid[msg] = invalid.get(msg, 0) + int(np.count_nonzero(bad)) * times
        sole[msg] = sole.get(msg, 0) + int(np.count_nonzero(bad & alone)) * times


def _array(values: list[Any]) -> np.ndarray:
    if all(isinstance(v, bool) for v in values):
        return np.asarray(values, dtype=bool)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return np.asarray(values, dtype=int)
    return np.asarray(values, dtype=object)


def outcome_names(kind: str) -> set[str]:
    """The metrics a constraint of a ``kind`` study may name (an outcome constraint): the
    workload's own metrics and the memory ones every workload reports."""
    from autotune.objectives import METRICS

    return {n for n, m in METRICS.items() if m.workload == kind} | {"peak_memory_gib", "memory_headroom_gib"}
