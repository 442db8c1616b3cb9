"""The decode-side bridge's settings and verdict header, without engines (the engine paths are
in tests/e2e): every bad setting is refused naming its variable, and the bridge then answers
every request natively with that reason; a header never carries characters HTTP forbids."""

from __future__ import annotations

import asyncio

import pytest

import engines  # noqa: E402  (tests/ is on the path: conftest)

engines.require("pd_bridge_omlx")

from pd_bridge_omlx import config  # noqa: E402
from pd_bridge_omlx.bridge import Bridge  # noqa: E402
from pd_bridge_omlx.verdict import Verdict  # noqa: E402

GOOD = {"PD_BRIDGE_PREFILL_URL": "http://gpu-box:8000/", "PD_BRIDGE_TOKEN": "s3cret"}


def test_defaults_and_derived_segment_address():
    cfg = config.from_env(GOOD)
    assert cfg.prefill_url == "http://gpu-box:8000"
    assert (cfg.segments_host, cfg.segments_port) == ("gpu-box", 7188)
    assert cfg.token == b"s3cret" and cfg.min_prompt_tokens == 2048 and cfg.min_uncached_tokens == 1024
    assert config.from_env({}) is None  # no prefill host: bridge off
    assert cfg.wire_lanes == 1 and config.from_env({**GOOD, "PD_BRIDGE_WIRE_LANES": "4"}).wire_lanes == 4


def test_several_prefill_hosts_pair_with_their_segment_servers_in_order():
    cfg = config.from_env({**GOOD, "PD_BRIDGE_PREFILL_URL": "http://spark-a:8000, http://[fd00::2]:8000/", "PD_BRIDGE_SEGMENTS": "spark-a:7188,[fd00::2]:7200"})
    assert [(t.url, t.segments_host, t.segments_port) for t in cfg.prefill_hosts] == [("http://spark-a:8000", "spark-a", 7188), ("http://[fd00::2]:8000", "fd00::2", 7200)]
    assert cfg.prefill_url == "http://spark-a:8000"  # the first
    derived = config.from_env({**GOOD, "PD_BRIDGE_PREFILL_URL": "http://a:1,http://b:2"})
    assert [(t.segments_host, t.segments_port) for t in derived.prefill_hosts] == [("a", 7188), ("b", 7188)]
    b = Bridge(cfg)
    assert [h.url for h in b.hosts] == ["http://spark-a:8000", "http://[fd00::2]:8000"]
    assert b.public_status()["prefill_hosts"] == [{"in_flight": 0}, {"in_flight": 0}]
    assert "spark-a" not in str(b.public_status()) and "fd00" not in str(b.public_status())
    # Least busy first, the configured order on a tie; each pick charges its host at once, so
    # bridges starting together spread.
    assert b._take_host(set()) == 0 and b._take_host(set()) == 1 and b._take_host(set()) == 0
    assert b._take_host({0}) == 1 and b._take_host({0, 1}) is None
    for i in (0, 1, 0, 1):
        b._charge(i, -1)
    assert b.public_status()["prefill_hosts"] == [{"in_flight": 0}, {"in_flight": 0}]


def test_data_parallel_ranks_are_targets_of_their_own():
    cfg = config.from_env({**GOOD, "PD_BRIDGE_PREFILL_URL": "http://a:1,http://b:2", "PD_BRIDGE_SEGMENTS": "a:7188,b:7300", "PD_BRIDGE_PREFILL_DP": "2"})
    assert [(t.url, t.segments_port, t.dp_rank, t.label) for t in cfg.prefill_hosts] == [
        ("http://a:1", 7188, 0, "prefill host 1 of 2 rank 0"), ("http://a:1", 7189, 1, "prefill host 1 of 2 rank 1"),
        ("http://b:2", 7300, 0, "prefill host 2 of 2 rank 0"), ("http://b:2", 7301, 1, "prefill host 2 of 2 rank 1")]  # fmt: skip
    one = config.from_env(GOOD)
    assert one.prefill_hosts[0].dp_rank is None and one.prefill_hosts[0].label == "prefill host"
    with pytest.raises(config.BridgeConfigError, match="PD_BRIDGE_PREFILL_DP"):
        config.from_env({**GOOD, "PD_BRIDGE_PREFILL_DP": "0"})
    with pytest.raises(config.BridgeConfigError, match="PD_BRIDGE_PREFILL_DP"):
        config.from_env({**GOOD, "PD_BRIDGE_SEGMENTS": "a:65535", "PD_BRIDGE_PREFILL_DP": "2"})


def test_pipeline_stages_are_pulled_from_consecutive_ports_of_each_rank():
    """A prefill host with P pipeline stages serves stage s of rank r on base + r x P + s."""
    cfg = config.from_env({**GOOD, "PD_BRIDGE_SEGMENTS": "a:7188", "PD_BRIDGE_PREFILL_DP": "2", "PD_BRIDGE_PREFILL_PP": "3"})
    assert [(t.segments_port, t.dp_rank, t.stages) for t in cfg.prefill_hosts] == [(7188, 0, 3), (7191, 1, 3)]
    assert config.from_env(GOOD).prefill_hosts[0].stages == 1
    for bad in ("0", "17", "two"):
        with pytest.raises(config.BridgeConfigError, match="PD_BRIDGE_PREFILL_PP"):
            config.from_env({**GOOD, "PD_BRIDGE_PREFILL_PP": bad})
    with pytest.raises(config.BridgeConfigError, match="pipeline stages"):
        config.from_env({**GOOD, "PD_BRIDGE_SEGMENTS": "a:65534", "PD_BRIDGE_PREFILL_PP": "4"})


