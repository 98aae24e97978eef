"""The ``autotune`` command line.

Like ``ray job`` and ``optuna``: logs and progress go to stderr, data to stdout, ``--json`` gives
scripts a stable object, and the exit codes are documented:

(Why one module of over 500 lines: the commands share their options, exit codes and output
helpers; each command only parses, calls the stage that does the work (:mod:`autotune.finish`,
:mod:`autotune.search`, :mod:`autotune.doctor`, ...) and prints what it returns.)


====  ==========================================================================
0     success
1     the study ran but no trial succeeded (see the report for the reasons)
2     bad input: the spec (or an edit of it that changes the study kept in the run directory),
      an option, or a run directory that holds no study
3     infrastructure failure: Ray (a cluster that cannot place any trial, a node lost mid-study:
      the results so far are written and the same command resumes), MLflow or the Optuna storage
130   interrupted (Ctrl-C); the study resumes with the same command
====  ==========================================================================
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from .secret_env import SPEC_COPY
from .spec import Spec
from .spec_errors import SpecError, escape_text
from .spec_load import load_spec

__all__ = ["app", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Declarative auto-tuner for large-model training and inference configurations.",
)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # paths and commands stay copyable
out = Console(highlight=False, soft_wrap=True)
log = logging.getLogger("autotune")

EXIT_OK, EXIT_NO_RESULT, EXIT_INPUT, EXIT_INFRA, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 130, 143
EXIT_INTERNAL = 70  # sysexits EX_SOFTWARE: a bug in autotune, never "no trial succeeded" (1)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, ``kill``): handled like Ctrl-C, then exit 143."""


_SIGTERM_RECEIVED = False  # the exception may reach us re-raised as a plain KeyboardInterrupt


def _on_sigterm(signum: int, frame: Any) -> None:
    global _SIGTERM_RECEIVED
    _SIGTERM_RECEIVED = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


def _install_sigterm() -> None:
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (the CLI called from a thread): leave it as it is
        pass


def _was_terminated(exc: KeyboardInterrupt) -> bool:
    """SIGTERM, not Ctrl-C. A ``Terminated`` raised inside Ray's C++ wait can come back as a new,
    plain ``KeyboardInterrupt`` (seen: exit 130 instead of 143, now and then): the flag decides."""
    return isinstance(exc, Terminated) or _SIGTERM_RECEIVED


def _interrupted_exit(exc: KeyboardInterrupt) -> int:
    return EXIT_TERMINATED if _was_terminated(exc) else EXIT_INTERRUPTED


SpecArg = typer.Argument(..., help="tuning spec (YAML)", show_default=False)
RunOrSpecArg = typer.Argument(..., help="run directory, or the tuning spec (YAML)", show_default=False)
RunDirOpt = typer.Option(None, "--run-dir", help="study directory (default ./autotune_runs/<spec name>)")
JsonOpt = typer.Option(False, "--json", help="print one JSON object on stdout")


def _error(text: str) -> None:
    """An error line. The text is never read as rich markup: it quotes specs, probes and paths,
    which are full of brackets (``[rank0]:``, ``[tp for x in ...]``, ``[/bold]``)."""
    err.print(Text.assemble(("error", "red"), " ", text))


def _warn(text: str) -> None:
    err.print(Text(text, style="yellow"))


def _setup_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    level = logging.INFO if verbose else logging.WARNING
    handler = RichHandler(console=err, show_path=False, show_time=False)
    logging.basicConfig(level=level, handlers=[handler], format="%(message)s", force=True)
    logging.getLogger("autotune").setLevel(logging.INFO if verbose else logging.WARNING)
    for noisy in ("alembic", "mlflow", "optuna", "ray", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING if verbose else logging.ERROR)
    # both configure their own loggers on import, which would undo the levels set above
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.INFO if verbose else optuna.logging.WARNING)
    # Optuna prints through its own handler ("[W 2026-11-24 ...] ..."): route it through ours
    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()


def _load(spec_path: Path) -> Spec:
    try:
        return load_spec(spec_path)
    except SpecError as exc:
        for problem in exc.problems:
            _error(problem.render(exc.file))
        raise typer.Exit(EXIT_INPUT) from None


def _run_dir(spec: Spec, run_dir: Optional[Path]) -> Path:
    return (run_dir or Path("autotune_runs") / spec.name).resolve()


_SPEC_LOCATION = "autotune_spec.path"  # where the spec a run directory keeps (SPEC_COPY) came from


def _remember_spec(spec_path: Path, directory: Path) -> None:
    """Keep the spec with its study, so ``report``/``export`` can be given the run directory
    (its secrets masked: :mod:`autotune.secret_env`)."""
    from .secret_env import write_spec_copy

    try:
        write_spec_copy(spec_path, directory)
        (directory / _SPEC_LOCATION).write_text(str(Path(spec_path).resolve()) + "\n")
    except OSError as exc:
        _warn(f"could not keep a copy of the spec in {directory}: {exc}")


def _load_run_or_spec(path: Path, run_dir: Optional[Path]) -> tuple[Spec, Optional[Path]]:
    """A spec file, or a run directory written by ``autotune run`` (its spec is used: the
    original file when it is still there, so relative paths in it resolve, else the copy)."""
    if not path.is_dir():
        return _load(path), run_dir
    original = path / _SPEC_LOCATION
    candidates = []
    if original.exists():
        candidates.append(Path(original.read_text().strip()))
    candidates.append(path / SPEC_COPY)
    for candidate in candidates:
        if candidate.is_file():
            return _load(candidate), run_dir or path
    _error(f"{path}: a directory, but not a run directory of `autotune run` (no {SPEC_COPY})")
    raise typer.Exit(EXIT_INPUT)


