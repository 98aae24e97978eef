"""The ``autotune`` command line.

Like ``ray job`` and ``optuna``: logs and progress go to stderr, data to stdout, ``--json`` gives
scripts a stable object, and the exit codes are documented:

====  ==========================================================================
0     success
1     no result: the study ran but no trial succeeded (see the report for the reasons; ``export``
      too), ``plan``: no config is predicted to fit, ``doctor``: the spec's largest trial cannot be
      placed, ``scale``: no size was measured
2     bad input: the spec (or an edit of it that changes the study kept in the run directory),
      an option, or a run directory that holds no study
3     infrastructure failure: Ray (a cluster that cannot place any trial, a node lost mid-study:
      the results so far are written and the same command resumes), MLflow or the Optuna storage
130   interrupted (Ctrl-C); the study resumes with the same command
====  ==========================================================================

(Why one module of over 500 lines: it holds the nine commands, their options and help, and
their exit paths, nothing else. Each command parses, calls the stage that does the work
(:mod:`autotune.cli.assembly` builds a study, :mod:`autotune.study.search` runs it, :mod:`autotune.finish.study_end`
writes its files and decides what to advise, :mod:`autotune.cli.doctor` asks the cluster, ...) and
prints what it returns (:mod:`autotune.cli.output`, the tables :mod:`autotune.finish.run_output`'s,
each long phase a moving status of :func:`autotune.tracking.progress.phase`). What the commands read is
:mod:`autotune.cli.input`'s, their shared options :mod:`autotune.cli.options`', the process's
end :mod:`autotune.cli.exit_status`'s.)
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.text import Text

from .console import err, out
from .console import json_failure as _json_failure
from .console import error as _error, say as _say, setup_logging as _setup_logging, voice as _voice, warn as _warn
from .exit_status import EXIT_INFRA, EXIT_INPUT, EXIT_INTERNAL, EXIT_NO_RESULT, EXIT_OK  # noqa: F401 (documented)
from .exit_status import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated  # noqa: F401 (documented)
from .exit_status import exit_without_teardown as _exit_without_teardown, install_sigterm as _install_sigterm
from .exit_status import interrupted_exit as _interrupted_exit, interrupted_words as _interrupted_words
from .options import Command as _Command, Group as _Group, JsonOpt, RunDirOpt, RunOrSpecArg, SpecArg, VerboseOpt
from .options import backend_kinds as _backend_kinds, flag as _flag, format_help as _format_help
from .input import load as _load, load_run_or_spec as _load_run_or_spec, open_existing as _open_existing
from .input import refuse_empty as _refuse_empty, remember_spec as _remember_spec, run_dir_of as _run_dir
from .input import why_empty as _why_empty, with_overrides as _with_overrides
from ..spec.schema import Spec
from ..spec.errors import SpecError, escape_text
from ..spec.load import load_spec
from ..stacks import target_of
from ..trial_attrs import RAN

__all__ = ["app", "main"]


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Declarative auto-tuner for large-model training and inference configurations.",
)
log = logging.getLogger("autotune")


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
    from ..tracking.progress import phase
    from ..dispatch.ray_dispatch import RayDispatcher

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
    from .output import print_cluster

    print_cluster(address, nodes, verdict, as_json)
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
    from .output import spec_summary

    if as_json:
        out.print_json(json.dumps({"ok": True, "summary": spec_summary(spec)}))
    else:
        _say(out, f"ok  {spec_summary(spec)}")


# ----------------------------------------------------------------------------------------- plan
@app.command(cls=_Command)
def plan(
    spec_path: Path = SpecArg,
    top: int = typer.Option(10, min=1, help="configs to show"),
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Space size, valid configs, configs the memory model says fit, and the predicted top N."""
    _setup_logging(verbose)
    spec = _load(spec_path)
    from ..spec.resolve import objectives_of, probe_context
    from ..guide.ranking import rank_space
    from ..spec.space import Space, SpaceTooLarge

    from .assembly import AssemblyFailed, planned_profile

    try:
        spec, profile = planned_profile(spec, _voice())
    except AssemblyFailed:  # said already
        raise typer.Exit(EXIT_INPUT) from None
    space = Space(spec)
    objectives = objectives_of(spec)
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
    from ..tracking.progress import phase

    with phase(err, f"ranking the space with the simulator ({len(enumeration.configs):,} valid configs)"):
        ranking = rank_space(enumeration, probe_context(spec), objectives)
    # the top distinct layouts: configs the model prices the same are one row, their knobs named
    layouts = ranking.distinct_layouts(top)
    best = [(ranking.enumeration.configs[lay.index], ranking.metrics_of(lay.index)) for lay in layouts]
    from .output import print_plan

    if not print_plan(spec, profile, space, enumeration, ranking, layouts, best, as_json):
        _warn("no config is predicted to fit; see the memory breakdown with -v")
        raise typer.Exit(EXIT_NO_RESULT)


