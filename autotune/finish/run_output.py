"""The tables ``plan``, ``run`` and ``report`` print: configs, trials, the front, the best
(``report``'s own table of trials: :mod:`autotune.finish.report_table`).

Apart from :mod:`autotune.cli.commands` (which parses options, calls the stage that does the work and
exits) because the tables have rules of their own that a command line should not hold: one
objective or several (each objective a column; ``*`` marks the Pareto front of the objectives,
or with one objective the front of it against memory headroom), the knobs the model cannot tell
apart said once (``~``), the Pareto-optimal trials instead of one best, and ``report``'s table
fitted to a 120-column terminal (the config whole, the why text wrapped on its own lines).
Every function prints on the console it is given and computes nothing the study's files do not
also hold.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from autotune.objectives.intervals import between_runs_words
from autotune.workers.parameters import prefill_tensor_parallel, value

from .report import WIDTH, wrap_line
from ..spec.errors import escape_text
from ..study.records import CONFIRMED_AT_TARGET, INTERFERENCE_KEY

__all__ = [
    "wrap_line",
    "decision_lines",
    "precision_note",
    "short",
    "fmt_metric",
    "print_top_table",
    "print_preview",
    "print_breakdown",
    "print_pricing",
    "print_best",
    "undistinguished_of",
    "WIDTH",
]


def short(config: dict[str, Any]) -> str:
    """A config on one line: the parallel layout in short words (``tp=2 pp=1 mbs=4 sp bf16``),
    every other searched setting by its name, the env settings last after two spaces. A value's
    control, bidi or invisible characters (an ESC, a NUL, a newline in an env or engine value of
    the spec) are escapes (``\\x1b``, ``\\n``): the line stays one line, and shows what it holds."""
    keys = [
        "tp",
        "pp",
        "vpp",
        "first_stage_layers",
        "cp",
        "dp",
        "micro_batch_size",
        "grad_accum",
        "sequence_parallel",
        "recompute",
        "recompute_layers",
        "zero_stage",
        "precision",
        "batch_size",
    ]
    labels = {
        "micro_batch_size": "mbs",
        "grad_accum": "ga",
        "sequence_parallel": "sp",
        "zero_stage": "zero",
        "recompute_layers": "rl",
        "first_stage_layers": "first",
        "precision": "",
        "batch_size": "bs",
    }
    parts = []
    layout = _instances(config)
    if layout:  # inference and serving: what is deployed, instances x their parallel sizes
        parts.append(layout)
        keys = [k for k in keys if k not in ("tp", "pp")]
    for k in keys:
        if k not in config:
            continue
        v = config[k]
        label = labels.get(k, k)
        if isinstance(v, bool):
            if v:
                parts.append(label)
        elif k == "recompute":
            if v != "none":
                parts.append(f"rc={v}")
        else:
            parts.append(f"{label}{'=' if label else ''}{v}")
    # every other searched setting (kv_cache_dtype, quantization, compile, graph_kernel_flags, ...)
    # by its canonical name, so that two configs never print the same
    parts += [f"{k}={v}" for k, v in config.items() if k not in keys and k not in _LAYOUT and not k.startswith("env.")]
    env = [f"{k[4:]}={v}" for k, v in config.items() if k.startswith("env.")]
    return escape_text(" ".join(parts) + (("  " + " ".join(env)) if env else ""))


# what ``_instances`` says of a config; world_size is the devices it occupies, which it implies
_LAYOUT = ("tp", "pp", "replicas", "world_size", "prefill_replicas", "prefill_tp", "kv_connector")


def _instances(config: dict[str, Any]) -> str:
    """``4 x tp2`` (``2 x tp2 pp2``): engine instances and each one's parallel sizes, for a config
    that has replicas (inference and serving); a disaggregated deployment's two pools and its KV
    connector (``prefill 1 x tp8 + decode 2 x tp4, KV by mooncake``); "" for a training config."""
    if "replicas" not in config:
        return ""
    pp = value(config, "pp")
    stages = f" pp{pp}" if pp != 1 else ""
    instances = f"{config['replicas']} x tp{value(config, 'tp')}{stages}"
    if value(config, "prefill_replicas") > 0:
        prefill = f"{value(config, 'prefill_replicas')} x tp{prefill_tensor_parallel(config)}{stages}"
        return f"prefill {prefill} + decode {instances}, KV by {value(config, 'kv_connector')}"
    return instances


# what stops a serving config's rate from growing, in words, by the simulator's names for it
# (workers/simulate/_serving.py LIMITS: its capacity with every SLO target met, or the target missed
# first), as a simulated trial's info names it (info["serving"]["limited_by"])
LIMIT_WORDS = {
    "capacity": "its capacity, every SLO target met at it",
    "ttft": "TTFT p99 (prompts wait for prefill)",
    "tpot": "TPOT p99 (decode steps slowed by the batch and the prompts mixed in)",
    "itl": "ITL p99 (a step that carries a prompt chunk)",
    "e2e": "E2E p99",
}


def rate_limit_text(metrics: dict[str, Any]) -> str:
    """What a predicted serving row's rate is limited by, from its ``slo_limit`` code (an index
    into the simulator's LIMITS): "capacity" or "TTFT p99"...; "" where the row has no such figure."""
    from autotune.workers.simulate import LIMITS

    code = metrics.get("slo_limit")
    if not isinstance(code, (int, float)) or code != code or not 0 <= int(code) < len(LIMITS):
        return ""
    name = LIMITS[int(code)]
    return name if name == "capacity" else f"{name.upper()} p99"


