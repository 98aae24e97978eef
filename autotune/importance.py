"""Parameter importances, computed once per study and read by every output.

The report, the MLflow parent run and the importance plot used to compute them apart (fANOVA
with a fresh random forest each time), so they disagreed (micro-batch 0.85 in one, 0.76 in
another). Now a finished study computes them once and keeps them in its Optuna storage
(``autotune.importances``); every output reads that.

Where the trials are predictions (the simulator backend), 20 trials are 20 of the model's best
bets, on which tp or precision hardly vary; the model prices the whole feasible space, so the
importances are the model's own: for each searched parameter, the share of the predicted
objective's variance over every feasible config that its value alone explains (a first-order
variance share). Where the trials are measured, Optuna's fANOVA over the trials, seeded, so
the same study always gives the same figures.

optuna-dashboard computes its own importances when it opens the study: PED-ANOVA over the trials
(``optuna.importance.PedAnovaImportanceEvaluator()``, its evaluator whenever Optuna has it). They
differ from the figures above by method and, for a simulated study, by population (the trials are
the model's best bets, not a sample of the space). So each study also keeps those figures
(``dashboard``), and the report prints them beside its own with a line that says why they differ.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np

__all__ = [
    "IMPORTANCES_ATTR",
    "model_importances",
    "trial_importances",
    "dashboard_importances",
    "record_importances",
    "study_importances",
    "importance_note",
]

log = logging.getLogger(__name__)
IMPORTANCES_ATTR = "autotune.importances"


def model_importances(ranking: Any, objectives: list[tuple[str, str]]) -> dict[str, dict[str, float]]:
    """First-order variance shares of each searched parameter over the feasible configs of the
    ranking, per objective, normalised to sum to one (largest first)."""
    fits = np.asarray(ranking.predictions.get("fits", []), dtype=bool)
    params = ranking.enumeration.params
    out: dict[str, dict[str, float]] = {}
    if not fits.any() or not params:
        return out
    for metric, _ in objectives:
        y = np.asarray(ranking.predictions[metric], dtype=float)[fits]
        keep = np.isfinite(y)
        y = y[keep]
        total = float(np.var(y))
        if y.size < 2 or total <= 0:
            continue
        shares = {}
        for name, column in params.items():
            values = np.asarray(column)[fits][keep].astype(str)
            groups, inverse = np.unique(values, return_inverse=True)
            if len(groups) < 2:
                continue
            means = np.bincount(inverse, weights=y) / np.bincount(inverse)
            shares[name] = float(np.var(means[inverse]) / total)
        norm = sum(shares.values())
        if norm > 0:
            out[metric] = dict(sorted(((k, v / norm) for k, v in shares.items()), key=lambda kv: -kv[1]))
    return out


def trial_importances(study: Any, objectives: list[tuple[str, str]]) -> dict[str, dict[str, float]]:
    """Optuna's fANOVA importances per objective over the study's trials, seeded (empty for a
    study too small to tell)."""
    import optuna
    from optuna.importance import FanovaImportanceEvaluator

    out: dict[str, dict[str, float]] = {}
    for i, (metric, _) in enumerate(objectives):
        try:
            with warnings.catch_warnings():  # importances do not depend on the direction
                warnings.simplefilter("ignore")
                values = optuna.importance.get_param_importances(
                    study, evaluator=FanovaImportanceEvaluator(seed=0), target=lambda t, i=i: t.values[i]
                )
        except Exception as exc:  # too few completed trials, or a parameter that never varied
            log.info("importances for %s skipped: %s", metric, exc)
            continue
        out[metric] = {k: float(v) for k, v in values.items()}
    return out


def dashboard_importances(study: Any, objectives: list[tuple[str, str]]) -> dict[str, dict[str, float]]:
    """What optuna-dashboard shows for the study: PED-ANOVA with its default settings over the
    completed trials, per objective (empty where it cannot tell: too few trials, or Optuna without
    PED-ANOVA). Milliseconds for the few hundred trials of a study."""
    import optuna

    try:
        from optuna.importance import PedAnovaImportanceEvaluator
    except ImportError:  # pragma: no cover - Optuna < 3.6
        return {}
    out: dict[str, dict[str, float]] = {}
    for i, (metric, _) in enumerate(objectives):
        try:
            with warnings.catch_warnings():  # PED-ANOVA is marked experimental
                warnings.simplefilter("ignore")
                values = optuna.importance.get_param_importances(
                    study, evaluator=PedAnovaImportanceEvaluator(), target=lambda t, i=i: t.values[i]
                )
        except Exception as exc:
            log.info("dashboard importances for %s skipped: %s", metric, exc)
            continue
        out[metric] = {k: float(v) for k, v in values.items()}
    return out


def _completed(study: Any) -> int:
    return sum(1 for t in study.get_trials(deepcopy=False) if t.values is not None)


def record_importances(study: Any, objectives: list[tuple[str, str]], ranking: Any = None) -> dict[str, Any]:
    """Compute the study's importances once (the model's over the ranking when the trials are
    predictions, else fANOVA over the trials) and keep them in the study's storage."""
    done = _completed(study)
    if ranking is not None:
        n = int(np.asarray(ranking.predictions.get("fits", []), dtype=bool).sum())
        entry = {
            "values": model_importances(ranking, objectives),
            "source": f"the model over all {n:,} feasible configs",
            "kind": "model",
            "configs": n,
        }
    else:
        entry = {
            "values": trial_importances(study, objectives),
            "source": f"fANOVA over {done} trials",
            "kind": "fanova",
        }
    entry["trials"] = done
    entry["dashboard"] = dashboard_importances(study, objectives)
    study.set_user_attr(IMPORTANCES_ATTR, entry)
    return entry


def study_importances(study: Any, objectives: list[tuple[str, str]]) -> dict[str, Any]:
    """The importances the study recorded; for a study that has none yet (still running, or
    from an older autotune), fANOVA over its trials, not stored."""
    stored = study.user_attrs.get(IMPORTANCES_ATTR)
    if isinstance(stored, dict) and isinstance(stored.get("values"), dict):
        return stored
    done = _completed(study)
    return {
        "values": trial_importances(study, objectives),
        "source": f"fANOVA over {done} trials",
        "kind": "fanova",
        "trials": done,
        "dashboard": dashboard_importances(study, objectives),
    }


def importance_note(entry: dict[str, Any]) -> str:
    """One sentence: which importances the report shows, and why optuna-dashboard's differ."""
    done = entry.get("trials")
    trials = f"the {done} trials" if isinstance(done, int) else "the trials"
    kind = entry.get("kind") or ("model" if str(entry.get("source", "")).startswith("the model") else "fanova")
    if kind == "model":
        n = entry.get("configs")
        configs = f"{n:,} feasible configs" if isinstance(n, int) else "every feasible config"
        return (
            f"importance: the model's first-order variance share over {configs}; optuna-dashboard shows "
            f"PED-ANOVA over {trials}, which are the model's best bets (not a sample of the space), so its "
            "figures differ"
        )
    return (
        f"importance: fANOVA over {trials} (seeded); optuna-dashboard shows PED-ANOVA over the same trials, "
        "another method, so its figures differ"
    )
