"""The vLLM wheel: importable without torch or CUDA, entry point declared, inert when off."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "pd_bridge"]
    assert ours and ours[0].value == "pd_bridge_vllm:register"


def test_import_and_register_touch_no_torch_or_cuda():
    code = (
        "import sys, pd_bridge_vllm; pd_bridge_vllm.register(); "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'cudarc', 'pycuda', 'cupy')]; "
        "print(pd_bridge_vllm.__version__, bad)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PD_BRIDGE_VLLM"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("[]"), out.stdout


def test_register_without_env_var_does_nothing(monkeypatch, caplog):
    import pd_bridge_vllm

    monkeypatch.delenv("PD_BRIDGE_VLLM", raising=False)
    pd_bridge_vllm.register()
    assert not pd_bridge_vllm._registered
    assert not caplog.records


def test_register_with_env_var_installs_the_tap_once(monkeypatch):
    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import engines

    engines.require("vllm")
    import pd_bridge_vllm
    from pd_bridge_vllm import tap

    monkeypatch.setenv("PD_BRIDGE_VLLM", "1")
    monkeypatch.setattr(pd_bridge_vllm, "_registered", False)
    try:
        pd_bridge_vllm.register()
        assert pd_bridge_vllm._registered and tap.installed()
        pd_bridge_vllm.register()  # idempotent: a second call changes nothing
        assert tap.installed()
    finally:
        tap.uninstall()


def test_fingerprint_error_is_typed(tmp_path):
    import pd_bridge_vllm

    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4"}')
    try:
        pd_bridge_vllm.weights_fingerprint(str(tmp_path))
    except pd_bridge_vllm.ConfigError as e:
        assert "hidden_size" in str(e) or "num_hidden_layers" in str(e)
    else:
        raise AssertionError("expected ConfigError")


def _python310():
    import shutil

    for cand in (shutil.which("python3.10"), os.path.expanduser("~/.pyenv/versions/3.10.13/bin/python3.10")):
        if cand and os.path.exists(cand):
            try:
                out = subprocess.run([cand, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True, timeout=30)
            except OSError:
                continue
            if out.returncode == 0 and out.stdout.strip() == "(3, 10)":
                return cand
    return None


def test_wheel_imports_on_python_310(tmp_path):
    """vLLM supports Python 3.10, so the abi3 wheel must load there too."""
    import glob

    import pytest

    py310 = _python310()
    if py310 is None:
        pytest.skip("no Python 3.10 interpreter on this machine")
    wheels = glob.glob(os.path.join(os.environ.get("PD_BRIDGE_WHEELS", ""), "vllm_plugin", "pd_bridge_vllm-*.whl"))
    if not wheels:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import engines

        engines.missing("PD_BRIDGE_WHEELS does not point at the built wheels (run via tests/bridge.sh)")
    venv = tmp_path / "venv310"
    subprocess.run([py310, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheels[0]], check=True)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys, pd_bridge_vllm; pd_bridge_vllm.register(); print(sys.version_info[:2], pd_bridge_vllm.__version__)"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.startswith("(3, 10)"), out.stdout


def _tiny_mla_weights(d):
    """A one-layer MLA decoder-weights directory (config.json + safetensors), numpy only."""
    import json
    import struct

    import numpy as np

    (d / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "hidden_size": 32, "num_hidden_layers": 1, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
    }))
    rng = np.random.default_rng(0)

    def bf16(a):
        return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()

    tensors = {
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ([24, 32], bf16(rng.standard_normal((24, 32)) * 0.2)),
        "model.layers.0.self_attn.kv_a_layernorm.weight": ([16], bf16(1 + 0.1 * rng.standard_normal(16))),
    }
    header, blob = {}, b""
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    h = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + blob)
    return d


def test_feed_takes_any_contiguous_buffer(tmp_path):
    """bytes, bytearray, memoryview (aligned or not) and numpy arrays are read in place and give
    the same segments; non-contiguous, wide-item and non-buffer inputs are refused by name."""
    import numpy as np
    import pytest

    import pd_bridge_vllm
    from pd_bridge_vllm import _native

    w = _native.Weights.load(str(_tiny_mla_weights(tmp_path)))
    rows = np.random.default_rng(1).standard_normal((32, 32)).astype(np.float32)
    bits = (rows.view(np.uint32) >> 16).astype(np.uint16)
    raw = bits.tobytes()
    odd = bytearray(b"\0" + raw)  # a memoryview into it starts at an odd address: the copy path

    def digest(data):
        # Segment headers carry the request id: the same one each time, on its own server.
        cap = _native.Capture(w, "r", 32, 16, _native.SegmentServer("127.0.0.1:0", b"t" * 32))
        cap.feed(0, 0, data)
        return cap.segments_digest

    inputs = {
        "bytes": raw, "bytearray": bytearray(raw), "memoryview": memoryview(raw), "numpy uint16": bits,
        "numpy uint8": bits.view(np.uint8), "memoryview unaligned": memoryview(odd)[1:],
    }
    got = {name: digest(data) for name, data in inputs.items()}
    assert got["bytes"][0] == 2, got
    assert len(set(got.values())) == 1, got

    cap = _native.Capture(w, "bad", 32, 16, _native.SegmentServer("127.0.0.1:0", b"t" * 32))
    with pytest.raises(pd_bridge_vllm.PdBridgeError, match="not C-contiguous"):
        cap.feed(0, 0, np.asfortranarray(bits))
    with pytest.raises(pd_bridge_vllm.PdBridgeError, match="items are 4 bytes"):
        cap.feed(0, 0, rows)
    with pytest.raises(pd_bridge_vllm.PdBridgeError, match="list is not a buffer"):
        cap.feed(0, 0, list(raw))
    with pytest.raises(pd_bridge_vllm.PdBridgeError, match="whole number of bf16"):
        cap.feed(0, 0, raw[:-1])


def test_native_stub_matches_the_module():
    """The shipped _native.pyi declares exactly what the built module exports, members included."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import stubs

    from pd_bridge_vllm import _native

    stubs.assert_stub_matches(_native)
