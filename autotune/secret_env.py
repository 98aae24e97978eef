"""Secrets in ``backend.env`` never leave the probe's environment.

A team's launcher often needs a token (a model hub, an object store, a cluster API). The spec is
the natural place for it, but the spec is also copied: into the run directory
(``autotune_spec.yaml``, which ``report``/``export`` read back), into every trial file, into the
result cache's key and into MLflow (the parent run's ``spec/`` artifact), where everyone who can
browse the experiment reads it. The probe itself gets the real value through its process
environment only (``backends.launch_for``), so every copy can carry a mask instead.

Which values are secret: the keys of ``backend.env`` whose name looks secret (``TOKEN``,
``PASSWORD``/``PASSWD``, ``SECRET``, ``KEY``, ``CREDENTIAL``, ``AUTH``, any case), and those the spec
names in ``backend.secret_env``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

__all__ = ["MASK", "SPEC_COPY", "looks_secret", "secret_env_names", "masked_backend", "masked_spec_text",
           "write_spec_copy"]

MASK = "***"
SPEC_COPY = "autotune_spec.yaml"  # the spec a run directory was made from (report/export read it back)
_SECRET_NAME = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|KEY|CREDENTIAL|AUTH", re.IGNORECASE)


def looks_secret(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def secret_env_names(env: dict[str, Any], declared: list[str] | tuple[str, ...] = ()) -> set[str]:
    """The ``backend.env`` keys whose values are masked in every copy."""
    return {k for k in env if looks_secret(k) or k in declared}


def masked_backend(backend: dict[str, Any]) -> dict[str, Any]:
    """``spec.backend.model_dump()`` with secret env values masked (for trial files, the cache key)."""
    env = backend.get("env") or {}
    secret = secret_env_names(env, backend.get("secret_env") or ())
    if not secret:
        return backend
    return {**backend, "env": {k: MASK if k in secret else v for k, v in env.items()}}


def masked_spec_text(text: str) -> str:
    """The spec file's text with the secret values of ``backend.env`` replaced by ``'***'``; every
    other byte (comments, layout) as written. Text that is not a readable spec is returned as is:
    it was validated before any copy is made."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return text
    backend = _child(root, "backend")
    env = _child(backend, "env")
    if not isinstance(env, yaml.MappingNode):
        return text
    declared = _child(backend, "secret_env")
    names = {n.value for n in declared.value if isinstance(n, yaml.ScalarNode)} \
        if isinstance(declared, yaml.SequenceNode) else set()
    spans = [(value.start_mark.index, value.end_mark.index) for key, value in env.value
             if isinstance(key, yaml.ScalarNode) and isinstance(value, yaml.ScalarNode)
             and (looks_secret(key.value) or key.value in names)]
    for start, end in sorted(spans, reverse=True):
        text = text[:start] + f"'{MASK}'" + text[end:]
    return text


def write_spec_copy(source: Path, run_dir: Path) -> Path:
    """Keep the spec with its study, as ``run_dir/autotune_spec.yaml``, its secrets masked."""
    copy = run_dir / SPEC_COPY
    copy.write_text(masked_spec_text(Path(source).read_text()))
    return copy


def _child(node: Any, key: str) -> Any:
    if not isinstance(node, yaml.MappingNode):
        return None
    return next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
