"""Every script in ``benchmarks/`` runs to completion at its smallest size, so that a refactor cannot
leave one broken (as ``orchestration_overhead.py`` was: its ``StudyRunner`` got no launcher and the
Ray dispatcher died on the first probe). Each runs as a user runs it, a subprocess of this Python,
in a throwaway folder (its working directory and ``TMPDIR``), and must exit 0 and print its table.

The fast set takes seconds a script; the scripts that need minutes even at their smallest size
(real torch probes, a vLLM engine, a multi-node local Ray cluster, a calibration) are ``slow``
(opt-in: ``pytest -m slow``). ``test_every_script_has_a_smoke_test`` fails when a script is added
without a case here. No figure is asserted: on a shared 2-core machine the timings vary."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import pytest
from support import REPO

BENCH = REPO / "benchmarks"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

# modules the scripts import, with no smoke test of their own: what runs each
HELPERS = {
    "local_ray_cluster.py": "search_efficiency.py --ray-cluster (slow): the local multi-node Ray cluster",
    "true_world.py": "search_efficiency.py without --in-process: the worlds, and their launcher, one subprocess "
    "per probe (its command line is the launcher's, a trial file; tests/test_bench_production_path.py)",
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One script at its smallest size: ``args`` (``{tmp}`` is the test's folder), the lines its
    output must match (regular expressions, multi-line), the files it must write under ``{tmp}``."""

    script: str
    args: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    exit_codes: tuple[int, ...] = (0,)
    timeout_s: int = 300
    prepare: Callable[[Path], None] | None = None
    needs: Path | None = None  # a file without which the case is skipped (an optional environment)
    name: str = ""

    @property
    def id(self) -> str:
        return self.name or Path(self.script).stem


