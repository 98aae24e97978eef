"""What observes a study: MLflow (:mod:`.tracker` writes, :mod:`.study_tracking` decides what the study
writes, as a listener of the loop; :mod:`.serving_plots` its serving picture; :mod:`.mlflow_ui` the UI)
and live progress on stderr (:mod:`.progress`).

Above the study: the loop tells its listeners and never imports this package.

``autotune.tracking`` was one module before the package; its names are read from :mod:`.tracker` on first use,
so ``from autotune.tracking import ...`` keeps working.
"""

from autotune import former_module

__getattr__ = former_module(__name__, "tracker")
