"""The load client: streaming requests to the engines' OpenAI-compatible ``/v1/completions``.

An own asyncio client rather than vLLM's ``benchmarks/serve.py`` or GuideLLM: both are
command-line programs built around their own datasets, reports and process model, they are not
installed where the probe runs (a vLLM-Ascend or MindIE node has neither), and neither spreads
requests over several engine replicas. What is measured is what they measure: the same
``/v1/completions`` request with ``stream: true`` and the timing of vLLM's ``benchmarks/serve.py``
(TTFT to the first streamed chunk, one inter-token gap per later chunk, E2E to the last).

Each request asks for exactly ``output_len`` tokens: ``max_tokens`` and ``min_tokens`` both set
and ``ignore_eos`` on, so a random-weight model that happens to emit EOS still produces the
length the traffic asked for. Prompts go as token-id lists when the engine takes them (no
tokenizer anywhere: ``--skip-tokenizer-init``), else as text.

Replicas sit behind a least-outstanding-requests balancer (what a production router in front of
several instances does; round-robin would pile requests onto a replica that fell behind), and
the open loop sends each request at its planned time whatever is in flight.

A disaggregated deployment (issue 46) has a prefill pool in front of its decode servers: the client
then does what vLLM's proxy (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``) does
for each request: the prompt to a prefill server with ``max_tokens`` 1 and ``kv_transfer_params``
asking for a remote decode, then the streamed request to a decode server with the
``kv_transfer_params`` the prefill answered (where to fetch the KV cache; a connector that finds it
by the prompt, the shared-storage one, answers none). The request's clock starts before the
prefill, so TTFT holds the prefill, the KV transfer and the first decode step, as a client of the
proxy sees them (less the proxy's own local HTTP hop).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import aiohttp

from .traffic import Planned

__all__ = ["Endpoint", "LeastOutstanding", "send_request", "open_loop", "closed_batch", "new_session"]


@dataclass
class Endpoint:
    """One replica's completions URL."""

    index: int
    url: str  # http://127.0.0.1:PORT/v1/completions


class LeastOutstanding:
    """Picks the replica with the fewest requests in flight (the lowest index on a tie); with
    ``prefill``, a disaggregated deployment's prefill servers, which a request visits first."""

    def __init__(self, endpoints: Sequence[Endpoint], prefill: "LeastOutstanding | None" = None) -> None:
        if not endpoints:
            raise ValueError("no replica to send requests to")
        self.endpoints = list(endpoints)
        self.outstanding = {e.index: 0 for e in self.endpoints}
        self.prefill = prefill

    def acquire(self) -> Endpoint:
        endpoint = min(self.endpoints, key=lambda e: (self.outstanding[e.index], e.index))
        self.outstanding[endpoint.index] += 1
        return endpoint

    def release(self, endpoint: Endpoint) -> None:
        self.outstanding[endpoint.index] -= 1


KEEPALIVE_S = 2.0  # below the engines' own keep-alive timeouts (uvicorn's default 5 s)


def new_session() -> aiohttp.ClientSession:
    """A session without a connection limit (aiohttp's default of 100 would queue requests in
    the client, closing the open loop) and without a total timeout (requests have deadlines).
    An idle connection is dropped by the client after :data:`KEEPALIVE_S`, before the engine's
    HTTP server closes it (uvicorn, vLLM's ``--timeout-keep-alive``: 5 s): a request sent on a
    connection the server is closing fails as "Server disconnected", which under overload (many
    connections, idle in bursts) was a crash of the trial, not a measurement (seen on vLLM 0.32,
    20 of 129 requests at 16 req/s)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
    )


def _body(planned: Planned, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": planned.prompt,
        "max_tokens": planned.output_len,
        "min_tokens": planned.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_request(
    session: aiohttp.ClientSession,
    balancer: LeastOutstanding,
    planned: Planned,
    model: str,
    t0: float,
    deadline: float | None,
) -> dict[str, Any]:
    """Send one request, read its stream, return its record. Times are ``time.perf_counter``
    seconds; ``t0`` is the phase's start, ``deadline`` when an unanswered request is given up."""
    endpoint = balancer.acquire()
    record: dict[str, Any] = {
        "id": planned.id,
        "replica": endpoint.index,
        "scheduled_s": round(planned.at_s, 6),
        "sent_s": None,
        "prompt_tokens": planned.prompt_len,
        "output_tokens": 0,
        "asked_tokens": planned.output_len,
        "ttft_ms": None,
        "itl_ms": [],
        "e2e_ms": None,
        "ok": False,
        "error": None,
        "error_kind": None,
    }
    start = time.perf_counter()
    record["sent_s"] = round(start - t0, 6)
    stream = _Stream(start)
    try:
        limit = None if deadline is None else max(deadline - start, 0.001)
        await asyncio.wait_for(_visit(session, balancer, endpoint, planned, model, record, stream), limit)
    except asyncio.TimeoutError:
        record.update(error=f"no complete answer within {limit:.1f} s of sending", error_kind="timeout")
        return _finish(record, start, time.perf_counter())
    except (aiohttp.ClientError, OSError) as exc:
        record.update(error=f"{type(exc).__name__}: {exc}"[:500], error_kind="connection")
        return _finish(record, start, time.perf_counter())
    finally:
        balancer.release(endpoint)
    if record["error"] is not None:
        return _finish(record, start, stream.failed_at or time.perf_counter())
    record["output_tokens"] = int(stream.usage_tokens) if stream.usage_tokens is not None else stream.chunks
    record["ok"] = True
    return _finish(record, start, stream.last)


