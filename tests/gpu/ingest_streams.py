#!/usr/bin/env python3
"""Decode side of tests/gpu/vllm_capture.py: ingest the segment streams recorded on the GPU host.

    python3 tests/gpu/ingest_streams.py STREAM.pdbw MODEL_TAR CACHE_DIR [--omlx-format F] [--model-name M]

``STREAM.pdbw`` is ``<rid>.pdbw`` (the stream as the GPU host's connector served it: segment
frames, then the seal; continued in ``<rid>.2.pdbw`` ... beside it when it was split); the tar holds ``<rid>.ids.json`` (the prompt's token ids) and
``<family>-mlx`` (the decoder weights the capture used). A local server replays the stream behind the same challenge-response
the connector's segment port speaks, and ``pd_bridge_omlx.ingest`` — the decode host's own client
— checks it (request id, fingerprint, order, checksums) and writes oMLX block files, each then
validated with ``inspect_block``. Prints the blocks written and the seal as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tarfile
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_capture import CHALLENGE, HELLO, TOKEN, frame, read_frame  # noqa: E402


def serve_once(raw: bytes) -> int:
    """Serve ``raw`` (recorded frames) to one client after its hello; returns the port."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run():
        c, _ = srv.accept()
        with c:
            c.sendall(frame(CHALLENGE, os.urandom(32)))
            kind, _, _ = read_frame(c)
            assert kind == HELLO
            c.sendall(raw)
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("stream")
    ap.add_argument("tar")
    ap.add_argument("cache_dir")
    ap.add_argument("--omlx-format", default=None)
    ap.add_argument("--model-name", default="tiny")
    ap.add_argument("--block-size", type=int, default=256)
    a = ap.parse_args()
    import pd_bridge_omlx

    work = Path(tempfile.mkdtemp(prefix="pdb-ingest-"))
    with tarfile.open(a.tar) as tf:
        tf.extractall(work)
    mlx = next(p for p in work.iterdir() if p.name.endswith("-mlx"))
    w = pd_bridge_omlx.Weights.load(str(mlx))
    out = {}
    for stream in [Path(a.stream)]:
        rid = stream.stem
        ids = json.loads((work / f"{rid}.ids.json").read_text())
        pieces = [stream] + sorted(stream.parent.glob(f"{rid}.*.pdbw"), key=lambda f: int(f.name.split(".")[-2]))
        port = serve_once(b"".join(f.read_bytes() for f in pieces))
        writer = pd_bridge_omlx.BlockWriter(str(Path(a.cache_dir) / rid), a.model_name, a.block_size, ids, a.omlx_format)
        n, verdict = pd_bridge_omlx.ingest("127.0.0.1", port, TOKEN, rid, w.fingerprint, writer, timeout_seconds=60.0)
        writer.flush()
        files = sorted((Path(a.cache_dir) / rid).rglob("*.safetensors"))
        checked = [pd_bridge_omlx.inspect_block(str(f), a.model_name, w.num_layers, a.block_size, writer.omlx_format)[1] for f in files]
        out[rid] = {"blocks": n, "verdict": json.loads(verdict), "files": len(files), "tokens_validated": sum(checked), "fingerprint": w.fingerprint}
    print(json.dumps(out, indent=1))
    return 0 if out and all(v["verdict"]["verdict"] == "complete" and v["files"] == v["blocks"] for v in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
