"""A stalled prefill host never slows a native prompt — against a real ``omlx serve``.

The prefill host stands for a vLLM whose engine stopped after its API answered: ``/health`` and
``/v1/models`` answer, ``/v1/completions`` is read and never answered, and the segment port
accepts connections and never sends a byte. With ``PD_BRIDGE_MAX_BRIDGES=8`` (the issue's case:
8 bridges waiting on a stopped vLLM once starved every prompt's tokenization):

- eight long prompts are admitted as bridges and stay stuck (their prefill requests are held by
  the stalled host; status counts 8 in flight);
- a ninth long prompt, past the cap, is declined at once naming the cap and served natively;
- short prompts sent while both bridges are stuck are all served, natively, with their answers,
  before either stuck bridge returns (their responses arrive while the bridges are still held),
  and ``/health`` answers throughout;
- once the stalled host lets go (its connections close), the eight bridges end ``declined`` and
  their prompts are served natively.

Only the order of events is asserted, never a duration.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

pytestmark = pytest.mark.engine  # starts a real `omlx serve`: not in the quick lane

import engines  # noqa: E402  (tests/ is on the path: conftest)

engines.require("pd_bridge_omlx", "omlx")
httpx = engines.require("httpx")

import omlx_server  # noqa: E402
from stalled_prefill import StalledPrefillHost  # noqa: E402

MODEL = "tiny-mla"
BRIDGES = 8


@pytest.fixture(scope="module")
def stalled():
    host = StalledPrefillHost()
    yield host
    host.release()


@pytest.fixture(scope="module")
def server(models, tmp_path_factory, stalled):
    tmp = tmp_path_factory.mktemp("isolation")
    root = tmp / "models"
    omlx_server.prepare_model(models / MODEL, root)
    env = {
        "PD_BRIDGE_OMLX": "1",
        "PD_BRIDGE_PREFILL_URL": stalled.url,
        "PD_BRIDGE_SEGMENTS": stalled.segments_address,
        "PD_BRIDGE_TOKEN": "isolation-test",
        "PD_BRIDGE_MIN_PROMPT_TOKENS": "400",
        "PD_BRIDGE_MIN_UNCACHED_TOKENS": "256",
        "PD_BRIDGE_MAX_BRIDGES": str(BRIDGES),
        # Long enough that only the test's release ends the stuck bridges.
        "PD_BRIDGE_TIMEOUT_S": "900",
        "PD_BRIDGE_IDLE_S": "900",
    }
    with omlx_server.serve(root, tmp / "cache", tmp / "home", model=MODEL, extra_env=env) as s:
        yield s


def complete(server, text: str) -> httpx.Response:
    body = {"model": server.model, "prompt": text, "max_tokens": 3, "temperature": 0.0}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=1200)


def test_native_prompts_are_served_while_bridges_are_stuck(server, stalled):
    longs = [omlx_server.prompt_of_tokens(server.model_path, 700, seed=40 + i)[0] for i in range(BRIDGES + 1)]
    shorts = [omlx_server.prompt_of_tokens(server.model_path, 80, seed=50 + i)[0] for i in range(4)]
    # The native answers, from the same server before any bridge is stuck.
    expected = {t: complete(server, t).json()["choices"][0]["text"] for t in shorts}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=BRIDGES + 8)
    stuck: list[concurrent.futures.Future] = []
    try:
        stuck += [pool.submit(complete, server, t) for t in longs[:BRIDGES]]
        for _ in stuck:  # both bridges have sent their prefill request to the stalled host
            assert stalled.completions.acquire(timeout=300), "a bridge never reached the prefill host"
        status = httpx.get(f"{server.base_url}/pd-bridge/v1/status", timeout=60).json()
        assert status["in_flight"] == BRIDGES and status["max_bridges"] == BRIDGES, status

        over_cap = complete(server, longs[BRIDGES])
        assert over_cap.status_code == 200, over_cap.text
        assert over_cap.headers["x-pd-bridge"] == f'declined; reason="{BRIDGES} bridges already in flight (PD_BRIDGE_MAX_BRIDGES={BRIDGES})"'

        natives = [pool.submit(complete, server, t) for t in shorts]
        for t, fut in zip(shorts, natives):
            # A liveness bound, not a timing target: starved natives would wait for the release.
            r = fut.result(timeout=300)
            assert r.status_code == 200, r.text
            assert r.headers["x-pd-bridge"].startswith('native; reason="prompt of 80 tokens'), r.headers["x-pd-bridge"]
            assert r.json()["choices"][0]["text"] == expected[t]
            assert httpx.get(f"{server.base_url}/health", timeout=60).status_code == 200
        # Every native response came back while every bridge was still held by the stalled host.
        assert not any(f.done() for f in stuck), [f.result().headers.get("x-pd-bridge") for f in stuck if f.done()]
        assert httpx.get(f"{server.base_url}/pd-bridge/v1/status", timeout=60).json()["in_flight"] == BRIDGES
    finally:
        stalled.release()
        results = [f.result(timeout=600) for f in stuck]
        pool.shutdown(wait=True)
    for r in results:
        assert r.status_code == 200, r.text
        assert r.headers["x-pd-bridge"].startswith("declined; reason="), r.headers["x-pd-bridge"]
        assert len(r.json()["choices"][0]["text"]) > 0
    # Each slot comes back once its last I/O thread has returned (the closed connections end them).
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.base_url}/pd-bridge/v1/status", timeout=60).json()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(f"{server.base_url}/pd-bridge/v1/status", timeout=60).json()["in_flight"] == 0
