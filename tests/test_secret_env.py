"""Secrets given in ``backend.env`` reach the probe and no copy autotune keeps (issue #13, item 11):
not the run directory's spec copy, the trial files, the results, the result cache nor MLflow."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.spec.secret_env import MASK, masked_backend, masked_spec_text
from support import TINY_TRAIN

PROBE = r"""
import json, os, sys
with open(os.environ["SEEN"], "a") as f:  # outside the run directory: what the probe really got
    f.write(os.environ["HF_TOKEN"] + " " + os.environ["WANDB_API_KEY"] + " " + os.environ["ORG"] + "\n")
with open(os.environ["SEEN"] + ".trial", "a") as f:  # the trial file, wherever the dispatcher wrote it
    f.write(open(sys.argv[sys.argv.index("--trial") + 1]).read())
print(json.dumps({"metrics": {"tokens_per_s_per_device": 100.0, "step_time_s": 1.0}}))
"""

SECRETS = ("hf_Zq8sEcReT", "wandb-7e1f9", "acme-corp-internal")


def test_secret_env_values_reach_the_probe_and_no_copy(write_spec, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    seen = tmp_path / "seen.txt"
    spec = write_spec(
        TINY_TRAIN.replace(
            "backend: simulate",
            f"""backend:  # a launcher that needs credentials
  kind: command
  argv: [{sys.executable}, {probe}, --trial, "{{trial_file}}"]
  env:
    HF_TOKEN: {SECRETS[0]}     # masked: the name looks secret
    WANDB_API_KEY: "{SECRETS[1]}"
    ORG: {SECRETS[2]}
    SEEN: {seen}
  secret_env: [ORG]          # masked: named secret
ray: {{enabled: false}}""",
        ).replace("search: {n_trials: 6, seed: 1}", "search: {n_trials: 3, seed: 1}")
    )
    run_dir = tmp_path / "study"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert seen.read_text().splitlines()[0] == " ".join(SECRETS)  # the probe got the real values

    trial_files = Path(str(seen) + ".trial")
    assert '"HF_TOKEN"' in trial_files.read_text()  # the trial files carry backend.env, masked
    files = [p for p in run_dir.rglob("*") if p.is_file()] + [Path(os.environ["AUTOTUNE_CACHE"]), trial_files]
    assert any(p.name == "autotune_spec.yaml" for p in files) and any(p.name == "mlflow.db" for p in files)
    assert any(p.parent.name == "spec" and "mlartifacts" in p.parts for p in files)  # MLflow's copy
    for path in files:
        data = path.read_bytes()
        for secret in SECRETS:
            assert secret.encode() not in data, f"{secret} leaked into {path}"
    copy = (run_dir / "autotune_spec.yaml").read_text()
    assert copy.count(f"'{MASK}'") == 3 and "# masked: named secret" in copy and str(seen) in copy

    # the masked copy still reads as the study's spec: report works from the run directory alone
    report = CliRunner().invoke(app, ["report", str(run_dir)])
    assert report.exit_code == 0, report.output


def test_masking_keeps_every_other_byte():
    text = "name: x  # comment\nbackend:\n  kind: command\n  env: {API_TOKEN: 'abc', PLAIN: 1, DB_PASSWORD: \"p w\"}\n"
    masked = masked_spec_text(text)
    assert masked == text.replace("'abc'", f"'{MASK}'").replace('"p w"', f"'{MASK}'")
    assert masked_spec_text("backend: simulate\n") == "backend: simulate\n"
    backend = {"kind": "command", "env": {"S3_SECRET": "s", "N": "n"}, "secret_env": ["N"]}
    assert masked_backend(backend)["env"] == {"S3_SECRET": MASK, "N": MASK} and backend["env"]["N"] == "n"


# ----------------------------------------------------------------- issue #31: mask the loaded data
def _copy_of(tmp_path: Path, text: str) -> str:
    from autotune.spec.secret_env import write_spec_copy

    source = tmp_path / "spec.yaml"
    source.write_text(text)
    return write_spec_copy(source, tmp_path).read_text()


BASE = TINY_TRAIN.replace("backend: simulate\n", "")


def test_a_secret_brought_by_a_merge_key_is_masked(tmp_path):
    import yaml

    copy = _copy_of(
        tmp_path, BASE + "backend:\n  kind: simulate\n  env:\n    <<: {HF_TOKEN: hf_merged_Zq8s}\n    PLAIN: x\n"
    )
    assert "hf_merged_Zq8s" not in copy
    assert yaml.safe_load(copy)["backend"]["env"] == {"HF_TOKEN": MASK, "PLAIN": "x"}


def test_a_secret_reused_through_an_alias_is_masked_and_the_copy_still_reads_as_the_spec(tmp_path):
    from autotune.spec.load import load_spec

    copy = _copy_of(
        tmp_path, BASE + "backend:\n  kind: simulate\n  env:\n    HF_TOKEN: &tok hf_alias_Zq8s\n    OTHER_TOKEN: *tok\n"
    )
    assert "hf_alias_Zq8s" not in copy
    spec = load_spec(tmp_path / "autotune_spec.yaml")  # valid YAML, a valid spec
    assert spec.backend.env == {"HF_TOKEN": MASK, "OTHER_TOKEN": MASK}


def test_a_storage_password_is_masked_in_the_copy(tmp_path):
    copy = _copy_of(
        tmp_path,
        BASE + "backend: simulate\ntracking:\n  storage: postgresql+psycopg2://tuner:pw_Zq8s99@db:5432/optuna"
        "  # shared\n",
    )
    assert "pw_Zq8s99" not in copy and "postgresql+psycopg2://tuner:***@db:5432/optuna" in copy
    assert "# shared" in copy  # the text-level copy, comments kept, where it reads back as the masked data


PRINTING_PROBE = r"""
import json, os, sys
print("environment: " + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.endswith("TOKEN")))
print(json.dumps({"event": "failure", "status": "crash", "reason": "gave up with " + os.environ["HF_TOKEN"],
                  "info": {"env": {"HF_TOKEN": os.environ["HF_TOKEN"]}}}))
sys.exit(1)
"""


def test_a_probe_that_prints_its_environment_leaves_no_secret_in_what_autotune_stores(write_spec, tmp_path):
    probe = tmp_path / "printing.py"
    probe.write_text(PRINTING_PROBE)
    spec = write_spec(
        TINY_TRAIN.replace(
            "backend: simulate",
            f"""backend:
  kind: command
  argv: [{sys.executable}, {probe}, --trial, "{{trial_file}}"]
  env: {{HF_TOKEN: hf_printed_Zq8s}}
ray: {{enabled: false}}""",
        ).replace("search: {n_trials: 6, seed: 1}", "search: {n_trials: 2, seed: 1}")
    )
    run_dir = tmp_path / "study"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir)])
    assert result.exit_code == 1, result.output  # every trial crashed
    assert "hf_printed_Zq8s" not in result.output
    log_tail = next(run_dir.glob("trials/*/log_tail.txt")).read_text()
    assert f"HF_TOKEN={MASK}" in log_tail  # what the probe printed is kept, the value masked
    files = [p for p in run_dir.rglob("*") if p.is_file()] + [Path(os.environ["AUTOTUNE_CACHE"])]
    for path in files:
        assert b"hf_printed_Zq8s" not in path.read_bytes(), f"the secret leaked into {path}"
