"""The hooks into oMLX's objects: block validation at index time, the bridge, routes.

The top of the decode side's one-way chain: ``hooks`` (oMLX's objects) → ``bridge`` (the
orchestration) → ``store`` (oMLX's cache index). Nothing imports this module but ``_autoload``.

oMLX builds its prefix-cache index once, when a model loads, and trusts every file it finds.
These hooks (active only with ``PD_BRIDGE_OMLX=1``) make these changes through oMLX's own
objects, without touching its files:

- every block file is validated by the Rust core before oMLX may index it (never following a
  link, never opening a FIFO); a file that fails is logged with the reason and never served;
- when oMLX creates its SSD cache for a directory, temp files a crashed bridge writer left
  there are removed (only the writer's own hidden pattern, never one still being written);
- ``EngineCore.add_request`` first runs the bridge (``bridge.py``): a cold long prompt is
  prefilled on the vLLM host and its blocks registered before oMLX looks for a prefix hit;
- the engine's output collector tells when a natively prefilled request's first token is out:
  the decision's native rate (``rates.py``);
- every generation response carries ``X-PD-Bridge`` with the verdict (``middleware.py``);
- ``POST /pd-bridge/v1/rescan {"model": ID}`` indexes block files that appeared since the model
  loaded, validated against that model; ``GET /pd-bridge/v1/status`` shows the counters.

``patches/omlx-0.7.0-cache-rescan.patch`` proposes the same as a small public API upstream.

Which oMLX is installed, its block format and the hook points wrapped here come from one table,
``versions.py``; anything not in it is refused at start, naming what is supported.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from pathlib import Path

from . import store, versions
from ._native import BlockRejected
from .versions import UnsupportedOmlxError  # noqa: F401  (re-exported)

logger = logging.getLogger("pd_bridge_omlx")

_lock = threading.Lock()
_installed = {"cache": False, "server": False, "engine": False}


def check_version() -> str:
    """The installed oMLX's description; ``UnsupportedOmlxError`` unless it is in the table."""
    return versions.detect().describe()


def _hook(point: tuple[str, str, str]):
    module, cls, attr = point
    owner = getattr(importlib.import_module(module), cls)
    if not hasattr(owner, attr):
        raise UnsupportedOmlxError(f"{module}.{cls} has no {attr}: not the oMLX the versions table describes ({versions.detect().describe()})")
    return owner, attr


def install_cache_guard() -> None:
    """Validate every block before ``PagedSSDCacheManager`` indexes it."""
    with _lock:
        if _installed["cache"]:
            return
        entry = versions.detect()
        owner, attr = _hook(entry.block_reader)
        original = getattr(owner, attr)
        fmt = entry.omlx_format

        def guarded(self, file_path):
            try:
                store.check_before_read(file_path, fmt)
            except BlockRejected as e:
                logger.warning("pd-bridge: not serving block %s", e)
                return None
            return original(self, file_path)

        guarded.__wrapped__ = original
        setattr(owner, attr, guarded)
        _install_temp_sweep(owner)
        _installed["cache"] = True
        logger.info("pd-bridge: block validation active for oMLX %s", check_version())


