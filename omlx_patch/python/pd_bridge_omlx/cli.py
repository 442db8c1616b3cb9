"""``pd-bridge``: operate the bridge from the decode host.

    pd-bridge export-weights MODEL_DIR OUT_DIR
        Write the decoder's attention-cache weights (exactly the tensors the cache math reads)
        and their fingerprint into OUT_DIR; copy OUT_DIR to the prefill host and point
        PD_BRIDGE_VLLM_WEIGHTS (or kv_connector_extra_config.weights) at it.

    pd-bridge export-checkpoint MODEL_DIR OUT_DIR
        Write the MLX model oMLX serves as a bf16 Hugging Face checkpoint the prefill host's vLLM
        loads: the decoder's own weights, quantized modules dequantized exactly. vLLM then
        computes the attention inputs with the weights the Mac decodes with ("same weights"),
        which keeps the bridged cache within the fidelity bound whatever the Mac's format.
        DeepSeek-V3-style MLA models.

    pd-bridge doctor [--model-dir MODEL_DIR] [--omlx-url URL]
        Check every link: versions, environment, the prefill host's health, the segment
        server's reachability and shared token, the weights fingerprint, and a tiny round trip
        (one block prefilled on vLLM, streamed, written and validated here). Says what to fix.
        With --omlx-url (the running oMLX), also the rates it measured and the break-even
        prompt length for this pair of machines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from .formats import format_summary

# The vLLM releases pd-bridge-vllm's table marks tested (vllm_plugin/python/pd_bridge_vllm/
# versions.py). Others are accepted there when their hook points conform, which only the prefill
# host can check (its connector at start, `pd-bridge-vllm doctor`): the Mac does not have vLLM.
TESTED_VLLM = ("0.26.0", "0.27.1", "0.29.0", "0.31.0", "0.32.0")


def _export(args) -> int:
    from ._native import PdBridgeError, Weights, export_weights

    try:
        fp = export_weights(args.model_dir, args.out_dir)
        formats = Weights.load(args.out_dir).formats
    except (PdBridgeError, OSError) as e:
        print(f"pd-bridge export-weights: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir} (attention-cache weights of {args.model_dir})")
    print(f"fingerprint {fp}")
    print(f"formats {format_summary(formats)}")
    print("on the prefill host: set PD_BRIDGE_VLLM_WEIGHTS to this directory (or kv_connector_extra_config.weights)")
    return 0


def _export_checkpoint(args) -> int:
    from ._native import PdBridgeError, export_checkpoint

    try:
        fp, dequantized, tensors = export_checkpoint(args.model_dir, args.out_dir)
    except (PdBridgeError, OSError) as e:
        print(f"pd-bridge export-checkpoint: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir}: {tensors} bf16 tensors, the weights of {args.model_dir}")
    print(f"model fingerprint {fp}")
    print(f"dequantized {format_summary(dequantized) if dequantized else 'nothing (the model is not quantized)'}")
    print(f"on the prefill host: serve it with vLLM (`vllm serve {args.out_dir} ...`); the bridge then runs the decoder's own weights on both hosts")
    return 0


class _Doctor:
    def __init__(self) -> None:
        self.failures = 0

    def ok(self, what: str, detail: str = "") -> None:
        print(f"  ok    {what}" + (f": {detail}" if detail else ""))

    def fail(self, what: str, detail: str, fix: str) -> None:
        self.failures += 1
        print(f"  FAIL  {what}: {detail}\n        fix: {fix}")

    def skip(self, what: str, why: str) -> None:
        print(f"  skip  {what}: {why}")


def _doctor(args) -> int:
    from . import ENV_VAR, __version__, enabled
    from . import config as config_mod
    from .bridge import PrefillHost

    d = _Doctor()
    print(f"pd-bridge doctor (pd-bridge-omlx {__version__}, Python {sys.version.split()[0]})")
    from . import versions

    try:
        d.ok("oMLX", versions.detect().describe())
    except versions.UnsupportedOmlxError as e:
        fix = "run the doctor with the Python that runs oMLX" if "no installed distribution" in str(e) else f"install one of: {versions.supported_text()}"
        d.fail("oMLX", str(e), fix)
    if enabled():
        d.ok(ENV_VAR, "set")
    else:
        d.fail(ENV_VAR, "not set: oMLX runs without the bridge", f"export {ENV_VAR}=1 before starting oMLX")
    try:
        cfg = config_mod.from_env()
    except config_mod.BridgeConfigError as e:
        d.fail("settings", str(e), "correct the variable named above")
        cfg = None
    else:
        if cfg is None:
            d.fail("PD_BRIDGE_PREFILL_URL", "not set", "export PD_BRIDGE_PREFILL_URL=http://<gpu-host>:8000 (vLLM's OpenAI server)")
        else:
            for t in cfg.prefill_hosts:
                d.ok("settings", f"prefill {t.url}, segments {t.segments_host}:{t.segments_port}")
    if cfg is None:
        print(f"{d.failures} problem(s)")
        return 1

    for i, target in enumerate(cfg.prefill_hosts):
        if len(cfg.prefill_hosts) > 1:
            print(f"prefill host {i + 1} of {len(cfg.prefill_hosts)}: {target.url}")
        host = PrefillHost(cfg, target)  # one pooled HTTP client for every check below
        try:
            _doctor_links(d, cfg, host, args)
        finally:
            host.close()
    if args.omlx_url:
        _doctor_rates(d, args.omlx_url.rstrip("/"))
    print(f"{d.failures} problem(s)" if d.failures else "all links ok")
    return 1 if d.failures else 0


def _doctor_rates(d: _Doctor, omlx_url: str) -> None:
    """The rates the running oMLX measured (``/pd-bridge/v1/status``), and the break-even."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{omlx_url}/pd-bridge/v1/status", timeout=10) as r:
            status = json.loads(r.read())
    except Exception as e:
        d.fail("measured rates", f"{omlx_url}/pd-bridge/v1/status: {e}", "pass the URL of the oMLX that runs with the bridge (--omlx-url http://127.0.0.1:8000)")
        return
    rates = status.get("rates")
    if not isinstance(rates, dict):
        d.fail("measured rates", f"{omlx_url} reports none (bridge {status.get('bridge', '?')})", "start oMLX with PD_BRIDGE_OMLX=1 and a prefill host")
        return
    print(f"measured rates (oMLX at {omlx_url}, decision: {status.get('decide', '?')})")
    native = rates.get("native") or {}
    if not native:
        d.skip("native prefill rate", "no native prefill of 256 or more uncached tokens yet")
    for model, e in native.items():
        d.ok("native prefill rate", f"{model}: {e['tok_s']:,.0f} tok/s ({e['samples']} samples, latest {e['age_s']:.0f} s ago)")
    for i, h in enumerate(rates.get("prefill_hosts") or []):
        name = f"prefill host {i + 1}"
        if not h.get("samples"):
            d.skip(f"{name} bridge rate", "no complete bridge yet")
            continue
        stream = f", stream {h['stream_mb_s']:,.0f} MB/s" if h.get("stream_mb_s") is not None else ""
        d.ok(f"{name} bridge rate", f"{h['bridge_tok_s']:,.0f} tok/s end to end, {h['overhead_s']:.2f} s before the prefill request{stream}, queue {h.get('queue')} ({h['samples']} samples)")
        for model, n in (h.get("break_even_tokens") or {}).items():
            what = f"bridging pays from {n:,} uncached tokens" if n else "never: a native prefill is predicted faster at every length"
            d.ok(f"{name} break-even", f"{model}: {what}")


