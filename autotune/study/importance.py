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

optuna-dashboard computes its own importances when it opens the study, by its own method over the
trials it holds. A recomputation here did not reproduce what the dashboard showed for the same
journal, so no figure is attributed to it: the outputs print autotune's, with a line that says how
they were computed and that the dashboard's are not these.
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
            f"importance: the model's first-order variance share over {configs}, computed by autotune; "
            f"optuna-dashboard computes its own when it opens the study, over {trials}, which are the model's "
            "best bets (not a sample of the space): its figures are not these"
        )
    return (
        f"importance: fANOVA over {trials} (seeded), computed by autotune; optuna-dashboard computes its own "
        "when it opens the study, by another method: its figures are not these"
    )
