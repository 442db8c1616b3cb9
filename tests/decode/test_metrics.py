"""The bridge's counters in Prometheus' text format, scraped from a real ``omlx serve``.

One oMLX (flyto-mlx 0.7.0, ``mlx[cpu]``) with the bridge on and a prefill host that is down: the
scrape at ``GET /pd-bridge/v1/metrics`` parses with prometheus_client's own text parser and has
every family; a short prompt (under ``PD_BRIDGE_MIN_PROMPT_TOKENS``) moves the ``native``
verdict counter, a long one (the bridge is tried, the health check fails through the HTTP
client) moves ``declined`` and the bytes-per-request histogram; the JSON status agrees.
"""

from __future__ import annotations


import pytest

pytestmark = pytest.mark.engine  # starts a real `omlx serve`: not in the quick lane

import engines  # noqa: E402  (tests/ is on the path: conftest)

engines.require("pd_bridge_omlx", "omlx")
httpx = engines.require("httpx")
try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    engines.missing("prometheus_client is not installed (pd-bridge-omlx depends on it)")

import omlx_server  # noqa: E402
import ports  # noqa: E402

MODEL = "tiny-mla"
FAMILIES = {  # family name -> type, as the parser reports them
    "pd_bridge_verdicts": "counter",
    "pd_bridge_blocks": "counter",
    "pd_bridge_tokens": "counter",
    "pd_bridge_bytes_written": "counter",
    "pd_bridge_phase_seconds": "histogram",
    "pd_bridge_request_bytes": "histogram",
}


def _dead_port() -> int:
    return ports.dead_port()  # bound, never listening: refused at once, taken by nobody


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    root = tmp / "models"
    omlx_server.prepare_model(models / MODEL, root)
    port = _dead_port()  # nothing listens: the prefill host is down
    env = {
        "PD_BRIDGE_OMLX": "1",
        "PD_BRIDGE_PREFILL_URL": f"http://127.0.0.1:{port}",
        "PD_BRIDGE_TOKEN": "metrics-test",
        "PD_BRIDGE_MIN_PROMPT_TOKENS": "400",
        "PD_BRIDGE_MIN_UNCACHED_TOKENS": "256",
        "PD_BRIDGE_CONNECT_TIMEOUT_S": "2",
    }
    with omlx_server.serve(root, tmp / "cache", tmp / "home", model=MODEL, extra_env=env) as s:
        yield s


def scrape(server) -> tuple[httpx.Response, dict]:
    r = httpx.get(f"{server.base_url}/pd-bridge/v1/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return r, {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, sample: str, **labels) -> float:
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {sample}{labels} in {family}")


def complete(server, text: str) -> httpx.Response:
    body = {"model": server.model, "prompt": text, "max_tokens": 2, "temperature": 0.0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r


def test_scrape_has_every_family_in_text_format_0_0_4(server):
    r, fams = scrape(server)
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    for name, kind in FAMILIES.items():
        assert name in fams, f"{name} missing from the scrape"
        assert fams[name].type == kind, (name, fams[name].type)
    kinds = {s.labels["kind"] for s in fams["pd_bridge_verdicts"].samples if s.name == "pd_bridge_verdicts_total"}
    assert kinds == {"complete", "partial", "declined", "native"}
    phases = {s.labels["phase"] for s in fams["pd_bridge_phase_seconds"].samples if s.name == "pd_bridge_phase_seconds_count"}
    assert phases == {"decide", "prefill", "after_prefill", "total"}
    # The private registry: none of prometheus_client's process/platform collectors.
    assert not any(n.startswith(("process_", "python_")) for n in fams)


def test_a_short_prompt_moves_the_native_counter(server):
    _, before = scrape(server)
    text, ids = omlx_server.prompt_of_tokens(server.model_path, 120)
    r = complete(server, text)
    assert r.headers["x-pd-bridge"].startswith('native; reason="prompt of 120 tokens is under PD_BRIDGE_MIN_PROMPT_TOKENS=400')
    _, after = scrape(server)
    assert value(after, "pd_bridge_verdicts_total", kind="native") == value(before, "pd_bridge_verdicts_total", kind="native") + 1
    for kind in ("complete", "partial", "declined"):
        assert value(after, "pd_bridge_verdicts_total", kind=kind) == value(before, "pd_bridge_verdicts_total", kind=kind)
    # A native verdict is not a bridge attempt: no bytes-per-request observation.
    assert value(after, "pd_bridge_request_bytes_count") == value(before, "pd_bridge_request_bytes_count")


def test_a_long_prompt_with_the_prefill_host_down_moves_declined(server):
    _, before = scrape(server)
    status_before = httpx.get(f"{server.base_url}/pd-bridge/v1/status", timeout=30).json()["counters"]
    text, _ = omlx_server.prompt_of_tokens(server.model_path, 700, seed=5)
    r = complete(server, text)
    header = r.headers["x-pd-bridge"]
    assert header.startswith('declined; reason="prefill host unhealthy: ') and "unreachable" in header, header
    _, after = scrape(server)
    assert value(after, "pd_bridge_verdicts_total", kind="declined") == value(before, "pd_bridge_verdicts_total", kind="declined") + 1
    assert value(after, "pd_bridge_request_bytes_count") == value(before, "pd_bridge_request_bytes_count") + 1
    assert value(after, "pd_bridge_bytes_written_total") == value(before, "pd_bridge_bytes_written_total")
    # The JSON status (unchanged in shape) counts the same requests.
    status_after = httpx.get(f"{server.base_url}/pd-bridge/v1/status", timeout=30).json()["counters"]
    assert status_after["verdicts"]["declined"] == status_before["verdicts"]["declined"] + 1
    assert set(status_after) == {"verdicts", "bridged_blocks", "bridged_tokens", "bytes_written", "seconds", "last"}
    total = {k: value(after, "pd_bridge_verdicts_total", kind=k) for k in status_after["verdicts"]}
    assert total == {k: float(v) for k, v in status_after["verdicts"].items()}


def test_connect_timeout_setting_is_validated():
    from pd_bridge_omlx import config

    good = {"PD_BRIDGE_PREFILL_URL": "http://gpu-box:8000", "PD_BRIDGE_TOKEN": "s"}
    assert config.from_env(good).connect_timeout_s == 5.0
    assert config.from_env({**good, "PD_BRIDGE_CONNECT_TIMEOUT_S": "1.5"}).connect_timeout_s == 1.5
    for bad in ("0", "-3", "soon", "nan", "inf"):
        with pytest.raises(config.BridgeConfigError, match="PD_BRIDGE_CONNECT_TIMEOUT_S"):
            config.from_env({**good, "PD_BRIDGE_CONNECT_TIMEOUT_S": bad})
