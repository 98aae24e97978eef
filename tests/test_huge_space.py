"""Huge spaces (issue #42): a limit whose ranking cannot fit in memory is refused with the numbers,
the chunked enumeration gives the configs the whole-array one gives, the ranking prices them in
chunks to the same predictions, and the benchmark runs at its smallest size. No timings asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import autotune.guide.ranking as ranking_mod
import autotune.spec.space as space_mod
from autotune.cli.commands import app
from autotune.spec.resolve import objectives_of, probe_context
from autotune.guide.ranking import rank_space
from autotune.spec.space import Space, config_key, memory_problem
from autotune.spec.load import load_spec
from support import REPO, TINY_TRAIN

runner = CliRunner()
GIB = 2**30

# 15 values of 10 env knobs on the tiny space's 72: 4.15e13 combinations
HUGE_ENV = "  env:\n" + "".join(f"    KNOB_{k}: [{', '.join(str(v) for v in range(15))}]\n" for k in range(10))
ENV_KNOBS = """  env:
    HCCL_BUFFSIZE: [120, 200, 400]
    PYTORCH_NPU_ALLOC_CONF: ["expandable_segments:False", "expandable_segments:True"]
    SOME_TIMEOUT: ["60", "120"]
"""


def _huge(write_spec, limit: str = "100000000000000"):
    text = TINY_TRAIN.replace(
        "search: {n_trials: 6, seed: 1}", f"search: {{n_trials: 6, seed: 1, exhaustive_limit: {limit}}}"
    )
    return write_spec(text.replace("objectives:", HUGE_ENV + "objectives:", 1))


# ------------------------------------------------------------------------------- the memory refusal
def test_a_limit_whose_ranking_cannot_fit_is_refused_with_the_numbers(write_spec, monkeypatch):
    monkeypatch.setattr(space_mod, "machine_memory", lambda: 24 * GIB)
    spec = _huge(write_spec)
    for command in (["validate"], ["plan"], ["validate", "--json"]):
        result = runner.invoke(app, [*command, str(spec)])
        assert result.exit_code == 2, result.output
        assert not isinstance(result.exception, MemoryError)
        text = result.stdout if "--json" in command else result.stderr
        assert "search.exhaustive_limit" in text
        assert f"{72 * 15**10:,} combinations" in text.replace("\n", " ")  # the space
        assert "24.0 GiB" in text  # the machine's memory
        assert "TiB" in text or "PiB" in text  # the estimate
    payload = json.loads(runner.invoke(app, ["validate", "--json", str(spec)]).stdout)
    assert payload["ok"] is False and "needs up to" in payload["errors"][0]


def test_above_the_limit_the_space_is_sampled_not_refused(write_spec, monkeypatch):
    """A space above search.exhaustive_limit is never enumerated: validate says ok, plan says why."""
    monkeypatch.setattr(space_mod, "machine_memory", lambda: 24 * GIB)
    spec = _huge(write_spec, limit="2000000")
    assert runner.invoke(app, ["validate", str(spec)]).exit_code == 0
    result = runner.invoke(app, ["plan", str(spec)])
    assert result.exit_code == 2 and "more than the limit 2,000,000" in result.stderr


def test_the_estimate_grows_with_the_space_and_the_default_limit_fits():
    assert memory_problem(2_000_000, 4 * GIB) is None  # the default limit on a small machine
    problem = memory_problem(410_000_000_000, 24 * GIB)
    assert problem is not None
    assert "410,000,000,000 combinations" in problem and "24.0 GiB" in problem
    assert f"{space_mod.BYTES_PER_COMBINATION} bytes per combination" in problem
    most = (24 * GIB - space_mod.BASE_BYTES) // space_mod.BYTES_PER_COMBINATION
    assert memory_problem(most, 24 * GIB) is None and memory_problem(most + 1, 24 * GIB) is not None


# --------------------------------------------------------------------- chunked == whole-array
def _whole_array(space: Space):
    """The enumeration as it was before issue #42: every combination at once (np.indices)."""
    names = list(space.choices)
    lens = [len(space.choices[n]) for n in names]
    idx = np.indices(lens).reshape(len(names), -1)
    cols = {n: space_mod._array(space.choices[n])[idx[i]] for i, n in enumerate(names)}
    for k, v in space.fixed.items():
        cols[k] = np.full(space.size, v, dtype=object if isinstance(v, str) else None)
    config_cols, valid, reasons = space._derive(cols)
    keep = np.flatnonzero(valid)
    kept = {k: v[keep] for k, v in config_cols.items()}
    codes = np.stack([np.unique(v.astype(str), return_inverse=True)[1].reshape(-1) for v in kept.values()], axis=1)
    _, first = np.unique(codes, axis=0, return_index=True)
    first.sort()
    lists = {k: v[first].tolist() for k, v in kept.items()}
    configs = [{k: v for k, v in zip(lists, row) if v is not None} for row in zip(*lists.values())]
    invalid = {msg: int(bad.sum()) for msg, bad in reasons.items() if bad.any()}
    violations = sum(np.asarray(bad, dtype=int) for bad in reasons.values())
    sole = {msg: int((bad & (violations == 1)).sum()) for msg, bad in reasons.items() if bad.any()}
    params = {name: cols[name][keep[first]] for name in names}
    return configs, invalid, sole, params, {k: v[first] for k, v in kept.items()}


