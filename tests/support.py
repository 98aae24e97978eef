"""Constants and helpers the tests share (imported as ``support``; fixtures stay in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TINY_TRAIN = """
name: tiny
model: tiny-llama
workload: {kind: train, seq_len: 128, global_batch_size: 8, warmup_steps: 1, measured_steps: 2}
cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2}
backend: simulate
space:
  tp: [1, 2]
  pp: [1, 2]
  micro_batch_size: [1, 2, 4]
  zero_stage: [0, 1, 3]
  recompute: [none, full]
objectives: [tokens_per_s_per_device]
search: {n_trials: 6, seed: 1}
"""


def free_port() -> int:
    """A TCP port nothing listens on now (for a server a test starts on loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlflow_runs(tracking_uri: str | Path, experiment: str) -> tuple[list, list]:
    """(parent runs, child runs) of an experiment; a run directory stands for its SQLite store."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{Path(tracking_uri) / 'mlflow.db'}" if isinstance(tracking_uri, Path) else tracking_uri
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return parents, children


def read_pid(path: Path, within_s: float = 30.0) -> int:
    """The pid a test probe wrote into ``path`` (waiting for the probe to start)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.02)
    raise AssertionError(f"{path} was never written")


# The guide's own tests (test_guided.py, test_guided_sampler.py): Llama-2-7B on one 8-NPU node
# with 40 GiB devices, so that memory decides, over a space no single stack restricts.
GUIDED_SPEC = {
    "name": "guided",
    "model": "llama2-7b",
    "workload": {"kind": "train", "seq_len": 4096, "global_batch_size": 64},
    "cluster": {
        "accelerator": "npu",
        "profile": "ascend-910b",
        "nodes": 1,
        "devices_per_node": 8,
        "overrides": {"device_memory_gib": 40},
    },
    "target": "none",
    "space": {
        "tp": [1, 2, 4, 8],
        "pp": [1, 2, 4],
        "micro_batch_size": [1, 2, 4],
        "recompute": ["none", "selective", "full"],
        "zero_stage": [0, 1, 3],
        "sequence_parallel": [False, True],
    },
    "objectives": [{"metric": "tokens_per_s_per_device", "direction": "maximize"}],
}


# A user's launcher: reads the trial file, logs when it ran, prints one metrics line. Throughput
# rises with micro-batch and falls with tp; micro-batch 4 without recompute "runs out of memory".
COMMAND_PROBE = r"""
import json, os, sys, time
trial = json.load(open(sys.argv[sys.argv.index("--trial") + 1]))
p = trial["params"]
log = os.environ["PROBE_LOG"]
with open(log, "a") as f:
    f.write(json.dumps({"event": "start", "t": time.time(), "pid": os.getpid(), "params": p}) + "\n")
time.sleep(float(os.environ.get("PROBE_SLEEP", "0.3")))
with open(log, "a") as f:
    f.write(json.dumps({"event": "end", "t": time.time(), "pid": os.getpid()}) + "\n")
if p["micro_batch_size"] == 4 and p["recompute"] == "none":
    print("RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB", flush=True)
    sys.exit(1)
tps = 1000.0 * p["micro_batch_size"] / (1.3 if p["recompute"] == "full" else 1.0) / p["tp"]
print(json.dumps({"event": "step", "step": 0, "step_time_s": 0.1}))
print(json.dumps({"metrics": {"tokens_per_s_per_device": tps, "step_time_s": 1.0}}))
"""


def command_spec(write_spec, tmp_path: Path, *, n_trials: int, parallel: int, ray: str, sleep: float = 0.3) -> Path:
    script = tmp_path / "probe.py"
    script.write_text(COMMAND_PROBE)
    text = TINY_TRAIN.replace(
        "backend: simulate",
        f"""backend:
  kind: command
  argv: [{sys.executable}, {script}, --trial, "{{trial_file}}"]
  timeout_s: 60
  resources: {{num_cpus: 1}}
  env: {{PROBE_LOG: "{tmp_path / "probe_log.jsonl"}", PROBE_SLEEP: "{sleep}"}}""",
    )
    text = text.replace(
        "search: {n_trials: 6, seed: 1}",
        f"search: {{n_trials: {n_trials}, parallel_trials: {parallel}, sampler: random, seed: 3}}\n{ray}",
    )
    return write_spec(text, "command.yaml")


def probe_log(tmp_path: Path) -> list[dict]:
    path = tmp_path / "probe_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ------------------------------------------------------------------ probes that leave processes behind
