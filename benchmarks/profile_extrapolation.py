"""How far a layout's memory profile reads the full model's peak, from two near profiles and with a
third at half the stage (issue 41): the benchmark worlds of ``search_efficiency.py`` on the
production path, each sampled layout profiled at 1 and a few layers per stage (``plan_profile``) and,
where its stage is long enough, at half the stage (``refine_layers``). Each line is read at the full
model with :class:`autotune.guide.memory_profile.StageMemoryFit` as the study reads it, and its error
against the world's true peak is put beside the sd it states: a line that says "1.645 sd under the
limit" should be under-predicted that far in 5 % of layouts (a P(fits) of 0.95 that fails).

    python benchmarks/profile_extrapolation.py [--worlds 6] [--layouts 150] [--scenarios ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import search_efficiency as se  # noqa: E402
from true_world import MIXED_OOM_FORMATS, PATHS, World  # noqa: E402

from autotune.guide.memory_profile import (  # noqa: E402
    DEVICE_PROFILE_NOISE,
    extrapolate_peak,
    layers_per_stage,
    plan_profile,
    profile_request,
    refine_layers,
)
from autotune.spec.resolve import probe_context  # noqa: E402
from autotune.spec.space import Space  # noqa: E402
from autotune.workers.protocol import TrialRequest  # noqa: E402

Z_95 = 1.645  # one-sided: a P(fits) of 0.95


def profile_peak(world: World, ctx, config: dict, per_stage: int) -> float | None:
    """The peak a memory profile of ``config`` with ``per_stage`` layers per stage reports: the
    study's own profile request, measured in the world."""
    full = TrialRequest(
        params=dict(config), model=dict(ctx.model), workload=dict(ctx.workload), cluster=dict(ctx.cluster)
    )
    run = profile_request(full, per_stage)
    out = world.measure(run.model, run.workload, run.cluster, run.params, 7)
    return float(out["metrics"]["peak_memory_gib"]) if "metrics" in out else None


def read(points: dict[int, float], per_stage: float) -> tuple[float, float]:
    """(peak, sd) of the full model from ``points`` as the study reads them (a device's noise)."""
    estimate = extrapolate_peak({0: points}, per_stage, DEVICE_PROFILE_NOISE)
    return estimate.peak_gib, estimate.sd_gib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="7b-8x64,7b-8x32,13b-8x64,70b-32x64")
    ap.add_argument("--worlds", type=int, default=6)
    ap.add_argument("--layouts", type=int, default=150, help="layouts sampled per world")
    args = ap.parse_args(argv)
    rows: dict[str, list[tuple[float, float, float]]] = {"two profiles": [], "two, where a third runs": [], "three": []}
    for scenario in args.scenarios.split(","):
        base = se.spec_for(scenario, se.SCENARIOS[scenario], 25, 0, None)
        space = Space(base)
        configs = space.enumerate().configs
        ctx = probe_context(base)
        for w in range(args.worlds):
            world = World.draw(1000 + w, ctx.hardware, space.choices, ())
            world.on_path(PATHS["production"], MIXED_OOM_FORMATS[(w + list(se.SCENARIOS).index(scenario)) % 4])
            rng = np.random.default_rng(w)
            for i in rng.choice(len(configs), min(args.layouts, len(configs)), replace=False):
                config = configs[int(i)]
                plan = plan_profile(ctx.model, config)
                if plan is None:
                    continue
                per_stage = layers_per_stage(ctx.model, config)
                third = refine_layers(ctx.model, config, plan)
                points = {k: profile_peak(world, ctx, config, k) for k in (*plan, *([third] if third else []))}
                if any(v is None for v in points.values()):
                    continue
                true = float(world.truth(ctx.model, ctx.workload, dict(ctx.cluster), [config])["peak_memory_gib"][0])
                two = read({k: points[k] for k in plan}, per_stage)
                rows["two profiles"].append((two[0] / true - 1, (two[0] - true) / two[1], two[1] / true))
                if third:
                    rows["two, where a third runs"].append(rows["two profiles"][-1])
                    mean, sd = read(points, per_stage)
                    rows["three"].append((mean / true - 1, (mean - true) / sd, sd / true))
    print(f"{'profiles':26} {'layouts':>8} {'mean error':>11} {'rms':>7} {'stated sd':>10} {'under by > 1.645 sd':>20}")
    for name, values in rows.items():
        if not values:
            continue
        err, z, sd = (np.array([v[j] for v in values]) for j in range(3))
        print(
            f"{name:26} {len(err):8d} {err.mean() * 100:+10.2f}% {np.sqrt((err**2).mean()) * 100:6.2f}% "
            f"{np.mean(sd) * 100:9.2f}% {np.mean(z < -Z_95) * 100:19.1f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
