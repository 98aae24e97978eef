"""Resolve and validate one trial into a ``Plan`` before any torch work starts.

Every rule that makes a config impossible (heads not divisible by tp, layers not divisible by
pp·vpp, a world that is not tp·pp·dp·cp, a batch that does not split) is checked here, once, with a
reason that names the numbers, so the probe fails fast as ``invalid`` instead of as a shape error
deep inside DTensor. No torch import: the rules are unit-testable anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..parameters import TRAINING, data_parallel, default, first_stage_split_divides, grad_accum, sequence_parallel_on
from .failures import ProbeFailure

__all__ = ["ModelConfig", "Plan", "resolve_plan", "RECOMPUTE_MODES", "PRECISIONS", "COMPILE_MODES"]

RECOMPUTE_MODES = TRAINING["recompute"].allowed
PRECISIONS = TRAINING["precision"].allowed
# the compile modes this probe runs: the table's, less reduce-overhead
COMPILE_MODES = tuple(m for m in TRAINING["compile"].allowed if m != "reduce-overhead")
DEFAULT_SEED = 1234
DEFAULT_LR = 1e-3


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape (Hugging Face field names, docs/ARCHITECTURE.md "Model fields")."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    arch: str = "llama"
    name: str = "custom"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        try:
            heads = int(data["num_attention_heads"])
            return cls(
                hidden_size=int(data["hidden_size"]),
                num_hidden_layers=int(data["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(data.get("num_key_value_heads") or heads),
                intermediate_size=int(data["intermediate_size"]),
                vocab_size=int(data["vocab_size"]),
                max_position_embeddings=int(data.get("max_position_embeddings") or 4096),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                arch=str(data.get("arch", "llama")),
                name=str(data.get("name", "custom")),
                rope_theta=float(data.get("rope_theta", 10000.0)),
                norm_eps=float(data.get("rms_norm_eps", data.get("norm_eps", 1e-5))),
            )
        except KeyError as exc:
            raise ProbeFailure("invalid", f"invalid config: model field {exc.args[0]!r} is missing") from None


@dataclass
class Plan:
    """Everything the probe does, resolved: parallel sizes, batch split, memory and precision
    settings and the workload. ``kind`` is ``train`` or ``infer``."""

    kind: str
    world_size: int
    tp: int = default("tp")
    pp: int = default("pp")
    dp: int = default("dp")
    cp: int = default("cp")
    vpp: int = default("vpp")
    micro_batch_size: int = default("micro_batch_size")
    grad_accum: int = default("grad_accum")
    sequence_parallel: bool = default("sequence_parallel")
    recompute: str = default("recompute")
    recompute_layers: int | None = default("recompute_layers")
    first_stage_layers: int | None = default("first_stage_layers")
    zero_stage: int = default("zero_stage")
    precision: str = default("precision", "cpu")  # resolve_plan: the trial's accelerator's
    compile: str = default("compile")
    seq_len: int = 128
    global_batch_size: int = 1
    warmup_steps: int = 1
    measured_steps: int = 3
    profile_step: bool = False
    seed: int = DEFAULT_SEED
    lr: float = DEFAULT_LR
    inject_nan_at_step: int | None = None
    # inference
    prompt_len: int = 0
    gen_len: int = 0
    batch_size: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # inference: the measured batch sizes
    notes: list[str] = field(default_factory=list)

    @property
    def loss_parallel(self) -> bool:
        """Cross-entropy on vocab-sharded logits whenever tp > 1 (torchtitan's default): the full
        logits never exist on one rank."""
        return self.tp > 1 and self.kind == "train"

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and average gradients (cp ranks see different
        tokens of the same sequences, so they reduce gradients like dp ranks)."""
        return self.dp * self.cp

    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


def _int(params: dict[str, Any], name: str, default: int | None) -> int | None:
    value = params.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ProbeFailure("invalid", f"invalid config: {name}={value!r} is not an integer")
    return int(value)


def _bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _choice(params: dict[str, Any], name: str, default: str, choices: tuple[str, ...]) -> str:
    value = str(params.get(name, default)).lower()
    if value not in choices:
        raise ProbeFailure("invalid", f"invalid config: {name}={value!r}, expected one of {', '.join(choices)}")
    return value


def resolve_plan(request: Any, world_size: int, environ: dict[str, str] | None = None) -> Plan:
    """The trial's ``Plan`` for a launch of ``world_size`` processes, or ``ProbeFailure('invalid')``.

    ``dp`` and ``grad_accum`` are derived when the trial does not carry them (docs/ARCHITECTURE.md: dp =
    world/(tp·pp·cp), grad_accum = global_batch/(micro_batch·dp)); when it does, they must agree.
    A parameter the trial does not name takes the parameter table's default on the trial's
    accelerator (``precision``: fp32 on a CPU, bf16 on npu and cuda).
    """
    environ = environ or {}
    params = dict(request.params)
    workload = dict(request.workload)
    backend = dict(getattr(request, "backend", {}) or {})
    model = ModelConfig.from_dict(request.model)
    kind = str(workload.get("kind", "train")).lower()
    if kind not in ("train", "infer"):
        raise ProbeFailure("invalid", f"invalid config: workload.kind={kind!r}, expected train or infer")

    accelerator = str(dict(getattr(request, "cluster", None) or {}).get("accelerator", "cpu")).lower()
    tp, pp, cp, vpp = (_int(params, name, default(name)) for name in ("tp", "pp", "cp", "vpp"))
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("vpp", vpp)):
        if value < 1:
            raise ProbeFailure("invalid", f"invalid config: {name}={value} must be >= 1")
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ProbeFailure(
            "invalid",
            f"invalid config: world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {model_parallel}",
        )
    dp = _int(params, "dp", int(data_parallel(world_size, tp, pp, cp)))
    if dp < 1 or tp * pp * dp * cp != world_size:
        raise ProbeFailure(
            "invalid",
            f"invalid config: tp*pp*dp*cp = {tp}*{pp}*{dp}*{cp} = {tp * pp * dp * cp} != world size {world_size}",
        )

    inject = params.get("inject_nan_at_step", environ.get("AUTOTUNE_INJECT_NAN_STEP"))
    plan = Plan(
        kind=kind,
        world_size=world_size,
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        vpp=vpp,
        sequence_parallel=_bool(params.get("sequence_parallel", default("sequence_parallel"))),
        recompute=_choice(params, "recompute", default("recompute"), RECOMPUTE_MODES),
        recompute_layers=_int(params, "recompute_layers", default("recompute_layers")),
        first_stage_layers=_int(params, "first_stage_layers", default("first_stage_layers")),
        zero_stage=_int(params, "zero_stage", default("zero_stage")),
        precision=_choice(params, "precision", default("precision", accelerator), PRECISIONS),
        compile=_choice(params, "compile", default("compile"), COMPILE_MODES),
        warmup_steps=int(workload.get("warmup_steps", 1)),
        measured_steps=int(workload.get("measured_steps", 3)),
        profile_step=_bool(workload.get("profile_step", False)),
        seed=int(params.get("seed", backend.get("seed", DEFAULT_SEED))),
        lr=float(backend.get("lr", DEFAULT_LR)),
        inject_nan_at_step=None if inject in (None, "") else int(inject),
    )
    if plan.zero_stage not in (0, 1, 2, 3):
        raise ProbeFailure("invalid", f"invalid config: zero_stage={plan.zero_stage}, expected 0-3")
    if plan.measured_steps < 1 or plan.warmup_steps < 0:
        raise ProbeFailure("invalid", "invalid config: need measured_steps >= 1 and warmup_steps >= 0")
    if plan.sequence_parallel and not sequence_parallel_on(plan.sequence_parallel, tp):
        plan.sequence_parallel = False
        plan.notes.append("sequence_parallel ignored: tp == 1")

    _check_model(model, plan)
    if kind == "train":
        _resolve_train(plan, params, workload, model)
    else:
        _resolve_infer(plan, params, workload, model)
    return plan


