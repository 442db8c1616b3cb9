"""The decode host's client of vLLM's OpenAI server against hostile answers, over real loopback.

A fake or broken prefill host must never hold a user's request: a host that trickles its answer a
byte at a time (each read well inside httpx's read timeout) is given up at the whole-answer
deadline, and answers that are JSON but not what vLLM sends (a list, a model list of garbage, a
flood) are refused naming what was wrong. Each is a ``PrefillUnavailable``, which the bridge turns
into a ``declined`` verdict while oMLX prefills natively.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

import engines  # noqa: E402  (tests/ is on the path: conftest)

engines.require("pd_bridge_omlx", "omlx")
engines.require("httpx")

from pd_bridge_omlx import config  # noqa: E402
from pd_bridge_omlx.bridge import PrefillHost, PrefillUnavailable  # noqa: E402


class FakeHost:
    """An HTTP/1.1 server on loopback answering every request with ``answer(path)``: a list of
    (bytes, seconds to wait before sending them). Stops when closed."""

    def __init__(self, answer):
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        with conn:
            conn.settimeout(5)
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    got = conn.recv(65536)
                    if not got:
                        return
                    head += got
                path = head.split(b" ", 2)[1].decode()
                for data, wait in self.answer(path):
                    if self.stop.wait(wait):
                        return
                    conn.sendall(data)
            except OSError:
                return

    def close(self):
        self.stop.set()
        self.sock.close()
        self.thread.join(timeout=5)


def json_answer(body: bytes) -> list[tuple[bytes, float]]:
    return [(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body, 0.0)]


@pytest.fixture
def host_for():
    made = []

    def make(answer) -> PrefillHost:
        fake = FakeHost(answer)
        made.append(fake)
        cfg = config.from_env({"PD_BRIDGE_PREFILL_URL": f"http://127.0.0.1:{fake.port}", "PD_BRIDGE_TOKEN": "s", "PD_BRIDGE_CONNECT_TIMEOUT_S": "2"})
        return PrefillHost(cfg)

    yield make
    for fake in made:
        fake.close()


def test_a_trickled_answer_is_given_up_at_the_whole_answer_deadline(host_for):
    body = b'{"status": "ok"}' + b" " * 200
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    # One byte every 0.5 s: each read is far inside the per-read timeout (3 s), the whole answer
    # would take ~100 s.
    host = host_for(lambda path: [(head, 0.0)] + [(body[i : i + 1], 0.5) for i in range(len(body))])
    t0 = time.monotonic()
    with pytest.raises(PrefillUnavailable, match=r"timed out: the answer took longer than 3s"):
        host.check_health()
    took = time.monotonic() - t0
    assert took < 10, f"the health check held the caller {took:.1f}s"


def test_json_that_is_not_what_vllm_sends_is_refused_naming_it(host_for):
    host = host_for(lambda path: json_answer(b"[1, 2, 3]"))
    with pytest.raises(PrefillUnavailable, match="JSON that is not an object"):
        host.check_health()
    for models in (b'{"data": "nope"}', b'{"data": [42]}', b'{"data": [{"id": 7}]}', b'{"data": []}'):
        host = host_for(lambda path, m=models: json_answer(m))
        with pytest.raises(PrefillUnavailable, match="lists no model"):
            host.model()
    host = host_for(lambda path: json_answer(json.dumps({"data": [{"id": "served-model"}]}).encode()))
    assert host.model() == "served-model"


def test_a_flood_is_cut_off(host_for):
    chunk = b" " * (1 << 16)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (64 * len(chunk))
    host = host_for(lambda path: [(head, 0.0)] + [(chunk, 0.0)] * 64)
    with pytest.raises(PrefillUnavailable, match="answered more than 1048576 bytes"):
        host.check_health()
