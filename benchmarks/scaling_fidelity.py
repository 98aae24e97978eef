"""A measured config projected to a larger size, against published multi-node runs (issue 45).

For every group of benchmarks/data/training_scaling_published.csv (one model and parallel layout
at several device counts, each row with its published source), the group's smallest row with a
published throughput is the "measured" reference; its step time is projected to each larger row
of the group by ``autotune.guide.projection.projected_step`` (the measured step split into
compute and communication by the model's share at the reference, each part scaled by the model's
own ratio between the two sizes), and the projected tokens/s/device is compared with the one
published for that row. Two naive baselines are printed for contrast: ideal data-parallel scaling
(tokens/s/device stays the reference's) and the model alone, unanchored (the simulator's own
tokens/s/device at the target).

Prints one line per compared row and the median absolute error of each method over the rows at
4-16x the reference's device count, and over all. No parameter is fitted here: the model uses the
bundled hardware profiles as they are, and none of the rows compared was used to build them.
Rows the CSV cannot price (no tp/pp/micro-batch published) are skipped with the reason. Exits 0
with a message when the data is absent.

    python benchmarks/scaling_fidelity.py
"""

from __future__ import annotations

import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simulator_fidelity import row_inputs  # noqa: E402

from autotune.guide.projection import ModelPoint, point_of_result, projected_step  # noqa: E402
from autotune.workers.protocol import TrialRequest  # noqa: E402
from autotune.workers.simulate import simulate_trial  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "training_scaling_published.csv"
BAND = (4.0, 16.0)  # the range of target size over probed size
NEEDED = ("tp", "pp", "dp", "micro_batch_size")  # without these a row has no config to price


def tokens_per_step(row: dict[str, str]) -> float:
    return float(row["global_batch_size"]) * float(row["seq"])


def measured_step_s(row: dict[str, str]) -> float | None:
    """The row's published step time, else the one its tokens/s/device implies; None without either."""
    if row["measured_step_time_s"]:
        return float(row["measured_step_time_s"])
    if row["measured_tokens_per_s_per_device"]:
        return tokens_per_step(row) / (float(row["measured_tokens_per_s_per_device"]) * int(row["devices"]))
    return None


def measured_tps(row: dict[str, str]) -> float | None:
    step = measured_step_s(row)
    return tokens_per_step(row) / step / int(row["devices"]) if step else None


def simulate_row(row: dict[str, str]) -> tuple[ModelPoint | None, str]:
    """The model's step at the row's config (its breakdown, OOM or not) and a note: '' or why none
    / what was left to the simulator's defaults."""
    missing = [k for k in NEEDED if not row[k].strip()]
    if missing:
        return None, f"not published: {', '.join(missing)}"
    model, workload, cluster, params = row_inputs(row)
    defaulted = [k for k, v in params.items() if v == ""]
    params = {k: v for k, v in params.items() if v != ""}  # an unpublished setting: the simulator's default
    cluster["hardware"] = row["hardware"]
    result = simulate_trial(TrialRequest(params=params, model=model, workload=workload, cluster=cluster))
    point = point_of_result(result, tokens_per_step(row), int(row["devices"]))
    if point is None:
        return None, f"the model cannot price it ({result.status}: {result.reason})"
    notes = []
    if result.status == "oom":
        notes.append("model: OOM")
    if defaulted:
        notes.append(f"{'/'.join(defaulted)} unpublished (simulator default)")
    return point, "; ".join(notes)


def quantile_abs(errors: list[float], q: float) -> str:
    """The ``q`` quantile of the absolute errors (inclusive, as ``statistics.quantiles``), in percent."""
    return f"{band_quantile(errors, q) * 100:.1f} %"


def band_quantile(errors: list[float], q: float) -> float:
    cuts = statistics.quantiles(sorted(abs(e) for e in errors), n=100, method="inclusive")
    return cuts[round(q * 100) - 1]


def median_abs(errors: list[float]) -> str:
    return f"{statistics.median(abs(e) for e in errors) * 100:.1f} %" if errors else "n/a"


def compare_rows(say=print) -> tuple[list[tuple[float, float, float, float]], list[str], int]:
    """(ratio, projection error, ideal error, model-alone error) per compared row, the rows skipped
    and the number of groups; ``say`` gets one line per row."""
    groups: dict[str, list[dict[str, str]]] = defaultdict(list)
    for row in csv.DictReader(DATA.open()):
        groups[row["group"]].append(row)

    compared = []  # (ratio, projection error, ideal error, model-alone error)
    skipped = []
    header = (
        f"{'group':<26} {'devices':>11} {'ratio':>6} {'measured':>9} {'projected':>9} "
        f"{'error %':>8} {'ideal %':>8} {'model %':>8}  note"
    )
    say("tokens/s/device: published vs projected from the group's smallest measured row")
    say(header)
    for name, rows in groups.items():
        rows = sorted(rows, key=lambda r: int(r["devices"]))
        points = {r["id"]: simulate_row(r) for r in rows}
        for r in rows:
            if points[r["id"]][0] is None:
                skipped.append(f"{r['id']}: {points[r['id']][1]}")
        candidates = [r for r in rows if measured_step_s(r) is not None and points[r["id"]][0] is not None]
        if not candidates:
            skipped.append(f"group {name}: no row with both a published throughput and a priceable config")
            continue
        ref = candidates[0]
        ref_point, ref_note = points[ref["id"]]
        ref_step, ref_tps = measured_step_s(ref), measured_tps(ref)
        for r in rows:
            devices = int(r["devices"])
            if devices <= int(ref["devices"]):
                continue
            point, note = points[r["id"]]
            measured = measured_tps(r)
            if point is None:
                continue
            if measured is None:
                skipped.append(f"{r['id']}: no published throughput to compare with")
                continue
            projected = point.tokens_per_s_per_device(projected_step(ref_step, None, ref_point, point))
            ratio = devices / int(ref["devices"])
            err = projected / measured - 1
            ideal = ref_tps / measured - 1
            alone = point.tokens_per_s_per_device() / measured - 1
            compared.append((ratio, err, ideal, alone))
            ref_said = "ref: same" if ref_note == note else f"ref: {ref_note}"
            notes = "; ".join(n for n in (note, ref_said if ref_note else "") if n)
            say(
                f"{name:<26} {ref['devices']:>4} -> {devices:<4} {ratio:>5.1f}x {measured:>9.1f} {projected:>9.1f} "
                f"{err * 100:>+8.1f} {ideal * 100:>+8.1f} {alone * 100:>+8.1f}  {notes}"
            )
    return compared, skipped, len(groups)


def main() -> int:
    if not DATA.exists():
        print(f"published scaling data not found at {DATA}; nothing to compare")
        return 0
    compared, skipped, n_groups = compare_rows()
    if skipped:
        print("\nskipped:")
        for line in skipped:
            print(f"  {line}")
    band = [c for c in compared if BAND[0] <= c[0] <= BAND[1]]
    lo, hi = (f"{b:g}" for b in BAND)
    print()
    for label, i in (("projection", 1), ("ideal data-parallel scaling", 2), ("model alone, unanchored", 3)):
        print(
            f"{label}: median abs error {median_abs([c[i] for c in band])} over {len(band)} rows at {lo}-{hi}x "
            f"({len(compared)} rows in all: {median_abs([c[i] for c in compared])})"
        )
    if band:
        print(f"projection: 80 % of the rows at {lo}-{hi}x within +/-{quantile_abs([c[1] for c in band], 0.8)}")
    print(f"groups: {n_groups}; rows compared: {len(compared)}; skipped: {len(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
