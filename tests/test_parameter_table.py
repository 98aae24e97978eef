"""The serving parameter table (``autotune.workers.parameters``, issue 43): every reader of a serving
default or of the rule ``max_num_batched_tokens >= max_num_seqs`` agrees with it: the space, the
simulator, the vLLM and MindIE stacks, and both exports. And no module restates a default."""

from __future__ import annotations

import re

from support import REPO

from autotune.export._mindie import mindie_settings
from autotune.export._vllm import vllm_engine_args
from autotune.space import SERVE_DEFAULTS
from autotune.stacks import unsupported_reasons
from autotune.workers.parameters import BATCHED_COVERS_SEQS, SERVING, batched_below_seqs, serving_default
from autotune.workers.simulate._columns import DEFAULTS as SIMULATOR_DEFAULTS


def test_the_space_and_the_simulator_take_their_serving_defaults_from_the_table():
    for name, parameter in SERVING.items():
        assert SERVE_DEFAULTS[name] == parameter.default, name
        assert SIMULATOR_DEFAULTS[name] == parameter.default, name


def test_the_vllm_launch_says_the_tables_defaults_under_vllms_flags():
    args = vllm_engine_args({}, "cuda")
    for name, parameter in SERVING.items():
        default = parameter.default
        if isinstance(default, bool):
            assert (parameter.vllm_flag if default else parameter.vllm_flag.replace("--", "--no-", 1)) in args, name
        else:
            assert args[args.index(parameter.vllm_flag) + 1] == f"{default:g}", name


def test_mindies_config_says_the_tables_defaults_under_its_keys():
    settings = mindie_settings({})
    schedule = settings["BackendConfig"]["ScheduleConfig"]
    for name, parameter in SERVING.items():
        for key in parameter.mindie_keys:
            assert schedule[key] == parameter.default, (name, key)
    assert schedule["templateType"] == ("Mix" if serving_default("enable_chunked_prefill") else "Standard")


def test_every_reader_of_the_rule_draws_the_same_line():
    """At the line (batched == seqs) every reader accepts; one token below it, every reader refuses."""
    for seqs in (8, 256):
        assert not batched_below_seqs(seqs, seqs) and batched_below_seqs(seqs - 1, seqs)
        ok = {"max_num_seqs": seqs, "max_num_batched_tokens": max(seqs, 4096), "enable_chunked_prefill": True}
        below = dict(ok, max_num_batched_tokens=seqs - 1)
        facts = {"accelerator": "cuda", "model": {"max_position_embeddings": 4096}, "workload": {"kind": "serve"}}
        assert not any("max_num_seqs" in r for r in unsupported_reasons("vllm", ok, facts))
        assert any(BATCHED_COVERS_SEQS in r for r in unsupported_reasons("vllm", below, facts))


def test_no_module_restates_a_serving_default():
    """A default written as a literal beside its name (``"max_num_seqs", 256`` or ``"max_num_seqs": 256``)
    anywhere but the table: the six files that each had a copy read the table now."""
    table = REPO / "workers" / "parameters.py"
    found = []
    for root in ("autotune", "workers"):
        for path in (REPO / root).rglob("*.py"):
            if path == table:
                continue
            text = path.read_text()
            for name, parameter in SERVING.items():
                literal = re.escape(repr(parameter.default))
                if re.search(rf"[\"']{name}[\"']\s*[:,]\s*{literal}\b", text):
                    found.append(f"{path.relative_to(REPO)}: {name} = {parameter.default!r}")
    assert not found, found
