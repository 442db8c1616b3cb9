"""Parity of the core's DeepSeek-V4.1 cache math with mlx-lm's own ``LayerCache``.

mlx-lm's real ``deepseek_v41`` model (mlx-lm 0.32.2 or later) runs its forward over a prompt in
steps while the attention input of every layer is captured; the core (through
``pd_bridge_omlx._native.V41CacheBuilder``) is fed the same inputs and every array of every
layer's cache (``window`` bf16; on the KV-source layers ``compress_kv``, ``index_k``,
``pending_kv``, ``pending_gate`` float32) is compared bit by bit with what the cache objects hold:
after every step, after re-cutting the prompt into random chunks, and after resuming from a carry
state made from mlx-lm's own cache at a step boundary.

    python tests/parity_v41.py MODELS_DIR      # prints the parity table (makes tiny-v41 if absent)
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
import tiny_v41  # noqa: E402
from parity_common import ParityResult, Tally, bits, prompt, random_chunking  # noqa: E402

# Odd, so the last group is unfinished (pending rows); steps of an odd size, so calls start at
# odd positions too (the pending row crosses calls), and the window (128) wraps many times.
PROMPT_TOKENS = 1111
DECODER_STEP = 255
CACHE_FIELDS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")


@contextlib.contextmanager
def capture_attention_inputs():
    """Record ``(layer, x)`` for every call of mlx-lm's V4.1 ``Attention``."""
    from mlx_lm.models import deepseek_v41 as dv41

    seen: list[tuple[int, mx.array]] = []
    orig = dv41.Attention.__call__

    def call(self, x, *args, **kwargs):
        seen.append((self._pd_layer, x))
        return orig(self, x, *args, **kwargs)

    dv41.Attention.__call__ = call
    try:
        yield seen
    finally:
        dv41.Attention.__call__ = orig


def expected(cache) -> dict[str, mx.array]:
    """What one layer's ``LayerCache`` holds, by field (absent where it holds None)."""
    return {name: getattr(cache, name) for name in CACHE_FIELDS if getattr(cache, name) is not None}


@dataclass
class ForwardCapture:
    """One mlx-lm prefill: per step, the attention input of every layer and the caches after it
    (plus each cache's offset)."""

    steps: list[tuple[int, int]]
    inputs: list[dict[int, mx.array]]
    expected: list[list[dict[str, mx.array]]]
    offsets: list[list[int]]


def mlx_prefill(model, tokens: list[int], step: int) -> ForwardCapture:
    for i, layer in enumerate(model.layers):
        layer.self_attn._pd_layer = i
    cache = model.make_cache()
    steps, inputs, exp, offsets = [], [], [], []
    with capture_attention_inputs() as seen:
        for start in range(0, len(tokens), step):
            end = min(start + step, len(tokens))
            seen.clear()
            model(mx.array(tokens[start:end])[None], cache=cache)
            mx.eval([a for c in cache for a in c.state if a is not None])
            per_layer = {i: x for i, x in seen}
            mx.eval(list(per_layer.values()))
            steps.append((start, end))
            inputs.append(per_layer)
            exp.append([expected(c) for c in cache])
            offsets.append([c.offset for c in cache])
    return ForwardCapture(steps, inputs, exp, offsets)


def compare_layer(tally: Tally, label: str, builder, layer: int, want: dict[str, mx.array], skip_groups: int = 0) -> None:
    """The core's layer state against ``want``; ``skip_groups``: compressed rows before a resume
    point, which a resumed state does not hold (the decoder does)."""
    ours = {}
    for name, dtype, shape, data in builder.snapshot(layer):
        ours[name] = (np.frombuffer(data, dtype=np.uint16 if dtype == "bfloat16" else np.uint32), tuple(shape))
    # The core keeps a ratio-2 pool's pending rows from the start; mlx-lm has them once a call
    # ran (both empty then): compare the sets of non-empty arrays' names plus the pools.
    if set(ours) != set(want):
        tally.arrays += 1
        tally.mismatched.append(f"{label}: arrays {sorted(ours)} vs mlx-lm {sorted(want)}")
        return
    for name, theirs in want.items():
        theirs_bits = bits(theirs)
        width = theirs.shape[-1]
        rows = theirs_bits.size // width
        if name in ("compress_kv", "index_k") and skip_groups:
            theirs_bits = theirs_bits[skip_groups * width :]
            rows -= skip_groups
        o, shape = ours[name]
        tally.add(f"{label} {name}", o, shape, theirs_bits, (rows, width), name=name, layer=layer)


