"""Two runs of ``search_efficiency.py`` on the same worlds, judged world by world: is the difference
one this benchmark can tell from chance?

A change of the guide reshuffles which worlds a study gets right: on the search benchmark the
variants of 2026-12-02 each turned 3-12 worlds of 120-240 and lost 3-25, so a share that moved
by a few worlds may have moved by chance. The share of worlds within the tolerance cannot say
so; the worlds can. Both runs see the same worlds (the same seeds), so each world is a pair: the
worlds where exactly one run reported a best within the tolerance are the evidence, and under "no
difference" each of them falls either way with probability 1/2 (the exact sign test, McNemar's
test for paired shares). The table gives, per scenario and pooled, the worlds each run got right,
those the second run turned and lost, and the two-sided p-value.

    python benchmarks/compare_search_runs.py --before A.json [A2.json ...] --after B.json [B2.json ...] \\
        [--within 0.02]

Each file is a ``search_efficiency.py --json`` output; several files on one side are pooled (the
worlds 0-29 of one run and 30-89 of another). Only worlds present on both sides are compared, by
scenario and world number.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterator

from scipy.stats import binomtest


def study_rows(paths: list[Path], method: str) -> Iterator[tuple[Path, str, dict[str, Any]]]:
    """(file, scenario, row) of every ``method`` study with a world and a final best, file by file;
    a file that is not a ``search_efficiency.py --json`` output is named (``pool_search_runs.py``
    reads the runs so too)."""
    for path in paths:
        try:
            data = json.loads(path.read_text())
            runs = {scenario: (methods or {}).get(method, []) for scenario, methods in data.items()}
        except (OSError, json.JSONDecodeError, AttributeError) as exc:
            raise SystemExit(f"{path}: not a search_efficiency.py --json output ({exc})") from None
        for scenario, rows in runs.items():
            for row in rows:
                if "world" in row and "final" in row:
                    yield path, scenario, row


def finals(paths: list[Path], method: str) -> dict[tuple[str, int], float]:
    """(scenario, world) -> the final reported best over the optimum, from every file."""
    return {(scenario, int(row["world"])): float(row["final"]) for _, scenario, row in study_rows(paths, method)}


def compare(before: dict, after: dict, within: float) -> list[dict]:
    """One row per scenario, then ``all``: worlds, right before / after, turned, lost, p."""
    threshold = 1.0 - within
    shared = sorted(set(before) & set(after))
    scenarios = sorted({s for s, _ in shared})
    rows = []
    for name in scenarios + ["all"]:
        keys = [k for k in shared if name == "all" or k[0] == name]
        ok_before = [before[k] >= threshold for k in keys]
        ok_after = [after[k] >= threshold for k in keys]
        turned = sum(a and not b for a, b in zip(ok_after, ok_before))
        lost = sum(b and not a for a, b in zip(ok_after, ok_before))
        p = binomtest(turned, turned + lost, 0.5).pvalue if turned + lost else 1.0
        rows.append(
            dict(
                scenario=name,
                worlds=len(keys),
                before=sum(ok_before),
                after=sum(ok_after),
                turned=turned,
                lost=lost,
                p=p,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, nargs="+", required=True, help="the first run's --json file(s)")
    parser.add_argument("--after", type=Path, nargs="+", required=True, help="the second run's --json file(s)")
    parser.add_argument(
        "--within", type=float, default=0.02, help="a world is right when its final best is within this of the optimum"
    )
    parser.add_argument("--method", default="autotune", help="the method compared (a key of the files' scenarios)")
    args = parser.parse_args(argv)
    if not 0 < args.within < 1:
        parser.error(f"--within must be between 0 and 1 (a share of the optimum), got {args.within}")
    before, after = finals(args.before, args.method), finals(args.after, args.method)
    rows = compare(before, after, args.within)
    if rows[-1]["worlds"] == 0:  # the pooled row: no world in both runs
        print("no world is in both runs (same scenarios and world numbers?)", file=sys.stderr)
        return 2
    print(f"within {args.within:.0%} of the optimum, world by world (the exact sign test on the worlds that differ)")
    print("| scenario | worlds | right before | right after | turned | lost | p (two-sided) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['scenario']} | {r['worlds']} | {r['before']} ({r['before'] / r['worlds']:.1%}) | "
            f"{r['after']} ({r['after'] / r['worlds']:.1%}) | {r['turned']} | {r['lost']} | {r['p']:.2f} |"
        )
    pooled = rows[-1]
    verdict = "a difference" if pooled["p"] < 0.05 else "no difference this benchmark can tell from chance"
    print(f"pooled: {pooled['turned']} turned, {pooled['lost']} lost, p = {pooled['p']:.2f}: {verdict} (at 5 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