def _with_overrides(spec: Spec, **changes: Any) -> Spec:
    search = spec.search.model_copy(update={k: v for k, v in changes.items() if v is not None})
    from .spec import SearchSpec

    try:
        search = SearchSpec.model_validate(search.model_dump())
    except Exception as exc:
        _error(f"option: {exc}")
        raise typer.Exit(EXIT_INPUT) from None
    return spec.model_copy(update={"search": search})


# --------------------------------------------------------------------------------------- doctor
@app.command()
def doctor(
    spec_path: Optional[Path] = typer.Argument(
        None, help="a spec: can its largest trial be placed?", show_default=False
    ),
    ray_address: Optional[str] = typer.Option(
        None,
        "--ray-address",
        help="the Ray cluster ('auto', host:6379); default: the spec's ray.address, else a local Ray on this machine",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """The Ray cluster node by node: accelerators, free resources, software (torch, torch_npu,
    CANN, MindSpore, ...), and whether the spec's largest trial can be placed (exit 1 if not)."""
    _setup_logging(False)
    spec = _load(spec_path) if spec_path else None
    address = ray_address or (spec.ray.address if spec else None)
    from .doctor import cluster_report, placement_verdict
    from .ray_dispatch import RayDispatcher

    try:
        dispatcher = RayDispatcher(address=address, num_cpus=spec.ray.num_cpus if spec and not address else None)
    except ConnectionError as exc:  # dispatch.RayUnreachable: its message names the address
        _error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None
    except Exception as exc:
        _error(f"cannot reach the Ray cluster{f' at {address}' if address else ''}: {type(exc).__name__}: {exc}")
        raise typer.Exit(EXIT_INFRA) from None
    try:
        nodes = cluster_report(dispatcher._ray)
    finally:
        dispatcher.shutdown()
    verdict = None
    if spec is not None:
        c = spec.cluster
        verdict = placement_verdict(nodes, c.accelerator, c.nodes, c.devices_per_node)
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "address": address or "local",
                    "nodes": nodes,
                    "placement": {"ok": verdict[0], "why": verdict[1]} if verdict else None,
                }
            )
        )
    else:
        out.print(f"[bold]Ray cluster[/bold] {escape(address or 'local (this machine)')}: {len(nodes)} node(s)")
        for n in nodes:
            devices = ", ".join(
                f"{k} {n['free'].get(k, v):g}/{v:g} free" for k, v in n["total"].items() if k in ("CPU", "GPU", "NPU")
            )
            soft = n.get("software") or {}
            software = ", ".join(f"{k} {v}" for k, v in soft.items()) if soft else n.get("error", "none found")
            out.print(
                f"  {n['label']} ({n.get('host', 'host not reported')}, python {n.get('python', '?')}): {devices}",
                markup=False,
            )
            out.print(f"      software: {software}", markup=False)
            if n.get("visible_devices"):
                out.print(f"      visible: {n['visible_devices']}", markup=False)
        if verdict:
            out.print(("ok  " if verdict[0] else "not placeable  ") + verdict[1], markup=False)
    if verdict and not verdict[0]:
        raise typer.Exit(EXIT_NO_RESULT)


# ------------------------------------------------------------------------------------- validate
@app.command()
def validate(spec_path: Path = SpecArg, as_json: bool = JsonOpt) -> None:
    """Check a spec; print "ok" and a one-line summary, or the errors (exit 2)."""
    try:
        spec = load_spec(spec_path)
    except SpecError as exc:
        if as_json:
            out.print_json(json.dumps({"ok": False, "errors": [p.render(exc.file) for p in exc.problems]}))
        else:
            for problem in exc.problems:
                _error(problem.render(exc.file))
        raise typer.Exit(EXIT_INPUT) from None
    empty = _why_empty(spec)
    if empty:
        if as_json:
            out.print_json(
                json.dumps({"ok": False, "errors": [f"{escape_text(str(spec_path))}: constraints: {empty}"]})
            )
        else:
            _error(f"{escape_text(str(spec_path))}: constraints: {empty}")
        raise typer.Exit(EXIT_INPUT)
    if as_json:
        out.print_json(json.dumps({"ok": True, "summary": spec.summary()}))
    else:
        out.print(f"ok  {spec.summary()}", markup=False)


def _why_empty(spec: Spec) -> Optional[str]:
    """Why the spec's space holds no valid config (None when it holds one, or is too large to
    enumerate: then the sampler explores it and says what it rejected)."""
    from .space import Space

    try:
        return Space(spec).enumerate(limit=spec.search.exhaustive_limit).why_empty()
    except ValueError:
        return None


def _refuse_empty(spec: Spec, spec_path: Path) -> None:
    empty = _why_empty(spec)
    if empty:
        _error(f"{escape_text(str(spec_path))}: constraints: {empty}")
        raise typer.Exit(EXIT_INPUT)


