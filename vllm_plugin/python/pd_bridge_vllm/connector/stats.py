"""The capture's figures through vLLM's KV-connector stats, so they reach vLLM's loggers and
``/metrics``.

The worker records one observation per sealed capture (verdict, blocks, bytes on the wire, seal
latency: from the end of the step that ran the last prompt chunk to sealed); vLLM collects them
with ``get_kv_connector_stats()`` after each step, aggregates over workers, rebuilds them in the
frontend with ``PdBridgeConnector.build_kv_connector_stats(data)``, logs ``reduce()`` with its
periodic stats line and feeds ``PdBridgePromMetrics.observe`` (Prometheus):

- ``vllm:pd_bridge_captures_total{verdict}``: captures sealed, by verdict (complete / partial /
  aborted / error);
- ``vllm:pd_bridge_aborts_total``: captures that did not seal complete (partial, aborted, error);
- ``vllm:pd_bridge_blocks_total``, ``vllm:pd_bridge_bytes_total``: blocks and wire bytes shipped;
- ``vllm:pd_bridge_seal_latency_seconds``: histogram of the seal latency.

The figures live in ``data`` (lists, serializable), which every vLLM the bridge accepts ships: from
0.30 through ``KVConnectorStats.to_dict()``, before that by reading ``data`` (``versions.py``:
trait ``stats_payload``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

VERDICTS = ("complete", "partial", "aborted", "error")
_KEYS = ("verdict", "blocks", "bytes", "seal_latency_s")


@dataclass
class PdBridgeKVConnectorStats(KVConnectorStats):
    """One entry per sealed capture in each list of ``data``."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data: dict[str, list[Any]] = {k: [] for k in _KEYS}

    def record_seal(self, verdict: str, blocks: int, nbytes: int, seal_latency_s: float | None) -> None:
        self.data["verdict"].append(verdict if verdict in VERDICTS else "error")
        self.data["blocks"].append(int(blocks))
        self.data["bytes"].append(int(nbytes))
        self.data["seal_latency_s"].append(None if seal_latency_s is None else float(seal_latency_s))

    def clone_and_reset(self) -> PdBridgeKVConnectorStats:
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not self.data.get("verdict")

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for k in _KEYS:
                self.data.setdefault(k, []).extend(other.data.get(k, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        v = self.data["verdict"]
        lat = sorted(x for x in self.data["seal_latency_s"] if x is not None)
        out: dict[str, int | float] = {"Captures sealed": len(v)}
        for k in VERDICTS:
            out[f"{k.capitalize()}"] = v.count(k)
        out["Blocks"] = sum(self.data["blocks"])
        out["MB shipped"] = round(sum(self.data["bytes"]) / 2**20, 3)
        out["Avg seal latency (ms)"] = round(1e3 * sum(lat) / len(lat), 3) if lat else 0
        out["Max seal latency (ms)"] = round(1e3 * lat[-1], 3) if lat else 0
        return out

    @property
    def num_captures(self) -> int:
        return len(self.data["verdict"])


class PdBridgePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        captures = self._counter_cls(
            name="vllm:pd_bridge_captures",
            documentation="pd-bridge captures sealed, by verdict (complete, partial, aborted, error).",
            labelnames=labelnames + ["verdict"],
        )
        self.captures = {i: {v: captures.labels(*lv, v) for v in VERDICTS} for i, lv in per_engine_labelvalues.items()}

        def per_engine(metric):
            return {i: metric.labels(*lv) for i, lv in per_engine_labelvalues.items()}

        self.aborts = per_engine(self._counter_cls(
            name="vllm:pd_bridge_aborts",
            documentation="pd-bridge captures that did not seal complete (partial, aborted or error).",
            labelnames=labelnames,
        ))
        self.blocks = per_engine(self._counter_cls(
            name="vllm:pd_bridge_blocks",
            documentation="Blocks of the decoder's cache shipped by pd-bridge captures.",
            labelnames=labelnames,
        ))
        self.bytes = per_engine(self._counter_cls(
            name="vllm:pd_bridge_bytes",
            documentation="Bytes of segments pd-bridge captures put on the wire.",
            labelnames=labelnames,
        ))
        self.seal_latency = per_engine(self._histogram_cls(
            name="vllm:pd_bridge_seal_latency_seconds",
            documentation="From the end of the step that ran a captured request's last prompt chunk to its capture sealed.",
            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
            labelnames=labelnames,
        ))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        d = transfer_stats_data
        for verdict, blocks, nbytes, lat in zip(d.get("verdict", []), d.get("blocks", []), d.get("bytes", []), d.get("seal_latency_s", [])):
            self.captures[engine_idx][verdict if verdict in VERDICTS else "error"].inc()
            if verdict != "complete":
                self.aborts[engine_idx].inc()
            self.blocks[engine_idx].inc(blocks)
            self.bytes[engine_idx].inc(nbytes)
            if lat is not None:
                self.seal_latency[engine_idx].observe(lat)
