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

import json
import re
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "MASK",
    "SPEC_COPY",
    "looks_secret",
    "secret_env_names",
    "masked_backend",
    "masked_spec_text",
    "masked_spec_data",
    "masked_url",
    "secret_values",
    "scrub",
    "scrub_values",
    "write_spec_copy",
]

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


_URL_FIELDS = ("storage", "mlflow_uri")
_URL_PASSWORD = re.compile(
    r"^([A-Za-z][\w+.-]*://[^:/@\s]*:)([^@/\s]+)(@)"
)  # scheme://user:PASSWORD@  # tracking.*: database and server URLs may carry a password


def masked_url(url: Any) -> Any:
    """``scheme://user:PASSWORD@host/...`` with the password masked (anything else as it is)."""
    if not isinstance(url, str):
        return url
    return _URL_PASSWORD.sub(lambda m: m.group(1) + MASK + m.group(3), url)


def masked_spec_data(data: Any) -> Any:
    """The loaded spec (YAML merges applied, aliases resolved) with every secret masked: the
    secret ``backend.env`` values, and passwords in ``tracking.storage``/``tracking.mlflow_uri``."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    backend = out.get("backend")
    if isinstance(backend, dict) and isinstance(backend.get("env"), dict):
        out["backend"] = masked_backend(backend)  # a validated spec: secret_env is a list of names
    tracking = out.get("tracking")
    if isinstance(tracking, dict):
        out["tracking"] = {k: masked_url(v) if k in _URL_FIELDS else v for k, v in tracking.items()}
    return out


def secret_values(data: Any) -> list[str]:
    """Every secret value the spec holds (longest first), to scrub from what autotune stores of a
    probe (its log tail, its reason, its info): a probe that prints its environment must not
    leave a token in log_tail.txt, result.json, MLflow or the result cache."""
    found: set[str] = set()
    if isinstance(data, dict):
        backend = data.get("backend") if isinstance(data.get("backend"), dict) else {}
        env = backend.get("env") if isinstance(backend.get("env"), dict) else {}
        declared = backend.get("secret_env") if isinstance(backend.get("secret_env"), list) else []
        found |= {str(env[k]) for k in secret_env_names(env, [str(d) for d in declared])}
        tracking = data.get("tracking") if isinstance(data.get("tracking"), dict) else {}
        for key in _URL_FIELDS:
            m = _URL_PASSWORD.match(str(tracking.get(key) or ""))
            if m:
                found.add(m.group(2))
    return sorted((v for v in found if len(v) >= 4 and v != MASK), key=len, reverse=True)


def scrub(text: str, secrets: list[str]) -> str:
    """``text`` with every secret value replaced by the mask."""
    for secret in secrets:
        text = text.replace(secret, MASK)
    return text


def scrub_values(value: Any, secrets: list[str]) -> Any:
    """``value`` (a probe's info: nested mappings, lists, strings) with the secrets masked."""
    if isinstance(value, str):
        return scrub(value, secrets)
    if isinstance(value, dict):
        return {scrub(str(k), secrets): scrub_values(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_values(v, secrets) for v in value]
    return value


def scrub_result(result: Any, secrets: list[str]) -> None:
    """A probe's result with every secret value masked in place: what it printed (log tail, reason)
    and what it said about itself (info)."""
    if secrets:
        result.log_tail, result.reason = scrub(result.log_tail, secrets), scrub(result.reason, secrets)
        result.info = scrub_values(result.info, secrets)


def masked_spec_text(text: str) -> str:
    """The spec file's text with the secret values of ``backend.env`` and the passwords of the
    tracking URLs replaced by ``'***'``; every other byte (comments, layout) as written. Text that is
    not a readable spec is returned as is. ``write_spec_copy`` keeps this form only when it reads
    back as the masked data (a merge key, an alias or anything else this text-level pass misses
    falls back to the masked data itself)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return text
    spans = []
    backend = _child(root, "backend")
    env = _child(backend, "env")
    if isinstance(env, yaml.MappingNode):
        declared = _child(backend, "secret_env")
        names = (
            {n.value for n in declared.value if isinstance(n, yaml.ScalarNode)}
            if isinstance(declared, yaml.SequenceNode)
            else set()
        )
        spans += [
            (value.start_mark.index, value.end_mark.index, f"'{MASK}'")
            for key, value in env.value
            if isinstance(key, yaml.ScalarNode)
            and isinstance(value, yaml.ScalarNode)
            and (looks_secret(key.value) or key.value in names)
        ]
    tracking = _child(root, "tracking")
    for field in _URL_FIELDS:
        node = _child(tracking, field)
        if isinstance(node, yaml.ScalarNode) and masked_url(node.value) != node.value:
            spans.append((node.start_mark.index, node.end_mark.index, json.dumps(masked_url(node.value))))
    for start, end, replacement in sorted(spans, reverse=True):
        text = text[:start] + replacement + text[end:]
    return text


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # a value reused through an alias is written out again
        return True


def write_spec_copy(source: Path, run_dir: Path) -> Path:
    """Keep the spec with its study, as ``run_dir/autotune_spec.yaml``, its secrets masked.

    What is masked is the loaded data (merges applied, aliases resolved): the text-level copy,
    which keeps the comments, is written only when it loads back as exactly that masked data;
    otherwise the masked data itself is written (a merge key that brought a token, an alias that
    reused one)."""
    from .load import read_spec_text

    text = read_spec_text(source)  # the same bounds and encoding as load_spec
    data = yaml.safe_load(text)
    masked = masked_spec_data(data)
    copy = run_dir / SPEC_COPY
    candidate = masked_spec_text(text)
    try:
        same = yaml.safe_load(candidate) == masked
    except yaml.YAMLError:
        same = False
    if not same:
        candidate = "# the spec as autotune loaded it (YAML merges applied), secrets masked\n" + yaml.dump(
            masked, Dumper=_NoAliasDumper, sort_keys=False, allow_unicode=True
        )
    copy.write_text(candidate)
    return copy


def _child(node: Any, key: str) -> Any:
    if not isinstance(node, yaml.MappingNode):
        return None
    return next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
