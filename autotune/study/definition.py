"""What defines a study, kept with it, so a re-run of an edited spec is never taken for a resume.

A run directory (or a shared Optuna storage) holds one study under the spec's ``name``. Running
the same command again resumes it: more budget, a killed run finished. But a user who edits the
spec (drops ``fp16`` from ``space.precision``, changes the model or the objectives) and runs again
would otherwise get the old study back: its best config and exports, now disagreeing with the spec
copy beside them, and Optuna's raw "CategoricalDistribution does not support dynamic value space"
once a new trial is asked for. So the sections that decide what a trial is and how it is judged
(:data:`DEFINING`) are stored on the study (a study user attribute, Optuna's public API) when it is
created, and compared before anything is probed: a difference stops the run (exit 2) with the
fields that changed and the two ways on (a new ``--run-dir``, or ``--fresh-study`` which sets the
old study aside in the same storage and starts anew; nothing measured is deleted).

Not defining: the budget and the rest of ``search`` (a larger ``n_trials`` is a continuation),
``recommend``, ``tracking``, ``ray``, ``baseline``, the description and the probe timeouts
(``workload.timeout_s``, ``backend.timeout_s``: raising one after a timeout is how a study goes
on). Secret ``backend.env`` values are stored masked, as in every other copy.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import optuna

from ..spec.secret_env import SPEC_COPY, masked_backend
from ..spec.schema import Spec
from ..stacks import target_of

__all__ = [
    "StudyRedefined",
    "redefinition",
    "DEFINING",
    "DEFINITION_ATTR",
    "definition",
    "changed_fields",
    "stored_definition",
    "record_definition",
    "set_aside",
]

DEFINITION_ATTR = "autotune.definition"
DEFINING = ("model", "workload", "cluster", "space", "constraints", "objectives", "target", "backend")
_NOT_DEFINING = {"workload": ("timeout_s",), "backend": ("timeout_s",)}


def definition(spec: Spec, backend_kind: str) -> dict[str, Any]:
    """The defining sections of ``spec`` as plain JSON values; ``backend_kind`` is the backend the
    run resolved (``auto`` becomes simulate or a real kind: a simulated study is not a measured one)."""
    dumped = spec.model_dump(mode="json")
    out: dict[str, Any] = {}
    for section in DEFINING:
        value = dumped.get(section)
        if section == "backend":
            value = masked_backend(value)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in _NOT_DEFINING.get(section, ())}
        out[section] = value
    out["target"] = target_of(spec)
    out["backend"] = {**(out.get("backend") or {}), "resolved": backend_kind}
    return json.loads(json.dumps(out, sort_keys=True))


def changed_fields(before: dict[str, Any], after: dict[str, Any], limit: int = 8) -> list[str]:
    """``path: old -> new`` for each leaf that differs (at most ``limit``, then a count)."""
    lines: list[str] = []

    def walk(path: str, a: Any, b: Any) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(f"{path}.{key}" if path else str(key), a.get(key, _ABSENT), b.get(key, _ABSENT))
        elif a != b:
            lines.append(f"{path}: {_short(a)} -> {_short(b)}")

    walk("", before, after)
    if len(lines) > limit:
        return lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, _Absent) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def stored_definition(study: optuna.Study) -> dict[str, Any] | None:
    """The definition a study was created with (None for a study made before definitions were
    kept: it gets the current one, as nothing else says what it was)."""
    stored = study.user_attrs.get(DEFINITION_ATTR)
    return stored if isinstance(stored, dict) else None


def record_definition(study: optuna.Study, value: dict[str, Any]) -> None:
    """Keep ``value`` on a study that has none yet (a new study, or one made before this was kept)."""
    if DEFINITION_ATTR not in study.user_attrs:
        study.set_user_attr(DEFINITION_ATTR, value)


def set_aside(study_name: str, storage: Any, run_dir: Path) -> str:
    """Move a study out of the way of a fresh one with the same name: it is copied, trials and
    attributes, to ``NAME.superseded-<UTC time>`` in the same storage (``optuna.copy_study``) and
    then removed under its own name; the run directory's per-trial folders, exports and spec copy
    move to ``superseded-<UTC time>/``. Nothing measured is deleted. Returns the new study name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = f"{study_name}.superseded-{stamp}"
    optuna.copy_study(from_study_name=study_name, from_storage=storage, to_storage=storage, to_study_name=aside)
    optuna.delete_study(study_name=study_name, storage=storage)
    folder = run_dir / f"superseded-{stamp}"
    for name in ("trials", "export", "ranking.csv", "summary.md", SPEC_COPY, "plots"):
        path = run_dir / name
        if path.exists():
            folder.mkdir(exist_ok=True)
            path.rename(folder / name)
    return aside


class StudyRedefined(ValueError):
    """The spec changed what defines the study kept in the run directory (the CLI: exit 2)."""

    def __init__(self, trials: int, changes: list[str]):
        super().__init__(f"the spec changed what defines the study ({trials} trial(s) measured under the old one)")
        self.trials, self.changes = trials, changes


def redefinition(spec: Spec, run_dir: Path, defined_as: dict[str, Any], fresh: bool) -> tuple[str, list[str]] | None:
    """Check a re-run against the study it would resume. None: a new study, or the same definition.
    A changed one raises :class:`StudyRedefined` with the changed fields; with ``fresh`` the old
    study is set aside instead, and ``(its new name, the changes)`` returned. Raises
    :class:`~autotune.study.storage.StorageDamaged` for a storage that cannot be read."""
    from .storage import journal_path, open_study, study_storage

    path = journal_path(spec, run_dir)
    if path is not None and not path.exists():
        return None  # a new study
    try:
        study = open_study(spec, run_dir, create=False)
    except KeyError:
        return None  # no study of this name in the storage yet
    before = stored_definition(study)
    if before is None or before == defined_as or not study.get_trials(deepcopy=False):
        return None
    changes = changed_fields(before, defined_as)
    if not fresh:
        raise StudyRedefined(len(study.trials), changes)
    return set_aside(spec.name, study_storage(spec, run_dir), run_dir), changes
