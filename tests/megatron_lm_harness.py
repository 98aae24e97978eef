"""Run Megatron-LM's own ``parse_args`` + ``validate_args`` on exported launch scripts.

    python tests/megatron_lm_harness.py MEGATRON_LM_CHECKOUT < cases.json > results.json

Each case is ``{"argv": [...], "env": {...}, "world_size": N}``: the arguments the exported
script passes to ``pretrain_gpt.py`` (plus the data/tokenizer arguments a user adds) and the
environment it exports. Each result is ``{"ok": true, "args": {...}}`` with the values Megatron
settled on, or ``{"ok": false, "error": "..."}`` with Megatron's own message. One process for all
cases: importing Megatron takes ~15 s.

The machine has no GPU, so two things stand in for the device: ``get_device_arch_version`` says
9 (Hopper; Ascend takes the same pre-Blackwell path, where ``validate_args`` requires
``CUDA_DEVICE_MAX_CONNECTIONS=1`` for tp/cp > 1), and on Python < 3.12 ``typing.override`` comes
from ``typing_extensions`` (Megatron's main branch imports it).
"""

from __future__ import annotations

import json
import os
import sys
import typing

READ_BACK = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "data_parallel_size",
    "micro_batch_size",
    "global_batch_size",
    "sequence_parallel",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "use_distributed_optimizer",
    "bf16",
    "fp16",
    "hidden_dropout",
    "attention_dropout",
    "rotary_base",
    "norm_epsilon",
    "num_layers",
    "num_query_groups",
    "untie_embeddings_and_output_weights",
    "swiglu",
    "transformer_impl",
)


def main() -> int:
    sys.path.insert(0, sys.argv[1])
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    import megatron.training.arguments as arguments

    arguments.get_device_arch_version = lambda: 9
    cases = json.load(sys.stdin)
    results = []
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # Megatron prints its settings: keep stdout for the JSON
    base_env = dict(os.environ)
    for case in cases:
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        os.environ.update(case.get("env", {}))
        sys.argv = ["pretrain_gpt.py", *case["argv"]]
        try:
            args = arguments.parse_args(ignore_unknown_args=bool(case.get("ignore_unknown")))
            args.world_size, args.rank = int(case["world_size"]), 0
            arguments.validate_args(args)
            results.append({"ok": True, "args": {k: getattr(args, k, None) for k in READ_BACK}})
        except (AssertionError, ValueError, SystemExit, TypeError) as exc:
            results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    json.dump(results, real_stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