def fmt_metric(v: Any, name: str = "") -> str:
    """A figure for a table cell: a share (``slo_attainment``) in per cent, else 3 significant digits
    (thousands separated)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
        return ""
    if name in _SHARES:
        return f"{100.0 * v:.2f} %"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


_SHARES = ("slo_attainment",)
# report's mark of the spec's baseline trial (``*`` marks a front, in run's tables only)
BASELINE_MARK = "B"


def _extra_metrics(names: list[str], metrics_rows: list[dict[str, Any]], skip: tuple[str, ...] = ()) -> list[str]:
    """The figures a decision of the study's workload reads (:data:`autotune.objectives.DECISION_METRICS`)
    that are not objectives already, where any row has them."""
    from autotune.objectives import DECISION_METRICS, workload_of_metrics

    kind = workload_of_metrics(metrics_rows[0]) if metrics_rows else "train"
    return [
        m
        for m in DECISION_METRICS[kind]
        if m not in names and m not in skip and any(m in metrics for metrics in metrics_rows)
    ]


def print_top_table(
    console: Console, rows: list[tuple[dict, dict]], objectives: list[tuple[str, str]], title: str
) -> None:
    """One line per config, metrics first and the config last and whole: a config is only useful
    to a reader if it can be copied, so it is never truncated or wrapped into a cell."""
    names = [m for m, _ in objectives]
    names += _extra_metrics(names, [metrics for _, metrics in rows])
    widths = [max(len(m), 9) for m in names]
    # a serving ranking says what limits each config's rate: why a disaggregated layout wins or loses
    limits = [rate_limit_text(metrics) for _, metrics in rows]
    limited = any(limits)
    console.print(f"[bold]{title}[/bold]")
    head = "  ".join(m.rjust(w) for m, w in zip(names, widths)) + ("  limited by" if limited else "")
    console.print("  #  " + head + "  config")
    for i, ((config, metrics), limit) in enumerate(zip(rows, limits), start=1):
        cells = [fmt_metric(metrics.get(m), m).rjust(w) for m, w in zip(names, widths)]
        if limited:
            cells.append(limit.ljust(len("limited by")))
        console.print(f"{i:>3}  " + "  ".join(cells) + "  " + short(config), markup=False)


def undistinguished_of(record: Any) -> str:
    """The knobs the model could not tell apart for the trial's layout (``env.HCCL_BUFFSIZE
    120|200|400, ...``), as its reason names them (:data:`autotune.trial_attrs.UNDISTINGUISHED`);
    "" when none."""
    from ..trial_attrs import undistinguished_in

    return undistinguished_in(getattr(record, "chosen_because", "") or "")


def _signed(record: Any, objectives: list[tuple[str, str]]) -> list[float]:
    return [(1.0 if d == "maximize" else -1.0) * float(record.metrics[m]) for m, d in objectives]


def print_preview(
    console: Console, records: list[Any], objectives: list[tuple[str, str]], recommendation: Any, top: int = 10
) -> None:
    """The simulated study as the model's ranking of distinct layouts: each trial a layout the
    model can tell apart, with the knobs it cannot (values the probes would try) on a line of
    their own, and the front marked ``*``. With one objective, the front of it against the memory
    each layout leaves free (no other layout is both better and roomier); with several, the
    Pareto front of the objectives (no other layout is better in every one), each objective a
    column, and every member of the front shown even when it ranks low on the first."""
    import numpy as np

    from ..guide.ranking import pareto_order
    from ..trial_attrs import UNDISTINGUISHED

    metric, direction = objectives[0]
    several = len(objectives) > 1
    ok = [
        r
        for r in records
        if r.status == "ok" and r.probed and all(isinstance(r.metrics.get(m), (int, float)) for m, _ in objectives)
    ]
    sign = 1.0 if direction == "maximize" else -1.0
    ok.sort(key=lambda r: (-sign * r.metrics[metric], r.number))
    capacity = None
    if recommendation is not None and recommendation.best_headroom_gib is not None:
        capacity = recommendation.best_headroom_gib + recommendation.best.metrics["peak_memory_gib"]
    room = [
        capacity - r.metrics["peak_memory_gib"]
        if capacity is not None and isinstance(r.metrics.get("peak_memory_gib"), (int, float))
        else (
            r.metrics.get("memory_headroom_gib")
            if isinstance(r.metrics.get("memory_headroom_gib"), (int, float))
            else 0.0
        )
        for r in ok
    ]
    if not ok:
        return
    if several:
        values = np.array([_signed(r, objectives) for r in ok])
    else:
        values = np.array([[sign * r.metrics[metric], h] for r, h in zip(ok, room)])
    front = list(pareto_order(values) == 0)
    rows = list(zip(ok, room, front))
    shown = rows[:top]
    if several:  # the whole front, then the best of the rest by the first objective
        on_front = [row for row in rows if row[2]]
        rest = [row for row in rows if not row[2]][: max(0, top - len(on_front))]
        keep = {id(row[0]) for row in on_front + rest}
        shown = [row for row in rows if id(row[0]) in keep]
    names = [m for m, _ in objectives]
    names += _extra_metrics(names, [r.metrics for r, _, _ in shown], skip=("peak_memory_gib",))
    if several:
        what = "* on the Pareto front of " + " and ".join(
            f"{m} ({'higher' if d == 'maximize' else 'lower'} is better)" for m, d in objectives
        )
    else:
        what = f"* on the front of {metric} against memory headroom (none is both better and roomier)"
    title = (
        f"{len(shown)} of {len(ok)} distinct layouts (simulated, not measured): the front, then the best of the rest"
        if several and len(shown) < len(ok)
        else f"top {len(shown)} of {len(ok)} distinct layouts (simulated, not measured)"
    )
    console.print(Text(title, style="bold"))
    console.print(f"  {what}", markup=False)
    widths = [max(len(m), 9) for m in names]
    console.print(
        "  trial  " + "  ".join(m.rjust(w) for m, w in zip(names, widths)) + "  peak GiB  free GiB  config",
        markup=False,
    )
    knobs = [undistinguished_of(r) for r, _, _ in shown]
    # the knobs most layouts leave to the probes, said once (rows marked ~), other sets per row
    named = [k for k in knobs if k]
    shared = max(sorted(set(named)), key=named.count) if named else ""
    for (r, h, on_front), left in zip(shown, knobs):
        mark = "*" if on_front else " "
        cells = "  ".join(fmt_metric(r.metrics.get(m), m).rjust(w) for m, w in zip(names, widths))
        peak = r.metrics.get("peak_memory_gib")
        console.print(
            f"{mark} {r.number:>5}  {cells}  {peak if isinstance(peak, (int, float)) else 0:8.1f}"
            f"  {h:8.1f}  {short({k: v for k, v in r.config.items() if not k.startswith('env.')})}"
            + ("  ~" if left and left == shared else ""),
            markup=False,
        )
        if left and left != shared:
            console.print(f"{'':9}{UNDISTINGUISHED}{escape_text(left)}", markup=False)
    if shared:
        for text in wrap_line(f"  ~ {UNDISTINGUISHED}{escape_text(shared)}", WIDTH, indent=4):
            console.print(text, markup=False)
    from ..trial_attrs import ROOMIEST, roomiest_in

    # per layout: a knob the model prices alike in one layout may move another's speed (the rows say so),
    # so each such note names the trials it is about
    rooms: dict[str, list[int]] = {}
    for r, _, _ in shown:
        room = roomiest_in(r.chosen_because or "")
        if room:
            rooms.setdefault(room, []).append(r.number)
    for room, numbers in sorted(rooms.items()):
        which = f" (trial{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))})"
        for text in wrap_line(f"  {ROOMIEST}{escape_text(room)}{which}", WIDTH, indent=4):
            console.print(text, markup=False)


def print_pricing(console: Console, pricing: dict[str, str]) -> None:
    """Which searched knobs the model prices (:meth:`autotune.guide.ranking.Ranking.knob_pricing`), so a
    reader knows which of a simulated config's values the model chose and which a probe must."""
    kinds = (
        ("speed", "the model prices in speed"),
        ("memory only", "in memory only (the roomiest value taken)"),
        ("not priced", "not at all (a probe must choose)"),
    )
    parts = [f"{words}: {', '.join(n for n, k in pricing.items() if k == kind)}" for kind, words in kinds]
    parts = [p for p, (kind, _) in zip(parts, kinds) if kind in pricing.values()]
    if parts:
        for text in wrap_line(escape_text("searched knobs " + "; ".join(parts)), WIDTH, indent=2):
            console.print(text, markup=False)


