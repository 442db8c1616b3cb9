"""``X-PD-Bridge`` on every generation response, streaming or not.

oMLX sends a keepalive byte as soon as a generation request arrives, before the engine has even
seen the prompt, so the response headers would leave before any verdict exists. This ASGI
middleware holds the response start until the engine hook has decided the request's verdict
(or the response ends without reaching the engine), then adds the header and lets everything
through unchanged. The hook and the middleware share one ``VerdictSlot`` through a context
variable: oMLX's handler tasks inherit it from the middleware's context.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from .counters import COUNTERS
from .verdict import HEADER, VerdictSlot, current_slot, native

logger = logging.getLogger("pd_bridge_omlx")

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
        if method != "POST" or path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)

        slot = VerdictSlot()
        since = time.monotonic()
        held: list[dict] = []
        released = False

        async def send_with_verdict(message):
            nonlocal released
            if released:
                return await send(message)
            if message["type"] == "http.response.start":
                held.append(message)
                return
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    await _wait_for_verdict(slot, since)
                verdict = slot.verdict
                if verdict is None:
                    status = held[0].get("status", 0) if held else 0
                    verdict = native(f"the request did not reach a text engine (HTTP {status})")
                    COUNTERS.record(verdict)
                start = dict(held[0]) if held else {"type": "http.response.start", "status": 200, "headers": []}
                start["headers"] = [*start.get("headers", []), (HEADER.encode(), verdict.header().encode())]
                released = True
                await send(start)
                return await send(message)
            return await send(message)

        token = current_slot.set(slot)
        try:
            await self.app(scope, receive, send_with_verdict)
        finally:
            current_slot.reset(token)
            if not released and held:
                # The app ended without a body: still send what it started, with a verdict.
                verdict = slot.verdict or native("the response carried no body")
                start = dict(held[0])
                start["headers"] = [*start.get("headers", []), (HEADER.encode(), verdict.header().encode())]
                try:
                    await send(start)
                except Exception:  # the client is gone
                    pass

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