@pytest.mark.parametrize(
    "extra, names",
    [
        ({"PD_BRIDGE_PREFILL_URL": "gpu-box:8000"}, "PD_BRIDGE_PREFILL_URL"),
        ({"PD_BRIDGE_TOKEN": ""}, "PD_BRIDGE_TOKEN"),
        ({"PD_BRIDGE_TOKEN_FILE": "/nonexistent/token"}, "PD_BRIDGE_TOKEN_FILE"),
        ({"PD_BRIDGE_SEGMENTS": "gpu-box"}, "PD_BRIDGE_SEGMENTS"),
        ({"PD_BRIDGE_SEGMENTS": "gpu-box:http"}, "PD_BRIDGE_SEGMENTS"),
        ({"PD_BRIDGE_SEGMENTS": "gpu-box:70000"}, "PD_BRIDGE_SEGMENTS"),
        ({"PD_BRIDGE_PREFILL_URL": "http://a:1,b:2"}, "PD_BRIDGE_PREFILL_URL"),
        ({"PD_BRIDGE_PREFILL_URL": "http://a:1,http://a:1"}, "PD_BRIDGE_PREFILL_URL"),
        ({"PD_BRIDGE_PREFILL_URL": "http://a:1,http://b:2", "PD_BRIDGE_SEGMENTS": "a:7188"}, "PD_BRIDGE_SEGMENTS"),
        ({"PD_BRIDGE_MIN_PROMPT_TOKENS": "lots"}, "PD_BRIDGE_MIN_PROMPT_TOKENS"),
        ({"PD_BRIDGE_MIN_UNCACHED_TOKENS": "0"}, "PD_BRIDGE_MIN_UNCACHED_TOKENS"),
        ({"PD_BRIDGE_TIMEOUT_S": "-1"}, "PD_BRIDGE_TIMEOUT_S"),
        ({"PD_BRIDGE_IDLE_S": "nan"}, "PD_BRIDGE_IDLE_S"),
        ({"PD_BRIDGE_WIRE_LANES": "0"}, "PD_BRIDGE_WIRE_LANES"),
        ({"PD_BRIDGE_WIRE_LANES": "17"}, "PD_BRIDGE_WIRE_LANES"),
    ],
)
def test_bad_settings_name_their_variable(extra, names):
    with pytest.raises(config.BridgeConfigError, match=names):
        config.from_env({**GOOD, **extra})


def test_misconfigured_bridge_serves_natively_and_says_why(monkeypatch):
    for k in list(__import__("os").environ):
        if k.startswith("PD_BRIDGE_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("PD_BRIDGE_PREFILL_URL", "http://gpu-box:8000")
    bridge = Bridge.from_env()  # no token
    verdict, nbytes, ids = asyncio.run(bridge.prepare(None, "any prompt", "req-1", multimodal=False))
    assert verdict.kind == "native" and nbytes == 0 and ids is None
    assert verdict.header().startswith('native; reason="bridge misconfigured: PD_BRIDGE_TOKEN')


def test_headers_stay_printable_ascii():
    v = Verdict("partial", 'stream broke: "quoted"\r\nX-Injected: yes ☃ ' + "x" * 500, blocks=3, of_blocks=8, tokens=768)
    h = v.header()
    assert h.startswith('partial 3/8; tokens=768; reason="stream broke: ?quoted?')
    assert all(32 <= ord(c) < 127 for c in h) and "\r" not in h and "\n" not in h and len(h) < 400
    assert Verdict("complete", blocks=7, of_blocks=7, tokens=1792).header() == "complete; blocks=7; tokens=1792"


def test_a_prefill_answer_that_says_no_capture_was_made_is_read():
    from pd_bridge_omlx.bridge import _refused

    why = "meant for data-parallel rank 1, ran on rank 0"
    assert _refused({"kv_transfer_params": {"pd_capture": {"request_id": "c", "refused": why}}}) == why
    for answer in ({}, {"kv_transfer_params": None}, {"kv_transfer_params": {"pd_capture": {"prompt_cached_tokens": 0}}}, [], "x"):
        assert _refused(answer) is None
    assert len(_refused({"kv_transfer_params": {"pd_capture": {"refused": "x" * 5000}}})) == 300


def test_same_or_different_weights_from_the_prefill_hosts_word(models):
    """The verdict's ``weights``: the decoder model's fingerprint against the one the prefill
    host reports; anything not shaped like a fingerprint leaves it unknown, and ``different``
    is the only relation the header says."""
    from pd_bridge_omlx._native import model_fingerprint

    b = Bridge(config.from_env(GOOD))
    d = str(models / "tiny-mla")
    b.fingerprint(d)
    mine = model_fingerprint(d)
    assert b.public_status()["model"]["fingerprint"] == mine and "bf16" in b.public_status()["model"]["formats"]
    assert b.weights_relation(d, mine) == "same"
    assert b.weights_relation(d, "sha256:" + "0" * 64) == "different"
    assert b.weights_relation(d, None) == "unknown" and b.weights_relation("/elsewhere", mine) == "unknown"
    v = Verdict("complete", blocks=7, tokens=1792, weights="different")
    assert v.header() == "complete; blocks=7; tokens=1792; weights=different"
    assert Verdict("complete", blocks=7, tokens=1792, weights="same").header() == "complete; blocks=7; tokens=1792"
