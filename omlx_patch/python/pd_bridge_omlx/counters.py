"""Process-wide bridge counters: verdicts, bytes, and seconds per phase.

Served as JSON at ``GET /pd-bridge/v1/status`` and under ``"pd_bridge"`` in oMLX's own
``GET /api/status``, and in Prometheus' text format (``prometheus_client``, a private
``CollectorRegistry``, not the process-global one) at ``GET /pd-bridge/v1/metrics``:

- ``pd_bridge_verdicts_total{kind}`` — complete / partial / declined / native
- ``pd_bridge_blocks_total``, ``pd_bridge_tokens_total`` — bridged blocks and tokens oMLX reused
- ``pd_bridge_bytes_written_total`` — block bytes registered with oMLX's index
- ``pd_bridge_phase_seconds{phase}`` (histogram) — decide, prefill, after_prefill, total
- ``pd_bridge_request_bytes`` (histogram) — bytes written per request that tried a bridge
"""

from __future__ import annotations

import threading

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
except ImportError:  # the JSON counters work without it; /pd-bridge/v1/metrics says what is missing
    CollectorRegistry = None

PHASES = ("decide", "prefill", "after_prefill", "total")
KINDS = ("complete", "partial", "declined", "native")

#: The Prometheus text exposition format, version 0.0.4.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Phases run from milliseconds (after prefill) to the bridge timeout (600 s by default).
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, float("inf"))
# A block is 100 KB (tiny MLA) to several hundred MB (DeepSeek-V4 at 64K tokens).
_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(2, 14)) + (float("inf"),)


class _Prometheus:
    """The same numbers as the JSON snapshot, as Prometheus metrics in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.verdicts = Counter("pd_bridge_verdicts", "Requests by the bridge's verdict (X-PD-Bridge's first word)", ["kind"], registry=r)
        for kind in KINDS:
            self.verdicts.labels(kind=kind)  # every kind is exported from the start, at 0
        self.blocks = Counter("pd_bridge_blocks", "Blocks bridged from the prefill host that oMLX reused", registry=r)
        self.tokens = Counter("pd_bridge_tokens", "Prompt tokens bridged from the prefill host that oMLX reused", registry=r)
        self.bytes = Counter("pd_bridge_bytes_written", "Block bytes written and registered with oMLX's index", registry=r)
        self.phase_seconds = Histogram("pd_bridge_phase_seconds", "Seconds per bridge phase (decide, prefill, after_prefill, total)",
                                       ["phase"], buckets=_SECONDS_BUCKETS, registry=r)  # fmt: skip
        for phase in PHASES:
            self.phase_seconds.labels(phase=phase)
        self.request_bytes = Histogram("pd_bridge_request_bytes", "Block bytes written per request that tried a bridge",
                                       buckets=_BYTES_BUCKETS, registry=r)  # fmt: skip

    def record(self, verdict, nbytes: int) -> None:
        self.verdicts.labels(kind=verdict.kind).inc()
        if verdict.kind in ("complete", "partial"):
            self.blocks.inc(verdict.blocks)
            self.tokens.inc(verdict.tokens)
        if nbytes:
            self.bytes.inc(nbytes)
        if verdict.kind != "native":
            self.request_bytes.observe(nbytes)
        for p, s in verdict.phases.items():
            if p in PHASES:
                self.phase_seconds.labels(phase=p).observe(max(0.0, float(s)))


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._verdicts = {k: 0 for k in KINDS}
            self._blocks = 0
            self._bytes = 0
            self._tokens = 0
            self._seconds = {p: 0.0 for p in PHASES}
            self._last: dict | None = None
            self._prom = _Prometheus() if CollectorRegistry is not None else None

    def record(self, verdict, nbytes: int = 0) -> None:
        with self._lock:
            self._verdicts[verdict.kind] = self._verdicts.get(verdict.kind, 0) + 1
            if verdict.kind in ("complete", "partial"):
                self._blocks += verdict.blocks
                self._tokens += verdict.tokens
            self._bytes += nbytes
            for p, s in verdict.phases.items():
                if p in self._seconds:
                    self._seconds[p] += s
            self._last = {"request_id": verdict.request_id, "verdict": verdict.header(), "phases": dict(verdict.phases), "ready_unix": verdict.ready_unix}
            if self._prom is not None:
                self._prom.record(verdict, nbytes)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "verdicts": dict(self._verdicts),
                "bridged_blocks": self._blocks,
                "bridged_tokens": self._tokens,
                "bytes_written": self._bytes,
                "seconds": {p: round(s, 6) for p, s in self._seconds.items()},
                "last": self._last,
            }

    @property
    def registry(self):
        """The private ``CollectorRegistry`` (None without ``prometheus_client``)."""
        with self._lock:
            return None if self._prom is None else self._prom.registry

    def prometheus_text(self) -> bytes:
        """The counters in Prometheus' text format 0.0.4. Raises RuntimeError when
        ``prometheus_client`` is not installed."""
        registry = self.registry
        if registry is None:
            raise RuntimeError("prometheus_client is not installed (pip install prometheus_client; pd-bridge-omlx depends on it)")
        return generate_latest(registry)


COUNTERS = Counters()