def _install_temp_sweep(owner) -> None:
    """Sweep a cache directory's stale writer temp files when oMLX sets the directory up, just
    before its own start-up scan (both supported oMLX releases call ``_init_directories``)."""
    original = getattr(owner, "_init_directories", None)
    if original is None:
        logger.warning("pd-bridge: %s has no _init_directories; stale temp files are swept at the first rescan or bridge", owner.__name__)
        return

    def init_directories(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if getattr(self, "_cache_dir", None):
            store.sweep_temps(self._cache_dir)
        return out

    init_directories.__wrapped__ = original
    owner._init_directories = init_directories


class Admissions:
    """Bridged requests whose verdict waits for oMLX's prefix lookup (upstream runs it when the
    scheduler admits the request, after ``add_request`` returned). ``expect`` is called before
    the request enters oMLX, so an admission on the scheduler's thread cannot be missed;
    ``admitted`` (that thread) and ``give_up`` (a timer) each finish a request at most once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, object] = {}

    def expect(self, request_id: str, finish) -> None:
        with self._lock:
            self._waiting[request_id] = finish

    def _pop(self, request_id: str):
        with self._lock:
            return self._waiting.pop(request_id, None)

    def admitted(self, request_id: str, cached_tokens: int) -> None:
        finish = self._pop(request_id)
        if finish is not None:
            finish(cached_tokens)

    def withdraw(self, request_id: str) -> bool:
        """Forget a request that will never be admitted; False when its lookup already ran."""
        return self._pop(request_id) is not None

    def give_up(self, request_id: str) -> None:
        finish = self._pop(request_id)
        if finish is not None:
            finish(None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)


ADMISSIONS = Admissions()


class NativePrefills:
    """Times oMLX's own prefills, for the decision's native rate (``rates.py``): a request
    served natively is timed from its entry into oMLX to its first output with a token, over the
    prompt tokens oMLX did not take from its prefix cache. Bounded: entries of requests that
    never produce an output (aborted) go after ``MAX_AGE_S`` or past ``MAX_ENTRIES``."""

    MAX_ENTRIES = 1024
    MAX_AGE_S = 3600.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, list] = {}  # request id -> [model, prompt tokens, start, cached, observe]

    def start(self, request_id: str, model: str, tokens: int, observe) -> None:
        now = time.perf_counter()
        with self._lock:
            for rid in [r for r, e in self._open.items() if now - e[2] > self.MAX_AGE_S][: self.MAX_ENTRIES]:
                del self._open[rid]
            while len(self._open) >= self.MAX_ENTRIES:
                del self._open[next(iter(self._open))]
            self._open[request_id] = [model, tokens, now, 0, observe]

    def cached(self, request_id: str, cached_tokens: int) -> None:
        with self._lock:
            e = self._open.get(request_id)
            if e is not None:
                e[3] = cached_tokens

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._open.pop(request_id, None)

    def first_output(self, request_id: str) -> None:
        with self._lock:
            e = self._open.pop(request_id, None)
        if e is not None:
            model, tokens, start, cached, observe = e
            observe(model, tokens - cached, time.perf_counter() - start)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


NATIVE_PREFILLS = NativePrefills()


def _install_first_output_hook(entry: versions.OmlxVersion) -> None:
    """Tell ``NATIVE_PREFILLS`` when a request's first token is handed out."""
    owner, attr = _hook(entry.first_output)
    original = getattr(owner, attr)

    def put(self, output, *args, **kwargs):
        try:
            if len(NATIVE_PREFILLS) and (getattr(output, "completion_tokens", 0) or getattr(output, "new_token_ids", None)):
                NATIVE_PREFILLS.first_output(output.request_id)
        except Exception:  # never fail oMLX's engine loop
            logger.exception("pd-bridge: timing a native prefill failed")
        return original(self, output, *args, **kwargs)

    put.__wrapped__ = original
    setattr(owner, attr, put)


def _install_admission_hook(entry: versions.OmlxVersion) -> None:
    """Tell ``ADMISSIONS`` how many tokens oMLX took from its prefix cache, right after its lookup."""
    owner, attr = _hook(entry.prefix_lookup)
    original = getattr(owner, attr)

    def prefix_lookup(self, request, *args, **kwargs):
        out = original(self, request, *args, **kwargs)
        try:
            cached = int(getattr(request, "cached_tokens", 0) or 0)
            ADMISSIONS.admitted(request.request_id, cached)
            NATIVE_PREFILLS.cached(request.request_id, cached)
        except Exception:  # never fail oMLX's scheduler
            logger.exception("pd-bridge[%s]: confirming the verdict failed", getattr(request, "request_id", "?"))
        return out

    prefix_lookup.__wrapped__ = original
    setattr(owner, attr, prefix_lookup)


def install_bridge() -> None:
    """Run the bridge in ``EngineCore.add_request``, before the scheduler looks up the cache."""
    with _lock:
        if _installed["engine"]:
            return
        entry = versions.detect()
        owner, attr = _hook(entry.request_entry)
        at_admission = entry.lookup_at == "admission"
        if at_admission:
            _install_admission_hook(entry)
        _install_first_output_hook(entry)
        import asyncio
        import inspect
        import uuid

        from .bridge import get_bridge
        from .counters import COUNTERS
        from .verdict import Verdict, current_slot

        original = getattr(owner, attr)
        signature = inspect.signature(original)

        async def add_request(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            if bound.arguments.get("request_id") is None:
                bound.arguments["request_id"] = str(uuid.uuid4())
            request_id = bound.arguments["request_id"]
            prompt = bound.arguments.get("prompt")
            multimodal = any(bound.arguments.get(k) is not None for k in ("images", "videos", "vlm_inputs_embeds"))
            slot = current_slot.get()
            if slot is not None:
                slot.begin()
            bridge = get_bridge()
            verdict, nbytes = Verdict("native", "bridge did not run", request_id=request_id), 0
            try:
                if bound.arguments.get("skip_cache_store") or bound.arguments.get("benchmark_trace"):
                    # oMLX's own benchmarks: the prompt must not enter the prefix cache, and what
                    # they time is oMLX's prefill.
                    verdict = Verdict("native", "the request asks oMLX not to store its cache (skip_cache_store)", request_id=request_id)
                else:
                    verdict, nbytes, ids = await bridge.prepare(self, prompt, request_id, multimodal)
                    if ids is not None:
                        bound.arguments["prompt"] = ids  # what the blocks were keyed on, not a re-tokenization
            except Exception as e:  # never let the bridge fail a request
                logger.exception("pd-bridge[%s]: bridge error", request_id)
                verdict = Verdict("native", f"bridge error: {type(e).__name__}", request_id=request_id)

            def refused(claimed: Verdict, e: BaseException) -> Verdict:
                """oMLX did not take the request: the bridged blocks stay in its cache (a retry
                hits them), but this request used none."""
                if claimed.kind not in ("complete", "partial"):
                    return claimed
                why = "cancelled" if isinstance(e, asyncio.CancelledError) else type(e).__name__
                return Verdict("declined", f"oMLX did not take the request ({why}); the {claimed.blocks} bridged blocks stay in its cache", request_id=request_id)

            def finish(final: Verdict) -> None:
                if final.kind == "native":
                    logger.info("pd-bridge[%s]: %s", request_id, final.header())
                COUNTERS.record(final, nbytes)
                if slot is not None:
                    slot.set(final)

            if at_admission and verdict.kind in ("complete", "partial"):
                # The verdict is final only once oMLX has looked the prompt up, on its scheduler's
                # thread; hand the result back to this loop (the slot and counters live here).
                loop, claimed = asyncio.get_running_loop(), verdict

                def admitted(cached: int | None) -> None:
                    final = claimed if cached is None else bridge.confirmed(claimed, cached)
                    if cached is None:
                        logger.warning("pd-bridge[%s]: oMLX did not admit the request within %.0fs; verdict unconfirmed", request_id, bridge.cfg.timeout_s)
                    loop.call_soon_threadsafe(finish, final)

                ADMISSIONS.expect(request_id, admitted)
                loop.call_later(bridge.cfg.timeout_s, ADMISSIONS.give_up, request_id)
                try:
                    return await original(*bound.args, **bound.kwargs)
                except BaseException as e:
                    if ADMISSIONS.withdraw(request_id):
                        finish(refused(claimed, e))
                    raise
            # A prompt oMLX prefills itself is timed for the native rate (rates.py keeps only
            # samples of 256 tokens or more: below that, fixed costs dominate).
            timed = verdict.kind in ("native", "declined") and isinstance(bound.arguments.get("prompt"), list) and bridge.cfg is not None
            if timed:
                NATIVE_PREFILLS.start(request_id, bridge.model_key(self, self.scheduler), len(bound.arguments["prompt"]), bridge.rates.observe_native)
            try:
                rid = await original(*bound.args, **bound.kwargs)
                verdict = bridge.confirm(self, rid, verdict)
                if timed and not at_admission:
                    # The lookup ran inside add_request: what it took from the cache is known.
                    req = getattr(self.scheduler, "requests", {}).get(rid)
                    NATIVE_PREFILLS.cached(request_id, int(getattr(req, "cached_tokens", 0) or 0))
                return rid
            except BaseException as e:
                NATIVE_PREFILLS.forget(request_id)
                verdict = refused(verdict, e)
                raise
            finally:
                finish(verdict)

        add_request.__wrapped__ = original
        setattr(owner, attr, add_request)
        _installed["engine"] = True
        logger.info("pd-bridge: decode-side bridge active (%s)", get_bridge().describe())


def _manager_for(model_id: str):
    from omlx.server import get_server_state

    pool = get_server_state().engine_pool
    entry = pool.get_entry(model_id) if pool is not None else None
    if entry is None or entry.engine is None:
        return None, None
    scheduler = entry.engine._engine.engine.scheduler
    return entry, scheduler


def cache_model_name(entry, scheduler) -> str:
    """The model string oMLX hashes into block keys and stamps in blocks: its paged cache
    manager's (the fork: the model directory path; upstream: the model id), else the table's rule."""
    pcm = getattr(scheduler, "paged_cache_manager", None)
    name = getattr(pcm, "model_name", None)
    return str(name) if name else versions.detect().model_name_for(entry)


def install_routes() -> None:
    """Add ``POST /pd-bridge/v1/rescan`` to oMLX's FastAPI app."""
    with _lock:
        if _installed["server"]:
            return
        entry = versions.detect()
        from fastapi import Body, HTTPException

        app = importlib.import_module(entry.server).app

        def rescan_route(payload: dict = Body(...)):
            model_id = payload.get("model") if isinstance(payload, dict) else None
            if not isinstance(model_id, str):
                raise HTTPException(status_code=400, detail='body must be {"model": "<model id>"}')
            entry, scheduler = _manager_for(model_id)
            if scheduler is None:
                raise HTTPException(status_code=404, detail=f"model {model_id!r} is not loaded")
            manager = getattr(scheduler, "paged_ssd_cache_manager", None)
            if manager is None:
                raise HTTPException(status_code=409, detail=f"model {model_id!r} has no SSD prefix cache (start oMLX with --paged-ssd-cache-dir)")
            model_dir = getattr(entry, "model_path", None)
            return store.rescan(manager, model_name=cache_model_name(entry, scheduler), block_size=scheduler.config.paged_cache_block_size,
                          model_dir=str(model_dir) if model_dir and (Path(model_dir) / "config.json").is_file() else None)  # fmt: skip

        def status_route():
            from .bridge import get_bridge
            from .counters import COUNTERS

            bridge = get_bridge()
            bridge.refresh_queues()  # the queues a decision made now would read
            # What a user of the port may know: no token, no prefill-host address (describe() is for the log).
            return {**bridge.public_status(), "counters": COUNTERS.snapshot()}

        from .middleware import VerdictMiddleware

        app.add_api_route("/pd-bridge/v1/rescan", rescan_route, methods=["POST"])
        app.add_api_route("/pd-bridge/v1/status", status_route, methods=["GET"])
        app.add_middleware(VerdictMiddleware)
        _installed["server"] = True
