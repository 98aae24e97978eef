"""The production stack as the probe: a trial rendered into the stack's own launch.

``backend: {kind: megatron | mindspeed | torchtitan | deepspeed, entry: ..., args: [...]}`` runs
the team's own training entry point (Megatron-LM's or MindSpeed-LLM's ``pretrain_gpt.py``,
torchtitan's trainer, a DeepSpeed training script) for a bounded number of iterations under
``torchrun --standalone``, with the trial's settings rendered by the same functions as
``autotune export`` (one source of truth: what is measured is what is exported), and reads the
stack's own log lines (:mod:`autotune.workers.stack_logs`) as the probe protocol.

What every preset shares is built here (the ``torchrun`` launcher, one process per node across
nodes, the entry point, the user's ``args`` with ``{iterations}`` filled in, ``$AUTOTUNE_ITERATIONS``
and the log reader's options); what each stack adds is its descriptor's ``launch``
(:mod:`autotune.stacks`: ``megatron``/``mindspeed`` the model's architecture and the trial's
Megatron arguments, ``torchtitan`` its CLI overrides and activation-checkpoint subcommand,
``deepspeed`` the trial's DeepSpeed JSON).

A serving engine (``backend: {kind: vllm | mindie}``) is no torchrun job: its launch writes
``engine.json`` (the engine's command line per replica, rendered by the same functions as its
export) and runs autotune's serving probe, which starts the servers, drives the load and prints
the probe protocol itself (no log reader); ``launcher`` is then the engine's interpreter
(``backend.python``) and ``devices`` the trial's ``replicas x tp x pp``.
"""

from __future__ import annotations

import sys
from typing import Any

from autotune.workers.parameters import trial_devices, value
from autotune.workers.torch_probe.launch import static_rendezvous

from ..guide.memory_profile import fill_num_layers, num_layers_of
from ..stacks import PresetRun, preset, preset_names
from ..stacks.deepspeed import DEEPSPEED_CONFIG_FILE

__all__ = ["preset_launch", "DEEPSPEED_CONFIG_FILE"]


def _entry(entry: str) -> list[str]:
    """A script path, or ``-m package.module`` for a module run with ``python -m``."""
    if entry.startswith("-m "):
        return ["-m", entry[3:].strip()]
    return [entry]


def preset_launch(
    kind: str, backend: Any, request: Any, iterations: int, warmup: int, python: str | None = None, nodes: int = 1
) -> dict[str, Any]:
    """``argv``, ``env``, ``files`` (name -> text, written beside the trial file; ``{trial_dir}``
    in argv names that folder) and the ``stack_log`` options of one trial's launch."""
    stack = preset(kind)
    if stack is None or stack.launch is None:
        raise ValueError(f"no stack preset {kind!r}; expected one of {', '.join(preset_names())}")
    if stack.serving:
        return _serving_launch(stack, backend, request, python)
    config, workload = request.params, request.workload
    devices = value(config, "tp") * value(config, "pp") * value(config, "cp") * value(config, "dp")
    gbs = int(workload.get("global_batch_size") or 0)
    seq = int(workload.get("seq_len") or 0)
    # one process per node; the dispatcher fills in the placeholders
    rendezvous = ["--standalone"] if nodes <= 1 else static_rendezvous("{nnodes}")
    launcher = [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        "--nproc-per-node",
        str(devices // max(1, nodes)),
    ]
    entry = backend.entry or stack.default_entry
    run = PresetRun(
        request=request,
        launcher=launcher,
        entry=_entry(str(entry)) if entry else [],
        # {num_layers}: the model's layers (fewer in a memory profile), for a script that builds its own model
        user=fill_num_layers(
            (str(a).replace("{iterations}", str(iterations)) for a in backend.args or []), request.model
        ),
        iterations=iterations,
        devices=devices,
        global_batch_size=gbs,
        layers=num_layers_of(request.model),
    )
    launch = stack.launch(run)
    # $AUTOTUNE_ITERATIONS: for a script with no standard flag for its step count (DeepSpeed)
    env: dict[str, str] = {"AUTOTUNE_ITERATIONS": str(iterations), **launch.env}
    log_options = {
        "kind": stack.log_reader,
        "warmup": warmup,
        "tokens_per_iteration": gbs * seq if gbs and seq else None,
        "devices": devices,
        "samples_per_iteration": gbs or None,
    }
    return {"argv": list(launch.argv), "env": env, "files": dict(launch.files), "stack_log": log_options}


def _serving_launch(stack: Any, backend: Any, request: Any, python: str | None) -> dict[str, Any]:
    """A serving engine's preset: the probe's argv and ``engine.json`` (no log reader: the serving
    probe prints the protocol)."""
    config = request.params
    devices = trial_devices("serve", config)  # replicas x tp x pp
    entry = backend.entry or stack.default_entry
    run = PresetRun(
        request=request,
        launcher=[python or sys.executable],
        entry=_entry(str(entry)) if entry else [],
        user=[str(a) for a in (backend.args or [])],
        iterations=0,
        devices=devices,
        global_batch_size=0,
        layers=int(request.model.get("num_hidden_layers") or 0),
    )
    launch = stack.launch(run)
    return {"argv": list(launch.argv), "env": dict(launch.env), "files": dict(launch.files), "stack_log": None}
