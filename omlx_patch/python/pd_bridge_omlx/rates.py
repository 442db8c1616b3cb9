"""Measured rates, and the decision to bridge made from them.

Whether a bridge pays depends on rates this decode host can measure: its own prefill speed for
the model (from the native prefills it does anyway: tokens prefilled over the time from oMLX's
admission of the request to its first output), each prefill host's end-to-end bridge speed (the
bridged tokens over the time from the prefill request to the last block registered, which
covers vLLM's prefill, the stream and the block writes, pipelined), the fixed cost of a bridge
before it starts (health probe, model lookup), the stream's bytes per second, and the host's
queue (``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` from its ``/metrics``, read
at each decision, with each health probe and for each status request; a read that answers late
still lands, unless a read started after it has landed first).

Prediction for ``n`` uncached tokens:

- native: ``n / native_rate``;
- bridged through host ``h``: ``overhead_h + n * (1 + queue_h) / bridge_rate_h``, the queue read
  as the requests that share the host's throughput with this one (vLLM batches them).

A prompt past the fixed floors (``PD_BRIDGE_MIN_PROMPT_TOKENS``, ``PD_BRIDGE_MIN_UNCACHED_TOKENS``)
is bridged to the host with the lowest prediction, and served natively when the native
prediction is lower. With no native estimate yet for the model, or a host whose estimate is
missing or older than ``PD_BRIDGE_RATE_MAX_AGE_S``, the prompt is bridged: that is how the
estimate is (re)made. Estimates are exponentially weighted moving averages (weight 0.3 for the
newest) over samples of at least ``MIN_SAMPLE_TOKENS`` tokens, so one odd request moves them
but does not set them.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

#: Samples shorter than this say more about fixed costs than about a rate.
MIN_SAMPLE_TOKENS = 256
_WEIGHT = 0.3


class Ewma:
    """An exponentially weighted moving average, and when it last moved."""

    def __init__(self) -> None:
        self.value: float | None = None
        self.samples = 0
        self.at = 0.0

    def observe(self, x: float, now: float) -> None:
        if not (x == x) or x < 0 or x == float("inf"):  # NaN, negative, infinite: not a sample
            return
        self.value = x if self.value is None else (1 - _WEIGHT) * self.value + _WEIGHT * x
        self.samples += 1
        self.at = now


@dataclass
class HostRates:
    """What this decode host measured of one prefill host."""

    bridge_tok_s: Ewma
    overhead_s: Ewma
    stream_bytes_s: Ewma
    bytes_per_token: Ewma
    #: Requests running + waiting on the host at its newest read (None: never read).
    queue: int | None = None
    #: When that read started (the clock of ``Rates``): an older read never overwrites it.
    queue_at: float = float("-inf")


@dataclass(frozen=True)
class Prediction:
    """Seconds to prefill ``tokens`` natively and through each host (None: not measured yet)."""

    tokens: int
    native_s: float | None
    bridged_s: tuple[float | None, ...]

    def best_host(self) -> int | None:
        """The host with the lowest bridged prediction, an unmeasured one first (to measure it)."""
        if not self.bridged_s:
            return None
        return min(range(len(self.bridged_s)), key=lambda i: (-1.0 if self.bridged_s[i] is None else self.bridged_s[i], i))

    def native_reason(self) -> str | None:
        """Why to serve natively, or None to bridge: only when every prediction is known and
        the native one is lower than the best bridged one."""
        h = self.best_host()
        if self.native_s is None or h is None or self.bridged_s[h] is None:
            return None
        if self.native_s < self.bridged_s[h]:
            return f"predicted native {self.native_s:.1f} s < bridged {self.bridged_s[h]:.1f} s for {self.tokens} uncached tokens"
        return None


def parse_queue(metrics_text: str) -> int | None:
    """Requests running + waiting, summed over label sets (data-parallel ranks, engines), from
    vLLM's Prometheus text; None when neither gauge is there."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        m = re.match(r"^vllm:num_requests_(running|waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", line)
        if m:
            try:
                total += float(m.group(2))
                seen = True
            except ValueError:
                continue
    return int(round(total)) if seen else None


