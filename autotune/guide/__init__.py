"""The model-guided search: the analytical ranking of the space (:mod:`.ranking`), the guide that picks
the next config (:mod:`.guided`; as an Optuna sampler, :mod:`.sampler`), the model's refit from
measurements (:mod:`.refit`) and memory profiles on a scaled-down model (:mod:`.memory_profile`).

It takes :class:`~.guided.GuideSettings`, never the spec (:mod:`.spec_settings` makes them from one),
and runs nothing: the study asks it and dispatches what it proposes.
"""
