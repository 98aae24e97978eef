"""Memory probes on a scaled-down model (issue #35, part 1): the profile trial, the backends that
can run one and the one that cannot say so, and the line through two profiles predicting the
full probe's peak on real torch probes on this CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from autotune.dispatch.backends import launch_for, select_backend
from autotune.spec.resolve import probe_context
from autotune.guide.memory_profile import (
    NUM_LAYERS_ENV,
    PROFILE_MARK,
    fit_stage_memory,
    layers_per_stage,
    profile_request,
    why_no_profile,
)
from autotune.spec.load import load_spec
from autotune.workers.protocol import TrialRequest


def _torch_probe_helpers():
    """tests/torch_probe/conftest.py (the tiny preset, running a probe as the dispatcher does),
    loaded under its own name: ``conftest`` is this directory's."""
    path = Path(__file__).parent / "torch_probe" / "conftest.py"
    spec = importlib.util.spec_from_file_location("torch_probe_helpers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _request(params: dict, layers: int = 8) -> TrialRequest:
    return TrialRequest(
        params=dict(params),
        model={"num_hidden_layers": layers, "hidden_size": 64},
        workload={"kind": "train", "warmup_steps": 2, "measured_steps": 5, "profile_step": True},
        cluster={"world_size": 4},
    )


def test_a_profile_runs_the_same_layout_with_k_layers_per_stage_for_one_step():
    full = _request({"tp": 1, "pp": 2, "vpp": 2, "micro_batch_size": 4, "recompute": "full"}, layers=32)
    scaled = profile_request(full, 1)
    assert scaled.model["num_hidden_layers"] == 4  # pp 2 x vpp 2 chunks of one layer
    assert scaled.params == full.params  # micro-batch, recompute, ...: the full probe's memory
    assert (scaled.workload["warmup_steps"], scaled.workload["measured_steps"]) == (1, 1)
    assert scaled.workload[PROFILE_MARK] == 1 and scaled.workload["profile_step"] is False
    assert full.model["num_hidden_layers"] == 32 and full.workload["measured_steps"] == 5  # untouched
    assert profile_request(_request({"pp": 4}), 2).model["num_hidden_layers"] == 8
    assert layers_per_stage(full.model, full.params) == 8
    with pytest.raises(ValueError, match="at least one layer per stage"):
        profile_request(full, 0)


def test_the_line_through_two_profiles_and_its_band():
    fit = fit_stage_memory({1: 0.481, 2: 0.548})
    assert fit.per_layer_gib == pytest.approx(0.067) and fit.static_gib == pytest.approx(0.414)
    mean, sd = fit.predict(4)
    assert mean == pytest.approx(0.682) and 0.0 < sd < 0.05
    far_mean, far_sd = fit.predict(40)
    assert far_sd > sd  # read further from the profiles, less sure
    # noise at tiny layers can tilt the line down: no layer frees memory
    assert fit_stage_memory({1: 0.50, 2: 0.49}).per_layer_gib == 0.0
    # three profiles: the residual widens the band
    noisy = fit_stage_memory({1: 1.0, 2: 1.2, 3: 1.5})
    assert noisy.predict(3)[1] > fit_stage_memory({1: 1.0, 3: 1.5}).predict(3)[1]
    with pytest.raises(ValueError, match="two layer counts"):
        fit_stage_memory({2: 1.0})


def test_which_backends_can_profile_and_the_one_that_says_why_not():
    assert why_no_profile("torch") is None and why_no_profile("mindspore") is None
    assert why_no_profile("megatron") is None  # presets render --num-layers from the request
    assert why_no_profile("command", ["python", "train.py", "--num-layers", "{num_layers}"]) is None
    why = why_no_profile("command", ["python", "train.py", "--trial", "{trial_file}"])
    assert why and "{num_layers}" in why
    assert "nothing to profile" in why_no_profile("simulate")
    # DeepSpeed's config has no model: its script must take the layer count from its args
    assert "{num_layers}" in why_no_profile("deepspeed", ["--steps", "{iterations}"])
    assert why_no_profile("deepspeed", ["--layers", "{num_layers}"]) is None
    assert why_no_profile("torchtitan") is None and "serving" in why_no_profile("vllm")


def test_a_command_backend_is_told_the_layers_of_the_model_it_runs(write_spec):
    path = write_spec(
        """
        name: profile-command
        model: tiny-llama
        workload: {kind: train, seq_len: 256, global_batch_size: 8}
        cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2}
        backend:
          kind: command
          argv: [python, launch.py, --num-layers, "{num_layers}", --trial, "{trial_file}"]
        space: {tp: [1], pp: [1, 2], micro_batch_size: [1]}
        objectives: [tokens_per_s_per_device]
        """
    )
    spec = load_spec(path)
    ctx = probe_context(spec)
    full = TrialRequest(
        params={"tp": 1, "pp": 2, "vpp": 1, "micro_batch_size": 1, "dp": 1},
        model=ctx.model,
        workload=ctx.workload,
        cluster=ctx.cluster,
    )
    choice = select_backend(spec)
    whole = launch_for(spec, choice, full)
    n = str(ctx.model["num_hidden_layers"])
    assert whole.argv[3] == n and whole.env[NUM_LAYERS_ENV] == n and "{trial_file}" in whole.argv
    scaled = launch_for(spec, choice, profile_request(full, 1))
    assert scaled.argv[3] == "2" and scaled.env[NUM_LAYERS_ENV] == "2"


def test_two_profiles_predict_the_full_probes_peak_on_this_cpu(tmp_path):
    """Real torch probes: pp 2 over 2 CPU ranks, a Llama of 8 layers (4 per stage), profiled at
    1 and 2 layers per stage; the full probe's measured peak (each stage's and the worst) lies in
    the band the line predicted for it."""
    pytest.importorskip("torch")
    helpers = _torch_probe_helpers()
    TINY_MODEL, make_request, run_probe = helpers.TINY_MODEL, helpers.make_request, helpers.run_probe
    model = dict(TINY_MODEL, hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4)
    model["num_hidden_layers"] = 8
    full = make_request({"tp": 1, "pp": 2, "micro_batch_size": 1, "precision": "fp32"}, world=2, model=model)
    peaks: dict[int, list[float]] = {}
    for k in (1, 2):
        run = run_probe(tmp_path, profile_request(full, k))
        assert run.returncode == 0, run.tail()
        peaks[k] = run.result["info"]["peak_memory_gib_by_stage"]
        assert len(peaks[k]) == 2 and max(peaks[k]) == pytest.approx(run.metrics["peak_memory_gib"])
    run = run_probe(tmp_path, full)
    assert run.returncode == 0, run.tail()
    measured = run.result["info"]["peak_memory_gib_by_stage"]
    per_stage = layers_per_stage(full.model, full.params)
    for stage in range(2):
        mean, sd = fit_stage_memory({k: peaks[k][stage] for k in peaks}).predict(per_stage)
        assert abs(measured[stage] - mean) <= 3 * sd, (stage, measured, mean, sd, peaks)
    assert run.metrics["peak_memory_gib"] == pytest.approx(max(measured))


def test_a_third_far_profile_reads_the_line_closer():
    """A third profile at half the stage: the line is measured up to it, its prior error is the part
    past it, so the band at the full model narrows (a 32-layer stage from 1 and 4 layers, then 16)."""
    from autotune.guide.memory_profile import refine_layers

    peaks = {k: 10.0 + 0.6 * k for k in (1, 4, 16)}
    two = fit_stage_memory({1: peaks[1], 4: peaks[4]})
    three = fit_stage_memory(peaks)
    (m2, s2), (m3, s3) = two.predict(32), three.predict(32)
    assert m2 == pytest.approx(29.2) and m3 == pytest.approx(29.2)
    assert s3 < 0.6 * s2
    # where the three do not lie on a line, their residual widens the band again
    bent = fit_stage_memory({1: 10.6, 4: 12.4, 16: 21.0})
    assert bent.predict(32)[1] > s3
    model = {"num_hidden_layers": 32}
    assert refine_layers(model, {"pp": 1}, (1, 4)) == 16
    assert refine_layers(model, {"pp": 1}, (1, 8)) == 16  # the second at a quarter: the third at half
    assert refine_layers(model, {"pp": 4}, (1, 4)) is None  # 8 per stage: half of it is the second profile
    assert refine_layers(model, {"pp": 2}, (1, 4)) == 8  # 16 per stage: 8 is past 1.5 times 4
    assert refine_layers(model, {"pp": 2}, (1, 6)) is None  # ... 8 is not past 1.5 times 6
