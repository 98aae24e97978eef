"""Which hardware profile a study ranks with, and calibrating the host when nobody measured it.

The simulator decides which configs are ever probed, and a profile of data-sheet figures ranks
wrong exactly where a real study decides (on a 2-core CPU: tensor parallelism priced as nearly
free where it halves the throughput; bf16 priced as fp32 where it runs 14x slower). So a study
with a real backend whose spec names a bundled (data-sheet) profile first measures this host:
``autotune calibrate --quick`` (15 s on an idle 2-core CPU, about a minute on a busy one;
GEMMs, memory, collectives and a tensor-parallel layer step), kept in a cache keyed by the host,
the device, the software and the calibration's shape (ranks, threads, base profile), so the
next study on the same host and software reuses it. ``cluster.calibrate: never`` (or
``AUTOTUNE_CALIBRATE=never``) keeps the profile as it is; a profile file
(``autotune calibrate --out``) is used as it is.

Trials that run on a Ray cluster (``ray.address``) are calibrated on one of its nodes, not on the
driver (which may have no device at all): a Ray task reserving a node's devices, as a trial does,
runs the same quick calibration there; the profile is cached per cluster address (its nodes are
taken to be alike). Not calibrated: a driver without torch when the trials run here.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib.util
import json
import os
import platform
import re
import signal
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, ContextManager

from ..dispatch.ray_dispatch import RayUnreachable
from ..spec.schema import Spec

__all__ = [
    "CALIBRATE_ENV",
    "PROFILE_CACHE_ENV",
    "ProfileOrigin",
    "profile_origin",
    "calibrate_setting",
    "calibration_key",
    "cached_profile_path",
    "why_not_calibrated",
    "ensure_measured_profile",
    "planned_profile",
]

CALIBRATE_ENV = "AUTOTUNE_CALIBRATE"  # cluster.calibrate where a spec leaves it out
PROFILE_CACHE_ENV = "AUTOTUNE_PROFILE_CACHE"  # directory of the measured profiles


# ----------------------------------------------------------------------------------- the profile
@dataclass(frozen=True)
class ProfileOrigin:
    """Where a spec's profile came from: a data sheet (bundled) or a measurement, and when."""

    name: str
    measured_at: _dt.datetime | None  # None: data-sheet figures

    def describe(self, now: _dt.datetime | None = None) -> str:
        if self.measured_at is None:
            return f"{self.name} (data-sheet figures, not measured on this host)"
        now = now or _dt.datetime.now().astimezone()
        return f"{self.name} (measured {self.measured_at:%Y-%m-%d %H:%M}, {_age(now - self.measured_at)} ago)"

    @property
    def measured(self) -> bool:
        return self.measured_at is not None


def _age(delta: _dt.timedelta) -> str:
    seconds = max(0, int(delta.total_seconds()))
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            n = seconds // size
            return f"{n} {unit}{'s' if unit == 'day' and n > 1 else ''}"
    return f"{seconds} s"


_WRITTEN_ON = re.compile(r"written by `autotune calibrate` on (\S+?)\.?$", re.MULTILINE)


def profile_origin(name: str) -> ProfileOrigin:
    """The origin of the profile ``name`` (a bundled name or a file's path): measured files carry
    ``calibrated_at`` (older ones their header line; else the file's modification time)."""
    from autotune.workers.hardware import is_profile_file, load_profile

    if not is_profile_file(name):
        return ProfileOrigin(name, None)
    stamp = load_profile(name).get("calibrated_at")
    if not stamp:
        text = Path(name).read_text(errors="replace")
        match = _WRITTEN_ON.search(text)
        stamp = match.group(1) if match else None
    try:
        when = _dt.datetime.fromisoformat(stamp) if stamp else None
    except ValueError:
        when = None
    if when is None:
        when = _dt.datetime.fromtimestamp(Path(name).stat().st_mtime)
    return ProfileOrigin(name, when if when.tzinfo else when.astimezone())


# ------------------------------------------------------------------------------------ the cache
def calibrate_setting(spec: Spec) -> str:
    """``auto`` or ``never``: the spec's ``cluster.calibrate``, else ``AUTOTUNE_CALIBRATE``, else auto."""
    if spec.cluster.calibrate:
        return spec.cluster.calibrate
    value = os.environ.get(CALIBRATE_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "never"):
        raise ValueError(f"{CALIBRATE_ENV}={value!r}: expected auto or never")
    return value


def _calibration_shape(spec: Spec) -> tuple[int, int | None]:
    """(ranks, threads per rank) of the calibration: the node's devices (at most 8) and the
    spec's CPU threads, as the probes will run."""
    return max(1, min(spec.cluster.devices_per_node, 8)), spec.cluster.threads_per_rank


