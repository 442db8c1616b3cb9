#!/usr/bin/env python3
"""The GPU host for real: a CUDA vLLM (0.26.0, the vLLM CUDA kit) with pd-bridge-vllm's plugin and
connector capturing inside the engine, the tap feeding CUDA descriptors to the GPU capture.

    python3 tests/gpu/vllm_capture.py OUT [--family mla,v4] [--chunk 1024]

For each family — a tiny DeepSeek-V3-style MLA model (``tests/prefill/tiny_mla_hf.py`` with the
head dims FA3 takes on Hopper: 128/64/128) and a tiny DeepSeek-V4 (``tiny_v4_fp8.py``: FP8
block-quantized, fp8 KV cache, FlashMLA sparse), each generated from ONE set of weights for vLLM's
checkpoint and the decoder's MLX-named weights dir — one engine (its own process) serves two
concurrent captured prompts of 3,000 and 2,600 tokens, prefilled over several chunks
(``max_num_batched_tokens`` = ``--chunk``, the two requests sharing steps), with
``PD_BRIDGE_GPU_GEMM=exact``. The connector's test-only dump records the attention inputs the tap
fed. Then, here:

1. every layer was fed every prompt row exactly once, over more than one step;
2. each capture sealed ``complete`` exactly once (its verdict file has one line);
3. the segments the engine streamed (pulled over the authenticated segment port, recorded as
   files) are byte-identical to what the CPU reference (``Capture.feed``, host rows) computes
   from the same attention inputs;
4. tensor cores (the default GEMM): the same inputs through the GPU path with CUDA tensors,
   compared with the CPU reference value by value: the fraction of bf16 values bit-identical
   and the largest difference in ulps;
5. the capture's figures reached vLLM's metrics (``vllm:pd_bridge_*`` from ``LLM.get_metrics()``,
   what ``/metrics`` serves): 2 complete captures, their blocks and bytes.

``OUT`` gets ``result.json`` (every figure), ``<family>-a.pdbw`` (the first request's segment
stream as the connector served it, split into ``<family>-a.2.pdbw`` ... past 15 MiB), ``<family>-model.tar`` (its prompt ids and the decoder
weights dir) — both for ``tests/gpu/ingest_streams.py`` on the decode side — and the engine logs. Exit 0 when every check
passes. Needs a CUDA GPU and vLLM 0.26.0 with pd_bridge_vllm installed (the kit: see README).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "prefill"))
TOKEN = b"gpu-test-token"
BLOCK = 256
PROMPTS = {"a": (3000, 11), "b": (2600, 12)}  # capture id suffix -> (prompt tokens, seed)
FRAME = struct.Struct("<4sBBHIQ")  # core/src/wire.rs: magic, version, kind, 0, crc32, len
CHALLENGE, HELLO, SEGMENT, SEAL, ERROR = 1, 2, 3, 4, 5


# ---------------------------------------------------------------------------------- the wire


def _recv(sock, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        b = sock.recv(n - len(buf))
        if not b:
            raise ConnectionError(f"stream ended after {len(buf)} of {n} bytes")
        buf += b
    return bytes(buf)


def read_frame(sock) -> tuple[int, bytes, bytes]:
    head = _recv(sock, FRAME.size)
    magic, ver, kind, _, crc, n = FRAME.unpack(head)
    assert magic == b"PDBW" and ver == 1, head
    payload = _recv(sock, n)
    assert zlib.crc32(payload) == crc, "frame checksum mismatch"
    return kind, head, payload


def frame(kind: int, payload: bytes) -> bytes:
    return FRAME.pack(b"PDBW", 1, kind, 0, zlib.crc32(payload), len(payload)) + payload


def record(port: int, rid: str, token: bytes = TOKEN, timeout: float = 120.0) -> list[tuple[int, bytes]]:
    """Pull ``rid``'s stream as the decode host does (challenge-response on the token); return
    its frames after the hello: segments, then the seal."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        kind, _, nonce = read_frame(s)
        assert kind == CHALLENGE and len(nonce) == 32
        mac = hmac.new(token, nonce + rid.encode(), hashlib.sha256).hexdigest()
        s.sendall(frame(HELLO, json.dumps({"request_id": rid, "mac": mac}).encode()))
        out = []
        while True:
            kind, _, payload = read_frame(s)
            out.append((kind, payload))
            if kind == ERROR:
                raise RuntimeError(f"{rid}: server error: {payload.decode(errors='replace')}")
            if kind == SEAL:
                return out


def segment_arrays(payload: bytes):
    """(header, [bf16 bit patterns as uint16 arrays]) of one segment payload."""
    import numpy as np

    n = int.from_bytes(payload[:4], "little")
    header = json.loads(payload[4 : 4 + n])
    body = np.frombuffer(payload[4 + n :], dtype=np.uint16)
    arrays, at = [], 0
    for layer in header["layers"]:
        for a in layer["arrays"]:
            k = a["rows"] * a["width"]
            arrays.append(body[at : at + k])
            at += k
    assert at == body.size
    return header, arrays


