"""A request whose JSON holds a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, not valid
Unicode) against a real ``omlx serve``, bridged (``PD_BRIDGE_OMLX=1``, prefill host down) and
plain (the bridge off), with the same raw bodies.

oMLX's own handler raises while tokenizing such a prompt: plain oMLX (the fork and upstream
alike) answers HTTP 500 ``Internal server error``. The bridged one never answers 500 for it:
where plain oMLX answers (200 or a 4xx), the bridged one gives the same status (and, greedy, the
same text); where plain oMLX fails with 500, the bridged one answers 400 in oMLX's own error
format, saying why, with a ``native`` verdict that says the same. Valid text with a surrogate
*pair* (an emoji) is answered alike by both.
"""

from __future__ import annotations


import pytest

pytestmark = pytest.mark.engine  # starts real `omlx serve` processes: not in the quick lane

import engines  # noqa: E402  (tests/ is on the path: conftest)

engines.require("pd_bridge_omlx", "omlx")
httpx = engines.require("httpx")

import omlx_server  # noqa: E402
import ports  # noqa: E402

MODEL = "tiny-mla"


def _dead_port() -> int:
    return ports.dead_port()  # bound, never listening: refused at once, taken by nobody


@pytest.fixture(scope="module")
def root(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("surrogate-models")
    omlx_server.prepare_model(models / MODEL, root)
    return root


@pytest.fixture(scope="module")
def plain(root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("surrogate-plain")
    with omlx_server.serve(root, tmp / "cache", tmp / "home", model=MODEL, extra_env={"PD_BRIDGE_OMLX": ""}) as s:
        # Really without the bridge: its routes are not there.
        assert httpx.get(f"{s.base_url}/pd-bridge/v1/status", timeout=30).status_code == 404
        yield s


@pytest.fixture(scope="module")
def bridged(root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("surrogate-bridged")
    env = {
        "PD_BRIDGE_OMLX": "1",
        "PD_BRIDGE_PREFILL_URL": f"http://127.0.0.1:{_dead_port()}",
        "PD_BRIDGE_SEGMENTS": f"127.0.0.1:{_dead_port()}",
        "PD_BRIDGE_TOKEN": "surrogate-shared-secret-8812",
        "PD_BRIDGE_CONNECT_TIMEOUT_S": "2",
    }
    with omlx_server.serve(root, tmp / "cache", tmp / "home", model=MODEL, extra_env=env) as s:
        assert httpx.get(f"{s.base_url}/pd-bridge/v1/status", timeout=30).status_code == 200
        yield s


# Raw bodies (the escapes stay as JSON writes them; json.dumps of a Python str would too, but the
# point is the bytes a client sends). MODEL is replaced with the served model id.
BODIES = {
    "completion": ("/v1/completions", rb'{"model": "MODEL", "prompt": "hello \ud800 world", "max_tokens": 2, "temperature": 0.0}'),
    "completion, prompt list": ("/v1/completions", rb'{"model": "MODEL", "prompt": ["hello \ud800 world"], "max_tokens": 2, "temperature": 0.0}'),
    "completion, streamed": ("/v1/completions", rb'{"model": "MODEL", "prompt": "\udc00 x", "max_tokens": 2, "temperature": 0.0, "stream": true}'),
    "completion, CESU bytes": ("/v1/completions", b'{"model": "MODEL", "prompt": "hello \xed\xa0\x80 world", "max_tokens": 2, "temperature": 0.0}'),
    "chat": ("/v1/chat/completions", rb'{"model": "MODEL", "messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2, "temperature": 0.0}'),
    "chat, streamed": ("/v1/chat/completions", rb'{"model": "MODEL", "messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2, "temperature": 0.0, "stream": true}'),
}
# Valid text: a surrogate pair is one character (an emoji).
PAIRED = ("/v1/completions", rb'{"model": "MODEL", "prompt": "hello \ud83d\ude00 world", "max_tokens": 2, "temperature": 0.0}')


def post(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", content=body.replace(b"MODEL", server.model.encode()), headers={"Content-Type": "application/json"}, timeout=300)


@pytest.mark.parametrize("case", list(BODIES))
def test_a_lone_surrogate_never_gets_500_and_follows_plain_omlx(plain, bridged, case):
    path, body = BODIES[case]
    native_answer = post(plain, path, body)
    ours = post(bridged, path, body)
    assert ours.status_code != 500, (case, ours.status_code, ours.text)
    verdict = ours.headers.get("x-pd-bridge", "")
    assert verdict.startswith("native;"), (case, verdict)
    if native_answer.status_code != 500:
        # Plain oMLX answers it: so does the bridged one, alike.
        assert ours.status_code == native_answer.status_code, (case, ours.status_code, ours.text, native_answer.text)
        if ours.status_code == 200 and not body.count(b'"stream": true'):
            assert [c.get("text") or c.get("message", {}).get("content") for c in ours.json()["choices"]] == [
                c.get("text") or c.get("message", {}).get("content") for c in native_answer.json()["choices"]
            ], case
        return
    # Plain oMLX fails on it (its tokenizer raises): a client error that says why, in oMLX's own
    # error format (what its own 400s look like on these routes).
    assert native_answer.json()["error"]["message"] == "Internal server error", native_answer.text
    assert ours.status_code == 400, (case, ours.status_code, ours.text)
    error = ours.json()["error"]
    assert set(error) == set(native_answer.json()["error"]), ours.text
    assert "lone UTF-16 surrogate" in error["message"] and "not valid Unicode" in error["message"], error
    assert "lone UTF-16 surrogate" in verdict and "HTTP 400" in verdict, verdict


def test_a_surrogate_pair_is_served_alike(plain, bridged):
    path, body = PAIRED
    native_answer, ours = post(plain, path, body), post(bridged, path, body)
    assert native_answer.status_code == ours.status_code == 200, (native_answer.text, ours.text)
    assert ours.json()["choices"][0]["text"] == native_answer.json()["choices"][0]["text"]
    assert ours.headers["x-pd-bridge"].startswith("native;"), ours.headers


def test_the_bridged_server_counts_it_and_still_serves(bridged):
    def natives() -> int:
        return httpx.get(f"{bridged.base_url}/pd-bridge/v1/status", timeout=30).json()["counters"]["verdicts"].get("native", 0)

    before = natives()
    assert post(bridged, *BODIES["completion"]).status_code != 500
    assert natives() == before + 1
    ours = post(bridged, "/v1/completions", rb'{"model": "MODEL", "prompt": "hello world", "max_tokens": 2, "temperature": 0.0}')
    assert ours.status_code == 200, ours.text
