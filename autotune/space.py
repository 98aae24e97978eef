"""The search space: Optuna distributions, derived values, validity rules and canonical form.

A *config* is a plain dict of canonical parameter names (docs/ARCHITECTURE.md) with the derived values
(``dp``, ``grad_accum``) filled in. Two raw proposals that would run identically — ZeRO stage 2
with one data-parallel rank and ZeRO stage 0, say — resolve to the same canonical config and the
same :func:`config_key`, so the search never probes a config twice.

Everything here works one config at a time (:meth:`Space.resolve`, for trials the sampler
proposes) and on the whole space at once (:meth:`Space.enumerate`, numpy columns, for ranking
and ``autotune plan``). ``space`` starts no cluster and logs nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .safe_expr import Expression, compile_expression
from .spec import ServeWorkload, Spec, TrainWorkload
from .stacks import target_violations

__all__ = ["Space", "Resolved", "Enumeration", "config_key", "TRAIN_DEFAULTS", "INFER_DEFAULTS", "SERVE_DEFAULTS"]

# Values of parameters the spec does not search (docs/ARCHITECTURE.md defaults).
TRAIN_DEFAULTS: dict[str, Any] = {
    "tp": 1,
    "pp": 1,
    "cp": 1,
    "vpp": 1,
    "micro_batch_size": 1,
    "sequence_parallel": False,
    "recompute": "none",
    "zero_stage": 0,
    "precision": "bf16",
}
# the values a config derives from the others (never proposed)
DERIVED = ("dp", "grad_accum")
# inference: the workload's batch sizes are measurement points of every config, never a knob
INFER_DEFAULTS: dict[str, Any] = {"tp": 1, "precision": "bf16"}
# a serving engine's settings when the spec does not search them (vLLM's defaults where it has one)
SERVE_DEFAULTS: dict[str, Any] = {
    "tp": 1,
    "pp": 1,
    "replicas": 1,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "block_size": 128,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": True,
    "memory_utilization": 0.9,
    "graph_mode": "graph",
    "kv_cache_dtype": "auto",
    "quantization": "none",
    "precision": "bf16",
}


def workload_defaults(spec: Spec) -> dict[str, Any]:
    """The values of the parameters a spec of this workload does not search."""
    kind = spec.workload.kind
    if kind == "train":
        return TRAIN_DEFAULTS
    if kind == "serve":  # vLLM's default block: 16 on CUDA, 128 on CPU (its only size there) and Ascend
        return {**SERVE_DEFAULTS, "block_size": 16 if spec.cluster.accelerator == "cuda" else 128}
    return INFER_DEFAULTS


def config_key(config: dict[str, Any]) -> str:
    """Stable identity of a canonical config (JSON with sorted keys)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)


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


