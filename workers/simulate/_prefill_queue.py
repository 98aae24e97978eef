"""The prefill pool's queue: TTFT quantiles of an engine that only prefills, batching whole prompts.

A disaggregated prefill instance (:mod:`._serve_disagg`) runs steps of prompts only. vLLM's scheduler
starts a step with every prompt waiting, up to the step's budget (``max_num_batched_tokens``: n_max
prompts), and a step of n prompts takes T(n) = a + b n (a, what a step costs whatever it carries:
weights read, launches, the collectives' latency; b, a prompt's compute). A request waits for the
step in progress, then is served in the next step with everyone who arrived during that one. That
is a batch-service queue (M/G^[1, n_max]/1 with a service time that grows with the batch) whose
quantiles have no closed form.

It was priced as a fixed point: a step carries what arrived during the one before, plus, while prompts
are backlogged (probability k P / c_max), the whole budget. Against a discrete-event run of the same
scheduler and step times (OPT-13B on an A100, 512-token prompts, n_max 16: T(1) 63 ms, T(16) 925 ms),
that fixed point ran away: at 10 prompts/s (58 % of capacity) it put 7.7 prompts in every step and
TTFT's p90 at 594 ms where the scheduler's is 242 ms (2.5x; 953 against 349 at 12 prompts/s).

In units of the one-prompt step T(1) the queue has three parameters: the load u = lambda T(1), the
step's fixed share beta = a / T(1), and n_max. The table (``prefill_queue.json``, written by
:func:`build_table`, a vectorised discrete-event run of that scheduler: Poisson arrivals, common random
numbers, the first tenth of the requests discarded) holds TTFT's mean and quantiles over T(1) on a
grid of rho = u / u_cap (u_cap = n_max / (beta + (1 - beta) n_max), the capacity), beta and
log2 n_max; :func:`prefill_ttft` interpolates it. Each figure is stored as (TTFT / T(1) - 1) (1 - rho):
the wait, scaled as heavy traffic scales it, smooth up to rho = 1, so that rho beyond the grid's last
point (0.95) extrapolates as Kingman's 1 / (1 - rho) does.

Left out (stated): prompt lengths vary (the caller adds their spread as before), arrivals burstier
than Poisson, and a step's time that is not affine in its prompts (a, b are read from T(1) and
T(n_max)).

    python -m autotune.workers.simulate._prefill_queue   # rewrites the table (about a minute)
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np

TABLE = Path(__file__).resolve().parent / "prefill_queue.json"
FIGURES = ("mean", "0.01", "0.5", "0.9", "0.99", "0.999")
RHO_GRID = tuple(round(x, 4) for x in np.concatenate([np.linspace(0.02, 0.8, 40), np.linspace(0.82, 0.95, 8)]))
BETA_GRID = (0.0, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.95, 0.98, 1.0)
NMAX_GRID = (1, 2, 4, 8, 16, 32, 64, 128)
WARM_UP = 0.1  # the share of each run's first requests discarded (the queue starts empty)


def capacity_load(beta: np.ndarray, n_max: np.ndarray) -> np.ndarray:
    """lambda T(1) at capacity: n_max prompts every T(n_max)."""
    return n_max / (beta + (1.0 - beta) * n_max)


def run_batch_queue(u: np.ndarray, beta: np.ndarray, n_max: np.ndarray, requests: int, seed: int = 0) -> np.ndarray:
    """TTFT / T(1) of ``requests`` Poisson arrivals at load u, for every (u, beta, n_max) at once: the
    scheduler starts a step with every prompt waiting (up to n_max) whenever it is free, a step of n
    prompts takes beta + (1 - beta) n. Returns (E, requests)."""
    u, beta, n_max = (np.asarray(x, dtype=float).ravel() for x in (u, beta, n_max))
    e = u.size
    gaps = np.random.default_rng(seed).exponential(1.0, requests)
    arrived = np.cumsum(gaps)  # arrival times x u (common random numbers for every element)
    end_of = np.full((e, requests), np.nan)
    t = np.zeros(e)
    i = np.zeros(e, dtype=np.int64)
    rows = np.arange(e)
    cap = n_max.astype(np.int64)
    while True:
        live = i < requests
        if not live.any():
            break
        r, ii = rows[live], i[live]
        start = np.maximum(t[r], arrived[ii] / u[r])
        j = np.minimum(np.searchsorted(arrived, start * u[r], side="right"), ii + cap[r])
        j = np.minimum(np.maximum(j, ii + 1), requests)
        end = start + beta[r] + (1.0 - beta[r]) * (j - ii)
        end_of[r, ii] = end
        t[r], i[r] = end, j
    # every request of a step ends with it: forward-fill each step's end over its batch
    filled = np.where(np.isnan(end_of), -np.inf, end_of)
    filled = np.maximum.accumulate(filled, axis=1)
    return filled - arrived[None, :] / u[:, None]


def build_table(requests: int = 40_000, heavy_requests: int = 200_000, seed: int = 0) -> dict:
    """The table over (rho, beta, n_max): the discrete-event run at every grid point (``heavy_requests``
    above rho 0.8, where the queue's excursions are long and its p99 needs more of them)."""
    rho, beta, n = np.meshgrid(np.array(RHO_GRID), np.array(BETA_GRID), np.array(NMAX_GRID), indexing="ij")
    u = rho * capacity_load(beta, n)
    figures = {f: np.empty(rho.size) for f in FIGURES}
    flat = [x.ravel() for x in (u, beta, n, rho)]
    chunk = 128
    for lo in range(0, rho.size, chunk):
        sl = slice(lo, lo + chunk)
        n_req = heavy_requests if flat[3][sl].max() > 0.8 else requests
        ttft = run_batch_queue(flat[0][sl], flat[1][sl], flat[2][sl], n_req, seed)[:, int(WARM_UP * n_req) :]
        scale = 1.0 - flat[3][sl]
        figures["mean"][sl] = (ttft.mean(axis=1) - 1.0) * scale
        for f in FIGURES[1:]:
            figures[f][sl] = (np.quantile(ttft, float(f), axis=1) - 1.0) * scale
    return {
        "about": "TTFT of a prefill-only engine batching whole prompts, (TTFT / T(1) - 1) (1 - rho); "
        f"workers/simulate/_prefill_queue.py, {requests} requests a point ({heavy_requests} above rho 0.8), "
        f"seed {seed}",
        "rho": list(RHO_GRID),
        "beta": list(BETA_GRID),
        "n_max": list(NMAX_GRID),
        "figures": {f: np.round(v.reshape(rho.shape), 5).tolist() for f, v in figures.items()},
    }


@lru_cache(maxsize=1)
def _table() -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    data = json.loads(TABLE.read_text())
    figs = {f: np.asarray(v, dtype=float) for f, v in data["figures"].items()}
    return np.asarray(data["rho"]), np.asarray(data["beta"]), np.log2(np.asarray(data["n_max"])), figs


def _axis(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lower index, weight of the upper) of x on a sorted grid, held at its ends."""
    x = np.clip(x, grid[0], grid[-1])
    lo = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, grid.size - 2)
    return lo, (x - grid[lo]) / (grid[lo + 1] - grid[lo])


def prefill_ttft(lam: np.ndarray, t_one: np.ndarray, t_max: np.ndarray, n_max: np.ndarray) -> dict[str, np.ndarray]:
    """TTFT's mean and quantiles (seconds; keys as :data:`FIGURES`) of a prefill instance at ``lam``
    prompts/s, its one-prompt step ``t_one``, its full step ``t_max`` (n_max prompts), from the table.
    Below capacity only (rho is held at 0.99, as the steady-state formulas are): the caller adds the
    window's backlog beyond it. Shapes broadcast."""
    n_max = np.maximum(np.asarray(n_max, dtype=float), 1.0)
    per_prompt = np.where(n_max > 1.0, (t_max - t_one) / np.maximum(n_max - 1.0, 1e-12), t_one)
    beta = np.clip(1.0 - per_prompt / t_one, 0.0, 1.0)
    u = lam * t_one
    rho = np.clip(u / capacity_load(beta, n_max), 0.0, 0.99)
    g_rho, g_beta, g_n, figs = _table()
    shape = np.broadcast_shapes(rho.shape, beta.shape, n_max.shape)
    axes = ((g_rho, rho), (g_beta, beta), (g_n, np.log2(n_max)))
    (i0, w0), (i1, w1), (i2, w2) = (_axis(g, np.broadcast_to(x, shape)) for g, x in axes)
    out = {}
    for f, table in figs.items():
        v = 0.0
        for d0, c0 in ((0, 1.0 - w0), (1, w0)):
            for d1, c1 in ((0, 1.0 - w1), (1, w1)):
                for d2, c2 in ((0, 1.0 - w2), (1, w2)):
                    v = v + c0 * c1 * c2 * table[i0 + d0, i1 + d1, i2 + d2]
        out[f] = t_one * (1.0 + np.maximum(v, 0.0) / (1.0 - rho))
    return out


if __name__ == "__main__":
    TABLE.write_text(json.dumps(build_table(), separators=(",", ":")) + "\n")
    print(f"wrote {TABLE}")