# ----------------------------------------------------------------------------------------- plan
@app.command()
def plan(
    spec_path: Path = SpecArg,
    top: int = typer.Option(10, help="configs to show"),
    as_json: bool = JsonOpt,
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """Space size, valid configs, configs the memory model says fit, and the predicted top N."""
    _setup_logging(verbose)
    spec = _load(spec_path)
    from .context import probe_context
    from .ranking import UNDISTINGUISHED, rank_space
    from .space import Space

    spec, profile = _planned_profile(spec)
    space = Space(spec)
    objectives = spec.objective_list()
    try:
        enumeration = space.enumerate(limit=spec.search.exhaustive_limit)
    except ValueError as exc:
        _error(f"{exc}; narrow the space or raise search.exhaustive_limit")
        raise typer.Exit(EXIT_INPUT) from None
    if enumeration.why_empty():
        _error(f"{escape_text(str(spec_path))}: constraints: {enumeration.why_empty()}")
        raise typer.Exit(EXIT_INPUT)
    ranking = rank_space(enumeration, probe_context(spec), objectives)
    # the top distinct layouts: configs the model prices the same are one row, their knobs named
    layouts = ranking.distinct_layouts(top)
    best = [(ranking.enumeration.configs[lay.index], ranking.metrics_of(lay.index)) for lay in layouts]
    if as_json:
        payload = {
            "space_size": enumeration.space_size,
            "valid": enumeration.valid,
            "fit": ranking.fit,
            "invalid_reasons": enumeration.invalid_reasons,
            "objectives": [{"metric": m, "direction": d} for m, d in objectives],
            "profile": {k: v for k, v in profile.items() if k != "line"},
            "top": [
                {"params": c, "metrics": _public_metrics(m), "undistinguished": lay.undistinguished}
                for (c, m), lay in zip(best, layouts)
            ],
        }
        out.print_json(json.dumps(payload, default=_json_default))
        return
    out.print(spec.summary())
    out.print(profile["line"], markup=False)
    out.print(
        f"space: {enumeration.space_size:,} combinations, {enumeration.valid:,} valid canonical configs, "
        f"{ranking.fit:,} predicted to fit in {ranking.predictions.get('memory_limit_gib', [0])[0]:.1f} GiB per device"
        if len(ranking.order)
        else f"space: {enumeration.space_size:,} combinations, no valid config"
    )
    for reason, count in sorted(enumeration.invalid_reasons.items(), key=lambda kv: -kv[1]):
        out.print(Text(f"  {count:,} rejected: {reason}", style="dim"))
    if not best:
        _warn("no config is predicted to fit; see the memory breakdown with -v")
        raise typer.Exit(EXIT_NO_RESULT)
    _print_top_table(best, objectives, title=f"predicted top {len(best)} distinct layouts (simulated, not measured)")
    knobs = {lay.undistinguished_text() for lay in layouts if lay.undistinguished}
    for text in sorted(knobs):
        rows = [str(i) for i, lay in enumerate(layouts, start=1) if lay.undistinguished_text() == text]
        out.print(f"  rows {','.join(rows)}: {UNDISTINGUISHED}{text}", markup=False)
    _print_breakdown(best[0][1])


def _public_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}


def _json_default(o: Any) -> Any:
    from .finish import json_default

    return json_default(o)


def _short(config: dict[str, Any]) -> str:
    keys = [
        "tp",
        "pp",
        "vpp",
        "cp",
        "dp",
        "micro_batch_size",
        "grad_accum",
        "sequence_parallel",
        "recompute",
        "recompute_layers",
        "zero_stage",
        "precision",
        "batch_size",
    ]
    short = {
        "micro_batch_size": "mbs",
        "grad_accum": "ga",
        "sequence_parallel": "sp",
        "zero_stage": "zero",
        "recompute_layers": "rl",
        "precision": "",
        "batch_size": "bs",
    }
    parts = []
    for k in keys:
        if k not in config:
            continue
        v = config[k]
        label = short.get(k, k)
        if isinstance(v, bool):
            if v:
                parts.append(label)
        elif k == "recompute":
            if v != "none":
                parts.append(f"rc={v}")
        else:
            parts.append(f"{label}{'=' if label else ''}{v}")
    # every other searched setting (kv_cache_dtype, quantization, compile, graph_kernel_flags, ...)
    # by its canonical name, so that two configs never print the same
    parts += [f"{k}={v}" for k, v in config.items() if k not in keys and not k.startswith("env.")]
    env = [f"{k[4:]}={v}" for k, v in config.items() if k.startswith("env.")]
    return " ".join(parts) + (("  " + " ".join(env)) if env else "")


def _print_top_table(rows: list[tuple[dict, dict]], objectives: list[tuple[str, str]], title: str) -> None:
    """One line per config, metrics first and the config last and whole: a config is only useful
    to a reader if it can be copied, so it is never truncated or wrapped into a cell."""
    names = [m for m, _ in objectives]
    training = any("tokens_per_s" in k or k == "step_time_s" for k in rows[0][1]) if rows else True
    extra = (
        ("step_time_s", "mfu", "peak_memory_gib") if training else ("ttft_ms", "decode_tokens_per_s", "peak_memory_gib")
    )
    names += [m for m in extra if m not in names and any(m in metrics for _, metrics in rows)]
    widths = [max(len(m), 9) for m in names]
    out.print(f"[bold]{title}[/bold]")
    out.print("  #  " + "  ".join(m.rjust(w) for m, w in zip(names, widths)) + "  config")
    for i, (config, metrics) in enumerate(rows, start=1):
        cells = [_fmt_metric(metrics.get(m)).rjust(w) for m, w in zip(names, widths)]
        out.print(f"{i:>3}  " + "  ".join(cells) + "  " + _short(config), markup=False)


