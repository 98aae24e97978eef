"""The ``autotune`` command line.

Like ``ray job`` and ``optuna``: logs and progress go to stderr, data to stdout, ``--json`` gives
scripts a stable object, and the exit codes are documented:

(Why one module of over 500 lines: the commands share their options, exit codes and output
helpers; each command only parses, calls the stage that does the work (:mod:`autotune.finish`,
:mod:`autotune.search`, :mod:`autotune.doctor`, ...) and prints what it returns; the tables it
prints are :mod:`autotune.run_output`'s, each long phase a moving status of
:func:`autotune.progress.phase`.)


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
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from typer.core import TyperCommand, TyperGroup
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from .secret_env import SPEC_COPY
from .spec import Spec
from .spec_errors import SpecError, escape_text
from .spec_load import load_spec

__all__ = ["app", "main"]


class _PlainHelp:
    """``--help`` shown as a plain flag (typer 0.29 prints ``--help <bool>``)."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.metavar = ""
        return option


class _Command(_PlainHelp, TyperCommand):
    pass


class _Group(_PlainHelp, TyperGroup):
    pass


app = typer.Typer(
    cls=_Group,
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


def _flag(*names: str, help: str) -> Any:
    """A boolean option shown as a plain flag (typer 0.29 prints ``--json <bool>`` otherwise)."""
    return typer.Option(False, *names, help=help, metavar="")


JsonOpt = _flag("--json", help="print one JSON object on stdout (logs and progress stay on stderr)")
VerboseOpt = _flag("-v", "--verbose", help="log what each stage does (stderr)")


def _backend_kinds() -> tuple[str, ...]:
    """Every backend ``--backend`` accepts, as :func:`autotune.backends.select_backend` does."""
    from .spec import BACKEND_KINDS
    from .stacks import preset_names

    return (*BACKEND_KINDS, *(name for name in preset_names() if name not in BACKEND_KINDS))


def _format_help() -> str:
    """``--format``'s help: every export format with the file it writes (from the registry)."""
    from .exports import EXPORTERS

    formats = ", ".join(f"{name} ({exporter.filename})" for name, exporter in EXPORTERS.items())
    return (
        f"comma-separated: {formats}; or all (every one that can launch the config). Default: yaml, env and the "
        "launch file of the spec's target stack"
    )


def _error(text: str) -> None:
    """An error line. The text is never read as rich markup: it quotes specs, probes and paths,
    which are full of brackets (``[rank0]:``, ``[tp for x in ...]``, ``[/bold]``); and its control,
    bidi and invisible characters are escapes (:func:`~autotune.spec_errors.escape_text`: an ESC
    is ``\\x1b``, a newline ``\\n``; text escaped already stays as it is)."""
    err.print(Text.assemble(("error", "red"), " ", escape_text(text)))


def _warn(text: str) -> None:
    err.print(Text(escape_text(text), style="yellow"))


def _say(console: Console, text: str, style: str = "") -> None:
    """A line of ``text`` that quotes a spec, a probe or a trial record: printed as it is, never
    read as markup, its control, bidi and invisible characters escaped (one line, what it holds)."""
    console.print(Text(escape_text(text), style=style))


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
@app.command(cls=_Command)
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
    from .progress import phase
    from .ray_dispatch import RayDispatcher

    where = f"the Ray cluster at {address}" if address else "a local Ray on this machine"
    with phase(err, f"starting or joining {where}"):
        try:
            dispatcher = RayDispatcher(address=address, num_cpus=spec.ray.num_cpus if spec and not address else None)
        except ConnectionError as exc:  # dispatch.RayUnreachable: its message names the address
            _error(str(exc))
            raise typer.Exit(EXIT_INFRA) from None
        except Exception as exc:
            _error(f"cannot reach the Ray cluster{f' at {address}' if address else ''}: {type(exc).__name__}: {exc}")
            raise typer.Exit(EXIT_INFRA) from None
    try:
        with phase(err, "asking each node for its devices and software") as step:
            nodes = cluster_report(dispatcher._ray, progress=step.update)
    finally:
        with phase(err, "stopping Ray"):
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
        out.print(
            f"[bold]Ray cluster[/bold] {escape(escape_text(address or 'local (this machine)'))}: {len(nodes)} node(s)"
        )
        for n in nodes:
            devices = ", ".join(
                f"{k} {n['free'].get(k, v):g}/{v:g} free" for k, v in n["total"].items() if k in ("CPU", "GPU", "NPU")
            )
            soft = n.get("software") or {}
            software = ", ".join(f"{k} {v}" for k, v in soft.items()) if soft else n.get("error", "none found")
            _say(
                out, f"  {n['label']} ({n.get('host', 'host not reported')}, python {n.get('python', '?')}): {devices}"
            )
            _say(out, f"      software: {software}")
            if n.get("visible_devices"):
                _say(out, f"      visible: {n['visible_devices']}")
        if verdict:
            _say(out, ("ok  " if verdict[0] else "not placeable  ") + verdict[1])
    if verdict and not verdict[0]:
        raise typer.Exit(EXIT_NO_RESULT)


# ------------------------------------------------------------------------------------- validate
@app.command(cls=_Command)
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
            out.print_json(json.dumps({"ok": False, "errors": [f"{escape_text(str(spec_path))}: {empty}"]}))
        else:
            _error(f"{escape_text(str(spec_path))}: {empty}")
        raise typer.Exit(EXIT_INPUT)
    if as_json:
        out.print_json(json.dumps({"ok": True, "summary": spec.summary()}))
    else:
        _say(out, f"ok  {spec.summary()}")


def _why_empty(spec: Spec) -> Optional[str]:
    """Why the spec's space holds no valid config, as ``constraints: ...`` (None when it holds one,
    or is above search.exhaustive_limit: then the sampler explores it and says what it rejected),
    or ``search.exhaustive_limit: ...`` when ranking a space that size could not fit in memory."""
    from .space import Space, SpaceTooLarge

    try:
        empty = Space(spec).why_empty(limit=spec.search.exhaustive_limit)
    except SpaceTooLarge as exc:
        return f"search.exhaustive_limit: {exc}"
    except ValueError:
        return None
    return f"constraints: {empty}" if empty else None


def _refuse_empty(spec: Spec, spec_path: Path) -> None:
    empty = _why_empty(spec)
    if empty:
        _error(f"{escape_text(str(spec_path))}: {empty}")
        raise typer.Exit(EXIT_INPUT)


# ----------------------------------------------------------------------------------------- plan
@app.command(cls=_Command)
def plan(
    spec_path: Path = SpecArg,
    top: int = typer.Option(10, help="configs to show"),
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Space size, valid configs, configs the memory model says fit, and the predicted top N."""
    _setup_logging(verbose)
    spec = _load(spec_path)
    from .context import probe_context
    from .ranking import rank_space
    from .trial_attrs import ROOMIEST, UNDISTINGUISHED
    from .space import Space, SpaceTooLarge

    spec, profile = _planned_profile(spec)
    space = Space(spec)
    objectives = spec.objective_list()
    try:
        enumeration = space.enumerate(limit=spec.search.exhaustive_limit)
    except SpaceTooLarge as exc:
        _error(f"{escape_text(str(spec_path))}: search.exhaustive_limit: {exc}")
        raise typer.Exit(EXIT_INPUT) from None
    except ValueError as exc:
        _error(f"{exc}; narrow the space or raise search.exhaustive_limit")
        raise typer.Exit(EXIT_INPUT) from None
    if enumeration.why_empty():
        _error(f"{escape_text(str(spec_path))}: constraints: {enumeration.why_empty()}")
        raise typer.Exit(EXIT_INPUT)
    from .progress import phase

    with phase(err, f"ranking the space with the simulator ({len(enumeration.configs):,} valid configs)"):
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
                {
                    "params": c,
                    "metrics": _public_metrics(m),
                    "undistinguished": lay.undistinguished,
                    "roomiest": lay.roomiest,
                }
                for (c, m), lay in zip(best, layouts)
            ],
            "knob_pricing": ranking.knob_pricing(list(space.choices)),
        }
        out.print_json(json.dumps(payload, default=_json_default))
        return
    _say(out, spec.summary())
    _say(out, profile["line"])
    out.print(
        f"space: {enumeration.space_size:,} combinations, {enumeration.valid:,} valid canonical configs, "
        f"{ranking.fit:,} predicted to fit in {ranking.predictions.get('memory_limit_gib', [0])[0]:.1f} GiB per device"
        if len(ranking.order)
        else f"space: {enumeration.space_size:,} combinations, no valid config"
    )
    for reason, count in sorted(enumeration.invalid_reasons.items(), key=lambda kv: -kv[1]):
        _say(out, f"  {count:,} rejected: {reason}", style="dim")
    if not best:
        _warn("no config is predicted to fit; see the memory breakdown with -v")
        raise typer.Exit(EXIT_NO_RESULT)
    from .ranking import Layout
    from .run_output import print_breakdown, print_pricing, print_top_table

    print_top_table(
        out, best, objectives, title=f"predicted top {len(best)} distinct layouts (simulated, not measured)"
    )
    for marker, text_of in ((UNDISTINGUISHED, Layout.undistinguished_text), (ROOMIEST, Layout.roomiest_text)):
        for text in sorted({text_of(lay) for lay in layouts if text_of(lay)}):
            rows = [str(i) for i, lay in enumerate(layouts, start=1) if text_of(lay) == text]
            _say(out, f"  rows {','.join(rows)}: {marker}{text}")
    print_pricing(out, ranking.knob_pricing(list(space.choices)))
    print_breakdown(out, best[0][1])


def _public_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}


def _json_default(o: Any) -> Any:
    from .finish import json_default

    return json_default(o)


# ------------------------------------------------------------------------------------ calibrate
@app.command(cls=_Command)
def calibrate(
    out_path: Path = typer.Option(..., "--out", help="profile file to write (YAML)"),
    accelerator: str = typer.Option("cpu", help="cpu | cuda | npu: the device to measure, on this host"),
    ranks: int = typer.Option(2, help="processes for the collective measurement (1: skip it)"),
    threads: Optional[int] = typer.Option(None, help="CPU: threads per device (default cores / ranks)"),
    quick: bool = _flag("--quick", help="small sizes, few repeats (seconds, rough figures)"),
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

    from .progress import phase

    try:
        with phase(err, f"measuring {accelerator}{' (quick)' if quick else ''}") as step:
            result = measure(accelerator, quick=quick, ranks=ranks, threads=threads, progress=step.update)
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
@app.command(cls=_Command)
def run(
    spec_path: Path = SpecArg,
    backend: Optional[str] = typer.Option(
        None, help=f"{' | '.join(_backend_kinds())} (overrides the spec's backend:)", show_default=False
    ),
    n_trials: Optional[int] = typer.Option(None, "--n-trials", help="probe budget"),
    parallel: Optional[int] = typer.Option(None, "--parallel", help="trials at once"),
    seed: Optional[int] = typer.Option(None, help="sampler seed"),
    run_dir: Optional[Path] = RunDirOpt,
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", help="connect to a Ray cluster ('auto', ray://...)"
    ),
    no_tracking: bool = _flag(
        "--no-tracking",
        help="write no MLflow runs (the study is still kept in the run directory's Optuna storage, with its "
        "results, plots and exports); run the same command again without it to log the trials measured "
        "meanwhile, nothing probed twice",
    ),
    reuse_cache: bool = _flag(
        "--reuse-cache",
        help="answer configs measured before (any study, "
        "same model, workload, cluster, backend and software) from the result cache",
    ),
    fresh_study: bool = _flag(
        "--fresh-study",
        help="the spec changed what defines the study kept "
        "in the run directory: set that study aside (kept, renamed) and start anew",
    ),
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
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
    err.print(Text.assemble((escape_text(f"backend: {choice.kind}"), "bold"), escape_text(f" — {choice.reason}")))
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
    # the lease first: a second driver is refused before its spec check can set the live study aside
    lease = _lease_shared_study(spec, directory)
    try:
        _check_definition(spec, spec_path, directory, defined_as, fresh_study)
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
    from .usable_memory import with_usable_memory

    spec, usable_memory = with_usable_memory(spec, choice.simulated, lambda text: _say(err, text, style="dim"))

    from .progress import ProgressObserver
    from .search import StudyRunner, Unplaceable

    from .assembly import dispatcher_for, launcher_for, tracking_for
    from .progress import phase

    try:
        # a real backend's dispatcher starts (or joins) Ray: seconds; the simulator's is in-process
        with phase(err, "starting the trials' dispatcher") if not choice.simulated else contextlib.nullcontext():
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
        with phase(err, "opening the MLflow store"):
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
        tracking=tracking_for(tracker, spec, choice, directory),
        observer=observer,
        cache=cache,
        reuse_cache=reuse_cache,
        stop_requested=lambda: _SIGTERM_RECEIVED,
        definition=defined_as,
        usable_memory=usable_memory or None,
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
            _say(err, f"  {line}")
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
        _say(
            err,
            f"--fresh-study: the earlier study ({len(changes)} change(s): {'; '.join(changes[:3])}) is kept as "
            f"{name!r} in the same storage; starting a new study {spec.name!r}",
            style="dim",
        )


def _measured_profile(spec: Spec, choice: Any) -> Spec:
    """The spec on this host's measured profile when a real study would otherwise rank with
    data-sheet figures (``host_profile``: calibrates once, cached per host and software)."""
    from .host_profile import ensure_measured_profile

    try:
        from .progress import phase

        return ensure_measured_profile(
            spec, choice.simulated, lambda text: _say(err, text, style="dim"), lambda text: phase(err, text)
        )
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
        _say(err, moved, style="dim")


def _tracker(spec: Spec, directory: Path) -> Any:
    from .tracking import Tracker, default_tracking_uri, error_line

    uri = spec.tracking.mlflow_uri or default_tracking_uri(directory)
    if not spec.tracking.mlflow_uri:
        _relocate_mlflow(directory)  # a resumed study whose run directory was moved
    if uri.startswith(("http://", "https://")):
        _say(err, f"connecting to MLflow at {uri} ...")
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
    from .storage import journal_path

    from .progress import phase

    objectives = spec.objective_list()
    tracking = runner.tracking
    what = "writing the results, plots, exports" + (" and the MLflow parent run" if tracking else "")
    with phase(err, what):
        finished = finish_study(
            spec,
            directory,
            outcome.study,
            outcome.result,
            probes_run=outcome.probes_run,
            stopped_because=outcome.stopped_because,
            tracking=tracking,
        )
        if tracking:
            _close_tracking(runner, "FINISHED")
    for name, reasons in finished.target_refusals.items():  # a study resumed from before its target
        _warn(f"not exported as {name}: {', '.join(reasons)}")
    result, exports, line = outcome.result, finished.exports, finished.improvement
    best = result.best[0] if result.best else None
    recommendation, chosen = result.recommendation, result.chosen
    failed = sum(1 for r in result.records if is_tracked(r) and r.status in FAILURE_STATUSES)
    if as_json:
        payload = {
            "study": spec.name,
            "backend": choice.kind,
            "source": "simulated" if choice.simulated else "measured",
            "probes": round(float(outcome.probes_run), 3),  # full-probe equivalents (a memory profile: its share)
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
        _say(
            err,
            f"{status_line(result.records)} ({_probes_words(outcome.probes_run)}, {source}); stopped: "
            f"{outcome.stopped_because}",
        )
        from .run_output import print_best, print_preview, print_pricing

        if best is not None and choice.simulated:
            print_preview(out, result.records, objectives, recommendation)
            if outcome.ranking is not None:
                print_pricing(out, outcome.ranking.knob_pricing(list(spec.space.choices())))
        print_best(
            out,
            result.best,
            objectives,
            source,
            line,
            recommendation,
            workload=spec.workload.model_dump(),
            cost_per_device_hour=spec.cluster.cost_per_device_hour,
        )
    if best is None:
        _warn("no trial succeeded: see `autotune report` for the failure reasons")
    err.print("\n[bold]next steps[/bold]")
    spec_arg = str(spec.source_path) if spec.source_path else spec.name
    if tracking:
        uri = tracking.tracker.tracking_uri
        if uri.startswith(("http://", "https://", "databricks")):  # a server of its own: open it there
            _say(err, f"  browse trials:   open {uri} (experiment {spec.tracking.experiment or spec.name})")
        else:
            _say(err, f"  browse trials:   autotune ui {_quoted(directory)}")
    journal = journal_path(spec, directory)
    if journal is not None:
        _say(err, f"  Optuna's view:   optuna-dashboard {_quoted(journal)}")
    _say(err, f"  results table:   autotune report {spec_arg} --run-dir {directory}")
    if exports:
        launch = next(
            (
                exports[f]
                for f in default_formats(spec.target_stack, spec.workload.kind)
                if f not in ("yaml", "env") and f in exports
            ),
            None,
        ) or next((p for f, p in exports.items() if f not in ("yaml", "env")), None)
        label = (
            "recommended:    "
            if recommendation is not None and recommendation.changed
            else "front's first:  "
            if len(objectives) > 1
            else "best config:    "
        )
        how = f"launch with {spec.target_stack}: {launch}, " if launch else ""
        _say(err, f"  {label} {exports['yaml']}   ({how}env: {exports['env']})")
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


def _quoted(path: Any) -> str:
    import shlex

    return shlex.quote(str(path))


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


@app.command(cls=_Command)
def report(
    spec_path: Path = RunOrSpecArg,
    run_dir: Optional[Path] = RunDirOpt,
    as_json: bool = JsonOpt,
    top: int = typer.Option(
        20, "--top", help="trials shown in the table, best first (failed ones last); the summary covers them all"
    ),
) -> None:
    """Every trial of the study with its status, metrics, config and why it was chosen or failed
    (best first, lines fit 120 columns), then the summary: before/after, the Pareto front,
    importances, probe costs."""
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
    from .run_output import WIDTH, decision_lines, print_report_table, wrap_line

    rows = results_rows(records, objectives, spec.workload.kind)
    out.print(Text.assemble((escape_text(spec.name), "bold"), escape_text(f": {status_line(records)}")))
    print_report_table(out, rows, records, objectives, top)
    decision = decision_lines(best[0], spec.workload.model_dump(), spec.cluster.cost_per_device_hour) if best else []
    if decision:
        out.print(f"best trial {best[0].number}:", markup=False)
        for text in decision:
            for part in wrap_line(f"  {escape_text(text)}", WIDTH, indent=6):
                out.print(part, markup=False)
    if line:
        _say(out, line)
    for text in summary_lines(summary):  # escaped by summary_lines (each line wrapped to fit)
        out.print(text, markup=False, highlight=False)


# --------------------------------------------------------------------------------------- export
@app.command(cls=_Command)
def export(
    spec_path: Path = RunOrSpecArg,
    run_dir: Optional[Path] = RunDirOpt,
    out_dir: Optional[Path] = typer.Option(None, "--out", help="directory for the files (default <run-dir>/export)"),
    formats: Optional[str] = typer.Option(None, "--format", help=_format_help(), show_default=False),
    trial: Optional[int] = typer.Option(None, help="export this trial instead of the best"),
    as_json: bool = JsonOpt,
) -> None:
    """Write the recommended (or best) config ready to launch: autotune's YAML and env file, and the
    launch file of each stack (--format lists every format and its file). A format that cannot
    launch the config exactly (a training launch of an inference study among them) is refused
    (exit 2)."""
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
            _say(
                err,
                f"exporting the recommended config: {result.recommendation.sentence} (--trial "
                f"{result.best[0].number} exports the best)",
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
        _say(out, f"{kind}: {path}")


# ------------------------------------------------------------------------------------------- ui
@app.command(cls=_Command)
def ui(
    run_dir: Path = typer.Argument(..., help="run directory of `autotune run`", show_default=False),
    host: str = typer.Option("127.0.0.1", "--host", help="address the MLflow server listens on"),
    port: int = typer.Option(5000, "--port", help="port the MLflow server listens on"),
    open_browser: bool = typer.Option(
        False, "--open/--no-open", help="open the study's page in a browser once the server answers", metavar=""
    ),
    print_url: bool = _flag(
        "--print-url", help="only print the study's URL for a server already running at --host/--port, and exit"
    ),
) -> None:
    """Browse the study in MLflow: start `mlflow ui` on the run directory's store and print the URL
    of the study's runs table (objectives, status and searched params as columns, sorted by the
    first objective). Ctrl-C stops the server."""
    _setup_logging(False)
    directory = run_dir.resolve()
    if not directory.is_dir():
        _error(f"{run_dir}: no such run directory (pass the --run-dir of `autotune run`)")
        raise typer.Exit(EXIT_INPUT)
    from .mlflow_ui import serve_ui, server_url, study_ui_url

    try:
        if print_url:
            out.print(study_ui_url(directory, server_url(host, port)), markup=False, soft_wrap=True)
            return
        code = serve_ui(
            directory,
            host=host,
            port=port,
            open_browser=open_browser,
            on_ready=lambda url: out.print(url, markup=False, soft_wrap=True),
        )
    except (FileNotFoundError, LookupError, ValueError) as exc:  # no MLflow store in the run directory
        _error(str(exc))
        raise typer.Exit(EXIT_INPUT) from None
    except (OSError, RuntimeError) as exc:  # the port is taken, the server stopped or did not answer
        _error(f"cannot start the MLflow UI on {host}:{port}: {exc}")
        raise typer.Exit(EXIT_INFRA) from None
    raise typer.Exit(code)


def _exit_without_teardown(code: Any) -> None:
    """Exit once the command's work is done and said, without the interpreter's teardown of
    torch, Ray, MLflow and pandas modules (2 s on an idle 2-core machine, up to 9 s on a loaded
    one, all of it silence after the last line). Nothing is skipped that keeps data: threads that
    are not daemons are joined, the atexit handlers (Ray's shutdown among them) run, and the
    standard streams and logs are flushed first."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): printed, status 1, as the interpreter does
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(status)


def main() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    _install_sigterm()
    try:
        app()
    except SystemExit as exc:  # how every command ends (typer's standalone mode)
        _exit_without_teardown(exc.code)
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


def _probes_words(spent: float) -> str:
    """The budget spent: a count of probes, or full-probe equivalents where memory profiles
    (which cost a share of a full probe) ran."""
    spent = float(spent)
    if abs(spent - round(spent)) < 1e-9:
        return f"{int(round(spent))} probed"
    return f"{spent:.1f} full-probe equivalents probed, memory profiles included"


if __name__ == "__main__":
    main()
