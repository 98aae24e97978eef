"""The guide's settings made from a spec: the one place the guide's knobs are read from ``search:``.

Apart from :mod:`.guided` and :mod:`.sampler`, which take :class:`~.guided.GuideSettings` and never
the spec (issue 43, narrow settings): the assembly (:func:`autotune.cli.assembly.loop_settings`) and
:meth:`~.sampler.GuidedSampler.from_spec`, the spec-facing edges, call this.
"""

from __future__ import annotations

from ..spec.context import ProbeContext
from ..spec.resolve import probe_context
from ..spec.schema import Spec
from .guided import GuideSettings

__all__ = ["guide_settings"]


def guide_settings(spec: Spec, context: ProbeContext | None = None) -> GuideSettings:
    """The guide's knobs from the spec's ``search:`` section (the same names), and what the device
    check found usable on a device (``context``'s hardware)."""
    sp = spec.search
    hardware = (context if context is not None else probe_context(spec)).hardware
    return GuideSettings(
        explore_kappa=sp.explore_kappa,
        fit_confidence=sp.fit_confidence,
        stop_early=sp.stop_early,
        min_fit_probability=sp.min_fit_probability,
        max_oom_share=sp.max_oom_share,
        max_doubt_probes=sp.max_doubt_probes,
        tie_tolerance=sp.tie_tolerance,
        max_readings=sp.max_readings,
        confidence=sp.confidence,
        confirm_readings=sp.confirm_readings(),
        drift_every=sp.drift_checks_every(),
        device_usable_gib=hardware.get("usable_memory_gib"),
    )
