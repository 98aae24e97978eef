"""Where chunked prefill changes nothing: the long-prompt serving check's spaces (issue 46).

``benchmarks/serving_cpu_study.py --close`` pairs every max_num_seqs with chunked prefill on and off, at
256-512-token prompts and the probe's ``max_num_batched_tokens`` of 8192. vLLM's V1 scheduler reads the
flag only where a prompt's tokens exceed the step's budget left, so each pair is one engine there, the
model prices it alike, and a rank correlation over the four configs reads the noise that splits the
pairs. ``--long`` (:func:`serving_cpu_study.long_prompts`) is the check's space of configs the engine
runs differently. Checked here: the model's figures (alike within a pair, apart across max_num_seqs), and
the installed vLLM's scheduler source, so that a vLLM that starts to read the flag elsewhere fails this
test rather than the claim going stale.
"""

from __future__ import annotations

import ast
import sys

import pytest
import yaml
from support import REPO, predicted_by_seqs_and_chunked

from autotune.workers.hardware import load_profile

sys.path.insert(0, str(REPO / "benchmarks"))
import serving_cpu_study  # noqa: E402

SCHEDULERS = sorted(REPO.glob(".venv-vllm/lib/python*/site-packages/vllm/v1/core/sched/scheduler.py"))


def _figures(write_spec, data: dict, name: str) -> dict:
    """The model's max rate and p99 TTFT at the operating point of every config of ``data``'s space, on
    the shipped CPU profile, by (max_num_seqs, chunked prefill)."""
    data = {**data, "backend": {"kind": "simulate"}, "cluster": {**data["cluster"], "profile": "cpu"}}
    predicted = predicted_by_seqs_and_chunked(write_spec(yaml.safe_dump(data), name), load_profile("cpu"))
    return {combo: (f["max_rate_rps_model"], f["ttft_p99_ms"]) for combo, f in predicted.items()}


def test_the_close_space_pairs_are_alike_and_the_long_space_configs_apart(write_spec):
    base = yaml.safe_load(serving_cpu_study.SPEC.read_text())
    close = _figures(write_spec, serving_cpu_study.close(base), "close.yaml")
    assert set(close) == {(4, True), (4, False), (8, True), (8, False)}
    for seqs in (4, 8):  # no 512-token prompt exceeds 8192 tokens less 8 decodes: chunking never happens
        # (alike to 1e-5: the unchunked budget is whole prompts, 8064 of the 8184 tokens left, which
        # moves the model's figures in the sixth digit)
        assert close[(seqs, True)] == pytest.approx(close[(seqs, False)], rel=1e-5)
    assert close[(8, True)][0] > close[(4, True)][0]

    data = serving_cpu_study.long_prompts(base)
    assert data["workload"]["traffic"]["prompt_len"] == {"low": 256, "high": 512}
    long = _figures(write_spec, data, "long.yaml")
    rates = [long[(seqs, True)][0] for seqs in (2, 4, 8, 16)]
    assert set(long) == {(2, True), (4, True), (8, True), (16, True)}
    assert len({round(r, 9) for r in rates}) == 4, (
        rates
    )  # four engines, four predictions: a rank correlation reads the model


@pytest.mark.skipif(not SCHEDULERS, reason="vLLM's environment (.venv-vllm) is not installed")
def test_vllms_scheduler_reads_chunked_prefill_only_where_a_prompt_exceeds_the_budget_left():
    tree = ast.parse(SCHEDULERS[0].read_text())
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "enable_chunked_prefill" in test:
                reads.append(test)
    uses = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr in ("enable_chunked_prefill", "chunked_prefill_enabled")
    ]
    assert reads, "vLLM's scheduler no longer reads enable_chunked_prefill in an if: re-read it"
    assert len(uses) == len(reads), f"{len(uses)} reads of the flag, {len(reads)} of them in an if's test"
    for test in reads:  # each read is the break of a prompt that does not fit what the step has left
        assert "not self.scheduler_config.enable_chunked_prefill" in test
        assert "num_new_tokens > request_token_budget" in test