def ulp_compare(ref: list[tuple[int, bytes]], got: list[tuple[int, bytes]]) -> dict:
    """Value-by-value comparison of two streams' segments (bf16): identical fraction, max ulps."""
    import numpy as np

    total = same = 0
    worst = 0
    hist = {}
    for (k1, p1), (k2, p2) in zip(ref, got):
        if k1 != SEGMENT:
            continue
        h1, a1 = segment_arrays(p1)
        h2, a2 = segment_arrays(p2)
        assert h1 == h2, (h1, h2)
        for x, y in zip(a1, a2):
            # ordered integer view of bf16 (sign-magnitude -> two's complement order)
            def key(u):
                v = u.astype(np.int32)
                return np.where(v & 0x8000, 0x8000 - v, v)

            d = np.abs(key(x) - key(y))
            total += d.size
            same += int((x == y).sum())
            worst = max(worst, int(d.max()) if d.size else 0)
            for b, c in zip(*np.unique(np.minimum(d, 4), return_counts=True)):
                hist[int(b)] = hist.get(int(b), 0) + int(c)
    return {"values": total, "identical": same, "identical_fraction": same / total if total else 1.0, "max_ulp": worst,
            "ulp_histogram": {("%d" % k if k < 4 else ">=4"): v for k, v in sorted(hist.items())}}


# ---------------------------------------------------------------------------------- the engine (child process)


def prompt_ids(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(2, 1000) for _ in range(n)]


def build_models(family: str, out: Path) -> tuple[Path, Path]:
    if family == "mla":
        import tiny_mla_hf

        # FA3 (the only MLA prefill backend on Hopper) takes (qk_nope, qk_rope, v) = (128, 64, 128).
        tiny_mla_hf.CONFIG.update(qk_nope_head_dim=128, v_head_dim=128)
        return tiny_mla_hf.build(out)
    import tiny_v4_fp8

    return tiny_v4_fp8.build(out)