def print_breakdown(console: Console, metrics: dict[str, Any]) -> None:
    mem = {k[4:]: v for k, v in metrics.items() if k.startswith("mem_")}
    tim = {k[5:]: v for k, v in metrics.items() if k.startswith("time_") and not k.startswith("time_for_100")}
    if mem:
        total = metrics.get("peak_memory_gib")
        console.print(
            "memory per device of the top config (GiB, predicted): "
            + ", ".join(f"{k} {v:.2f}" for k, v in mem.items() if v)
            + (f" = {total:.2f}" if total else "")
        )
    if tim:
        console.print(
            "step time of the top config (s, predicted): " + ", ".join(f"{k} {v:.3f}" for k, v in tim.items() if v)
        )


def _metric_line(record: Any, objectives: list[tuple[str, str]]) -> str:
    """The objectives first, in the spec's order, then the other metrics a user compares."""
    from autotune.objectives import DECISION_METRICS, workload_of_metrics

    shown = ("tokens_per_s_per_device", *DECISION_METRICS[workload_of_metrics(record.metrics)])
    names = [m for m, _ in objectives] + [m for m in shown if m in record.metrics]
    seen: list[str] = []
    for m in names:
        if m not in seen and isinstance(record.metrics.get(m), (int, float)):
            seen.append(m)
    objective_names = {m for m, _ in objectives}
    return ", ".join(
        f"{m} {record.metrics[m]:,.4g}{_interval(record, m) if m in objective_names else ''}" for m in seen
    )


