"""Process-wide bridge counters: verdicts, bytes, and seconds per phase.

Served as JSON at ``GET /pd-bridge/v1/status`` and under ``"pd_bridge"`` in oMLX's own
``GET /api/status``.
"""

from __future__ import annotations

import threading

PHASES = ("decide", "prefill", "after_prefill", "total")


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._verdicts = {"complete": 0, "partial": 0, "declined": 0, "native": 0}
            self._blocks = 0
            self._bytes = 0
            self._tokens = 0
            self._seconds = {p: 0.0 for p in PHASES}
            self._last: dict | None = None

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


COUNTERS = Counters()
