"""Mac models as users make them: a bf16 tiny model quantized by mlx-lm's own ``convert`` (every
format MLX writes) or by oMLX's own quantizer (oQ, ``omlx.oq``), each an MLX model directory that
oMLX serves.

``FORMATS`` names each conversion by what a user types: ``mlx_lm.convert -q --q-bits 4
--q-group-size 64`` is ``affine-4-g64``; ``--quant-predicate mixed_3_6`` is ``mixed_3_6``;
``--q-mode mxfp4`` is ``mxfp4``. ``oq4`` / ``oq8`` are oQ levels 4 and 8.

oQ measures each layer's sensitivity by running calibration text through the model (minutes on
these tiny models); the tests hand it a flat sensitivity map instead (its
``sensitivity_map_override``), which skips only that measurement: the level's own bit allocation
and protections, its quantizer and its writer are the ones users run. oQ on the tiny DeepSeek-V4
(whose routed experts are already MXFP4) writes a config its own loader refuses (the experts
lose their MXFP4 entries), so oQ is used on the MLA model only.

    python tests/mac_models.py SRC_MODEL_DIR OUT_ROOT FORMAT...
    python tests/mac_models.py parity MODELS_DIR OUT_ROOT    # the parity table of BENCHMARKS.md
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# name -> mlx_lm.convert's keyword arguments (quantize=True implied)
CONVERT = {
    "affine-4-g64": dict(q_bits=4, q_group_size=64),  # mlx-lm's default
    "affine-8-g32": dict(q_bits=8, q_group_size=32),
    "affine-6-g128": dict(q_bits=6, q_group_size=128),
    "affine-2-g32": dict(q_bits=2, q_group_size=32),
    "affine-3-g64": dict(q_bits=3, q_group_size=64),
    "affine-5-g128": dict(q_bits=5, q_group_size=128),
    "mixed_3_6": dict(quant_predicate="mixed_3_6"),
    "mxfp4": dict(q_mode="mxfp4"),
    "mxfp8": dict(q_mode="mxfp8"),
    "nvfp4": dict(q_mode="nvfp4"),
}
OQ = {"oq4": 4, "oq8": 8}
FORMATS = [*CONVERT, *OQ]


def _source_with_tokenizer(src: Path, work: Path) -> Path:
    """mlx-lm's convert loads a tokenizer with the model: give the source one (the tiny models'
    locally trained BPE) in a copy."""
    import omlx_server

    if (src / "tokenizer.json").exists():
        return src
    copy = work / f"{src.name}-src"
    if not copy.exists():
        shutil.copytree(src, copy)
        omlx_server.add_tokenizer(copy)
    return copy


def make(src: Path, out: Path, fmt: str) -> Path:
    """Quantize the bf16 MLX model ``src`` into ``out`` the way ``fmt`` names; returns ``out``."""
    import tiny_models

    tiny_models._apply_v4_patch()  # oMLX's DeepSeek-V4 model, as `omlx serve` loads it
    src, out = Path(src), Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    source = _source_with_tokenizer(src, out.parent)
    if fmt in CONVERT:
        from mlx_lm.convert import convert

        convert(str(source), str(out), quantize=True, **CONVERT[fmt])
    elif fmt in OQ:
        import json

        from omlx.oq import quantize_oq_streaming

        layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
        quantize_oq_streaming(str(source), str(out), OQ[fmt], sensitivity_map_override={i: 1.0 for i in range(layers)})
    else:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    return out


V4_FORMATS = ["affine-4-g64", "mixed_3_6", "mxfp4", "nvfp4"]


def parity_table(models: Path, root: Path, tokens: int = 700, step: int = 256) -> None:
    """Each format made from the tiny models, compared with MLX's own forward (tests/parity.py)."""
    import mlx.core as mx
    import mlx_lm

    import parity
    from pd_bridge_omlx._native import Weights

    print(f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, oMLX format {parity.omlx_format()}; {tokens}-token prompt, {step}-token steps, then re-chunked")
    print("| model | made by | format of the cache projections | arrays bit-exact | elements identical | worst |")
    print("|---|---|---|---|---|---|")
    for fam, fmts in (("mla", FORMATS), ("v4", V4_FORMATS)):
        for f in fmts:
            d = make(models / ("tiny-mla" if fam == "mla" else "tiny-v4-bf16"), root / f"{fam}-{f}", f)
            kinds = sorted({x for _, x in Weights.load(str(d)).formats})
            t = (parity.run_mla if fam == "mla" else parity.run_v4)(d, n_tokens=tokens, step=step).tally
            by = "oMLX oQ" if f in OQ else "mlx_lm.convert"
            print(f"| {'MLA' if fam == 'mla' else 'DeepSeek-V4'} | {by} `{f}` | {', '.join(kinds)} | {t.arrays_identical}/{t.arrays} | "
                  f"{t.elements_identical}/{t.elements} | {t.worst_ulp} ulp |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "parity":
        parity_table(Path(sys.argv[2]), Path(sys.argv[3]))
        sys.exit(0)
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    for f in sys.argv[3:]:
        print(make(Path(sys.argv[1]), Path(sys.argv[2]) / f, f))
