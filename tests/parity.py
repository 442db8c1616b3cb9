"""Parity of the core's cache math with MLX's own caches.

MLX runs its model forward over a prompt in the decoder's prefill steps while the attention
input of every layer is captured; the core (through ``pd_bridge_omlx._native``) is fed the same
inputs and its state is compared, array by array and bit by bit, with what MLX's cache objects
hold after every step. Used by the tests and by the README's main command.

    python tests/parity.py MODELS_DIR      # prints the parity table
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_models  # noqa: E402
from parity_common import ParityResult, Tally, bf16_bits, prompt, random_chunking  # noqa: E402,F401

from pd_bridge_omlx import CacheBuilder, Weights  # noqa: E402

PROMPT_TOKENS = 2777  # not a multiple of 4 or 128: remainders and a partial last step
DECODER_STEP = 512  # oMLX's block size for these models; the prefill grid


@contextlib.contextmanager
def capture_attention_inputs(classes):
    """Record ``(layer, x)`` for every call of the given attention classes' forward."""
    seen: list[tuple[int, mx.array]] = []
    originals = {cls: cls.__call__ for cls in classes}

    def wrap(orig):
        def call(self, x, *args, **kwargs):
            seen.append((self._pd_layer, x))
            return orig(self, x, *args, **kwargs)

        return call

    for cls, orig in originals.items():
        cls.__call__ = wrap(orig)
    try:
        yield seen
    finally:
        for cls, orig in originals.items():
            cls.__call__ = orig


def _tag_layers(model) -> None:
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "attn", None) or getattr(layer, "self_attn")
        attn._pd_layer = i


def v4_expected(cache) -> dict[str, mx.array | None]:
    """What oMLX's DeepSeek-V4 caches hold for one layer, under the core's array names."""
    from mlx_lm.models.cache import CacheList

    parts = list(cache.caches) if isinstance(cache, CacheList) else [cache]
    rot = parts[0]
    window = rot._temporal_order(rot.keys)[..., -min(rot.max_size, rot.offset) :, :]
    out = {"window": window}
    for prefix, pool in zip(("", "idx_"), parts[1:]):
        state = pool.state
        buf_kv, buf_gate, pooled = state[:3]
        out[prefix + "pooled"] = pooled
        out[prefix + "buf_kv"] = buf_kv
        out[prefix + "buf_gate"] = buf_gate
        if len(state) == 5:  # upstream: the previous ratio-4 window, [1, 1, ratio, out_dim]
            for name, a in zip(("prev_kv", "prev_gate"), state[3:]):
                out[prefix + name] = None if a is None else a.reshape(-1, a.shape[-1])
    return out


def mla_expected(cache) -> dict[str, mx.array | None]:
    latent, k_pe = cache.state
    return {"latent": latent, "k_pe": k_pe}


