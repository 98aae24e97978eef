"""A transformer layer's step measured in context: what tensor parallelism really costs.

Collectives timed between idle ranks (``calibrate_collectives.measure_collectives``) price a message on the
wire. A tensor-parallel layer pays more at each of its collectives: DTensor's dispatch around
every sharded linear, the host issuing the collective after its compute, and the wait for the
slower rank at a blocking all-reduce. On a 2-core CPU host with gloo that is ~7 ms per collective
against the ~0.4 ms idle ranks measure, and a profile that prices tensor parallelism from the idle
figure ranks tp = 2 configs above tp = 1 ones that run 1.5-2x faster.

So the layer is measured on the same ranks twice, with the probe's own block
(``torch_probe.model.TransformerBlock``) and its own plan (``parallelize.block_tp_plan``):

- **sharded**: DTensor tensor parallelism, 2 all-reduces forward and 2 backward per layer;
- **local**: the same per-rank shard without communication (projections 1/tp wide),

and the difference per collective, less what the message's bytes cost at the fitted bus
bandwidth, is the latency the simulator's tensor-parallel collectives pay
(``tp_collective_latency_us``; an all-reduce pays it twice, as it pays ``collective_latency_us``).
Runs inside ``calibrate_collectives._collective_worker``, whose process group it uses.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["LAYER_STEP", "QUICK_LAYER_STEP", "measure_tp_layer", "fit_tp_latency"]

# (model shape, dtype, [(micro-batch, seq)], layers) per accelerator: the tiny probes' layer on
# the CPU, a Llama-2-7B layer on accelerators (the sizes tensor parallelism sends there).
_TINY = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=688)
_LLAMA_7B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008)
LAYER_STEP: dict[str, dict[str, Any]] = {
    "cpu": dict(shape=_TINY, dtype="fp32", batches=((1, 256), (2, 256), (4, 256)), layers=2),
    "cuda": dict(shape=_LLAMA_7B, dtype="bf16", batches=((1, 2048), (1, 4096), (2, 4096)), layers=2),
    "npu": dict(shape=_LLAMA_7B, dtype="bf16", batches=((1, 2048), (1, 4096), (2, 4096)), layers=2),
}
QUICK_LAYER_STEP: dict[str, dict[str, Any]] = {
    "cpu": dict(LAYER_STEP["cpu"], batches=((1, 256), (2, 256))),
    "cuda": dict(LAYER_STEP["cuda"], batches=((1, 2048), (1, 4096))),
    "npu": dict(LAYER_STEP["npu"], batches=((1, 2048), (1, 4096))),
}
COLLECTIVES_PER_LAYER = 4  # Rowwise o and down: an all-reduce each forward, Colwise inputs' grads backward


def _blocks(cfg: Any, layers: int, tp: int, mesh: Any, sharded: bool, device: Any, dtype: Any) -> list[Any]:
    import torch

    from .torch_probe.model import Linear, TransformerBlock
    from .torch_probe.parallelize import block_tp_plan

    blocks = []
    with torch.device(device):
        for _ in range(layers):
            block = TransformerBlock(cfg)
            if sharded:
                from torch.distributed.tensor.parallel import parallelize_module

                parallelize_module(block, mesh, block_tp_plan(block, sequence_parallel=False))
            else:  # the rank's shard, no communication: Colwise outputs and Rowwise inputs 1/tp wide
                attn, ffn, h = block.attention, block.feed_forward, cfg.hidden_size
                for mod, name in ((attn, "wq"), (attn, "wk"), (attn, "wv"), (ffn, "w1"), (ffn, "w3")):
                    if hasattr(mod, name):
                        setattr(mod, name, Linear(h, getattr(mod, name).out_features // tp, bias=False))
                attn.wo = Linear(attn.wo.in_features // tp, h, bias=False)
                ffn.w2 = Linear(ffn.w2.in_features // tp, h, bias=False)
            blocks.append(block.to(dtype))
    return blocks


def measure_tp_layer(
    accelerator: str, device: Any, sync: Callable[[], None], tp: int, repeats: int, quick: bool = False
) -> dict[str, Any]:
    """Seconds of ``layers`` blocks' forward + backward, sharded over the ``tp`` ranks of the
    default process group and as the local shard alone, per (micro-batch, seq); with the bytes
    each all-reduce carries. Every rank must call it (the sharded runs are collective)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from .torch_probe.model import rope_tables
    from .torch_probe.plan import ModelConfig

    setup = (QUICK_LAYER_STEP if quick else LAYER_STEP)[accelerator]
    cfg = ModelConfig(num_hidden_layers=setup["layers"], vocab_size=2, **setup["shape"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[setup["dtype"]]
    mesh = init_device_mesh(torch.device(device).type, (tp,))
    torch.manual_seed(0)
    rows = []
    for batch, seq in setup["batches"]:
        cos, sin = rope_tables(cfg.head_dim, seq, cfg.rope_theta, device=device)
        x0 = torch.randn(batch, seq, cfg.hidden_size, device=device, dtype=dtype)
        row: dict[str, Any] = {
            "micro_batch": batch,
            "seq": seq,
            "allreduce_bytes": batch * seq * cfg.hidden_size * x0.element_size(),
        }
        stacks = {
            mode: _blocks(cfg, setup["layers"], tp, mesh, mode == "sharded", device, dtype)
            for mode in ("local", "sharded")
        }

        def step(blocks: list[Any]) -> None:
            out = x0.clone().requires_grad_()
            for block in blocks:
                out = block(out, cos, sin)
            out.float().sum().backward()

        for blocks in stacks.values():  # warm-up: allocator, DTensor's sharding-propagation cache
            for _ in range(2):
                step(blocks)
        sync()
        samples: dict[str, list[float]] = {mode: [] for mode in stacks}
        # interleaved, so a host's drift (a noisy neighbour, frequency) weighs on both alike;
        # many samples, since rank skew makes single sharded steps noisy
        for _ in range(max(repeats, 9 if quick else 15)):
            for mode, blocks in stacks.items():
                t0 = time.perf_counter()
                step(blocks)
                sync()
                samples[mode].append(time.perf_counter() - t0)
        for mode, times in samples.items():
            row[f"{mode}_s"] = statistics.median(times)
        rows.append(row)
    return {"tp": tp, "layers": setup["layers"], "dtype": setup["dtype"], "rows": rows}


def fit_tp_latency(measured: dict[str, Any], allreduce_busbw: float) -> float:
    """Seconds of ``tp_collective_latency_us`` from ``measure_tp_layer``'s rows: each row's
    sharded - local time per collective is ``2 latency + 2 (g-1)/g bytes / bus bandwidth`` (the
    simulator's all-reduce); the median over rows of what the bandwidth term leaves, halved.
    Never below zero (a host where the shards ran faster than the local copy measured noise)."""
    tp = measured["tp"]
    per_layer = COLLECTIVES_PER_LAYER * measured["layers"]
    share = 2.0 * (tp - 1) / tp
    latencies = [
        ((r["sharded_s"] - r["local_s"]) / per_layer - share * r["allreduce_bytes"] / allreduce_busbw) / 2.0
        for r in measured["rows"]
    ]
    return max(0.0, statistics.median(latencies))
