"""Dependencies run one way (issue #32; docs/ARCHITECTURE.md): no import cycle among autotune's
modules, lazy (function-level) imports included, and the probes (``workers/``) never import the
driver's search, tracking or MLflow."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {
    "autotune": REPO / "autotune",
    "autotune.workers": REPO / "workers",
    "autotune.objectives": REPO / "objectives",
}


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in known:  # a name imported from a module: the module
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name:
                found.add(target)
    return found


def _path(module: str) -> Path:
    """The file of a module of autotune (``autotune.study.search`` -> autotune/study/search.py)."""
    return _modules()[module]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {m: _imports(m, p, known) for m, p in modules.items()}
    for m in list(graph):  # importing a package runs its __init__: not a dependency on its own modules
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_autotune():
    assert _cycles(_graph()) == []


def test_probes_never_import_the_driver():
    graph = _graph()
    for module, deps in graph.items():
        if module.startswith("autotune.workers"):
            driver = {
                d
                for d in deps
                if d.startswith("autotune.") and not d.startswith(("autotune.workers", "autotune.objectives"))
            }
            assert not driver, (module, driver)


def _external_imports(path: Path) -> set[str]:
    """Top-level names of the packages a module imports (lazy imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_study_loop_never_imports_tracking():
    """Issue 43: the loop (autotune.study.search) and its trials (autotune.study.trial_run) tell their listeners
    what happened and know nothing of MLflow: the assembly builds the tracking listener and hands it over."""
    graph = _graph()
    for module in ("autotune.study.search", "autotune.study.trial_run"):
        banned = {d for d in graph[module] if d == "autotune.tracking" or d.startswith("autotune.tracking.")}
        assert not banned, (module, banned)
        assert "mlflow" not in _external_imports(_path(module)), module


# issue 43: the modules that take narrow settings (the loop, the trials, the guide, the pruner, the
# dispatchers, the probes' request builder) and the settings' own leaf
NARROW_SETTINGS = (
    "study.search",
    "study.trial_run",
    "study.trial_resolve",
    "spec.context",
    "study.pruning",
    "guide.guided",
    "guide.sampler",
    "dispatch.dispatcher",
    "dispatch.ray_dispatch",
    "dispatch.ray_tasks",
    "study.listeners",
    "study.stop_conditions",
    "settings",
)


def test_the_loop_guide_and_dispatch_never_import_the_spec():
    """Issue 43 (narrow settings, not the whole spec): the loop, the guide, the dispatchers and the
    probes' request builder take small frozen settings made once by the assembly; none of them
    imports autotune.spec.schema (lazily neither), and none resolves the objectives again."""
    graph = _graph()
    for module in NARROW_SETTINGS:
        assert "autotune.spec.schema" not in graph[f"autotune.{module}"], module
        assert "objective_list" not in _path(f"autotune.{module}").read_text(), module


def test_the_parameter_table_is_a_leaf():
    """The serving parameter table is read by the probes and the driver: it imports nothing of either."""
    assert not {d for d in _graph()["autotune.workers.parameters"] if d.startswith("autotune")}


# the schema and its section modules (autotune/spec/schema.py's docstring); what they may import of autotune
SPEC_SCHEMA = (
    "spec.schema",
    "spec.fields",
    "spec.workload_section",
    "spec.space_section",
    "spec.search_section",
    "spec.stack_names",
)
SPEC_SCHEMA_MAY_IMPORT = {
    "autotune.spec.models",  # ModelSpec and the model presets
    "autotune.workers.protocol",  # ENV_NAME, the probe protocol's environment variable name
    "autotune.workers.alloc_conf",  # an allocator config, parsed as the simulator parses it
    "autotune.workers.trace_prefix",  # a trace's block size (Mooncake's hash_ids), as the probe and simulator read it
    *(f"autotune.{m}" for m in SPEC_SCHEMA),
}
# what needs a catalogue above the schema is resolved there, never by the schema: the default target
# by the registry (autotune.stacks.target_of), the objectives once (autotune.spec.resolve.objectives_of)


def _function_imports(path: Path) -> set[tuple[str, str]]:
    """(function, module) for each import inside a function of the module at ``path``."""
    found = set()
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    found.add((function.name, f"autotune.{base}" if node.level else base))
                elif isinstance(node, ast.Import):
                    found |= {(function.name, a.name) for a in node.names}
    return found


def test_the_spec_is_the_schema():
    """Issue 43: the schema reads no file and imports no stack, simulator, hardware-profile or objectives
    module; the files a spec names are read by the loader (autotune.spec.files), the checks across
    sections are autotune.spec.checks. No import inside a function either: the default target is the
    registry's answer (autotune.stacks.target_of), the objectives are resolved above the schema."""
    graph = _graph()
    for module in SPEC_SCHEMA:
        deps = {d for d in graph[f"autotune.{module}"] if d.startswith("autotune")}
        assert deps <= SPEC_SCHEMA_MAY_IMPORT, (module, deps - SPEC_SCHEMA_MAY_IMPORT)
        lazy = {(f, m) for f, m in _function_imports(_path(f"autotune.{module}")) if m.startswith("autotune")}
        assert not lazy, (module, lazy)
        external = _external_imports(_path(f"autotune.{module}")) - {"autotune", "__future__"}
        assert external <= {"pydantic", "typing", "pathlib", "math", "re", "json", "unicodedata"}, (module, external)
    assert sum(1 for _ in _path("autotune.spec.schema").open()) <= 500


def test_importing_the_spec_loads_no_stack_simulator_or_objectives():
    import subprocess
    import sys

    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, autotune.spec.schema; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    banned = ("autotune.stacks", "autotune.workers.simulate", "autotune.workers.hardware", "autotune.objectives")
    assert not [m for m in loaded if m.startswith(banned)]


def test_the_stack_names_the_schema_reads_are_the_registry():
    """autotune.spec.stack_names is the schema's copy of the registry's names: they agree, name for name."""
    from autotune import stacks
    from autotune.spec import stack_names

    assert stack_names.STACK_NAMES == stacks.names()
    assert stack_names.preset_names() == stacks.preset_names()
    for name, entry in stack_names.PRESET_ENTRIES.items():
        assert (entry.default, entry.example) == (stacks.STACKS[name].default_entry, stacks.STACKS[name].entry_example)


# the packages of autotune in the order of the data flow, lowest first (docs/ARCHITECTURE.md, "The
# layout"): a package imports only packages below it (siblings on one line import neither way)
LAYERS = (
    ("autotune.trial_attrs", "autotune.sanity", "autotune.settings"),  # the vocabulary every stage shares
    ("autotune.export",),  # each stack's launch format
    ("autotune.stacks",),  # the stacks' registry: rules, memory rule, exporter, preset launch
    ("autotune.spec",),  # the spec, its space, the probe context it resolves to
    ("autotune.guide",),  # the model-guided search: ranking, guide, refit, memory profiles
    ("autotune.dispatch",),  # which probe, and running it (local or Ray)
    ("autotune.study",),  # the loop, one trial, its records, result and set-up
    ("autotune.scaling",),  # a config measured at several sizes, and projected between them
    ("autotune.tracking", "autotune.finish"),  # MLflow and progress; the files and advice at the end
    ("autotune.cli",),  # the commands and the assembly that wires a study
)


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_the_packages_follow_the_data_flow():
    """Issue 43 (a layout that shows the data flow): every import between autotune's packages goes
    down :data:`LAYERS`, so a package's place says which stages it may use."""
    level = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    upward = []
    for module, deps in _graph().items():
        a = _package(module)
        if a not in level:
            continue
        for dep in deps:
            b = _package(dep)
            if b in level and b != a and level[b] >= level[a]:
                upward.append(f"{module} -> {dep}")
    assert not upward, upward


def test_autotune_holds_packages_and_the_shared_vocabulary_only():
    """No module goes back into the flat folder: autotune/ holds the stage packages, each with a
    docstring that says what it holds, and the three leaves every stage reads."""
    root = ROOTS["autotune"]
    flat = {p.stem for p in root.glob("*.py")} - {"__init__"}
    assert flat == {m.rsplit(".", 1)[1] for m in LAYERS[0]}, flat
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists() and not p.is_symlink()}
    assert {f"autotune.{p}" for p in packages} == {p for layer in LAYERS[1:] for p in layer}
    for p in packages:
        assert ast.get_docstring(ast.parse((root / p / "__init__.py").read_text())), p


def test_every_former_module_path_still_imports_the_module_it_became():
    """Documented import paths (``autotune.guided_sampler.GuidedSampler``, ``autotune.spec_load``,
    ``autotune.dispatch``...) keep working after the layout: the same module object, with a
    DeprecationWarning that names the new place; the five packages named like a former module
    give its names."""
    import importlib
    import subprocess
    import sys

    import autotune

    code = (
        "import importlib, warnings, sys\n"
        "from autotune import MOVED\n"
        "for old, new in MOVED.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module('autotune.' + old)\n"
        "    assert module is importlib.import_module('autotune.' + new), old\n"
        "    assert module.__spec__.name == 'autotune.' + new, old\n"
        "    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old\n"
        "from autotune.guided_sampler import GuidedSampler\n"
        "from autotune.spec import Spec\n"
        "from autotune.dispatch import InProcessDispatcher, LocalProcessDispatcher\n"
        "from autotune.tracking import Tracker\n"
        "from autotune.finish import finish_run\n"
        "from autotune.cli import main\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
    assert set(autotune.MOVED.values()) <= {m[len("autotune.") :] for m in _modules()}
    assert importlib.import_module("autotune.study.search").__name__ == "autotune.study.search"
