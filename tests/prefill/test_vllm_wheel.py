"""The vLLM wheel: importable without torch or CUDA, entry point declared, inert when off."""

import importlib.metadata
import os
import subprocess
import sys


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

    pytest.importorskip("vllm", reason="vLLM is not installed in this venv")
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
        pytest.skip("PD_BRIDGE_WHEELS does not point at the built wheels (run via tests/bridge.sh)")
    venv = tmp_path / "venv310"
    subprocess.run([py310, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheels[0]], check=True)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys, pd_bridge_vllm; pd_bridge_vllm.register(); print(sys.version_info[:2], pd_bridge_vllm.__version__)"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.startswith("(3, 10)"), out.stdout
