"""The decode-side bridge: decide, ask the prefill host, ingest, register, continue.

The orchestration in the middle of the decode side's one-way chain: ``hooks`` (oMLX's objects)
call it; it hands each block the Rust writer wrote and validated to ``store``, which puts it into
oMLX's index. It never imports the hooks.

Runs inside oMLX, in its engine's ``add_request``: the point where the prompt is final and the
scheduler has not looked at the prefix cache yet. For a cold long prompt it asks vLLM to prefill
the token ids (``/v1/completions``, ``max_tokens: 1``, the capture named in
``kv_transfer_params``), pulls the segment stream, writes each block through the Rust writer and
registers it with oMLX's index as it lands, then lets oMLX continue: the scheduler finds the
prefix hit and prefills only the sub-block tail. Every failure leaves oMLX serving natively,
with whatever whole blocks did arrive, and a verdict that says what happened.

All slow work runs on the bridge's own threads, in two pools, so that oMLX's event loop keeps
serving other requests and no prompt's decision ever waits behind a bridge: the decision pool only
tokenizes and walks oMLX's prefix index; the I/O pool runs everything that may block on the
prefill host (fingerprint, health, the prefill request, the segment stream). At most
``PD_BRIDGE_MAX_BRIDGES`` bridges are in flight, each holding its slot until its last I/O thread
has returned (a request blocked on a stalled host included); a prompt past the cap is declined
at once and served natively.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import logging
import re
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from . import config as config_mod
from . import rates as rates_mod
from . import store, versions
from ._native import BlockRejected, BlockWriter, IngestControl, LandedBlock, PdBridgeError, Weights, capture_secret, carry_state, ingest
from .verdict import Verdict, native

logger = logging.getLogger("pd_bridge_omlx")

# After vLLM answers (or fails), how long the stream may take to deliver what remains.
_GRACE_AFTER_HTTP_FAILURE_S = 2.0
# After a complete seal, how long the verdict waits for vLLM's answer (what it took from its cache).
_WAIT_FOR_PREFILL_ANSWER_S = 0.25
# Threads that tokenize prompts and walk oMLX's prefix index (pure CPU, never the network).
_DECIDE_THREADS = 8

# Peer addresses in a reason: verdicts go to every client of oMLX's port (X-PD-Bridge, the
# status routes); the log keeps the full text.
_URL_ORIGIN = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s'\"]+")
_IPV4 = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?(?![\w.])")
_IPV6 = re.compile(r"\[[0-9a-fA-F:.%\w]*:[0-9a-fA-F:.%\w]*\](?::\d+)?")


def public_reason(text: str, hosts: tuple[str, ...] = ()) -> str:
    """``text`` without addresses: URL origins become ``<prefill host>``, socket addresses
    ``<address>``, and each of ``hosts`` (host names) ``<prefill host>``."""
    text = _URL_ORIGIN.sub("<prefill host>", text)
    for host in sorted({h for h in hosts if h}, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?::\d+)?(?![\w-])", "<prefill host>", text)
    return _IPV6.sub("<address>", _IPV4.sub("<address>", text))


def _brief(why: str, limit: int = 110) -> str:
    """One passed-over host's reason, short enough that a verdict header (300 characters of
    reason) names every host tried; the log has each in full."""
    return why if len(why) <= limit else why[: limit - 3] + "..."


class _Slot:
    """One admitted bridge: released when the bridge is done *and* every I/O job it started has
    returned (a prefill request stuck on a stalled host keeps holding its thread, so it keeps
    holding the slot). Given back exactly once, whatever order its parts end in
    (tests/decode/test_bridge_slots.py tries every order)."""

    def __init__(self, slots: "_Slots") -> None:
        self._slots = slots
        self._lock = threading.Lock()
        self._parts = 1  # the bridge itself, until done()
        self._bridge_done = False
        self._given_back = False

    def hold(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            if self._given_back:
                # Work started after the slot went back would run unaccounted: refuse it.
                raise RuntimeError("a bridge started I/O after its slot was given back")
            self._parts += 1
        fut.add_done_callback(lambda _f: self._release())

    def done(self) -> None:
        with self._lock:
            if self._bridge_done:
                return
            self._bridge_done = True
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._parts -= 1
            last = self._parts == 0 and not self._given_back
            self._given_back |= last
        if last:
            self._slots._give_back()


class _Slots:
    """At most ``limit`` bridges in flight; taking a slot never waits. The count moves only under
    its lock, never past the limit and never below zero."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._held = 0

    def try_take(self) -> _Slot | None:
        with self._lock:
            if self._held >= self.limit:
                return None
            self._held += 1
        return _Slot(self)

    def _give_back(self) -> None:
        with self._lock:
            if self._held == 0:
                logger.error("pd-bridge: a bridge slot was given back twice (a bug); the count stays at zero")
                return
            self._held -= 1

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._held


_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")


class PrefillUnavailable(RuntimeError):
    pass


