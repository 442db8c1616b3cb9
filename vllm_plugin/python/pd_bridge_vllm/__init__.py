"""pd-bridge for vLLM: capture the decoder's finished cache during prefill.

vLLM calls :func:`register` in every process it starts (``vllm.general_plugins``). Without
``PD_BRIDGE_VLLM=1`` it returns at once and costs nothing. Nothing here imports torch or
touches CUDA at import time.
"""

from __future__ import annotations

import logging
import os

from ._native import (  # noqa: F401
    VERSION,
    Capture,
    ConfigError,
    PdBridgeError,
    SegmentServer,
    Weights,
    WeightsError,
    weights_fingerprint,
)

__version__ = VERSION
ENV_VAR = "PD_BRIDGE_VLLM"

logger = logging.getLogger("pd_bridge_vllm")
_registered = False


def enabled() -> bool:
    """Whether the bridge is switched on for this process."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """vLLM general-plugin entry point; idempotent, import-light, never initialises CUDA."""
    global _registered
    if _registered or not enabled():
        return
    _registered = True
    # The KV connector and the model tap arrive with the capture engine; until then an enabled
    # plugin says so instead of pretending to capture.
    logger.warning("pd-bridge-vllm %s: %s is set, but this build has no capture engine yet; vLLM runs unchanged", VERSION, ENV_VAR)
