"""``report``'s table of trials, fitted to a 120-column terminal.

Split from :mod:`autotune.finish.run_output` (the tables ``plan``, ``run`` and ``report`` share) because
this one table has layout rules of its own: each trial's status, source, objectives and the
one prediction that chose it on one line, the config whole beside it or wrapped on lines of its
own, the why text wrapped below, and the knobs the model prices alike (``~``) or the roomiest
config (``=``) said once under the table instead of in every reason.
"""

from __future__ import annotations

import re
from typing import Any

from rich.console import Console
from rich.text import Text

from .report import WIDTH, wrap_line
from .run_output import BASELINE_MARK, _extra_metrics, fmt_metric, short, undistinguished_of
from ..spec.errors import escape_text

__all__ = ["print_report_table"]


# the guide's "predicted 693.6 ± 30" in a trial's reason: the figure the report's column shows
_GUIDE_PREDICTION = re.compile(r"^predicted [-+0-9.e]+ ± [-+0-9.e]+(?:, )?")


def _predicted_cell(record: Any, metric: str) -> str:
    """The one prediction of a trial: the guide's (mean ± sd, what chose it) when it steered,
    else the model's."""
    p = record.predicted or {}
    mean, sd = p.get(f"guided_{metric}"), p.get(f"guided_{metric}_sd")
    if isinstance(mean, (int, float)):
        return fmt_metric(mean) + (f" ± {fmt_metric(float(sd))}" if isinstance(sd, (int, float)) else "")
    return fmt_metric(p.get(metric))


def _one_line(text: str) -> str:
    """``text`` escaped (:func:`~autotune.spec.errors.escape_text`: a newline is ``\\n``), its runs
    of spaces one space."""
    return " ".join(escape_text(text).split())


def _why(record: Any, with_prediction_column: bool, shared: str = "", shared_room: str = "") -> str:
    """Why the trial was chosen or failed, on one line: a probe's words escaped (an ESC, a BEL,
    a newline in a failure reason is written as ``\\x1b``, ``\\x07``, ``\\n``)."""
    why = record.reason if record.status != "ok" else record.chosen_because
    why = _one_line(str(why or ""))
    if shared:
        from ..trial_attrs import UNDISTINGUISHED

        why = why.replace(_one_line(f"{UNDISTINGUISHED}{shared}"), "knobs the model prices alike: ~ below")
    if shared_room:
        from ..trial_attrs import ROOMIEST

        why = why.replace(_one_line(f"{ROOMIEST}{shared_room}"), "knobs priced alike in speed, roomiest taken: = below")
    if with_prediction_column and record.status == "ok":
        # the guide's prediction is the table's predicted column: said once per row
        parts = (_GUIDE_PREDICTION.sub("", part) for part in why.split("; "))
        why = "; ".join(part for part in parts if part)
    return why


def _config_lines(prefix: str, config: str) -> list[str]:
    """``prefix`` and the config within :data:`WIDTH` columns: whole on the line when it fits,
    else its env settings on their own lines under it, each part cut at a setting (never inside
    one), continuations aligned under the config."""
    if len(prefix) + len(config) <= WIDTH:
        return [prefix + config]
    layout, _, env = config.partition("  ")
    if len(prefix) > WIDTH // 2 and len(prefix) + len(layout) > WIDTH:  # no room beside: lines of its own
        lines = [prefix.rstrip(), *wrap_line(" " * 7 + layout, WIDTH, indent=7)]
        return lines + (wrap_line(" " * 7 + env, WIDTH, indent=7) if env else [])
    indent = len(prefix) if len(prefix) <= WIDTH // 2 else 7
    lines = wrap_line(prefix + layout, WIDTH, indent=indent)
    if env:
        lines += wrap_line(" " * indent + env, WIDTH, indent=indent)
    return lines


def _source_words(record: Any) -> str:
    """A trial's source as the table says it: a trial its memory profile ended ran only the profile
    (a few layers, its peak measured) and no full probe, so it reads "profiled", not "measured",
    beside a predicted figure a reader could take for a reading."""
    if record.status == "oom_predicted" and record.source == "measured":
        return "profiled"
    return str(record.source)


def _staggered(lead: str, columns: list[str], cells: list[int]) -> tuple[list[int], str, str]:
    """Column widths and two header lines holding every name whole, alternately on the upper and the
    lower line (the lower one after ``lead``), each right-aligned over its column and free to reach
    left over its neighbour's, which names nothing on that line: a spec's metric names stay whole
    and searchable (``cost_per_million_output_tokens``) where one line of them would pass
    :data:`WIDTH`. ``cells``: each column's widest cell."""
    widths, lines = [], [[" "] * len(lead), list(lead)]
    ends = [0, len(lead.rstrip()) + 1]  # where each line is free from (one space after what it holds)
    x = len(lead)
    for i, (name, cell) in enumerate(zip(columns, cells)):
        line = i % 2  # the first name on the upper line: it may reach back over the lead's blank there
        width = max(cell, 1, len(name) - (x - ends[line]))  # its name may reach back to the line's free point
        right = x + width
        text = lines[line]
        text.extend(" " * (right - len(text)))
        text[right - len(name) : right] = list(name)
        ends[line] = right + 1
        widths.append(width)
        x = right + 2
    return widths, "".join(lines[0]).rstrip(), "".join(lines[1]).rstrip()