def _interval(record: Any, metric: str) -> str:
    """`` [low-high, 3 steps]`` after an objective's figure: its 95 % interval within a run (issue
    44), the runs it is the mean of; "" where a figure has neither (the line's source says
    measured or simulated)."""
    from autotune.objectives.intervals import ci_keys

    low, high = (record.metrics.get(k) for k in ci_keys(metric))
    runs = int(record.metrics.get("measurements", 1) or 1)
    parts = []
    if isinstance(low, (int, float)) and isinstance(high, (int, float)):
        steps = record.metrics.get("n_steps")
        parts.append(f"95 % CI {low:,.4g}-{high:,.4g}" + (f" over {int(steps)} steps" if steps else ""))
    if runs > 1:
        parts.append(f"mean of {runs} runs")
    aside = (getattr(record, "info", None) or {}).get(INTERFERENCE_KEY)
    if aside:  # issue 44: a reading far slower than its config's others is a slowdown of the machine
        trials = ", ".join(str(n) for n in aside)
        parts.append(f"trial {trials} set aside as interference: far slower than its other run")
    return f" ({'; '.join(parts)})" if parts else ""


def _rate_bracket(m: dict[str, Any]) -> str:
    """`` (bracket 5.56-5.70 req/s)``: where the rate search left the highest rate meeting the SLO
    (issue 44); "" without one."""
    low, high = m.get("max_rate_rps_ci_low"), m.get("max_rate_rps_ci_high")
    if isinstance(low, (int, float)) and isinstance(high, (int, float)) and high > low:
        return f" (between {low:,.4g} and {high:,.4g} req/s)"
    return ""


