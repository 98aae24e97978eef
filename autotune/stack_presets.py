"""The production stack as the probe: a trial rendered into the stack's own launch.

``backend: {kind: megatron | mindspeed | torchtitan | deepspeed, entry: ..., args: [...]}`` runs
the team's own training entry point (Megatron-LM's or MindSpeed-LLM's ``pretrain_gpt.py``,
torchtitan's trainer, a DeepSpeed training script) for a bounded number of iterations under
``torchrun --standalone``, with the trial's settings rendered by the same functions as
``autotune export`` (one source of truth: what is measured is what is exported), and reads the
stack's own log lines (:mod:`autotune.workers.stack_logs`) as the probe protocol.

What each preset adds to the launch:

- megatron / mindspeed: the model's architecture and the trial's parallel, batch, recompute,
  optimizer-sharding and precision arguments (``export._megatron``; MindSpeed-LLM's fusion flags
  for ``mindspeed``), ``--train-iters``, ``--log-interval 1``, ``--log-throughput``,
  ``--eval-iters 0``, then ``args`` (data, tokenizer: argparse keeps the last value, so the
  team's own flags win);
- torchtitan: ``args`` first (``--module``/``--config`` of the team's job), the trial's
  overrides (``export._torchtitan``), ``--training.steps``, ``--metrics.log_freq 1``, and the
  activation-checkpoint subcommand last;
- deepspeed: ``--deepspeed_config`` pointing at the trial's DeepSpeed JSON (``export._deepspeed``,
  with ``steps_per_print: 1`` so the throughput timer prints every step), then ``args``. A
  DeepSpeed script has no standard flag for its step count: ``{iterations}`` in ``args`` (or
  ``$AUTOTUNE_ITERATIONS``, set for every preset) is the number of iterations to run.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["PRESETS", "preset_launch", "DEEPSPEED_CONFIG_FILE"]

PRESETS = ("megatron", "mindspeed", "torchtitan", "deepspeed")
DEEPSPEED_CONFIG_FILE = "deepspeed_config.json"


def _entry(entry: str) -> list[str]:
    """A script path, or ``-m package.module`` for a module run with ``python -m``."""
    if entry.startswith("-m "):
        return ["-m", entry[3:].strip()]
    return [entry]


def preset_launch(kind: str, backend: Any, request: Any, iterations: int, warmup: int,
                  python: str | None = None, nodes: int = 1) -> dict[str, Any]:
    """``argv``, ``env``, ``files`` (name -> text, written beside the trial file; ``{trial_dir}``
    in argv names that folder) and the ``stack_log`` options of one trial's launch."""
    from .export import ExportContext
    from .export._deepspeed import DeepSpeedExporter
    from .export._megatron import MINDSPEED_FLAGS, megatron_args, model_args
    from .export._torchtitan import activation_checkpoint_subcommand, torchtitan_args

    config, model, workload, cluster = request.params, request.model, request.workload, request.cluster
    devices = (int(config.get("tp", 1)) * int(config.get("pp", 1)) * int(config.get("cp", 1) or 1)
               * int(config.get("dp", 1) or 1))
    gbs = int(workload.get("global_batch_size") or 0)
    seq = int(workload.get("seq_len") or 0)
    layers = int(model.get("num_hidden_layers") or 0)
    rendezvous = ["--standalone"] if nodes <= 1 else [  # one process per node, the dispatcher fills these in
        "--nnodes", "{nnodes}", "--node-rank", "{node_rank}", "--master-addr", "{master_addr}",
        "--master-port", "{master_port}"]
    launcher = [python or sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node",
                str(devices // max(1, nodes))]
    entry = _entry(str(backend.entry))
    user = [str(a).replace("{iterations}", str(iterations)) for a in (backend.args or [])]
    env: dict[str, str] = {"AUTOTUNE_ITERATIONS": str(iterations)}  # for a script with no standard flag (DeepSpeed)
    files: dict[str, str] = {}
    if kind in ("megatron", "mindspeed"):
        stack = list(MINDSPEED_FLAGS) if kind == "mindspeed" else []
        if kind == "mindspeed" and int(config.get("cp", 1) or 1) > 1:
            stack += ["--context-parallel-algo", "megatron_cp_algo"]
        argv = [*launcher, *entry, *model_args(model, workload, kind), *stack, *megatron_args(config, gbs, layers),
                "--train-iters", str(iterations), "--log-interval", "1", "--log-throughput", "--eval-iters", "0",
                *user]
        if int(config.get("tp", 1)) > 1 or int(config.get("cp", 1) or 1) > 1:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron's validate_args requires it for tp/cp > 1
    elif kind == "torchtitan":  # torchtitan logs on every rank: keep rank 0's (as its run_train.sh does)
        launcher = [*launcher[:-2], "--local-ranks-filter", "0", *launcher[-2:]]
        argv = [*launcher, *(entry if backend.entry else ["-m", "torchtitan.train"]), *user,
                *torchtitan_args(config, workload, layers), "--training.steps", str(iterations),
                "--metrics.log_freq", "1", activation_checkpoint_subcommand(config)]
    elif kind == "deepspeed":
        ctx = ExportContext(study=request.study, trial=request.number, config=dict(config), metrics={},
                            source="probe", model=model, workload=workload, cluster={**cluster, "world_size": devices})
        ds = json.loads(DeepSpeedExporter().render(ctx))
        ds["steps_per_print"] = 1  # the throughput timer prints at every step
        files[DEEPSPEED_CONFIG_FILE] = json.dumps(ds, indent=1)
        argv = [*launcher, *entry, "--deepspeed_config", f"{{trial_dir}}/{DEEPSPEED_CONFIG_FILE}", *user]
    else:
        raise ValueError(f"no stack preset {kind!r}; expected one of {', '.join(PRESETS)}")
    log_options = {"kind": kind, "warmup": warmup, "tokens_per_iteration": gbs * seq if gbs and seq else None,
                   "devices": devices, "samples_per_iteration": gbs or None}
    return {"argv": argv, "env": env, "files": files, "stack_log": log_options}
