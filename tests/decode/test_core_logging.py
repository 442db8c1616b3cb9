"""The core's ``tracing`` events reach Python's ``logging``, with the request id, from both
wheels (pd-bridge-bindings' logging bridge), and only at the levels Python's loggers let through.

A real segment server (the vLLM wheel's) refuses a pull for a capture it does not have: the core
logs that on ``pd_bridge.core.segment_server`` with the request id, the decode side (the oMLX wheel's
``ingest``) gets a typed ``PdBridgeError``. Loading the decoder weights logs at DEBUG on
``pd_bridge.core.weights``. Records are handed to Python from the bindings' own thread, so the
test waits for them (bounded), and uses a later event as a barrier to show one that was filtered.
"""

from __future__ import annotations

import logging
import time

import pytest

import engines  # noqa: E402  (tests/ is on the path: conftest)

pd_bridge_omlx = engines.require("pd_bridge_omlx")
pd_bridge_vllm = engines.require("pd_bridge_vllm")

TOKEN = b"logging-test-secret"


def set_level(caplog, level: int) -> None:
    """Set pd-bridge's loggers to ``level``; the bindings re-read it at most every 100 ms
    (logging.rs REFRESH_MS), so the next call into a wheel after that uses it."""
    caplog.set_level(level, logger="pd_bridge")
    time.sleep(0.25)


def wait_for(caplog, match, timeout: float = 60.0) -> logging.LogRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in caplog.records:
            if match(r):
                return r
        time.sleep(0.05)
    raise AssertionError(f"no such record; got {[(r.name, r.levelname, r.getMessage()) for r in caplog.records]}")


def refused_pull(tmp_path, request_id: str) -> pd_bridge_omlx.PdBridgeError:
    """Ingest ``request_id`` from a real segment server that has no such capture."""
    server = pd_bridge_vllm.SegmentServer("127.0.0.1:0", TOKEN, queue_wait_seconds=0.5)
    writer = pd_bridge_omlx.BlockWriter(str(tmp_path / "cache"), "m", 16, list(range(64)), "upstream-0.6.3")
    with pytest.raises(pd_bridge_omlx.PdBridgeError) as err:
        pd_bridge_omlx.ingest("127.0.0.1", server.port, TOKEN, request_id, "sha256:" + "0" * 64, writer, timeout_seconds=30,
                              secret=pd_bridge_omlx._native.capture_secret(), token_ids=list(range(64)))  # fmt: skip
    return err.value


def test_a_core_error_reaches_logging_with_its_request_id(caplog, tmp_path):
    set_level(caplog, logging.DEBUG)
    rid = "log-req-refused-1"
    err = refused_pull(tmp_path, rid)
    assert type(err).__name__ in ("WireError", "AuthError"), repr(err)  # typed, not the bare base
    assert err.args[1] == 0  # (message, blocks written before the stream broke)
    r = wait_for(caplog, lambda r: r.name.startswith("pd_bridge.core.segment_server") and getattr(r, "request_id", None) == rid)
    assert r.levelno >= logging.WARNING, r
    assert r.getMessage().startswith(f"pd-bridge[{rid}]: "), r.getMessage()
    assert r.pathname.endswith(".rs") and r.lineno > 0  # the Rust source of the event
    assert isinstance(r.pd_bridge_fields, dict)


def test_both_wheels_forward_and_honour_the_level(caplog, tmp_path, models):
    model = str(models / "tiny-mla")
    loaded = lambda r: r.name == "pd_bridge.core.weights" and "decoder weights loaded" in r.getMessage()  # noqa: E731
    # DEBUG is off: the weights' debug event is dropped in Rust; a later warning from the same
    # wheel (the refused pull) arrives, so the dropped one would have arrived before it.
    set_level(caplog, logging.WARNING)
    pd_bridge_vllm.Weights.load(model)
    refused_pull(tmp_path, "log-req-barrier")
    wait_for(caplog, lambda r: getattr(r, "request_id", None) == "log-req-barrier")
    assert not any(loaded(r) for r in caplog.records)
    # DEBUG on: each wheel's own copy of the core forwards it, without a request id.
    set_level(caplog, logging.DEBUG)
    for wheel in (pd_bridge_vllm, pd_bridge_omlx):
        caplog.clear()
        wheel.Weights.load(model)
        r = wait_for(caplog, loaded)
        assert r.levelno == logging.DEBUG and r.request_id is None and "fingerprint" in r.pd_bridge_fields, r.__dict__


def test_both_wheels_raise_the_same_classes(models):
    shared = ("PdBridgeError", "ConfigError", "WeightsError", "InputError", "WireError", "AuthError", "DeviceError", "InternalError")
    for wheel in (pd_bridge_omlx, pd_bridge_vllm):
        native = wheel._native
        for name in shared:
            cls = getattr(native, name)
            # Owned by the wheel's module; an Exception (pyo3's PanicException is only a BaseException).
            assert cls.__module__ == native.__name__ and issubclass(cls, Exception), (wheel, name)
            assert issubclass(cls, native.PdBridgeError)
    with pytest.raises(pd_bridge_vllm._native.ConfigError, match="idle_seconds"):
        pd_bridge_vllm.SegmentServer("127.0.0.1:0", TOKEN, idle_seconds=-1.0)
    builder = pd_bridge_omlx.CacheBuilder(pd_bridge_omlx.Weights.load(str(models / "tiny-mla")), 16)
    with pytest.raises(pd_bridge_omlx._native.InputError, match="not a buffer"):
        builder.feed(0, 0, [1, 2])