def source_label(record: Any, source: str) -> str:
    """How a figure was obtained: ``source``, or, for a config measured on the probe slice, that."""
    info = getattr(record, "info", None) or {}
    confirmed = info.get(CONFIRMED_AT_TARGET)
    if confirmed:
        return f"measured at the target's {confirmed['nodes']} node(s), confirming trial {confirmed['confirms_trial']}"
    where = info.get("projected_from")
    if not where or where.get("step_ratio") is None:
        return source
    return f"measured on {where['nodes']} node(s), projected to {where['target_nodes']}"


def projection_line(record: Any) -> str | None:
    """What a figure projected from the probe slice rests on (``cluster.probe_nodes``); None otherwise."""
    where = (getattr(record, "info", None) or {}).get("projected_from")
    if not where or where.get("step_ratio") is None:
        return None
    measured = where.get("measured") or {}
    step = measured.get("step_time_s")
    said = f" (step {step:.4g} s there)" if isinstance(step, (int, float)) else ""
    return (
        f"projected to the target's {where['target_nodes']} node(s) ({where['target_devices']} devices) from a "
        f"probe on {where['nodes']} node(s) ({where['devices']} devices){said} by the calibrated model; its band "
        f"+/-{100 * where.get('band', 0):.1f} % (the projection's median error on published multi-node rows"
        + (f"; 80 % of them within +/-{100 * where['band_80']:.1f} %" if where.get("band_80") else "")
        + ")"
        + (f"; {where['links']}" if where.get("links") else "")
    )


def decision_lines(record: Any, workload: dict[str, Any], cost_per_device_hour: float | None = None) -> list[str]:
    """What a serving or inference decision reads of a config, each figure said with what it is:
    serving's goodput, the rate it holds, SLO attainment and the p99s against their targets, the cost;
    inference's figures at each of the workload's batch sizes. [] for training."""
    m = record.metrics
    kind = workload.get("kind", "train")

    def num(name: str) -> str:
        return fmt_metric(m.get(name), name)

    projected = projection_line(record)
    if projected:
        return [projected]

    if kind == "serve" and isinstance(m.get("goodput_rps"), (int, float)):
        lines = [
            f"{_instances(record.config) or 'layout'}: goodput {num('goodput_rps_per_device')} req/s/device "
            f"({num('goodput_rps')} req/s that met every SLO target) at {num('max_rate_rps')} req/s offered, the "
            f"highest rate the rate search found meeting the SLO{_rate_bracket(m)}; SLO attainment "
            f"{num('slo_attainment')} of the requests at that rate"
        ]
        slo = workload.get("slo") or {}
        p99 = [
            f"{label} {num(f'{key}_p99_ms')} ms (SLO {slo[f'{key}_p99_ms']:,.4g})"
            for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
            if slo.get(f"{key}_p99_ms") and isinstance(m.get(f"{key}_p99_ms"), (int, float))
        ]
        if p99:
            lines.append("p99 " + ", ".join(p99))
        serving = (getattr(record, "info", None) or {}).get("serving") or {}
        limit = LIMIT_WORDS.get(str(serving.get("limited_by") or ""))
        if limit:  # the simulator says what stops the rate growing: why this deployment kind wins or loses
            lines.append(f"its rate is limited by {limit} (predicted)")
        if isinstance(m.get("cost_per_million_output_tokens"), (int, float)):
            lines.append(
                f"cost {m['cost_per_million_output_tokens']:,.4g} per million output tokens "
                f"(cluster.cost_per_device_hour {cost_per_device_hour:g} x devices / output tokens an hour)"
                if cost_per_device_hour is not None
                else f"cost {m['cost_per_million_output_tokens']:,.4g} per million output tokens"
            )
        return lines
    sizes = [b for b in workload.get("batch_sizes") or [] if f"ttft_ms_bs{b}" in m]
    if kind == "infer" and sizes:

        def row(name: str) -> str:
            return " / ".join(num(f"{name}_bs{b}") for b in sizes)

        return [
            f"{_instances(record.config) or 'layout'} at batch {' / '.join(map(str, sizes))} (the workload's "
            "measurement points, per instance):",
            f"  TTFT {row('ttft_ms')} ms; 100 tokens in {row('time_for_100_tokens_s')} s; decode "
            f"{row('decode_tokens_per_s')} tokens/s ({row('decode_tokens_per_s_per_device')} per device)",
        ]
    return []


