#!/usr/bin/env python3
"""Benchmark on the H200: vLLM's prefill with the capture on and off, DeepSeek-V4-Flash's attention.

    python3 tests/gpu/bench_vllm_flash.py OUT [--lengths 8192,32768,131072] [--reps 5] [--chunk 8192] [--compiled]

A random DeepSeek-V4 with Flash's attention shapes (``tiny_v4_fp8.FLASH_ATTENTION``: 43 layers,
hidden 4096, 64 heads of 512, index head 128, Flash's compress ratios; FP8 block weights) and a
MoE small enough to fit, made on the GPU. ONE vLLM 0.26.0 engine (its own process, the pd-bridge
plugin and connector loaded, prefix caching off, ``max_num_batched_tokens`` = ``--chunk``) serves
every run, so "on" and "off" differ only in whether the request carries ``pd_capture``: at each
length, ``--reps`` pairs, interleaved (off then on, then on then off, ...), one prompt at a time,
1 token generated. The engine is eager (``enforce_eager``) unless ``--compiled`` (vLLM's default:
torch.compile with piecewise CUDA graphs, the tap as a splitting op). An "on" run is pulled by
the decode host's own client (``pd_bridge_omlx.ingest``) into block files on local disk, as a Mac
would. Printed per run and summarised in ``OUT/bench.json``:

- prefill tokens/s (prompt tokens / wall time of the request); per length the medians of off and
  on, their ratio, the worst "on" run against the median "off", and the extra wall time of each
  "on" run over the "off" run of its pair (median and worst): a stall cannot hide in a best-of;
- per captured request, from the connector's seal log line: host time the capture took on vLLM's
  forward thread, the GPU engine's newly allocated buffers and its host time by phase, bytes
  (the connector fills its pools at engine start, for these blocks: its "ready for" line);
- seal latency: how long after the step that ran the prompt's last chunk the capture sealed (the
  connector's log line per capture);
- host RSS of the engine process and GPU memory in use after each run (flat in prompt length
  is the target: the capture holds one block per layer, not the prompt);
- bytes per token shipped (``vllm:pd_bridge_bytes`` per captured token).

The capture writes upstream oMLX 0.6.3's block format (``upstream-0.6.3``, what Mac users run;
pooled on the GPU like the fork's) unless ``--omlx-format`` says otherwise. Blocks are
``--block-size`` tokens (default 2,048, the decoder stepping that many tokens per call): the
fork's blocks hold the whole pool so far, and at 512 a 131,072-token prompt makes the decode
host's client write ~90 GB and fall behind, which is not what is measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TOKEN = b"bench-token"
# The decode host's per-request capture secret (pd_capture.secret), keying the encrypted stream.
SECRET = "5e" * 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_rss_bytes() -> int:
    """RSS of this process and its children (vLLM's engine core runs in a child)."""
    import psutil

    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)] if p.is_running())


def gpu_used_bytes() -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)


def metric(llm, name: str) -> float:
    """A counter's value summed over its label sets (engine, model)."""
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name and not hasattr(m, "count"))