def _print_preview(records: list[Any], objectives: list[tuple[str, str]], recommendation: Any, top: int = 10) -> None:
    """The simulated study as the model's ranking of distinct layouts: each trial a layout the
    model can tell apart, with the knobs it cannot (values the probes would try) on a line of
    their own, the memory each leaves free, and the front of the first objective against that
    headroom (``*``: no other layout is both faster and roomier)."""
    from .ranking import UNDISTINGUISHED, pareto_order

    metric, direction = objectives[0]
    ok = [r for r in records if r.status == "ok" and r.probed and isinstance(r.metrics.get(metric), (int, float))]
    sign = 1.0 if direction == "maximize" else -1.0
    ok.sort(key=lambda r: -sign * r.metrics[metric])
    capacity = None
    if recommendation is not None and recommendation.best_headroom_gib is not None:
        capacity = recommendation.best_headroom_gib + recommendation.best.metrics["peak_memory_gib"]
    room = [
        capacity - r.metrics["peak_memory_gib"]
        if capacity is not None and isinstance(r.metrics.get("peak_memory_gib"), (int, float))
        else 0.0
        for r in ok
    ]
    import numpy as np

    front = pareto_order(np.array([[sign * r.metrics[metric], h] for r, h in zip(ok, room)])) == 0 if ok else []
    out.print(
        f"[bold]top {min(top, len(ok))} of {len(ok)} distinct layouts (simulated, not measured)[/bold]; "
        "* on the front of speed against memory headroom"
    )
    out.print(f"  trial  {metric:>24}  peak GiB  free GiB  config")
    shown = list(zip(ok, room, front))[:top]
    knobs = [
        r.chosen_because.split(UNDISTINGUISHED, 1)[1] if UNDISTINGUISHED in r.chosen_because else ""
        for r, _, _ in shown
    ]
    # the knobs most layouts leave to the probes, said once (rows marked ~), other sets per row
    named = [k for k in knobs if k]
    shared = max(set(named), key=named.count) if named else ""
    for (r, h, on_front), left in zip(shown, knobs):
        mark = "*" if on_front else " "
        out.print(
            f"{mark} {r.number:>5}  {_fmt_metric(r.metrics[metric]):>24}  {r.metrics.get('peak_memory_gib', 0):8.1f}"
            f"  {h:8.1f}  {_short({k: v for k, v in r.config.items() if not k.startswith('env.')})}"
            + ("  ~" if left and left == shared else ""),
            markup=False,
        )
        if left and left != shared:
            out.print(f"{'':9}{UNDISTINGUISHED}{left}", markup=False)
    if shared:
        out.print(f"  ~ {UNDISTINGUISHED}{shared}", markup=False)


def _print_breakdown(metrics: dict[str, Any]) -> None:
    mem = {k[4:]: v for k, v in metrics.items() if k.startswith("mem_")}
    tim = {k[5:]: v for k, v in metrics.items() if k.startswith("time_")}
    if mem:
        total = metrics.get("peak_memory_gib")
        out.print(
            "memory per device of the top config (GiB, predicted): "
            + ", ".join(f"{k} {v:.2f}" for k, v in mem.items() if v)
            + (f" = {total:.2f}" if total else "")
        )
    if tim:
        out.print(
            "step time of the top config (s, predicted): " + ", ".join(f"{k} {v:.3f}" for k, v in tim.items() if v)
        )


# ------------------------------------------------------------------------------------ calibrate
@app.command()
def calibrate(
    out_path: Path = typer.Option(..., "--out", help="profile file to write (YAML)"),
    accelerator: str = typer.Option("cpu", help="cpu | cuda | npu: the device to measure, on this host"),
    ranks: int = typer.Option(2, help="processes for the collective measurement (1: skip it)"),
    threads: Optional[int] = typer.Option(None, help="CPU: threads per device (default cores / ranks)"),
    quick: bool = typer.Option(False, "--quick", help="small sizes, few repeats (seconds, rough figures)"),
    as_json: bool = JsonOpt,
) -> None:
    """Measure this host's device (linear layers per precision at the shapes models run, memory
    bandwidth, collectives' latency and bandwidth) and write a hardware profile; use it with
    `cluster.profile: <file>` in a spec."""
    _setup_logging(False)
    if accelerator not in ("cpu", "cuda", "npu"):
        _error(f"--accelerator: expected cpu, cuda or npu, got {accelerator!r}")
        raise typer.Exit(EXIT_INPUT)
    if ranks < 1:
        _error(f"--ranks: expected >= 1, got {ranks}")
        raise typer.Exit(EXIT_INPUT)
    try:
        from autotune.workers.calibrate import calibrate as measure, write_profile
    except ImportError as exc:
        _error(f"calibrate needs torch ({exc}); pip install torch==2.13.0")
        raise typer.Exit(EXIT_INPUT) from None
    from autotune.workers.torch_probe.failures import ProbeFailure

    try:
        result = measure(
            accelerator,
            quick=quick,
            ranks=ranks,
            threads=threads,
            progress=lambda text: err.print(f"measuring {text}", markup=False),
        )
    except (ImportError, RuntimeError, ValueError, ProbeFailure) as exc:  # no device, no torch_npu, a degenerate fit
        _error(f"cannot measure {accelerator}: {exc}")
        raise typer.Exit(EXIT_INFRA) from None
    path = write_profile(result, out_path)
    profile = result["profile"]
    if as_json:
        out.print_json(
            json.dumps({"path": str(path), "profile": profile, "measured": result["measured"]}, default=_json_default)
        )
        return
    peaks = ", ".join(f"{k} {v:.4g}" for k, v in profile["peak_tflops"].items() if k != "int8")
    out.print(
        f"wrote {escape(str(path))}: peak TFLOPS {peaks}; memory {profile['memory_bandwidth_gbps']:.1f} GB/s; "
        f"collectives {profile['intra_node_bandwidth_gbps']:.3g} GB/s, "
        f"{profile['collective_latency_us']:.0f} us latency"
    )
    err.print(f"\n[bold]next steps[/bold]\n  use it in a spec:  cluster: {{profile: {escape(str(path))}}}")


