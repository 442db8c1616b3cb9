"""The Mac models people run (issue 35): the tiny models quantized by mlx-lm's own ``convert`` and
by oMLX's own oQ (``tests/mac_models.py``), read by the core and computed bit for bit as MLX's own
forward computes them, its CPU ``quantized_matmul`` included.

Every format MLX writes is covered on the MLA model (affine at every bit width 2-8 and every group
32/64/128, mixed_3_6, mxfp4, mxfp8, nvfp4, oQ levels 4 and 8); DeepSeek-V4 (whose compressors'
projections are quantized too) with mlx-lm's default, a mixed predicate and the two FP4 modes.
The matrix runs against upstream oMLX, the decode target; the fork runs mlx-lm's default only.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mac_models
import parity
from pd_bridge_omlx._native import ConfigError, Weights, WeightsError, export_weights

UPSTREAM = parity.omlx_format().startswith("upstream")
TOKENS, STEP = 400, 256  # past the ratio-128 pools, a whole step and an odd tail

# The quick lane (PD_BRIDGE_QUICK=1) takes one format per family: the matrix is minutes of MLX
# forwards; the test command runs it whole.
QUICK = os.environ.get("PD_BRIDGE_QUICK") == "1"
MLA_FORMATS = mac_models.FORMATS[:1] if QUICK else mac_models.FORMATS
V4_FORMATS = mac_models.V4_FORMATS[:1] if QUICK else mac_models.V4_FORMATS


@pytest.fixture(scope="session")
def mac_model(models, tmp_path_factory):
    made: dict[tuple[str, str], Path] = {}
    root = tmp_path_factory.mktemp("mac-models")

    def get(family: str, fmt: str) -> Path:
        if not UPSTREAM and fmt != "affine-4-g64":
            pytest.skip("the format matrix runs against upstream oMLX (the decode target); the fork runs affine-4-g64")
        key = (family, fmt)
        if key not in made:
            src = models / ("tiny-mla" if family == "mla" else "tiny-v4-bf16")
            made[key] = mac_models.make(src, root / f"{family}-{fmt}", fmt)
        return made[key]

    return get


def expected_format(fmt: str, module: str) -> set[str]:
    if fmt.startswith("affine-"):
        _, bits, group = fmt.split("-")
        return {f"affine {bits}-bit g{group[1:]}"}
    if fmt == "mixed_3_6":
        # mlx-lm's mixed predicate: 6 bits for some layers' attention, 3 for the rest (group 64).
        return {"affine 3-bit g64", "affine 6-bit g64"}
    if fmt in ("oq4", "oq8"):
        return {f"affine {b}-bit g64" for b in (4, 5, 6, 8)}
    return {fmt}


def check_formats(model_dir: Path, fmt: str) -> Weights:
    w = Weights.load(str(model_dir))
    seen = {f for _, f in w.formats}
    assert seen and seen <= expected_format(fmt, ""), (fmt, w.formats)
    assert "bf16" not in seen, f"{fmt}: the converter left a cache projection unquantized: {w.formats}"
    return w


def report(r):
    print("\n" + r.tally.line(r.name))
    for m in r.tally.mismatched[:10]:
        print("    " + m)


@pytest.mark.parametrize("fmt", MLA_FORMATS)
def test_mla_is_bit_exact_in_every_format(mac_model, fmt):
    d = mac_model("mla", fmt)
    check_formats(d, fmt)
    r = parity.run_mla(d, n_tokens=TOKENS, step=STEP)
    report(r)
    assert r.tally.arrays >= 18
    assert r.tally.bit_exact, r.tally.mismatched[:10]


@pytest.mark.parametrize("fmt", V4_FORMATS)
def test_deepseek_v4_is_bit_exact_in_every_format(mac_model, fmt):
    d = mac_model("v4", fmt)
    w = check_formats(d, fmt)
    # The compressors' and the indexer's projections are quantized too, not only the window's.
    assert any(".compressor.wgate" in m for m, _ in w.formats)
    r = parity.run_v4(d, n_tokens=TOKENS, step=STEP)
    report(r)
    assert r.tally.arrays >= 30  # 34 on the fork's caches (no carried overlap), 44 upstream
    assert r.tally.bit_exact, r.tally.mismatched[:10]


def test_mixed_predicate_keeps_per_module_formats(mac_model):
    """mlx-lm's mixed_3_6 writes per-module entries with ``group_size: null`` (the mode's
    default); the core reads both widths, as the config says, module by module."""
    d = mac_model("mla", "mixed_3_6")
    cfg = json.loads((d / "config.json").read_text())["quantization"]
    w = Weights.load(str(d))
    for module, fmt in w.formats:
        entry = cfg.get(module)
        bits = entry["bits"] if isinstance(entry, dict) else cfg["bits"]
        assert fmt == f"affine {bits}-bit g64", (module, entry, fmt)
    assert {f for _, f in w.formats} == {"affine 3-bit g64", "affine 6-bit g64"}


@pytest.mark.parametrize("fmt", ["affine-4-g64", "nvfp4", "oq4"])
def test_export_weights_keeps_format_and_fingerprint(mac_model, fmt, tmp_path):
    d = mac_model("mla", fmt)
    src = Weights.load(str(d))
    fp = export_weights(str(d), str(tmp_path / "w"))
    out = Weights.load(str(tmp_path / "w"))
    assert fp == src.fingerprint == out.fingerprint
    assert out.formats == src.formats
    cli = Path(sys.executable).with_name("pd-bridge")
    res = subprocess.run([str(cli), "export-weights", str(d), str(tmp_path / "w2")], capture_output=True, text=True, check=True)
    assert f"fingerprint {fp}" in res.stdout
    fmts = res.stdout.split("formats ", 1)[1]
    assert "kv_a_proj_with_mqa" in fmts and src.formats[0][1] in fmts, res.stdout


def test_same_values_other_format_fingerprint_differently(mac_model):
    a = Weights.load(str(mac_model("mla", "affine-4-g64")))
    b = Weights.load(str(mac_model("mla", "mxfp4")))
    assert a.fingerprint != b.fingerprint


def test_a_float16_conversion_is_refused_naming_the_fix(models, tmp_path):
    """A model converted with ``--dtype float16`` computes its cache in float16, which oMLX's bf16
    blocks of this family do not hold: refused at load, naming the module, the dtype and the fix."""
    from mlx_lm.convert import convert

    src = mac_models._source_with_tokenizer(models / "tiny-mla", tmp_path)
    convert(str(src), str(tmp_path / "f16-4bit"), quantize=True, q_bits=4, q_group_size=64, dtype="float16")
    with pytest.raises(WeightsError) as e:
        Weights.load(str(tmp_path / "f16-4bit"))
    msg = str(e.value)
    assert "kv_a_proj_with_mqa" in msg and "F16" in msg and "bfloat16" in msg, msg


@pytest.mark.parametrize(
    "entry, words",
    [
        ({"group_size": 64, "bits": 4, "mode": "int4"}, ["int4"]),
        ({"group_size": 48, "bits": 4, "mode": "affine"}, ["group 48"]),
        ({"group_size": 32, "bits": 8, "mode": "mxfp4"}, ["mxfp4", "bits 8"]),
    ],
)
def test_a_format_mlx_does_not_write_is_refused_by_name(mac_model, tmp_path, entry, words):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(mac_model("mla", "affine-4-g64"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"]["model.layers.1.self_attn.kv_a_proj_with_mqa"] = entry
    cfg["quantization_config"] = cfg["quantization"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        Weights.load(str(d))
    msg = str(e.value)
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa" in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("fmt", ["affine-4-g64", "nvfp4"])
def test_export_checkpoint_is_the_mac_models_weights(mac_model, fmt, tmp_path):
    """The checkpoint for the GPU host holds exactly ``mx.dequantize`` of every quantized module
    under Hugging Face's names; MLX loading it back (its sanitize splits kv_b_proj again) has the
    Mac model's weights, dequantized, value for value; it reports the Mac model's identity until
    it is edited."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import tiny_models
    from pd_bridge_omlx._native import export_checkpoint, model_fingerprint

    d = mac_model("mla", fmt)
    fp, dequantized, tensors = export_checkpoint(str(d), str(tmp_path / "ck"))
    assert fp == model_fingerprint(str(d)) == model_fingerprint(str(tmp_path / "ck"))
    assert dequantized and tensors > 0
    hf = mx.load(str(tmp_path / "ck" / "model.safetensors"))
    assert any(k.endswith("kv_b_proj.weight") for k in hf) and not any(k.endswith((".scales", ".biases", "embed_q.weight")) for k in hf)
    mac = dict(tree_flatten(tiny_models.load(d).parameters()))
    back = dict(tree_flatten(tiny_models.load(tmp_path / "ck").parameters()))
    checked = 0
    for name, w in back.items():
        module = name.rsplit(".", 1)[0]
        if f"{module}.scales" in mac:
            q = mac[f"{module}.weight"], mac[f"{module}.scales"], mac.get(f"{module}.biases")
            ref = mx.dequantize(*q, group_size=16 if fmt == "nvfp4" else 64, bits=4, mode="nvfp4" if fmt == "nvfp4" else "affine")
            checked += 1
        else:
            ref = mac[name]
        assert ref.dtype == w.dtype and mx.array_equal(ref, w).item(), name
    assert checked >= 10
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["pd_bridge_source"]["checkpoint_digest"] = "sha256:" + "0" * 64  # as if edited
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(str(tmp_path / "ck")) != fp


