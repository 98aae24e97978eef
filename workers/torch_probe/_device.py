"""The device, the collective backend and the process environment, picked once per probe.

One table decides everything accelerator-specific (``ACCELERATORS``), so nothing else in the
probe names cuda: cpu → gloo, cuda → nccl, npu → ``import torch_npu`` then hccl. The environment
part (``prepare_env``, ``visible_devices``, ``threads_per_rank``) imports no torch, because
allocator settings such as ``PYTORCH_NPU_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` are read when the
allocator starts and must be in ``os.environ`` before torch is imported. The torch part takes an
``importer`` so the cuda and npu paths are unit-testable on a machine without either.
"""

from __future__ import annotations

import re

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable, MutableMapping

from .failures import ProbeFailure

__all__ = [
    "ACCELERATORS",
    "DeviceInfo",
    "accelerator_of",
    "prepare_env",
    "visible_devices",
    "local_device_index",
    "threads_per_rank",
    "available_cpus",
    "setup_device",
    "device_module",
    "device_name",
    "software_versions",
]


@dataclass(frozen=True)
class _Accel:
    backend: str  # torch.distributed backend
    visibility_env: str | None  # which devices this process may see (set by Ray / the launcher)
    extension: str | None  # module that registers the device with torch


ACCELERATORS: dict[str, _Accel] = {
    "cpu": _Accel("gloo", None, None),
    "cuda": _Accel("nccl", "CUDA_VISIBLE_DEVICES", None),
    "npu": _Accel("hccl", "ASCEND_RT_VISIBLE_DEVICES", "torch_npu"),
}


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # cpu | cuda | npu
    backend: str
    index: int | None  # local device index (None on cpu)

    @property
    def name(self) -> str:
        """The torch device string: ``cpu``, ``cuda:1``, ``npu:0``."""
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def accelerator_of(cluster: dict[str, Any]) -> str:
    kind = str(cluster.get("accelerator", "cpu")).lower()
    if kind == "gpu":
        kind = "cuda"
    if kind not in ACCELERATORS:
        raise ProbeFailure(
            "invalid", f"invalid config: cluster.accelerator={kind!r}, expected one of {', '.join(ACCELERATORS)}"
        )
    return kind