def _same_as_whole_array(space: Space, enumeration) -> None:
    configs, invalid, sole, params, columns = _whole_array(space)
    assert [config_key(c) for c in enumeration.configs] == [config_key(c) for c in configs]
    assert list(enumeration.configs) == configs  # the same dicts, keys in the same order
    assert [list(c) for c in enumeration.configs] == [list(c) for c in configs]
    assert enumeration.invalid_reasons == invalid and enumeration.sole_reasons == sole
    assert enumeration.space_size == space.size
    for name, values in params.items():
        assert enumeration.params[name].dtype == values.dtype
        assert enumeration.params[name].tolist() == values.tolist()
    assert list(enumeration.columns) == list(columns)
    for name, values in columns.items():
        assert enumeration.columns[name].tolist() == values.tolist()


@pytest.mark.parametrize(
    "extra",
    [
        "",  # the parallel knobs only
        ENV_KNOBS,  # env knobs no rule reads: the product of the others times theirs
        ENV_KNOBS + "constraints: ['env.SOME_TIMEOUT != \"120\" or tp == 1']\n",  # a constraint reads one
    ],
    ids=["parallel", "env-knobs", "env-constraint"],
)
def test_chunked_enumeration_gives_the_whole_array_configs(write_spec, monkeypatch, extra):
    monkeypatch.setattr(space_mod, "CHUNK", 7)  # many chunks, a group of duplicates across them
    text = TINY_TRAIN.replace("objectives:", extra.split("constraints:")[0] + "objectives:", 1)
    if "constraints:" in extra:
        text += "constraints:" + extra.split("constraints:")[1]
    space = Space(load_spec(write_spec(text)))
    enumeration = space.enumerate()
    assert 0 < enumeration.valid < space.size
    _same_as_whole_array(space, enumeration)
    _same_as_whole_array(space, space._enumerate([]))  # the whole product in chunks
    if extra:
        bound, free = space._split()
        assert ("env.SOME_TIMEOUT" in free) is ("constraints" not in extra)
        assert "env.HCCL_BUFFSIZE" in free