def test_export_checkpoint_refuses_deepseek_v4(models, tmp_path):
    from pd_bridge_omlx._native import export_checkpoint

    with pytest.raises(ConfigError, match="deepseek_v4"):
        export_checkpoint(str(models / "tiny-v4-bf16"), str(tmp_path / "ck"))


def test_both_doctors_name_the_formats_and_the_route(mac_model, models, tmp_path, capsys):
    """The GPU host's doctor prints the cache projections' formats and says whether the checkpoint
    vLLM serves is the Mac model's (its export-checkpoint) or another one (the bf16 source)."""
    from pd_bridge_omlx._native import export_checkpoint

    from pd_bridge_vllm.doctor import check_weights

    d = mac_model("mla", "affine-4-g64")
    w = tmp_path / "w"
    export_weights(str(d), str(w))
    export_checkpoint(str(d), str(tmp_path / "ck"))
    assert check_weights(str(w), str(tmp_path / "ck"))
    same = capsys.readouterr().out
    assert "decoder weight formats: affine 4-bit g64 x3" in same and "same weights" in same, same
    assert check_weights(str(w), str(models / "tiny-mla"))
    other = capsys.readouterr().out
    assert "different weights" in other and "pd-bridge export-checkpoint" in other, other


def test_a_sharded_checkpoint_reads_as_one(mac_model, tmp_path):
    """mlx-lm shards big models (``model-0000N-of-0000M.safetensors`` and an index): the same
    tensors in two shards give the same weights, formats and fingerprints."""
    import shutil

    import mlx.core as mx

    from pd_bridge_omlx._native import export_checkpoint, model_fingerprint

    d = mac_model("mla", "affine-4-g64")
    s = tmp_path / "sharded"
    shutil.copytree(d, s, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = mx.load(str(d / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for f, part in halves.items():
        mx.save_safetensors(str(s / f), {k: tensors[k] for k in part}, metadata={"format": "mlx"})
    (s / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {k: f for f, part in halves.items() for k in part}}))
    a, b = Weights.load(str(d)), Weights.load(str(s))
    assert (a.fingerprint, a.formats) == (b.fingerprint, b.formats)
    assert model_fingerprint(str(d)) == model_fingerprint(str(s))
    export_checkpoint(str(s), str(tmp_path / "ck"))
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.safetensors")) == sorted(halves)