@dataclass
class Enumeration:
    """The whole space at once: ``space_size`` raw combinations, ``configs`` the valid unique
    canonical ones (as dicts, in a stable order) and ``columns`` the same as numpy arrays."""

    space_size: int
    configs: list[dict[str, Any]]
    columns: dict[str, np.ndarray]
    invalid_reasons: dict[str, int]
    # the searched parameters' raw values of the first combination that resolves to each config:
    # what a sampler proposes so that ``Space.resolve`` gives that config back
    params: dict[str, np.ndarray] = field(default_factory=dict)
    # combinations each rule rejects that no other rule does: the rule that empties a space
    sole_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def valid(self) -> int:
        return len(self.configs)

    def why_empty(self) -> str | None:
        """Why no combination is a valid config (None when some is): each rule with the
        combinations it rejects, the user's constraints first, and the fix."""
        if self.configs:
            return None
        if not self.invalid_reasons:
            return "the space has no combination to try"
        order = sorted(self.invalid_reasons, key=lambda r: (not r.startswith("constraint "), -self.invalid_reasons[r]))
        parts = []
        for reason in order:
            alone = self.sole_reasons.get(reason, 0)
            parts.append(
                f"{reason} rejects {self.invalid_reasons[reason]:,}"
                + (f" ({alone:,} that no other rule rejects)" if alone else "")
            )
        culprits = [r for r in order if r.startswith("constraint ") and self.sole_reasons.get(r)]
        fix = (
            f"loosen {', '.join(culprits)} or widen the space"
            if culprits
            else "widen the space (more values of the rejected parameters) or loosen the constraints"
        )
        return f"no valid config in the space's {self.space_size:,} combinations: " + "; ".join(parts) + f". Fix: {fix}"

    def params_of(self, index: int) -> dict[str, Any]:
        """The searched parameters (plain Python values) that resolve to config ``index``."""
        return {name: _scalar(values[index]) for name, values in self.params.items()}


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
        self.user_constraints: list[Expression] = [compile_expression(c) for c in spec.constraints]
        self.target: str | None = (
            spec.target_stack if (self.training or self.serving) and spec.target_stack != "none" else None
        )
        # what a stack's rules know of the study besides the config (autotune.stacks.fact_columns)
        self.facts = {
            "accelerator": spec.cluster.accelerator,
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

        from .spec import IntRange

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

    def violated_constraints(self, config: dict[str, Any]) -> list[str]:
        return self.resolve({k: v for k, v in config.items() if k not in DERIVED}).violations

    # ---- the whole space ------------------------------------------------------------------------
    def enumerate(self, limit: int | None = None) -> Enumeration:
        """All valid canonical configs. Raises ValueError when the space exceeds ``limit``."""
        size = self.size
        if limit is not None and size > limit:
            raise ValueError(f"the space has {size:,} combinations, more than the limit {limit:,}")
        names = list(self.choices)
        lens = [len(self.choices[n]) for n in names]
        if names:
            idx = np.indices(lens).reshape(len(names), -1)
            cols = {n: _array(self.choices[n])[idx[i]] for i, n in enumerate(names)}
        else:
            cols = {}
        n = size
        for k, v in self.fixed.items():
            cols[k] = np.full(n, v, dtype=object if isinstance(v, str) else None)
        config_cols, valid, reasons = self._derive(cols)
        keep = np.flatnonzero(valid)
        kept = {k: v[keep] for k, v in config_cols.items()}
        # de-duplicate canonical rows, keeping the first occurrence (stable order)
        codes = (
            np.stack([np.unique(v.astype(str), return_inverse=True)[1] for v in kept.values()], axis=1)
            if kept
            else np.zeros((0, 0))
        )
        if len(keep):
            _, first = np.unique(codes, axis=0, return_index=True)
            first.sort()
        else:
            first = np.zeros(0, dtype=int)
        columns = {k: v[first] for k, v in kept.items()}
        lists = {k: v.tolist() for k, v in columns.items()}
        configs = [{k: v for k, v in zip(lists, row) if v is not None} for row in zip(*lists.values())] if lists else []
        invalid_reasons = {msg: int(bad.sum()) for msg, bad in reasons.items() if bad.any()}
        violations = sum((np.asarray(bad, dtype=int) for bad in reasons.values()), np.zeros(size, dtype=int))
        sole = {msg: int((bad & (violations == 1)).sum()) for msg, bad in reasons.items() if bad.any()}
        params = {name: cols[name][keep[first]] for name in names}
        return Enumeration(size, configs, columns, invalid_reasons, params, sole)

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
            dp = np.maximum(self.world // model_par, 1)
            gbs = self.constants["global_batch_size"]
            reasons[f"global_batch_size ({gbs}) not divisible by micro_batch_size*dp"] = gbs % (mbs * dp) != 0
            grad_accum = np.maximum(gbs // np.maximum(mbs * dp, 1), 1)
            # canonical form: settings that cannot matter take their neutral value
            vpp = np.where(pp == 1, 1, vpp)
            reasons[f"num layers ({self.layers}) not divisible by pp*vpp"] = self.layers % (pp * vpp) != 0
            reasons["interleaved schedule (vpp>1) needs grad_accum divisible by pp"] = (vpp > 1) & (
                grad_accum % pp != 0
            )
            seq = self.constants["seq_len"]
            reasons[f"seq_len ({seq}) not divisible by 2*cp"] = (cp > 1) & (seq % (2 * cp) != 0)
            sp = out["sequence_parallel"].astype(bool) & (tp > 1)
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
        """A serving layout: ``replicas`` engines of ``tp*pp`` devices each, on one node, and the
        engine's own refusals (vLLM's scheduler config checks) as rules."""
        pp, replicas = out["pp"].astype(int), out["replicas"].astype(int)
        node = self.constants["devices_per_node"]
        devices = replicas * tp * pp
        reasons[f"replicas*tp*pp exceeds the devices of a node ({node})"] = devices > node
        reasons[f"num layers ({self.layers}) not divisible by pp"] = self.layers % pp != 0
        if self.target is None:  # no engine in mind: vLLM's scheduler checks, the engines' common ground
            seqs = out["max_num_seqs"].astype(int)
            batched = out["max_num_batched_tokens"].astype(int)
            reasons["max_num_batched_tokens below max_num_seqs (the engine refuses it)"] = batched < seqs
            context = int(self.constants["max_model_len"])
            chunked = out["enable_chunked_prefill"].astype(bool)
            no_chunks = f"without chunked prefill max_num_batched_tokens must hold max_model_len ({context})"
            reasons[no_chunks + " (the engine refuses it)"] = ~chunked & (batched < context)
        # canonical form: a KV cache in the compute dtype is the engine's default ('auto')
        kv = out["kv_cache_dtype"].astype(object)
        kv = np.where(kv == out["precision"].astype(object), "auto", kv).astype(object)
        return {"tp": tp, "pp": pp, "replicas": replicas, "world_size": devices, "kv_cache_dtype": kv}


def _array(values: list[Any]) -> np.ndarray:
    if all(isinstance(v, bool) for v in values):
        return np.asarray(values, dtype=bool)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return np.asarray(values, dtype=int)
    return np.asarray(values, dtype=object)


def _scalar(v: Any) -> Any:
    """numpy scalar -> plain Python value (JSON, Optuna and MLflow want plain values)."""
    if isinstance(v, np.generic):
        return v.item()
    return v