def script(tmp_path: Path, code: str, name: str = "probe.py") -> list[str]:
    """argv of a Python probe written from ``code`` (dedented) into ``tmp_path``."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return [sys.executable, str(path)]


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def wait_dead(pid: int, within_s: float = 15.0) -> bool:
    """True once ``pid`` is gone (or a zombie) within ``within_s``."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


GRANDCHILD_THEN = """
    print("started", flush=True)
    time.sleep(60)
"""


def grandchild_probe(
    tmp_path: Path, pid_file: Path, then: str = GRANDCHILD_THEN, grandchild_output: str = "", lives_s: int = 60
) -> list[str]:
    """A probe that starts a grandchild (sleeping ``lives_s``, a minute by default) which writes its
    pid to ``pid_file``, and goes on only once the grandchild is up; ``then`` is the rest of the probe."""
    spawn = f"""
        import json, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c",
            "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep({lives_s})", sys.argv[1]]
            {grandchild_output})
        while True:
            try:
                if open(sys.argv[1]).read():
                    break
            except OSError:
                pass
            time.sleep(0.01)
    """
    return script(tmp_path, textwrap.dedent(spawn) + textwrap.dedent(then), "grandchild_probe.py") + [str(pid_file)]


def measured_record(number: int, config: dict, metrics: dict, source: str = "measured", **fields):
    """A probed, completed trial as the records read it back (``autotune.study.records``): status
    ok unless ``fields`` say otherwise (``status``, ``predicted``, ``memory_profile`` ...)."""
    from autotune.study.records import TrialRecord

    values = dict(
        number=number,
        state="COMPLETE",
        config=config,
        status="ok",
        source=source,
        metrics=metrics,
        predicted={},
        reason="",
        probed=True,
        baseline=False,
        chosen_because="",
        values=None,
        feasible=True,
    )
    return TrialRecord(**{**values, **fields})


def flat_guide(n: int, **settings):
    """A guide over ``n`` configs (micro-batch 1..n) that the model predicts alike (1000 tokens/s,
    10 GiB of 64): what it decides then rests on the readings (the race, the drift checks)."""
    from types import SimpleNamespace

    import numpy as np

    from autotune.guide.guided import Guide, GuideSettings

    configs = [{"micro_batch_size": i + 1} for i in range(n)]
    ranking = SimpleNamespace(
        predictions={
            "tokens_per_s_per_device": np.full(n, 1000.0),
            "peak_memory_gib": np.full(n, 10.0),
            "memory_limit_gib": np.full(n, 64.0),
            "valid": np.ones(n, bool),
        },
        enumeration=SimpleNamespace(configs=configs, params=["micro_batch_size"]),
        objectives=[("tokens_per_s_per_device", "maximize")],
    )
    return Guide(ranking, ("tokens_per_s_per_device", "maximize"), GuideSettings(**settings))


def launcher_study(write_spec, probe: Path, space: str, search: str, name: str) -> Path:
    """A one-device tiny-Llama training spec through the command backend, the launcher ``probe``
    (a script that reads ``--trial FILE`` and prints the metrics line)."""
    return write_spec(
        f"""
name: {name}
model: tiny-llama
workload: {{kind: train, seq_len: 128, global_batch_size: 8}}
cluster: {{accelerator: cpu, nodes: 1, devices_per_node: 1, overrides: {{device_memory_gib: 16}}}}
backend:
  kind: command
  argv: [{sys.executable}, {probe}, --trial, "{{trial_file}}"]
  timeout_s: 60
  resources: {{num_cpus: 1}}
space:
{textwrap.indent(space.strip(), "  ")}
objectives: [tokens_per_s_per_device]
search: {search}
ray: {{enabled: false}}
"""
    )


def run_launcher_study(
    write_spec, tmp_path: Path, probe_source: str, space: str, search: str, name: str
) -> tuple[Path, dict, dict]:
    """A :func:`launcher_study` with the launcher ``probe_source``, run through the CLI (``run --json
    --no-tracking``, which must succeed) and reported (``report --json``): (the spec, the run's
    payload, the report)."""
    from typer.testing import CliRunner

    from autotune.cli.commands import app

    probe = tmp_path / "probe.py"
    probe.write_text(probe_source)
    spec = launcher_study(write_spec, probe, space, search, name)
    runner = CliRunner()
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--json", "--no-tracking"])
    assert result.exit_code == 0, result.output
    report = runner.invoke(app, ["report", str(spec), "--run-dir", str(run_dir), "--json"])
    return spec, json.loads(result.stdout), json.loads(report.stdout)


