"""The decision from measured rates (``pd_bridge_omlx.rates``), without engines: estimates,
predictions, the break-even, stale estimates re-measured, the queue from vLLM's metrics, and the
bridge's use of them (tests/e2e/test_bridge.py::test_the_decision_from_measured_rates runs it
with real engines)."""

from __future__ import annotations

import asyncio
import http.server
import threading

import pytest

import engines  # noqa: E402  (tests/ is on the path: conftest)

engines.require("pd_bridge_omlx")

from pd_bridge_omlx import config, rates  # noqa: E402
from pd_bridge_omlx.bridge import Bridge  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_predictions_and_the_decision():
    clock = Clock()
    r = rates.Rates(2, max_age_s=600, clock=clock)
    # Nothing measured: bridge (that is how the estimates are made).
    p = r.predict("/m/a", 8000)
    assert p.native_s is None and p.bridged_s == (None, None) and p.native_reason() is None
    r.observe_native("/m/a", 4000, 2.0)  # 2,000 tok/s
    r.observe_native("/m/a", 100, 1.0)  # too short to be a rate: ignored
    p = r.predict("/m/a", 8000)
    assert p.native_s == pytest.approx(4.0) and p.native_reason() is None and p.best_host() == 0
    # Host 0: 8,000 tok/s end to end after 0.5 s of set-up; host 1 not measured yet.
    r.observe_bridge(0, 8192, 1.024, 0.5, 8192 * 10_000)
    p = r.predict("/m/a", 8000)
    assert p.bridged_s[0] == pytest.approx(0.5 + 1.0) and p.bridged_s[1] is None
    assert p.best_host() == 1  # the unmeasured host is tried, to measure it
    r.observe_bridge(1, 8192, 8.192, 0.1, 0)  # 1,000 tok/s
    p = r.predict("/m/a", 8000)
    assert p.best_host() == 0 and p.native_reason() is None
    # Short prompts: the set-up dominates and native wins, saying why.
    p = r.predict("/m/a", 1000)
    assert p.native_reason() == "predicted native 0.5 s < bridged 0.6 s for 1000 uncached tokens"
    # A queue on the host (its metrics, or this host's own bridges in flight) slows its share.
    r.observe_queue(0, 3)
    assert r.predict("/m/a", 8000).bridged_s[0] == pytest.approx(0.5 + 4.0)
    assert r.predict("/m/a", 8000, in_flight=[5, 0]).bridged_s[0] == pytest.approx(0.5 + 6.0)
    r.observe_queue(0, 0)
    # Reads answer out of order: only the one started last counts.
    r.observe_queue(1, 7, read_at=clock.t - 1)
    r.observe_queue(1, 2, read_at=clock.t - 5)
    assert r.snapshot()["prefill_hosts"][1]["queue"] == 7 and r.snapshot()["prefill_hosts"][1]["queue_age_s"] == 1.0
    r.observe_queue(1, 0)
    # Break-even: overhead / (1/native - 1/bridge) = 0.5 / (1/2000 - 1/8000) = 1333.3 tokens.
    assert r.break_even("/m/a", 0) == 1334
    assert r.break_even("/m/a", 1) is None  # host 1 is slower than native at any length
    assert r.break_even("/m/other", 0) is None
    # An estimate past its age is re-measured: the host counts as unmeasured again.
    clock.t += 601
    assert r.predict("/m/a", 1000).bridged_s == (None, None) and r.predict("/m/a", 1000).native_reason() is None
    snap = r.snapshot()
    assert snap["native"]["a"]["tok_s"] == 2000.0 and snap["native"]["a"]["samples"] == 1
    assert snap["prefill_hosts"][0]["bridge_tok_s"] == 8000.0 and snap["prefill_hosts"][0]["bytes_per_token"] == 10000
    assert snap["prefill_hosts"][0]["break_even_tokens"] == {"a": 1334}