def _load(script: str):
    spec = importlib.util.spec_from_file_location(Path(script).stem, BENCH / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank_fidelity_measurements(tmp: Path) -> None:
    """An earlier ``--json`` output for ``rank_fidelity.py --measurements``: its first 4 configs,
    "measured" as the shipped profile's predictions slowed down by a different factor each."""
    module = _load("rank_fidelity.py")
    with tempfile.TemporaryDirectory(dir=tmp) as scratch:
        predicted = module.predictions(Path(scratch), None)
    rows = []
    for key, metrics in predicted.items():
        if metrics.get("tokens_per_s_per_device") and len(rows) < 4:
            slower = 20.0 * (1 + 0.15 * len(rows))
            measured = {
                "tokens_per_s_per_device": metrics["tokens_per_s_per_device"] / slower,
                "step_time_s": metrics["step_time_s"] * slower,
            }
            rows.append({"config": json.loads(key), "measured_metrics": measured})
    assert len(rows) == 4, predicted
    (tmp / "measurements.json").write_text(json.dumps({"rows": rows}))


def _kept_serving_rounds(tmp: Path) -> None:
    """Two kept exhaustive serving runs (``round0``, ``round1``: three configs' goodput, read apart by
    a tenth) and a profile with calibrate's repeat noise (``host.yaml``, 15 %, 6 degrees of freedom)."""
    import optuna
    import yaml
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    from autotune.trial_attrs import A

    for n, scale in enumerate((1.0, 0.9)):
        folder = tmp / f"round{n}"
        folder.mkdir()
        storage = JournalStorage(JournalFileBackend(str(folder / "optuna.journal")))
        study = optuna.create_study(study_name=f"round{n}", storage=storage, direction="maximize")
        for seqs, goodput in ((2, 12.0), (8, 27.0), (16, 34.0)):
            attrs = {A.CONFIG: {"max_num_seqs": seqs}, A.STATUS: "ok", A.PROBED: True, A.SOURCE: "measured"}
            attrs[A.METRICS] = {"goodput_rps_per_device": goodput * scale}
            study.add_trial(optuna.trial.create_trial(value=goodput * scale, user_attrs=attrs))
    steps = {"engine": "vllm", "decode_scale": 1.0, "prefill_scale": 1.0, "step_overhead_us": 0.0}
    (tmp / "host.yaml").write_text(
        yaml.safe_dump({"serving_steps": {**steps, "repeat_noise": 0.15, "repeat_noise_dof": 6}})
    )


def _two_search_runs(tmp: Path) -> None:
    """Two ``search_efficiency.py --json`` outputs over the same 12 worlds of two scenarios: the second
    turns 9 worlds (7b-8x32 0-8) and loses none, and reports a world the first never ran."""
    before = {
        "7b-8x64": {"autotune": [{"world": w, "final": 1.0} for w in range(12)]},
        "7b-8x32": {"autotune": [{"world": w, "final": 0.95} for w in range(12)]},
    }
    after = json.loads(json.dumps(before))
    for row in after["7b-8x32"]["autotune"][:9]:
        row["final"] = 0.99
    after["7b-8x64"]["autotune"].append({"world": 12, "final": 0.5})
    (tmp / "before.json").write_text(json.dumps(before))
    (tmp / "after.json").write_text(json.dumps(after))


def _two_runs_of_different_worlds(tmp: Path) -> None:
    """Worlds 0-11 (``before.json``) and 12-23 (``later.json``) of two scenarios: 7b-8x32 right in the
    later run's worlds 12-20 only, its misses named by two causes, one wrong certificate and a
    tenth of its probes out of memory in world 0 (0.4 %: the mean of its 24 studies' shares); a third file repeats world 0."""
    first = {
        "7b-8x64": {"autotune": [{"world": w, "final": 1.0} for w in range(12)]},
        "7b-8x32": {"autotune": [{"world": w, "final": 0.95, "miss": "race"} for w in range(12)]},
    }
    first["7b-8x32"]["autotune"][0].update(probes=40, oom_share=0.1, certified=True)
    later = {
        "7b-8x64": {"autotune": [{"world": w, "final": 1.0} for w in range(12, 24)]},
        "7b-8x32": {"autotune": [{"world": w, "final": 0.99, "probes": 10} for w in range(12, 24)]},
    }
    for row in later["7b-8x32"]["autotune"][9:]:
        row.update(final=0.9, miss="model")
    for name, data in (
        ("before", first),
        ("later", later),
        ("again", {"7b-8x64": {"autotune": [{"world": 0, "final": 1}]}}),
    ):
        (tmp / f"{name}.json").write_text(json.dumps(data))


SEARCH = ("--methods", "autotune", "--worlds", "1", "--scenarios", "7b-8x64", "--budget", "3")
SEARCH_TABLE = (
    r"^7b-8x64 world 0 autotune .* full probes [1-9]",
    r"^\| scenario \| worlds \|",
    r"^\| 7b-8x64 \| 1 \|",
    r"^repeats after an OOM",
)
TINY_TORCH = ("--warmup", "1", "--measured", "1", "--repeats", "1", "--seq-len", "32", "--global-batch", "2")

FAST = [
    Case(
        "compare_search_runs.py",
        ("--before", "{tmp}/before.json", "--after", "{tmp}/after.json"),
        (
            r"^\| 7b-8x32 \| 12 \| 0 \(0\.0%\) \| 9 \(75\.0%\) \| 9 \| 0 \| 0\.00 \|",
            r"^\| 7b-8x64 \| 12 \| 12 \(100\.0%\) \| 12 \(100\.0%\) \| 0 \| 0 \| 1\.00 \|",
            r"^pooled: 9 turned, 0 lost, p = 0\.00: a difference",
        ),
        prepare=_two_search_runs,
    ),
    Case(  # two runs of different worlds read as one sample: 7b-8x32 right in 9 of 24, two causes
        "pool_search_runs.py",
        ("{tmp}/before.json", "{tmp}/later.json"),
        (
            r"^2 run\(s\) pooled \(autotune\)",
            r"^\| 7b-8x32 \| 24 \| 9/24 = 37\.5% \[19%-59%\] \| 9/24 = 37\.5% \[19%-59%\] \| 0\.4% \| 1 \(0\) \| "
            r"race: 12; model: 3 \|$",
            r"^\| all \| 48 \| 33/48 = 68\.8% \[54%-81%\] \|",
        ),
        prepare=_two_runs_of_different_worlds,
    ),
    Case(  # two studies of the search benchmark, each judged at its end by every rule
        "report_rules.py",
        (
            "--json",
            "{tmp}/picks.json",
            "--",
            "--in-process",
            "--worlds",
            "2",
            "--scenarios",
            "7b-8x64",
            "--budget",
            "8",
        ),
        (
            r"^the report's rule against others",
            r"^\| study \| 2 \| \d \(\d+\.\d%\) \| 0 \| 0 \|",
            r"^\| prediction \+ readings \| 2 \| ",
        ),
        writes=("picks.json",),
    ),
    Case(  # kept rounds judged: each reading's interval at the host's noise against the other round
        "serving_host_noise.py",
        ("--profile", "{tmp}/host.yaml", "--rounds", "{tmp}/round0", "{tmp}/round1"),
        (
            r"^host noise 15\.0% per reading, 6 degrees of freedom",
            r"^3 configs x 2 rounds: the other rounds' readings inside the interval 6 of 6; the mean over the "
            r"rounds inside it 6 of 6",
        ),
        prepare=_kept_serving_rounds,
    ),
    Case("simulator_speed.py", ("1000",), (r"^1000 configs: conversion", r"configs/s including conversion")),
    Case("simulator_fidelity.py", (), (r"^row\s+metric\s+predicted\s+measured", r"MAPE over \d+ rows")),
    Case(
        "scaling_fidelity.py",
        (),
        (
            r"^group\s+devices\s+ratio\s+measured\s+projected",
            r"^projection: median abs error",
            r"^projection: 80 % of the rows at 4-16x within",
        ),
    ),
    Case(
        "profile_extrapolation.py",
        ("--scenarios", "7b-8x32", "--worlds", "1", "--layouts", "20"),
        (r"^profiles\s+layouts\s+mean error", r"^two profiles\s+\d+\s+[+-][\d.]+%", r"^three\s+\d+\s+"),
    ),
    Case(
        "scaling_unpriced_worlds.py",
        ("--worlds", "2"),
        (r"^projection from 1 node\(s\) of 8 devices, \d+ configs", r"^overlap_break\s+16 n\s+[\d.]+%"),
    ),
    Case(
        "serving_fidelity.py",
        ("--markdown", "{tmp}/serving.md"),
        (
            r"^## Serving model fidelity",
            r"^\| row \| configuration \| metric \|",
            r"clean rows: mean absolute error",
            r"\*\*Held out \(\d+ clean rows\): mean absolute error \d+ %\*\*",
            r"^- vLLM \(4 rows\): decode x[\d.]+, prompt x[\d.]+",
        ),
        writes=("serving.md",),
    ),
    Case(
        "serving_disagg_published.py",
        ("--quick", "--json", "{tmp}/pd.json"),
        (
            r"^\| distserve-prefill-worker \| measured \|",
            r"^\| distserve-ratio \| measured \| .* \| 2\.08 \| [\d.]+ \([\d.]+\) \|",
            r"^- measured: \d+ clean rows, mean absolute error \d+ %",
        ),
        writes=("pd.json",),
    ),
    Case(
        "serving_queue_vs_scheduler.py",
        ("--quick", "--json", "{tmp}/queue.json"),
        (
            r"^\| case \| req/s \| TTFT p50 model / scheduler \|",
            r"^\| OPT-13B, 1 x A100, 512/64, whole prompts \| 4 \| \d+ / \d+ \|",
        ),
        writes=("queue.json",),
    ),
    Case(
        "huge_space.py",
        ("--size", "small", "--keep", "{tmp}"),
        (r"^\$ -m autotune\.cli plan ", r"^  exit 0, wall [\d.]+ s, peak RSS \d+ MiB"),
        writes=("huge_space_small.yaml",),
    ),
    Case(
        "search_efficiency.py",
        (*SEARCH, "--in-process", "--json", "{tmp}/worlds.json", "--trace"),
        (
            *SEARCH_TABLE,
            r"^  #0 ",  # --trace: each trial against the world's truth, then the guide's view of the optimum
            r"^  optimum at the end \{.*\}: peak [\d.]+ \+/- [\d.]+ GiB .* P\(fits\) [\d.]+ \(its own peak against",
        ),
        writes=("worlds.json",),
        name="search_efficiency-in-process",
    ),
    Case(  # the world's launcher (true_world.py) as a subprocess per probe, as a user's launcher runs
        "search_efficiency.py",
        (*SEARCH, "--json", "{tmp}/worlds.json"),
        SEARCH_TABLE,
        writes=("worlds.json",),
        name="search_efficiency-launcher",
    ),
    Case(
        "dispatch_overhead.py",
        ("--trials", "4", "--parallel", "2", "--repeats", "1"),
        (
            r"^dispatcher\s+probe\s+median ms/trial",
            r"^raw spawn \(reference\)\s+sh\s+[\d.]+",
            r"^LocalProcessDispatcher\s+python\s+[\d.]+",
            r"^RayDispatcher\s+sh\s+[\d.]+",
        ),
    ),
    Case(
        "silences.py",
        ("--only", "run-simulated"),
        (r"^command\s+longest silence", r"^run-simulated\s+[\d.]+ s\s+[\d.]+ s\s+0 "),
    ),
    Case(  # one real torch probe (2 gloo processes, fresh ones: no warm server left behind), a few seconds
        "torch_probe_overhead.py",
        ("--modes", "dp2", "--launchers", "spawn", *TINY_TORCH),
        (r"^mode\s+launcher\s+wall s", r"^dp2\s+spawn\s+[\d.]+", r'"benchmark": "torch_probe_overhead"'),
        name="torch_probe_overhead-spawn",
    ),
    Case(  # no probe: judged against an earlier run's measurements (the probes: the slow case below)
        "rank_fidelity.py",
        ("--measurements", "{tmp}/measurements.json", "--refit-probes", "1"),
        (
            r"^4 configs measured on this host",
            r"^shipped cpu profile: Spearman -?[\d.]+, median abs error",
            r"^after 1 refit probes \(.*\), on the other 3: Spearman",
        ),
        prepare=_rank_fidelity_measurements,
        name="rank_fidelity-measurements",
    ),
]

SLOW = [
    Case(  # CI time (26 s): the opt-in step
        "orchestration_overhead.py",
        ("--trials", "4", "--parallel", "2", "--repeats", "1"),
        (
            r"^\(local Ray start: [\d.]+ s",
            r"^sampler\s+tracking\s+median ms/trial",
            r"^random\s+off\s+[\d.]+",
            r"^random\s+mlflow\s+[\d.]+",
            r"^auto\s+off\s+[\d.]+",
            r"^auto\s+mlflow\s+[\d.]+",
        ),
    ),
    Case(  # CI time (22 s): the opt-in step
        "load.py",
        ("--trials", "4", "--parallel", "2", "--backend", "simulate"),
        (r"^first run: .* stopped: budget reached", r"^re-run changed nothing: True; lost 0, duplicated 0"),
    ),
    Case(
        "rank_fidelity.py",
        ("--configs", "3", "--refit-probes", "1", "--json", "{tmp}/rank.json"),
        (r"^\d configs measured on this host", r"^after 1 refit probes .* on the other \d: Spearman"),
        writes=("rank.json",),
        timeout_s=900,
        name="rank_fidelity-probes",
    ),
    Case(  # every config of its space once, then one study of 2 probes: the acceptance's smallest run
        "certified_cpu_study.py",
        ("--rounds", "1", "--runs", "1", "--n-trials", "2", "--json", "{tmp}/certified.json"),
        (r"^reference: 12 configs x 1 readings; best", r"^\| run \| recommended", r"^\| 0 \| [\d.]+% \|"),
        writes=("certified.json",),
        timeout_s=900,
    ),
    Case(  # two configs at 1 and 2 nodes of the local Ray cluster, one reading each, the 2-node link measured
        "scaling_cpu_cluster.py",
        ("--configs", "2", "--repeats", "1", "--steps", "2", "--nodes", "2", "--run-dir", "{tmp}/scale", "--links"),
        (
            r"across 2 nodes [\d.e+-]+ GB/s per rank",
            r"^trial\s+1 node\(s\)\s+2 node\(s\)\s+from 1",
            r"^from 1 node\(s\) to 2: median abs error [\d.]+ %",
        ),
        timeout_s=900,
    ),
    Case(  # a 2-probe study at full size and on a 1-node slice of a 2-node target
        "slice_study_cpu_cluster.py",
        ("--trials", "2", "--repeats", "1", "--steps", "2", "--nodes", "2", "--run-dir", "{tmp}/slice"),
        (r"^ full: trial \d+ ", r"^slice: trial \d+ ", r"^slice pick / full-size pick at 2 nodes: [\d.]+; device"),
        timeout_s=900,
    ),
    Case(
        "simulator_vs_cpu_probe.py",
        ("--trials", "3", "--keep", "{tmp}/run"),
        (r"^profile: cpu; \d measured configs", r"^trial\s+predicted\s+measured", r"Spearman|fewer than 3"),
        timeout_s=900,
    ),
    Case(  # the warm launcher (the default on a CPU node: a server started by the first trial) and torchrun
        "torch_probe_overhead.py",
        ("--modes", "dp2", "--launchers", "warm,torchrun", *TINY_TORCH),
        (r"^warm launcher: first trial \(starts the server\)", r"^dp2\s+warm\s+[\d.]+", r"^dp2\s+torchrun\s+[\d.]+"),
        timeout_s=600,
        name="torch_probe_overhead-warm-torchrun",
    ),
    Case(  # exit 1: every step ran but the full probe's peak fell outside the profiles' band (a measurement)
        "accelerator_check.py",
        ("--device", "cpu", "--size", "tiny", "--out", "{tmp}/out", "--configs", "1", "--quiet"),
        tuple(rf"^\| {step} \| ok \|" for step in ("sweep", "calibrate", "memory_profile", "full_probe", "comparison")),
        writes=("out/accelerator_check.json", "out/accelerator_check.md"),
        exit_codes=(0, 1),
        timeout_s=900,
    ),
    Case(
        "serving_cpu_study.py",
        ("--quick", "--keep", "{tmp}/serving"),
        (r"^exhaustive: 2 configs measured", r"^study: \d configs measured", r"^recommended: trial \d+ "),
        timeout_s=1500,
        needs=VLLM_PYTHON,
    ),
    Case(  # issue 46: the serving model before any trial against the two configs measured, per rate too
        "serving_cpu_study.py",
        ("--quick", "--model-check", "--keep", "{tmp}/serving"),
        (
            r"^worst factor [\d.]+x over 2 configs",
            r"^\| 8, chunked True \| [\d.]+ \| .+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \([\d.]+\) \| [\d.]+ \|$",
            r"^  tpot_p50_ms: median [\d.]+, range",
            r"^refit: worst factor [\d.]+x over 2 configs",
        ),
        timeout_s=900,
        needs=VLLM_PYTHON,
        name="serving_cpu_study-model-check",
    ),
    Case(  # issue 46: the model and the study's refit against each config's mean over two rounds
        "serving_cpu_study.py",
        ("--quick", "--model-check", "--rounds", "2", "--keep", "{tmp}/serving"),
        (
            r"^2 runs of every config; each figure against the config's mean over them",
            r"^\| 8, chunked True \| [\d.]+, [\d.]+ \| [\d.]+ \([\d.]+\) \| [\d.]+, [\d.]+ \| [\d.]+ \([\d.]+\) \|$",
            r"^worst factor against the mean: [\d.]+x before any trial, [\d.]+x after the refit, over 2 configs",
        ),
        timeout_s=1500,
        needs=VLLM_PYTHON,
        name="serving_cpu_study-rounds",
    ),
    Case(
        "silences.py",
        (),
        tuple(rf"^{name}\s+[\d.]+ s\s+[\d.]+ s\s+0 " for name in ("run-simulated", "run-torch", "calibrate", "doctor")),
        timeout_s=900,
        name="silences-all",
    ),
    Case(  # a 4-node trial through a local multi-node Ray cluster (local_ray_cluster.py), one launcher per node
        "search_efficiency.py",
        (
            "--methods",
            "autotune",
            "--worlds",
            "1",
            "--scenarios",
            "70b-32x64",
            "--budget",
            "2",
            "--ray-cluster",
            "--wall-scale",
            "0.2",
        ),
        (r"^70b-32x64 world 0 autotune .* full probes [1-9]", r"^\| scenario \| worlds \|", r"^\| 70b-32x64 \| 1 \|"),
        timeout_s=1200,
        name="search_efficiency-ray-cluster",
    ),
]


def _bench_files() -> set[Path]:
    return {p for p in BENCH.rglob("*") if "__pycache__" not in p.parts}


def run_case(case: Case, tmp_path: Path) -> str:
    """Run the case's script in ``tmp_path``; its output, once the case's checks pass."""
    if case.needs is not None and not case.needs.exists():
        pytest.skip(f"{case.needs} is not here")
    if case.prepare is not None:
        case.prepare(tmp_path)
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(
        TMPDIR=str(scratch),  # the scripts' temporary folders (load.py's is never removed) land in tmp_path
        # Ray's sockets stay where they would be: a socket path is at most 107 bytes long
        RAY_TMPDIR=os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),  # silences.py: `autotune`
        RAY_AUTH_MODE="disabled",
        NO_COLOR="1",
    )
    argv = [sys.executable, str(BENCH / case.script), *(a.format(tmp=tmp_path) for a in case.args)]
    before = _bench_files()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=case.timeout_s)
    output = proc.stdout + proc.stderr
    said = f"$ {' '.join(argv[1:])}\nexit {proc.returncode}\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode in case.exit_codes, said
    for pattern in case.expect:
        assert re.search(pattern, output, re.MULTILINE), f"no line matches {pattern!r}\n{said}"
    for name in case.writes:
        assert (tmp_path / name).is_file(), f"{name} not written\n{said}"
    assert _bench_files() == before, "the script wrote into benchmarks/"
    return output


