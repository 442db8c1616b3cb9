"""The oMLX wheel's native module: it imports, and bad input gets a typed, specific error."""

import json
import re
import shutil

import pytest

import pd_bridge_omlx
from pd_bridge_omlx import CacheBuilder, ConfigError, InputError, PdBridgeError, Weights, WeightsError


def test_wheel_imports_and_is_off_by_default(monkeypatch):
    monkeypatch.delenv("PD_BRIDGE_OMLX", raising=False)
    assert pd_bridge_omlx.__version__
    assert not pd_bridge_omlx.enabled()
    monkeypatch.setenv("PD_BRIDGE_OMLX", "1")
    assert pd_bridge_omlx.enabled()


def test_fingerprint_is_stable_and_model_specific(models):
    a = Weights.load(str(models / "tiny-v4-bf16"))
    b = Weights.load(str(models / "tiny-v4-bf16"))
    c = Weights.load(str(models / "tiny-v4-mxfp8"))
    assert a.fingerprint == b.fingerprint and a.fingerprint.startswith("sha256:")
    assert a.fingerprint != c.fingerprint
    assert (a.family, a.num_layers, a.hidden_size) == ("deepseek_v4", 5, 256)


def copy_model(models, tmp_path, name="tiny-v4-bf16"):
    dst = tmp_path / name
    shutil.copytree(models / name, dst)
    return dst


def test_fingerprint_covers_config_values_the_math_uses(models, tmp_path):
    d = copy_model(models, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["compress_rope_theta"] = 150000.0
    (d / "config.json").write_text(json.dumps(cfg))
    assert Weights.load(str(d)).fingerprint != Weights.load(str(models / "tiny-v4-bf16")).fingerprint


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda c: c.pop("hidden_size"), "hidden_size"),
        (lambda c: c.update(model_type="llama"), "model_type"),
        (lambda c: c.update(compress_ratios=[0, 0, 4, 7, 4]), "compress_ratios[3]"),
        (lambda c: c.update(rope_scaling={"type": "dynamic"}), "rope_scaling.type"),
        (lambda c: c.update(head_dim="wide"), "head_dim"),
    ],
)
def test_bad_config_names_the_field(models, tmp_path, edit, field):
    d = copy_model(models, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=re.escape(f"config {field}:")):
        Weights.load(str(d))


def test_truncated_weight_file(models, tmp_path):
    d = copy_model(models, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(WeightsError, match="model.safetensors"):
        Weights.load(str(d))


def test_garbage_weight_file(models, tmp_path):
    d = copy_model(models, tmp_path)
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(WeightsError):
        Weights.load(str(d))


def test_wrong_model_dims(models, tmp_path):
    d = copy_model(models, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["head_dim"] = 192  # the file's wkv is [128, 256]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match=r"model.layers.0.attn.wkv.weight: shape \[128, 256\], expected \[192, 256\]"):
        Weights.load(str(d))


def test_missing_directory():
    with pytest.raises(OSError):
        Weights.load("/nonexistent/model")


def test_feed_rejections(models):
    w = Weights.load(str(models / "tiny-v4-bf16"))
    b = CacheBuilder(w, 512)
    row = bytes(2 * w.hidden_size)
    with pytest.raises(InputError, match="5 layers"):
        b.feed(9, 0, row)
    with pytest.raises(InputError, match="width 256"):
        b.feed(0, 0, row[:-2])
    with pytest.raises(InputError, match="starts at token 3 but 0"):
        b.feed(0, 3, row)
    with pytest.raises(InputError, match="whole number of bf16"):
        b.feed(0, 0, b"\x00")
    b.feed(0, 0, row * 2)
    assert b.processed(0) == 2
    with pytest.raises(ConfigError):
        CacheBuilder(w, 0)
    assert issubclass(InputError, PdBridgeError) and issubclass(WeightsError, PdBridgeError)


def test_hooks_refuse_an_unsupported_omlx(monkeypatch):
    """The installed oMLX is told apart by the distribution that ships it, not by its version
    string (the fork calls itself 0.7.0); anything else is refused naming what is supported."""
    import omlx

    from pd_bridge_omlx import hooks, versions

    found = versions.installed_distributions()
    entry = versions.match(found)
    assert hooks.check_version() == entry.describe()
    assert (entry.distribution, entry.key) in (("omlx", "upstream-0.6.3"), ("flyto-mlx", "fork-0.7.0")), found
    monkeypatch.setattr(omlx, "__version__", "0.9.1")  # the string alone changes nothing
    assert versions.match(found) is entry
    with pytest.raises(versions.UnsupportedOmlxError, match=r"supports omlx 0\.6\.3rc2/0\.6\.3 .*flyto-mlx 0\.7\.0 .*; this is omlx 0\.7\.0"):
        versions.match({"omlx": "0.7.0"})  # upstream 0.7.0: not an entry yet
    with pytest.raises(versions.UnsupportedOmlxError, match=r"this is flyto-mlx 0\.6\.0"):
        versions.match({"flyto-mlx": "0.6.0"})
    with pytest.raises(versions.UnsupportedOmlxError, match="no installed distribution provides"):
        versions.match({})


def test_autoload_is_inert_without_env_var():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PD_BRIDGE_OMLX"}
    code = "import sys; print(any(type(f).__name__ == '_AfterImport' for f in sys.meta_path), 'pd_bridge_omlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PD_BRIDGE_OMLX": "1"}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