# what vLLM's proxy asks of a prefill server (toy_proxy_server.py, vLLM commit 030ea52e): compute the
# prompt's KV cache for a decode server elsewhere
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def _visit(
    session: aiohttp.ClientSession,
    balancer: LeastOutstanding,
    endpoint: Endpoint,
    planned: Planned,
    model: str,
    record: dict[str, Any],
    stream: "_Stream",
) -> None:
    """The request's path: its prefill server first where the deployment has a prefill pool, then
    ``endpoint``'s stream."""
    body = _body(planned, model)
    if balancer.prefill is not None:
        params = await _prefill(session, balancer.prefill, planned, model, record)
        if record["error"] is not None:
            return
        if params is not None:
            body["kv_transfer_params"] = params
    await _exchange(session, endpoint.url, body, record, stream)


async def _prefill(
    session: aiohttp.ClientSession, pool: LeastOutstanding, planned: Planned, model: str, record: dict[str, Any]
) -> Any:
    """The prompt to the least busy prefill server, one token asked (not streamed); the
    ``kv_transfer_params`` its answer carries for the decode server (None where it has none)."""
    endpoint = pool.acquire()
    record["prefill_replica"] = endpoint.index
    body = {**_body(planned, model), "max_tokens": 1, "min_tokens": 1, "stream": False}
    body.pop("stream_options")
    body["kv_transfer_params"] = dict(REMOTE_DECODE)
    start = time.perf_counter()
    try:
        async with session.post(endpoint.url, json=body) as resp:
            text = await resp.text()
    finally:
        pool.release(endpoint)
    record["prefill_ms"] = round((time.perf_counter() - start) * 1000.0, 4)
    if resp.status >= 400:
        record.update(
            error=f"prefill server {endpoint.index}: HTTP {resp.status}: {_error_text(text)}",
            error_kind="http",
            http_status=resp.status,
        )
        return None
    try:
        answer = json.loads(text)
    except ValueError:
        record.update(error=f"prefill server {endpoint.index} answered no JSON: {text[:200]!r}", error_kind="http")
        return None
    return answer.get("kv_transfer_params") if isinstance(answer, dict) else None


class _Stream:
    """What has been read of one response stream so far."""

    def __init__(self, start: float) -> None:
        self.start = self.last = start
        self.chunks = 0
        self.usage_tokens: int | None = None
        self.failed_at: float | None = None


async def _exchange(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], record: dict[str, Any], stream: _Stream
) -> None:
    """POST ``body`` and read the server-sent events into ``record`` (an error sets
    ``record["error"]``); the timing of each content chunk is taken when its bytes arrive."""
    async with session.post(url, json=body) as resp:
        if resp.status >= 400:
            text = (await resp.text())[:2000]
            record.update(error=f"HTTP {resp.status}: {_error_text(text)}", error_kind="http", http_status=resp.status)
            return
        buffer = b""
        done = False
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                try:
                    event = json.loads(payload)
                except ValueError:
                    continue
                if not isinstance(event, dict):
                    continue
                if event.get("error"):
                    record.update(error=f"the engine answered an error: {_error_text(event)}", error_kind="http")
                    stream.failed_at = now
                    return
                if event.get("choices"):
                    if stream.chunks == 0:
                        record["ttft_ms"] = round((now - stream.start) * 1000.0, 4)
                    else:
                        record["itl_ms"].append(round((now - stream.last) * 1000.0, 4))
                    stream.chunks += 1
                    stream.last = now
                usage = event.get("usage")
                if isinstance(usage, dict):
                    if usage.get("completion_tokens") is not None:
                        stream.usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        record["prompt_tokens"] = int(usage["prompt_tokens"])
        if not done:
            record.update(
                error=f"the stream ended after {stream.chunks} chunk(s) without its closing [DONE]",
                error_kind="connection",
            )
            stream.failed_at = time.perf_counter()
        elif stream.chunks == 0:
            record.update(error="the stream ended without any token", error_kind="http")


def _finish(record: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    record["e2e_ms"] = round((end - start) * 1000.0, 4)
    return record


def _error_text(body: Any) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}``), else the text."""
    obj = body
    if isinstance(body, str):
        try:
            obj = json.loads(body)
        except ValueError:
            return body.strip()[:400]
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:400]
        if isinstance(err, str):
            return err[:400]
        if "message" in obj:
            return str(obj["message"])[:400]
    return str(body)[:400]


async def open_loop(
    plan: Sequence[Planned], send: Callable[[Planned, float], "asyncio.Future[dict[str, Any]]"], t0: float
) -> list[asyncio.Task]:
    """One task per planned request, each sleeping until ``t0 + at_s`` and then sending, however
    many are in flight: the arrivals never wait for completions."""

    async def fire(p: Planned) -> dict[str, Any]:
        delay = t0 + p.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return await send(p, t0)

    return [asyncio.create_task(fire(p), name=f"request-{p.id}") for p in plan]


async def closed_batch(
    plan: Sequence[Planned], send: Callable[[Planned, float], "asyncio.Future[dict[str, Any]]"]
) -> list[dict[str, Any]]:
    """All of ``plan`` at once (a closed-loop batch), waiting for every answer."""
    t0 = time.perf_counter()
    return list(await asyncio.gather(*(send(p, t0) for p in plan)))
