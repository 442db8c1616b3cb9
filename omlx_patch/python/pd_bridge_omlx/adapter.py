"""Runtime adapter for oMLX: block validation at index time and a rescan route.

oMLX builds its prefix-cache index once, when a model loads, and trusts every file it finds.
This adapter (active only with ``PD_BRIDGE_OMLX=1``) makes two changes through oMLX's own
objects, without touching its files:

- every block file is validated by the Rust core before oMLX may index it; a file that fails
  is logged with the reason and never served;
- ``POST /pd-bridge/v1/rescan {"model": ID}`` indexes block files that appeared since the model
  loaded (the bridge's writer puts them there), validated against that model.

``patches/omlx-0.7.0-cache-rescan.patch`` proposes the same as a small public API upstream.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ._native import BlockRejected, inspect_block

logger = logging.getLogger("pd_bridge_omlx")

SUPPORTED_OMLX = ("0.7.0",)

_lock = threading.Lock()
_installed = {"cache": False, "server": False}


class UnsupportedOmlxError(RuntimeError):
    pass


def check_version() -> str:
    import omlx

    version = getattr(omlx, "__version__", "unknown")
    if version not in SUPPORTED_OMLX:
        raise UnsupportedOmlxError(
            f"pd-bridge-omlx supports oMLX {', '.join(SUPPORTED_OMLX)}; this is oMLX {version}. "
            "Unset PD_BRIDGE_OMLX to run oMLX without the bridge, or install a supported oMLX."
        )
    return version


def install_cache_guard() -> None:
    """Validate every block before ``PagedSSDCacheManager`` indexes it."""
    with _lock:
        if _installed["cache"]:
            return
        check_version()
        from omlx.cache.paged_ssd_cache import PagedSSDCacheManager

        original = PagedSSDCacheManager._read_file_metadata

        def guarded(self, file_path):
            try:
                inspect_block(str(file_path))
            except BlockRejected as e:
                logger.warning("pd-bridge: not serving block %s", e)
                return None
            return original(self, file_path)

        guarded.__wrapped__ = original
        PagedSSDCacheManager._read_file_metadata = guarded
        _installed["cache"] = True
        logger.info("pd-bridge: block validation active for oMLX %s", check_version())


def rescan(manager, model_name: str | None = None, block_size: int | None = None) -> dict:
    """Index block files in ``manager``'s cache directory that it does not know yet.

    Each is validated (and, when given, checked against the model and block size) first.
    Returns ``{"registered": [...], "rejected": [[path, reason], ...], "known": n}``.
    """
    registered, rejected, known = [], [], 0
    root = Path(manager._cache_dir)
    for sub in manager.SUBDIR_CHARS:
        for path in sorted((root / sub).glob("*.safetensors")):
            try:
                digest = bytes.fromhex(path.stem)
            except ValueError:
                digest = None
            if digest is not None and manager._index.contains(digest):
                known += 1
                continue
            try:
                inspect_block(str(path), model_name=model_name, block_size=block_size)
            except BlockRejected as e:
                logger.warning("pd-bridge: not serving block %s", e)
                rejected.append([str(path), str(e)])
                continue
            meta = manager._read_file_metadata(path)
            if meta is None:
                rejected.append([str(path), "oMLX could not read its metadata"])
                continue
            manager._enforce_size_limit_for_new_block()
            manager._index.add(meta)
            registered.append(path.stem)
    logger.info("pd-bridge: rescan registered %d blocks, rejected %d, %d already known", len(registered), len(rejected), known)
    return {"registered": registered, "rejected": rejected, "known": known}


def _manager_for(model_id: str):
    from omlx.server import get_server_state

    pool = get_server_state().engine_pool
    entry = pool.get_entry(model_id) if pool is not None else None
    if entry is None or entry.engine is None:
        return None, None
    scheduler = entry.engine._engine.engine.scheduler
    return entry, scheduler


def install_routes() -> None:
    """Add ``POST /pd-bridge/v1/rescan`` to oMLX's FastAPI app."""
    with _lock:
        if _installed["server"]:
            return
        check_version()
        from fastapi import Body, HTTPException
        from omlx.server import app

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
            return rescan(manager, model_name=str(entry.model_path), block_size=scheduler.config.paged_cache_block_size)

        app.add_api_route("/pd-bridge/v1/rescan", rescan_route, methods=["POST"])
        _installed["server"] = True
