"""The bridge's own routes behind oMLX's API key, status without secrets, and one verdict per
prompt — against a real ``omlx serve`` started with ``--api-key`` and the bridge on, its prefill
host down (nothing listens on the configured port).

- ``/pd-bridge/v1/{status,metrics,rescan}`` answer exactly as oMLX's own ``/api/status`` does
  without the key or with a wrong one (same status, same body), and 200 with it (Bearer or
  ``x-api-key``, as oMLX accepts);
- neither ``/pd-bridge/v1/status`` nor the ``pd_bridge`` section of oMLX's ``/api/status`` shows
  the token or the prefill host's address, even after a bridge failed against it, and neither
  does the ``X-PD-Bridge`` header of that request;
- a completion with prompts ``[short, long]`` says ``native`` for the short one and ``declined``
  for the long one (the bridge was tried), in order, and ``[long, short]`` the other way round.
"""

from __future__ import annotations


import pytest

pytestmark = pytest.mark.engine  # starts a real `omlx serve`: not in the quick lane

import engines  # noqa: E402  (tests/ is on the path: conftest)

engines.require("pd_bridge_omlx", "omlx")
httpx = engines.require("httpx")

import omlx_server  # noqa: E402
import ports  # noqa: E402

MODEL = "tiny-mla"
API_KEY = "routes-test-key-7731"
TOKEN = "routes-shared-secret-5521"


def _dead_port() -> int:
    return ports.dead_port()  # bound, never listening: refused at once, taken by nobody


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routes")
    root = tmp / "models"
    omlx_server.prepare_model(models / MODEL, root)
    prefill_port, segments_port = _dead_port(), _dead_port()
    env = {
        "PD_BRIDGE_OMLX": "1",
        "PD_BRIDGE_PREFILL_URL": f"http://127.0.0.1:{prefill_port}",
        "PD_BRIDGE_SEGMENTS": f"127.0.0.1:{segments_port}",
        "PD_BRIDGE_TOKEN": TOKEN,
        "PD_BRIDGE_MIN_PROMPT_TOKENS": "400",
        "PD_BRIDGE_MIN_UNCACHED_TOKENS": "256",
        "PD_BRIDGE_CONNECT_TIMEOUT_S": "2",
    }
    with omlx_server.serve(root, tmp / "cache", tmp / "home", model=MODEL, extra_env=env, api_key=API_KEY) as s:
        s.prefill_port, s.segments_port = prefill_port, segments_port
        yield s


AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROUTES = [("GET", "/pd-bridge/v1/status", None), ("GET", "/pd-bridge/v1/metrics", None), ("POST", "/pd-bridge/v1/rescan", {"model": MODEL})]


def call(server, method, path, body=None, headers=None) -> httpx.Response:
    return httpx.request(method, f"{server.base_url}{path}", json=body, headers=headers or {}, timeout=60)


def complete(server, prompt, headers=AUTH) -> httpx.Response:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=600)


@pytest.mark.parametrize("method,path,body", ROUTES)
def test_bridge_routes_refuse_as_omlx_does_without_the_key(server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong-key-0000"}, {"x-api-key": "wrong-key-0000"}):
        # oMLX's own status route, behind the same check (its error body differs on /v1 routes).
        own = call(server, "GET", "/api/status", headers=headers)
        assert own.status_code == 401, (headers, own.status_code, own.text)
        ours = call(server, method, path, body, headers)
        assert (ours.status_code, ours.json()) == (own.status_code, own.json()), (path, headers, ours.text)


@pytest.mark.parametrize("method,path,body", ROUTES)
def test_bridge_routes_answer_with_the_key(server, method, path, body):
    for headers in (AUTH, {"x-api-key": API_KEY}):
        r = call(server, method, path, body, headers)
        assert r.status_code == 200, (path, headers, r.status_code, r.text)


def _secrets(server) -> list[str]:
    return [TOKEN, str(server.prefill_port), str(server.segments_port), "127.0.0.1", "localhost", "http://"]


def test_status_and_headers_show_no_token_or_prefill_address(server):
    text, _ = omlx_server.prompt_of_tokens(server.model_path, 700, seed=11)
    r = complete(server, text)
    assert r.status_code == 200, r.text
    header = r.headers["x-pd-bridge"]
    # The bridge was tried and failed against the prefill host: the reason says so, not where.
    assert header.startswith('declined; reason="prefill host unhealthy: <prefill host>/health is unreachable'), header
    status = call(server, "GET", "/pd-bridge/v1/status", headers=AUTH).json()
    assert status["bridge"].startswith("on: min prompt 400") and status["max_bridges"] >= 1 and status["in_flight"] == 0
    assert status["counters"]["verdicts"]["declined"] >= 1 and status["counters"]["last"]["verdict"] == header
    omlx_status = call(server, "GET", "/api/status", headers=AUTH)
    assert omlx_status.status_code == 200, omlx_status.text
    section = omlx_status.json()["pd_bridge"]
    assert section["verdicts"] == status["counters"]["verdicts"]
    for what, shown in (("X-PD-Bridge", header), ("/pd-bridge/v1/status", r.text + str(status)), ("/api/status pd_bridge", str(section))):
        for secret in _secrets(server):
            assert secret not in shown, f"{what} shows {secret!r}: {shown}"
    # oMLX's own status stays behind its key.
    assert call(server, "GET", "/api/status").status_code == 401


def test_every_prompt_of_a_list_gets_its_own_verdict(server):
    short, _ = omlx_server.prompt_of_tokens(server.model_path, 60, seed=21)
    long, _ = omlx_server.prompt_of_tokens(server.model_path, 700, seed=22)
    r = complete(server, [short, long])
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    verdicts = r.headers["x-pd-bridge"].split(", ")
    assert len(verdicts) == 2, r.headers["x-pd-bridge"]
    assert verdicts[0].startswith('native; reason="prompt of 60 tokens is under PD_BRIDGE_MIN_PROMPT_TOKENS=400'), verdicts
    assert verdicts[1].startswith('declined; reason="prefill host unhealthy:'), verdicts
    other_long, _ = omlx_server.prompt_of_tokens(server.model_path, 700, seed=23)  # `long` is cached now
    r = complete(server, [other_long, short])
    verdicts = r.headers["x-pd-bridge"].split(", ")
    assert [v.split(";")[0] for v in verdicts] == ["declined", "native"], verdicts
    # One prompt, or a streamed list (oMLX streams only its first prompt): one verdict.
    r = complete(server, short)
    assert len(r.headers["x-pd-bridge"].split(", ")) == 1
    body = {"model": server.model, "prompt": [short, long], "max_tokens": 2, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=600) as s:
        s.read()
        assert s.status_code == 200
        assert s.headers["x-pd-bridge"].startswith("native; reason=\"prompt of 60 tokens"), s.headers["x-pd-bridge"]
        assert len(s.headers["x-pd-bridge"].split(", ")) == 1
