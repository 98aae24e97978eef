"""The end of a study: the files and words it leaves (:mod:`.study_end`: the results table, summary,
plots, exports and the advice), the report (:mod:`.report`, :mod:`.report_table`, :mod:`.plots`), the
tables the commands print (:mod:`.run_output`) and the exports a stack launches (:mod:`.exports`, each
format in :mod:`autotune.export`).

Above the study: it reads what the study found (:class:`autotune.study.result.StudyResult`).

``autotune.finish`` was one module before the package; its names are read from :mod:`.study_end` on first use,
so ``from autotune.finish import ...`` keeps working.
"""

from autotune import former_module

__getattr__ = former_module(__name__, "study_end")
