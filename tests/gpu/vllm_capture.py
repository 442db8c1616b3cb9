#!/usr/bin/env python3
"""The GPU host for real: a CUDA vLLM (0.26.0, the vLLM CUDA kit) with pd-bridge-vllm's plugin and
connector capturing inside the engine, the tap feeding CUDA descriptors to the GPU capture.

    python3 tests/gpu/decode_check.py prompts PROMPTS.json        # here: the prompts, tokenized by oMLX's tokenizer
    python3 tests/gpu/vllm_capture.py OUT --prompts PROMPTS.json   # on the H200, with the kit
    python3 tests/gpu/decode_check.py check OUT                   # here: a real upstream oMLX serves the blocks

For each family — a tiny DeepSeek-V3-style MLA model (``tests/prefill/tiny_mla_hf.py`` with the
head dims FA3 takes on Hopper: 128/64/128) and a tiny DeepSeek-V4 (``tiny_v4_fp8.py``: FP8
block-quantized, fp8 KV cache, FlashMLA sparse), each generated from ONE set of weights for vLLM's
checkpoint and the decoder's weights dir — one engine (its own process) serves two concurrent
captured prompts of 4,400 and 2,600 tokens, prefilled over several chunks
(``max_num_batched_tokens`` = ``--chunk``, the two requests sharing steps), with
``PD_BRIDGE_GPU_GEMM=exact``. Request ``a`` asks for upstream oMLX 0.6.3's block format (what Mac
users run), ``b`` for the fork's. The connector's test-only dump records the attention inputs the
tap fed. Every capture is pulled by the decode host's own client (``pd_bridge_omlx.ingest``, the
core's wire) into oMLX block files. Then, here:

1. every layer was fed every prompt row exactly once, over more than one step;
2. each capture sealed ``complete`` exactly once (its verdict file has one line);
3. the blocks the engine's capture streamed are identical, array by array, to the blocks of the
   CPU reference (``Capture.feed``, host rows) from the same attention inputs;
4. tensor cores (the default GEMM): the same inputs through the GPU path with CUDA tensors,
   compared with the CPU reference value by value: the fraction of bf16 values bit-identical
   and the largest difference in ulps;
5. the capture's figures reached vLLM's metrics (``vllm:pd_bridge_*`` from ``LLM.get_metrics()``,
   what ``/metrics`` serves): 2 complete captures, their blocks and bytes.

``OUT`` gets ``result.json`` (every figure), ``<family>-a-blocks.tar`` (request a's upstream-format
block files, as the decode host wrote them), ``<family>-model.tar`` (the prompt ids, the decoder weights
dir and, for MLA, the whole checkpoint) for ``decode_check.py check``, and the engine logs. Exit 0
when every check passes. Needs a CUDA GPU and vLLM 0.26.0 with pd_bridge_vllm and pd_bridge_omlx
installed (the kit: see README).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "prefill"))
TOKEN = b"gpu-test-token"
# The decode host's per-request capture secret (pd_capture.secret), keying the encrypted stream.
SECRET = "5e" * 32
COMPILED_ENV = "PD_BRIDGE_TEST_COMPILED"  # set by --compiled: engines run without enforce_eager
# capture id suffix -> (prompt tokens, seed); a spans two of upstream's 2,048-token V4 blocks
PROMPTS = {"a": (4400, 11), "b": (2600, 12)}
# Request a: upstream oMLX 0.6.3's blocks (served by decode_check.py); b: the fork's.
FORMATS = {"a": "upstream-0.6.3", "b": "fork-0.7.0"}
MODEL_NAME = {"mla": "tiny-mla-gpu", "v4": "tiny-v4-gpu"}  # the oMLX model id the blocks are keyed on


# ---------------------------------------------------------------------------------- the wire, through the core


def pull(port: int, rid: str, fingerprint: str, ids: list[int], fmt: str, block: int, model_name: str, dest: Path, timeout: float = 120.0) -> dict:
    """Pull capture ``rid`` from the segment port as the decode host does (``pd_bridge_omlx.ingest``:
    the core's authenticated wire, its checks) into oMLX block files under ``dest``."""
    import pd_bridge_omlx

    writer = pd_bridge_omlx.BlockWriter(str(dest), model_name, block, ids, fmt)
    n, seal = pd_bridge_omlx.ingest("127.0.0.1", port, TOKEN, rid, fingerprint, writer, timeout_seconds=timeout, secret=SECRET, token_ids=ids)
    writer.flush()
    return {"blocks": n, "seal": json.loads(seal)}


def block_arrays(path: Path) -> dict[str, tuple[str, bytes]]:
    """{tensor name: (dtype, raw bytes)} of one safetensors block file (no library needed)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    base = 8 + n
    return {k: (v["dtype"], raw[base + v["data_offsets"][0] : base + v["data_offsets"][1]]) for k, v in head.items() if k != "__metadata__"}


def block_set(root: Path) -> dict[str, dict[str, tuple[str, bytes]]]:
    return {f.name: block_arrays(f) for f in sorted(root.rglob("*.safetensors"))}


def blocks_identical(ref: Path, got: Path) -> bool:
    a, b = block_set(ref), block_set(got)
    return bool(a) and a == b


def ulp_compare(ref: Path, got: Path) -> dict:
    """Value-by-value comparison of two sets of block files (their bf16 arrays): the fraction
    identical and the largest distance in ulps."""
    import numpy as np

    A, B = block_set(ref), block_set(got)
    assert A.keys() == B.keys() and A, (sorted(A), sorted(B))
    total = same = worst = 0
    hist: dict[int, int] = {}
    for f in A:
        assert A[f].keys() == B[f].keys(), f
        for name, (dt, x) in A[f].items():
            dt2, y = B[f][name]
            assert dt == dt2 and len(x) == len(y), (f, name)
            if dt != "BF16":
                total += 1
                same += int(x == y)
                continue
            u, v = np.frombuffer(x, np.uint16), np.frombuffer(y, np.uint16)

            def key(w):  # ordered integer view of bf16 (sign-magnitude -> two's complement order)
                t = w.astype(np.int32)
                return np.where(t & 0x8000, 0x8000 - t, t)

            d = np.abs(key(u) - key(v))
            total += d.size
            same += int((u == v).sum())
            worst = max(worst, int(d.max()) if d.size else 0)
            for k, c in zip(*np.unique(np.minimum(d, 4), return_counts=True)):
                hist[int(k)] = hist.get(int(k), 0) + int(c)
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
        model=spec["hf"], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=os.environ.get(COMPILED_ENV) != "1", enable_prefix_caching=False,
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
    import pd_bridge_omlx

    ids = spec["prompts"] or {k: prompt_ids(n, seed) for k, (n, seed) in PROMPTS.items()}
    decoder = pd_bridge_omlx.Weights.load(spec["mlx"])
    # The block size the decoder's oMLX picks for this model and format (the core's rule).
    block = {k: pd_bridge_omlx.expected_block_size(decoder, FORMATS[k]) for k in ids}
    sps = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False,
                          extra_args={"kv_transfer_params": {"pd_capture": {"request_id": f"{family}-{k}", "block_size": block[k], "omlx_format": FORMATS[k], "secret": SECRET}}}) for k in ids]
    t1 = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=v) for v in ids.values()], sps, use_tqdm=False)  # one call: concurrent
    t_gen = time.monotonic() - t1
    fingerprint = decoder.fingerprint
    streams = {k: pull(spec["port"], f"{family}-{k}", fingerprint, ids[k], FORMATS[k], block[k], MODEL_NAME[family], work / "blocks-engine" / k) for k in ids}
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
    res = {"engine_start_s": round(t_start, 2), "generate_s": round(t_gen, 3), "ids": ids, "streams": streams, "metrics": metrics, "fingerprint": fingerprint, "block_size": block,
           "outputs": {f"{family}-{k}": {"tokens": list(o.outputs[0].token_ids), "kv_transfer_params": o.kv_transfer_params} for k, o in zip(ids, outs)}}
    (work / "engine.json").write_text(json.dumps(res))


# ---------------------------------------------------------------------------------- the checks (parent process)


def fed_chunks(dump: Path, rid: str) -> dict[int, list[tuple[int, bytes]]]:
    got: dict[int, list[tuple[int, bytes]]] = {}
    for f in dump.glob(f"{rid}.L*.S*.in.bin"):
        _, L, S, *_ = f.name[len(rid) :].split(".")
        got.setdefault(int(L[1:]), []).append((int(S[1:]), f.read_bytes()))
    return {k: sorted(v) for k, v in got.items()}


def check_family(family: str, work: Path, out: Path, chunk: int, prompts: dict | None) -> dict:
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
    (work / "spec.json").write_text(json.dumps({"hf": str(hf), "mlx": str(mlx), "port": free, "prompts": prompts}))
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
    for k, n in ((k, len(v)) for k, v in eng["ids"].items()):
        rid, fmt, ids, bs = f"{family}-{k}", FORMATS[k], eng["ids"][k], eng["block_size"][k]
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
        # 2. sealed complete exactly once, and the decode host's client wrote every block
        vf = dump / f"{rid}.verdict.json"
        verdicts = [json.loads(line) for line in vf.read_text().splitlines()] if vf.exists() else []
        want = {"verdict": "complete", "blocks": n // bs, "tokens": n // bs * bs}
        got = eng["streams"][k]
        ok[f"{rid}: sealed complete exactly once"] = verdicts == [want] and got["seal"] == want
        ok[f"{rid}: the decode host's client wrote every block ({fmt})"] = got["blocks"] == want["blocks"] == len(list((work / "blocks-engine" / k).rglob("*.safetensors")))
        # 3. the engine's blocks == the CPU reference's from the same inputs
        srv = pd_bridge_vllm.SegmentServer("127.0.0.1:0", TOKEN)
        cpu = pd_bridge_vllm.Capture(w, rid, n, bs, srv, fmt, SECRET, pd_bridge_vllm.prompt_digest(ids))
        for layer in sorted(fed):
            for s, b in fed[layer]:
                cpu.feed(layer, s, b)
        cpu.seal()
        pull(srv.port, rid, eng["fingerprint"], ids, fmt, bs, MODEL_NAME[family], work / "blocks-cpu" / k)
        same = blocks_identical(work / "blocks-cpu" / k, work / "blocks-engine" / k)
        exact[rid] = {"omlx_format": fmt, "block_size": bs, "blocks": want["blocks"], "identical": same}
        if not same:
            exact[rid]["values"] = ulp_compare(work / "blocks-cpu" / k, work / "blocks-engine" / k)
        ok[f"{rid}: in-engine capture (exact GEMM) == CPU reference, every array bit for bit"] = same
        # 4. tensor cores: the same inputs as CUDA tensors through the GPU path, default GEMM
        srv2 = pd_bridge_vllm.SegmentServer("127.0.0.1:0", TOKEN)
        gpu = pd_bridge_vllm.Capture(w, rid, n, bs, srv2, fmt, SECRET, pd_bridge_vllm.prompt_digest(ids))
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
        pull(srv2.port, rid, eng["fingerprint"], ids, fmt, bs, MODEL_NAME[family], work / "blocks-tc" / k)
        tensor[rid] = {"omlx_format": fmt, **ulp_compare(work / "blocks-cpu" / k, work / "blocks-tc" / k)}
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

    blocks = sum(len(v) // eng["block_size"][k] for k, v in eng["ids"].items())
    ok["metrics: vllm:pd_bridge_captures{verdict=complete} == 2"] = metric("vllm:pd_bridge_captures", verdict="complete") == 2
    ok[f"metrics: vllm:pd_bridge_blocks == {blocks}"] = metric("vllm:pd_bridge_blocks") == blocks
    wire = metric("vllm:pd_bridge_bytes")
    ok["metrics: vllm:pd_bridge_bytes > 0"] = bool(wire)
    res["bytes_per_token"] = round(wire / sum(len(v) // eng["block_size"][k] * eng["block_size"][k] for k, v in eng["ids"].items()), 1) if wire else None
    ok["metrics: vllm:pd_bridge_aborts == 0"] = metric("vllm:pd_bridge_aborts") in (0, 0.0)
    lat = metric("vllm:pd_bridge_seal_latency_seconds")
    ok["metrics: seal latency histogram has 2 observations"] = isinstance(lat, dict) and lat.get("count") == 2
    res["seal_latency"] = lat
    for line in logtext.splitlines():
        if "sealed:" in line and "after the step's forward" in line:
            res.setdefault("seal_log", []).append(line.split("pd-bridge: ", 1)[-1][:200])
    # Request a's upstream blocks, its ids, the decoder weights and (MLA) the checkpoint, for
    # decode_check.py: a real upstream oMLX serves them there.
    # (one tar: the device returns files at most two folders deep)
    with tarfile.open(out / f"{family}-a-blocks.tar", "w") as tf:
        tf.add(work / "blocks-engine" / "a", arcname=".")
    (work / f"{family}-a.ids.json").write_text(json.dumps(eng["ids"]["a"]))
    with tarfile.open(out / f"{family}-model.tar", "w") as tf:
        tf.add(work / f"{family}-a.ids.json", arcname=f"{family}-a.ids.json")
        tf.add(mlx, arcname=f"{family}-mlx")
        if family == "mla":
            tf.add(hf, arcname=f"{family}-hf")
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--family", default="mla,v4")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--prompts", help="decode_check.py prompts' file: {a: {ids}, b: {ids}} (default: random ids)")
    ap.add_argument("--engine", nargs=2, metavar=("FAMILY", "WORK"), help=argparse.SUPPRESS)
    ap.add_argument("--compiled", action="store_true", help="vLLM's default compilation (torch.compile + CUDA graphs) instead of eager")
    a = ap.parse_args()
    if a.compiled:
        os.environ[COMPILED_ENV] = "1"  # the engine processes inherit it
    if a.engine:
        engine(a.engine[0], Path(a.engine[1]), a.chunk)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    prompts = {k: v["ids"] for k, v in json.loads(Path(a.prompts).read_text()).items()} if a.prompts else None
    results, rc = [], 0
    for family in a.family.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"pdb-gpu-{family}-"))
        try:
            r = check_family(family, work, out, a.chunk, prompts)
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
