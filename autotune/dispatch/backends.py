"""Which probe measures a trial, and how it is launched.

``backend: auto`` means real probes where the devices exist, else the simulator — and the user is
told which and why on the first line of ``autotune run``. Device presence is checked without
importing torch (device nodes and the vendor's Python package), so the CLI stays fast and a
machine without torch still gets a useful answer.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass

from ..spec.schema import BACKEND_KINDS, Spec
from ..stacks import preset, preset_names
from autotune.workers.parameters import trial_devices
from autotune.workers.protocol import TrialRequest

__all__ = ["BackendChoice", "select_backend", "visible_devices", "launch_for", "trial_placement", "least_trial_devices"]


@dataclass(frozen=True)
class BackendChoice:
    kind: str  # simulate | command | torch | mindspore
    reason: str

    @property
    def simulated(self) -> bool:
        return self.kind == "simulate"


def visible_devices(accelerator: str) -> int:
    """Accelerators of this kind visible to this host (0 when none or not determinable): the
    runtime's visibility variable, else the device nodes. Which Python packages autotune's own
    interpreter has says nothing here: a stack's torch_npu may live in the stack's environment."""
    if accelerator == "npu":
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        if visible:
            return len([d for d in visible.split(",") if d.strip()])
        return len(glob.glob("/dev/davinci[0-9]*"))
    if accelerator == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
        return len(glob.glob("/dev/nvidia[0-9]*"))
    return os.cpu_count() or 1


def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def _npu_runtime_installed() -> bool:
    """torch_npu (or MindSpore) importable here: what ``auto`` needs to run its torch probe on NPUs."""
    return importlib.util.find_spec("torch_npu") is not None or importlib.util.find_spec("mindspore") is not None


def select_backend(spec: Spec, override: str | None = None) -> BackendChoice:
    """Resolve ``auto`` (and an explicit ``--backend``) into a concrete backend with a reason.

    A stack preset always runs its stack: the stack's launcher, in its own environment, knows its
    devices, and a study the user pointed at Megatron must never quietly become a simulation.
    ``torch``/``mindspore`` named in the spec for devices this host does not show preview with the
    simulator (said on the first line; ``--backend`` forces the probes)."""
    kind = override or spec.backend.kind
    acc = spec.cluster.accelerator
    kinds = (*BACKEND_KINDS, *(name for name in preset_names() if name not in BACKEND_KINDS))
    if kind not in kinds:
        raise ValueError(f"--backend: expected one of {', '.join(kinds)}, got {kind!r}")
    if kind == "simulate":
        return BackendChoice(
            "simulate", "backend 'simulate' requested: results are predictions of the analytical model"
        )
    if preset(kind) is not None:  # a registered stack preset (autotune.stacks)
        if kind != spec.backend.kind:
            raise ValueError(
                f"--backend {kind}: the spec's backend is {spec.backend.kind!r}; a stack preset needs "
                f"backend.kind: {kind} with its entry and args in the spec"
            )
        return BackendChoice(kind, f"stack preset '{kind}': the stack's own launch and log, every result a measurement")
    if kind in ("torch", "mindspore") and override is None and acc != "cpu" and visible_devices(acc) == 0:
        # the spec names a real probe for devices this machine lacks: preview with the
        # simulator (``--backend`` forces the probe anyway)
        name = {"npu": "NPU", "cuda": "GPU"}[acc]
        return BackendChoice(
            "simulate",
            f"the spec asks for {kind} probes but no {name} is visible: using the "
            f"simulator; results are predictions (--backend {kind} forces the probes)",
        )
    if kind in ("command", "torch", "mindspore"):
        if kind == "command" and not spec.backend.argv:
            raise ValueError("--backend command needs backend.argv in the spec")
        return BackendChoice(kind, f"backend '{kind}' requested: every result is a measurement")
    # auto
    name = {"npu": "NPU", "cuda": "GPU", "cpu": "CPU"}[acc]
    if acc != "cpu" and visible_devices(acc) == 0:
        return BackendChoice("simulate", f"no {name} visible: using the simulator; results are predictions")
    if acc == "npu" and not _npu_runtime_installed():
        return BackendChoice(
            "simulate",
            f"{visible_devices(acc)} NPU(s) visible but torch_npu is not installed here "
            "(pip install 'autotune[npu]'): using the simulator; results are predictions",
        )
    if not _torch_installed():
        return BackendChoice(
            "simulate",
            "torch is not installed (pip install 'autotune[torch]'): using the simulator; results are predictions",
        )
    have = visible_devices(acc)
    return BackendChoice("torch", f"{have} {name}(s) visible: real torch probes; every result is a measurement")


def node_bundle(accelerator: str, devices_per_node: int) -> dict[str, float]:
    """One node's placement-group bundle: its devices (and a CPU for the launcher)."""
    if accelerator == "npu":
        return {"NPU": float(devices_per_node), "CPU": 1.0}
    if accelerator == "cuda":
        return {"GPU": float(devices_per_node), "CPU": 1.0}
    return {"CPU": float(devices_per_node)}


def least_trial_devices(spec: Spec) -> int:
    """The fewest devices any trial of the spec's space occupies (what a cluster must offer at all)."""
    if spec.workload.kind == "train":
        probe = spec.cluster.probe_slice  # tuned on a slice: its probes run there
        return probe * spec.cluster.devices_per_node if probe else spec.cluster.world_size
    choices = spec.space.choices()
    tp = min(int(v) for v in (choices.get("tp") or [1]))
    if spec.workload.kind == "serve":
        return (
            tp * min(int(v) for v in (choices.get("pp") or [1])) * min(int(v) for v in (choices.get("replicas") or [1]))
        )
    return tp


