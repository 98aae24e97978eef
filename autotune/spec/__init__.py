"""The spec and what it defines: the schema (:mod:`.schema` and its sections), reading a spec file
(:mod:`.load`, :mod:`.files`, :mod:`.bounded_read`), the checks across sections (:mod:`.checks`) and the
errors a person reads (:mod:`.errors`); the space it defines (:mod:`.space`, :mod:`.space_enumeration`:
distributions, derived values, rules, canonical form); and what it resolves to once (:mod:`.resolve`:
the objectives, the probe context of :mod:`.context`; secrets masked by :mod:`.secret_env`).

The first stage of the data flow: below it only the stacks' registry, the exports' formats and the
shared vocabulary (:mod:`autotune.trial_attrs`, :mod:`autotune.sanity`, :mod:`autotune.settings`).

``autotune.spec`` was one module before the package; its names are read from :mod:`.schema` on first use,
so ``from autotune.spec import ...`` keeps working.
"""

from autotune import former_module

__getattr__ = former_module(__name__, "schema")