def _check_model(model: ModelConfig, plan: Plan) -> None:
    tp, heads, kv = plan.tp, model.num_attention_heads, model.num_key_value_heads
    checks = [
        (
            model.hidden_size % heads == 0,
            f"hidden_size {model.hidden_size} not divisible by num_attention_heads {heads}",
        ),
        (heads % kv == 0, f"num_attention_heads {heads} not divisible by num_key_value_heads {kv}"),
        (heads % tp == 0, f"num_attention_heads {heads} not divisible by tp {tp}"),
        (kv % tp == 0, f"num_key_value_heads {kv} not divisible by tp {tp}"),
        (model.intermediate_size % tp == 0, f"intermediate_size {model.intermediate_size} not divisible by tp {tp}"),
        (model.vocab_size % tp == 0, f"vocab_size {model.vocab_size} not divisible by tp {tp}"),
        (model.arch in ("llama", "gpt"), f"arch {model.arch!r} is not llama or gpt"),
        (plan.vpp == 1 or plan.pp > 1, f"vpp {plan.vpp} needs pp > 1"),
    ]
    first, layers = plan.first_stage_layers, model.num_hidden_layers
    if first is None:
        checks.append(
            (
                layers % (plan.pp * plan.vpp) == 0,
                f"num_hidden_layers {layers} not divisible by pp*vpp = {plan.pp}*{plan.vpp}",
            )
        )
    else:  # FIRST_STAGE_RULE
        checks += [
            (plan.pp > 1 and plan.vpp == 1, f"first_stage_layers {first} needs pp > 1 and vpp = 1"),
            (
                bool(first_stage_split_divides(layers, plan.pp, first)),
                f"num_hidden_layers {layers} less first_stage_layers {first} do not split evenly over pp-1 = "
                f"{plan.pp - 1} stages",
            ),
        ]
    for ok, reason in checks:
        if not ok:
            raise ProbeFailure("invalid", f"invalid config: {reason}")


