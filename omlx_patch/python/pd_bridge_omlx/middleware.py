"""``X-PD-Bridge`` on every generation response, streaming or not.

oMLX sends a keepalive byte as soon as a generation request arrives, before the engine has even
seen the prompt, so the response headers would leave before any verdict exists. This ASGI
middleware holds what the handler sends (without blocking it) until the engine hook has decided
the request's verdict, or the response ends without reaching the engine, then sends it with the
header added, and everything after it unchanged. The hook and the middleware share one ``VerdictSlot`` through a context
variable: oMLX's handler tasks inherit it from the middleware's context. A non-streaming
``/v1/completions`` with a list of prompts waits for every prompt's verdict (oMLX streams only the
first prompt of a list).

A request whose JSON holds a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, not valid Unicode)
makes oMLX's own handler raise while tokenizing it (the fork and upstream alike answer HTTP 500
without the bridge). When oMLX raises on such a request before any response started, the
middleware answers HTTP 400 in oMLX's own error format instead, with a ``native`` verdict naming
why (and logs oMLX's exception); any answer oMLX does give (200 or 4xx) passes unchanged.

The bridge's own routes (everything under ``/pd-bridge/``) pass oMLX's own API-key check first,
``verify_api_key`` of the versions table's server module: with ``--api-key`` set, a request
without the key, or with a wrong one, gets exactly the answer oMLX gives on its own routes.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import time

from . import versions
from .counters import COUNTERS, METRICS_CONTENT_TYPE
from .verdict import HEADER, VerdictSlot, current_slot, native

logger = logging.getLogger("pd_bridge_omlx")

#: The counters in Prometheus' text format (served here, next to the JSON at /pd-bridge/v1/status).
METRICS_PATH = "/pd-bridge/v1/metrics"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"})
# A request whose handler never reaches the engine within this long (an engine without the
# hook, an early error) is released with a "native" verdict rather than held back.
_UNROUTED_GRACE_S = 3.0
#: Every route the bridge adds lives under this prefix (rescan, status, metrics).
ROUTE_PREFIX = "/pd-bridge/"


async def _api_key_refusal(scope, receive):
    """None when oMLX's own API-key check lets the request through, else the response oMLX would
    give for it (its ``HTTPException`` through the app's own exception handler)."""
    from fastapi import HTTPException
    from starlette.requests import Request

    server = importlib.import_module(versions.detect().server)
    verify, security = getattr(server, "verify_api_key", None), getattr(server, "security", None)
    request = Request(scope, receive)
    if verify is None or security is None:  # not the oMLX the table describes: refuse, never open
        from starlette.responses import JSONResponse

        return JSONResponse({"detail": "pd-bridge cannot find oMLX's API key check"}, status_code=500)
    try:
        await verify(request, await security(request))
    except HTTPException as exc:
        handlers = getattr(getattr(server, "app", None), "exception_handlers", {}) or {}
        handler = handlers.get(exc.status_code) or next((handlers[c] for c in type(exc).__mro__ if c in handlers), None)
        if handler is None:
            from fastapi.exception_handlers import http_exception_handler as handler
        response = handler(request, exc)
        return await response if inspect.isawaitable(response) else response
    return None


async def _omlx_http_error(scope, receive, status: int, detail: str):
    """The response oMLX itself gives for ``HTTPException(status, detail)`` on this route (its
    app's exception handler: the OpenAI error body on API routes, and its log line)."""
    from fastapi import HTTPException
    from starlette.requests import Request

    exc = HTTPException(status_code=status, detail=detail)
    request = Request(scope, receive)
    server = importlib.import_module(versions.detect().server)
    handlers = getattr(getattr(server, "app", None), "exception_handlers", {}) or {}
    handler = handlers.get(status) or next((handlers[c] for c in type(exc).__mro__ if c in handlers), None)
    if handler is None:
        from fastapi.exception_handlers import http_exception_handler as handler
    response = handler(request, exc)
    return await response if inspect.isawaitable(response) else response


def _has_lone_surrogate(body: bytes) -> bool:
    """Whether a JSON body holds a string (or key) with a lone UTF-16 surrogate: JSON's ``\\ud800``
    escapes (or their CESU bytes, which ``json.loads`` lets through) that pair with nothing, so
    the text is not valid Unicode and cannot be encoded to UTF-8 for the tokenizer."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return False
    try:
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except (TypeError, ValueError, RecursionError):
        return False
    return False


#: The 400's message and the verdict's reason (no backslash or comma: the verdict header quotes neither).
LONE_SURROGATE = "the request holds a lone UTF-16 surrogate in a string: not valid Unicode; it cannot be tokenized"


async def _read_body(receive):
    """The whole request body, and a ``receive`` that replays it to the app (then the real one)."""
    messages, body = [], b""
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break

    async def replay():
        return messages.pop(0) if messages else await receive()

    return body, replay


def _prompts_served(body: bytes) -> int:
    """How many prompts of a ``/v1/completions`` body reach the engine: each of a list when not
    streaming; one otherwise (oMLX streams only a list's first prompt)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return 1
    if not isinstance(doc, dict) or doc.get("stream"):
        return 1
    prompt = doc.get("prompt")
    return len(prompt) if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt) else 1


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
        if isinstance(path, str) and path.startswith(ROUTE_PREFIX):
            refusal = await _api_key_refusal(scope, receive)
            if refusal is not None:
                return await refusal(scope, receive, send)
        if method == "GET" and path == "/api/status":
            return await self._status(scope, receive, send)
        if method == "GET" and path == METRICS_PATH:
            return await self._metrics(send)
        if method != "POST" or path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)

        body, receive = await _read_body(receive)
        expected = _prompts_served(body) if path == "/v1/completions" else 1
        slot = VerdictSlot(expected)
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
            status = held[0].get("status", 0) if held else 0
            if not slot.verdicts:
                verdict = native(f"the request did not reach a text engine (HTTP {status})")
                COUNTERS.record(verdict)
                slot.verdicts.append(verdict)
            while len(slot.verdicts) < slot.expected:  # the response ended before every prompt ran
                verdict = native(f"the prompt did not reach the engine (HTTP {status})")
                COUNTERS.record(verdict)
                slot.verdicts.append(verdict)
            first = held.pop(0) if held and held[0]["type"] == "http.response.start" else {"type": "http.response.start", "status": 200, "headers": []}
            first = dict(first)
            first["headers"] = [*first.get("headers", []), (HEADER.encode(), slot.header().encode())]
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
        except Exception as exc:
            # oMLX raised before any response (its own answer would be a bare 500): for a body
            # that is not valid Unicode, a client error that says so. Anything else propagates.
            async with lock:
                answer = not released and not held and _has_lone_surrogate(body)
            if not answer:
                raise
            logger.warning("pd-bridge: %s %s: oMLX failed on a request holding a lone UTF-16 surrogate (%s: %s); answering HTTP 400",
                           method, path, type(exc).__name__, exc, exc_info=exc)  # fmt: skip
            if not slot.verdicts:
                verdict = native(f"{LONE_SURROGATE} (HTTP 400)")
                COUNTERS.record(verdict)
                slot.verdicts.append(verdict)
            response = await _omlx_http_error(scope, receive, 400, LONE_SURROGATE)
            await response(scope, receive, send_with_verdict)
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
