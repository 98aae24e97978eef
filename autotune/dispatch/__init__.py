"""Dispatch: which probe measures a trial (:mod:`.backends`; a production stack's own launch,
:mod:`.stack_presets`), and running it: in process, as a local process group (:mod:`.dispatcher`) or
as a Ray task reserving the trial's devices (:mod:`.ray_dispatch`, inside Ray :mod:`.ray_tasks`).

Below the study: the loop is given a dispatcher and never chooses one.

``autotune.dispatch`` was one module before the package; its names are read from :mod:`.dispatcher` on first use,
so ``from autotune.dispatch import ...`` keeps working.
"""

from autotune import former_module

__getattr__ = former_module(__name__, "dispatcher")