def _doctor_links(d: _Doctor, cfg, host, args) -> None:
    """Every check of one prefill host (``host``), failures counted in ``d``."""
    from . import versions
    from .bridge import PrefillUnavailable

    try:
        host.check_health()
        d.ok("prefill host health", f"{host.url}/health")
        d.ok("prefill model", host.model())
        version = host.version()
        if version.split("+")[0] in TESTED_VLLM:
            d.ok("vLLM", version)
        else:
            d.ok("vLLM", f"{version} (not a tested release: {', '.join(TESTED_VLLM)}; the connector runs it if its hook points conform, which `pd-bridge-vllm doctor` on the prefill host checks)")
    except PrefillUnavailable as e:
        d.fail("prefill host", str(e), "start vLLM with the pd-bridge connector there, or correct PD_BRIDGE_PREFILL_URL")
        return

    if not args.model_dir:
        d.skip("weights fingerprint and round trip", "pass --model-dir (the model directory oMLX serves)")
        return
    from ._native import BlockWriter, PdBridgeError, Weights, capture_secret, ingest, inspect_block

    model_dir = str(Path(args.model_dir).resolve())
    try:
        weights = Weights.load(model_dir)
        d.ok("decoder weights", f"{weights.family}, {weights.num_layers} layers, {weights.fingerprint}")
        d.ok("decoder weight formats", format_summary(weights.formats))
    except PdBridgeError as e:
        # A model in a format the core does not compute (a float16 model, a foreign quantization)
        # needs another conversion, not another directory.
        fix = ("convert the model again with mlx-lm from its bf16 checkpoint (`mlx_lm.convert --dtype bfloat16 -q ...`) or with oMLX's oQ; "
               "every format mlx-lm and oQ write (affine 2-8 bits, mxfp4, mxfp8, nvfp4) is supported") if type(e).__name__ in ("WeightsError", "ConfigError") else "point --model-dir at the MLX model directory oMLX loads"
        d.fail("decoder weights", str(e), fix)
        return
    except OSError as e:
        d.fail("decoder weights", str(e), "point --model-dir at the MLX model directory oMLX loads")
        return

    # A tiny round trip: one block of random ids prefilled there, streamed and written here.
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size", 1000))
    block = args.block_size
    ids = [random.Random(7).randrange(10, max(11, vocab - 1)) for _ in range(block + 1)]
    capture_id = f"pdb-doctor-{os.getpid()}-{int(time.time())}"
    try:
        fmt = versions.detect().omlx_format
    except versions.UnsupportedOmlxError:
        fmt = None  # reported above; the round trip still checks the link in the default format
    secret = capture_secret()
    spec = {"request_id": capture_id, "block_size": block, "fingerprint": weights.fingerprint, "secret": secret, **({"omlx_format": fmt} if fmt else {})}
    with tempfile.TemporaryDirectory(prefix="pd-bridge-doctor-") as tmp:
        writer = BlockWriter(tmp, model_dir, block, ids[:block], fmt)
        import threading

        result: dict = {}

        def pull():
            try:
                result["ingest"] = ingest(host.target.segments_host, host.target.segments_port, cfg.token, capture_id, weights.fingerprint, writer, timeout_seconds=min(cfg.idle_s, 60.0), secret=secret, token_ids=ids[:block])
            except PdBridgeError as e:
                result["error"] = str(e.args[0]) if e.args else str(e)

        t = threading.Thread(target=pull, daemon=True)
        t.start()
        try:
            host.prefill(ids[:block], spec, timeout=120.0)
        except PrefillUnavailable as e:
            d.fail("round trip: prefill request", str(e), "see the vLLM log; the connector must be configured (kv_transfer_config)")
        t.join(timeout=90.0)
        if "error" in result:
            err = result["error"]
            fix = "set the same PD_BRIDGE_TOKEN on both hosts (and the same pd-bridge version)" if ("refused" in err or "handshake" in err or "wire version" in err) else "check PD_BRIDGE_SEGMENTS and that the prefill host's segment port is reachable"
            d.fail("round trip: segment stream", err, fix)
        elif "ingest" in result:
            blocks, seal = result["ingest"]
            seal = json.loads(seal)
            if seal.get("verdict") == "complete" and blocks == 1:
                files = list(Path(tmp).rglob("*.safetensors"))
                try:
                    for f in files:
                        inspect_block(str(f), model_name=model_dir, block_size=block, omlx_format=fmt)
                    d.ok("round trip", f"1 block of {block} tokens prefilled, streamed, written and validated")
                    d.ok("weights fingerprint", "the prefill host computes with the same decoder weights")
                except Exception as e:
                    d.fail("round trip: block", str(e), "report this: a streamed block failed validation")
            elif "fingerprint" in seal.get("reason", ""):
                d.fail("weights fingerprint", seal.get("reason", ""), f"run `pd-bridge export-weights {model_dir} OUT` here and point the prefill host's PD_BRIDGE_VLLM_WEIGHTS at OUT")
            else:
                d.fail("round trip", f"sealed {seal}", "see the vLLM log for the capture's reason")
        else:
            d.fail("round trip", "no answer from the segment server within 90 s", "check PD_BRIDGE_SEGMENTS and the prefill host's firewall")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pd-bridge", description="Operate pd-bridge from the decode host (oMLX).")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export-weights", help="write the decoder's attention-cache weights and fingerprint for the prefill host")
    e.add_argument("model_dir", help="the MLX model directory oMLX serves")
    e.add_argument("out_dir", help="where to write them (copy it to the prefill host)")
    e.set_defaults(func=_export)
    c = sub.add_parser("export-checkpoint", help="write the decoder's own weights as a bf16 checkpoint for the prefill host's vLLM")
    c.add_argument("model_dir", help="the MLX model directory oMLX serves")
    c.add_argument("out_dir", help="where to write the checkpoint (must not exist)")
    c.set_defaults(func=_export_checkpoint)
    dr = sub.add_parser("doctor", help="check every link and say what to fix")
    dr.add_argument("--model-dir", help="the MLX model directory oMLX serves (enables the fingerprint check and round trip)")
    dr.add_argument("--block-size", type=int, default=256, help="oMLX's cache block size for this model (default 256)")
    dr.add_argument("--omlx-url", help="the running oMLX (e.g. http://127.0.0.1:8000): print the rates it measured and the break-even prompt length")
    dr.set_defaults(func=_doctor)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
