"""A scaling study's measurements: each config probed at each size, every reading kept on disk.

The probes go through the study's own dispatcher and launcher (:mod:`autotune.cli.assembly`): a
size of several nodes is one trial placed by a Ray placement group, as a study's multi-node trial
is, and a simulated study's sizes are the simulator's predictions, labelled so. They run one at a
time, never side by side: two probes sharing a cluster (its links, a host's cores) would each
measure the other's load, and a scaling curve is the comparison of sizes under the same load.

Every reading is appended to ``<run dir>/scaling/readings.jsonl`` as it comes back, so a scaling
study killed half-way keeps what it measured and the same command measures only what is missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..dispatch.backends import BackendChoice, launch_for, trial_placement
from ..guide.projection import simulated_comm
from ..spec.resolve import objectives_of, probe_context, request_settings
from ..study.interpret import interpret
from ..study.plan import Unplaceable  # a size the cluster cannot place is refused as a study is (exit 3)
from autotune.workers.parameters import trial_devices

from .sizes import Size, SizedConfig

__all__ = ["Reading", "ReadingLog", "measure"]

READINGS = "readings.jsonl"
INFRA_RETRIES = 1  # a probe the infrastructure failed is run once more, then the study stops


@dataclass
class Reading:
    """One probe of one config at one size: what the study reads from it."""

    trial: int  # the study's trial whose config this is
    mode: str
    size: Size
    repeat: int
    status: str
    source: str
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    wall_s: float = 0.0

    @property
    def key(self) -> tuple[int, str, str, int]:
        return (self.trial, self.mode, self.size.label, self.repeat)

    def to_json(self) -> dict[str, Any]:
        return {
            "trial": self.trial,
            "mode": self.mode,
            "size": self.size.to_json(),
            "repeat": self.repeat,
            "status": self.status,
            "source": self.source,
            "metrics": self.metrics,
            "reason": self.reason,
            "wall_s": round(self.wall_s, 3),
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> "Reading":
        size = Size(int(row["size"]["nodes"]), int(row["size"]["devices_per_node"]))
        return cls(
            int(row["trial"]),
            str(row["mode"]),
            size,
            int(row["repeat"]),
            str(row["status"]),
            str(row["source"]),
            {k: float(v) for k, v in (row.get("metrics") or {}).items()},
            str(row.get("reason", "")),
            float(row.get("wall_s", 0.0)),
        )


class ReadingLog:
    """The readings of one run directory's scaling study, one JSON line each, appended as they come."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / READINGS

    def load(self) -> list[Reading]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                out.append(Reading.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError):  # a line cut by a crash: the rest is kept
                continue
        return out

    def append(self, reading: Reading) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(reading.to_json()) + "\n")
            f.flush()


def measure(
    planned: Iterable[tuple[int, SizedConfig]],
    repeats: int,
    choice: BackendChoice,
    dispatcher: Any,
    log: ReadingLog,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Reading]:
    """Every reading of ``planned`` (``(trial, sized config)`` pairs, sizes the layout cannot run
    left out by the caller) up to ``repeats`` each: those ``log`` holds, then the missing ones
    probed one at a time. A size the cluster can never place raises :class:`Unplaceable` before
    its first probe; a probe the infrastructure failed twice raises it too (the readings so far
    are kept)."""
    planned = list(planned)
    readings = log.load()
    have = {r.key for r in readings if r.status != "infra"}
    missing = [(t, s) for t, s in planned if not all((t, s.mode, s.size.label, k) in have for k in range(repeats))]
    checked: set[Size] = set()
    for _, sized in missing:  # every size the study still needs, before its first probe
        if sized.size not in checked:
            _check_placeable(sized, dispatcher)
            checked.add(sized.size)
    number = len(readings)
    for trial, sized in missing:
        for k in range(repeats):
            if (trial, sized.mode, sized.size.label, k) in have:
                continue
            for attempt in range(INFRA_RETRIES + 1):
                progress(
                    f"trial {trial}, {sized.mode} scaling, {sized.size.label} devices, reading {k + 1} of {repeats}"
                    + (" (retry: the infrastructure failed)" if attempt else "")
                )
                reading = _probe(trial, sized, k, number, choice, dispatcher)
                number += 1
                log.append(reading)
                readings.append(reading)
                if reading.status != "infra":
                    break
            else:
                raise Unplaceable(
                    f"the infrastructure failed trial {trial}'s probe at {sized.size.label} devices "
                    f"{INFRA_RETRIES + 1} times: {reading.reason}. The readings so far are kept; run the same "
                    "command again once the cluster is whole"
                )
    return readings


def _check_placeable(sized: SizedConfig, dispatcher: Any) -> None:
    assert sized.spec is not None
    placement = trial_placement(sized.spec, sized.size.devices)
    problem = dispatcher.placement_problem(**placement)
    if problem is not None:
        raise Unplaceable(
            f"size {sized.size.label} ({sized.size.nodes} node(s) x {sized.size.devices_per_node} "
            f"{sized.spec.cluster.accelerator} device(s)) cannot be placed on the Ray cluster: {problem[1]}. "
            "Start the nodes it needs, or leave the size out (--nodes / --devices)"
        )


def _probe(trial: int, sized: SizedConfig, repeat: int, number: int, choice: BackendChoice, dispatcher: Any) -> Reading:
    """One probe of ``sized`` through ``dispatcher``, read as a study reads its trials."""
    spec, config = sized.spec, sized.config
    assert spec is not None and config is not None
    context = probe_context(spec)
    request = request_settings(spec, context).request(config, number)
    launch = None if choice.simulated else launch_for(spec, choice, request)
    result = dispatcher.result_of(dispatcher.submit(request, launch))
    meaning = interpret(config, result, context, objectives_of(spec), trial_devices("train", config))
    metrics = {
        k: float(v) for k, v in meaning.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    if choice.simulated:
        metrics.update(simulated_comm(result.info, metrics.get("step_time_s")))
    status = "infra" if meaning.retry else meaning.status
    return Reading(trial, sized.mode, sized.size, repeat, status, result.source, metrics, meaning.reason, result.wall_s)
