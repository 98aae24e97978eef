"""The study's objectives, resolved once: the one piece every narrow settings object carries.

Issue 43 ("narrow settings, not the whole spec"): the loop (:class:`autotune.study.search.LoopSettings`),
the guide (:class:`autotune.guide.guided.GuideSettings`), the dispatcher
(:class:`autotune.dispatch.dispatcher.DispatchSettings`), the pruner (:class:`autotune.study.pruning.PruneSettings`)
and the probes' request builder (:class:`autotune.spec.context.RequestSettings`) each take a small frozen
object made once from the spec by the assembly (:mod:`autotune.cli.assembly`, through
:mod:`autotune.spec.resolve`), and each type lives in the module that uses it. Only the
objectives are shared by several of them (the loop, the trials, the resolver, the pruner, the
ranking and the outputs all read the same (metric, direction) pairs), so their type lives here, in
a leaf that imports no spec: the metrics' default directions are read from :mod:`autotune.objectives`
once, when :func:`resolve_objectives` is called, never again per trial.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

__all__ = ["DEFAULT_OBJECTIVE", "Objective", "Objectives", "resolve_objectives"]

# the metric a spec without ``objectives:`` optimises, per workload kind
DEFAULT_OBJECTIVE = {
    "train": "tokens_per_s_per_device",
    "infer": "decode_tokens_per_s_per_device",
    "serve": "goodput_rps_per_device",
}


class Objective(NamedTuple):
    """One objective, its direction resolved (a pair: ``metric, direction = objective`` reads it)."""

    metric: str  # the metric's name in autotune.objectives: what probes and the simulator report
    direction: str  # "maximize" or "minimize": the spec's, else the metric's own default


Objectives = tuple[Objective, ...]  # the study's objectives in the spec's order: the first guides and sorts


def resolve_objectives(declared: Iterable[Any], workload_kind: str) -> Objectives:
    """The objectives a spec declares (items with ``metric`` and ``direction``, the spec's
    ``objectives:`` section), or the workload's default metric, each with its direction."""
    from autotune.objectives import get_metric

    items = [(o.metric, o.direction) for o in declared] or [(DEFAULT_OBJECTIVE[workload_kind], None)]
    return tuple(Objective(metric, direction or get_metric(metric).direction) for metric, direction in items)