# ------------------------------------------------------------------------------------------ run
@app.command()
def run(
    spec_path: Path = SpecArg,
    backend: Optional[str] = typer.Option(
        None,
        help="auto | simulate | command | torch | mindspore | megatron | "
        "mindspeed | torchtitan | deepspeed (overrides the spec)",
    ),
    n_trials: Optional[int] = typer.Option(None, "--n-trials", help="probe budget"),
    parallel: Optional[int] = typer.Option(None, "--parallel", help="trials at once"),
    seed: Optional[int] = typer.Option(None, help="sampler seed"),
    run_dir: Optional[Path] = RunDirOpt,
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", help="connect to a Ray cluster ('auto', ray://...)"
    ),
    no_tracking: bool = typer.Option(False, "--no-tracking", help="do not write MLflow runs"),
    reuse_cache: bool = typer.Option(
        False,
        "--reuse-cache",
        help="answer configs measured before (any study, "
        "same model, workload, cluster, backend and software) from the result cache",
    ),
    fresh_study: bool = typer.Option(
        False,
        "--fresh-study",
        help="the spec changed what defines the study kept "
        "in the run directory: set that study aside (kept, renamed) and start anew",
    ),
    as_json: bool = JsonOpt,
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """Run (or resume) the study: propose, probe, record; then print the best config.

    Running it again resumes the study (a larger --n-trials continues it); a spec whose model,
    workload, cluster, space, constraints, objectives, target or backend changed is refused
    (exit 2) unless --fresh-study or a new --run-dir says what to do with the old study."""
    _setup_logging(verbose)
    spec = _load(spec_path)
    spec = _with_overrides(spec, n_trials=n_trials, parallel_trials=parallel, seed=seed)
    if ray_address:
        spec = spec.model_copy(update={"ray": spec.ray.model_copy(update={"address": ray_address})})
    _refuse_empty(spec, spec_path)
    from .backends import select_backend

    try:
        choice = select_backend(spec, backend)
    except ValueError as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_INPUT) from None
    err.print(Text.assemble((f"backend: {choice.kind}", "bold"), f" — {choice.reason}"))
    directory = _run_dir(spec, run_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _error(f"cannot create the run directory {directory} ({exc.strerror or exc}); pass a writable --run-dir")
        raise typer.Exit(EXIT_INPUT) from None
    from .run_lock import RunDirLock, StudyInUse

    lock = RunDirLock(directory)
    try:
        lock.acquire()
    except StudyInUse as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None
    except OSError as exc:
        _error(f"cannot lock the run directory {directory} ({exc.strerror or exc}); pass a writable --run-dir")
        raise typer.Exit(EXIT_INPUT) from None
    try:
        _run_locked(
            spec,
            spec_path,
            directory,
            choice,
            fresh_study=fresh_study,
            no_tracking=no_tracking,
            reuse_cache=reuse_cache,
            as_json=as_json,
        )
    finally:
        lock.release()


def _run_locked(
    spec: Spec,
    spec_path: Path,
    directory: Path,
    choice: Any,
    *,
    fresh_study: bool,
    no_tracking: bool,
    reuse_cache: bool,
    as_json: bool,
) -> None:
    """The study itself, with the run directory locked by this driver (:mod:`.run_lock`)."""
    from .study_definition import definition

    defined_as = definition(spec, choice.kind)
    _check_definition(spec, spec_path, directory, defined_as, fresh_study)
    lease = _lease_shared_study(spec, directory)
    try:
        _run_study(
            spec,
            spec_path,
            directory,
            choice,
            defined_as,
            no_tracking=no_tracking,
            reuse_cache=reuse_cache,
            as_json=as_json,
        )
    finally:
        if lease is not None:
            lease.release()


def _lease_shared_study(spec: Spec, directory: Path) -> Any:
    """Take the lease of a study in a shared database (:func:`.run_lock.lease_shared_study`): exit 3
    while another driver holds it."""
    from .run_lock import StudyInUse, lease_shared_study
    from .storage import StorageDamaged

    try:
        return lease_shared_study(spec, directory)
    except (StudyInUse, StorageDamaged) as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None


def _run_study(
    spec: Spec,
    spec_path: Path,
    directory: Path,
    choice: Any,
    defined_as: dict[str, Any],
    *,
    no_tracking: bool,
    reuse_cache: bool,
    as_json: bool,
) -> None:
    """Probe, record and finish the study (its run directory locked, its lease held)."""
    _remember_spec(spec_path, directory)
    spec = _measured_profile(spec, choice)

    from .progress import ProgressObserver
    from .search import StudyRunner, Unplaceable

    from .assembly import dispatcher_for, launcher_for

    try:
        dispatcher = dispatcher_for(spec, choice, directory)
    except ConnectionError as exc:  # dispatch.RayUnreachable: its message names the address
        _error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None
    except Exception as exc:  # Ray would not start: say what failed, keep the traceback for -v
        log.debug("dispatcher failed", exc_info=True)
        _error(f"cannot start the trials' dispatcher: {type(exc).__name__}: {exc}")
        raise typer.Exit(EXIT_INFRA) from None
    tracker = None
    if not no_tracking:
        err.print(Text("opening the MLflow store", style="dim"))
        tracker = _tracker(spec, directory)
    observer = ProgressObserver(err, spec.objective_list(), quiet=as_json)
    cache = None
    if not choice.simulated:
        from .cache import ResultCache

        try:
            cache = ResultCache()
        except Exception as exc:  # an unwritable home: run without the cache, and say so
            _warn(f"result cache unavailable ({exc}); set AUTOTUNE_CACHE to a writable file")
    from .storage import StorageDamaged

    runner = StudyRunner(
        spec,
        directory,
        choice,
        dispatcher=dispatcher,
        launcher=launcher_for(spec, choice),
        tracker=tracker,
        observer=observer,
        cache=cache,
        reuse_cache=reuse_cache,
        stop_requested=lambda: _SIGTERM_RECEIVED,
        definition=defined_as,
    )
    status = "FAILED"
    try:
        with observer:
            outcome = runner.run()
        status = "FINISHED"
    except KeyboardInterrupt as exc:
        what = "terminated (SIGTERM)" if _was_terminated(exc) else "interrupted"
        _warn(f"{what}: the study is saved; run the same command to resume")
        status = "KILLED"
        raise typer.Exit(_interrupted_exit(exc)) from None
    except (StorageDamaged, Unplaceable) as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None
    except ValueError as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_INPUT) from None
    except Exception as exc:  # Ray / MLflow / storage: say what failed, keep the traceback for -v
        log.debug("study failed", exc_info=True)
        _error(f"the study stopped: {type(exc).__name__}: {exc}")
        raise typer.Exit(EXIT_INFRA) from None
    finally:
        runner.close()
        if status != "FINISHED":
            _close_tracking(runner, "KILLED" if status == "KILLED" else "FAILED")
    _finish_run(spec, directory, choice, outcome, runner, as_json)