def prepare_env(
    trial_env: dict[str, str], kind: str, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Apply the trial's ``env.*`` settings to this process before torch starts; return what was set.

    The trial's values win over inherited ones (the trial *is* the config being measured). On
    cuda the NPU allocator string is copied to ``PYTORCH_CUDA_ALLOC_CONF`` (same syntax for the
    common keys such as ``expandable_segments:True``), unless the trial set that one itself.
    On cpu, ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` keeps an installed torch_npu without CANN from
    breaking ``import torch``.
    """
    environ = os.environ if environ is None else environ
    applied: dict[str, str] = {}
    for key, value in trial_env.items():
        environ[key] = str(value)
        applied[key] = str(value)
    if kind == "cuda" and "PYTORCH_NPU_ALLOC_CONF" in environ and "PYTORCH_CUDA_ALLOC_CONF" not in trial_env:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = environ["PYTORCH_NPU_ALLOC_CONF"]
        applied["PYTORCH_CUDA_ALLOC_CONF"] = environ["PYTORCH_NPU_ALLOC_CONF"]
    if kind == "cpu" and "TORCH_DEVICE_BACKEND_AUTOLOAD" not in environ:
        environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        applied["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return applied


def visible_devices(kind: str, environ: MutableMapping[str, str] | None = None) -> list[str] | None:
    """The device ids the visibility variable exposes (None when unset: all are visible)."""
    environ = os.environ if environ is None else environ
    var = ACCELERATORS[kind].visibility_env
    if var is None or var not in environ:
        return None
    return [d.strip() for d in environ[var].split(",") if d.strip()]


def local_device_index(kind: str, local_rank: int, environ: MutableMapping[str, str] | None = None) -> int | None:
    """Which device this rank drives: the ``local_rank``-th *visible* one.

    Ray sets ``ASCEND_RT_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` to the devices it reserved
    for the task; the runtime renumbers them from 0, so the logical index is the local rank and
    the physical ids are never used directly. Too few visible devices is a placement error.
    """
    if kind == "cpu":
        return None
    visible = visible_devices(kind, environ)
    if visible is not None and local_rank >= len(visible):
        var = ACCELERATORS[kind].visibility_env
        raise ProbeFailure(
            "crash",
            f"local rank {local_rank} needs a {kind} device but {var}={','.join(visible)!r} "
            f"exposes only {len(visible)}",
        )
    return local_rank


def available_cpus() -> int:
    """CPUs this process may run on (affinity/cgroup aware where the OS says so)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_rank(cluster: dict[str, Any], local_world_size: int, cpus: int | None = None) -> int:
    """Intra-op threads for one rank: ``cluster.threads_per_rank`` if given, else the CPUs shared
    evenly among the ranks of this node (at least 1). Set explicitly because Ray hands tasks with
    ``num_cpus=0`` ``OMP_NUM_THREADS=1``, which would silently serialise every CPU probe."""
    explicit = cluster.get("threads_per_rank")
    if explicit:
        return max(1, int(explicit))
    cpus = available_cpus() if cpus is None else cpus
    return max(1, cpus // max(1, local_world_size))


def setup_device(
    kind: str,
    local_rank: int,
    environ: MutableMapping[str, str] | None = None,
    importer: Callable[[str], Any] = importlib.import_module,
) -> DeviceInfo:
    """Load the device extension (torch_npu) and bind this process to its device."""
    accel = ACCELERATORS[kind]
    if accel.extension:
        try:
            importer(accel.extension)
        except ImportError as exc:
            raise ProbeFailure("crash", f"accelerator {kind!r} needs {accel.extension}: {exc}") from None
    index = local_device_index(kind, local_rank, environ)
    if index is not None:
        device_module(kind, importer).set_device(index)
    return DeviceInfo(kind=kind, backend=accel.backend, index=index)


class _CpuModule:
    """The device-module interface on cpu: nothing to synchronise, no allocator statistics."""

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def set_device(index: int) -> None:
        return None

    @staticmethod
    def max_memory_allocated(device: Any = None) -> None:
        return None

    @staticmethod
    def max_memory_reserved(device: Any = None) -> None:
        return None

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None


def device_module(kind: str, importer: Callable[[str], Any] = importlib.import_module) -> Any:
    """``torch.cuda`` / ``torch.npu`` / a cpu stand-in: synchronize, memory statistics, set_device."""
    if kind == "cpu":
        return _CpuModule
    torch = importer("torch")
    module = getattr(torch, kind, None)
    if module is None:
        raise ProbeFailure("crash", f"torch has no {kind!r} device module (is {ACCELERATORS[kind].extension} loaded?)")
    return module


def software_versions(kind: str) -> dict[str, str]:
    """The software a probe (or a calibration) ran with, as its result reports it."""
    import torch

    info = {"torch": torch.__version__}
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (loaded already by setup_device)

            info["torch_npu"] = getattr(torch_npu, "__version__", "unknown")
            cann = getattr(getattr(torch_npu, "version", None), "cann", None)
            if cann:
                info["cann"] = str(cann)
        except ImportError:
            pass
    if kind == "cuda":
        info["cuda"] = str(torch.version.cuda)
    driver = driver_version(kind)
    if driver:
        info["driver"] = driver
    return info


_DRIVER_FILES = {"cuda": "/proc/driver/nvidia/version", "npu": "/usr/local/Ascend/driver/version.info"}


def driver_version(kind: str, path: str | None = None) -> str | None:
    """The device driver's version as its install states it (NVIDIA: /proc/driver/nvidia/version,
    Ascend: the driver's version.info ``Version=``); None on cpu or when unreadable."""
    path = path or _DRIVER_FILES.get(kind)
    if not path:
        return None
    try:
        text = open(path).read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Version="):
            return line.split("=", 1)[1].strip()
        if "Kernel Module" in line:
            # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ..." or, the open module,
            # "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ..."
            found = re.search(r"\b\d+\.\d+(?:\.\d+)*\b", line.split("Kernel Module", 1)[1])
            return found.group(0) if found else None
    return None


def device_name(kind: str, devmod: Any) -> str:
    """The device's model name: the CPU model on cpu, the runtime's name on cuda/npu."""
    if kind == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        import platform

        return platform.processor() or "cpu"
    try:
        return str(devmod.get_device_name())
    except Exception:  # noqa: BLE001 - a name is nice to have, never a reason to fail
        return kind