def _on_ray_cluster(spec: Spec) -> bool:
    return bool(spec.ray.enabled and spec.ray.address)


def calibration_key(spec: Spec) -> dict[str, object]:
    """What a measured profile depends on: the host and its device (or the Ray cluster whose node
    was measured), the software that drives it, and the calibration's shape. Read without
    importing torch (package metadata)."""
    software = {}
    for package in ("torch", "torch_npu", "autotune"):
        try:
            software[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    ranks, threads = _calibration_shape(spec)
    where = (
        {"ray_cluster": spec.ray.address}
        if _on_ray_cluster(spec)
        else {"host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count()}
    )
    return {
        **where,
        "accelerator": spec.cluster.accelerator,
        "base_profile": spec.cluster.profile_name,
        "ranks": ranks,
        "threads_per_rank": threads,
        "python": platform.python_version(),
        "software": software,
    }


def _cache_dir() -> Path:
    return Path(os.environ.get(PROFILE_CACHE_ENV) or Path.home() / ".cache" / "autotune" / "profiles")


def cached_profile_path(spec: Spec) -> Path:
    key = calibration_key(spec)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", str(key.get("host") or "ray-cluster"))[:40]
    return _cache_dir() / f"{spec.cluster.accelerator}-{host}-{digest}.yaml"


def why_not_calibrated(spec: Spec, simulated: bool) -> str | None:
    """None when a study with this backend should measure the host first; else why not (said to
    the user where it matters, e.g. a remote Ray cluster)."""
    from autotune.workers.hardware import is_profile_file

    if simulated:
        return "the study runs on the simulator"
    if is_profile_file(spec.cluster.profile_name):
        return "the spec names a profile file"
    if calibrate_setting(spec) == "never":
        return "cluster.calibrate is never"
    if not _on_ray_cluster(spec) and importlib.util.find_spec("torch") is None:
        return "torch is not installed here (calibration measures with torch)"
    return None


def ensure_measured_profile(
    spec: Spec, simulated: bool, say: Callable[[str], None], phase: Callable[[str], ContextManager[Any]] | None = None
) -> Spec:
    """The spec a study runs with: its own, or (when ``why_not_calibrated`` is None) the same spec
    on this host's measured profile, calibrating first when the cache has none. A calibration
    that fails is said and the data-sheet profile kept: the probes still measure; only the
    pre-screen ranks with worse figures. ``phase`` keeps the user's status moving while the
    calibration runs (each measurement step becomes its detail)."""
    if why_not_calibrated(spec, simulated) is not None:
        return spec
    path = cached_profile_path(spec)
    if path.is_file():
        from autotune.workers.hardware import load_profile

        try:
            load_profile(str(path))
        except ValueError as exc:  # edited or damaged by hand: measure again
            say(f"the cached profile is unusable ({exc}); measuring again")
            path.unlink(missing_ok=True)
    if not path.is_file():
        from autotune.workers.calibrate import write_profile

        ranks, threads = _calibration_shape(spec)
        where = f"a node of the Ray cluster at {spec.ray.address}" if _on_ray_cluster(spec) else "this host"
        say(
            f"calibrating {where} first: {spec.cluster.profile_name} holds data-sheet figures "
            f"(quick: GEMMs per precision, memory, collectives and a tensor-parallel layer step on {ranks} "
            f"{spec.cluster.accelerator} rank(s); 15 s on an idle 2-core CPU, a minute on a busy one; "
            "cluster.calibrate: never skips it)"
        )
        started = time.perf_counter()
        try:
            with phase(f"calibrating {where}") if phase is not None else contextlib.nullcontext() as step:
                if _on_ray_cluster(spec):
                    result = _calibrate_on_ray_node(spec, ranks, threads)
                else:
                    calibrate_here = _calibration_task if spec.cluster.accelerator == "cpu" else _calibration_apart
                    result = calibrate_here(
                        spec.cluster.accelerator,
                        ranks,
                        threads,
                        spec.cluster.profile_name,
                        progress=step.update if step is not None else (lambda _: None),
                    )
            partial = write_profile(result, path.with_name(f".{path.name}.{os.getpid()}.tmp"))
            os.replace(partial, path)  # whole or absent: two studies calibrating at once never read half a file
        except RayUnreachable:  # not a calibration problem: the study cannot run either
            raise
        except Exception as exc:  # no device, a broken collective backend: rank with the data sheet
            say(
                f"calibration failed ({type(exc).__name__}: {exc}); ranking with {spec.cluster.profile_name}'s "
                "data-sheet figures"
            )
            return spec
        same = "cluster" if _on_ray_cluster(spec) else "host"
        say(
            f"measured in {time.perf_counter() - started:.0f} s; cached at {path} for later studies on this {same} "
            "and software"
        )
    else:
        say(
            f"profile: {profile_origin(str(path)).describe()}, this {'cluster' if _on_ray_cluster(spec) else 'host'}'s "
            "cached calibration"
        )
    return _with_profile(spec, path)


def _with_profile(spec: Spec, path: Path) -> Spec:
    return spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"profile": str(path)})})


