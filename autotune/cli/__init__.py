"""The command line: the ``autotune`` commands (:mod:`.commands`), what they read (:mod:`.input`) and
print (:mod:`.output`, :mod:`.console`), their shared options and their exit codes (:mod:`.exit_status`),
the Ray cluster's report (:mod:`.doctor`), and the study's assembly (:mod:`.assembly`): the one place
that builds a study's dispatcher, launcher, listeners and settings from the spec and hands them to the
loop (as Hydra's sweeper is given its launcher).

The top of the data flow: it may import every package below; nothing imports it.

``autotune.cli`` was one module before the package; its names are read from :mod:`.commands` on first use,
so ``from autotune.cli import ...`` keeps working.
"""

from autotune import former_module

__getattr__ = former_module(__name__, "commands")
