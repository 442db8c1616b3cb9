"""The oMLX wheel's native module: its shipped type stub matches what it exports, and `feed`
reads any contiguous buffer in place."""

from pathlib import Path

import numpy as np
import pytest

import stubs  # tests/ is on the path: conftest
from pd_bridge_omlx import _native


def test_native_stub_matches_the_module():
    stubs.assert_stub_matches(_native)


def test_feed_takes_any_contiguous_buffer(models):
    w = _native.Weights.load(str(models / "tiny-mla"))
    rows = np.random.default_rng(1).standard_normal((40, w.hidden_size)).astype(np.float32)
    bits = (rows.view(np.uint32) >> 16).astype(np.uint16)
    raw = bits.tobytes()
    odd = bytearray(b"\0" + raw)

    def state(data):
        b = _native.CacheBuilder(w, 16)
        b.feed(0, 0, data)
        return b.snapshot(0)

    want = state(raw)
    for data in (bytearray(raw), memoryview(raw), bits, bits.view(np.uint8), memoryview(odd)[1:]):
        assert state(data) == want, type(data)
    b = _native.CacheBuilder(w, 16)
    with pytest.raises(_native.InputError, match="not C-contiguous"):
        b.feed(0, 0, np.asfortranarray(bits))
    with pytest.raises(_native.InputError, match="items are 4 bytes"):
        b.feed(0, 0, rows)
    with pytest.raises(_native.InputError, match="list is not a buffer"):
        b.feed(0, 0, list(raw))
    assert b.processed(0) == 0