def _check_definition(spec: Spec, spec_path: Path, directory: Path, defined_as: dict[str, Any], fresh: bool) -> None:
    """Refuse (exit 2) to resume a study whose defining sections the spec has changed, naming the
    fields; with ``fresh``, say that the old study was set aside (:mod:`.study_definition`)."""
    from .storage import StorageDamaged
    from .study_definition import StudyRedefined, redefinition

    try:
        aside = redefinition(spec, directory, defined_as, fresh)
    except StorageDamaged as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None
    except StudyRedefined as exc:
        _error(
            f"{escape_text(str(spec_path))}: the spec changed what defines the study {spec.name!r} kept in {directory} "
            f"({exc.trials} trial(s) measured under the old definition):"
        )
        for line in exc.changes:
            err.print(f"  {line}", markup=False)
        err.print(
            "resuming would mix trials of two different studies. Either start it in a new directory "
            "(--run-dir NEW_DIR), or start a fresh study in this one with --fresh-study (the old study is "
            "kept in the same storage under another name, its trial folders under superseded-*/; nothing "
            "is deleted); or undo the edit to resume the old study.",
            markup=False,
        )
        raise typer.Exit(EXIT_INPUT) from None
    if aside is not None:
        name, changes = aside
        err.print(
            Text(
                f"--fresh-study: the earlier study ({len(changes)} change(s): {'; '.join(changes[:3])}) is kept as "
                f"{name!r} in the same storage; starting a new study {spec.name!r}",
                style="dim",
            )
        )


def _measured_profile(spec: Spec, choice: Any) -> Spec:
    """The spec on this host's measured profile when a real study would otherwise rank with
    data-sheet figures (``host_profile``: calibrates once, cached per host and software)."""
    from .host_profile import ensure_measured_profile

    try:
        return ensure_measured_profile(spec, choice.simulated, lambda text: err.print(Text(text, style="dim")))
    except ConnectionError as exc:  # the Ray cluster does not answer (dispatch.RayUnreachable)
        _error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None
    except ValueError as exc:  # AUTOTUNE_CALIBRATE set to something else than auto / never
        _error(str(exc))
        raise typer.Exit(EXIT_INPUT) from None


def _planned_profile(spec: Spec) -> tuple[Spec, dict[str, Any]]:
    from .backends import select_backend
    from .host_profile import planned_profile

    try:
        simulated = select_backend(spec).simulated
    except ValueError:  # a backend the run would refuse: plan still ranks, with the spec's profile
        simulated = True
    try:
        return planned_profile(spec, simulated)
    except ValueError as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_INPUT) from None


def _relocate_mlflow(directory: Path) -> None:
    """A moved run directory's own MLflow store, pointed at its new place (and said)."""
    from .tracking import relocate_artifacts

    try:
        moved = relocate_artifacts(directory)
    except Exception as exc:  # a store in use, or not MLflow's: browsing may miss artifacts, nothing else
        log.debug("MLflow artifact paths not checked: %s", exc)
        return
    if moved:
        err.print(Text(moved, style="dim"))


def _tracker(spec: Spec, directory: Path) -> Any:
    from .tracking import Tracker, default_tracking_uri, error_line

    uri = spec.tracking.mlflow_uri or default_tracking_uri(directory)
    if not spec.tracking.mlflow_uri:
        _relocate_mlflow(directory)  # a resumed study whose run directory was moved
    if uri.startswith(("http://", "https://")):
        err.print(f"connecting to MLflow at {uri} ...", markup=False)
    try:
        return Tracker(uri, spec.tracking.experiment or spec.name, directory / "mlartifacts")
    except Exception as exc:
        _error(
            f"cannot open the MLflow store {uri} (tracking.mlflow_uri): {error_line(exc, 300)}. Start the server or "
            "fix the URI; or run with --no-tracking and run the same command again once it answers: the trials "
            "measured meanwhile are logged then, and nothing is probed twice"
        )
        raise typer.Exit(EXIT_INFRA) from None


def _close_tracking(runner: Any, status: str) -> None:
    """Close the MLflow parent run and say what the user must know (writes MLflow refused)."""
    if runner.tracking is not None:
        for warning in runner.tracking.close(status):
            _warn(warning)


