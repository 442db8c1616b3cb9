"""What a test does when an engine it needs is missing or cannot start.

``tests/bridge.sh`` installs every engine the suite uses and sets ``PD_BRIDGE_REQUIRE_ENGINES=1``:
there a missing vLLM, oMLX or wheel is a broken set-up and the test FAILS, saying what is
missing. Run by hand in some other venv (no such variable) the test skips with the same reason.
Genuinely absent hardware (no CUDA device, fewer than two CPUs) still skips everywhere.
"""

from __future__ import annotations

import importlib
import os

import pytest

REQUIRED = os.environ.get("PD_BRIDGE_REQUIRE_ENGINES") == "1"


def missing(reason: str) -> None:
    """Fail (under the test command) or skip (elsewhere) with ``reason``; usable at module level."""
    if REQUIRED:
        pytest.fail(f"{reason} (PD_BRIDGE_REQUIRE_ENGINES=1: the test command installs it, so this is a broken set-up)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(*modules: str):
    """Import and return the first of ``modules`` after importing all; ``missing`` if any fails."""
    got = []
    for name in modules:
        try:
            got.append(importlib.import_module(name))
        except Exception as e:  # an engine that fails to import is as missing as an absent one
            missing(f"{name} is not importable here: {type(e).__name__}: {e}")
    return got[0] if got else None


def starting(what: str) -> None:
    """Called where a test starts an engine. The quick lane (``tests/bridge.sh quick``, which sets
    ``PD_BRIDGE_QUICK=1``) runs only tests not marked ``engine``: reaching here there means a test
    that starts an engine lacks its mark."""
    if os.environ.get("PD_BRIDGE_QUICK") == "1":
        raise RuntimeError(f"{what} started in the quick lane: mark the test `engine` (pytest.mark.engine)")
