"""A serving engine's steps measured on this host for the serving model (issue 46).

``autotune calibrate --serving SPEC --out FILE`` runs the spec's engine through the study's own
backend, dispatcher and launcher (:mod:`autotune.cli.assembly`), three probes per prompt length
(:func:`autotune.workers.calibrate_serving.calibration_prompts`) in rounds, each a short warm-up, one
short rate at the ladder's lowest rung (the probe's protocol asks for one) and the closed-loop
batches that the fit reads (the median of the rounds). One config is measured: the spec's own values, with the largest
``max_num_seqs`` and token budget the space offers so that every batch is admitted at once
(``--set name=value`` picks others). The fit (:func:`~autotune.workers.calibrate_serving.fit_serving_steps`)
is against the model on the profile the study would rank with, so the profile written is that
one plus ``serving_steps``. The probes run one at a time: two engines on one host would each
measure the other's load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..spec.schema import Spec

__all__ = [
    "CALIBRATION_DURATION_S",
    "DEFAULT_REPEATS",
    "READINGS",
    "CalibrationInputError",
    "CalibrationFailed",
    "ServingCalibration",
    "calibration_config",
    "calibration_spec",
    "calibrate_serving",
    "check_calibratable",
    "read_readings",
    "refit_serving",
]

READINGS = "readings.jsonl"  # every calibration probe's whole result, one line each, written as it comes
DEFAULT_REPEATS = 3  # probes per prompt length: the median of three outvotes one slow spell of a shared host
CALIBRATION_DURATION_S = 2.0  # the one open-loop rate the probe's protocol runs: short, not read by the fit
_WIDEST = ("max_num_seqs", "max_num_batched_tokens")


class CalibrationInputError(ValueError):
    """The spec cannot be calibrated as given (no serving spec, no engine here, a bad --set)."""


class CalibrationFailed(RuntimeError):
    """The engine's probes gave too few readings to fit (their reasons said)."""


@dataclass
class ServingCalibration:
    """What ``calibrate --serving`` measured and fitted."""

    engine: str
    config: dict[str, Any]
    steps: dict[str, Any]  # the profile's serving_steps
    hardware: dict[str, Any]  # the profile the fit is against, serving_steps added
    failures: list[str] = field(default_factory=list)  # a prompt length whose probe failed, and why


def calibration_config(spec: Spec, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The config measured: each searched parameter's first value (the widest for the batch
    limits), ``settings`` over them, resolved as a trial's. ``ValueError`` names a parameter the
    space does not have or a config its rules refuse."""
    from ..spec.space import Space

    space = Space(spec)
    unknown = sorted(set(settings) - set(space.choices) - set(space.defaults))
    if unknown:
        raise CalibrationInputError(
            f"--set {', '.join(unknown)}: not a parameter of this serving space; "
            f"expected one of {', '.join(sorted(set(space.choices) | set(space.defaults)))}"
        )
    params = {k: (max(v) if k in _WIDEST else v[0]) for k, v in space.choices.items()}
    params.update(settings)
    resolved = space.resolve(params)
    if not resolved.valid:
        raise CalibrationInputError(
            f"the calibration config {params} breaks the space's rules: {'; '.join(resolved.violations)}"
        )
    return resolved.config


def calibration_spec(spec: Spec, prompt_len: int, batches: list[int]) -> Spec:
    """``spec`` with a workload of one prompt length: the traffic's mean output, its lowest rate for
    :data:`CALIBRATION_DURATION_S`, the closed-loop ``batches``, and the engine's context kept at the
    study's (or longer where this prompt needs it)."""
    from ..spec.workload_section import TrafficSpec

    w = spec.workload
    out_len = _output_len(spec)
    longest = sum(w.traffic.longest())
    traffic = TrafficSpec.model_validate(
        {
            "rates": [min(w.traffic.rates)],
            "prompt_len": int(prompt_len),
            "output_len": out_len,
            "duration_s": CALIBRATION_DURATION_S,
            "warmup_requests": w.traffic.warmup_requests,
            "seed": w.traffic.seed,
        }
    )
    context = max(int(w.max_model_len or longest), int(prompt_len) + out_len)
    workload = w.model_copy(update={"traffic": traffic, "batch_sweep": batches, "max_model_len": context})
    return spec.model_copy(update={"workload": workload})


