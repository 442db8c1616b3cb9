"""A prefill host that stopped: for the isolation test and benchmark (tests/decode/test_isolation.py,
tests/bench_isolation.py).

It stands for a vLLM whose engine stopped after its API server answered: ``/health``,
``/v1/models`` and ``/version`` answer, every ``/v1/completions`` request is read and never
answered, and the segment port accepts connections and never sends a byte, until ``release()``
closes them all (the bridges then see their connections end). Loopback only.
"""

from __future__ import annotations

import json
import socket
import threading


class StalledPrefillHost:
    """An HTTP listener that answers vLLM's health and model routes and holds every completion
    request unanswered, and a segment port that accepts and stays silent, until ``release()``."""

    def __init__(self) -> None:
        self.http = socket.create_server(("127.0.0.1", 0))
        self.segments = socket.create_server(("127.0.0.1", 0))
        self.held: list[socket.socket] = []
        self.completions = threading.Semaphore(0)  # one release per completion request held
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for listener, serve in ((self.http, self._serve_http), (self.segments, self._hold)):
            threading.Thread(target=self._accept, args=(listener, serve), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.getsockname()[1]}"

    @property
    def segments_address(self) -> str:
        return f"127.0.0.1:{self.segments.getsockname()[1]}"

    def _accept(self, listener, serve) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        with self._lock:
            if self._stop.is_set():
                conn.close()
                return
            self.held.append(conn)

    def _serve_http(self, conn: socket.socket) -> None:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                chunk = conn.recv(65536)
                if not chunk:
                    conn.close()
                    return
                buf += chunk
            head, _, rest = buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ")[:2]
            length = next((int(h.split(":", 1)[1]) for h in lines[1:] if h.lower().startswith("content-length:")), 0)
            while len(rest) < length:
                rest += conn.recv(65536)
            buf = rest[length:]
            if path == "/v1/completions":
                self._hold(conn)
                self.completions.release()
                return
            body = {"/health": {}, "/v1/models": {"data": [{"id": "stalled"}]}, "/version": {"version": "stalled"}}.get(path)
            status = "200 OK" if body is not None else "404 Not Found"
            payload = json.dumps(body if body is not None else {"detail": "no such route"}).encode()
            conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)

    def release(self) -> None:
        with self._lock:
            self._stop.set()
            for conn in self.held:
                conn.close()
            self.held.clear()
        self.http.close()
        self.segments.close()