def precision_note(config: dict[str, Any], workload_kind: str) -> str:
    """The numerical-stability caveat of an fp16 recommendation ("" for any other precision)."""
    if config.get("precision") != "fp16":
        return ""
    if workload_kind == "train":
        return (
            "fp16 note: fp16's range ends at 65,504, and Llama-scale pre-training in fp16 is known to overflow "
            "(loss-scale collapse, inf/NaN steps) over long runs that a short probe does not reach; bf16 has "
            "fp32's range: prefer it where the stack supports it unless fp16 is clearly faster, and watch the "
            "loss scale"
        )
    return (
        "fp16 note: some Llama layers' activations exceed fp16's range (65,504); check the outputs against "
        "bf16 on real prompts before deploying"
    )


def print_best(
    console: Console,
    best: list[Any],
    objectives: list[tuple[str, str]],
    source: str,
    improvement: str | None,
    recommendation: Any,
    workload: dict[str, Any] | None = None,
    cost_per_device_hour: float | None = None,
    certificate: dict[str, Any] | None = None,
    drift: dict[str, Any] | None = None,
) -> None:
    """The study's answer: the best trial (one objective), or every Pareto-optimal trial (several:
    no single best exists; each is the best at its trade-off), then the recommendation; for serving
    and inference the figures the decision reads (:func:`decision_lines`), and the fp16 caveat."""
    if not best:
        return
    workload = workload or {}
    if len(objectives) > 1:
        beaten = "on both objectives" if len(objectives) == 2 else "on every objective"
        console.print(
            Text.assemble(
                ("Pareto-optimal trials", "bold"),
                f" ({len(best)}; none is beaten {beaten} by another: pick by the trade-off you need):",
            )
        )
        for r in best:
            console.print(Text.assemble(("  trial ", ""), (str(r.number), "bold"), f": {short(r.config)}"))
            console.print(
                escape_text(f"      {_metric_line(r, objectives)}  ({source_label(r, source)})"), markup=False
            )
        for line in decision_lines(best[0], workload, cost_per_device_hour):
            for text in wrap_line(f"  front's first, {escape_text(line)}", WIDTH, indent=6):
                console.print(text, markup=False)
    else:
        top = best[0]
        console.print(Text.assemble(("best", "bold"), f" trial {top.number}: {short(top.config)}"))
        console.print(escape_text(f"  {_metric_line(top, objectives)}  ({source_label(top, source)})"), markup=False)
        for line in decision_lines(top, workload, cost_per_device_hour):
            for text in wrap_line(f"  {escape_text(line)}", WIDTH, indent=6):
                console.print(text, markup=False)
    note = precision_note(best[0].config, workload.get("kind", "train"))
    if note:
        for text in wrap_line(f"  {note}", WIDTH, indent=4):
            console.print(text, markup=False)
    if improvement:
        console.print(f"  {escape_text(improvement)}", markup=False)
    for said in (certificate, drift):  # how sure, and whether the machine drifted (issue 44): StudyResult
        if said and said.get("sentence"):
            for text in wrap_line(f"  {escape_text(said['sentence'])}", WIDTH, indent=4):
                console.print(text, markup=False)
    for key in ("between_runs", "between_runs_max_rate"):  # the best's figures between runs (issue 44)
        across = between_runs_words((certificate or {}).get(key))
        if across:
            for text in wrap_line(f"  {escape_text(across)}", WIDTH, indent=4):
                console.print(text, markup=False)
    if recommendation is not None and recommendation.sentence:
        if recommendation.changed:
            console.print(Text(escape_text(recommendation.sentence), style="bold"))
        else:
            console.print(Text.assemble(("tight:", "bold"), f" {escape_text(recommendation.sentence)}"))
