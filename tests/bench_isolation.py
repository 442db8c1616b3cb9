"""Native prompts beside stalled bridges: latency figures from a real ``omlx serve``.

    python tests/bench_isolation.py [--bridges 8] [--natives 10] [--model tiny-mla]

Runs one oMLX (the installed one, bridge on, ``PD_BRIDGE_MAX_BRIDGES`` = --bridges) against a
stalled prefill host (tests/stalled_prefill.py: health answers, prefill and stream never do) and
prints the latency of short native prompts (under ``PD_BRIDGE_MIN_PROMPT_TOKENS``), one at a
time: first with no bridge in flight, then with --bridges bridges stuck on the stalled host, then
for one more long prompt past the cap (declined at once). Figures, not asserts.
Models: $PD_BRIDGE_MODELS (what ``tests/bridge.sh setup`` made) or fresh tiny ones.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

import omlx_server  # noqa: E402
from stalled_prefill import StalledPrefillHost  # noqa: E402


def complete(base_url: str, model: str, text: str) -> tuple[float, httpx.Response]:
    t = time.perf_counter()
    r = httpx.post(f"{base_url}/v1/completions", json={"model": model, "prompt": text, "max_tokens": 3, "temperature": 0.0}, timeout=1200)
    return time.perf_counter() - t, r


def figures(name: str, secs: list[float]) -> None:
    print(f"  {name:<34} n={len(secs):<3} median {statistics.median(secs) * 1e3:8.1f} ms   max {max(secs) * 1e3:8.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bridges", type=int, default=8)
    ap.add_argument("--natives", type=int, default=10)
    ap.add_argument("--model", default="tiny-mla")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pd-bench-iso-") as tmp:
        tmp = Path(tmp)
        models = Path(os.environ.get("PD_BRIDGE_MODELS", "")) if os.environ.get("PD_BRIDGE_MODELS") else None
        if models is None or not (models / args.model / "config.json").exists():
            import tiny_models

            models = tmp / "src"
            tiny_models.make_mla(models / "tiny-mla")
        root = tmp / "models"
        omlx_server.prepare_model(models / args.model, root)
        host = StalledPrefillHost()
        env = {
            "PD_BRIDGE_OMLX": "1", "PD_BRIDGE_PREFILL_URL": host.url, "PD_BRIDGE_SEGMENTS": host.segments_address,
            "PD_BRIDGE_TOKEN": "bench", "PD_BRIDGE_MIN_PROMPT_TOKENS": "400", "PD_BRIDGE_MIN_UNCACHED_TOKENS": "256",
            "PD_BRIDGE_MAX_BRIDGES": str(args.bridges), "PD_BRIDGE_TIMEOUT_S": "900", "PD_BRIDGE_IDLE_S": "900",
        }  # fmt: skip
        try:
            with omlx_server.serve(root, tmp / "cache", tmp / "home", model=args.model, extra_env=env) as s:
                shorts = [omlx_server.prompt_of_tokens(s.model_path, 80, seed=300 + i)[0] for i in range(args.natives)]
                longs = [omlx_server.prompt_of_tokens(s.model_path, 700, seed=400 + i)[0] for i in range(args.bridges + 1)]
                complete(s.base_url, s.model, shorts[0])  # warm-up
                print(f"oMLX {omlx_server.installed_omlx().describe()}, model {args.model}, {os.cpu_count()} CPUs")
                figures("native, no bridge in flight", [complete(s.base_url, s.model, t)[0] for t in shorts])
                pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.bridges)
                stuck = [pool.submit(complete, s.base_url, s.model, t) for t in longs[: args.bridges]]
                for _ in stuck:
                    host.completions.acquire(timeout=600)
                in_flight = httpx.get(f"{s.base_url}/pd-bridge/v1/status", timeout=60).json()["in_flight"]
                figures(f"native, {in_flight} bridges stalled", [complete(s.base_url, s.model, t)[0] for t in shorts])
                secs, r = complete(s.base_url, s.model, longs[-1])
                figures(f"long past the cap ({r.headers['x-pd-bridge'].split(';')[0]})", [secs])
                print(f"  stalled bridges still held: {sum(not f.done() for f in stuck)} of {len(stuck)}")
                host.release()
                for f in stuck:
                    f.result(timeout=600)
                pool.shutdown()
        finally:
            host.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
