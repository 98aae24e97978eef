"""Several runs of ``search_efficiency.py`` on different worlds, pooled: how many worlds each
scenario got right, with the share's interval, as one sample.

A criterion judged on 30 or 90 worlds passes or fails by luck near its threshold (30 worlds bound
a share of 90 % only to about 73-98 %), so the benchmark is run again on fresh worlds (another
``--first-world``) and the runs are read together. This script does that reading from the runs'
``--json`` files, so a pooled figure in ``benchmarks/README.md`` comes with the command that gave
it rather than from a calculation by hand:

    python benchmarks/pool_search_runs.py R0.json R30.json R90.json [--within 0.02 0.03]

Per scenario and pooled: the worlds, the share within each tolerance of the optimum (95 %
Clopper-Pearson interval), the OOM share of the full probes (each study's, averaged, as
search_efficiency.py prints it), the certified recommendations and how
many of them were truly within the first tolerance, and the misses (below the first tolerance) by
the study's ``miss_cause``. A world that two files both hold (the same scenario and number) is an
error: a pooled sample counts each world once.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_search_runs import study_rows  # noqa: E402

from autotune.objectives.intervals import share_interval  # noqa: E402


def share_cell(k: int, n: int) -> str:
    """``k/n = share [low-high]``, the 95 % Clopper-Pearson interval (search_efficiency's share
    cell with the counts, without importing the search benchmark to print a table)."""
    interval = share_interval(k, n)
    if interval is None:
        return "-"
    return f"{k}/{n} = {k / n:.1%} [{interval[0]:.0%}-{interval[1]:.0%}]"


def studies(paths: list[Path], method: str) -> dict[tuple[str, int], dict[str, Any]]:
    """(scenario, world) -> the study's row, from every file; a world in two files is an error."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for path, scenario, row in study_rows(paths, method):
        key = (scenario, int(row["world"]))
        if key in out:
            raise SystemExit(
                f"{path}: {scenario} world {key[1]} is in an earlier file too: pool runs of different worlds"
            )
        out[key] = row
    return out


def pooled_rows(rows: dict[tuple[str, int], dict[str, Any]], within: list[float]) -> list[dict[str, Any]]:
    """One row per scenario, then ``all``: worlds, right per tolerance, OOM full probes, certificates, misses."""
    scenarios = sorted({s for s, _ in rows})
    out = []
    for name in scenarios + ["all"]:
        picked = [r for (s, _), r in sorted(rows.items()) if name == "all" or s == name]
        certified = [r for r in picked if r.get("certified")]
        misses = collections.Counter(str(r.get("miss") or "unnamed") for r in picked if r["final"] < 1.0 - within[0])
        out.append(
            dict(
                scenario=name,
                worlds=len(picked),
                right=[sum(r["final"] >= 1.0 - w for r in picked) for w in within],
                # each study's OOM share of its full probes, averaged, as search_efficiency.py prints it
                oom=sum(float(r.get("oom_share", 0.0)) for r in picked) / len(picked) if picked else 0.0,
                certified=len(certified),
                certified_right=sum(r["final"] >= 1.0 - within[0] for r in certified),
                misses=dict(misses.most_common()),
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs="+", help="search_efficiency.py --json outputs of different worlds")
    parser.add_argument(
        "--within", type=float, nargs="+", default=[0.02, 0.03], help="tolerances of the optimum (the first judges)"
    )
    parser.add_argument("--method", default="autotune", help="the method pooled (a key of the files' scenarios)")
    args = parser.parse_args(argv)
    for w in args.within:
        if not 0 < w < 1:
            parser.error(f"--within must be between 0 and 1 (a share of the optimum), got {w}")
    rows = pooled_rows(studies(args.files, args.method), args.within)
    if rows[-1]["worlds"] == 0:
        print(f"no {args.method} study in {', '.join(map(str, args.files))}", file=sys.stderr)
        return 2
    heads = " | ".join(f"within {w:.0%}" for w in args.within)
    print(f"{len(args.files)} run(s) pooled ({args.method}); shares with their 95 % interval (Clopper-Pearson)")
    print(
        f"| scenario | worlds | {heads} | OOM full probes | certified (within {args.within[0]:.0%}) | misses by cause |"
    )
    print("|---|---|" + "---|" * len(args.within) + "---|---|---|")
    for r in rows:
        shares = " | ".join(share_cell(k, r["worlds"]) for k in r["right"])
        misses = "; ".join(f"{cause}: {n}" for cause, n in r["misses"].items()) or "-"
        print(
            f"| {r['scenario']} | {r['worlds']} | {shares} | {r['oom']:.1%} | "
            f"{r['certified']} ({r['certified_right']}) | {misses} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
