"""What ``doctor``, ``plan``, ``calibrate``, ``run`` and ``report`` print besides the tables: the ``--json``
object or the lines around the tables (:mod:`autotune.finish.run_output`), on the consoles of
:mod:`autotune.cli.console`.

Apart from :mod:`autotune.cli.commands` so that the command line holds the commands (their options, the
stage each calls, the exit codes) and this the shape of what each says; every function prints
what its stage decided (:func:`autotune.finish.study_end.advise` for ``run``) and decides nothing.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from rich.markup import escape
from rich.text import Text

from .console import err, out, say, warn
from ..finish.study_end import Advice, json_default
from ..spec.schema import Spec
from ..spec.errors import escape_text
from ..stacks import target_of
from ..spec.resolve import objectives_of

__all__ = ["print_calibration", "print_cluster", "print_plan", "print_report", "print_run_end", "public_metrics"]


def public_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as ``--json`` gives them: floats rounded to 6 places."""
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}


def print_cluster(
    address: Optional[str], nodes: list[dict[str, Any]], verdict: Optional[tuple[bool, str]], as_json: bool
) -> None:
    """``doctor``: the Ray cluster node by node, and whether the spec's largest trial can be placed."""
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "address": address or "local",
                    "nodes": nodes,
                    "placement": {"ok": verdict[0], "why": verdict[1]} if verdict else None,
                }
            )
        )
    else:
        out.print(
            f"[bold]Ray cluster[/bold] {escape(escape_text(address or 'local (this machine)'))}: {len(nodes)} node(s)"
        )
        for n in nodes:
            devices = ", ".join(
                f"{k} {n['free'].get(k, v):g}/{v:g} free" for k, v in n["total"].items() if k in ("CPU", "GPU", "NPU")
            )
            soft = n.get("software") or {}
            software = ", ".join(f"{k} {v}" for k, v in soft.items()) if soft else n.get("error", "none found")
            say(out, f"  {n['label']} ({n.get('host', 'host not reported')}, python {n.get('python', '?')}): {devices}")
            say(out, f"      software: {software}")
            if n.get("visible_devices"):
                say(out, f"      visible: {n['visible_devices']}")
        if verdict:
            say(out, ("ok  " if verdict[0] else "not placeable  ") + verdict[1])


def print_calibration(path: Any, result: dict[str, Any], as_json: bool) -> None:
    """``calibrate``: the profile written and its figures, and how a spec uses it."""
    profile = result["profile"]
    if as_json:
        out.print_json(
            json.dumps({"path": str(path), "profile": profile, "measured": result["measured"]}, default=json_default)
        )
        return
    peaks = ", ".join(f"{k} {v:.4g}" for k, v in profile["peak_tflops"].items() if k != "int8")
    out.print(
        f"wrote {escape(str(path))}: peak TFLOPS {peaks}; memory {profile['memory_bandwidth_gbps']:.1f} GB/s; "
        f"collectives {profile['intra_node_bandwidth_gbps']:.3g} GB/s, "
        f"{profile['collective_latency_us']:.0f} us latency"
        + "".join(
            f"; across {n} nodes {link['bandwidth_gbps']:.3g} GB/s per rank, {link['latency_us']:.0f} us"
            for n, link in sorted((profile.get("inter_node_links") or {}).items())
        )
    )
    err.print(f"\n[bold]next steps[/bold]\n  use it in a spec:  cluster: {{profile: {escape(str(path))}}}")


def print_plan(
    spec: Spec,
    profile: dict[str, Any],
    space: Any,
    enumeration: Any,
    ranking: Any,
    layouts: list[Any],
    best: list[Any],
    as_json: bool,
) -> bool:
    """``plan``: the space, what the rules rejected, the predicted top layouts, the knobs' prices
    and the best one's memory; False (its tables not printed) when no config is predicted to fit."""
    from ..finish.run_output import rate_limit_text
    from ..trial_attrs import ROOMIEST, UNDISTINGUISHED

    objectives = objectives_of(spec)
    if as_json:
        payload = {
            "space_size": enumeration.space_size,
            "valid": enumeration.valid,
            "fit": ranking.fit,
            "invalid_reasons": enumeration.invalid_reasons,
            "objectives": [{"metric": m, "direction": d} for m, d in objectives],
            "profile": {k: v for k, v in profile.items() if k != "line"},
            "top": [
                {
                    "params": c,
                    "metrics": public_metrics(m),
                    "undistinguished": lay.undistinguished,
                    "roomiest": lay.roomiest,
                    **({"limited_by": rate_limit_text(m)} if rate_limit_text(m) else {}),
                }
                for (c, m), lay in zip(best, layouts)
            ],
            "knob_pricing": ranking.knob_pricing(list(space.choices)),
        }
        out.print_json(json.dumps(payload, default=json_default))
        return bool(ranking.fit)  # nothing predicted to fit: exit 1, as without --json
    say(out, spec_summary(spec))
    say(out, profile["line"])
    out.print(
        f"space: {enumeration.space_size:,} combinations, {enumeration.valid:,} valid canonical configs, "
        f"{ranking.fit:,} predicted to fit in {ranking.predictions.get('memory_limit_gib', [0])[0]:.1f} GiB per device"
        if len(ranking.order)
        else f"space: {enumeration.space_size:,} combinations, no valid config"
    )
    for reason, count in sorted(enumeration.invalid_reasons.items(), key=lambda kv: -kv[1]):
        say(out, f"  {count:,} rejected: {reason}", style="dim")
    if "meets_constraints" in ranking.predictions:  # the spec's constraints on metrics, judged on predictions
        p = ranking.predictions
        missed = sum(1 for meets, fits in zip(p["meets_constraints"], p["fits_memory"]) if fits and not meets)
        judged = ", ".join(e.source for e in space.outcome_constraints)
        say(out, f"  {missed:,} that fit predicted to miss {judged} (left out of the fitting ones)", style="dim")
    if not best:
        return False
    from ..guide.ranking import Layout
    from ..finish.run_output import print_breakdown, print_pricing, print_top_table

    print_top_table(
        out, best, objectives, title=f"predicted top {len(best)} distinct layouts (simulated, not measured)"
    )
    for marker, text_of in ((UNDISTINGUISHED, Layout.undistinguished_text), (ROOMIEST, Layout.roomiest_text)):
        for text in sorted({text_of(lay) for lay in layouts if text_of(lay)}):
            rows = [str(i) for i, lay in enumerate(layouts, start=1) if text_of(lay) == text]
            say(out, f"  rows {','.join(rows)}: {marker}{text}")
    print_pricing(out, ranking.knob_pricing(list(space.choices)))
    print_breakdown(out, best[0][1])
    return True


