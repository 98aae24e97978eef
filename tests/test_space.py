"""The space: derived values, rules, canonical form and whole-space enumeration."""

import itertools

import optuna
import pytest

from autotune.spec.space import Space, config_key
from autotune.spec.load import load_spec
from support import REPO, TINY_TRAIN


@pytest.fixture
def space(write_spec):
    return Space(load_spec(write_spec(TINY_TRAIN)))


def test_derived_dp_and_grad_accum(space):
    r = space.resolve({"tp": 1, "pp": 1, "micro_batch_size": 2, "zero_stage": 1, "recompute": "none"})
    assert r.valid and r.config["dp"] == 2 and r.config["grad_accum"] == 2  # 8 / (2*2)


def test_zero_irrelevant_without_dp_and_sp_without_tp(space):
    a = space.resolve({"tp": 2, "pp": 1, "micro_batch_size": 1, "zero_stage": 3, "recompute": "none"})
    b = space.resolve({"tp": 2, "pp": 1, "micro_batch_size": 1, "zero_stage": 0, "recompute": "none"})
    assert a.config["dp"] == 1 and a.config["zero_stage"] == 0 and a.key == b.key
    c = space.resolve({"tp": 1, "pp": 1, "micro_batch_size": 1, "sequence_parallel": True})
    assert c.config["sequence_parallel"] is False


def test_rules_name_the_violation(space):
    r = space.resolve({"tp": 2, "pp": 2, "micro_batch_size": 1})
    assert not r.valid and any("world size" in v for v in r.violations)
    r = space.resolve({"tp": 1, "pp": 1, "micro_batch_size": 3})
    assert any("global_batch_size (8) not divisible" in v for v in r.violations)


def test_enumeration_matches_one_by_one(space):
    enum = space.enumerate()
    names = list(space.choices)
    valid_keys = set()
    for values in itertools.product(*space.choices.values()):
        r = space.resolve(dict(zip(names, values)))
        if r.valid:
            valid_keys.add(r.key)
    assert {config_key(c) for c in enum.configs} == valid_keys
    assert enum.space_size == 2 * 2 * 3 * 3 * 2
    assert len(enum.configs) == len(valid_keys) < enum.space_size


def test_user_constraint_applies_vectorised_and_scalar(write_spec):
    spec = load_spec(write_spec(TINY_TRAIN + "constraints: ['micro_batch_size * dp <= 4']\n"))
    space = Space(spec)
    assert all(c["micro_batch_size"] * c["dp"] <= 4 for c in space.enumerate().configs)
    r = space.resolve({"tp": 1, "pp": 1, "micro_batch_size": 4})
    assert any("micro_batch_size * dp <= 4" in v for v in r.violations)


def test_distributions(write_spec):
    spec = load_spec(
        write_spec(TINY_TRAIN.replace("micro_batch_size: [1, 2, 4]", "micro_batch_size: {low: 1, high: 4}"))
    )
    d = Space(spec).distributions()
    assert isinstance(d["micro_batch_size"], optuna.distributions.IntDistribution)
    assert isinstance(d["recompute"], optuna.distributions.CategoricalDistribution)


def test_recompute_layers_canonical(write_spec):
    spec = load_spec(
        write_spec(
            TINY_TRAIN.replace(
                "  recompute: [none, full]\n", "  recompute: [none, full]\n  recompute_layers: [1, 2, 4]\n"
            )
        )
    )
    space = Space(spec)
    none = space.resolve({"tp": 1, "pp": 2, "micro_batch_size": 1, "recompute": "none", "recompute_layers": 2})
    assert "recompute_layers" not in none.config
    full_all = space.resolve({"tp": 1, "pp": 2, "micro_batch_size": 1, "recompute": "full", "recompute_layers": 4})
    full_two = space.resolve({"tp": 1, "pp": 2, "micro_batch_size": 1, "recompute": "full", "recompute_layers": 2})
    # 4 layers / pp 2 = 2 per stage: recomputing 2 or 4 of them is the same (all)
    assert full_all.key == full_two.key and "recompute_layers" not in full_all.config
    part = space.resolve({"tp": 1, "pp": 2, "micro_batch_size": 1, "recompute": "full", "recompute_layers": 1})
    assert part.config["recompute_layers"] == 1


def test_first_stage_layers_canonical_and_its_rules(write_spec):
    """An even split (or one stage) is no first_stage_layers; an uneven one needs the rest to split
    evenly over the other stages, and no interleaving."""
    text = TINY_TRAIN.replace("  pp: [1, 2]\n", "  pp: [1, 2, 4]\n  first_stage_layers: [1, 2, 3]\n  vpp: [1, 2]\n")
    text = text.replace("devices_per_node: 2", "devices_per_node: 4")
    space = Space(load_spec(write_spec(text)))
    base = {"tp": 1, "micro_batch_size": 1, "vpp": 1}
    assert "first_stage_layers" not in space.resolve({**base, "pp": 2, "first_stage_layers": 2}).config
    assert "first_stage_layers" not in space.resolve({**base, "pp": 1, "first_stage_layers": 3}).config
    one = space.resolve({**base, "pp": 2, "first_stage_layers": 1})
    assert one.valid and one.config["first_stage_layers"] == 1
    three = space.resolve({**base, "pp": 4, "first_stage_layers": 2})  # 2 + 2/3 per stage
    assert not three.valid and any("do not split evenly" in v for v in three.violations)
    interleaved = space.resolve({**base, "pp": 2, "vpp": 2, "first_stage_layers": 1})
    assert not interleaved.valid and any("first_stage_layers needs vpp = 1" in v for v in interleaved.violations)
    configs = space.enumerate().configs
    assert {c.get("first_stage_layers") for c in configs} == {None, 1, 3}


def test_llama2_7b_space_counts():
    space = Space(load_spec(REPO / "search_spaces" / "llama2_7b_8npu.yaml"))
    enum = space.enumerate()
    assert enum.space_size == space.size
    assert 0 < enum.valid < enum.space_size
    keys = [config_key(c) for c in enum.configs]
    assert len(set(keys)) == len(keys)
