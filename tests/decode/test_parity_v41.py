"""DeepSeek-V4.1's cache math against mlx-lm's own ``LayerCache``, on a tiny random model
(issue 22 item 4).

mlx-lm's real ``deepseek_v41`` forward (mlx-lm 0.32.2 or later, on mlx 0.32.2 or later) runs a
1,111-token prompt in 255-token steps (odd: the unfinished ratio-2 group crosses calls); every
layer's attention input is captured and fed to the core, and every array of every layer's cache
— the windows of all 8 layers, and on the KV sources the compressed KV, the index keys and the
pending rows — is compared bit for bit after every step, once more after re-cutting the prompt
into random chunks, and after resuming from a carry state made from mlx-lm's own cache at two
step boundaries (one with a pending row, one without).
"""

import os
from pathlib import Path

import pytest

import engines

mx = engines.require("mlx.core")
engines.require("mlx_lm.models.deepseek_v41")
if tuple(int(p) for p in mx.__version__.split(".")[:3] if p.isdigit()) < (0, 32, 2):
    engines.missing(f"mlx-lm's deepseek_v41 needs mlx >= 0.32.2 (its gather_qmm takes global_scale); this is mlx {mx.__version__}")
native = engines.require("pd_bridge_omlx._native")
if not hasattr(native, "V41CacheBuilder"):
    engines.missing("the installed pd_bridge_omlx wheel predates V41CacheBuilder: rebuild it")

import parity_v41  # noqa: E402
import tiny_v41  # noqa: E402


def tiny(tmp_path_factory, name: str, attention: str) -> Path:
    """A tiny V4.1 model: the one in ``PD_BRIDGE_MODELS`` if generated there, or a fresh one."""
    given = os.environ.get("PD_BRIDGE_MODELS")
    if given and (Path(given) / name / "config.json").exists():
        return Path(given) / name
    return tiny_v41.make_v41(tmp_path_factory.mktemp("models") / name, attention=attention)


@pytest.fixture(scope="module")
def v41_model(tmp_path_factory) -> Path:
    return tiny(tmp_path_factory, tiny_v41.NAME, "bf16")


@pytest.fixture(scope="module")
def v41_mxfp8_model(tmp_path_factory) -> Path:
    return tiny(tmp_path_factory, tiny_v41.NAME_MXFP8, "mxfp8")


@pytest.fixture(scope="module")
def v41(v41_model):
    return parity_v41.run_v41(v41_model)


def report(r):
    print("\n" + r.tally.line(r.name) + f"  ({r.steps} steps)")
    for m in r.tally.mismatched[:10]:
        print("    " + m)


def test_deepseek_v41_is_bit_exact(v41):
    report(v41)
    t = v41.tally
    # 8 windows after each of 5 steps, the pools of layers 1, 4 and 7 (pending rows only where a
    # group is unfinished), then the re-chunked and the two resumed states.
    assert v41.steps == 5
    assert t.arrays >= 110
    assert t.bit_exact, t.mismatched[:10]


def test_every_cache_array_and_layer_is_compared(v41):
    assert v41.tally.names == set(parity_v41.CACHE_FIELDS)
    assert v41.tally.layers == set(range(tiny_v41.V41_CONFIG["num_hidden_layers"]))


def test_layer_kinds_follow_the_sources(v41_model):
    w = native.V41Weights.load(str(v41_model))
    kinds = [w.layer_kind(i) for i in range(w.num_layers)]
    assert kinds == [
        (0, False, False),
        (2, True, True),
        (2, False, False),
        (2, False, False),
        (1, True, True),
        (1, False, False),
        (1, False, False),
        (1, True, False),
    ]


# The MXFP8 model on a shorter prompt (555 tokens in steps of 111).
MXFP8_TOKENS, MXFP8_STEP = 555, 111


def test_deepseek_v41_mxfp8_quantized_forward_is_bit_exact(v41_mxfp8_model):
    """MLX's own forward, its CPU `quantized_matmul` included (bf16 group sums, then scaled)."""
    r = parity_v41.run_v41(v41_mxfp8_model, n_tokens=MXFP8_TOKENS, step=MXFP8_STEP)
    report(r)
    t = r.tally
    assert t.names == set(parity_v41.CACHE_FIELDS)
    assert t.bit_exact, t.mismatched[:10]