def calibration_in_child(accelerator, ranks, threads, base, progress=lambda _: None):
    """A stand-in for the calibration that says where it ran (importable by a spawned child)."""
    progress(f"measuring {accelerator}")
    return {"pid": os.getpid(), "accelerator": accelerator, "ranks": ranks}


# ---- vLLM's own parser and stand-ins for its servers (the vllm exports' tests)
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SERVER_VARIABLES = (
    "ASCEND_RT_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "VLLM_CPU_OMP_THREADS_BIND",
    "HCCL_BUFFSIZE",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
)


def vllm_stand_ins(tmp_path: Path) -> Path:
    """``vllm`` and ``python`` stand-ins recording argv and the variables a server reads
    (:data:`SERVER_VARIABLES`), one file per process in ``$RECORD_DIR``; the folder to put first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    recorder = (
        f"#!{sys.executable}\n"
        "import json, os, sys, uuid\n"
        f"keep = {SERVER_VARIABLES!r}\n"
        "record = {'argv': sys.argv, 'env': {k: os.environ[k] for k in keep if k in os.environ}}\n"
        "path = os.path.join(os.environ['RECORD_DIR'], uuid.uuid4().hex + '.json')\n"
        "open(path, 'w').write(json.dumps(record))\n"
    )
    for name in ("vllm", "python"):
        (bin_dir / name).write_text(recorder)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def server_words(record: dict) -> list[str]:
    """The words vLLM's serve parser sees: after ``vllm serve``, or after ``-m MODULE`` on CPU."""
    argv = record["argv"]
    if Path(argv[0]).name == "vllm":
        assert argv[1] == "serve"
        return argv[2:]
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    return argv[3:]


def vllm_parse_on_tiny(records: list[dict], folder: Path) -> list[dict]:
    """vLLM's parse and engine config of each recorded server's command line, its checkpoint swapped
    for a tiny Llama's config.json in ``folder`` (16 heads, so that vLLM checks the parallel layout
    and not the weights; dummy weights, no tokenizer)."""
    from autotune.stacks.vllm import hf_config

    model = folder / "tiny"
    model.mkdir(exist_ok=True)
    tiny = {"name": "tiny", "arch": "llama", "hidden_size": 256, "num_hidden_layers": 4}
    tiny |= {"num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 512, "vocab_size": 512}
    (model / "config.json").write_text(json.dumps(hf_config({**tiny, "max_position_embeddings": 4096}, {})))
    cases = [[str(model), *server_words(r)[1:], "--load-format", "dummy", "--skip-tokenizer-init"] for r in records]
    return vllm_parse(cases, engine_config=True)


def vllm_parse(cases: list[list[str]], engine_config: bool = False) -> list[dict]:
    """vLLM's own parse of each command line (one interpreter start for all:
    tests/fixtures/vllm/parse_serve_args.py); ``engine_config``: also the engine config vLLM builds
    from it (the model a folder with a config.json)."""
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(REPO / "tests" / "fixtures" / "vllm" / "parse_serve_args.py")],
        input=json.dumps([{"argv": argv, "engine_config": engine_config} for argv in cases]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(proc.stdout.strip().splitlines()[-1])
    assert payload["vllm"].startswith("0.")
    return payload["results"]


# a chat workload for a 70B model: p99 TTFT 2 s / TPOT 60 ms (the multi-node and MindIE PD tests)
CHAT_70B = {
    "kind": "serve",
    "traffic": {
        "rates": [0.5, 1, 2, 4],
        "prompt_len": {"low": 512, "high": 2048},
        "output_len": {"low": 128, "high": 512},
        "duration_s": 60,
    },
    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60},
    "max_model_len": 2560,
}

SERVING_CONFIG = {  # a serving config's settings beside its layout (tests build the layout they test)
    "max_num_seqs": 128,
    "max_num_batched_tokens": 4096,
    "block_size": 16,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": True,
    "memory_utilization": 0.9,
    "graph_mode": "graph",
    "kv_cache_dtype": "auto",
    "quantization": "none",
    "precision": "bf16",
}


def serving_config(**layout) -> dict:
    """:data:`SERVING_CONFIG` with ``layout`` (tp, pp, replicas, a prefill pool...) and the devices it takes."""
    from autotune.workers.parameters import trial_devices

    config = {**SERVING_CONFIG, **layout}
    config["world_size"] = trial_devices("serve", config)
    return config