def print_report_table(
    console: Console, rows: list[dict[str, Any]], records: list[Any], objectives: list[tuple[str, str]], top: int
) -> None:
    """``report``'s trials, at most :data:`WIDTH` columns a line: status, source, the objectives,
    the one prediction of the first objective (measured studies; a simulated trial's metrics are
    the prediction), the peak memory and the config (wrapped at a word when long), then why the
    trial was chosen or why it failed on its own indented lines."""
    names = [m for m, _ in objectives]
    first = names[0]
    by_number = {r.number: r for r in records}
    shown = [by_number[row["trial"]] for row in rows[:top]]
    from autotune.objectives import workload_of_metrics

    if any(workload_of_metrics(r.metrics) == "serve" for r in shown if r.metrics):  # the serving decision's figures
        names += _extra_metrics(names, [r.metrics for r in shown if r.metrics], skip=("peak_memory_gib",))
    predicted = any(r.source != "simulated" for r in shown)
    peak = any(isinstance(r.metrics.get("peak_memory_gib"), (int, float)) for r in shown)
    columns = [
        *names,
        *([f"predicted {first}" if len(first) < 14 else "predicted"] if predicted else []),
        *(["peak GiB"] if peak else []),
    ]
    cells_of = {}
    for rec in shown:
        values = [fmt_metric(rec.metrics.get(m), m) for m in names]
        if predicted:
            values.append(_predicted_cell(rec, first))
        if peak:
            values.append(fmt_metric(rec.metrics.get("peak_memory_gib")))
        cells_of[rec.number] = values
    status_of = {r.number: escape_text(str(r.status)) for r in shown}  # a trial record's: printed as text
    source_of = {r.number: escape_text(_source_words(r)) for r in shown}
    status_w = max([6] + [len(s) for s in status_of.values()])
    source_w = max([6] + [len(s) for s in source_of.values()])
    lead = f"{'trial':<6} {'status':<{status_w}} {'source':<{source_w}} "
    cell_widths = [max(len(cells_of[r.number][i]) for r in shown) if shown else 0 for i in range(len(columns))]
    widths = [max(len(c), w) for c, w in zip(columns, cell_widths)]
    head = lead + "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    if len(head) > WIDTH:  # the serving figures' long names: on two lines, staggered, each whole
        widths, upper, head = _staggered(lead, columns, cell_widths)
        console.print(upper, markup=False)
    # the config is the last column where it fits beside the figures; else on its own lines below each row
    console.print(head + "  config" if len(head) + 8 <= WIDTH else head, markup=False)
    # the knobs most rows leave to the probes, said once at the end (~), as run's preview does
    named = [k for k in (undistinguished_of(r) for r in shown) if k]
    shared = max(sorted(set(named)), key=named.count) if named else ""
    shared = shared if named.count(shared) > 1 else ""
    from ..trial_attrs import ROOMIEST, roomiest_in

    rooms = [k for k in (roomiest_in(r.chosen_because or "") for r in shown) if k]
    shared_room = max(sorted(set(rooms)), key=rooms.count) if rooms else ""
    shared_room = shared_room if rooms.count(shared_room) > 1 else ""
    for rec in shown:
        number = f"{rec.number}{BASELINE_MARK if rec.baseline else ''}"
        cells = "  ".join(v.rjust(w) for v, w in zip(cells_of[rec.number], widths))
        prefix = f"{number:<6} {status_of[rec.number]:<{status_w}} {source_of[rec.number]:<{source_w}} {cells}  "
        for text in _config_lines(prefix, short(rec.config)):
            console.print(text, markup=False)
        why = _why(rec, predicted, shared, shared_room)
        if why:
            label = "why failed: " if rec.status != "ok" else "why chosen: "
            for text in wrap_line(f"       {label}{why}", WIDTH, indent=7 + len(label)):
                console.print(Text(text, style="dim"))
    if any(r.baseline for r in shown):
        console.print(f"{BASELINE_MARK}: the spec's baseline", markup=False)
    behind = [r.number for r in shown if (r.metrics or {}).get("load_generator_behind_runs")]
    if behind:  # a serving trial whose client could not send on time: the host's figure, not only the engine's
        said = (
            f"! trial(s) {', '.join(map(str, behind))}: the load generator fell behind its plan in some rate runs "
            "(load_generator_behind_runs); the engine saw burstier arrivals than asked, and a miss there is "
            "the host's as much as the engine's: run the client on another host"
        )
        for text in wrap_line(said, WIDTH, indent=2):
            console.print(text, markup=False)
    if shared:
        from ..trial_attrs import UNDISTINGUISHED

        for text in wrap_line(f"~ (in a reason): {UNDISTINGUISHED}{escape_text(shared)}", WIDTH, indent=2):
            console.print(text, markup=False)
    if shared_room:
        for text in wrap_line(f"= (in a reason): {ROOMIEST}{escape_text(shared_room)}", WIDTH, indent=2):
            console.print(text, markup=False)