def engine(family: str, work: Path, chunk: int) -> None:
    spec = json.loads((work / "spec.json").read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = dict(
        model=spec["hf"], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
        max_model_len=8192, max_num_batched_tokens=chunk, max_num_seqs=4, kv_cache_memory_bytes=4 << 30, gpu_memory_utilization=0.5, seed=0,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdBridgeConnector", kv_connector_module_path="pd_bridge_vllm.connector", kv_role="kv_producer",
            kv_connector_extra_config={"weights": spec["mlx"], "port": spec["port"], "token": TOKEN.decode(), "address": "127.0.0.1"},
        ),
    )
    if family == "v4":
        kw["kv_cache_dtype"] = "fp8"  # FlashMLA's fp8_ds_mla cache: the only sm_90 V4 path
    t0 = time.monotonic()
    llm = LLM(**kw)
    t_start = time.monotonic() - t0
    ids = {k: prompt_ids(n, seed) for k, (n, seed) in PROMPTS.items()}
    sps = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False,
                          extra_args={"kv_transfer_params": {"pd_capture": {"request_id": f"{family}-{k}", "block_size": BLOCK}}}) for k in ids]
    t1 = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=v) for v in ids.values()], sps, use_tqdm=False)  # one call: concurrent
    t_gen = time.monotonic() - t1
    streams = {}
    for k in ids:
        rid = f"{family}-{k}"
        frames = record(spec["port"], rid)
        (work / f"{rid}.pdbw").write_bytes(b"".join(frame(kd, p) for kd, p in frames))
        streams[rid] = {"segments": sum(kd == SEGMENT for kd, _ in frames), "seal": json.loads(frames[-1][1]),
                        "wire_bytes": sum(FRAME.size + len(p) for kd, p in frames if kd == SEGMENT)}
    # One more (uncaptured) step carries the last seals' stats to the frontend's loggers.
    time.sleep(1.0)
    llm.generate([TokensPrompt(prompt_token_ids=prompt_ids(16, 3))], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    metrics = {}
    for m in llm.get_metrics():
        if "pd_bridge" in m.name:
            val = getattr(m, "value", None)
            if val is None and hasattr(m, "count"):
                val = {"count": m.count, "sum": getattr(m, "sum", None)}
            metrics[m.name + json.dumps(dict(sorted(m.labels.items())), sort_keys=True)] = val
    res = {"engine_start_s": round(t_start, 2), "generate_s": round(t_gen, 3), "ids": ids, "streams": streams, "metrics": metrics,
           "outputs": {f"{family}-{k}": {"tokens": list(o.outputs[0].token_ids), "kv_transfer_params": o.kv_transfer_params} for k, o in zip(ids, outs)}}
    (work / "engine.json").write_text(json.dumps(res))


# ---------------------------------------------------------------------------------- the checks (parent process)


def fed_chunks(dump: Path, rid: str) -> dict[int, list[tuple[int, bytes]]]:
    got: dict[int, list[tuple[int, bytes]]] = {}
    for f in dump.glob(f"{rid}.L*.S*.in.bin"):
        _, L, S, *_ = f.name[len(rid) :].split(".")
        got.setdefault(int(L[1:]), []).append((int(S[1:]), f.read_bytes()))
    return {k: sorted(v) for k, v in got.items()}


def check_family(family: str, work: Path, out: Path, chunk: int) -> dict:
    import numpy as np
    import torch

    import pd_bridge_vllm

    res: dict = {"family": family, "chunk": chunk, "checks": {}}
    ok = res["checks"]
    hf, mlx = build_models(family, work / "model")
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    (work / "spec.json").write_text(json.dumps({"hf": str(hf), "mlx": str(mlx), "port": free}))
    env = dict(os.environ, PD_BRIDGE_VLLM="1", PD_BRIDGE_VLLM_DUMP_DIR=str(work / "dump"), PD_BRIDGE_GPU_GEMM="exact",
               VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_DEEP_GEMM_WARMUP="skip", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    t = time.monotonic()
    with open(out / f"{family}-engine.log", "w") as log:
        p = subprocess.run([sys.executable, __file__, "--engine", family, str(work), "--chunk", str(chunk)], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=int(os.environ.get("PD_BRIDGE_GPU_ENGINE_TIMEOUT", "420")))
    res["engine_wall_s"] = round(time.monotonic() - t, 1)
    logtext = (out / f"{family}-engine.log").read_text(errors="replace")
    if p.returncode != 0 or not (work / "engine.json").exists():
        res["error"] = f"engine rc {p.returncode}: " + logtext[-4000:]
        return res
    eng = json.loads((work / "engine.json").read_text())
    res.update({k: eng[k] for k in ("engine_start_s", "generate_s", "streams", "metrics", "outputs")})
    ok["tap_and_connector_loaded"] = "model tap installed" in logtext and "capturing with weights" in logtext and "NOT installed" not in logtext
    w = pd_bridge_vllm.Weights.load(str(mlx))
    dump = work / "dump"
    steps, exact, tensor = {}, {}, {}
    for k, (n, _) in PROMPTS.items():
        rid = f"{family}-{k}"
        fed = fed_chunks(dump, rid)
        # 1. every layer fed every row once, in order, over several steps
        tiled = sorted(fed) == list(range(w.num_layers))
        for layer, chunks in fed.items():
            at = 0
            for s, b in chunks:
                tiled &= s == at and len(b) % (w.hidden_size * 2) == 0
                at += len(b) // (w.hidden_size * 2)
            tiled &= at == n
        steps[rid] = [(s, len(b) // (w.hidden_size * 2)) for s, b in fed.get(0, [])]
        ok[f"{rid}: every layer fed every prompt row once"] = bool(tiled)
        ok[f"{rid}: prefilled over several steps"] = len(steps[rid]) > 1
        # 2. sealed complete exactly once
        vf = dump / f"{rid}.verdict.json"
        verdicts = [json.loads(line) for line in vf.read_text().splitlines()] if vf.exists() else []
        want = {"verdict": "complete", "blocks": n // BLOCK, "tokens": n // BLOCK * BLOCK}
        ok[f"{rid}: sealed complete exactly once"] = verdicts == [want] and eng["streams"][rid]["seal"] == want
        # 3. the engine's stream == the CPU reference from the same inputs
        engine_frames = []
        raw = (work / f"{rid}.pdbw").read_bytes()
        at = 0
        while at < len(raw):
            _, _, _, _, _, ln = FRAME.unpack(raw[at : at + FRAME.size])
            engine_frames.append((raw[at + 5], raw[at + FRAME.size : at + FRAME.size + ln]))
            at += FRAME.size + ln
        srv = pd_bridge_vllm.SegmentServer("127.0.0.1:0", TOKEN)
        cpu = pd_bridge_vllm.Capture(w, rid, n, BLOCK, srv)
        for layer in sorted(fed):
            for s, b in fed[layer]:
                cpu.feed(layer, s, b)
        cpu.seal()
        ref = record(srv.port, rid)
        exact[rid] = {"segments": sum(kd == SEGMENT for kd, _ in ref), "byte_identical": ref == engine_frames}
        if ref != engine_frames:
            exact[rid]["values"] = ulp_compare(ref, engine_frames)
        ok[f"{rid}: in-engine GPU capture (exact GEMM) == CPU reference, bit for bit"] = ref == engine_frames
        # 4. tensor cores: the same inputs as CUDA tensors through the GPU path, default GEMM
        srv2 = pd_bridge_vllm.SegmentServer("127.0.0.1:0", TOKEN)
        gpu = pd_bridge_vllm.Capture(w, rid, n, BLOCK, srv2)
        dev = torch.device("cuda", 0)
        keep = []
        for s, _ in fed[0]:  # the engine's chunking: chunk by chunk, every layer
            for layer in sorted(fed):
                b = dict(fed[layer])[s]
                x = torch.from_numpy(np.frombuffer(b, dtype=np.int16).copy()).view(torch.bfloat16).reshape(-1, w.hidden_size).to(dev)
                cur = torch.cuda.current_stream(dev)
                gpu.feed_cuda(layer, s, x.data_ptr(), x.numel() * x.element_size(), "bfloat16", 0, cur.cuda_stream)
                keep.append(x)
        gpu.seal()
        del keep
        tensor[rid] = ulp_compare(ref, record(srv2.port, rid))
        # bytes on the wire as the connector counts them
        exact[rid]["wire_bytes"] = eng["streams"][rid]["wire_bytes"]
        exact[rid]["bytes_per_token"] = round(eng["streams"][rid]["wire_bytes"] / (n // BLOCK * BLOCK), 1)
    res["steps_layer0"] = steps
    res["exact_gemm"] = exact
    res["tensor_cores"] = tensor
    # 5. the stats reached vLLM's metrics
    m = eng["metrics"]

    def metric(name, **labels):
        for key, v in m.items():
            if key.startswith(name + "{") and all(f'"{a}": "{b}"' in key for a, b in labels.items()):
                return v
        return None

    blocks = sum(n // BLOCK for n, _ in PROMPTS.values())
    wire = sum(e["wire_bytes"] for e in exact.values())
    ok["metrics: vllm:pd_bridge_captures{verdict=complete} == 2"] = metric("vllm:pd_bridge_captures", verdict="complete") == 2
    ok[f"metrics: vllm:pd_bridge_blocks == {blocks}"] = metric("vllm:pd_bridge_blocks") == blocks
    ok[f"metrics: vllm:pd_bridge_bytes == {wire}"] = metric("vllm:pd_bridge_bytes") == wire
    ok["metrics: vllm:pd_bridge_aborts == 0"] = metric("vllm:pd_bridge_aborts") in (0, 0.0)
    lat = metric("vllm:pd_bridge_seal_latency_seconds")
    ok["metrics: seal latency histogram has 2 observations"] = isinstance(lat, dict) and lat.get("count") == 2
    res["seal_latency"] = lat
    for line in logtext.splitlines():
        if "sealed:" in line and "after the step's forward" in line:
            res.setdefault("seal_log", []).append(line.split("pd-bridge: ", 1)[-1][:200])
    # the streams of the first request (+ ids, decoder weights) for ingest on the decode side
    rid = f"{family}-a"
    (work / f"{rid}.ids.json").write_text(json.dumps(eng["ids"]["a"]))
    # Files come back from the device in pieces of at most 16 MiB: split at frame boundaries
    # (``<rid>.pdbw``, ``<rid>.2.pdbw`` ...; ingest_streams.py joins them in order).
    raw, parts, at, start = (work / f"{rid}.pdbw").read_bytes(), [], 0, 0
    while at < len(raw):
        ln = FRAME.size + FRAME.unpack(raw[at : at + FRAME.size])[5]
        if at + ln - start > 15 << 20 and at > start:
            parts.append(raw[start:at])
            start = at
        at += ln
    parts.append(raw[start:])
    for i, part in enumerate(parts):
        (out / (f"{rid}.pdbw" if i == 0 else f"{rid}.{i + 1}.pdbw")).write_bytes(part)
    with tarfile.open(out / f"{family}-model.tar", "w") as tf:
        tf.add(work / f"{rid}.ids.json", arcname=f"{rid}.ids.json")
        tf.add(mlx, arcname=f"{family}-mlx")
    res["stream_files"] = len(parts)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--family", default="mla,v4")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--engine", nargs=2, metavar=("FAMILY", "WORK"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        engine(a.engine[0], Path(a.engine[1]), a.chunk)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    results, rc = [], 0
    for family in a.family.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"pdb-gpu-{family}-"))
        try:
            r = check_family(family, work, out, a.chunk)
        except Exception as e:  # report, go on with the next family
            import traceback

            r = {"family": family, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        passed = "error" not in r and all(r["checks"].values())
        r["passed"] = passed
        rc |= 0 if passed else 1
        results.append(r)
        (out / "result.json").write_text(json.dumps(results, indent=1))
        print(json.dumps({k: r.get(k) for k in ("family", "passed", "error", "checks", "engine_start_s", "generate_s", "steps_layer0", "exact_gemm", "tensor_cores", "seal_latency")}, indent=1), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