def _json_default(o: Any) -> Any:
    from ..finish.study_end import json_default

    return json_default(o)


# ------------------------------------------------------------------------------------ calibrate
@app.command(cls=_Command)
def calibrate(
    out_path: Path = typer.Option(..., "--out", help="profile file to write (YAML)"),
    accelerator: str = typer.Option("cpu", help="cpu | cuda | npu: the device to measure, on this host"),
    ranks: int = typer.Option(2, help="processes for the collective measurement (1: skip it)"),
    threads: Optional[int] = typer.Option(None, help="CPU: threads per device (default cores / ranks)"),
    quick: bool = _flag("--quick", help="small sizes, few repeats (seconds, rough figures)"),
    nodes: Optional[str] = typer.Option(
        None,
        "--nodes",
        help="node counts of the Ray cluster to measure the collectives across, e.g. 2,4 (each count: --ranks "
        "processes per node, all in one group); needs --ray-address",
    ),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="the Ray cluster of --nodes ('auto', ...)"),
    serving: Optional[Path] = typer.Option(
        None,
        "--serving",
        help="a serving spec: measure its engine's prefill and decode steps on this host (closed-loop batches at "
        "three prompt lengths) and write the profile the study ranks with, plus serving_steps",
    ),
    settings: list[str] = typer.Option(
        [], "--set", help="with --serving: a parameter of the config measured, name=value (repeatable)"
    ),
    readings: Optional[Path] = typer.Option(
        None,
        "--readings",
        help="with --serving: refit the readings an earlier calibration kept (its <out>.serving-calibration "
        "folder or readings.jsonl) against the model and profile as they are now; the engine is not run",
    ),
    serving_repeats: Optional[int] = typer.Option(
        None,
        "--repeats",
        help="with --serving: probes per prompt length, in rounds; the fit reads each figure's median (default 3; "
        "1 is the quick, single-reading calibration)",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Measure this host's device (linear layers per precision at the shapes models run, memory
    bandwidth, collectives' latency and bandwidth) and write a hardware profile; use it with
    `cluster.profile: <file>` in a spec. With --nodes, the collectives are measured across each
    node count of a Ray cluster too (`inter_node_links`: what a study pays across that many nodes).
    With --serving SPEC, the spec's serving engine is measured instead (`serving_steps`: how its
    steps compare with the serving model's); with --readings too, what an earlier run measured is
    refitted and nothing is run."""
    _setup_logging(False)
    if serving is not None:
        from .serving_calibrate_command import calibrate_serving_engine, parse_settings

        if readings is not None and settings:
            _error("--set picks the config to measure; --readings refits the config those readings measured")
            raise typer.Exit(EXIT_INPUT)
        if readings is not None and serving_repeats is not None:
            _error("--repeats sets how often the engine is probed; --readings refits readings and probes nothing")
            raise typer.Exit(EXIT_INPUT)
        if serving_repeats is not None and serving_repeats < 1:
            _error(f"--repeats: expected at least 1 probe per prompt length, got {serving_repeats}")
            raise typer.Exit(EXIT_INPUT)
        calibrate_serving_engine(serving, out_path, parse_settings(settings), as_json, readings, serving_repeats)
        return
    if settings:
        _error("--set picks the config of --serving; give the serving spec with --serving")
        raise typer.Exit(EXIT_INPUT)
    if readings is not None:
        _error("--readings refits a serving engine's readings; give the serving spec with --serving")
        raise typer.Exit(EXIT_INPUT)
    if serving_repeats is not None:
        _error("--repeats sets the serving calibration's probes per prompt length; give the spec with --serving")
        raise typer.Exit(EXIT_INPUT)
    if accelerator not in ("cpu", "cuda", "npu"):
        _error(f"--accelerator: expected cpu, cuda or npu, got {accelerator!r}")
        raise typer.Exit(EXIT_INPUT)
    if ranks < 1:
        _error(f"--ranks: expected >= 1, got {ranks}")
        raise typer.Exit(EXIT_INPUT)
    node_counts = _node_counts(nodes) if nodes is not None else []
    if node_counts and not ray_address:
        _error("--nodes measures across the nodes of a Ray cluster: give its --ray-address (e.g. auto)")
        raise typer.Exit(EXIT_INPUT)
    try:
        from autotune.workers.calibrate import calibrate as measure, write_profile
    except ImportError as exc:
        _error(f"calibrate needs torch ({exc}); pip install torch==2.13.0")
        raise typer.Exit(EXIT_INPUT) from None
    from autotune.workers.torch_probe.failures import ProbeFailure

    from ..tracking.progress import phase

    try:
        with phase(err, f"measuring {accelerator}{' (quick)' if quick else ''}") as step:
            result = measure(accelerator, quick=quick, ranks=ranks, threads=threads, progress=step.update)
    except (ImportError, RuntimeError, ValueError, ProbeFailure) as exc:  # no device, no torch_npu, a degenerate fit
        _error(f"cannot measure {accelerator}: {exc}")
        raise typer.Exit(EXIT_INFRA) from None
    if node_counts:
        _measure_links(result, accelerator, ranks, node_counts, ray_address, quick)
    path = write_profile(result, out_path)
    from .output import print_calibration

    print_calibration(path, result, as_json)


def _node_counts(text: str) -> list[int]:
    """``--nodes 2,4``: the node counts, each a whole number >= 1, or exit 2 naming the value."""
    counts = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            _error(f"--nodes: expected node counts >= 1 separated by commas (e.g. 2,4), got {text!r}")
            raise typer.Exit(EXIT_INPUT)
        counts.append(int(part))
    return sorted(set(counts))


def _measure_links(
    result: dict, accelerator: str, ranks: int, node_counts: list[int], ray_address: str | None, quick: bool
) -> None:
    """The collectives across each node count (:mod:`autotune.dispatch.node_collectives`), fitted into
    the profile's ``inter_node_links``; exit 3 when the cluster cannot place a count or a
    measurement fails."""
    from autotune.workers.calibrate import COLLECTIVE_KIB, QUICK_COLLECTIVE_KIB
    from autotune.workers.calibrate_nodes import fit_inter_node_links

    from ..dispatch.node_collectives import NodesUnavailable, measure_node_counts
    from ..dispatch.ray_dispatch import RayDispatcher, RayUnreachable
    from ..tracking.progress import phase

    sizes = (QUICK_COLLECTIVE_KIB if quick else COLLECTIVE_KIB)[accelerator]
    try:
        dispatcher = RayDispatcher(address=ray_address)
    except RayUnreachable as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None
    try:
        with phase(err, f"collectives across {', '.join(map(str, node_counts))} node(s)") as step:
            seconds = measure_node_counts(
                dispatcher, accelerator, ranks, node_counts, sizes, 3 if quick else 5, progress=step.update
            )
    except NodesUnavailable as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None
    except RuntimeError as exc:
        _error(f"cannot measure across nodes: {exc}")
        raise typer.Exit(EXIT_INFRA) from None
    finally:
        dispatcher.shutdown()
    links = fit_inter_node_links(seconds, ranks)
    if links:
        result["profile"]["inter_node_links"] = links
    result["measured"]["inter_node_seconds"] = {
        str(n): {op: {str(b): t for b, t in times.items()} for op, times in ops.items()} for n, ops in seconds.items()
    }
    result["measured"]["inter_node_ranks_per_node"] = ranks


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
    spec = _with_overrides(spec, spec_path, n_trials=n_trials, parallel_trials=parallel, seed=seed)
    if ray_address:
        spec = spec.model_copy(update={"ray": spec.ray.model_copy(update={"address": ray_address})})
    _refuse_empty(spec, spec_path)
    from ..dispatch.backends import select_backend

    try:
        choice = select_backend(spec, backend)
    except ValueError as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_INPUT) from None
    err.print(Text.assemble((escape_text(f"backend: {choice.kind}"), "bold"), escape_text(f" — {choice.reason}")))
    if ray_address and choice.simulated:
        _warn(f"--ray-address {ray_address} is not used: the simulator runs in this process, without Ray")
    elif ray_address and not spec.ray.enabled:
        _warn(
            f"--ray-address {ray_address} is not used: the spec's ray.enabled is false (probes run as local processes)"
        )
    directory = _run_dir(spec, run_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _error(f"cannot create the run directory {directory} ({exc.strerror or exc}); pass a writable --run-dir")
        raise typer.Exit(EXIT_INPUT) from None
    from ..study.run_lock import RunDirLock, StudyInUse

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
    """The study itself, with the run directory locked by this driver (:mod:`.run_lock`): assembled
    (:mod:`.assembly`), run (:class:`.search.StudyRunner`), finished (:mod:`.finish`)."""
    from .assembly import AssemblyFailed, assemble_study, check_definition, lease_shared_study
    from .exit_status import sigterm_received
    from ..tracking.progress import ProgressObserver
    from ..spec.resolve import objectives_of
    from ..study.definition import definition

    voice = _voice()
    defined_as = definition(spec, choice.kind)
    lease = None
    try:
        # the lease first: a second driver is refused before its spec check can set the live study aside
        lease = lease_shared_study(spec, directory, voice)
        check_definition(spec, spec_path, directory, defined_as, fresh_study, voice)
        _remember_spec(spec_path, directory)
        study = assemble_study(
            spec,
            directory,
            choice,
            defined_as,
            voice,
            observer=lambda: ProgressObserver(err, objectives_of(spec), quiet=as_json),
            no_tracking=no_tracking,
            reuse_cache=reuse_cache,
            stop_requested=sigterm_received,
        )
        outcome = _run_study(study.runner)
        _finish_run(study.spec, directory, choice, outcome, study.runner, as_json)
    except AssemblyFailed as exc:  # said already, where it failed
        raise typer.Exit(EXIT_INFRA if exc.infrastructure else EXIT_INPUT) from None
    finally:
        if lease is not None:
            lease.release()


def _run_study(runner: Any) -> Any:
    """Probe and record the study (its run directory locked, its lease held): its outcome."""
    from ..study.plan import Unplaceable
    from ..study.storage import StorageDamaged

    status = "FAILED"
    try:
        with runner.observer:
            outcome = runner.run()
        status = "FINISHED"
    except KeyboardInterrupt as exc:
        _warn(f"{_interrupted_words(exc)}: the study is saved; run the same command to resume")
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
    return outcome


def _close_tracking(runner: Any, status: str) -> None:
    """Close the MLflow parent run and say what the user must know (writes MLflow refused)."""
    if runner.tracking is not None:
        for warning in runner.tracking.close(status):
            _warn(warning)


def _finish_run(spec: Spec, directory: Path, choice: Any, outcome: Any, runner: Any, as_json: bool) -> None:
    """Write the study's files (:func:`.finish.finish_study`), then print what :func:`.finish.advise`
    says: the JSON object, or the status line and the tables; the next steps; the exit code."""
    from .output import print_run_end
    from ..finish.study_end import advise, finish_run

    finished = finish_run(spec, directory, outcome, runner.listeners, runner.tracking, _voice())
    advice = advise(spec, directory, choice, outcome, finished, runner.tracking)
    print_run_end(spec, choice, outcome, finished, advice, as_json)
    if advice.infra_failure:
        _error(f"the infrastructure failed: {advice.infra_failure}")
        raise typer.Exit(EXIT_INFRA)
    if not advice.succeeded:
        raise typer.Exit(EXIT_NO_RESULT)


# ---------------------------------------------------------------------------------------- scale
@app.command(cls=_Command)
def scale(
    run_path: Path = typer.Argument(..., help="run directory of `autotune run` (or its spec)", show_default=False),
    nodes: Optional[str] = typer.Option(
        None, "--nodes", help="node counts, e.g. 1,2,4 (each with the spec's devices per node; needs Ray)"
    ),
    devices: Optional[str] = typer.Option(None, "--devices", help="device counts within one node, e.g. 1,2,4,8"),
    mode: str = typer.Option(
        "weak", "--mode", help="weak (each rank's work fixed) | strong (global batch fixed) | both"
    ),
    top: int = typer.Option(1, "--top", help="configs scaled: the recommended one, then the next best"),
    repeats: int = typer.Option(1, "--repeats", help="readings per config and size (2 or more give intervals)"),
    backend: Optional[str] = typer.Option(
        None, help=f"{' | '.join(_backend_kinds())} (overrides the spec's backend:)", show_default=False
    ),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", help="connect to a Ray cluster ('auto', ray://...)"
    ),
    no_tracking: bool = _flag("--no-tracking", help="log nothing to the study's MLflow parent run"),
    as_json: bool = JsonOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Measure the study's best config at several sizes: scaling efficiency against linear, the
    communication share and the peak memory per size, the model's projection from the smallest
    size beside each measurement; a table, scaling/scaling.json, scaling/scaling.png and the
    study's MLflow parent run. Readings are kept as they come: the same command resumes."""
    _setup_logging(verbose)
    from .scale_command import scale_study

    scale_study(run_path, nodes, devices, mode, top, repeats, backend, ray_address, no_tracking, as_json)


# --------------------------------------------------------------------------------------- report
@app.command(cls=_Command)
def report(
    spec_path: Path = RunOrSpecArg,
    run_dir: Optional[Path] = RunDirOpt,
    as_json: bool = JsonOpt,
    top: int = typer.Option(
        20, "--top", min=1, help="trials shown in the table, best first (failed ones last); the summary covers them all"
    ),
) -> None:
    """Every trial of the study with its status, metrics, config and why it was chosen or failed
    (best first, lines fit 120 columns), then the summary: before/after, the Pareto front,
    importances, probe costs."""
    _setup_logging(False)
    spec, run_dir = _load_run_or_spec(spec_path, run_dir)
    study = _open_existing(spec, run_dir)
    from .assembly import relocate_mlflow

    relocate_mlflow(_run_dir(spec, run_dir), lambda text: _say(err, text, style="dim"))
    from ..finish.report import improvement_line, study_summary
    from ..study.result import StudyResult
    from ..spec.resolve import objectives_of

    objectives = objectives_of(spec)
    result = StudyResult.load(spec, study, objectives)
    records, best, baseline = result.records, result.best, result.baseline
    line = improvement_line(best[0] if best else None, baseline, *objectives[0])
    summary = study_summary(
        study, records, objectives, best, baseline, result.recommendation, result.certificate, result.drift
    )
    from .output import print_report

    print_report(spec, records, best, baseline, line, summary, top, as_json)


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
    from ..finish.exports import default_formats, parse_formats, write_exports

    try:
        chosen_formats = parse_formats(formats) if formats else None
    except ValueError as exc:
        _error(f"--format: {exc}")
        raise typer.Exit(EXIT_INPUT) from None
    spec, run_dir = _load_run_or_spec(spec_path, run_dir)
    if chosen_formats is None:
        chosen_formats = list(default_formats(target_of(spec), spec.workload.kind))
    study = _open_existing(spec, run_dir)
    from ..study.result import StudyResult

    result = StudyResult.load(spec, study)
    if trial is not None:
        chosen = result.record(trial)
        if chosen is None:
            _error(f"--trial {trial}: the study has trials 0..{len(result.records) - 1}")
            raise typer.Exit(EXIT_INPUT)
        if chosen.status not in RAN:  # its launch would walk into what stopped it
            why = f": {chosen.reason}" if chosen.reason else ""
            _error(
                f"--trial {trial} did not run to a result ({chosen.status}{why}); an export launches a "
                "config that ran: choose a trial whose status is ok (`autotune report` lists them)"
            )
            raise typer.Exit(EXIT_INPUT)
    else:
        chosen = result.chosen
        if chosen is None:
            _error("the study has no successful trial to export")
            raise typer.Exit(EXIT_NO_RESULT)
        if result.recommendation is not None and result.recommendation.changed:
            _say(
                err,
                f"exporting the recommended config: {result.recommendation.sentence} (--trial "
                f"{result.best[0].number} exports the best)",
            )
    directory = out_dir or _run_dir(spec, run_dir) / "export"
    from ..export import ExportRefused
    from ..finish.exports import refusals
    from ..finish.study_end import export_context

    context = export_context(spec, chosen, result.certificate)
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
            else f"the study's target is {target_of(spec)}: export its format, or set `target:` in the spec and run "
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
    from ..tracking.mlflow_ui import serve_ui, server_url, study_ui_url

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


def main() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    _install_sigterm()
    try:
        app()
    except SystemExit as exc:  # how every command ends (typer's standalone mode)
        _exit_without_teardown(exc.code)
    except KeyboardInterrupt as exc:  # before the study started (imports, ranking): nothing to save yet
        _warn(_interrupted_words(exc))
        _json_failure(_interrupted_exit(exc))
        sys.exit(_interrupted_exit(exc))
    except Exception as exc:  # a bug: say so in one line, keep the traceback for AUTOTUNE_DEBUG=1
        if os.environ.get("AUTOTUNE_DEBUG"):
            raise
        _error(
            f"internal error: {type(exc).__name__}: {exc} (a bug in autotune; AUTOTUNE_DEBUG=1 shows the "
            "traceback; please report it)"
        )
        _json_failure(EXIT_INTERNAL)
        sys.exit(EXIT_INTERNAL)


if __name__ == "__main__":
    main()