def _finish_run(spec: Spec, directory: Path, choice: Any, outcome: Any, runner: Any, as_json: bool) -> None:
    from autotune.workers.protocol import FAILURE_STATUSES

    from .exports import default_formats
    from .finish import finish_study
    from .records import is_tracked
    from .report import best_payload, status_counts, status_line
    from .tracking import mlflow_ui_command

    objectives = spec.objective_list()
    tracking = runner.tracking
    err.print(
        Text(
            "writing the results, plots, exports" + (" and the MLflow parent run" if tracking else "")
            if tracking
            else "writing the results, plots and exports",
            style="dim",
        )
    )
    finished = finish_study(
        spec,
        directory,
        outcome.study,
        outcome.result,
        probes_run=outcome.probes_run,
        stopped_because=outcome.stopped_because,
        tracking=tracking,
    )
    for name, reasons in finished.target_refusals.items():  # a study resumed from before its target
        _warn(f"not exported as {name}: {', '.join(reasons)}")
    if tracking:
        _close_tracking(runner, "FINISHED")
    result, exports, line = outcome.result, finished.exports, finished.improvement
    best = result.best[0] if result.best else None
    recommendation, chosen = result.recommendation, result.chosen
    failed = sum(1 for r in result.records if is_tracked(r) and r.status in FAILURE_STATUSES)
    if as_json:
        payload = {
            "study": spec.name,
            "backend": choice.kind,
            "source": "simulated" if choice.simulated else "measured",
            "probes": outcome.probes_run,
            "failed": failed,
            "statuses": status_counts(result.records),
            "stopped_because": outcome.stopped_because,
            "best": [best_payload(b) for b in result.best],
            "improvement": line,
            "run_dir": str(directory),
            "recommended": best_payload(chosen) if chosen is not None else None,
            "recommendation": recommendation.sentence if recommendation else "",
            "exports": {k: str(v) for k, v in exports.items()},
            "mlflow_parent_run_id": outcome.parent_run_id,
        }
        out.print_json(json.dumps(payload, default=_json_default))
    else:
        source = "simulated" if choice.simulated else "measured"
        err.print(
            f"{status_line(result.records)} ({outcome.probes_run} probed, {source}); stopped: "
            f"{outcome.stopped_because}",
            markup=False,
        )
        if best is not None and choice.simulated:
            _print_preview(result.records, objectives, recommendation)
        if best is not None:
            m = objectives[0][0]
            out.print(Text.assemble(("best", "bold"), f" trial {best.number}: {_short(best.config)}"))
            out.print(
                "  "
                + ", ".join(
                    f"{k} {v:,.4g}"
                    for k, v in best.metrics.items()
                    if k
                    in (
                        m,
                        "mfu",
                        "peak_memory_gib",
                        "step_time_s",
                        "tokens_per_s_per_device",
                        "ttft_ms",
                        "decode_tokens_per_s",
                    )
                )
                + f"  ({source})"
            )
            if line:
                out.print(f"  {line}", markup=False)
            if recommendation is not None and recommendation.sentence:
                if recommendation.changed:
                    out.print(Text(recommendation.sentence, style="bold"))
                else:
                    out.print(Text.assemble(("tight:", "bold"), f" {recommendation.sentence}"))
    if best is None:
        _warn("no trial succeeded: see `autotune report` for the failure reasons")
    err.print("\n[bold]next steps[/bold]")
    spec_arg = str(spec.source_path) if spec.source_path else spec.name
    if tracking:
        err.print(f"  browse trials:   {mlflow_ui_command(tracking.tracker.tracking_uri)}", markup=False)
    err.print(f"  results table:   autotune report {spec_arg} --run-dir {directory}", markup=False)
    if exports:
        launch = next(
            (
                exports[f]
                for f in default_formats(spec.target_stack, spec.workload.kind)
                if f not in ("yaml", "env") and f in exports
            ),
            None,
        ) or next((p for f, p in exports.items() if f not in ("yaml", "env")), None)
        label = "recommended:    " if recommendation is not None and recommendation.changed else "best config:    "
        how = f"launch with {spec.target_stack}: {launch}, " if launch else ""
        err.print(f"  {label} {exports['yaml']}   ({how}env: {exports['env']})", markup=False)
    if choice.simulated:
        how = (
            f"backend {spec.target_stack}, the engine itself"
            if spec.workload.kind == "serve" and spec.target_stack != "none"
            else "backend torch or command"
        )
        err.print(f"  these are predictions: run on the target cluster ({how}) to measure them")
    if outcome.infra_failure:
        _error(f"the infrastructure failed: {outcome.infra_failure}")
        raise typer.Exit(EXIT_INFRA)
    if best is None:
        raise typer.Exit(EXIT_NO_RESULT)


# --------------------------------------------------------------------------------------- report
def _open_existing(spec: Spec, run_dir: Optional[Path]) -> Any:
    from .storage import StorageDamaged, open_study

    directory = _run_dir(spec, run_dir)
    if not spec.tracking.storage and not (directory / "optuna.journal").exists():
        _error(f"no study in {directory}; run `autotune run` first (or pass --run-dir)")
        raise typer.Exit(EXIT_INPUT)
    try:
        return open_study(spec, directory, create=False)
    except StorageDamaged as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None
    except KeyError:
        _error(f"the storage holds no study named {spec.name!r}")
        raise typer.Exit(EXIT_INPUT) from None


