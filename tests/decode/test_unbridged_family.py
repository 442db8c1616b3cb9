"""A model of a family that is not bridged — DeepSeek-V4.1: its cache math is in pd-bridge, but
oMLX's block format for it is not — is refused on the decode host, saying why, before anything
is asked of the prefill host, and its prompt is served natively.

The refusal comes from the family's entry in the core's family table (``Family::not_bridged``),
read when the decoder's ``config.json`` is: the decode host meets it where the bridge loads the
model's weights for their fingerprint (``Bridge.fingerprint`` → ``Weights.load``), the first
thing an admitted bridge does. The config is the tiny V4.1 model's own (``tests/tiny_v41.py``).
"""

from __future__ import annotations

import asyncio
import json

import pytest

import engines  # noqa: E402  (tests/ is on the path: conftest)

engines.require("pd_bridge_omlx")

import tiny_v41  # noqa: E402
from pd_bridge_omlx import ConfigError, Weights  # noqa: E402
from pd_bridge_omlx import config as config_mod  # noqa: E402
from pd_bridge_omlx.bridge import Bridge  # noqa: E402


@pytest.fixture
def v41_dir(tmp_path):
    d = tmp_path / "tiny-v41"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_v41.V41_CONFIG))
    return d


def _says_why(text: str) -> None:
    assert '"deepseek_v41"' in text and "not bridged yet" in text, text
    assert "oMLX's block format" in text and "prefills natively" in text, text


def test_the_decoders_weights_are_refused_naming_the_missing_block_format(v41_dir):
    with pytest.raises(ConfigError) as e:
        Weights.load(str(v41_dir))
    _says_why(str(e.value))


def test_an_admitted_bridge_declines_before_asking_the_prefill_host(v41_dir):
    # Nothing listens on the prefill host's address: a bridge that got past the model would
    # decline for the host ("prefill host unhealthy"), not for the model.
    cfg = config_mod.from_env({"PD_BRIDGE_PREFILL_URL": "http://127.0.0.1:9", "PD_BRIDGE_TOKEN": "t", "PD_BRIDGE_WEIGHTS": str(v41_dir)})
    bridge = Bridge(cfg)
    slot = bridge._slots.try_take()
    try:
        # With PD_BRIDGE_WEIGHTS set the engine, scheduler and caches are not looked at before
        # the fingerprint, which is where the model is refused.
        verdict, nbytes, ids = asyncio.run(bridge._admitted(None, None, None, None, list(range(600)), 2, 256, "req-v41", slot, 0.0))
    finally:
        slot.done()
    assert verdict.kind == "declined" and nbytes == 0, verdict.header()
    assert "cannot be fingerprinted" in verdict.reason, verdict.reason
    _says_why(verdict.reason)
    # The refusal is remembered: later prompts of this model are declined without loading again.
    with pytest.raises(ConfigError):
        bridge.fingerprint(str(v41_dir))
