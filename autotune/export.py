"""Launch-ready forms of a chosen config: YAML, an env file, launch arguments.

Every export starts with a header saying which study and trial it came from, whether its numbers
were measured or simulated, and what they were, so a file found later explains itself.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any

import yaml

from .search import TrialRecord

__all__ = ["header_lines", "best_config_yaml", "env_file", "launch_args", "write_exports"]


def header_lines(study: str, record: TrialRecord, comment: str = "#") -> list[str]:
    metrics = ", ".join(f"{k}={v:.6g}" for k, v in sorted(record.metrics.items()) if isinstance(v, (int, float)))
    source = record.source or "unknown"
    lines = [
        f"{comment} autotune export: study {study}, trial {record.number}, {source}",
        f"{comment} written {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"{comment} metrics ({source}): {metrics}",
    ]
    if source == "simulated":
        lines.append(f"{comment} NOTE: simulated by the analytical model, not measured; probe it before production use")
    return lines


def best_config_yaml(study: str, record: TrialRecord) -> str:
    body = {
        "study": study, "trial": record.number, "source": record.source,
        "params": record.config, "metrics": {k: v for k, v in record.metrics.items()},
    }
    return "\n".join(header_lines(study, record)) + "\n" + yaml.safe_dump(body, sort_keys=False)


def env_file(study: str, record: TrialRecord) -> str:
    env = {k[4:]: v for k, v in record.config.items() if k.startswith("env.")}
    lines = header_lines(study, record)
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(env.items())]
    if "PYTORCH_NPU_ALLOC_CONF" in env:
        lines.append(f"export PYTORCH_CUDA_ALLOC_CONF={shlex.quote(str(env['PYTORCH_NPU_ALLOC_CONF']))}  # same allocator string on CUDA")
    return "\n".join(lines) + "\n"


def launch_args(config: dict[str, Any], global_batch_size: int | None) -> list[str]:
    """Megatron-LM / MindSpeed-LLM arguments for the config's parallel and memory settings."""
    args = [
        "--tensor-model-parallel-size", str(config.get("tp", 1)),
        "--pipeline-model-parallel-size", str(config.get("pp", 1)),
    ]
    if config.get("cp", 1) > 1:
        args += ["--context-parallel-size", str(config["cp"])]
    if "micro_batch_size" in config:
        args += ["--micro-batch-size", str(config["micro_batch_size"])]
    if global_batch_size:
        args += ["--global-batch-size", str(global_batch_size)]
    if config.get("sequence_parallel"):
        args.append("--sequence-parallel")
    recompute = config.get("recompute", "none")
    if recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    elif recompute == "full":
        layers = config.get("recompute_layers")
        args += ["--recompute-granularity", "full", "--recompute-method", "block" if layers else "uniform",
                 "--recompute-num-layers", str(layers or 1)]
    if config.get("zero_stage", 0) >= 1:
        args.append("--use-distributed-optimizer")
    precision = config.get("precision", "bf16")
    if precision in ("bf16", "fp16"):
        args.append(f"--{precision}")
    return args


def write_exports(study: str, record: TrialRecord, out_dir: Path, global_batch_size: int | None) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "yaml": out_dir / "best_config.yaml",
        "env": out_dir / "best.env",
        "args": out_dir / "launch_args.txt",
    }
    paths["yaml"].write_text(best_config_yaml(study, record))
    paths["env"].write_text(env_file(study, record))
    args = launch_args(record.config, global_batch_size)
    paths["args"].write_text("\n".join(header_lines(study, record)) + "\n" + " ".join(shlex.quote(a) for a in args) + "\n")
    return paths