@pytest.mark.parametrize("case", FAST, ids=lambda c: c.id)
@pytest.mark.timeout(400)
def test_fast(case: Case, tmp_path: Path):
    run_case(case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=lambda c: c.id)
@pytest.mark.timeout(1800)
def test_slow(case: Case, tmp_path: Path):
    output = run_case(case, tmp_path)
    if case.id == "rank_fidelity-probes":  # the earlier run's measurements judge again without probes
        report = json.loads((tmp_path / "rank.json").read_text())
        assert len(report["rows"]) >= 2 and all(r["measured"] > 0 for r in report["rows"]), output
        again = Case(
            "rank_fidelity.py",
            ("--measurements", "{tmp}/rank.json", "--refit-probes", "1"),
            (rf"^{len(report['rows'])} configs measured on this host",),
        )
        run_case(again, tmp_path)


def test_report_rules_counts_each_rules_turned_and_lost_studies_against_the_report():
    """``report_rules.table``: a rule's pick is right within the tolerance; it turned a study the
    report missed and lost one the report had; a study with no picks (nothing measured) counts nowhere."""
    rules = _load("report_rules.py")
    other = {r: 1.0 for r in rules.RULES if r != "study"}
    rows = [
        {**other, "study": 0.95, "mean reading": 0.99},  # every rule right, the report wrong
        {**other, "study": 0.99, "mean reading": 0.90},  # the mean reading lost it
        {**other, "study": 0.985, "mean reading": 0.975},  # within 3 % both, within 2 % the mean reading lost it
        {"study": 0.0},  # nothing measured: no picks
    ]
    by_rule = {r["rule"]: r for r in rules.table(rows, 0.02)}
    assert by_rule["study"] == dict(rule="study", studies=3, right=2, turned=0, lost=0)
    assert by_rule["mean reading"] == dict(rule="mean reading", studies=3, right=1, turned=1, lost=2)
    assert by_rule["model, every measured"] == dict(rule="model, every measured", studies=3, right=3, turned=1, lost=0)
    wider = {r["rule"]: r for r in rules.table(rows, 0.03)}
    assert wider["mean reading"]["lost"] == 1 and wider["mean reading"]["right"] == 2