def trial_placement(spec: Spec, devices: int) -> dict:
    """What a trial of ``devices`` asks the cluster for: its Ray ``resources`` (one task), and for a
    trial over several whole nodes (the world of a multi-node cluster, or its probe slice),
    ``nodes`` with one ``bundle`` each."""
    from .dispatcher import resources_for

    per_node = spec.cluster.devices_per_node
    nodes = devices // per_node if devices > per_node and devices % per_node == 0 else 1  # whole nodes each
    return {
        "resources": resources_for(spec.cluster.accelerator, devices, spec.backend.resources),
        "nodes": nodes,
        "bundle": node_bundle(spec.cluster.accelerator, spec.cluster.devices_per_node),
    }


def launch_for(spec: Spec, choice: BackendChoice, request: TrialRequest):
    """The :class:`~autotune.dispatch.dispatcher.ProbeLaunch` of one trial for a real backend."""
    from .dispatcher import ProbeLaunch

    from ..guide.memory_profile import NUM_LAYERS_ENV, fill_num_layers, num_layers_of
    from ..guide.short_remeasure import MEASURED_STEPS_ENV, fill_measured_steps

    backend = spec.backend
    timeout = backend.timeout_s or spec.workload.timeout_s
    # the layers of the model this trial runs: fewer than the spec's in a memory profile
    # (autotune.guide.memory_profile), so a launcher that takes its own layer count is told; and the
    # timed steps it runs: fewer in a re-measurement (autotune.guide.short_remeasure)
    env = {**backend.env, **request.env(), NUM_LAYERS_ENV: str(num_layers_of(request.model))}
    if request.workload.get("measured_steps"):
        env[MEASURED_STEPS_ENV] = str(int(request.workload["measured_steps"]))
    placement = trial_placement(spec, trial_devices(spec.workload.kind, request.params))
    resources, nodes = placement["resources"], placement["nodes"]
    cwd = backend.cwd
    if cwd and not os.path.isabs(cwd) and spec.source_path is not None:
        cwd = str(spec.source_path.resolve().parent / cwd)
    spread = (
        dict(nodes=nodes, bundle=placement["bundle"], placement_timeout_s=spec.ray.placement_timeout_s)
        if nodes > 1
        else {}
    )
    spread["oom_exit_grace_s"] = backend.oom_exit_grace_s  # every process probe: an OOM that does not exit
    if choice.kind == "command":
        return ProbeLaunch(
            argv=fill_measured_steps(fill_num_layers(backend.argv or [], request.model), request.workload),
            env=env,
            timeout_s=timeout,
            resources=resources,
            metric_patterns=backend.metric_patterns or None,
            cwd=cwd,
            **spread,
        )
    if choice.kind == "torch":
        from autotune.workers.torch_probe.launch import probe_argv, torchrun_argv

        # backend.launcher: warm / spawn on one node (seconds less per trial), torchrun across nodes
        python = backend.python or sys.executable
        argv = torchrun_argv(request, python) if nodes > 1 else probe_argv(request, python)
        return ProbeLaunch(
            argv=argv, env=env, timeout_s=timeout, resources=resources, metric_patterns=None, cwd=cwd, **spread
        )
    if choice.kind == "mindspore":
        from autotune.workers.mindspore_probe.launch import probe_argv as ms_argv, probe_env, resolve_python

        python = resolve_python(backend.python, spec.source_path.resolve().parent if spec.source_path else None)
        # MindSpore's kernel compiler (AKG) writes its kernels into the working directory: a
        # shared scratch folder keeps them out of the user's tree and reuses them across trials
        work = cwd or os.path.join(tempfile.gettempdir(), f"autotune-mindspore-{os.getuid()}")
        os.makedirs(work, exist_ok=True)
        return ProbeLaunch(
            argv=ms_argv(request, python),
            env={**probe_env(python), **env},
            timeout_s=timeout,
            resources=resources,
            metric_patterns=None,
            cwd=work,
            **spread,
        )
    stack = preset(choice.kind)
    if stack is not None:  # the stack's own launch and log (autotune.stacks, autotune.dispatch.stack_presets)
        from .stack_presets import preset_launch

        workload = spec.workload
        warmup = int(getattr(workload, "warmup_steps", 1) or 0)
        iterations = backend.iterations or warmup + int(getattr(workload, "measured_steps", 3) or 1)
        if not backend.iterations:  # lines the stack logs that cannot be measured (Megatron's first after warm-up)
            iterations += stack.extra_iterations
        entry_backend = backend
        if (
            backend.entry
            and not backend.entry.startswith("-m ")
            and not os.path.isabs(backend.entry)
            and spec.source_path is not None
            and (os.sep in backend.entry or backend.entry.endswith(".py"))
        ):  # a script path is relative to the spec (a bare name, e.g. mindieservice_daemon, is a command)
            entry_backend = backend.model_copy(update={"entry": str(spec.source_path.resolve().parent / backend.entry)})
        python = backend.python
        if python and os.sep in python and not os.path.isabs(python) and spec.source_path is not None:
            python = str(spec.source_path.resolve().parent / python)  # an interpreter path is relative to the spec
        launch = preset_launch(stack.name, entry_backend, request, iterations, warmup, python, nodes=nodes)
        if stack.serving and nodes > 1:  # an instance across nodes: node 0's probe measures it
            spread["ends_with_node_0"] = True
        return ProbeLaunch(
            argv=launch["argv"],
            env={**launch["env"], **env},
            timeout_s=timeout,
            resources=resources,
            metric_patterns=backend.metric_patterns or None,
            cwd=cwd,
            files=launch["files"],
            stack_log=launch["stack_log"],
            **spread,
        )
    raise ValueError(f"backend {choice.kind!r} is not launched as a process")