def compare_layer(tally: Tally, label: str, builder: CacheBuilder, layer: int, expected: dict) -> None:
    snap = {name: (shape, np.frombuffer(data, dtype=np.uint16)) for name, shape, data in builder.snapshot(layer)}
    if set(snap) != set(expected):
        tally.arrays += 1
        tally.mismatched.append(f"{label}: arrays {sorted(snap)} vs MLX {sorted(expected)}")
        return
    for name, theirs in expected.items():
        shape, ours = snap[name]
        if theirs is None:
            theirs_bits, theirs_shape = np.zeros(0, np.uint16), (0, shape[-1] if shape else 0)
        else:
            theirs_bits = bf16_bits(theirs)
            theirs_shape = (theirs_bits.size // theirs.shape[-1], theirs.shape[-1])
        tally.add(f"{label} {name}", ours, shape, theirs_bits, theirs_shape)


@dataclass
class ForwardCapture:
    """One MLX prefill: per step, the attention input of every layer and the caches after it."""

    steps: list[tuple[int, int]]
    inputs: list[dict[int, mx.array]]
    expected: list[list[dict]]


def mlx_prefill(model, tokens: list[int], step: int, attention_classes, expected_of) -> ForwardCapture:
    from mlx_lm.models.cache import make_prompt_cache

    _tag_layers(model)
    cache = make_prompt_cache(model)
    steps, inputs, expected = [], [], []
    with capture_attention_inputs(attention_classes) as seen:
        for start in range(0, len(tokens), step):
            end = min(start + step, len(tokens))
            seen.clear()
            model(mx.array(tokens[start:end])[None], cache=cache)
            mx.eval([c.state for c in cache])
            per_layer = {i: x for i, x in seen}
            mx.eval(list(per_layer.values()))
            steps.append((start, end))
            inputs.append(per_layer)
            expected.append([expected_of(c) for c in cache])
    return ForwardCapture(steps, inputs, expected)


def omlx_format() -> str:
    """The installed oMLX's block format (its decoder's overlap semantics)."""
    from pd_bridge_omlx import versions

    return versions.detect().omlx_format


def core_replay(weights: Weights, cap: ForwardCapture, step: int, tally: Tally, chunking=None) -> float:
    """Feed the captured inputs to the core; compare after every decoder step (or only at the
    end when ``chunking`` re-cuts the prompt). Returns the seconds the core spent."""
    builder = CacheBuilder(weights, step, omlx_format())
    n_layers = weights.num_layers
    spent = 0.0
    if chunking is None:
        for (start, _end), per_layer, exp in zip(cap.steps, cap.inputs, cap.expected):
            t0 = time.perf_counter()
            for layer in range(n_layers):
                builder.feed(layer, start, bf16_bits(per_layer[layer]).tobytes())
            spent += time.perf_counter() - t0
            for layer in range(n_layers):
                compare_layer(tally, f"step@{start} layer {layer}", builder, layer, exp[layer])
        return spent
    full = {layer: np.concatenate([bf16_bits(p[layer]) for p in cap.inputs]) for layer in range(n_layers)}
    hidden = weights.hidden_size
    t0 = time.perf_counter()
    for layer in range(n_layers):
        pos = 0
        for size in chunking:
            builder.feed(layer, pos, full[layer][pos * hidden : (pos + size) * hidden].tobytes())
            pos += size
    spent = time.perf_counter() - t0
    for layer in range(n_layers):
        compare_layer(tally, f"rechunked layer {layer}", builder, layer, cap.expected[-1][layer])
    return spent


def v4_classes():
    from mlx_lm.models import deepseek_v4 as dv4

    return (dv4.LocalAttention, dv4.CompressedAttention, dv4.SparseCompressedAttention)


def mla_classes():
    from mlx_lm.models import deepseek_v3 as dv3

    return (dv3.DeepseekV3Attention,)


def run_v4(model_dir: Path, n_tokens: int = PROMPT_TOKENS, step: int = DECODER_STEP) -> ParityResult:
    model = tiny_models.load(model_dir)
    weights = Weights.load(str(model_dir))
    toks = prompt(n_tokens, model.args.vocab_size)
    t0 = time.perf_counter()
    cap = mlx_prefill(model, toks, step, v4_classes(), v4_expected)
    mlx_s = time.perf_counter() - t0
    tally = Tally()
    core_s = core_replay(weights, cap, step, tally)
    core_replay(weights, cap, step, tally, chunking=random_chunking(n_tokens, random.Random(7)))
    return ParityResult(model_dir.name, tally, mlx_s, core_s)


def run_mla(model_dir: Path, n_tokens: int = PROMPT_TOKENS, step: int = DECODER_STEP) -> ParityResult:
    model = tiny_models.load(model_dir)
    weights = Weights.load(str(model_dir))
    toks = prompt(n_tokens, model.args.vocab_size)
    t0 = time.perf_counter()
    cap = mlx_prefill(model, toks, step, mla_classes(), mla_expected)
    mlx_s = time.perf_counter() - t0
    tally = Tally()
    core_s = core_replay(weights, cap, step, tally)
    core_replay(weights, cap, step, tally, chunking=random_chunking(n_tokens, random.Random(8)))
    return ParityResult(model_dir.name, tally, mlx_s, core_s)


def main(models: Path) -> int:
    print(f"parity: {PROMPT_TOKENS}-token prompt, decoder steps of {DECODER_STEP}, mlx {mx.__version__}")
    runs = [
        lambda: run_v4(models / "tiny-v4-bf16"),
        lambda: run_v4(models / "tiny-v4-mxfp8"),
        lambda: run_mla(models / "tiny-mla"),
    ]
    for run in runs:
        r = run()
        print(r.tally.line(r.name) + f"  (MLX forward {r.mlx_seconds:.1f}s, core {r.core_seconds:.1f}s)")
        for m in r.tally.mismatched[:5]:
            print("    " + m, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".pd-bridge/models")))