def test_estimates_move_by_weighted_average_and_ignore_nonsense():
    r = rates.Rates(1)
    r.observe_native("m", 1000, 1.0)
    r.observe_native("m", 1000, 0.5)  # 2,000 tok/s: weight 0.3
    assert r.predict("m", 1300).native_s == pytest.approx(1300 / 1300.0)
    for bad in (0.0, -1.0, float("nan")):
        r.observe_native("m", 1000, bad)
    r.observe_bridge(0, 1000, float("inf"), 0.1, 1)
    assert r.snapshot()["native"]["m"]["samples"] == 2 and r.snapshot()["prefill_hosts"][0]["samples"] == 0


def test_the_queue_is_read_from_vllms_metrics():
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting_by_reason{reason="x"} 9.0
vllm:gpu_cache_usage_perc 0.5
"""
    assert rates.parse_queue(text) == 6
    assert rates.parse_queue("no metrics here") is None


def test_the_bridge_decides_natively_from_rates_and_says_why():
    cfg = config.from_env({"PD_BRIDGE_PREFILL_URL": "http://a:1,http://b:2", "PD_BRIDGE_TOKEN": "t"})
    assert cfg.decide == "rates" and cfg.rate_max_age_s == 600.0
    assert config.from_env({"PD_BRIDGE_PREFILL_URL": "http://a:1", "PD_BRIDGE_TOKEN": "t", "PD_BRIDGE_DECIDE": "thresholds"}).decide == "thresholds"
    with pytest.raises(config.BridgeConfigError, match="PD_BRIDGE_DECIDE"):
        config.from_env({"PD_BRIDGE_PREFILL_URL": "http://a:1", "PD_BRIDGE_TOKEN": "t", "PD_BRIDGE_DECIDE": "sometimes"})
    b = Bridge(cfg)
    b.rates.observe_bridge(0, 4096, 4.096, 0.2, 1)  # 1,000 tok/s
    b.rates.observe_bridge(1, 4096, 1.024, 0.2, 1)  # 4,000 tok/s
    # The host with the lowest prediction first, whatever the configured order.
    p = b.rates.predict("m", 8000, b._host_loads())
    assert b._take_host(set(), p.bridged_s) == 1 and b._take_host({1}, p.bridged_s) == 0
    b._charge(0, -1)
    b._charge(1, -1)
    st = b.public_status()
    assert st["decide"] == "rates" and st["rates"]["prefill_hosts"][1]["bridge_tok_s"] == 4000.0
    assert "a:1" not in str(st) and "b:2" not in str(st)


class _SlowMetrics(http.server.ThreadingHTTPServer):
    """vLLM's /metrics as a host too busy to answer: each read is held until ``gate`` opens."""

    daemon_threads = True

    def __init__(self, queue: int) -> None:
        self.gate = threading.Event()
        self.reads = 0
        self.lock = threading.Lock()
        text = f"vllm:num_requests_running{{engine=\"0\"}} {queue}.0\nvllm:num_requests_waiting{{engine=\"0\"}} 0.0\n".encode()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                with server.lock:
                    server.reads += 1
                server.gate.wait(30)
                self.send_response(200)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_a_queue_read_that_answers_late_still_lands_and_reads_never_pile_up():
    srv = _SlowMetrics(queue=4)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        b = Bridge(config.from_env({"PD_BRIDGE_PREFILL_URL": f"http://127.0.0.1:{srv.server_port}", "PD_BRIDGE_TOKEN": "t"}))
        # The decision waits its deadline (the host is held past it) and goes on without a reading.
        asyncio.run(b._read_queues())
        pending = b._queue_reads()
        assert len(pending) == 1 and not pending[0].done()
        assert b.rates.snapshot()["prefill_hosts"][0]["queue"] is None
        # A status request (or the next decision) meanwhile awaits that read, never a second one.
        b.refresh_queues()
        assert b._queue_reads()[0] is pending[0]
        # The host answers at last: its queue lands for the next decision.
        srv.gate.set()
        pending[0].result(30)
        assert b.rates.snapshot()["prefill_hosts"][0]["queue"] == 4 and srv.reads == 1
        fresh = b._queue_reads()[0]
        assert fresh is not pending[0]
        fresh.result(30)
        assert srv.reads == 2
    finally:
        srv.shutdown()
