"""ZeRO stage 1 (optimizer-state sharding) for parameters torch's ZeroRedundancyOptimizer cannot take.

``ZeroRedundancyOptimizer`` broadcasts parameters with c10d ops, which DTensor parameters (tensor
parallel, or FSDP2's ``replicate`` used under pipeline parallel) do not support. This is the same
algorithm on local shards: gradients are already averaged over the data-parallel ranks by the
wrapper; each dp rank owns a size-balanced subset of the parameters and keeps AdamW state only
for those, updates them, and broadcasts the new values to the other dp ranks (one flat buffer
per owner). Being an ``AdamW`` subclass, the loss scalers drive it like any optimizer.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

__all__ = ["Zero1AdamW", "partition"]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def partition(sizes: list[int], n: int) -> list[int]:
    """Owner rank of each parameter: largest first onto the least-loaded rank (deterministic,
    the same on every rank)."""
    loads = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += sizes[i]
    return owner


class Zero1AdamW(torch.optim.AdamW):
    def __init__(self, params: Iterable[torch.nn.Parameter], group: Any, **kwargs: Any) -> None:
        self._all = list(params)
        super().__init__(self._all, **kwargs)
        self._group = group
        self._rank = dist.get_rank(group)
        n = dist.get_world_size(group)
        self._owner = partition([_local(p).numel() for p in self._all], n)
        self._src = [dist.get_global_rank(group, r) for r in range(n)]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        hidden = []
        for p, owner in zip(self._all, self._owner):
            if owner != self._rank and p.grad is not None:
                hidden.append((p, p.grad))
                p.grad = None  # AdamW skips it: no state, no update for parameters we don't own
        try:
            loss = super().step(closure)
        finally:
            for p, g in hidden:
                p.grad = g
        for r, src in enumerate(self._src):
            tensors = [_local(p) for p, o in zip(self._all, self._owner) if o == r]
            if not tensors:
                continue
            if r == self._rank:
                flat = torch.cat([t.reshape(-1) for t in tensors])
            else:
                flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
            dist.broadcast(flat, src=src, group=self._group)
            if r != self._rank:
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
        return loss