def check_calibratable(spec: Spec, choice: Any) -> None:
    """:class:`CalibrationInputError` unless ``spec`` serves and ``choice`` (its backend) runs a real engine."""
    if spec.workload.kind != "serve":
        raise CalibrationInputError(
            f"calibrate --serving measures a serving engine; this spec's workload is {spec.workload.kind!r}"
        )
    if choice.simulated:
        raise CalibrationInputError(
            "calibrate --serving measures the spec's engine, and its backend runs the simulator here "
            f"({choice.reason}); "
            "install the engine (the README's install command makes .venv-vllm) or name its backend"
        )


def calibrate_serving(
    spec: Spec,
    choice: Any,
    dispatcher: Any,
    settings: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] = lambda _: None,
    keep: Path | None = None,
    repeats: int = DEFAULT_REPEATS,
) -> ServingCalibration:
    """Each prompt length probed ``repeats`` times through ``dispatcher`` (``choice``: the backend),
    in rounds (every length once, then again) so that a slow spell of the host falls on one round
    rather than on one length, then the fit (each figure the median of its repeats); with ``keep``,
    each probe's whole result (its per-request records too) appended to ``keep/readings.jsonl`` as
    it comes back.
    :class:`CalibrationInputError` when the spec is no serving spec or runs on the simulator;
    :class:`CalibrationFailed` when too few readings came back."""
    from autotune.workers.calibrate_serving import ServingRun, calibration_batches, calibration_prompts

    from ..dispatch.backends import launch_for
    from ..spec.resolve import probe_context, request_settings

    check_calibratable(spec, choice)
    if repeats < 1:
        raise CalibrationInputError(f"--repeats: expected at least 1 probe per prompt length, got {repeats}")
    config = calibration_config(spec, dict(settings or {}))
    batches = calibration_batches(int(config.get("max_num_seqs") or 1))
    prompt, output = spec.workload.traffic.mean()
    runs: list[ServingRun] = []
    failures: list[str] = []
    engine = spec.backend.kind
    lengths = calibration_prompts(prompt, max(int(round(output)), 2), spec.workload.max_model_len)
    probes = [(repeat, length) for repeat in range(repeats) for length in lengths]
    for number, (repeat, length) in enumerate(probes):
        progress(
            f"prompt {length} tokens, round {repeat + 1} of {repeats} (probe {number + 1} of {len(probes)}): "
            f"batches {', '.join(map(str, batches))}"
        )
        sized = calibration_spec(spec, length, batches)
        sized_context = probe_context(sized)
        request = request_settings(sized, sized_context).request(dict(config), number)
        result = dispatcher.result_of(dispatcher.submit(request, launch_for(sized, choice, request)))
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            with (keep / READINGS).open("a") as f:
                line = {
                    "prompt_len": length,
                    "repeat": repeat,
                    "output_len": _output_len(spec),
                    "config": config,
                    **result.to_json(),
                }
                f.write(json.dumps(line, default=str) + "\n")
        if result.status != "ok":
            failures.append(f"prompt {length}, round {repeat + 1}: {result.status}: {result.reason}")
            continue
        engine = str(((result.info or {}).get("serving") or {}).get("engine") or engine)
        runs.append(ServingRun(length, sized_context.workload, dict(result.metrics)))
    return _fitted(spec, config, runs, failures, engine)


def _with_apart_shares(measured: dict[str, Any], record: Mapping[str, Any]) -> dict[str, Any]:
    """A kept reading's metrics with each batch's ``tokens_apart_share`` read from its requests where
    the probe that measured it did not report it (readings kept before 2026-12-01): the refit then
    leaves out the batches a calibration run today would."""
    from autotune.objectives import serving

    text = ((record.get("info") or {}).get("serving") or {}).get("requests_jsonl")
    if not isinstance(text, str):
        return measured
    for batch, requests in serving.records_by(text.splitlines(), "batch", "batch").items():
        share = serving.batch_summary(requests, batch).get("tokens_apart_share")
        if share is not None:
            measured.setdefault(f"batch{batch}_tokens_apart_share", share)
    return measured


