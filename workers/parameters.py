"""The canonical parameters, each written once: its type, default, allowed values, what it means,
each stack's spelling, and the rules between parameters (issue 43, "one table of parameters").

Why a table: the serving defaults (``max_num_seqs`` 256, ``max_num_batched_tokens`` 8192) were written
in six files and the rule ``max_num_batched_tokens >= max_num_seqs`` in three; the training defaults
(``zero_stage`` 0, ``recompute`` none, ``precision`` bf16...) in some sixty places across the space,
the simulator, the stacks' rules, four exporters and both probes, and the rules ``dp = world /
(tp*pp*cp)``, ``grad_accum = gbs / (mbs*dp)``, "sequence parallel needs tp > 1" and "vpp needs
pp > 1" in three to five each. A change to one copy would have left the others pricing, checking or
launching another config. They all read this module now; ``tests/test_parameter_table.py`` checks
that each agrees with it and that no module writes a default beside its name again.

A leaf module (standard library only): the probes (``autotune.workers``; the MindSpore probe loads it
by its file, it runs in MindSpore's own environment) and the driver both read it. The serving
defaults are vLLM's (``vllm/engine/arg_utils.py`` / ``vllm/config/scheduler.py``) where it has one;
MindIE's ``config.json`` keys carry the same meaning under their own names. The training spellings
are the ones the exporters write (``autotune/export/_megatron.py``, ``_deepspeed.py``,
``_torchtitan.py``, ``_mindformers.py``).

``precision`` has a default per accelerator: ``bf16`` is the study's (the space writes it into every
trial it proposes on every accelerator, the simulator prices it, the exports launch it), and a trial
that reaches a probe on a CPU without a precision runs ``fp32`` (MindSpore's CPU backend has no bf16
kernels, its Gather refuses BFloat16; torch's CPU bf16 is emulated 10-50x slower without AVX512-BF16),
which is what both probes did on every accelerator before the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any


Spelling = str | tuple[str, ...]  # a stack's flag or key; a tuple: every form it is written in


@dataclass(frozen=True)
class Parameter:
    """One canonical parameter (serving: vLLM's and MindIE's spellings; training: the four training
    stacks')."""

    name: str  # the canonical name (spec, space, trial params, MLflow)
    default: Any  # the value when the spec does not search it (and a config does not name it)
    meaning: str  # what it sets, in one line
    vllm_flag: str | None = None  # vLLM's engine argument (``vllm serve``)
    mindie_keys: tuple[str, ...] = ()  # MindIE config.json's ScheduleConfig / ModelConfig keys
    type: type = object  # what a value is read as (:func:`value`): int, bool or str
    allowed: tuple[Any, ...] = ()  # its values, where they are finitely many
    # the default where an accelerator's differs (a probe running there reads it: :func:`default`)
    by_accelerator: tuple[tuple[str, Any], ...] = ()
    derived: bool = False  # derived from the others by a rule (:data:`RULES`) when a config lacks it
    megatron: Spelling = ""  # Megatron-LM / MindSpeed-LLM ``pretrain_gpt.py`` flag (export._megatron)
    deepspeed: Spelling = ""  # DeepSpeed config JSON key (export._deepspeed)
    torchtitan: Spelling = ""  # torchtitan 0.3 trainer CLI override (export._torchtitan)
    mindformers: Spelling = ""  # MindFormers run-YAML key (export._mindformers)

    def spelling(self, stack: str) -> Spelling:
        """This parameter's flag or key in ``stack`` (megatron, deepspeed, torchtitan, mindformers;
        "" where the stack has none)."""
        return getattr(self, stack)


SERVING: dict[str, Parameter] = {
    p.name: p
    for p in (
        Parameter(
            "max_num_seqs",
            256,
            "sequences one instance batches at once (its decode batch)",
            "--max-num-seqs",
            ("maxBatchSize", "maxPrefillBatchSize"),
        ),
        Parameter(
            "max_num_batched_tokens",
            8192,
            "tokens one scheduler step may process (the prefill chunk budget)",
            "--max-num-batched-tokens",
            ("maxPrefillTokens",),
        ),
        Parameter(
            "block_size",
            16,
            "tokens per KV-cache block (the paged attention's page)",
            "--block-size",
            ("cacheBlockSize",),
            type=int,
            allowed=(16, 32, 64, 128),
            # vLLM's CacheConfig.DEFAULT_BLOCK_SIZE is 16 (vllm/config/cache.py); its CPU platform sets 128
            # when none is given (vllm/platforms/cpu.py check_and_update_config); vLLM-Ascend and MindIE
            # (cacheBlockSize) run 128 on Ascend
            by_accelerator=(("npu", 128), ("cpu", 128)),
        ),
        Parameter(
            "enable_chunked_prefill",
            True,
            "split long prompts into chunks scheduled with decodes (MindIE: the splitfuse plugin)",
            "--enable-chunked-prefill",
        ),
        Parameter(
            "enable_prefix_caching",
            True,
            "reuse the KV cache of a shared prompt prefix (MindIE: the prefix_cache plugin)",
            "--enable-prefix-caching",
        ),
        Parameter(
            "memory_utilization",
            0.9,
            "share of the device memory the engine may take (weights, activations, KV cache)",
            "--gpu-memory-utilization",
        ),
        # The four below are serving rows too, though kv_cache_dtype and quantization are also an offline
        # inference workload's (spec/checks.py allows them there): not a section of their own, because the
        # defaults and spellings are the serving engines' either way (the simulator prices both workloads
        # with the same columns, the torch inference probe does not act on them), and one more dict would
        # make every lookup (default, value, the tests over SERVING) search a third place for nothing.
        # How an engine spells a value ("none" -> no --quantization; "graph" -> --no-enforce-eager) stays
        # in its exporter (autotune/export/_vllm.py); only the default is here.
        Parameter(
            "replicas",
            1,
            "engine instances (servers) on the node, each on its own tp*pp devices, behind one load balancer",
            # no engine flag or key: each replica is a server of its own (one ``vllm serve``, one
            # mindieservice_daemon, MindIE's modelInstanceNumber stays 1) that the export and the preset start
            None,
            type=int,
        ),
        Parameter(
            "graph_mode",
            "graph",
            "eager, the engine's graph capture (CUDA graphs, vLLM-Ascend's ACLGraph; MindIE's own ATB graph) "
            "or vLLM-Ascend's torchair graph",
            # a boolean flag in vLLM (EngineArgs.enforce_eager, False: graph capture, vllm/engine/arg_utils.py):
            # eager -> --enforce-eager, graph -> --no-enforce-eager, torchair -> --no-enforce-eager and
            # --additional-config torchair_graph_config; no MindIE key (it always runs its graph; the
            # stack's rules refuse eager and torchair)
            "--enforce-eager",
            type=str,
            allowed=("eager", "graph", "torchair"),
        ),
        Parameter(
            "kv_cache_dtype",
            "auto",
            "the KV cache's dtype (auto: the compute dtype, precision)",
            # vLLM's CacheConfig.cache_dtype, "auto" (vllm/config/cache.py); no MindIE key: its int8 (C8)
            # KV cache comes with msModelSlim-quantized weights, as vLLM-Ascend's does
            "--kv-cache-dtype",
            type=str,
            allowed=("auto", "bf16", "fp16", "fp8", "int8"),
        ),
        Parameter(
            "quantization",
            "none",
            "the weights' quantization scheme (the checkpoint holds it; none: unquantized weights)",
            # vLLM's ModelConfig.quantization, None: no --quantization flag (vllm/config/model.py); a scheme
            # is --quantization ascend on Ascend, compressed-tensors elsewhere (the export); no MindIE key:
            # msModelSlim-quantized weights (modelWeightPath)
            "--quantization",
            type=str,
            allowed=("none", "int8", "w8a8", "int4"),
        ),
        # Disaggregated prefill/decode (issue 46): the same engine in two pools, the KV cache of each prompt
        # sent from a prefill instance to a decode instance by a KV connector, a proxy in front (vLLM's
        # --kv-transfer-config, vLLM-Ascend's connectors, MindIE's PD separation). No engine flag of their
        # own: the export launches prefill_replicas servers of prefill_tp x pp devices and replicas servers of
        # tp x pp, and the proxy (autotune/export/_vllm.py).
        Parameter(
            "prefill_replicas",
            0,
            "prefill-only instances of a disaggregated deployment (0: aggregated, every replica runs both "
            "phases; from 1: these prefill, the replicas decode)",
            None,
            type=int,
        ),
        Parameter(
            "prefill_tp",
            0,
            "tensor-parallel size of each prefill instance (0: the decode instances' tp)",
            None,
            type=int,
        ),
        Parameter(
            "kv_connector",
            "auto",
            "the KV connector a disaggregated deployment sends the KV cache with (auto: the accelerator's, "
            "KV_CONNECTOR_AUTO, or the target stack's own transfer, KV_CONNECTOR_OF_STACK: d2d for MindIE)",
            # vLLM's KVTransferConfig.kv_connector (vllm/config/kv_transfer.py), a name its KVConnectorFactory
            # registers (vllm/distributed/kv_transfer/kv_connector/factory.py, vLLM 0.32: NixlConnector,
            # MooncakeConnector, LMCacheConnectorV1, ExampleConnector: the shared-storage example, formerly
            # SharedStorageConnector); vLLM-Ascend registers MooncakeConnectorV1 (its LLMDataDist connector was
            # removed in a77045f3): the export spells each, the stacks' rules say where each runs. No flag of
            # its own: each server's --kv-transfer-config JSON names it with the server's role. d2d is MindIE's
            # own device-to-device transfer (MindIE-Motor's ms_controller transfer_type D2DTransfer), what auto
            # stands for under target mindie (autotune/export/_mindie_pd.py)
            None,
            type=str,
            allowed=("auto", "nixl", "mooncake", "lmcache", "shared_storage", "d2d"),
        ),
    )
}


# the KV connector ``kv_connector: auto`` stands for on each accelerator: NIXL on CUDA (vLLM's
# docs/features/nixl_connector_usage.md), Mooncake on Ascend (vLLM-Ascend's
# pd_disaggregation_mooncake_single_node tutorial), and on a CPU the shared-storage example connector,
# the one vLLM's CPU build can run without RDMA libraries (torch and safetensors only)
KV_CONNECTOR_AUTO = {"cuda": "nixl", "npu": "mooncake", "cpu": "shared_storage"}
# a stack that moves the KV cache itself: auto stands for its transfer, whatever the accelerator
KV_CONNECTOR_OF_STACK = {"mindie": "d2d"}


# where each KV connector runs: vLLM 0.32 registers NIXL, Mooncake and LMCache for CUDA devices (their
# transfer libraries: UCX/NIXL, Mooncake's transfer engine, LMCache's CUDA kernels); vLLM-Ascend 0.x
# registers Mooncake (MooncakeConnectorV1) on Ascend; the shared-storage example connector moves tensors
# through torch and safetensors only, so vLLM's CPU build runs it too
KV_CONNECTOR_ACCELERATORS = {
    "nixl": ("cuda",),
    "mooncake": ("cuda", "npu"),
    "lmcache": ("cuda",),
    "shared_storage": ("cuda", "cpu"),
    "d2d": ("npu",),
}
# vLLM-Ascend's Mooncake connector (vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_connector.py):
# the prefill instances' tp must be at least the decode instances', and decode runs without pp
MOONCAKE_ASCEND_RULE = "vLLM-Ascend's Mooncake connector needs prefill_tp >= tp and pp = 1"


def kv_connector_on(connector: str, accelerator: str, target: str | None = None) -> str:
    """The KV connector ``connector`` names on ``accelerator`` for the ``target`` stack (``auto``
    resolved: the stack's own transfer where it has one, :data:`KV_CONNECTOR_OF_STACK`)."""
    if connector != "auto":
        return connector
    return KV_CONNECTOR_OF_STACK.get(target or "") or KV_CONNECTOR_AUTO.get(accelerator, "nixl")


def kv_connector_rules(connector: str, accelerator: str) -> tuple[str | None, str | None]:
    """(why ``connector`` cannot run on ``accelerator``, else None; the rule its pools' sizes must
    keep there, else None: :data:`MOONCAKE_ASCEND_RULE`, broken where :func:`mooncake_ascend_broken`)."""
    name = kv_connector_on(connector, accelerator)
    where = KV_CONNECTOR_ACCELERATORS.get(name, ())
    if accelerator not in where:
        return (
            f"kv_connector {name} runs on {', '.join(where) or 'nowhere'}; the accelerator here is {accelerator}",
            None,
        )
    return None, MOONCAKE_ASCEND_RULE if name == "mooncake" and accelerator == "npu" else None


def mooncake_ascend_broken(prefill_tp: Any, tp: Any, pp: Any) -> Any:
    """Where :data:`MOONCAKE_ASCEND_RULE` is broken (scalars or numpy arrays, element-wise)."""
    return (prefill_tp < tp) | (pp > 1)


def prefill_tp_or_tp(prefill_tp: Any, tp: Any) -> Any:
    """The prefill instances' tensor-parallel size: ``prefill_tp``, 0 meaning the decode instances'
    ``tp`` (scalars or numpy arrays, element-wise)."""
    return (prefill_tp > 0) * prefill_tp + (prefill_tp <= 0) * tp


def serving_parameter(name: str) -> Parameter:
    """The table's row of a serving parameter; KeyError for a name it does not hold."""
    return SERVING[name]


def serving_default(name: str, accelerator: str | None = None) -> Any:
    """The default of a canonical serving parameter, on ``accelerator`` where its own differs
    (``block_size``); KeyError for a name the table does not hold."""
    return default(name, accelerator)


# the rule between two serving parameters, as vLLM's scheduler config enforces it
BATCHED_COVERS_SEQS = (
    "max_num_batched_tokens >= max_num_seqs (vllm/config/scheduler.py verify_max_model_len: a step must "
    "hold one token of every sequence)"
)


def batched_below_seqs(batched: Any, seqs: Any) -> Any:
    """Where :data:`BATCHED_COVERS_SEQS` is broken (scalars or numpy arrays, element-wise)."""
    return batched < seqs


# ---------------------------------------------------------------------------------------- training
# The spellings are what the exporters write (and ``tests/test_parameter_table.py`` finds in their
# files); "" where a stack cannot set the parameter (its rules refuse a value other than the default,
# autotune.stacks) or derives it.
TRAINING: dict[str, Parameter] = {
    p.name: p
    for p in (
        Parameter(
            "tp",
            1,
            "tensor-parallel size",
            type=int,
            megatron="--tensor-model-parallel-size",
            torchtitan="--parallelism.tensor_parallel_degree",
            mindformers="parallel_config.model_parallel",
        ),
        Parameter(
            "pp",
            1,
            "pipeline-parallel size (stages)",
            type=int,
            megatron="--pipeline-model-parallel-size",
            torchtitan="--parallelism.pipeline_parallel_degree",
            mindformers="parallel_config.pipeline_stage",
        ),
        Parameter(
            "cp",
            1,
            "context-parallel size (ring attention over the sequence)",
            type=int,
            megatron="--context-parallel-size",
            torchtitan="--parallelism.context_parallel_degree",
            mindformers="parallel_config.context_parallel",
        ),
        Parameter(
            "vpp",
            1,
            "virtual pipeline stages per rank (interleaved 1F1B; 1 unless pp > 1)",
            type=int,
            megatron="--num-layers-per-virtual-pipeline-stage",
            torchtitan="--parallelism.pipeline_parallel_schedule",
            mindformers="model.model_config.pp_interleave_num",
        ),
        Parameter(
            "first_stage_layers",
            None,
            "layers on the first pipeline stage, the rest split evenly over the others (None: an even "
            "split); fewer there lowers the stage that holds the most micro-batches and the embedding",
            type=int,
            # Megatron-LM's flag (megatron-core's num_layers_in_first_pipeline_stage); MindSpeed-LLM's
            # examples spell the same split as one list of every stage's layers
            megatron=("--decoder-first-pipeline-num-layers", "--num-layer-list"),
        ),
        Parameter(
            "dp",
            1,
            "data-parallel size: derived, world_size / (tp*pp*cp)",
            type=int,
            derived=True,
            deepspeed="train_batch_size",
            torchtitan="--training.global_batch_size",
            mindformers="parallel_config.data_parallel",
        ),
        Parameter(
            "micro_batch_size",
            1,
            "sequences per micro-batch per data-parallel rank",
            type=int,
            megatron="--micro-batch-size",
            deepspeed="train_micro_batch_size_per_gpu",
            torchtitan="--training.local_batch_size",
            mindformers="runner_config.batch_size",
        ),
        Parameter(
            "grad_accum",
            1,
            "micro-batches per step: derived, global_batch_size / (micro_batch_size*dp)",
            type=int,
            derived=True,
            deepspeed="gradient_accumulation_steps",
            torchtitan="--training.global_batch_size",
            # micro_batch_num with pp > 1, runner_config.gradient_accumulation_steps without
            mindformers=("parallel_config.micro_batch_num", "runner_config.gradient_accumulation_steps"),
        ),
        Parameter(
            "sequence_parallel",
            False,
            "Megatron-style sequence parallelism of the norms and dropouts with tensor parallelism",
            type=bool,
            megatron="--sequence-parallel",
            torchtitan=("--parallelism.enable-sequence-parallel", "--parallelism.no-enable-sequence-parallel"),
            mindformers="parallel_config.use_seq_parallel",
        ),
        Parameter(
            "recompute",
            "none",
            "activation recomputation granularity",
            type=str,
            allowed=("none", "selective", "full"),
            megatron="--recompute-granularity",
            deepspeed="activation_checkpointing",
            torchtitan="activation-checkpoint:",  # the trainer's subcommand, activation-checkpoint:none|selective|full
            mindformers="recompute_config",
        ),
        Parameter(
            "recompute_layers",
            None,
            "layers recomputed per stage with full recompute (None: every layer of the stage)",
            type=int,
            megatron="--recompute-num-layers",
            mindformers="recompute_config.recompute",
        ),
        Parameter(
            "zero_stage",
            0,
            "ZeRO / distributed-optimizer sharding stage (1 optimizer states, 2 + gradients, 3 + weights)",
            type=int,
            allowed=(0, 1, 2, 3),
            megatron="--use-distributed-optimizer",
            deepspeed="zero_optimization.stage",
            torchtitan="--parallelism.fsdp_reshard_after_forward",
            mindformers="parallel.enable_parallel_optimizer",
        ),
        Parameter(
            "precision",
            "bf16",
            "compute dtype (fp16 with dynamic loss scaling)",
            type=str,
            allowed=("bf16", "fp16", "fp32"),
            # a probe on a CPU: MindSpore's CPU backend has no bf16 kernels, torch's emulates bf16
            by_accelerator=(("cpu", "fp32"),),
            megatron=("--bf16", "--fp16"),
            deepspeed="bf16 / fp16",
            torchtitan="--training.mixed_precision_param",
            mindformers="model.model_config.compute_dtype",
        ),
        Parameter(
            "compile",
            "none",
            "torch.compile mode (torch backend; torchtitan's compile has no mode)",
            type=str,
            allowed=("none", "default", "reduce-overhead", "max-autotune"),
            torchtitan=("--compile.enable", "--compile.no-enable"),
        ),
        Parameter(
            "mode",
            "graph",
            "MindSpore execution mode (MindSpore backend)",
            type=str,
            allowed=("graph", "pynative"),
            mindformers="context.mode",
        ),
        Parameter(
            "jit_level",
            "O1",
            "MindSpore jit level of the MindFormers launch (the MindSpore probe, given none, runs O1 with "
            "graph_kernel_flags and O0 without: probe_jit_level)",
            type=str,
            allowed=("O0", "O1", "O2"),
            mindformers="context.jit_config.jit_level",
        ),
        Parameter(
            "graph_kernel_flags",
            "",
            "MindSpore graph-kernel fusion flags (MS_DEV_GRAPH_KERNEL_FLAGS; '' = fusion off)",
            type=str,
            mindformers="MS_DEV_GRAPH_KERNEL_FLAGS in best.env",
        ),
    )
}
STACKS = ("megatron", "deepspeed", "torchtitan", "mindformers")


def default(name: str, accelerator: str | None = None) -> Any:
    """The default of a canonical parameter (training or serving); ``accelerator`` (npu | cuda | cpu):
    that accelerator's where it has its own (a probe reads it; the study's default is ``accelerator``
    None: the space writes it into every trial it proposes). KeyError for a name the table does not hold."""
    parameter = TRAINING.get(name) or SERVING[name]
    if accelerator is not None:
        for where, value_there in parameter.by_accelerator:
            if where == accelerator:
                return value_there
    return parameter.default


def value(config: Mapping[str, Any], name: str, accelerator: str | None = None) -> Any:
    """``config[name]`` read as the table's type, or the table's default (:func:`default`) where the
    config does not name it or names it as None, "" or "None" (what a value read back from MLflow or a
    YAML null looks like), or an int parameter as 0 where its default is not 0 (no size: the callers'
    ``or 1``). A bool from a string: 1/true/yes/on. A value of the wrong kind raises ValueError
    (``int("x")``), as the callers' ``int(...)`` did."""
    raw = config.get(name)
    if raw is None or (isinstance(raw, str) and raw.strip() in ("", "None")):
        return default(name, accelerator)
    kind = (TRAINING.get(name) or SERVING[name]).type
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on") if isinstance(raw, str) else bool(raw)
    if kind is int:
        return int(raw) or default(name, accelerator)
    if kind is str:
        return str(raw)
    return raw


def spellings(stack: str) -> dict[str, Spelling]:
    """``{canonical name: flag or key}`` of the parameters ``stack`` spells (what its export writes
    for each: the header names it beside a value the evidence did not choose)."""
    return {name: p.spelling(stack) for name, p in TRAINING.items() if p.spelling(stack)}


def probe_jit_level(config: Mapping[str, Any]) -> str:
    """The MindSpore probe's jit level for a config that names none: O1 where graph-kernel flags
    (or the older ``enable_graph_kernel``) ask for fusion, which runs at O1, else O0 (MindSpore 2.10's
    kernel-by-kernel default). The MindFormers export writes the table's ``jit_level`` default (O1)."""
    if config.get("jit_level"):
        return str(config["jit_level"])
    return "O1" if value(config, "graph_kernel_flags") or config.get("enable_graph_kernel") else "O0"


# ---- the rules between training parameters (scalars or numpy arrays, element-wise; no numpy here)
DP_RULE = "dp = world_size / (tp*pp*cp)"
GRAD_ACCUM_RULE = "grad_accum = global_batch_size / (micro_batch_size*dp)"
SEQUENCE_PARALLEL_RULE = "sequence_parallel only with tp > 1 (Megatron turns it off at tp = 1)"
VPP_RULE = "vpp only with pp > 1 (one stage has no interleaving: vpp is 1)"
REFERENCE_DP_RULE = (
    "scaling_efficiency's reference: each rank's work kept, one node's worth of data parallelism "
    "(devices_per_node // (tp*pp*cp), at least 1) when the config spans nodes, else dp 1"
)
FIRST_STAGE_RULE = (
    "first_stage_layers only with pp > 1 and vpp = 1; the other pp - 1 stages split the remaining layers "
    "evenly (Megatron-LM's --decoder-first-pipeline-num-layers)"
)
RULES = (DP_RULE, GRAD_ACCUM_RULE, SEQUENCE_PARALLEL_RULE, VPP_RULE, REFERENCE_DP_RULE)


def _at_least(x: Any, low: float) -> Any:
    """``max(x, low)``, element-wise for arrays (a product of sizes below 1 is an invalid config the
    caller's checks refuse; the division stays finite)."""
    return x * (x >= low) + low * (x < low)


def data_parallel(world: Any, tp: Any, pp: Any, cp: Any) -> Any:
    """:data:`DP_RULE`: a float where tp*pp*cp does not divide the world (the caller refuses the config,
    or floors it where it has refused it already)."""
    return world / _at_least(tp * pp * cp, 1.0)


def grad_accum(global_batch_size: Any, micro_batch_size: Any, dp: Any) -> Any:
    """:data:`GRAD_ACCUM_RULE`: a float where micro_batch_size*dp does not divide the global batch."""
    return global_batch_size / _at_least(micro_batch_size * dp, 1e-9)


def reference_dp(tp: Any, pp: Any, cp: Any, dp: Any, devices_per_node: Any) -> Any:
    """:data:`REFERENCE_DP_RULE`: the data-parallel size a config's scaling efficiency reads against
    (the simulator's columns, a measured trial's projection)."""
    layout = _at_least(tp * pp * cp, 1.0)
    per_node = _at_least((devices_per_node // layout) * 1.0, 1.0)
    spans = layout * dp > devices_per_node
    wanted = per_node * spans + 1.0 * (1 - spans)
    return wanted * (wanted <= dp) + dp * (wanted > dp)


def weak_scaled(config: Mapping[str, Any], devices: int) -> tuple[int, int]:
    """``(dp, global_batch_size)`` of a resolved training ``config`` moved to ``devices``, each rank
    doing the work it did (tp, pp, cp, micro-batch and grad-accum kept): a probe slice
    (``cluster.probe_nodes``) and a scaling study's weak mode (``autotune scale``) size it alike."""
    layout = int(value(config, "tp")) * int(value(config, "pp")) * int(value(config, "cp"))
    dp = max(1, devices // layout)
    return dp, int(config["micro_batch_size"]) * dp * int(config["grad_accum"])


def sequence_parallel_on(sequence_parallel: Any, tp: Any) -> Any:
    """:data:`SEQUENCE_PARALLEL_RULE`: whether sequence parallelism is on."""
    return sequence_parallel & (tp > 1)


def stage_layers(num_layers: Any, pp: Any, first_stage_layers: Any) -> tuple[Any, Any]:
    """:data:`FIRST_STAGE_RULE`: ``(layers of the first stage, layers of each other stage)``;
    ``first_stage_layers`` None, 0 or negative (the simulator's "unset") is an even split. Floats where
    the split does not divide (the caller refuses the config)."""
    even = num_layers / _at_least(pp * 1.0, 1.0)
    if first_stage_layers is None:
        return even, even
    uneven = (first_stage_layers > 0) & (pp > 1)
    first = first_stage_layers * uneven + even * (1 - uneven)
    rest = (num_layers - first_stage_layers) / _at_least(pp - 1.0, 1.0)
    return first, rest * uneven + even * (1 - uneven)


def first_stage_split_divides(num_layers: Any, pp: Any, first_stage_layers: Any) -> Any:
    """:data:`FIRST_STAGE_RULE`: whether the layers left after ``first_stage_layers`` (at least one
    layer first) split evenly over the other ``pp - 1`` stages, leaving them at least one each."""
    fits = (first_stage_layers > 0) & (first_stage_layers < num_layers)
    return fits & ((num_layers - first_stage_layers) % _at_least(pp - 1, 1) == 0)


def effective_vpp(vpp: Any, pp: Any) -> Any:
    """:data:`VPP_RULE`: the virtual stages a pipeline of ``pp`` stages runs."""
    return vpp * (pp > 1) + (pp <= 1)


# ---- the devices a config occupies (the dispatcher reserves them, the metrics divide by them)
DEVICES_RULE = (
    "a trial's devices: tp*pp*cp*dp for training (the world), replicas*tp*pp for serving (replicas of one "
    "tp*pp instance; a disaggregated deployment adds prefill_replicas*prefill_tp*pp), tp for offline "
    "inference (one instance)"
)


def instance_devices(config: Mapping[str, Any]) -> int:
    """The devices one engine instance spans: tp*pp."""
    return value(config, "tp") * value(config, "pp")


INSTANCE_NODES_RULE = (
    "an engine instance wider than a node takes whole nodes (tp*pp a multiple of devices_per_node), "
    "as vLLM's multi-node launch (--nnodes) splits its ranks evenly over the nodes"
)


def instance_nodes(size: Any, devices_per_node: Any) -> Any:
    """The nodes one serving instance of ``size`` (tp*pp) devices spans: 1 within a node, else
    ``size / devices_per_node`` rounded up (:data:`INSTANCE_NODES_RULE`; scalars or numpy arrays,
    element-wise)."""
    per = _at_least(devices_per_node, 1)
    return (size > per) * (-(-size // per)) + (size <= per) * 1


def instance_splits_a_node(size: Any, devices_per_node: Any) -> Any:
    """Where :data:`INSTANCE_NODES_RULE` is broken: an instance wider than a node that leaves part of
    one (scalars or numpy arrays, element-wise)."""
    per = _at_least(devices_per_node, 1)
    return (size > per) & (size % per != 0)


def pd_placement(
    prefill_replicas: int, prefill_size: int, replicas: int, size: int, devices_per_node: int
) -> list[tuple[str, int, int, int, list[int]]]:
    """Where a disaggregated deployment's instances go: (pool, index in the pool, first node, nodes,
    the devices it takes on each of them) of every instance, prefill first. An instance within a node
    goes first-fit on the current node (the next one when it does not fit); one wider than a node
    takes whole nodes of its own (:data:`INSTANCE_NODES_RULE`), every device of each."""
    per = max(int(devices_per_node), 1)
    sizes = [("prefill", int(prefill_size))] * int(prefill_replicas) + [("decode", int(size))] * int(replicas)
    out: list[tuple[str, int, int, int, list[int]]] = []
    node, used, counts = 0, 0, {"prefill": 0, "decode": 0}
    for pool, width in sizes:
        if width > per:
            if used:
                node, used = node + 1, 0
            nodes = -(-width // per)
            out.append((pool, counts[pool], node, nodes, list(range(per))))
            node += nodes
        else:
            if used + width > per:
                node, used = node + 1, 0
            out.append((pool, counts[pool], node, 1, list(range(used, used + width))))
            used += width
        counts[pool] += 1
    return out


def pd_nodes(prefill_replicas: Any, prefill_size: Any, replicas: Any, size: Any, devices_per_node: int) -> Any:
    """The nodes :func:`pd_placement` takes (element-wise over arrays; computed once per distinct layout)."""
    import numpy as np  # here: the probes import this module without numpy

    cols = np.broadcast_arrays(
        *(np.asarray(x, dtype=np.int64) for x in (prefill_replicas, prefill_size, replicas, size))
    )
    flat = np.stack([c.ravel() for c in cols], axis=1)
    if flat.size == 0:
        return np.zeros(cols[0].shape, dtype=np.int64)
    layouts, back = np.unique(flat, axis=0, return_inverse=True)
    per = max(int(devices_per_node), 1)

    def nodes(prefill: int, prefill_size: int, replicas: int, size: int) -> int:
        if max(prefill, 0) + max(replicas, 0) > _PLACED_MAX:  # no cluster holds it: at least its devices' nodes
            return -(-(max(prefill, 0) * max(prefill_size, 1) + max(replicas, 0) * max(size, 1)) // per)
        placed = pd_placement(prefill, prefill_size, replicas, size, per)
        return max((first + n for _, _, first, n, _ in placed), default=0)

    counts = np.array([nodes(*map(int, row)) for row in layouts], dtype=np.int64)
    return counts[back.ravel()].reshape(cols[0].shape)


_PLACED_MAX = 4096  # instances beyond which pd_nodes bounds rather than places (a spec's typo, never a cluster)


def prefill_tensor_parallel(config: Mapping[str, Any]) -> int:
    """A disaggregated deployment's prefill instance's tensor-parallel size (``prefill_tp`` 0: ``tp``)."""
    return prefill_tp_or_tp(value(config, "prefill_tp"), value(config, "tp"))


def prefill_devices(config: Mapping[str, Any]) -> int:
    """The devices of a serving config's prefill pool: prefill_replicas*prefill_tp*pp (0 aggregated)."""
    return value(config, "prefill_replicas") * prefill_tensor_parallel(config) * value(config, "pp")


def trial_devices(workload_kind: str, config: Mapping[str, Any]) -> int:
    """:data:`DEVICES_RULE`: the devices one trial of a ``workload_kind`` workload occupies; a probe's
    reported ``world_size`` is not read here (the caller prefers it where the probe knows it)."""
    if workload_kind == "train":
        return instance_devices(config) * value(config, "cp") * value(config, "dp")
    if workload_kind == "serve":
        return value(config, "replicas") * instance_devices(config) + prefill_devices(config)
    return value(config, "tp")
