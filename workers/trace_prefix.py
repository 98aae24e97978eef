"""A trace's shared prefixes: what an engine's prefix cache can reuse, from the trace's ``hash_ids``.

Mooncake's trace format (kvcache-ai/Mooncake ``mooncake_trace.jsonl`` at d21da178; the format NVIDIA
Dynamo's ``benchmarks/data_generator/README.md`` and AISBench's ``mooncake_trace`` dataset read) gives
each request the ids of its prompt's blocks, ``block_tokens`` tokens each (512 in Mooncake's traces):
two requests whose ``hash_ids`` start alike share that prompt prefix (a multi-turn conversation's
history, a system prompt). Each id hashes its block and all before it, so a request reuses the
leading run of its ids that earlier requests already sent. The serving probe builds every block's
tokens from its id and its run (within a run the same id, the same tokens; a later run replays other
conversations), and the simulator prices the share of prompt tokens an unbounded prefix cache would
skip in a run of the probe's length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["MOONCAKE_BLOCK_TOKENS", "reused_tokens", "reuse_share"]

MOONCAKE_BLOCK_TOKENS = 512


def reused_tokens(blocks: Iterable[Sequence[int]], prompt_lens: Iterable[int], block_tokens: int) -> list[int]:
    """For each request in arrival order, the prompt tokens an earlier request already sent: the
    leading run of its block ids seen before, ``block_tokens`` each, at most its prompt."""
    seen: set[int] = set()
    out = []
    for ids, prompt in zip(blocks, prompt_lens):
        run = 0
        for block in ids:
            if block not in seen:
                break
            run += 1
        out.append(min(run * int(block_tokens), int(prompt)))
        seen.update(ids)
    return out


def reuse_share(
    blocks: Sequence[Sequence[int]], prompt_lens: Sequence[int], block_tokens: int, window: int | None = None
) -> float:
    """The share of prompt tokens a prefix cache that keeps everything would reuse (0 to 1): over the
    whole trace, or, with ``window``, over runs of that many consecutive requests (the probe replays
    a run from a row it draws, wrapping around; its cache sees only that run's history: a run much
    shorter than a conversation's turns are apart reuses little), averaged over up to 64 evenly
    spaced starting rows."""
    n = len(prompt_lens)
    if not n:
        return 0.0
    if window is None or window >= n:
        total = sum(int(p) for p in prompt_lens)
        return sum(reused_tokens(blocks, prompt_lens, block_tokens)) / total if total else 0.0
    size = max(int(window), 1)
    shares = []
    for start in sorted({int(k * n / 64) for k in range(64)}):
        rows = [(start + i) % n for i in range(size)]
        lens = [prompt_lens[r] for r in rows]
        total = sum(int(p) for p in lens)
        if total:
            shares.append(sum(reused_tokens([blocks[r] for r in rows], lens, block_tokens)) / total)
    return sum(shares) / len(shares) if shares else 0.0
