"""autotune: a declarative auto-tuner for large-model training and serving configurations.

The packages follow the data flow, each importing only those below it (docs/ARCHITECTURE.md, "The
layout"; tests/test_import_graph.py holds the order):

- :mod:`autotune.cli`: the commands, and the assembly that wires a study;
- :mod:`autotune.tracking` (MLflow, progress) and :mod:`autotune.finish` (report, exports, advice);
- :mod:`autotune.study`: the loop, one trial, the set-up, storage, what a study found;
- :mod:`autotune.dispatch`: which probe, and running it locally or on Ray;
- :mod:`autotune.guide`: the model-guided search;
- :mod:`autotune.spec`: the spec, its space, what it resolves to;
- :mod:`autotune.stacks` and :mod:`autotune.export`: the production stacks and their launch formats;
- the vocabulary every stage shares: :mod:`autotune.trial_attrs`, :mod:`autotune.sanity`,
  :mod:`autotune.settings`.

The probes are :mod:`autotune.workers`, the metrics :mod:`autotune.objectives`.

Until the layout of 2026-11 every module sat in this one folder; an import of a former path (say
``autotune.guided_sampler``, named in docs and users' notebooks) still gets the module, from its new
place, with a DeprecationWarning that names it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable

# former flat module -> its place now (autotune.<value>)
MOVED = {
    "assembly": "cli.assembly",
    "backends": "dispatch.backends",
    "bounded_read": "spec.bounded_read",
    "cache": "study.cache",
    "cli_input": "cli.input",
    "cli_options": "cli.options",
    "cli_output": "cli.output",
    "console": "cli.console",
    "context": "spec.context",
    "doctor": "cli.doctor",
    "exit_status": "cli.exit_status",
    "exports": "finish.exports",
    "guided": "guide.guided",
    "guided_sampler": "guide.sampler",
    "host_profile": "study.host_profile",
    "importance": "study.importance",
    "interpret": "study.interpret",
    "listeners": "study.listeners",
    "memory_profile": "guide.memory_profile",
    "mlflow_ui": "tracking.mlflow_ui",
    "models": "spec.models",
    "profiling": "study.profiling",
    "progress": "tracking.progress",
    "pruning": "study.pruning",
    "ranking": "guide.ranking",
    "ray_dispatch": "dispatch.ray_dispatch",
    "ray_tasks": "dispatch.ray_tasks",
    "recommend": "study.recommend",
    "records": "study.records",
    "refit": "guide.refit",
    "report": "finish.report",
    "report_table": "finish.report_table",
    "requeue": "study.requeue",
    "run_lock": "study.run_lock",
    "run_output": "finish.run_output",
    "safe_expr": "spec.safe_expr",
    "search": "study.search",
    "secret_env": "spec.secret_env",
    "serving_plots": "tracking.serving_plots",
    "space": "spec.space",
    "space_enumeration": "spec.space_enumeration",
    "spec_checks": "spec.checks",
    "spec_errors": "spec.errors",
    "spec_fields": "spec.fields",
    "spec_files": "spec.files",
    "spec_load": "spec.load",
    "spec_search": "spec.search_section",
    "spec_space": "spec.space_section",
    "spec_workload": "spec.workload_section",
    "stack_names": "spec.stack_names",
    "stack_presets": "dispatch.stack_presets",
    "stop_conditions": "study.stop_conditions",
    "storage": "study.storage",
    "study_definition": "study.definition",
    "study_plan": "study.plan",
    "study_plots": "finish.plots",
    "study_result": "study.result",
    "study_tracking": "tracking.study_tracking",
    "trial_resolve": "study.trial_resolve",
    "trial_run": "study.trial_run",
    "usable_memory": "study.usable_memory",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``autotune.<former name>`` as the module at its new place (one module object, two names)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - the finder protocol
        prefix, _, name = fullname.partition(".")
        if prefix != "autotune" or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):  # noqa: D102
        new = "autotune." + MOVED[spec.name.partition(".")[2]]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):  # noqa: D102
        module.__spec__ = self._spec  # the import system set the alias's spec on the shared module: undo it


sys.meta_path.append(_MovedModules())


def former_module(package: str, module: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of a package that was one module before the layout (``autotune.spec``,
    ``autotune.dispatch``...): a name of the former module is read from ``package.module``, where it
    lives now, on first use (so importing one of the package's modules never imports that one)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # the import system's own probes (``__path__``...) are not its names
            raise AttributeError(name)
        try:
            return getattr(importlib.import_module(f"{package}.{module}"), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
