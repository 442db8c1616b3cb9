"""The model tap: hands each DeepSeek-V2/V3 MLA layer's attention input to the capture.

One small adapter per supported vLLM version. For vLLM 0.32.0 it wraps, at the class level,
``vllm.model_executor.models.deepseek_v2.DeepseekV2MLAAttention.forward(positions,
hidden_states, llama_4_scaling)``: the decoder layer calls it with the hidden states right after
``input_layernorm`` (the attention input), flattened over the whole batch. The wrapper asks the
active worker-side connector (if any) to slice its requests' rows out and feed them, then runs
vLLM's own forward unchanged. No vLLM file is edited; nothing here touches CUDA at import.

The wrapper is plain Python, so it needs eager execution of the model (``enforce_eager=True``,
or a compilation mode that leaves the attention module uncompiled).
"""

from __future__ import annotations

import functools
import logging
import re

logger = logging.getLogger("vllm.pd_bridge")  # a child of vLLM's logger: its handler and level apply

SUPPORTED_VLLM = ("0.32.0",)
_MARK = "__pd_bridge_tap__"
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn$")

# The worker-side connector that receives attention inputs (set by PdBridgeConnector's worker).
_sink = None


class UnsupportedVLLM(RuntimeError):
    pass


def set_sink(sink) -> None:
    global _sink
    _sink = sink


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def check_version() -> str:
    v = vllm_version()
    base = v.split("+", 1)[0]
    if base not in SUPPORTED_VLLM:
        raise UnsupportedVLLM(
            f"pd-bridge-vllm's model tap supports vLLM {', '.join(SUPPORTED_VLLM)}; this is vLLM {v}. "
            "Install a supported vLLM or a pd-bridge-vllm release that supports this one."
        )
    return v


def _target():
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention

    return DeepseekV2MLAAttention


def installed() -> bool:
    try:
        import sys

        mod = sys.modules.get("vllm.model_executor.models.deepseek_v2")
        return mod is not None and getattr(mod.DeepseekV2MLAAttention.forward, _MARK, False)
    except Exception:  # pragma: no cover - defensive
        return False


def layer_of(module) -> tuple[int, str]:
    """(decoder layer index, attention layer name keyed in the forward context) of one module."""
    cached = getattr(module, "_pd_bridge_layer", None)
    if cached is not None:
        return cached
    wrapper = module.mla_attn  # MultiHeadLatentAttentionWrapper (vllm/model_executor/layers/mla.py)
    m = _LAYER_RE.search(getattr(wrapper, "prefix", ""))
    if m is None:
        raise RuntimeError(f"cannot read a layer index from MLA prefix {getattr(wrapper, 'prefix', None)!r}")
    found = (int(m.group(1)), wrapper.mla_attn.layer_name)
    module._pd_bridge_layer = found
    return found


def install() -> bool:
    """Wrap the MLA attention forward once per process. Returns True if this call installed it."""
    check_version()
    cls = _target()
    orig = cls.forward
    if getattr(orig, _MARK, False):
        return False

    @functools.wraps(orig)
    def forward(self, positions, hidden_states, *args, **kwargs):
        sink = _sink
        if sink is not None:
            try:
                sink.on_attention_input(self, positions, hidden_states)
            except Exception:  # never break vLLM's forward; the capture records its own failure
                logger.exception("pd-bridge tap failed; the forward continues without it")
        return orig(self, positions, hidden_states, *args, **kwargs)

    setattr(forward, _MARK, True)
    forward.__pd_bridge_orig__ = orig
    cls.forward = forward
    logger.info("pd-bridge: model tap installed on %s.%s.forward (vLLM %s)", cls.__module__, cls.__qualname__, vllm_version())
    return True


def uninstall() -> None:
    """Restore vLLM's forward (tests)."""
    cls = _target()
    orig = getattr(cls.forward, "__pd_bridge_orig__", None)
    if orig is not None:
        cls.forward = orig
