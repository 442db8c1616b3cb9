"""The prefill host's segment server through the vLLM wheel: a capture is kept only until it is
pulled and sealed (plus a grace), within a memory bound; only the decode host holding its secret
pulls it; a capture nobody will read tells the connector so, and the connector's spec demands
the secret. Real captures of a tiny MLA model; the decode side is pd_bridge_omlx's own client."""

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engines  # noqa: E402
import tiny_mla_hf  # noqa: E402

pd_bridge_vllm = engines.require("pd_bridge_vllm")
BLOCK = 256
SECRET = "5e" * 32


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    _hf, mlx = tiny_mla_hf.build(tmp_path_factory.mktemp("wire-model"))
    return mlx, pd_bridge_vllm.Weights.load(str(mlx))


def fed(w, server, rid, ids, secret=SECRET, seal=True):
    import numpy as np

    cap = pd_bridge_vllm.Capture(w, rid, len(ids), BLOCK, server, None, secret, pd_bridge_vllm.prompt_digest(ids))
    x = np.random.default_rng(1).standard_normal((len(ids), w.hidden_size), dtype=np.float32)
    for layer in range(w.num_layers):
        cap.feed(layer, 0, (x.view(np.uint32) >> 16).astype(np.uint16))
    if seal:
        assert json.loads(cap.seal())["verdict"] == "complete"
    return cap


def wait(what, f, limit=10.0):
    t0 = time.monotonic()
    while not f():
        assert time.monotonic() - t0 < limit, what
        time.sleep(0.05)


def test_a_capture_nobody_pulls_is_freed_after_the_grace(weights):
    _, w = weights
    server = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"tok", grace_seconds=1.0)
    caps = [fed(w, server, f"never-{i}", list(range(2 * BLOCK))) for i in range(3)]
    assert server.outboxes >= 1 and server.queued_bytes > 0  # the last one, at least, within its grace
    wait("the unpulled captures are freed", lambda: server.outboxes == 0)
    assert server.queued_bytes == 0
    for c in caps:
        assert "not pulled within" in c.stream_closed, c.stream_closed


def test_the_memory_bound_drops_the_oldest_unpulled_capture(weights):
    _, w = weights
    probe = fed(w, pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"tok"), "probe", list(range(2 * BLOCK)), seal=False)
    one = probe.segment_bytes  # about two segments' bytes
    server = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"tok", memory_bytes=int(one * 1.5))
    old = fed(w, server, "old", list(range(2 * BLOCK)), seal=False)
    new = fed(w, server, "new", list(range(2 * BLOCK)), seal=False)
    assert old.stream_closed is not None and "memory bound" in old.stream_closed, old.stream_closed
    assert new.stream_closed is None
    assert server.queued_bytes <= one * 1.5


def test_a_capture_whose_stream_was_dropped_seals_aborted_with_why(weights):
    """A capture the server gave up (here: the memory bound) never reached its decode host, so its
    verdict is not `complete`, however far it computed."""
    _, w = weights
    probe = fed(w, pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"tok"), "probe", list(range(2 * BLOCK)), seal=False)
    server = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"tok", memory_bytes=int(probe.segment_bytes * 1.5))
    old = fed(w, server, "old", list(range(2 * BLOCK)), seal=False)
    new = fed(w, server, "new", list(range(2 * BLOCK)), seal=False)
    verdict = json.loads(old.seal())
    assert verdict["verdict"] == "aborted" and "segment stream closed" in verdict["reason"] and "memory bound" in verdict["reason"], verdict
    assert json.loads(new.seal())["verdict"] == "complete"


def test_only_the_secret_holder_pulls_and_then_nothing_is_held(weights, tmp_path):
    mlx, w = weights
    omlx = pytest.importorskip("pd_bridge_omlx")
    ids = list(range(2 * BLOCK))
    server = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"tok")
    cap = fed(w, server, "mine", ids)
    writer = lambda d: omlx.BlockWriter(str(tmp_path / d), "m", BLOCK, ids)  # noqa: E731
    with pytest.raises(omlx.AuthError, match="refused"):
        omlx.ingest("127.0.0.1", server.port, b"tok", "mine", w.fingerprint, writer("thief"), timeout_seconds=10.0, secret=omlx.capture_secret(), token_ids=ids)
    assert not list((tmp_path / "thief").rglob("*.safetensors"))
    with pytest.raises(omlx.AuthError, match="refused"):
        omlx.ingest("127.0.0.1", server.port, b"tok", "mine", w.fingerprint, writer("other-prompt"), timeout_seconds=10.0, secret=SECRET, token_ids=ids[::-1])
    n, verdict = omlx.ingest("127.0.0.1", server.port, b"tok", "mine", w.fingerprint, writer("owner"), timeout_seconds=10.0, secret=SECRET, token_ids=ids)
    assert n == 2 and json.loads(verdict)["verdict"] == "complete"
    wait("the sent capture is dropped", lambda: server.outboxes == 0)
    assert server.queued_bytes == 0 and cap.stream_closed is None


def test_the_connector_demands_a_secret_and_never_shows_it():
    from pd_bridge_vllm.connector import CaptureSpec, CaptureSpecError

    with pytest.raises(CaptureSpecError, match="secret is missing"):
        CaptureSpec.parse({"pd_capture": {"request_id": "r", "block_size": 256}})
    with pytest.raises(CaptureSpecError, match="64 hex digits"):
        CaptureSpec.parse({"pd_capture": {"request_id": "r", "block_size": 256, "secret": "short"}})
    spec = CaptureSpec.parse({"pd_capture": {"request_id": "r", "block_size": 256, "secret": SECRET}})
    assert spec.secret == SECRET and SECRET not in repr(spec)
    # Data parallelism: the rank the decode host pulls from; anything but a non-negative int is refused.
    assert spec.dp_rank is None
    assert CaptureSpec.parse({"pd_capture": {"request_id": "r", "block_size": 256, "secret": SECRET, "dp_rank": 1}}).dp_rank == 1
    for bad in (-1, True, "1", 1.0):
        with pytest.raises(CaptureSpecError, match="dp_rank must be a non-negative integer"):
            CaptureSpec.parse({"pd_capture": {"request_id": "r", "block_size": 256, "secret": SECRET, "dp_rank": bad}})


def test_the_segment_server_binds_loopback_unless_told(monkeypatch):
    from pd_bridge_vllm.connector import worker

    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "m"])
    assert worker._default_address() == "127.0.0.1"
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "m", "--host", "0.0.0.0"])
    assert worker._default_address() == "127.0.0.1"
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "m", "--host=10.1.2.3"])
    assert worker._default_address() == "10.1.2.3"
