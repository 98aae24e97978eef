"""Property-based fuzzing of specs and constraint expressions (issue #13): whatever a user writes,
autotune answers with a spec or with errors that each name the file and a field, never with a
traceback; a constraint either compiles and evaluates or is an ``ExpressionError``.

The spec fuzzer mutates a valid spec at random paths with values a hand-written or generated
YAML file can hold (huge and negative integers, floats, NaN, markup, nested containers, wrong
types, missing sections), writes it as YAML and loads it the way ``autotune validate`` does; a
sample of the mutants also goes through the CLI (exit 0 or 2, nothing else)."""

from __future__ import annotations

import copy
import os
import string

import numpy as np
import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from autotune.safe_expr import ExpressionError, compile_expression  # noqa: E402
from autotune.spec import Spec, SpecError, load_spec  # noqa: E402
from support import TINY_TRAIN  # noqa: E402

BASE = yaml.safe_load(TINY_TRAIN)
BASE.update({"constraints": ["tp * pp <= 2"], "baseline": {"tp": 1, "pp": 1, "micro_batch_size": 1, "zero_stage": 0,
                                                           "recompute": "none"}})

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70), st.sampled_from([0, 1, -1, 2**31, 2**53, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.sampled_from(["[/bold]", "[red]x", "$(rm -rf /)", "a\nb", "\x00", "🙂", "1e30", "auto",
                                           "{trial_file}", "none", "tp", "env.X"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=12)


def _paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _paths(v, prefix + (i,))


EXAMPLES = int(os.environ.get("AUTOTUNE_FUZZ_EXAMPLES", "300"))  # more: AUTOTUNE_FUZZ_EXAMPLES=5000
PATHS = [p for p in _paths(BASE) if p]
KEYS = sorted({p[-1] for p in PATHS if isinstance(p[-1], str)} | {"low", "high", "step", "log", "env", "argv",
                                                                 "metric_patterns", "target", "profile", "overrides"})


def like(original):
    """Values of the original's own type, extremes included: these pass the type checks and
    reach the code behind them (the ranking, the memory model)."""
    ints = st.one_of(st.sampled_from([1, 2, 4, 8, 3, 2**20, 2**53 - 1, 2**53, 2**63, 10**30, 0, -1]),
                     st.integers(min_value=-2**70, max_value=2**70))
    if isinstance(original, bool):
        return st.booleans()
    if isinstance(original, int):
        return ints
    if isinstance(original, float):
        return st.floats(allow_nan=True, allow_infinity=True)
    if isinstance(original, str):
        return st.one_of(st.sampled_from([original.upper(), original + "x", "", " ", "[/bold]"]), st.text(max_size=20))
    if isinstance(original, list) and original and all(isinstance(v, int) and not isinstance(v, bool) for v in original):
        return st.one_of(st.lists(ints, min_size=1, max_size=4, unique=True),
                         st.fixed_dictionaries({"low": ints, "high": ints}))
    if isinstance(original, list):
        return st.lists(st.sampled_from(original + [None, "full", 7]), max_size=5)
    return values


@st.composite
def mutated_specs(draw):
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(min_value=1, max_value=2))):
        path = draw(st.sampled_from(PATHS))
        parent = data
        try:
            for part in path[:-1]:
                parent = parent[part]
        except (KeyError, IndexError, TypeError):
            continue
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if not isinstance(parent, (dict, list)):
            continue
        if action == "delete" and isinstance(parent, dict):
            parent.pop(path[-1], None)
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYS))] = draw(values)
        else:
            try:
                original = parent[path[-1]]
                parent[path[-1]] = draw(st.one_of(like(original), like(original), values))
            except (KeyError, IndexError, TypeError):  # deleted by an earlier mutation
                continue
    return data


def _check(path, spec_or_error):
    if isinstance(spec_or_error, SpecError):
        assert spec_or_error.problems
        for problem in spec_or_error.problems:
            line = problem.render(spec_or_error.file)
            assert line.startswith(str(path)) and problem.message, line
        return
    assert isinstance(spec_or_error, Spec)
    # a valid spec is one the model can rank, as `autotune plan` does (a space too large to
    # enumerate is the one error plan reports, as a ValueError naming the limit)
    from autotune.context import probe_context
    from autotune.ranking import rank_space
    from autotune.space import Space

    spec = spec_or_error
    try:
        enumeration = Space(spec).enumerate(limit=spec.search.exhaustive_limit)
    except ValueError as exc:
        assert "limit" in str(exc) or "exhaustive" in str(exc), exc
        return
    ranking = rank_space(enumeration, probe_context(spec), spec.objective_list())
    assert ranking.fit <= enumeration.valid <= enumeration.space_size


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=mutated_specs())
def test_fuzzed_specs_are_a_spec_or_located_errors(tmp_path, data):
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    try:
        outcome = load_spec(path)
    except SpecError as exc:
        outcome = exc
    _check(path, outcome)


@settings(max_examples=max(EXAMPLES // 8, 20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=mutated_specs())
def test_fuzzed_specs_through_the_cli_exit_0_or_2(tmp_path, data):
    from typer.testing import CliRunner

    from autotune.cli import app

    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    if result.exit_code == 0:  # a valid spec is also one the model can rank (exit 1: nothing fits)
        planned = CliRunner().invoke(app, ["plan", str(path), "--json"])
        assert planned.exit_code in (0, 1), planned.output


@settings(max_examples=max(EXAMPLES // 3, 20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=string.printable, max_size=200))
def test_arbitrary_yaml_text_is_a_spec_or_located_errors(tmp_path, text):
    path = tmp_path / "text.yaml"
    path.write_text(text)
    try:
        outcome = load_spec(path)
    except SpecError as exc:
        outcome = exc
    _check(path, outcome)


# -------------------------------------------------------------------------------- expressions
NAMES = ["tp", "pp", "mbs", "heads", "recompute", "sp"]
ENV = {"tp": 2, "pp": 4, "mbs": 1, "heads": 32, "recompute": "full", "sp": True}
tokens = st.sampled_from(NAMES + ["1", "0", "-1", "2.5", "10**9", "9**9", "'full'", "'a'", "True", "None", "+", "-",
                                  "*", "/", "//", "%", "**", "==", "!=", "<", ">=", "and", "or", "not", "in", "(", ")",
                                  ",", "[", "]", "if", "else", "min(", "max(", "abs(", "lambda", ".", "__class__",
                                  "env.X", "'x' * 10**10", "1e308"])


@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(parts=st.lists(tokens, min_size=1, max_size=25))
def test_fuzzed_constraints_compile_and_evaluate_or_say_why(parts):
    source = " ".join(parts)
    try:
        expression = compile_expression(source, set(NAMES) | {"env.X"})
    except ExpressionError as exc:
        assert str(exc)
        return
    env = {**ENV, "env.X": "200"}
    columns = {k: np.array([v, v], dtype=object if isinstance(v, str) else None) for k, v in env.items()}
    try:  # the scalar form (a baseline) and the column form (the whole space at once)
        expression.evaluate(env)
        expression.evaluate(columns)
    except ExpressionError as exc:
        assert source in str(exc) or repr(source) in str(exc)
