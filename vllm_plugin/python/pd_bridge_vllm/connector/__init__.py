"""PdBridgeConnector: vLLM KV connector (v1 API) that drives pd-bridge captures.

Load it with::

    kv_transfer_config={"kv_connector": "PdBridgeConnector",
                        "kv_connector_module_path": "pd_bridge_vllm.connector",
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"weights": DIR, "port": P, "token": T,
                                                      "address": "10.0.0.5"}}

(or set PD_BRIDGE_VLLM_WEIGHTS / PD_BRIDGE_VLLM_PORT / PD_BRIDGE_VLLM_TOKEN /
PD_BRIDGE_VLLM_ADDRESS; without an address the segment server binds vLLM's ``--host`` or
loopback, never every interface). A request is captured when its ``kv_transfer_params`` hold
``{"pd_capture": {"request_id": "...", "block_size": 256, "secret": "<64 hex>"}}`` (the decode
host's per-request secret, which keys the encrypted stream; optionally ``"fingerprint"`` and
``"omlx_format"``, the decoder's block format: its overlap semantics and what segments carry).

Shaped as vLLM's own NIXL and Mooncake connectors are: this class only dispatches by role to

- ``scheduler.PdBridgeConnectorScheduler`` (EngineCore process): which captured requests run
  prompt tokens in each step, with their KV blocks, and which step runs the last prompt chunk;
- ``worker.PdBridgeConnectorWorker`` (each worker): the native captures, fed by the model tap,
  sealed in ``wait_for_save`` of the step that ran the last prompt chunk — no timers;
- ``stats``: captures, blocks, bytes, seal latency and aborts through vLLM's KV-connector stats
  (``get_kv_connector_stats`` / ``build_kv_connector_stats`` / ``build_prom_metrics``), so they
  appear in vLLM's stats log and on its ``/metrics``;
- ``metadata``: the capture spec and what the scheduler side hands the workers each step.

Which vLLM versions, and where they are hooked: ``pd_bridge_vllm.versions``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA

from .. import versions
from ..tap import OP_NAME
from .metadata import (  # noqa: F401  (the public names of the former single module)
    DUMP_ENV,
    PARAM_KEY,
    CaptureChunk,
    CaptureSpec,
    CaptureSpecError,
    PdBridgeConnectorMetadata,
    UnsupportedEngineSettings,
    check_compilation,
)
from .scheduler import PdBridgeConnectorScheduler
from .stats import PdBridgeKVConnectorStats, PdBridgePromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from .worker import PdBridgeConnectorWorker


class PdBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """SupportsHMA: vLLM keeps its hybrid KV-cache manager on with this connector (DeepSeek-V4's
    sliding-window and compressed layers in their own KV-cache groups, as without a connector;
    vLLM 0.26's FlashMLA prefill fails on the unified layout); the worker locates a layer's rows
    with the blocks of that layer's own group either way."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None):
        versions.check()
        check_compilation(vllm_config, OP_NAME)
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.connector_scheduler: PdBridgeConnectorScheduler | None = None
        self.connector_worker: PdBridgeConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = PdBridgeConnectorScheduler(vllm_config, kv_cache_config)
        else:
            from .worker import PdBridgeConnectorWorker  # torch + the native module: workers only

            self.connector_worker = PdBridgeConnectorWorker(vllm_config, extra, kv_cache_config)

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        self.connector_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None:
            self.connector_worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.connector_worker is not None:
            self.connector_worker.clear()

    def on_attention_input(self, module, positions, hidden_states) -> None:
        """The tap's sink (the worker side is set as the sink; kept here for callers of the
        connector object)."""
        self.connector_worker.on_attention_input(module, positions, hidden_states)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.connector_worker is None:
            return None, None
        return self.connector_worker.get_finished(finished_req_ids)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # ------------------------------------------------------------------ stats (/metrics)

    def get_kv_connector_stats(self) -> PdBridgeKVConnectorStats | None:
        if self.connector_worker is None:
            return None
        return self.connector_worker.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdBridgeKVConnectorStats:
        return PdBridgeKVConnectorStats(data=data) if data is not None else PdBridgeKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> PdBridgePromMetrics:
        return PdBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
