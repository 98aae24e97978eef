"""``autotune calibrate --serving SPEC --out FILE``: a serving engine's steps measured on this host (issue 46).

Apart from :mod:`autotune.cli.commands` (which declares the command and its options) because it
wires more than one stage: the spec (:mod:`autotune.cli.input`), the backend, profile and
dispatcher a study of it would use (:mod:`autotune.cli.assembly`), the measurement and fit
(:mod:`autotune.study.serving_calibration`), and the profile file it writes. Exit codes are the
command line's: 2 for input that cannot be calibrated (no serving spec, a backend that runs the
simulator, a ``--set`` the space does not have), 3 when the engine's probes gave too few readings
or Ray does not answer.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.table import Table
from rich.text import Text

from .console import err, error, out, voice
from .exit_status import EXIT_INFRA, EXIT_INPUT
from .input import load
from ..spec.errors import escape_text

__all__ = ["calibrate_serving_engine", "parse_settings", "write_serving_profile"]

# the median point's spread between rounds above which the command says the host was busy
NOISY_REPEAT_SPREAD = 0.15


def parse_settings(items: list[str]) -> dict[str, Any]:
    """``--set name=value`` pairs, values read as YAML scalars (``8``, ``true``, ``eager``)."""
    settings: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            error(f"--set: expected name=value, got {item!r}")
            raise typer.Exit(EXIT_INPUT)
        try:
            settings[name.strip()] = yaml.safe_load(text)
        except yaml.YAMLError:
            settings[name.strip()] = text
    return settings


def write_serving_profile(
    hardware: dict[str, Any], path: Path, spec_path: Path, config: dict[str, Any], readings: Path | None = None
) -> Path:
    """The profile (checked as a whole first) as YAML, what was measured in its header."""
    from autotune.workers.hardware import validate_profile

    profile = validate_profile(hardware, str(path))
    steps = profile["serving_steps"]
    refit = f" --readings {readings}" if readings is not None else ""
    measured = f"refitted from the readings in {readings}" if readings is not None else "measured on this host"
    rounds = int(steps.get("repeats") or 1)
    each = f", each the median of up to {rounds} rounds" if rounds > 1 else ", each a single reading"
    header = [
        f"# Hardware profile written by `autotune calibrate --serving {spec_path}{refit}` on "
        f"{_dt.datetime.now().isoformat(timespec='seconds')}.",
        f"# serving_steps: {steps['engine']} {measured} at {len(steps['points'])} closed-loop points{each} "
        f"(config {json.dumps(config, sort_keys=True)});",
        "# the serving model's step: decode_scale * its decode part + prefill_scale * its prompt part + step_overhead",
        "# + decoding sequences * (sequence_overhead + context * context_overhead)",
        "# + prompt tokens * prompt_token_overhead; a TTFT adds request_latency.",
        "# Every other figure is the profile the study ranks with (unchanged).",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(profile, sort_keys=False))
    return path


def calibrate_serving_engine(
    spec_path: Path,
    out_path: Path,
    settings: dict[str, Any],
    as_json: bool,
    readings: Path | None = None,
    repeats: int | None = None,
) -> None:
    """Measure (or, with ``readings``, refit) and write the profile; ``repeats``: rounds per prompt
    length, None for the calibration's default (:data:`~autotune.study.serving_calibration.DEFAULT_REPEATS`)."""
    from autotune.workers.calibrate_serving import describe_steps

    from ..dispatch.backends import select_backend
    from ..study.serving_calibration import (
        DEFAULT_REPEATS,
        CalibrationFailed,
        CalibrationInputError,
        calibrate_serving,
        check_calibratable,
        read_readings,
        refit_serving,
    )
    from ..tracking.progress import phase
    from .assembly import AssemblyFailed, dispatcher_for, measured_profile

    spec = load(spec_path)
    try:
        choice = select_backend(spec)
    except ValueError as exc:
        error(str(exc))
        raise typer.Exit(EXIT_INPUT) from None
    err.print(Text.assemble(("backend: ", "bold"), escape_text(f"{choice.kind} — {choice.reason}")))
    try:
        if readings is None:  # a refit runs no engine, and reads its readings before the host's calibration
            check_calibratable(spec, choice)
        else:
            read_readings(spec, readings)
    except CalibrationInputError as exc:
        error(f"{escape_text(str(spec_path))}: {escape_text(str(exc))}")
        raise typer.Exit(EXIT_INPUT) from None
    try:
        spec = measured_profile(spec, choice, voice())
    except AssemblyFailed as exc:
        raise typer.Exit(EXIT_INFRA if exc.infrastructure else EXIT_INPUT) from None
    logs = out_path.parent / f"{out_path.stem}.serving-calibration"  # the probes' engine logs and requests
    try:
        if readings is not None:
            with phase(err, f"refitting {readings}"):
                result = refit_serving(spec, readings)
        else:
            with dispatcher_for(spec, choice, logs) as dispatcher, phase(err, "measuring the engine") as step:
                result = calibrate_serving(
                    spec,
                    choice,
                    dispatcher,
                    settings,
                    step.update,
                    keep=logs,
                    repeats=DEFAULT_REPEATS if repeats is None else repeats,
                )
    except CalibrationInputError as exc:
        error(f"{escape_text(str(spec_path))}: {escape_text(str(exc))}")
        raise typer.Exit(EXIT_INPUT) from None
    except (CalibrationFailed, ConnectionError) as exc:
        error(f"{escape_text(str(spec_path))}: {escape_text(str(exc))}")
        raise typer.Exit(EXIT_INFRA) from None
    path = write_serving_profile(result.hardware, out_path, spec_path, result.config, readings)
    steps = result.steps
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "path": str(path),
                    "engine": result.engine,
                    "config": result.config,
                    "serving_steps": steps,
                    "failures": result.failures,
                    "logs": str(readings if readings is not None else logs),
                }
            )
        )
        return
    table = Table(title=f"{result.engine} on this host: closed-loop batches, seconds", title_justify="left")
    for column in ("prompt", "batch", "figure", "measured", "readings", "spread", "model", "fitted"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for p in steps["points"]:
        table.add_row(
            str(p["prompt_len"]),
            str(p["batch"]),
            p["figure"].removesuffix("_ms").removesuffix("_s"),  # the table's unit is seconds
            f"{p['measured_s']:.4g}",
            str(p.get("readings", 1)),
            f"{p['spread']:.0%}" if "spread" in p else "-",
            f"{p['model_s']:.4g}",
            f"{p['fitted_s']:.4g}",
        )
    out.print(table)
    out.print(
        f"wrote {escape_text(str(path))}: {describe_steps(steps)}; the fit is within {steps['rms_error']:.0%} (rms) "
        "of the readings"
    )
    spread = steps.get("repeat_spread")
    if spread is not None and spread > NOISY_REPEAT_SPREAD:
        err.print(
            f"[yellow]noisy host[/yellow] the rounds of one figure differ by {spread:.0%} at the median point (highest "
            f"less lowest, over {steps['repeats']} rounds): the fit reads their median, but a host this busy moves a "
            "study's readings as much; calibrate again when it is quiet, or with more --repeats"
        )
    if steps.get("repeat_noise") is not None:
        err.print(
            f"one reading's noise between probes on this host: {steps['repeat_noise']:.1%} "
            f"({int(steps['repeat_noise_dof'])} degrees of freedom); a serving study that ranks with this profile "
            "takes it as its noise until its own repeats measure one"
        )
    for skipped in steps.get("left_out") or ():
        err.print(
            f"[yellow]left out[/yellow] batch {skipped['batch']} at prompt {skipped['prompt_len']}: "
            f"a request had {skipped['tokens_apart_share']:.0%} of its tokens arrive apart from the one before (the "
            "API server fell behind and they arrived piled up: its times are the server's, not the engine's steps)"
        )
    for failure in result.failures:
        err.print(f"[yellow]not measured[/yellow] {escape_text(failure)}")
    err.print(f"\n[bold]next steps[/bold]\n  use it in the spec:  cluster: {{profile: {escape_text(str(path))}}}")