class Rates:
    """The running estimates of one decode host (thread-safe)."""

    def __init__(self, hosts: int, max_age_s: float = 600.0, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.max_age_s = max_age_s
        self._native: dict[str, Ewma] = {}
        self._hosts = [HostRates(Ewma(), Ewma(), Ewma(), Ewma()) for _ in range(hosts)]

    def observe_native(self, model: str, tokens: int, seconds: float) -> None:
        """A native prefill of ``tokens`` uncached tokens took ``seconds``."""
        if tokens < MIN_SAMPLE_TOKENS or not 0 < seconds < float("inf"):  # NaN fails too
            return
        with self._lock:
            self._native.setdefault(model, Ewma()).observe(tokens / seconds, self._clock())

    def observe_bridge(self, host: int, tokens: int, seconds: float, overhead_s: float, nbytes: int) -> None:
        """A complete bridge of ``tokens`` tokens through ``host``: ``seconds`` from the prefill
        request to the last block registered, ``overhead_s`` before the request (probe, model),
        ``nbytes`` written."""
        if tokens < MIN_SAMPLE_TOKENS or not 0 < seconds < float("inf"):
            return
        now = self._clock()
        with self._lock:
            h = self._hosts[host]
            h.bridge_tok_s.observe(tokens / seconds, now)
            h.overhead_s.observe(max(0.0, overhead_s), now)
            if nbytes > 0:
                h.stream_bytes_s.observe(nbytes / seconds, now)
                h.bytes_per_token.observe(nbytes / tokens, now)

    def now(self) -> float:
        return self._clock()

    def observe_queue(self, host: int, queue: int | None, read_at: float | None = None) -> None:
        """The host's queue from a read of its metrics started at ``read_at`` (default now):
        reads answer out of order, and only the one started last counts."""
        if queue is None or queue < 0:
            return
        at = self._clock() if read_at is None else read_at
        with self._lock:
            h = self._hosts[host]
            if at >= h.queue_at:
                h.queue, h.queue_at = queue, at

    def predict(self, model: str, tokens: int, in_flight: list[int] | None = None) -> Prediction:
        """Predictions for ``tokens`` uncached tokens; ``in_flight`` (this decode host's bridges
        per host) is a floor under each host's queue (the host's metrics lag)."""
        now = self._clock()
        with self._lock:
            native = self._native.get(model)
            native_s = tokens / native.value if native is not None and native.value else None
            bridged: list[float | None] = []
            for i, h in enumerate(self._hosts):
                rate = h.bridge_tok_s
                if not rate.value or now - rate.at > self.max_age_s:
                    bridged.append(None)
                    continue
                queue = max(h.queue or 0, (in_flight or [0] * len(self._hosts))[i])
                bridged.append((h.overhead_s.value or 0.0) + tokens * (1 + queue) / rate.value)
        return Prediction(tokens, native_s, tuple(bridged))

    def break_even(self, model: str, host: int) -> int | None:
        """The uncached prompt length from which a bridge through ``host`` is predicted to be
        faster than a native prefill (None: not measured, or the host is never faster)."""
        with self._lock:
            native = self._native.get(model)
            h = self._hosts[host]
            if native is None or not native.value or not h.bridge_tok_s.value:
                return None
            gain = 1 / native.value - (1 + (h.queue or 0)) / h.bridge_tok_s.value
            if gain <= 0:
                return None
            return int((h.overhead_s.value or 0.0) / gain) + 1

    def snapshot(self) -> dict:
        """The estimates, for ``/pd-bridge/v1/status`` (models by directory name only)."""
        now = self._clock()

        def r(x: float | None, nd: int = 1):
            return None if x is None else round(x, nd)

        with self._lock:
            native = {model.rstrip("/").rsplit("/", 1)[-1]: {"tok_s": r(e.value), "samples": e.samples, "age_s": r(now - e.at)} for model, e in self._native.items()}
            hosts = [
                {
                    "bridge_tok_s": r(h.bridge_tok_s.value),
                    "overhead_s": r(h.overhead_s.value, 3),
                    "stream_mb_s": r(None if h.stream_bytes_s.value is None else h.stream_bytes_s.value / 1e6),
                    "bytes_per_token": r(h.bytes_per_token.value, 0),
                    "queue": h.queue,
                    "queue_age_s": r(now - h.queue_at) if h.queue is not None else None,
                    "samples": h.bridge_tok_s.samples,
                    "age_s": r(now - h.bridge_tok_s.at) if h.bridge_tok_s.samples else None,
                }
                for h in self._hosts
            ]
        models = list(self._native)
        for i, h in enumerate(hosts):
            h["break_even_tokens"] = {m.rstrip("/").rsplit("/", 1)[-1]: self.break_even(m, i) for m in models}
        return {"native": native, "prefill_hosts": hosts, "max_age_s": self.max_age_s}
