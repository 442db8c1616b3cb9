"""``X-PD-Bridge`` on every generation response, streaming or not.

oMLX sends a keepalive byte as soon as a generation request arrives, before the engine has even
seen the prompt, so the response headers would leave before any verdict exists. This ASGI
middleware holds what the handler sends (without blocking it) until the engine hook has decided
the request's verdict, or the response ends without reaching the engine, then sends it with the
header added, and everything after it unchanged. The hook and the middleware share one ``VerdictSlot`` through a context
variable: oMLX's handler tasks inherit it from the middleware's context.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from .counters import COUNTERS, METRICS_CONTENT_TYPE
from .verdict import HEADER, VerdictSlot, current_slot, native

logger = logging.getLogger("pd_bridge_omlx")

#: The counters in Prometheus' text format (served here, next to the JSON at /pd-bridge/v1/status).
METRICS_PATH = "/pd-bridge/v1/metrics"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"})
# A request whose handler never reaches the engine within this long (an engine without the
# hook, an early error) is released with a "native" verdict rather than held back.
_UNROUTED_GRACE_S = 3.0


async def _wait_for_verdict(slot: VerdictSlot, since: float) -> None:
    while not slot.decided.is_set():
        if not slot.pending and time.monotonic() - since > _UNROUTED_GRACE_S:
            return
        try:
            await asyncio.wait_for(slot.decided.wait(), timeout=0.25)
        except asyncio.TimeoutError:
            pass


class VerdictMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        method, path = scope.get("method"), scope.get("path")
        if method == "GET" and path == "/api/status":
            return await self._status(scope, receive, send)
        if method == "GET" and path == METRICS_PATH:
            return await self._metrics(send)
        if method != "POST" or path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)

        slot = VerdictSlot()
        since = time.monotonic()
        held: list[dict] = []
        released = False
        lock = asyncio.Lock()

        async def release() -> None:
            # Caller holds the lock.
            nonlocal released
            if released:
                return
            released = True
            verdict = slot.verdict
            if verdict is None:
                status = held[0].get("status", 0) if held else 0
                verdict = native(f"the request did not reach a text engine (HTTP {status})")
                COUNTERS.record(verdict)
            first = held.pop(0) if held and held[0]["type"] == "http.response.start" else {"type": "http.response.start", "status": 200, "headers": []}
            first = dict(first)
            first["headers"] = [*first.get("headers", []), (HEADER.encode(), verdict.header().encode())]
            await send(first)
            while held:
                await send(held.pop(0))

        async def releaser() -> None:
            # Streaming handlers produce their first bytes before the engine sees the prompt and
            # then run the engine from the same generator, so the response must keep flowing
            # (into `held`) while the verdict is pending; it is released from here.
            await _wait_for_verdict(slot, since)
            async with lock:
                if held:
                    await release()

        async def send_with_verdict(message):
            async with lock:
                if released:
                    return await send(message)
                held.append(message)
                final = message["type"] == "http.response.body" and not message.get("more_body", False)
                if final or slot.decided.is_set():
                    await release()

        token = current_slot.set(slot)
        watcher = asyncio.ensure_future(releaser())
        try:
            await self.app(scope, receive, send_with_verdict)
        finally:
            current_slot.reset(token)
            watcher.cancel()
            async with lock:
                if not released and held:
                    try:
                        await release()
                    except Exception:  # the client is gone
                        pass

    async def _metrics(self, send):
        """``GET /pd-bridge/v1/metrics``: the counters for a Prometheus scrape."""
        try:
            status, ctype, body = 200, METRICS_CONTENT_TYPE, COUNTERS.prometheus_text()
        except RuntimeError as e:  # prometheus_client missing
            status, ctype, body = 503, "text/plain; charset=utf-8", f"{e}\n".encode()
        headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _status(self, scope, receive, send):
        """oMLX's own status JSON, with the bridge's counters under ``pd_bridge``."""
        start, chunks = None, []

        async def capture(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        body = b"".join(chunks)
        if start is not None and start.get("status") == 200:
            try:
                doc = json.loads(body)
                doc["pd_bridge"] = COUNTERS.snapshot()
                body = json.dumps(doc).encode()
            except (ValueError, TypeError):
                pass
        start = dict(start or {"type": "http.response.start", "status": 500, "headers": []})
        start["headers"] = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        start["headers"].append((b"content-length", str(len(body)).encode()))
        await send(start)
        await send({"type": "http.response.body", "body": body})
