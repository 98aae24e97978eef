"""Secrets given in ``backend.env`` reach the probe and no copy autotune keeps (issue #13, item 11):
not the run directory's spec copy, the trial files, the results, the result cache nor MLflow."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from typer.testing import CliRunner

from autotune.cli import app
from autotune.secret_env import MASK, masked_backend, masked_spec_text
from support import TINY_TRAIN

PROBE = r'''
import json, os, sys
with open(os.environ["SEEN"], "a") as f:  # outside the run directory: what the probe really got
    f.write(os.environ["HF_TOKEN"] + " " + os.environ["WANDB_API_KEY"] + " " + os.environ["ORG"] + "\n")
with open(os.environ["SEEN"] + ".trial", "a") as f:  # the trial file, wherever the dispatcher wrote it
    f.write(open(sys.argv[sys.argv.index("--trial") + 1]).read())
print(json.dumps({"metrics": {"tokens_per_s_per_device": 100.0, "step_time_s": 1.0}}))
'''

SECRETS = ("hf_Zq8sEcReT", "wandb-7e1f9", "acme-corp-internal")


def test_secret_env_values_reach_the_probe_and_no_copy(write_spec, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    seen = tmp_path / "seen.txt"
    spec = write_spec(TINY_TRAIN.replace("backend: simulate", f"""backend:  # a launcher that needs credentials
  kind: command
  argv: [{sys.executable}, {probe}, --trial, "{{trial_file}}"]
  env:
    HF_TOKEN: {SECRETS[0]}     # masked: the name looks secret
    WANDB_API_KEY: "{SECRETS[1]}"
    ORG: {SECRETS[2]}
    SEEN: {seen}
  secret_env: [ORG]          # masked: named secret
ray: {{enabled: false}}""").replace("search: {n_trials: 6, seed: 1}", "search: {n_trials: 3, seed: 1}"))
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
