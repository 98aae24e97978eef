"""What the commands read: a spec (its errors said, exit 2), or the spec a run directory of
``autotune run`` keeps; the study's run directory and the study in it; the options that override
the spec's search section; and whether the spec's space holds any valid config.

Apart from :mod:`autotune.cli.commands` because several commands read their input the same way (``report``
and ``export`` take a run directory or a spec; ``run`` keeps the spec with its study so that they
can): one place says what a run directory holds. Each function says what is wrong and exits with
the documented code (:mod:`autotune.cli.exit_status`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from .console import error, warn
from .exit_status import EXIT_INFRA, EXIT_INPUT
from ..spec.secret_env import SPEC_COPY
from ..spec.schema import Spec
from ..spec.errors import SpecError, escape_text
from ..spec.load import load_spec

__all__ = [
    "SPEC_LOCATION",
    "load",
    "load_run_or_spec",
    "open_existing",
    "refuse_empty",
    "remember_spec",
    "run_dir_of",
    "why_empty",
    "with_overrides",
]


def load(spec_path: Path) -> Spec:
    try:
        return load_spec(spec_path)
    except SpecError as exc:
        for problem in exc.problems:
            error(problem.render(exc.file))
        raise typer.Exit(EXIT_INPUT) from None


def run_dir_of(spec: Spec, run_dir: Optional[Path]) -> Path:
    return (run_dir or Path("autotune_runs") / spec.name).resolve()


SPEC_LOCATION = "autotune_spec.path"  # where the spec a run directory keeps (SPEC_COPY) came from


def remember_spec(spec_path: Path, directory: Path) -> None:
    """Keep the spec with its study, so ``report``/``export`` can be given the run directory
    (its secrets masked: :mod:`autotune.spec.secret_env`)."""
    from ..spec.secret_env import write_spec_copy

    try:
        write_spec_copy(spec_path, directory)
        (directory / SPEC_LOCATION).write_text(str(Path(spec_path).resolve()) + "\n")
    except OSError as exc:
        warn(f"could not keep a copy of the spec in {directory}: {exc}")


def load_run_or_spec(path: Path, run_dir: Optional[Path]) -> tuple[Spec, Optional[Path]]:
    """A spec file, or a run directory written by ``autotune run`` (its spec is used: the
    original file when it is still there, so relative paths in it resolve, else the copy)."""
    if not path.is_dir():
        return load(path), run_dir
    original = path / SPEC_LOCATION
    candidates = []
    if original.exists():
        candidates.append(Path(original.read_text().strip()))
    candidates.append(path / SPEC_COPY)
    for candidate in candidates:
        if candidate.is_file():
            return load(candidate), run_dir or path
    error(f"{path}: a directory, but not a run directory of `autotune run` (no {SPEC_COPY})")
    raise typer.Exit(EXIT_INPUT)


# the search section's fields that ``run``'s options override, and the options' names
OVERRIDE_OPTIONS = {"n_trials": "--n-trials", "parallel_trials": "--parallel", "seed": "--seed"}


def with_overrides(spec: Spec, spec_path: Path, **changes: Any) -> Spec:
    """The spec with ``run``'s options in its search section, checked as the spec's own values are:
    a bad one is said as the option (``--n-trials: expected > 0, got 0``); one the spec's other
    fields refuse with it (a ``search.confirm_budget`` above ``--n-trials``) names both."""
    from pydantic import ValidationError

    from ..spec.schema import SearchSpec

    given = {k: v for k, v in changes.items() if v is not None}
    search = spec.search.model_copy(update=given)
    try:
        search = SearchSpec.model_validate(search.model_dump())
    except ValidationError as exc:
        for problem in exc.errors():
            field = str(problem["loc"][0]) if problem.get("loc") else ""
            message = str(problem.get("msg", "")).removeprefix("Value error, ")
            if field in given:
                error(f"{OVERRIDE_OPTIONS.get(field, field)}: {message} (got {given[field]!r})")
            else:
                options = ", ".join(f"{OVERRIDE_OPTIONS.get(k, k)} {v}" for k, v in given.items())
                where = f"search.{field}" if field else "search"
                error(f"{escape_text(str(spec_path))}: {where} with {options}: {message}")
        raise typer.Exit(EXIT_INPUT) from None
    return spec.model_copy(update={"search": search})


def why_empty(spec: Spec) -> Optional[str]:
    """Why the spec's space holds no valid config, as ``constraints: ...`` (None when it holds one,
    or is above search.exhaustive_limit: then the sampler explores it and says what it rejected),
    or ``search.exhaustive_limit: ...`` when ranking a space that size could not fit in memory."""
    from ..spec.space import Space, SpaceTooLarge

    try:
        empty = Space(spec).why_empty(limit=spec.search.exhaustive_limit)
    except SpaceTooLarge as exc:
        return f"search.exhaustive_limit: {exc}"
    except ValueError:
        return None
    return f"constraints: {empty}" if empty else None


def refuse_empty(spec: Spec, spec_path: Path) -> None:
    empty = why_empty(spec)
    if empty:
        error(f"{escape_text(str(spec_path))}: {empty}")
        raise typer.Exit(EXIT_INPUT)


def open_existing(spec: Spec, run_dir: Optional[Path]) -> Any:
    from ..study.storage import StorageDamaged, open_study

    directory = run_dir_of(spec, run_dir)
    if not spec.tracking.storage and not (directory / "optuna.journal").exists():
        error(f"no study in {directory}; run `autotune run` first (or pass --run-dir)")
        raise typer.Exit(EXIT_INPUT)
    try:
        return open_study(spec, directory, create=False)
    except StorageDamaged as exc:
        error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None
    except KeyError:
        error(f"the storage holds no study named {spec.name!r}")
        raise typer.Exit(EXIT_INPUT) from None