def _refused(answer: dict) -> str | None:
    """Why the prefill host made no capture for this request, if its answer says so."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    got = params.get("pd_capture") if isinstance(params, dict) else None
    why = got.get("refused") if isinstance(got, dict) else None
    return str(why)[:300] if why is not None else None


# Connections to the prefill host, per bridge: a few long prefill requests at once plus the
# health/model probes; idle ones are kept for the next bridge.
_POOL_LIMITS = httpx.Limits(max_connections=32, max_keepalive_connections=8, keepalive_expiry=30.0)
# The health check and model list, each: past this (and the connect timeout) the prompt is served
# natively whatever the prefill host is doing.
_PROBE_S = 6.0
# How long a decision waits for the prefill hosts' queues (vLLM's /metrics), and how long one
# read may take: a busy vLLM answers its metrics late, and a late answer still counts next time.
_QUEUE_WAIT_S = 1.0
_QUEUE_READ_S = 10.0
# vLLM's answers here are a few hundred bytes (a one-token completion, its model list).
_MAX_ANSWER_BYTES = 1 << 20
_TIMEOUT_PHASE = {httpx.ConnectTimeout: "connecting", httpx.ReadTimeout: "waiting for the answer",
                  httpx.WriteTimeout: "sending the request", httpx.PoolTimeout: "waiting for a free connection"}  # fmt: skip


class PrefillHost:
    """vLLM's OpenAI server on the prefill host, through one pooled ``httpx.Client``.

    The client is created once (per bridge, per doctor run) and shared by the bridge's threads
    (``httpx.Client`` is thread-safe). Each request gets the configured connect timeout
    (``PD_BRIDGE_CONNECT_TIMEOUT_S``) and its own read timeout. Every failure is a
    ``PrefillUnavailable`` whose text says which: ``<url> is unreachable: <why>`` (refused, reset,
    closed, DNS, and timeouts as ``timed out ...``), ``<url> answered HTTP <code>: <body>``, or
    ``<url> answered something that is not JSON``."""

    def __init__(self, cfg: config_mod.BridgeConfig, target: config_mod.PrefillTarget | None = None):
        self.cfg = cfg
        #: Which prefill host (default the first configured).
        self.target = target if target is not None else cfg.prefill_hosts[0]
        self.url = self.target.url
        self._model = cfg.prefill_model
        self._client = httpx.Client(
            limits=_POOL_LIMITS,
            timeout=httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s),
            headers={
                "Content-Type": "application/json",
                "User-Agent": "pd-bridge-omlx",
                **({"Authorization": f"Bearer {cfg.prefill_api_key}"} if cfg.prefill_api_key else {}),
            },
            follow_redirects=True,
        )

    def close(self) -> None:
        self._client.close()

    def _request(self, path: str, body: dict | None, timeout: float, headers: dict[str, str] | None = None) -> dict:
        url = f"{self.url}{path}"
        raw = self._fetch(path, body, timeout, headers)
        if not raw.strip():
            return {}
        try:
            got = json.loads(raw)
        except ValueError:
            raise PrefillUnavailable(f"{url} answered something that is not JSON: {raw[:200]!r}") from None
        if not isinstance(got, dict):
            raise PrefillUnavailable(f"{url} answered JSON that is not an object: {raw[:200]!r}")
        return got

    def _fetch(self, path: str, body: dict | None, timeout: float, headers: dict[str, str] | None = None) -> bytes:
        url = f"{self.url}{path}"
        limits = httpx.Timeout(timeout, connect=min(self.cfg.connect_timeout_s, timeout))
        # httpx's timeouts bound each read, not the answer: a host that trickles a byte at a time
        # would hold the request (and its bridge slot) for ever. The whole answer has `timeout`.
        deadline = time.monotonic() + timeout
        try:
            if body is None:
                req = self._client.build_request("GET", url, timeout=limits)
            else:
                req = self._client.build_request("POST", url, content=json.dumps(body).encode(), timeout=limits, headers=headers)
            resp = self._client.send(req, stream=True)
            try:
                chunks, size = [], 0
                for chunk in resp.iter_bytes():
                    chunks.append(chunk)
                    size += len(chunk)
                    if time.monotonic() > deadline:
                        raise PrefillUnavailable(f"{url} is unreachable: timed out: the answer took longer than {timeout:g}s")
                    if size > _MAX_ANSWER_BYTES:
                        raise PrefillUnavailable(f"{url} answered more than {_MAX_ANSWER_BYTES} bytes")
            finally:
                resp.close()
            raw = b"".join(chunks)
        except httpx.TimeoutException as e:
            phase = next((f" {what}" for cls, what in _TIMEOUT_PHASE.items() if isinstance(e, cls)), "")
            secs = limits.connect if isinstance(e, httpx.ConnectTimeout) else timeout
            raise PrefillUnavailable(f"{url} is unreachable: timed out{phase} after {secs:g}s") from None
        except httpx.HTTPError as e:  # refused, reset, closed without an answer, DNS, bad URL
            raise PrefillUnavailable(f"{url} is unreachable: {str(e) or type(e).__name__}") from None
        if resp.status_code >= 400:
            raise PrefillUnavailable(f"{url} answered HTTP {resp.status_code}: {raw[:300].decode('utf-8', 'replace')}")
        return raw

    def check_health(self) -> None:
        self._request("/health", None, timeout=3.0)

    def queue(self, timeout: float = 3.0) -> int | None:
        """Requests running + waiting on the host (vLLM's ``/metrics``); None when it has none."""
        try:
            return rates_mod.parse_queue(self._fetch("/metrics", None, timeout=timeout).decode("utf-8", "replace"))
        except PrefillUnavailable:
            return None

    def model(self) -> str:
        if self._model is None:
            models = self._request("/v1/models", None, timeout=5.0).get("data") or []
            first = models[0] if isinstance(models, list) and models else None
            if not isinstance(first, dict) or not isinstance(first.get("id"), str):
                raise PrefillUnavailable(f"{self.url}/v1/models lists no model")
            self._model = first["id"]
        return self._model

    def version(self) -> str:
        return str(self._request("/version", None, timeout=5.0).get("version", "unknown"))

    def prefill(self, token_ids: list[int], capture: dict, timeout: float) -> dict:
        body = {
            "model": self.model(),
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": {"pd_capture": capture},
        }
        # vLLM's data parallelism: pin the request to the rank whose segment port is pulled.
        pin = {"X-data-parallel-rank": str(self.target.dp_rank)} if self.target.dp_rank is not None else None
        return self._request("/v1/completions", body, timeout=timeout, headers=pin)


class Bridge:
    def __init__(self, cfg: config_mod.BridgeConfig | None, config_error: str | None = None):
        self.cfg = cfg
        self.config_error = config_error
        self.hosts = [PrefillHost(cfg, t) for t in cfg.prefill_hosts] if cfg is not None else []
        self.host = self.hosts[0] if self.hosts else None
        # This decode host's bridges in flight per prefill host (picks the least busy).
        self._host_load = [0] * len(self.hosts)
        self._host_lock = threading.Lock()
        # Measured rates: native prefill per model, each host's bridges (rates.py).
        self.rates = rates_mod.Rates(len(self.hosts), max_age_s=cfg.rate_max_age_s if cfg is not None else 600.0)
        max_bridges = cfg.max_bridges if cfg is not None else 1
        self._decide_pool = concurrent.futures.ThreadPoolExecutor(max_workers=_DECIDE_THREADS, thread_name_prefix="pd-bridge-decide")
        # Each admitted bridge runs at most two I/O jobs at once (the prefill request and the
        # stream; fingerprint, health and model lookup come before them, one at a time), so
        # admitted bridges never queue here; one spare for the shared fingerprint load.
        self._io_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 * max_bridges + 1, thread_name_prefix="pd-bridge-io")
        self._slots = _Slots(max_bridges)
        self._queue_pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self.hosts)), thread_name_prefix="pd-bridge-queue")
        self._queue_pending: list[concurrent.futures.Future | None] = [None] * len(self.hosts)
        self._queue_lock = threading.Lock()
        self._fingerprints: dict[str, str | Exception] = {}
        self._weights: dict[str, Weights] = {}  # loaded with the fingerprint: carry states need them
        self._fingerprint_loads: dict[str, concurrent.futures.Future] = {}
        self._fingerprint_lock = threading.Lock()
        # The decoder model's identity (checkpoint.rs' model_fingerprint) and formats, per model
        # dir, read with the weights; and what the last capture said of the prefill host's model.
        self._models: dict[str, dict] = {}
        self._last_weights: dict = {}

    @property
    def version(self) -> versions.OmlxVersion:
        """The running oMLX's entry in the versions table: its block format, where it looks up."""
        return versions.detect()

    @classmethod
    def from_env(cls) -> "Bridge":
        try:
            return cls(config_mod.from_env())
        except config_mod.BridgeConfigError as e:
            logger.error("pd-bridge: bridge off: %s", e)
            return cls(None, str(e))

    def describe(self) -> str:
        if self.cfg is None:
            return f"off: {self.config_error}" if self.config_error else "off: PD_BRIDGE_PREFILL_URL is not set"
        c = self.cfg
        hosts = ", ".join(f"{t.url} (segments {t.segments_host}:{t.segments_port})" for t in c.prefill_hosts)
        return (f"prefill {hosts}, "
                f"min prompt {c.min_prompt_tokens}, min uncached {c.min_uncached_tokens}, timeout {c.timeout_s:g}s")  # fmt: skip

    def public_status(self) -> dict:
        """What a user of oMLX's port may see (``GET /pd-bridge/v1/status``): on or off, the
        thresholds, bridges in flight; never the token or the prefill host's addresses."""
        if self.cfg is None:
            why = f"bridge misconfigured: {self.config_error}" if self.config_error else "PD_BRIDGE_PREFILL_URL is not set"
            return {"bridge": f"off: {public_reason(why)}", "in_flight": 0, "max_bridges": 0}
        c = self.cfg
        return {
            "bridge": (f"on: min prompt {c.min_prompt_tokens}, min uncached {c.min_uncached_tokens}, "
                       f"timeout {c.timeout_s:g}s, at most {c.max_bridges} bridges at once"),  # fmt: skip
            "in_flight": self._slots.in_flight,
            "max_bridges": c.max_bridges,
            # Per prefill host, in the configured order (never their addresses).
            "prefill_hosts": [{"in_flight": n} for n in self._host_loads()],
            # What the decision reads (PD_BRIDGE_DECIDE=rates): measured rates and break-evens.
            "decide": c.decide,
            "rates": self.rates.snapshot(),
            # Which weights the bridge computes with on each side: the decoder model's identity
            # and formats, and what the last capture's prefill host said of its own.
            "model": {**next(iter(self._models.values()), {"fingerprint": None, "formats": None}), **self._last_weights},
        }

    def _host_loads(self) -> list[int]:
        with self._host_lock:
            return list(self._host_load)

    def _take_host(self, tried: set[int], predicted: tuple[float | None, ...] = ()) -> int | None:
        """The prefill host not yet tried with the lowest predicted time (one not measured yet
        first, to measure it), then the least busy (this decode host's bridges in flight), then
        the configured order; charged one bridge in the same critical section, so that bridges
        starting together spread over the hosts; None when every one was tried."""
        with self._host_lock:
            free = [i for i in range(len(self._host_load)) if i not in tried]
            if not free:
                return None

            def rank(k: int) -> float:
                p = predicted[k] if k < len(predicted) else None
                return -1.0 if p is None else p

            i = min(free, key=lambda k: (rank(k), self._host_load[k], k))
            self._host_load[i] += 1
            return i

    def _charge(self, i: int, delta: int) -> None:
        with self._host_lock:
            self._host_load[i] = max(0, self._host_load[i] + delta)

    def _public(self, text: str) -> str:
        c = self.cfg
        hosts = () if c is None else tuple(h for t in c.prefill_hosts for h in (urlsplit(t.url).hostname or "", t.segments_host))
        return public_reason(text, hosts)

    def _decide(self, fn, *args):
        """Decision work (tokenize, prefix walk): its own pool, never behind bridge I/O."""
        return asyncio.wrap_future(self._decide_pool.submit(fn, *args))

    def _io(self, slot: _Slot, fn, *args):
        """Work that may block on the prefill host, charged to the bridge's slot until it returns."""
        fut = self._io_pool.submit(fn, *args)
        slot.hold(fut)
        return asyncio.wrap_future(fut)

    def _fingerprint(self, weights_dir: str, slot: _Slot):
        """``fingerprint`` on the I/O pool, loaded once however many bridges ask at the same time."""
        with self._fingerprint_lock:
            fut = self._fingerprint_loads.get(weights_dir)
            if fut is None:
                fut = self._io_pool.submit(self.fingerprint, weights_dir)
                self._fingerprint_loads[weights_dir] = fut
        slot.hold(fut)
        return asyncio.wrap_future(fut)

    def fingerprint(self, weights_dir: str) -> str:
        # Cached, failures too: a running oMLX's weights do not change, and loading them again
        # for every long prompt would only repeat the same error slowly.
        got = self._fingerprints.get(weights_dir)
        if got is None:
            try:
                w = Weights.load(weights_dir)
                self._weights[weights_dir] = w
                got = w.fingerprint
                self._models[weights_dir] = self._model_identity(weights_dir, w)
            except Exception as e:
                got = e
            self._fingerprints[weights_dir] = got
        if isinstance(got, Exception):
            raise got
        return got

    @staticmethod
    def _model_identity(model_dir: str, w: Weights) -> dict:
        from ._native import model_fingerprint
        from .formats import format_summary

        try:
            fp = model_fingerprint(model_dir)
        except Exception as e:  # noqa: BLE001 - an unreadable identity leaves "same or different" unknown
            logger.warning("pd-bridge: the model fingerprint of %s cannot be read (%s)", model_dir, e)
            fp = None
        return {"fingerprint": fp, "formats": format_summary(w.formats)}

    def weights_relation(self, model_dir: str | None, prefill_model: object) -> str:
        """``same``: the prefill host serves the decoder's own weights (the same checkpoint, or
        one ``pd-bridge export-checkpoint`` wrote from it); ``different``: another checkpoint;
        ``unknown``: either side could not say."""
        mine = self._models.get(model_dir or "", {}).get("fingerprint")
        if not isinstance(prefill_model, str) or not mine:
            return "unknown"
        return "same" if prefill_model == mine else "different"

    @staticmethod
    def _cached_blocks(pcm, ssd, ids: list[int], nblocks: int, block_size: int) -> int:
        """Leading blocks oMLX already has, walked with oMLX's own chain hash."""
        from omlx.cache.paged_cache import compute_block_hash

        parent = None
        for i in range(nblocks):
            h = compute_block_hash(parent, ids[i * block_size : (i + 1) * block_size], extra_keys=None, model_name=pcm.model_name)
            if pcm.cached_block_hash_to_block.get_block(h) is None and not ssd.has_block(h):
                return i
            parent = h
        return nblocks

    async def prepare(self, engine_core, prompt, request_id: str, multimodal: bool) -> tuple[Verdict, int, list[int] | None]:
        """Decide and, when worth it, bridge. Returns the verdict, the bytes written and the
        prompt's token ids (None when it was not tokenized here); oMLX is then handed exactly
        those ids, so the blocks and its prefix lookup agree by construction. Never raises: any
        failure is a verdict, and oMLX then prefills natively. The verdict's reason names no
        peer address (``public_reason``); the log has the full text."""
        try:
            verdict, nbytes, ids = await self._prepare(engine_core, prompt, request_id, multimodal)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not fail the request: oMLX prefills natively
            logger.exception("pd-bridge[%s]: bridge error", request_id)
            # Only the class goes to the client (the text may name local paths); the log has it.
            verdict, nbytes, ids = native(f"bridge error: {type(e).__name__}", request_id), 0, None
        public = self._public(verdict.reason)
        if public != verdict.reason:
            logger.info("pd-bridge[%s]: %s: %s", request_id, verdict.kind, verdict.reason)
            verdict.reason = public
        verdict.failed_over = self._public(verdict.failed_over)
        return verdict, nbytes, ids

    async def _prepare(self, engine_core, prompt, request_id: str, multimodal: bool) -> tuple[Verdict, int, list[int] | None]:
        t0 = time.perf_counter()
        if self.cfg is None:
            return native(f"bridge misconfigured: {self.config_error}" if self.config_error else "PD_BRIDGE_PREFILL_URL is not set", request_id), 0, None
        if multimodal:
            return native("multimodal request (only text prompts are bridged)", request_id), 0, None
        scheduler = engine_core.scheduler
        pcm = getattr(scheduler, "paged_cache_manager", None)
        ssd = getattr(scheduler, "paged_ssd_cache_manager", None)
        if pcm is None or ssd is None:
            return native("oMLX runs without an SSD prefix cache (start it with --paged-ssd-cache-dir)", request_id), 0, None
        try:
            ids = await self._decide(lambda: list(scheduler.tokenizer.encode(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt])
        except Exception as e:  # the scheduler will report its own error for this prompt
            return native(f"prompt could not be tokenized: {e}", request_id), 0, None
        n, cfg = len(ids), self.cfg
        if n < cfg.min_prompt_tokens:
            return native(f"prompt of {n} tokens is under PD_BRIDGE_MIN_PROMPT_TOKENS={cfg.min_prompt_tokens}", request_id), 0, ids
        block_size = int(getattr(pcm, "block_size", 0) or scheduler.config.paged_cache_block_size)
        # Leave at least one token uncached: oMLX needs a token to feed for the first logit.
        nblocks = (n - 1) // block_size
        cached = await self._decide(self._cached_blocks, pcm, ssd, ids, nblocks, block_size)
        uncached = (nblocks - cached) * block_size
        if uncached < cfg.min_uncached_tokens:
            what = f"prefix cached: {cached * block_size} of {n} tokens" if cached else f"{nblocks} full blocks of {block_size} tokens"
            return native(f"{what}; {uncached} bridgeable uncached tokens is under PD_BRIDGE_MIN_UNCACHED_TOKENS={cfg.min_uncached_tokens}", request_id), 0, ids

        # Past the floors: bridge where that is predicted faster (rates.py), else natively.
        predicted = None
        if cfg.decide == "rates":
            await self._read_queues()
            predicted = self.rates.predict(self.model_key(engine_core, scheduler), uncached, self._host_loads())
            why = predicted.native_reason()
            if why is not None:
                return native(why, request_id), 0, ids

        # From here a bridge is tried: failures are "declined" (or "partial").
        slot = self._slots.try_take()
        if slot is None:
            return Verdict("declined", f"{cfg.max_bridges} bridges already in flight (PD_BRIDGE_MAX_BRIDGES={cfg.max_bridges})", request_id=request_id), 0, ids
        try:
            return await self._admitted(engine_core, scheduler, pcm, ssd, ids, nblocks, block_size, request_id, slot, t0, cached, predicted)
        finally:
            slot.done()

    def _queue_reads(self) -> list[concurrent.futures.Future]:
        """A read of each prefill host's queue (vLLM's ``/metrics``) on a pool of its own (so a
        stalled host never holds the threads native prompts are tokenized on), each landing in
        the rates when it answers, however late: a host too busy to answer in time still moves
        the next decision. A host whose last read is still pending is not read again (its
        answer is the one awaited), so a stalled host never piles reads up."""

        def read(i: int, host: PrefillHost, at: float) -> None:
            self.rates.observe_queue(i, host.queue(timeout=_QUEUE_READ_S), read_at=at)

        with self._queue_lock:
            for i, h in enumerate(self.hosts):
                if self._queue_pending[i] is None or self._queue_pending[i].done():
                    self._queue_pending[i] = self._queue_pool.submit(read, i, h, self.rates.now())
            return [f for f in self._queue_pending if f is not None]

    async def _read_queues(self) -> None:
        """Each prefill host's queue, read now for this decision: it waits at most
        ``_QUEUE_WAIT_S``; a host that has not answered by then counts with its newest reading
        (and the bridge's own health probe then judges it)."""
        await asyncio.wait([asyncio.wrap_future(f) for f in self._queue_reads()], timeout=_QUEUE_WAIT_S)

    def refresh_queues(self) -> None:
        """The same reads for ``GET /pd-bridge/v1/status`` (a thread of the server's pool), so
        that it shows the queues a decision made now would read."""
        if self.cfg is not None and self.cfg.decide == "rates":
            concurrent.futures.wait(self._queue_reads(), timeout=_QUEUE_WAIT_S)

    def model_key(self, engine_core, scheduler) -> str:
        """The directory oMLX loaded the model from: the engine's model_name on every supported
        oMLX (upstream's scheduler holds the model id instead); the key of its rates too."""
        return self.cfg.weights_dir or str(getattr(getattr(engine_core, "config", None), "model_name", "") or scheduler.config.model_name)

    async def _admitted(self, engine_core, scheduler, pcm, ssd, ids, nblocks, block_size, request_id, slot, t0, cached: int = 0, predicted: rates_mod.Prediction | None = None) -> tuple[Verdict, int, list[int] | None]:
        cfg = self.cfg
        weights_dir = self.model_key(engine_core, scheduler)
        try:
            fingerprint = await self._fingerprint(weights_dir, slot)
        except Exception as e:
            return Verdict("declined", f"decoder weights in {weights_dir} cannot be fingerprinted: {e}", request_id=request_id), 0, ids
        probe = _PROBE_S + cfg.connect_timeout_s
        passed: list[str] = []  # why each host tried so far was passed over
        tried: set[int] = set()
        t_first = time.perf_counter()
        while (i := self._take_host(tried, predicted.bridged_s if predicted is not None else ())) is not None:
            tried.add(i)
            host = self.hosts[i]
            name = host.target.label
            last = len(tried) == len(self.hosts) or time.perf_counter() - t_first > cfg.timeout_s
            t_host = time.perf_counter()
            try:
                try:
                    await asyncio.wait_for(self._io(slot, host.check_health), probe)
                    await asyncio.wait_for(self._io(slot, host.model), probe)
                    if cfg.decide == "rates":
                        # The host's queue, for the next decision (this one is made).
                        read_at = self.rates.now()
                        self.rates.observe_queue(i, await asyncio.wait_for(self._io(slot, host.queue), probe), read_at=read_at)
                except (PrefillUnavailable, asyncio.TimeoutError) as e:
                    why = f"{name} unhealthy: " + (str(e) if isinstance(e, PrefillUnavailable) else f"its health check and model list did not answer within {probe:g}s")
                    if last:
                        return Verdict("declined", "; ".join([*map(_brief, passed), why]), request_id=request_id), 0, ids
                    logger.warning("pd-bridge[%s]: %s; trying the next prefill host", request_id, why)
                    passed.append(self._public(why))  # scrubbed before it is cut short
                    continue
                t_decided = time.perf_counter()
                verdict, nbytes, host_failed = await self._bridge(host, scheduler, pcm, ssd, ids[: nblocks * block_size], nblocks, block_size, fingerprint, request_id, slot, model_dir=weights_dir, held=cached)
            finally:
                self._charge(i, -1)
            verdict.phases["decide"] = t_decided - t0
            if verdict.kind == "complete":
                self.rates.observe_bridge(i, verdict.tokens - verdict.resumed_at, verdict.phases.get("total", 0.0), t_decided - t_host, nbytes)
            if host_failed and not last:
                # Nothing of this host's arrived: the next host starts clean.
                why = f"{name}: {verdict.reason}"
                logger.warning("pd-bridge[%s]: %s; trying the next prefill host", request_id, why)
                passed.append(self._public(why))  # scrubbed before it is cut short
                continue
            if passed:
                if verdict.kind == "declined":
                    verdict.reason = "; ".join([*map(_brief, passed), f"{name}: {verdict.reason}"])
                else:
                    verdict.failed_over = "; ".join(map(_brief, passed))
            return verdict, nbytes, ids
        raise AssertionError("unreachable: the last host tried returns")

    def _carry(self, writer: BlockWriter, cache_dir: Path, model_dir: str | None, held: int, block_size: int) -> tuple[bytes, int]:
        """The decoder's carry state (the source of truth for the resumed capture) at the end of
        the last of its ``held`` leading blocks that has a file, and how many blocks that is; read
        from that block's file. Raises naming what does not fit."""
        weights = self._weights.get(model_dir or "")
        if weights is None:
            raise PdBridgeError(f"decoder weights in {model_dir} are not loaded")
        for k in range(held, 0, -1):
            path = store.block_path(cache_dir, writer.hash_hex(k - 1))
            # oMLX may hold its latest blocks in memory only (not yet on its SSD cache): resume
            # at the last one that is on disk.
            if path.exists():
                return carry_state(weights, str(path), block_size, k * block_size, self.version.omlx_format), k
        raise PdBridgeError(f"none of the {held} held blocks has a file in the SSD cache")

    async def _bridge(self, host: PrefillHost, scheduler, pcm, ssd, ids, nblocks, block_size, fingerprint, request_id, slot: _Slot, model_dir: str | None = None, held: int = 0) -> tuple[Verdict, int, bool]:
        """One bridge through ``host``. Returns the verdict, the bytes registered, and whether
        the host failed before any block arrived (another host may then be tried)."""
        cfg = self.cfg
        target = host.target
        capture_id = f"pdb-{request_id}-{uuid.uuid4().hex[:8]}"
        cache_dir = Path(ssd._cache_dir)
        model_name = pcm.model_name
        # model_dir: every segment is checked against the decoder's plan before it is written.
        writer = BlockWriter(str(cache_dir), model_name, block_size, ids, self.version.omlx_format, model_dir=model_dir)
        # Multi-turn: oMLX already holds the first `held` blocks; the capture resumes at the end of
        # the last one, from the carry state read from its file, and only the tail is streamed.
        # A carry state that cannot be taken (a missing or refused block) means a bridge from 0.
        first, carry, not_resumed = 0, None, ""
        if held > 0:
            try:
                carry, at = await self._decide(self._carry, writer, cache_dir, model_dir, held, block_size)
                first = writer.resume(carry)
                if first != at:
                    raise PdBridgeError(f"writer resumed at block {first}, the carry state is at block {at}")
            except Exception as e:
                # Verdicts go to every client: the cache directory's path stays in the log.
                not_resumed = f"carry state at token {held * block_size} not taken: " + str(e).replace(str(cache_dir), "<cache>")
                logger.warning("pd-bridge[%s]: %s; bridging from token 0", request_id, not_resumed)
                carry, first = None, 0
                writer = BlockWriter(str(cache_dir), model_name, block_size, ids, self.version.omlx_format, model_dir=model_dir)
        resumed_at = first * block_size
        control = IngestControl()
        registered: list[int] = []
        problems: list[str] = []
        nbytes = 0

        def on_block(block: LandedBlock) -> None:
            # The writer hands over each block once, on disk under its final name and validated
            # by the core (its path, hash and the validator's verdict): registered from that.
            nonlocal nbytes
            if control.cancelled or problems:
                return
            index = block.index
            if index != first + len(registered):
                # Only an unbroken chain from the first block streamed is useful: stop the rest.
                problems.append(f"block {index} arrived where block {first + len(registered)} was due")
                control.cancel()
                return
            try:
                size = store.register_landed(ssd, block)
            except (BlockRejected, OSError) as e:
                # oMLX would not serve this block (nor so the ones after it): stop the stream, and
                # take the file off the disk, where oMLX's index would never count or evict it.
                problems.append(f"block {index} not registered: {e}")
                logger.warning("pd-bridge[%s]: %s; stopping the stream", request_id, problems[-1])
                control.cancel()
                store.drop_unindexed(ssd, block)
                return
            nbytes += size or 0
            registered.append(index)

        # Only this decode host can pull the capture: the wire's key needs this secret (and the
        # token, and these exact ids), which travels to vLLM only inside this request.
        secret = capture_secret()

        def pull():
            return ingest(target.segments_host, target.segments_port, cfg.token, capture_id, fingerprint, writer,
                          timeout_seconds=cfg.idle_s, on_block=on_block, control=control, secret=secret, token_ids=ids, lanes=cfg.wire_lanes if target.stages == 1 else 1, stages=target.stages)  # fmt: skip

        spec = {"request_id": capture_id, "block_size": block_size, "fingerprint": fingerprint, "omlx_format": self.version.omlx_format, "secret": secret}
        if carry is not None:
            spec["resume"] = {"position": resumed_at, "carry": base64.b64encode(carry).decode("ascii")}
        if target.dp_rank is not None:
            spec["dp_rank"] = target.dp_rank
        if target.stages > 1:
            spec["stages"] = target.stages
        logger.info("pd-bridge[%s]: asking %s to prefill %d tokens (%d blocks, capture %s%s)", request_id, host.url, len(ids), nblocks, capture_id,
                    f", resumed at {resumed_at} ({len(carry)}-byte carry state)" if carry is not None else "")  # fmt: skip
        t_ask = time.perf_counter()
        stream = self._io(slot, pull)
        http = self._io(slot, host.prefill, ids, spec, cfg.timeout_s)
        t_http = None
        http_error = None
        deadline = t_ask + cfg.timeout_s
        try:
            done, _ = await asyncio.wait({stream, http}, timeout=cfg.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if http in done:
                t_http = time.perf_counter()
                if http.exception() is not None:
                    http_error = str(http.exception())
                elif (refused := _refused(http.result())) is not None:
                    # The engine that ran the request made no capture (another data-parallel
                    # rank than the one pulled): nothing will come; stop waiting for it.
                    http_error = f"the prefill host made no capture: {refused}"
                    control.cancel()
                if stream not in done:
                    grace = _GRACE_AFTER_HTTP_FAILURE_S if http_error else max(0.1, min(cfg.idle_s, deadline - time.perf_counter()))
                    await asyncio.wait({stream}, timeout=grace)
        except asyncio.CancelledError:  # the client went away: stop writing for it
            control.cancel()
            logger.info("pd-bridge[%s]: cancelled by the client after %d blocks", request_id, len(registered))
            raise
        if not stream.done():
            control.cancel()
        seal, stream_error = None, None
        try:
            _, seal_json = await stream
            seal = json.loads(seal_json)
            if not isinstance(seal, dict):
                raise PdBridgeError(f"the seal is not an object: {seal_json[:200]}")
        except Exception as e:  # a refused stream, or the disk (OSError): what was registered stays
            stream_error = str(e.args[0]) if e.args else str(e)
        t_seal = time.perf_counter()
        if stream_error is not None and not registered and not http.done():
            # The stream failed before any block (the segment server unreachable, a refusal):
            # a prefill request that fails too within the grace frees the host for a failover.
            await asyncio.wait({http}, timeout=_GRACE_AFTER_HTTP_FAILURE_S)
        if http.done() and t_http is None:
            t_http = t_seal
            if http.exception() is not None:
                http_error = str(http.exception())
        # Everything registered is on disk and in oMLX's index; oMLX continues from here.
        t_ready, ready_unix = time.perf_counter(), time.time()
        after_from = min(t_seal, t_http) if t_http is not None else t_seal
        phases = {"prefill": after_from - t_ask, "after_prefill": max(0.0, t_ready - after_from), "total": t_ready - t_ask}
        blocks = len(registered)
        new_blocks = nblocks - first
        vllm_cached = None
        weights = "unknown"
        if not http.done() and seal is not None and seal.get("verdict") == "complete":
            # vLLM answers right after the step that sealed the capture; its answer says how much
            # of the prompt it took from its own cache. Waited for briefly, never for long.
            await asyncio.wait({http}, timeout=_WAIT_FOR_PREFILL_ANSWER_S)
        if http.done() and not http.cancelled() and http.exception() is None:
            # What vLLM took from its own prefix cache (the connector reports it at the finish).
            params = http.result().get("kv_transfer_params")
            got = params.get("pd_capture") if isinstance(params, dict) else None
            if isinstance(got, dict) and isinstance(got.get("prompt_cached_tokens"), int):
                vllm_cached = got["prompt_cached_tokens"]
            if isinstance(got, dict):
                # The prefill host's word, kept only in the form a fingerprint has (a hostile
                # host's string is neither compared nor shown).
                prefill_model = got.get("model_fingerprint")
                if not (isinstance(prefill_model, str) and _FINGERPRINT.fullmatch(prefill_model)):
                    prefill_model = None
                weights = self.weights_relation(model_dir, prefill_model)
                self._last_weights = {"weights": weights, "prefill_fingerprint": prefill_model}
        extra = {"resumed_at": resumed_at, "not_resumed": not_resumed, "vllm_cached": vllm_cached, "weights": weights}
        if seal is not None and seal.get("verdict") == "complete" and blocks == new_blocks and not problems:
            v = Verdict("complete", blocks=blocks, of_blocks=new_blocks, tokens=(first + blocks) * block_size, request_id=request_id, phases=phases, **extra)
        else:
            if seal is not None and seal.get("verdict") != "complete":
                why = f"prefill host sealed {seal.get('verdict')}: {seal.get('reason', '')}"
            elif problems:
                why = problems[0]
            elif stream_error:
                why = f"segment stream: {stream_error}"
            elif seal is not None:
                why = f"prefill host sealed complete but only {blocks} of {new_blocks} blocks arrived"
            else:
                why = "no seal"
            if http_error and (stream_error or seal is None or seal.get("verdict") != "complete"):
                why = f"{why}; prefill request: {http_error}"
            kind = "partial" if blocks else "declined"
            # Verdicts go to every client: the cache directory's path stays in the log.
            v = Verdict(kind, why.replace(str(cache_dir), "<cache>"), blocks=blocks, of_blocks=new_blocks, tokens=(first + blocks) * block_size if blocks else 0, request_id=request_id, phases=phases, **extra)
        v.ready_unix = ready_unix
        logger.info("pd-bridge[%s]: %s (prefill %.3fs, after prefill %.3fs, %d bytes)", request_id, v.header(), phases["prefill"], phases["after_prefill"], nbytes)
        # The host's fault, and nothing of it was registered: no local problem (a client that
        # went away raised above), and both of its jobs have returned (a prefill request still
        # running there keeps its I/O thread: the next host is not tried beside it).
        host_failed = v.kind == "declined" and not blocks and not problems and http.done() and stream.done() and (http_error is not None or stream_error is not None or (seal is not None and seal.get("verdict") != "complete"))
        return v, nbytes, host_failed

    @staticmethod
    def confirm(engine_core, request_id: str, verdict: Verdict) -> Verdict:
        """After oMLX looked the prompt up (inside ``add_request`` on the fork): the verdict may
        only claim what oMLX actually reused."""
        if verdict.kind not in ("complete", "partial"):
            return verdict
        req = getattr(engine_core.scheduler, "requests", {}).get(request_id)
        if req is None:
            return verdict
        return Bridge.confirmed(verdict, int(getattr(req, "cached_tokens", 0) or 0))

    @staticmethod
    def confirmed(verdict: Verdict, cached: int) -> Verdict:
        """``verdict`` corrected to the ``cached`` prompt tokens oMLX took from its prefix cache."""
        if verdict.kind not in ("complete", "partial"):
            return verdict
        if cached >= verdict.tokens:
            return verdict
        # A resumed bridge's tokens include the prefix held before it (resumed_at).
        per_block = (verdict.tokens - verdict.resumed_at) // max(verdict.blocks, 1)
        used = max(0, cached - verdict.resumed_at) // per_block if per_block else 0
        reason = f"oMLX reused {cached} of the {verdict.tokens} bridged tokens"
        if used == 0:
            return Verdict("declined", reason, of_blocks=verdict.of_blocks, request_id=verdict.request_id, phases=verdict.phases)
        return Verdict("partial", f"{reason}; {verdict.reason}".rstrip("; "), blocks=used, of_blocks=verdict.of_blocks,
                       tokens=verdict.resumed_at + used * per_block, request_id=verdict.request_id, phases=verdict.phases, ready_unix=verdict.ready_unix,
                       resumed_at=verdict.resumed_at, not_resumed=verdict.not_resumed, vllm_cached=verdict.vllm_cached, failed_over=verdict.failed_over, weights=verdict.weights)  # fmt: skip


_bridge: Bridge | None = None
_bridge_lock = threading.Lock()


def get_bridge() -> Bridge:
    global _bridge
    with _bridge_lock:
        if _bridge is None:
            _bridge = Bridge.from_env()
        return _bridge

