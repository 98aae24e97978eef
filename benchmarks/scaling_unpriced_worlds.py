"""The projection from a slice to a larger cluster in worlds whose scaling the model does not price
(issue 45, item 5c).

The projection (:mod:`autotune.guide.projection`) anchors on a measurement at the probe size and
lets the calibrated model say how the step changes with size. That cancels whatever the model
gets wrong uniformly at both sizes; it cannot cancel an effect present at one size only. Each world
here is the simulator's step (compute and exposed communication, Ascend 910B profile, 8 devices a
node) with effects the model has no term for, drawn per world:

- ``contention``: the inter-node links are shared (oversubscribed uplinks): the communication at
  n nodes takes ``1 + c log2(n)`` times the model's, c in [0.05, 0.3];
- ``stragglers``: every step waits for the slowest of its ranks: the step at r ranks takes
  ``1 + s sqrt(2 ln r)`` times (the expected maximum of r ranks' jitter of relative sd s, s in
  [0.5 %, 2 %]);
- ``overlap_break``: the gradient communication is hidden behind compute up to some size and not
  beyond: from a break size (2, 4 or 8 nodes) on, the exposed communication is ``1 + b`` times the
  model's, b in [0.5, 2];
- ``all``: the three together.

In each world, every config is "measured" at the probe size (the true step, 2 % noise) and
projected to 4, 8 and 16 nodes, weak scaling (each rank's work kept); the truth there is read with
the same noise. Printed per family and target size: the median absolute error of the projected
tokens/s/device, the share of configs inside the projection's stated bands (+/-5.6 %: the median
error on published rows; +/-8.8 %: 80 % of them), the Spearman correlation of the projected and
true rankings, and how far the config the projection ranks first is from the true best (what a
study on the slice would recommend). A world without effects (``none``) is the control: only
the noise.

    python benchmarks/scaling_unpriced_worlds.py [--worlds 20] [--probe-nodes 1] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from autotune.guide.projection import PROJECTION_BAND, PROJECTION_BAND_80, ModelPoint, point_of_result  # noqa: E402
from autotune.guide.projection import projected_step  # noqa: E402
from autotune.spec.models import PRESETS  # noqa: E402
from autotune.workers.protocol import TrialRequest  # noqa: E402
from autotune.workers.simulate import simulate_trial  # noqa: E402

FAMILIES = ("none", "contention", "stragglers", "overlap_break", "all")
TARGETS = (4, 8, 16)
DEVICES_PER_NODE = 8
SEQ = 4096
GRAD_ACCUM = 4  # micro-batches per step and replica, at every size (weak scaling)
NOISE = 0.02
# (model, tp, pp, micro-batch, ZeRO stage, recompute): layouts a 910B study ranks
CONFIGS = [
    ("llama2-7b", 1, 1, 1, 1, "full"),
    ("llama2-7b", 2, 1, 1, 1, "selective"),
    ("llama2-7b", 2, 1, 2, 1, "full"),
    ("llama2-7b", 4, 1, 2, 0, "none"),
    ("llama2-7b", 4, 2, 1, 0, "none"),
    ("llama2-7b", 8, 1, 4, 0, "none"),
    ("llama2-7b", 1, 2, 1, 1, "full"),
    ("llama2-7b", 2, 2, 2, 1, "selective"),
    ("llama2-13b", 4, 2, 1, 1, "selective"),
    ("llama2-13b", 8, 1, 1, 1, "full"),
    ("llama2-13b", 2, 4, 1, 1, "full"),
    ("llama2-13b", 8, 2, 2, 0, "selective"),
]


@dataclass(frozen=True)
class World:
    family: str
    contention: float = 0.0
    straggler_sd: float = 0.0
    overlap_break_nodes: int = 0
    overlap_penalty: float = 0.0

    @classmethod
    def draw(cls, family: str, rng: random.Random) -> "World":
        on = (lambda name: family in (name, "all")) if family != "none" else (lambda name: False)
        return cls(
            family,
            contention=rng.uniform(0.05, 0.3) if on("contention") else 0.0,
            straggler_sd=rng.uniform(0.005, 0.02) if on("stragglers") else 0.0,
            overlap_break_nodes=rng.choice((2, 4, 8)) if on("overlap_break") else 0,
            overlap_penalty=rng.uniform(0.5, 2.0) if on("overlap_break") else 0.0,
        )

    def step(self, point: ModelPoint, nodes: int) -> float:
        """The true step at ``nodes`` nodes: the model's, with this world's effects."""
        comm = point.comm_s
        if nodes > 1:
            comm *= 1.0 + self.contention * math.log2(nodes)
        if self.overlap_break_nodes and nodes >= self.overlap_break_nodes:
            comm *= 1.0 + self.overlap_penalty
        ranks = point.devices
        straggle = 1.0 + self.straggler_sd * math.sqrt(2.0 * math.log(ranks)) if ranks > 1 else 1.0
        return (point.compute_s + comm) * straggle


def request(config: tuple, nodes: int) -> TrialRequest:
    model, tp, pp, mbs, zero, recompute = config
    devices = nodes * DEVICES_PER_NODE
    dp = devices // (tp * pp)
    return TrialRequest(
        params=dict(
            tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, zero_stage=zero, recompute=recompute, grad_accum=GRAD_ACCUM
        ),
        model=dict(PRESETS[model], name=model),
        workload=dict(kind="train", seq_len=SEQ, global_batch_size=mbs * GRAD_ACCUM * dp),
        cluster=dict(
            accelerator="npu",
            nodes=nodes,
            devices_per_node=DEVICES_PER_NODE,
            world_size=devices,
            hardware="ascend-910b",
        ),
        study="unpriced-worlds",
        number=0,
    )


def model_points(probe_nodes: int) -> dict[tuple, dict[int, ModelPoint]]:
    """The simulator's step per config at the probe size and each target (configs it cannot price,
    or that do not fit, left out)."""
    points: dict[tuple, dict[int, ModelPoint]] = {}
    for config in CONFIGS:
        at: dict[int, ModelPoint] = {}
        for nodes in (probe_nodes, *TARGETS):
            req = request(config, nodes)
            result = simulate_trial(req)
            point = point_of_result(result, float(req.workload["global_batch_size"]) * SEQ, nodes * DEVICES_PER_NODE)
            if result.status != "ok" or point is None:
                break
            at[nodes] = point
        else:
            points[config] = at
    return points


def spearman(xs: list[float], ys: list[float]) -> float:
    from scipy.stats import spearmanr

    rho = spearmanr(xs, ys).statistic
    return 0.0 if math.isnan(rho) else float(rho)


def run(worlds: int, probe_nodes: int, seed: int) -> dict[str, dict[int, dict[str, float]]]:
    """Per family and target: median abs error, coverage of each band, median Spearman, median and
    worst (pick's true tokens/s over the true best)."""
    points = model_points(probe_nodes)
    rng = random.Random(seed)
    out: dict[str, dict[int, dict[str, float]]] = {}
    for family in FAMILIES:
        per_target: dict[int, dict[str, list[float]]] = {t: {"err": [], "rho": [], "pick": []} for t in TARGETS}
        for _ in range(worlds):
            world = World.draw(family, rng)
            measured = {
                c: world.step(p[probe_nodes], probe_nodes) * (1.0 + rng.gauss(0.0, NOISE)) for c, p in points.items()
            }
            for target in TARGETS:
                projected, true = [], []
                for config, at in points.items():
                    step = projected_step(measured[config], None, at[probe_nodes], at[target])
                    truth = world.step(at[target], target) * (1.0 + rng.gauss(0.0, NOISE))
                    projected.append(at[target].tokens_per_s_per_device(step))
                    true.append(at[target].tokens_per_s_per_device(truth))
                    per_target[target]["err"].append(projected[-1] / true[-1] - 1.0)
                per_target[target]["rho"].append(spearman(projected, true))
                pick = max(range(len(projected)), key=projected.__getitem__)
                per_target[target]["pick"].append(true[pick] / max(true))
        out[family] = {
            t: {
                "median_abs_error": statistics.median(abs(e) for e in v["err"]),
                "within_band": sum(abs(e) <= PROJECTION_BAND for e in v["err"]) / len(v["err"]),
                "within_band_80": sum(abs(e) <= PROJECTION_BAND_80 for e in v["err"]) / len(v["err"]),
                "spearman": statistics.median(v["rho"]),
                "pick_median": statistics.median(v["pick"]),
                "pick_worst": min(v["pick"]),
                "configs": len(points),
            }
            for t, v in per_target.items()
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, default=20, help="worlds per family")
    ap.add_argument("--probe-nodes", type=int, default=1, help="the probe size (nodes of 8 devices)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    result = run(args.worlds, args.probe_nodes, args.seed)
    configs = next(iter(next(iter(result.values())).values()))["configs"]
    print(
        f"projection from {args.probe_nodes} node(s) of {DEVICES_PER_NODE} devices, {configs} configs, "
        f"{args.worlds} worlds per family, {NOISE:.0%} noise on every reading"
    )
    print(
        f"{'family':<14} {'target':>6} {'median err':>10} {'in +/-' + format(PROJECTION_BAND, '.1%'):>11} "
        f"{'in +/-' + format(PROJECTION_BAND_80, '.1%'):>11} {'Spearman':>8} {'pick (median)':>13} {'pick (worst)':>12}"
    )
    for family, per_target in result.items():
        for target, f in per_target.items():
            print(
                f"{family:<14} {target:>4} n {f['median_abs_error']:>10.1%} {f['within_band']:>11.0%} "
                f"{f['within_band_80']:>11.0%} {f['spearman']:>8.2f} {f['pick_median']:>13.3f} {f['pick_worst']:>12.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