def _calibration_task(
    accelerator: str, ranks: int, threads: int | None, base: str, progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """The quick calibration, here or as a Ray task on a node (imports torch where it runs)."""
    from autotune.workers.calibrate import calibrate

    return calibrate(accelerator, quick=True, ranks=ranks, threads=threads, base=base, progress=progress)


def _calibration_apart(
    accelerator: str,
    ranks: int,
    threads: int | None,
    base: str,
    progress: Callable[[str], None] = lambda _: None,
    task: Callable[..., dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The quick calibration in a child process of its own, which ends with it: on a device the
    calibration's runtime context and cached blocks go with it. Run in the study's own process, they
    stayed for the whole study (an H200 study's probes each found 2.42 GiB of the device held by
    the driver, 2026-11-28). Its progress comes back through a queue."""
    import concurrent.futures
    import multiprocessing
    import queue as _queue

    context = multiprocessing.get_context("spawn")  # a fork would inherit the parent's state
    with context.Manager() as manager:
        messages = manager.Queue()
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
            future = pool.submit(task or _calibration_task, accelerator, ranks, threads, base, messages.put)
            while True:
                try:
                    progress(messages.get(timeout=0.2))
                except _queue.Empty:
                    if future.done():
                        break
            return future.result()


def _calibrate_on_ray_node(spec: Spec, ranks: int, threads: int | None, timeout_s: float = 900.0) -> dict[str, Any]:
    """The quick calibration as a Ray task that reserves one node's devices, as a trial does
    (``backends.node_bundle``), so it runs where the probes will. Connects for the task alone;
    the study's dispatcher connects again as usual."""
    import ray

    from ..dispatch.backends import node_bundle

    bundle = node_bundle(spec.cluster.accelerator, spec.cluster.devices_per_node)
    options: dict[str, Any] = {"num_cpus": bundle.pop("CPU", 1.0), "max_retries": 0}
    if "GPU" in bundle:
        options["num_gpus"] = bundle.pop("GPU")
    if bundle:
        options["resources"] = bundle
    owns = not ray.is_initialized()
    if owns:
        from ..dispatch.ray_dispatch import check_ray_address

        check_ray_address(spec.ray.address)  # Ray's own connect has no overall timeout
        handler = signal.getsignal(signal.SIGTERM)
        ray.init(address=spec.ray.address, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
        signal.signal(signal.SIGTERM, handler)  # the CLI's (save the study, exit 143), not Ray's
    try:
        need = {"CPU": options["num_cpus"], "GPU": options.get("num_gpus", 0.0), **options.get("resources", {})}
        nodes = [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")]
        if not any(all(node.get(k, 0.0) >= v for k, v in need.items() if v) for node in nodes):
            raise RuntimeError(
                f"no node of the Ray cluster has {', '.join(f'{v:g} {k}' for k, v in need.items() if v)}"
            )
        task = ray.remote(**options)(_calibration_task)
        ref = task.remote(spec.cluster.accelerator, ranks, threads, spec.cluster.profile_name)
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            raise RuntimeError(
                f"no node of the cluster ran the calibration within {timeout_s:.0f} s (it needs {options})"
            ) from None
    finally:
        if owns:
            ray.shutdown()


def planned_profile(spec: Spec, simulated: bool) -> tuple[Spec, dict[str, object]]:
    """What ``autotune plan`` ranks with and says: the spec on this host's cached calibration when
    a run would use it, and a description (``profile``, ``measured_at``, ``calibrates_first``,
    ``line``) of the profile and its age, or of the calibration a run will do first."""
    why = why_not_calibrated(spec, simulated)
    cached = cached_profile_path(spec) if why is None else None
    if cached is not None and cached.is_file():
        spec = _with_profile(spec, cached)
    origin = profile_origin(spec.cluster.profile_name)
    line = f"profile: {origin.describe()}"
    first = why is None and not origin.measured
    if first:
        line += "; `autotune run` measures this host first (about 20 s) and ranks with that"
    elif why is None:
        line += ", this host's cached calibration"
    return spec, {
        "profile": origin.name,
        "measured_at": origin.measured_at.isoformat() if origin.measured_at else None,
        "calibrates_first": first,
        "line": line,
    }