def _resolve_train(plan: Plan, params: dict[str, Any], workload: dict[str, Any], model: ModelConfig) -> None:
    plan.seq_len = int(workload.get("seq_len", 128))
    plan.global_batch_size = int(workload.get("global_batch_size", plan.dp))
    mbs = _int(params, "micro_batch_size", None)
    ga = _int(params, "grad_accum", None)
    per_dp = plan.global_batch_size / plan.dp
    if per_dp != int(per_dp) or per_dp < 1:
        raise ProbeFailure(
            "invalid", f"invalid config: global_batch_size {plan.global_batch_size} not divisible by dp {plan.dp}"
        )
    per_dp = int(per_dp)
    if mbs is None:
        mbs = per_dp // ga if ga else default("micro_batch_size")
    if mbs < 1 or per_dp % mbs:
        raise ProbeFailure(
            "invalid",
            f"invalid config: global_batch_size {plan.global_batch_size} / dp {plan.dp} = {per_dp} "
            f"not divisible by micro_batch_size {mbs}",
        )
    if ga is None:
        ga = int(grad_accum(plan.global_batch_size, mbs, plan.dp))
    if mbs * ga * plan.dp != plan.global_batch_size:
        raise ProbeFailure(
            "invalid",
            f"invalid config: micro_batch_size*grad_accum*dp = {mbs}*{ga}*{plan.dp} != global_batch_size "
            f"{plan.global_batch_size}",
        )
    plan.micro_batch_size, plan.grad_accum = mbs, ga
    if plan.seq_len % plan.cp:
        raise ProbeFailure("invalid", f"invalid config: seq_len {plan.seq_len} not divisible by cp {plan.cp}")
    if plan.sequence_parallel and (plan.seq_len // plan.cp) % plan.tp:
        raise ProbeFailure(
            "invalid",
            f"invalid config: sequence_parallel needs seq_len/cp = {plan.seq_len // plan.cp} divisible by tp {plan.tp}",
        )
    if plan.pp > 1:
        if plan.vpp == 1 and ga < plan.pp:
            raise ProbeFailure("invalid", f"invalid config: 1F1B needs grad_accum (micro-batches) {ga} >= pp {plan.pp}")
        rounds = max(1, ga // plan.pp)
        if plan.vpp > 1 and ga % rounds:
            raise ProbeFailure(
                "invalid", f"invalid config: interleaved 1F1B needs grad_accum {ga} divisible by its rounds {rounds}"
            )
    if plan.recompute_layers is not None and plan.recompute_layers < 0:
        raise ProbeFailure("invalid", f"invalid config: recompute_layers={plan.recompute_layers} < 0")
    if plan.inject_nan_at_step is not None and plan.inject_nan_at_step < 0:
        raise ProbeFailure("invalid", "invalid config: inject_nan_at_step < 0")
    if plan.seq_len > model.max_position_embeddings:
        plan.notes.append(
            f"seq_len {plan.seq_len} > max_position_embeddings {model.max_position_embeddings}: RoPE extended"
        )


def _resolve_infer(plan: Plan, params: dict[str, Any], workload: dict[str, Any], model: ModelConfig) -> None:
    if plan.pp > 1 or plan.cp > 1:
        raise ProbeFailure(
            "invalid",
            f"invalid config: the inference probe runs tp (and dp replicas) only, got pp={plan.pp} cp={plan.cp}",
        )
    plan.prompt_len = int(workload.get("prompt_len", 128))
    plan.gen_len = int(workload.get("gen_len", 32))
    # every config at each of the workload's batch sizes (measurement points); a batch_size param
    # (an older study's knob) measures that batch alone
    bs = _int(params, "batch_size", None)
    sizes = [bs] if bs is not None else sorted({int(b) for b in workload.get("batch_sizes") or [1]})
    if min(sizes) < 1 or plan.prompt_len < 1 or plan.gen_len < 1:
        raise ProbeFailure("invalid", "invalid config: batch sizes, prompt_len and gen_len must be >= 1")
    plan.batch_sizes = sizes
    bs = plan.batch_size = max(sizes)  # the largest sets the peak memory
    plan.seq_len = plan.prompt_len + plan.gen_len
    plan.global_batch_size = bs * plan.dp
    if plan.recompute != "none" or plan.zero_stage:
        plan.notes.append("recompute and zero_stage do not apply to inference: ignored")