def predicted_by_seqs_and_chunked(spec_path, profile) -> dict:
    """The serving model's figures for every config of the spec's space (its ``max_num_seqs`` x
    ``enable_chunked_prefill``), on ``profile``, by (max_num_seqs, chunked)."""
    import itertools

    from autotune.spec.load import load_spec
    from autotune.spec.resolve import probe_context
    from autotune.spec.space import Space
    from autotune.workers.simulate import columns_from_params, simulate_configs

    spec = load_spec(spec_path)
    ctx = probe_context(spec)
    space = Space(spec)
    combos = list(itertools.product(space.choices["max_num_seqs"], space.choices["enable_chunked_prefill"]))
    configs = [space.resolve({"max_num_seqs": m, "enable_chunked_prefill": c}).config for m, c in combos]
    out = simulate_configs(
        dict(ctx.model), dict(ctx.workload), profile, dict(ctx.cluster), columns_from_params(configs)
    )
    return {combo: {k: float(v[i]) for k, v in out.items() if hasattr(v, "__len__")} for i, combo in enumerate(combos)}


def serving_preset_run(ctx):
    """The stack presets' launch input for an export context's serving config (its model, traffic
    and cluster), as the dispatcher builds it for a trial."""
    from types import SimpleNamespace

    from autotune.stacks._base import PresetRun

    request = SimpleNamespace(params=ctx.config, model=ctx.model, workload=ctx.workload, cluster=ctx.cluster)
    devices = int(ctx.config.get("world_size") or 1)
    return PresetRun(
        request=request, launcher=[], entry=[], user=[], iterations=0, devices=devices, global_batch_size=0, layers=80
    )


@contextlib.contextmanager
def local_npu_cluster(workers: int = 2):
    """A local Ray cluster on this machine: a head (1 CPU, no NPU) and ``workers`` raylets declaring
    NPU: 1 each, as separate "nodes" for multi-node trials."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20})
    for _ in range(workers):
        c.add_node(num_cpus=1, resources={"NPU": 1}, object_store_memory=80 * 2**20)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


# vLLM's place taken by the fake engine (tests/fixtures/fake_engine/server.py): ``backend: {kind: vllm,
# entry: <this script>}`` renders each trial into vLLM's launch as for the real engine (``{python}
# {entry} --model ... --port {port} --max-num-seqs N ...``); the script keeps what the fake understands
# (the port, ``--max-num-seqs`` as the requests decoding at once) and becomes the fake server in the
# same process, so the probe stops what it started. ``prelude``: Python run first (``args`` is argv).
FAKE_ENGINE = REPO / "tests" / "fixtures" / "fake_engine" / "server.py"
_FAKE_VLLM = r"""
import json, os, sys, time
args = sys.argv[1:]
def value(name, default):
    return args[args.index(name) + 1] if name in args else default
PRELUDE
os.execv(sys.executable, [sys.executable, FAKE_SERVER, "--port", value("--port", "0"),
         "--capacity", value("--max-num-seqs", "64"), "--ttft-ms", TTFT, "--token-ms", TOKEN])
"""


def fake_vllm(folder: Path, ttft_ms: float = 5, token_ms: float = 1, prelude: str = "") -> Path:
    """The fake engine's stand-in for vLLM's entry, written into ``folder``: ``ttft_ms`` to the first
    token and ``token_ms`` a token, whatever the batch."""
    path = folder / "fake_vllm.py"
    path.write_text(
        _FAKE_VLLM.replace("FAKE_SERVER", repr(str(FAKE_ENGINE)))
        .replace("PRELUDE", prelude)
        .replace("TTFT", repr(str(ttft_ms)))
        .replace("TOKEN", repr(str(token_ms)))
    )
    return path


# a serving spec's workload for the fake engine (fake_vllm): one short rate, one batch, an SLO every
# request meets however loaded the machine is; a spec's f-string puts it in as {FAKE_SERVE_WORKLOAD}
FAKE_SERVE_WORKLOAD = """workload:
  kind: serve
  traffic: {rates: [2], arrival: poisson, prompt_len: 16, output_len: 4, duration_s: 1, warmup_requests: 1, seed: 3}
  slo: {ttft_p99_ms: 20000, tpot_p99_ms: 5000}
  batch_sweep: [1]
  startup_timeout_s: 60
  timeout_s: 120"""


class MessageObserver:
    """A search observer (``autotune.study.listeners.SearchObserver``) that keeps what the study said
    (``messages``) and ignores the rest."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def on_start(self, *args) -> None: ...

    def on_trial_started(self, *args) -> None: ...

    def on_trial_finished(self, *args) -> None: ...

    def on_message(self, text: str) -> None:
        self.messages.append(text)