def read_readings(spec: Any, readings: Path) -> tuple[Path, list[str]]:
    """The readings file a refit reads (``readings``: it, or the folder that holds it) and its lines;
    :class:`CalibrationInputError` for a spec that does not serve or a file that cannot be read.
    The command line calls it first, so a wrong path is said before the host is calibrated."""
    if spec.workload.kind != "serve":
        raise CalibrationInputError(
            f"calibrate --serving refits a serving engine's readings; this spec's workload is {spec.workload.kind!r}"
        )
    path = readings / READINGS if readings.is_dir() else readings
    try:
        return path, path.read_text().splitlines()
    except OSError as exc:
        raise CalibrationInputError(
            f"{path}: cannot read the calibration readings ({exc.strerror or exc}); expected the "
            f"{READINGS} a `calibrate --serving` run kept in its <out>.serving-calibration folder"
        ) from None


def refit_serving(spec: Spec, readings: Path) -> ServingCalibration:
    """The fit again, on the readings an earlier ``calibrate --serving`` kept (``readings``: its
    ``readings.jsonl``, or the folder holding it), against the model as it is now and the profile
    ``spec`` ranks with: the engine is not run again, so a corrected model (or profile) is refitted
    from what was measured. Readings of one prompt length more than once (the rounds of one run, or
    two runs' files put together) are pooled as the run's rounds are: each figure their median.
    :class:`CalibrationInputError` names the file and line of a reading that cannot be read, or
    readings of more than one config."""
    from autotune.workers.calibrate_serving import ServingRun, calibration_batches

    from ..spec.resolve import probe_context

    path, lines = read_readings(spec, readings)
    config: dict[str, Any] | None = None
    runs: list[Any] = []
    failures: list[str] = []
    engine = spec.backend.kind
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
            length = int(record["prompt_len"])
            measured = dict(record.get("metrics") or {})
            status = str(record["status"])
            this_config = dict(record["config"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CalibrationInputError(
                f"{where}: not a calibration reading ({type(exc).__name__}: {exc}); expected a JSON object "
                "with prompt_len, config, status and metrics"
            ) from None
        if config is None:
            config = this_config
        elif this_config != config:
            raise CalibrationInputError(
                f"{where}: a reading of another config ({json.dumps(this_config, sort_keys=True)}, the first was "
                f"{json.dumps(config, sort_keys=True)}); one fit reads one config's readings"
            )
        measured_output = record.get("output_len")  # readings kept before it was recorded have none
        if measured_output is not None and int(measured_output) != _output_len(spec):
            raise CalibrationInputError(
                f"{where}: measured with outputs of {int(measured_output)} tokens, the spec's traffic has "
                f"{_output_len(spec)}: refit with the spec that was calibrated (the fit prices each batch at its "
                "output length)"
            )
        if status != "ok":
            failures.append(f"prompt {length}: {status}: {record.get('reason') or ''}")
            continue
        engine = str((((record.get("info") or {}).get("serving") or {}).get("engine")) or engine)
        batches = calibration_batches(int(config.get("max_num_seqs") or 1))
        sized = calibration_spec(spec, length, batches)
        runs.append(ServingRun(length, probe_context(sized).workload, _with_apart_shares(measured, record)))
    if config is None:
        raise CalibrationInputError(f"{path}: no readings in it (an empty file)")
    return _fitted(spec, config, runs, failures, engine)


def _output_len(spec: Spec) -> int:
    """The output length every calibration probe of ``spec`` asks for (:func:`calibration_spec`)."""
    return max(int(round(spec.workload.traffic.mean()[1])), 2)


def _fitted(
    spec: Spec, config: dict[str, Any], runs: list[Any], failures: list[str], engine: str
) -> ServingCalibration:
    """The fit of ``runs`` against the model on the profile ``spec`` ranks with."""
    from autotune.workers.calibrate_serving import fit_serving_steps

    from ..spec.resolve import probe_context

    if not runs:
        raise CalibrationFailed("no calibration probe came back: " + "; ".join(failures))
    context = probe_context(spec)
    try:
        steps = fit_serving_steps(runs, context.model, context.hardware, context.cluster, config, engine)
    except ValueError as exc:  # too few readings
        raise CalibrationFailed("; ".join([str(exc), *failures])) from None
    return ServingCalibration(engine, config, steps, {**context.hardware, "serving_steps": steps}, failures)