def engine(a) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    import pd_bridge_omlx

    spec = json.loads((Path(a.work) / "spec.json").read_text())
    top = max(a.lengths)
    t0 = time.monotonic()
    llm = LLM(
        model=spec["hf"], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=not a.compiled, enable_prefix_caching=False,
        kv_cache_dtype="fp8", max_model_len=top + 1024, max_num_batched_tokens=a.chunk, max_num_seqs=2,
        gpu_memory_utilization=0.85, seed=0, disable_log_stats=False, **({"async_scheduling": False} if a.sync_scheduling else {}),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdBridgeConnector", kv_connector_module_path="pd_bridge_vllm.connector", kv_role="kv_producer",
            kv_connector_extra_config={"weights": spec["mlx"], "port": spec["port"], "token": TOKEN.decode(), "address": "127.0.0.1",
                                       # the bodies the connector pools at start are sized for these blocks
                                       "omlx_format": a.omlx_format, **({"block_size": a.block_size} if a.block_size else {})},
        ),
    )
    start_s = time.monotonic() - t0
    decoder = pd_bridge_omlx.Weights.load(spec["mlx"])
    block = a.block_size or pd_bridge_omlx.expected_block_size(decoder, a.omlx_format)
    rng = random.Random(0)
    runs, out = [], Path(a.out)

    def one(n: int, capture: bool, tag: str) -> dict:
        ids = [rng.randrange(2, 1000) for _ in range(n)]
        rid = f"bench-{tag}-{n}"
        params = {"pd_capture": {"request_id": rid, "block_size": block, "omlx_format": a.omlx_format, "secret": SECRET}} if capture else {}
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, extra_args={"kv_transfer_params": params} if params else None)
        pulled: dict = {}
        puller = None
        if capture:
            dest = Path(a.work) / "blocks" / rid

            def pull():
                try:
                    w = pd_bridge_omlx.BlockWriter(str(dest), "bench", block, ids, a.omlx_format)
                    n_blocks, seal = pd_bridge_omlx.ingest("127.0.0.1", spec["port"], TOKEN, rid, decoder.fingerprint, w, timeout_seconds=600.0, secret=SECRET, token_ids=ids)
                    w.flush()
                    pulled.update(blocks=n_blocks, seal=json.loads(seal), t_end=time.monotonic())
                except Exception as e:  # reported in the run's figures
                    pulled.update(error=f"{type(e).__name__}: {e}")

            puller = threading.Thread(target=pull, daemon=True)
            puller.start()
        b0 = metric(llm, "vllm:pd_bridge_bytes") or 0
        t = time.monotonic()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
        wall = time.monotonic() - t
        if puller is not None:
            puller.join(600)
        # Uncaptured steps carry the seal's stats to the frontend's loggers (the worker reports a
        # seal with a step after it): step until the counter moves, at most 10 (a capture whose
        # bytes never arrive reads 0 here, beside the seal line's figure).
        b1, stats_steps = b0, 0
        for stats_steps in range(1, 11 if capture else 2):
            time.sleep(0.2)
            llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
            b1 = metric(llm, "vllm:pd_bridge_bytes") or 0
            if b1 != b0:
                break
        r = {"rid": rid if capture else None, "tokens": n, "capture": capture, "wall_s": round(wall, 3), "tok_per_s": round(n / wall), "rss_gib": round(engine_rss_bytes() / 2**30, 2),
             "gpu_used_gib": round(gpu_used_bytes() / 2**30, 2)}
        if capture:
            r.update(pulled=pulled.get("blocks"), seal=pulled.get("seal"), error=pulled.get("error"), bytes=b1 - b0, stats_steps=stats_steps,
                     bytes_per_token=round((b1 - b0) / n, 1),
                     blocks_on_disk_gib=round(sum(f.stat().st_size for f in dest.rglob("*.safetensors")) / 2**30, 3))
            import shutil

            shutil.rmtree(dest, ignore_errors=True)  # the Mac's disk, not the GPU host's
        print(json.dumps(r), flush=True)
        return r

    one(min(a.lengths), False, "warm")  # first-use kernel compiles, both paths
    one(min(a.lengths), True, "warm")
    for n in a.lengths:
        for rep in range(a.reps):
            for capture in ((False, True) if rep % 2 == 0 else (True, False)):
                runs.append(dict(one(n, capture, f"{'on' if capture else 'off'}{rep}"), pair=rep))
    import statistics

    summary = {}
    for n in a.lengths:
        off = {r["pair"]: r for r in runs if r["tokens"] == n and not r["capture"]}
        on = {r["pair"]: r for r in runs if r["tokens"] == n and r["capture"]}
        off_med = statistics.median(r["tok_per_s"] for r in off.values())
        on_med = statistics.median(r["tok_per_s"] for r in on.values())
        extra = [round((on[k]["wall_s"] - off[k]["wall_s"]) * 1e3) for k in sorted(on) if k in off]
        summary[n] = {"off_tok_s_median": off_med, "on_tok_s_median": on_med, "on_off_median": round(on_med / off_med, 3),
                      "on_off_worst": round(min(r["tok_per_s"] for r in on.values()) / off_med, 3),
                      "extra_ms_median": statistics.median(extra), "extra_ms_worst": max(extra), "extra_ms": extra,
                      "runs": len(on)}
    # What vLLM's metrics hold for the bridge at the end, as read (the per-run bytes read-back has
    # been 0 while the seal line's bytes were not: this shows what the reader gets).
    seen = [(m.name, type(m).__name__, dict(m.labels), getattr(m, "value", None)) for m in llm.get_metrics() if "pd_bridge" in m.name]
    print("pd_bridge metrics at the end:", json.dumps(seen), flush=True)
    (out / "bench.json").write_text(json.dumps({"engine_start_s": round(start_s, 1), "compiled": a.compiled, "chunk": a.chunk, "omlx_format": a.omlx_format,
                                                "block_size": block, "runs": runs, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compiled", action="store_true", help="vLLM's default compilation (torch.compile + CUDA graphs) instead of eager")
    ap.add_argument("--sync-scheduling", action="store_true", help="vLLM's async scheduling off (the host runs no step ahead of the device)")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--omlx-format", default="upstream-0.6.3")
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--engine", metavar="WORK", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.lengths = [int(x) for x in str(a.lengths).split(",")]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.engine:
        a.work = a.engine
        engine(a)
        return 0
    import tempfile

    import tiny_v4_fp8

    work = Path(tempfile.mkdtemp(prefix="pdb-flash-"))
    t = time.monotonic()
    hf, mlx = tiny_v4_fp8.build(work / "model", overrides=tiny_v4_fp8.FLASH_ATTENTION, device="cuda")
    print(f"Flash-shaped checkpoint made in {time.monotonic() - t:.1f}s: {sum(f.stat().st_size for f in hf.iterdir()) / 2**30:.2f} GiB", flush=True)
    import torch

    torch.cuda.empty_cache()
    (work / "spec.json").write_text(json.dumps({"hf": str(hf), "mlx": str(mlx), "port": free_port()}))
    env = dict(os.environ, PD_BRIDGE_VLLM="1", VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_DEEP_GEMM_WARMUP="skip", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, __file__, a.out, "--engine", str(work), "--lengths", ",".join(map(str, a.lengths)), "--reps", str(a.reps),
           "--chunk", str(a.chunk), "--omlx-format", a.omlx_format, "--block-size", str(a.block_size)] + (["--compiled"] if a.compiled else []) + (["--sync-scheduling"] if a.sync_scheduling else [])
    with open(Path(a.out) / "bench-engine.log", "w") as log:
        p = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=int(os.environ.get("PD_BRIDGE_GPU_ENGINE_TIMEOUT", "540")))
    text = (Path(a.out) / "bench-engine.log").read_text(errors="replace")
    # Seal latency per capture, from the connector's log line ("capture <rid> ... sealed: ...
    # (X ms after the step's forward ...").
    import re

    seal_ms = {m.group(1): float(m.group(2)) for m in re.finditer(r"capture (\S+) \(request [^)]*\) sealed: .*?\(([0-9.]+) ms after the step's forward", text)}
    # What each capture cost, from the same line: "[bytes=N forward_thread_ms=X rows_ms=R native_ms=F new_buffers=K gpu_host_ms=Y]".
    cost = {m.group(1): dict((k, float(v)) for k, v in re.findall(r"(\w+)=([0-9.]+)", m.group(2)))
            for m in re.finditer(r"capture (\S+) \(request [^)]*\) sealed: .*?\[([^\]]*)\]", text)}
    bench = Path(a.out) / "bench.json"
    if bench.exists():
        res = json.loads(bench.read_text())
        for r in res["runs"]:
            if r.get("rid"):
                r["seal_latency_ms"] = seal_ms.get(r["rid"])
                r["cost"] = cost.get(r["rid"])
        for n, sm in res["summary"].items():
            costs = [r["cost"] for r in res["runs"] if r.get("cost") and str(r["tokens"]) == str(n) and r["capture"] and not r["rid"].startswith("bench-warm")]
            for k in ("forward_thread_ms", "rows_ms", "native_ms", "new_buffers", "gpu_host_ms", "bytes"):
                vals = sorted(c[k] for c in costs if k in c)
                if vals:
                    sm[f"{k}_median"], sm[f"{k}_worst"] = vals[len(vals) // 2], vals[-1]
        res["seal_latency_ms"] = seal_ms
        bench.write_text(json.dumps(res, indent=1))
        print("summary with per-capture costs:", json.dumps(res["summary"], indent=1))
        print("seal latency (ms) per capture:", json.dumps(seal_ms))
    print("\n".join(line for line in text.splitlines() if line.startswith(("{", " ", "}", "pd_bridge metrics")) or "pd-bridge: cuda" in line or "could not prepare" in line))
    if p.returncode != 0:
        print(text[-4000:])
    return p.returncode


if __name__ == "__main__":
    sys.exit(main())