def core_replay(weights, cap: ForwardCapture, tally: Tally, chunking=None):
    """Feed the captured inputs to the core; compare after every step (or only at the end when
    ``chunking`` re-cuts the prompt). Returns the seconds the core spent."""
    from pd_bridge_omlx._native import V41CacheBuilder

    builder = V41CacheBuilder(weights)
    n_layers = weights.num_layers
    spent = 0.0
    if chunking is None:
        for (start, end), per_layer, exp, offs in zip(cap.steps, cap.inputs, cap.expected, cap.offsets):
            t0 = time.perf_counter()
            for layer in range(n_layers):
                builder.feed(layer, start, bits(per_layer[layer]))
            spent += time.perf_counter() - t0
            for layer in range(n_layers):
                if builder.processed(layer) != offs[layer]:
                    tally.arrays += 1
                    tally.mismatched.append(f"step@{start} layer {layer}: offset {builder.processed(layer)} vs mlx-lm {offs[layer]}")
                compare_layer(tally, f"step@{start} layer {layer}", builder, layer, exp[layer])
        return spent
    full = full_inputs(cap, n_layers)
    hidden = weights.hidden_size
    t0 = time.perf_counter()
    for layer in range(n_layers):
        pos = 0
        for size in chunking:
            builder.feed(layer, pos, full[layer][pos * hidden : (pos + size) * hidden])
            pos += size
    spent = time.perf_counter() - t0
    for layer in range(n_layers):
        compare_layer(tally, f"rechunked layer {layer}", builder, layer, cap.expected[-1][layer])
    return spent


def full_inputs(cap: ForwardCapture, n_layers: int) -> dict[int, np.ndarray]:
    return {layer: np.concatenate([bits(p[layer]) for p in cap.inputs]) for layer in range(n_layers)}


def carry_from_mlx(weights, cap: ForwardCapture, step_index: int) -> tuple[int, bytes]:
    """The carry state at the end of step ``step_index``, made from mlx-lm's own caches there
    (the window and the pending rows), as the decode host would."""
    position = cap.steps[step_index][1]
    layers = []
    for want in cap.expected[step_index]:
        window = bits(want["window"]).tobytes()
        pk = bits(want["pending_kv"]).tobytes() if "pending_kv" in want else b""
        pg = bits(want["pending_gate"]).tobytes() if "pending_gate" in want else b""
        layers.append((window, pk, pg))
    return position, weights.carry_state_of(position, layers)


def core_resume(weights, cap: ForwardCapture, step_index: int, tally: Tally, rng: random.Random) -> None:
    """Resume from mlx-lm's cache at the end of step ``step_index`` (also round-tripped through
    the core's own carry), feed the rest in random chunks starting a few rows before the resume
    point (skipped), and compare with mlx-lm's final cache."""
    from pd_bridge_omlx._native import V41CacheBuilder

    position, carry = carry_from_mlx(weights, cap, step_index)
    n_layers, hidden = weights.num_layers, weights.hidden_size
    full = full_inputs(cap, n_layers)
    total = cap.steps[-1][1]
    builder = V41CacheBuilder.resume(weights, carry)
    assert builder.origin == position
    # The core's own carry of a state built up to `position` is the same bytes.
    own = V41CacheBuilder(weights)
    for layer in range(n_layers):
        own.feed(layer, 0, full[layer][: position * hidden])
    if own.carry_state() != carry:
        tally.arrays += 1
        tally.mismatched.append(f"resumed@{position}: the core's own carry state differs from mlx-lm's cache's")
    back = min(position, 5)
    for layer in range(n_layers):
        pos = position - back
        while pos < total:
            size = min(rng.randrange(1, 200), total - pos)
            builder.feed(layer, pos, full[layer][pos * hidden : (pos + size) * hidden])
            pos += size
    for layer in range(n_layers):
        ratio, pools, _ = weights.layer_kind(layer)
        skip = position // ratio if pools else 0
        compare_layer(tally, f"resumed@{position} layer {layer}", builder, layer, cap.expected[-1][layer], skip_groups=skip)


def run_v41(model_dir: Path, n_tokens: int = PROMPT_TOKENS, step: int = DECODER_STEP) -> ParityResult:
    from pd_bridge_omlx._native import V41Weights

    model = tiny_v41.load(model_dir)
    weights = V41Weights.load(str(model_dir))
    toks = prompt(n_tokens, model.args.vocab_size)
    t0 = time.perf_counter()
    cap = mlx_prefill(model, toks, step)
    mlx_s = time.perf_counter() - t0
    tally = Tally(reference="mlx-lm")
    core_s = core_replay(weights, cap, tally)
    core_replay(weights, cap, tally, chunking=random_chunking(n_tokens, random.Random(9)))
    # Resume at an odd step boundary (a pending row is carried) and at an even one.
    for k in (0, 1):
        core_resume(weights, cap, k, tally, random.Random(10 + k))
    return ParityResult(model_dir.name, tally, mlx_s, core_s, len(cap.steps))


def main(models: Path) -> int:
    print(f"parity (DeepSeek-V4.1): {PROMPT_TOKENS}-token prompt, steps of {DECODER_STEP}, mlx {mx.__version__}")
    ok = True
    for name, attention in ((tiny_v41.NAME, "bf16"), (tiny_v41.NAME_MXFP8, "mxfp8")):
        model_dir = models / name
        if not (model_dir / "config.json").exists():
            tiny_v41.make_v41(model_dir, attention=attention)
        r = run_v41(model_dir)
        print(r.tally.line(r.name) + f"  (mlx-lm forward {r.mlx_seconds:.1f}s, core {r.core_seconds:.2f}s, {r.steps} steps)")
        for m in r.tally.mismatched[:5]:
            print("    " + m, flush=True)
        ok &= r.tally.bit_exact
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".pd-bridge/models")))
