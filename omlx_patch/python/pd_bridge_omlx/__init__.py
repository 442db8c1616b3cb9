"""pd-bridge for oMLX: decode on the Mac what a vLLM host prefilled.

Enabled by ``PD_BRIDGE_OMLX=1``. The native module does all cache math, checking and writing;
this package only adapts oMLX's objects to plain data.
"""

from __future__ import annotations

import logging
import os

from ._native import (  # noqa: F401
    VERSION,
    AuthError,
    BlockRejected,
    BlockWriter,
    CacheBuilder,
    ConfigError,
    DeviceError,
    IngestControl,
    InputError,
    InternalError,
    PdBridgeError,
    Weights,
    WeightsError,
    WireError,
    capture_secret,
    clean_stale_temps,
    expected_block_size,
    export_weights,
    ingest,
    inspect_block,
    omlx_formats,
)

__version__ = VERSION
ENV_VAR = "PD_BRIDGE_OMLX"

logger = logging.getLogger("pd_bridge_omlx")


def enabled() -> bool:
    """Whether the bridge is switched on for this process."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")