@app.command()
def report(
    spec_path: Path = RunOrSpecArg,
    run_dir: Optional[Path] = RunDirOpt,
    as_json: bool = JsonOpt,
    top: int = typer.Option(20, help="rows in the table"),
) -> None:
    """Every trial of the study with its status, metrics and failure reason."""
    _setup_logging(False)
    spec, run_dir = _load_run_or_spec(spec_path, run_dir)
    study = _open_existing(spec, run_dir)
    _relocate_mlflow(_run_dir(spec, run_dir))
    from .report import best_payload, improvement_line, results_rows, status_line, study_summary, summary_lines
    from .study_result import StudyResult

    objectives = spec.objective_list()
    result = StudyResult.load(spec, study)
    records, best, baseline = result.records, result.best, result.baseline
    line = improvement_line(best[0] if best else None, baseline, *objectives[0])
    summary = study_summary(study, records, objectives, best, baseline, result.recommendation)
    if as_json:
        payload = {
            "study": spec.name,
            "objectives": [{"metric": m, "direction": d} for m, d in objectives],
            "trials": [r.to_json() for r in records],
            "best": [best_payload(b) for b in best],
            "baseline": best_payload(baseline) if baseline else None,
            "improvement": line,
            "summary": summary,
        }
        out.print_json(json.dumps(payload, default=_json_default))
        return
    rows = results_rows(records, objectives)
    out.print(f"[bold]{escape(spec.name)}[/bold]: {escape(status_line(records))}")
    # one line per trial, the config last and whole (copyable), like `plan`
    names = [m for m, _ in objectives]
    first = names[0]
    columns = [*names, f"predicted {first}", "peak_memory_gib"]
    widths = [max(len(c), 9) for c in columns]
    out.print(
        "trial     status    source     "
        + "  ".join(c.rjust(w) for c, w in zip(columns, widths))
        + "  config  —  why chosen / why failed"
    )
    by_number = {r.number: r for r in records}
    for row in rows[:top]:
        rec = by_number[row["trial"]]
        values = [row.get(m) for m in names] + [rec.predicted.get(first), row.get("peak_memory_gib")]
        cells = "  ".join(_fmt_metric(v).rjust(w) for v, w in zip(values, widths))
        why = rec.reason if rec.status != "ok" else rec.chosen_because
        number = f"{rec.number}{'*' if rec.baseline else ''}"
        out.print(
            f"{number:<9} {rec.status:<9} {rec.source:<10} {cells}  {_short(rec.config)}  —  {why[:160]}", markup=False
        )
    if any(r.baseline for r in records):
        out.print("(* the baseline of the spec)")
    if line:
        out.print(line)
    for text in summary_lines(summary):
        out.print(text, markup=False, highlight=False)


def _fmt_metric(v: Any) -> str:
    if not isinstance(v, (int, float)):
        return ""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


# --------------------------------------------------------------------------------------- export
@app.command()
def export(
    spec_path: Path = RunOrSpecArg,
    run_dir: Optional[Path] = RunDirOpt,
    out_dir: Optional[Path] = typer.Option(None, "--out", help="directory for the files (default <run-dir>/export)"),
    formats: Optional[str] = typer.Option(
        None,
        "--format",
        help="comma-separated: yaml, env, megatron (torchrun script with "
        "MindSpeed-LLM / Megatron-LM arguments), deepspeed (config JSON), "
        "mindformers (parallel_config YAML), torchtitan (0.3 launch "
        "script); or all (those that can launch the config). Default: "
        "yaml, env and the launch form of the spec's target",
    ),
    trial: Optional[int] = typer.Option(None, help="export this trial instead of the best"),
    as_json: bool = JsonOpt,
) -> None:
    """Write the best config ready to launch: YAML, env file, MindSpeed/Megatron torchrun script,
    DeepSpeed JSON, MindFormers YAML, torchtitan 0.3 launch script. A format that cannot launch the
    measured config (a training launch of an inference study among them) is refused (exit 2)."""
    _setup_logging(False)
    from .exports import default_formats, parse_formats, write_exports

    try:
        chosen_formats = parse_formats(formats) if formats else None
    except ValueError as exc:
        _error(f"--format: {exc}")
        raise typer.Exit(EXIT_INPUT) from None
    spec, run_dir = _load_run_or_spec(spec_path, run_dir)
    if chosen_formats is None:
        chosen_formats = list(default_formats(spec.target_stack, spec.workload.kind))
    study = _open_existing(spec, run_dir)
    from .study_result import StudyResult

    result = StudyResult.load(spec, study)
    if trial is not None:
        chosen = result.record(trial)
        if chosen is None:
            _error(f"--trial {trial}: the study has trials 0..{len(result.records) - 1}")
            raise typer.Exit(EXIT_INPUT)
    else:
        chosen = result.chosen
        if chosen is None:
            err.print("[red]error[/red] the study has no successful trial to export")
            raise typer.Exit(EXIT_NO_RESULT)
        if result.recommendation is not None and result.recommendation.changed:
            err.print(
                f"exporting the recommended config: {result.recommendation.sentence} (--trial "
                f"{result.best[0].number} exports the best)",
                markup=False,
            )
    directory = out_dir or _run_dir(spec, run_dir) / "export"
    from .export import ExportRefused
    from .exports import refusals
    from .finish import export_context

    context = export_context(spec, chosen)
    if formats == "all":  # every format that can launch the config; say why the others cannot
        refused = refusals(context, chosen_formats)
        for name, reasons in refused.items():
            _warn(f"not exported as {name}: {', '.join(reasons)}")
        chosen_formats = [f for f in chosen_formats if f not in refused]

    try:
        paths = write_exports(context, directory, chosen_formats)
    except ExportRefused as exc:
        hint = (
            "export yaml or env"
            if spec.workload.kind != "train"
            else f"the study's target is {spec.target_stack}: export its format, or set `target:` in the spec and run "
            "the study again"
        )
        _error(f"{exc} ({hint})")
        raise typer.Exit(EXIT_INPUT) from None
    if as_json:
        print(json.dumps({"trial": chosen.number, "files": {k: str(v) for k, v in paths.items()}}))
        return
    for kind, path in paths.items():
        out.print(f"{kind}: {path}", highlight=False, soft_wrap=True, markup=False)


def main() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    _install_sigterm()
    try:
        app()
    except KeyboardInterrupt as exc:  # before the study started (imports, ranking): nothing to save yet
        _warn("terminated (SIGTERM)" if _was_terminated(exc) else "interrupted")
        sys.exit(_interrupted_exit(exc))
    except Exception as exc:  # a bug: say so in one line, keep the traceback for AUTOTUNE_DEBUG=1
        if os.environ.get("AUTOTUNE_DEBUG"):
            raise
        _error(
            f"internal error: {type(exc).__name__}: {exc} (a bug in autotune; AUTOTUNE_DEBUG=1 shows the "
            "traceback; please report it)"
        )
        sys.exit(EXIT_INTERNAL)


if __name__ == "__main__":
    main()
