"""Cap a captured request's prefix-cache hit at the block boundary its capture starts from.

vLLM's prefix cache may stay on (issue 13). A capture needs every prompt row from its start
``S`` on (0 for a cold capture, the decode host's held prefix for a resumed one): rows vLLM takes
from its own cache are never computed, so the tap never sees them. A hit up to ``S`` is fine
(the capture ignores rows before ``S``); one past ``S`` would leave a gap. So:

- a cold capture sets vLLM's own per-request ``skip_reading_prefix_cache`` (its supported switch:
  no lookup at all);
- a resumed capture keeps its lookup, but ``KVCacheManager.get_computed_blocks`` (and the
  connector variant, which falls back to it) sees only the block hashes of ``[0, S)`` for it, so
  the longest hit vLLM can find ends at or before ``S``. A class-level wrapper, like the model tap;
  no vLLM file is edited. Other requests are untouched.

If the wrapper cannot be installed (another vLLM), a resumed capture falls back to skipping the
lookup too: correct, only slower. The worker still checks the first row it is fed and seals a
capture whose rows before its first chunk were not computed ``aborted``.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("vllm.pd_bridge")

# Set on a vLLM Request by the connector's scheduler side: the capture's start S (tokens).
ATTR = "_pd_bridge_prefix_cap"

_installed: bool | None = None


def _capped(fn):
    @functools.wraps(fn)
    def wrapper(self, request, *args, **kwargs):
        cap = getattr(request, ATTR, None)
        if cap is None:
            return fn(self, request, *args, **kwargs)
        hbs = int(getattr(getattr(getattr(self, "coordinator", None), "block_pool", None), "hash_block_size", 0) or 0)
        full = request.block_hashes
        keep = cap // hbs if hbs else 0
        if keep >= len(full):
            return fn(self, request, *args, **kwargs)
        # The lookup only reads request.block_hashes; vLLM's scheduler is one thread, and the
        # full list is back before anything else looks at the request.
        request.block_hashes = full[:keep]
        try:
            return fn(self, request, *args, **kwargs)
        finally:
            request.block_hashes = full

    wrapper._pd_bridge_capped = True  # type: ignore[attr-defined]
    return wrapper


def install() -> bool:
    """Wrap vLLM's prefix lookup once per process; True when it is in place."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        for name in ("get_computed_blocks", "get_computed_blocks_for_connector"):
            fn = getattr(KVCacheManager, name, None)
            if fn is not None and not getattr(fn, "_pd_bridge_capped", False):
                setattr(KVCacheManager, name, _capped(fn))
        _installed = callable(getattr(KVCacheManager, "get_computed_blocks", None))
    except Exception as e:  # another vLLM: captured requests then skip the lookup
        logger.warning("pd-bridge: prefix-cache cap not installed (%s); captured requests skip vLLM's prefix cache", e)
        _installed = False
    return _installed


def apply(request, start: int) -> str:
    """Keep ``request``'s prefix-cache hit at or before ``start``; returns what was done."""
    if start > 0 and install():
        setattr(request, ATTR, int(start))
        return f"prefix-cache hit capped at {start}"
    request.skip_reading_prefix_cache = True
    return "prefix-cache lookup skipped"