def test_report_rules_pools_earlier_runs_and_names_a_file_it_cannot_read(tmp_path: Path, capsys):
    """``--pool``: the table over earlier runs' picks, no search run; a file that is not one is named."""
    rules = _load("report_rules.py")
    row = {r: 1.0 for r in rules.RULES}
    for name, study in (("a.json", 1.0), ("b.json", 0.9)):
        (tmp_path / name).write_text(json.dumps([{**row, "study": study}]))
    assert rules.main(["--pool", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\| study \| 2 \| 1 \(50\.0%\) \| 0 \| 0 \|", out, re.M), out
    assert re.search(r"^\| mean reading \| 2 \| 2 \(100\.0%\) \| 1 \| 0 \|", out, re.M), out
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(SystemExit, match="c.json: not a report_rules.py --json output"):
        rules.main(["--pool", str(tmp_path / "c.json")])


def test_every_script_has_a_smoke_test():
    """Each ``benchmarks/*.py`` is run by a case above, or is a helper module a case's script runs."""
    scripts = {p.name for p in BENCH.glob("*.py")}
    cased = {c.script for c in FAST + SLOW}
    missing = scripts - cased - set(HELPERS)
    assert not missing, f"benchmark scripts without a smoke test here (add a Case to FAST or SLOW): {sorted(missing)}"
    gone = (cased | set(HELPERS)) - scripts
    assert not gone, f"cases for scripts that are no longer in benchmarks/: {sorted(gone)}"
    assert not cased & set(HELPERS), "a helper module with a case of its own: drop it from HELPERS"
    for helper in HELPERS:  # a helper is imported by a script that runs here
        importers = [
            s for s in cased if re.search(rf"^(from|import) {Path(helper).stem}\b", (BENCH / s).read_text(), re.M)
        ]
        assert importers, f"{helper} is imported by no benchmark script: give it a case of its own"
    assert len({c.id for c in FAST + SLOW}) == len(FAST + SLOW), "two cases with the same id"


def test_pool_search_runs_refuses_a_world_counted_twice_and_names_a_file_it_cannot_read(tmp_path: Path):
    """A pooled sample counts each world once: a world in two files is an error naming the file and
    the world; a file that is not a search output is named; no study at all is exit 2."""
    pool = _load("pool_search_runs.py")
    _two_runs_of_different_worlds(tmp_path)
    with pytest.raises(SystemExit, match=r"again.json: 7b-8x64 world 0 is in an earlier file too"):
        pool.main([str(tmp_path / "before.json"), str(tmp_path / "again.json")])
    (tmp_path / "c.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="c.json: not a search_efficiency.py --json output"):
        pool.main([str(tmp_path / "c.json")])
    assert pool.main([str(tmp_path / "later.json"), "--method", "random"]) == 2
    with pytest.raises(SystemExit):
        pool.main([str(tmp_path / "later.json"), "--within", "1.5"])
