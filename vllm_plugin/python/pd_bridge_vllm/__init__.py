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
    AuthError,
    Capture,
    ConfigError,
    DeviceError,
    InputError,
    InternalError,
    PdBridgeError,
    SegmentServer,
    Weights,
    WeightsError,
    WireError,
    model_fingerprint,
    prompt_digest,
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
    """vLLM general-plugin entry point; idempotent, import-light, never initialises CUDA.

    With ``PD_BRIDGE_VLLM=1`` it installs the model tap (``tap.py``) in this vLLM process; the
    capture itself is driven by the KV connector ``pd_bridge_vllm.connector.PdBridgeConnector``,
    which the user names in ``--kv-transfer-config``. Without the variable it does nothing.
    """
    global _registered
    if _registered or not enabled():
        return
    _registered = True
    from . import tap  # imports vLLM's DeepSeek-V2/V3 model module; only when switched on

    try:
        tap.install()
    except Exception as e:  # an unsupported vLLM: say so, never break vLLM's start
        logger.error("pd-bridge-vllm %s: %s is set, but the model tap cannot be installed: %s; vLLM runs without captures", VERSION, ENV_VAR, e)