def test_a_rule_that_reads_a_free_knob_turns_the_shortcut_off(write_spec, monkeypatch):
    """The shortcut checks, chunk by chunk, that the knobs it takes as free change no verdict."""
    monkeypatch.setattr(space_mod, "CHUNK", 5)
    text = TINY_TRAIN.replace("objectives:", ENV_KNOBS + "objectives:", 1)
    text += "constraints: ['env.SOME_TIMEOUT != \"120\" or tp == 1']\n"
    space = Space(load_spec(write_spec(text)))
    monkeypatch.setattr(Space, "_split", lambda self: (["tp"], ["env.SOME_TIMEOUT", "env.HCCL_BUFFSIZE"]))
    with pytest.raises(space_mod._FreeKnobRead):
        space._enumerate(["env.SOME_TIMEOUT", "env.HCCL_BUFFSIZE"])
    _same_as_whole_array(space, space.enumerate())  # falls back to the whole product


def test_why_empty_streams_and_says_what_enumerate_says(write_spec, monkeypatch):
    monkeypatch.setattr(space_mod, "CHUNK", 4)
    empty = write_spec(TINY_TRAIN.replace("objectives:", ENV_KNOBS + "objectives:", 1) + "constraints: ['tp > 4']\n")
    space = Space(load_spec(empty))
    assert space.why_empty() == space.enumerate().why_empty()
    assert "constraint 'tp > 4' rejects" in space.why_empty()
    assert Space(load_spec(write_spec(TINY_TRAIN, "ok.yaml"))).why_empty() is None


def test_configs_are_built_on_access_and_found_by_key(write_spec):
    space = Space(load_spec(write_spec(TINY_TRAIN.replace("objectives:", ENV_KNOBS + "objectives:", 1))))
    enumeration = space.enumerate()
    configs = list(enumeration.configs)
    assert enumeration.configs[-1] == configs[-1] and enumeration.configs[1:4] == configs[1:4]
    assert enumeration.configs.rows(np.array([3, 0])) == [configs[3], configs[0]]
    with pytest.raises(IndexError):
        enumeration.configs[len(configs)]
    for i in (0, 5, len(configs) - 1):
        assert enumeration.index_of_key(config_key(configs[i])) == i
        assert space.resolve(enumeration.params_of(i)).config == configs[i]
    assert enumeration.index_of_config({**configs[0], "tp": 3}) is None
    assert enumeration.index_of_config({**configs[0], "unknown": 1}) is None


# ------------------------------------------------------------------------------ chunked pricing
def test_chunked_pricing_gives_the_whole_batch_predictions(write_spec, monkeypatch):
    from autotune.workers.simulate import columns_from_params, simulate_configs

    monkeypatch.setattr(ranking_mod, "SIM_CHUNK", 11)
    text = TINY_TRAIN.replace("objectives:", ENV_KNOBS + "objectives:", 1)
    spec = load_spec(write_spec(text))
    enumeration = Space(spec).enumerate()
    ranking = rank_space(enumeration, probe_context(spec), objectives_of(spec))
    c = probe_context(spec)
    whole = simulate_configs(c.model, c.workload, c.hardware, c.cluster, columns_from_params(list(enumeration.configs)))
    assert list(ranking.predictions) == list(whole)
    for key, values in whole.items():
        assert np.array_equal(np.asarray(ranking.predictions[key]), values, equal_nan=values.dtype.kind == "f"), key
    # priced once per distinct simulator input: the unread env knob does not multiply the pricing
    assert len(ranking.predictions.unique["fits"]) * 2 <= enumeration.valid
    for i in (0, int(ranking.order[0]), enumeration.valid - 1):
        assert ranking.metrics_of(i) == {
            k: (v[i].item() if isinstance(v[i], np.generic) else v[i]) for k, v in whole.items()
        }
    layouts = ranking.distinct_layouts(3)
    assert [lay.rank for lay in layouts] == [1, 2, 3]
    assert "env.SOME_TIMEOUT" in layouts[0].undistinguished  # not priced: a probe must choose


# ------------------------------------------------------------------------------------ benchmark
def test_the_benchmark_runs_at_its_smallest_size(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "huge_space.py"), "--size", "small", "--keep", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plan" in proc.stdout and "exit 0" in proc.stdout and "peak RSS" in proc.stdout
    assert (tmp_path / "huge_space_small.yaml").is_file()
