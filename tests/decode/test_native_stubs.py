"""The oMLX wheel's native module: its shipped type stub matches what it exports, and `feed`
reads any contiguous buffer in place."""

import ast
from pathlib import Path

import numpy as np
import pytest

from pd_bridge_omlx import _native


def _public(obj) -> set[str]:
    return {n for n in vars(obj) if not n.startswith("_")}


def stub_names(stub: Path) -> dict[str, set[str] | None]:
    """{top-level name: member names (classes) or None} declared by a .pyi stub."""
    out: dict[str, set[str] | None] = {}
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = None
    return out


def test_native_stub_matches_the_module():
    stub = Path(_native.__file__).with_name("_native.pyi")
    assert stub.is_file(), f"{stub} is not installed with the wheel"
    declared = stub_names(stub)
    assert set(declared) == _public(_native), set(declared) ^ _public(_native)
    for name, members in declared.items():
        obj = getattr(_native, name)
        if members is not None and not issubclass(obj, BaseException):
            assert members == _public(obj), (name, members ^ _public(obj))


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