def print_run_end(spec: Spec, choice: Any, outcome: Any, finished: Any, advice: Advice, as_json: bool) -> None:
    """``run``'s end: the ``--json`` object, or the status line, the preview and the best; then the
    next steps (:func:`autotune.finish.study_end.advise` decided each)."""
    objectives = objectives_of(spec)
    result = outcome.result
    if as_json:
        out.print_json(json.dumps(advice.payload, default=json_default))
    else:
        say(err, advice.status)
        from ..finish.run_output import print_best, print_preview, print_pricing

        if advice.succeeded and choice.simulated:
            print_preview(out, result.records, objectives, result.recommendation)
            if outcome.ranking is not None:
                print_pricing(out, outcome.ranking.knob_pricing(list(spec.space.choices())))
        print_best(
            out,
            result.best,
            objectives,
            "simulated" if choice.simulated else "measured",
            finished.improvement,
            result.recommendation,
            workload=spec.workload.model_dump(),
            cost_per_device_hour=spec.cluster.cost_per_device_hour,
            certificate=result.certificate,
            drift=result.drift,
        )
    if not advice.succeeded:
        warn("no trial succeeded: see `autotune report` for the failure reasons")
    err.print("\n[bold]next steps[/bold]")
    for line in advice.next_steps:
        say(err, line)


def print_report(
    spec: Spec,
    records: list[Any],
    best: list[Any],
    baseline: Any,
    line: Optional[str],
    summary: dict[str, Any],
    top: int,
    as_json: bool,
) -> None:
    """``report``: every trial (the table fitted to 120 columns), the best trial's decision lines,
    before/after, and the summary; or the ``--json`` object."""
    objectives = objectives_of(spec)
    if as_json:
        from ..finish.report import best_payload

        payload = {
            "study": spec.name,
            "objectives": [{"metric": m, "direction": d} for m, d in objectives],
            "trials": [r.to_json() for r in records],
            "best": [best_payload(b) for b in best],
            "baseline": best_payload(baseline) if baseline else None,
            "improvement": line,
            "summary": summary,
        }
        out.print_json(json.dumps(payload, default=json_default))
        return
    from ..finish.report import results_rows, status_line, summary_lines
    from ..finish.report_table import print_report_table
    from ..finish.run_output import WIDTH, decision_lines, wrap_line

    rows = results_rows(records, objectives, spec.workload.kind)
    out.print(Text.assemble((escape_text(spec.name), "bold"), escape_text(f": {status_line(records)}")))
    print_report_table(out, rows, records, objectives, top)
    decision = decision_lines(best[0], spec.workload.model_dump(), spec.cluster.cost_per_device_hour) if best else []
    if decision:
        out.print(f"best trial {best[0].number}:", markup=False)
        for text in decision:
            for part in wrap_line(f"  {escape_text(text)}", WIDTH, indent=6):
                out.print(part, markup=False)
    if line:
        say(out, line)
    for text in summary_lines(summary):  # escaped by summary_lines (each line wrapped to fit)
        out.print(text, markup=False, highlight=False)


def spec_summary(spec: Spec) -> str:
    """One line that says what a spec tunes: the model, the workload, the cluster, the backend and
    target, the objectives (resolved) and the budget."""
    from ..spec.schema import ServeWorkload, TrainWorkload

    w = spec.workload
    if isinstance(w, TrainWorkload):
        work = f"train seq {w.seq_len} gbs {w.global_batch_size}"
    elif isinstance(w, ServeWorkload):
        prompt, output = w.traffic.mean()
        rates = "/".join(f"{r:g}" for r in w.traffic.rates)
        work = f"serve prompt ~{prompt:.0f} output ~{output:.0f} at {rates} req/s"
        work += f", SLO ttft p99 {w.slo.ttft_p99_ms:g} ms"
        if w.slo.tpot_p99_ms:
            work += f" tpot p99 {w.slo.tpot_p99_ms:g} ms"
    else:
        work = f"infer prompt {w.prompt_len} gen {w.gen_len}"
    objs = ", ".join(f"{m} ({d[:3]})" for m, d in objectives_of(spec))
    n = spec.model.num_parameters()
    size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
    return (
        f"{spec.name}: {spec.model.name} ({size} params), {work}, "
        f"{spec.cluster.nodes}x{spec.cluster.devices_per_node} {spec.cluster.accelerator} "
        f"({spec.cluster.profile_name}), {len(spec.space.choices())} searched params, "
        f"backend {spec.backend.kind}, target {target_of(spec)}, objectives {objs}, "
        f"budget {spec.search.n_trials} trials"
    )
