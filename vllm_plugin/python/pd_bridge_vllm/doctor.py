"""``pd-bridge-vllm doctor``: is this GPU host ready to prefill for a Mac?

Checks, each with what to do when it fails: the installed vLLM's hook points (the same
conformance check the plugin runs at engine start), the CUDA driver and NVRTC, the kernels
compiled by NVRTC for each device's architecture (as a capture does at its first feed), the
decoder weights' fingerprint (the Mac's ``pd-bridge doctor`` prints the same value), and the
segment port (free to listen on, or a vLLM already serving it). Exit status 0 when every check
passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys


def _line(ok: bool | None, what: str, detail: str) -> bool:
    mark = {True: "ok  ", False: "FAIL", None: "skip"}[ok]
    print(f"[{mark}] {what}: {detail}")
    return ok is not False


def check_vllm() -> bool:
    from . import versions

    try:
        v = versions.installed_version()
    except ImportError:
        return _line(False, "vLLM", "not installed in this Python: pip install vllm (tested: " + versions.tested_text() + ")")
    try:
        entry = versions.check()
    except versions.UnsupportedVLLM as e:
        return _line(False, "vLLM", f"{v} does not conform: {e}")
    tested = getattr(entry, "tested", False)
    return _line(True, "vLLM", f"{v} conforms ({'tested' if tested else 'untested; tested: ' + versions.tested_text()})")


def check_cuda() -> bool:
    from . import _native

    r = _native.cuda_report()
    if not r.get("built_with_cuda"):
        return _line(False, "CUDA", "this pd-bridge-vllm was built without the cuda feature: reinstall the wheel from PyPI")
    ok = True
    drv = r.get("driver_version")
    ok &= _line(drv is not None, "CUDA driver", f"{drv // 1000}.{drv % 1000 // 10}" if drv else "; ".join(r["problems"]) or "unreadable")
    nv = r.get("nvrtc_version")
    archs = r.get("nvrtc_archs") or []
    ok &= _line(nv is not None, "NVRTC", f"{nv[0]}.{nv[1]}, compiles for sm_{min(archs)}..sm_{max(archs)}" if nv and archs else "; ".join(p for p in r["problems"] if "NVRTC" in p) or "unreadable")
    devices = r.get("devices") or []
    if not devices:
        ok &= _line(False, "GPU", "no CUDA device visible (CUDA_VISIBLE_DEVICES, driver)")
    for i, (name, (maj, minor)) in enumerate(devices):
        arch = f"compute_{maj}{minor}"
        try:
            n = _native.compile_kernels(arch)
            ok &= _line(True, f"GPU {i}", f"{name}, compute capability {maj}.{minor}: kernels compiled for {arch} ({n} bytes of PTX)")
        except Exception as e:  # the native error names the fix
            ok &= _line(False, f"GPU {i}", f"{name}, compute capability {maj}.{minor}: {e}")
    return ok


def check_weights(weights: str | None, model: str | None = None) -> bool:
    if not weights:
        return _line(None, "decoder weights", "give --weights DIR (or PD_BRIDGE_VLLM_WEIGHTS): the directory `pd-bridge export-weights` wrote on the Mac")
    from . import _native

    try:
        w = _native.Weights.load(weights)
    except Exception as e:
        return _line(False, "decoder weights", f"{weights}: {e}")
    ok = _line(True, "decoder weights", f"{weights}: fingerprint {w.fingerprint} (the Mac's `pd-bridge doctor` must print the same)")
    formats: dict[str, int] = {}
    for _, f in w.formats:
        formats[f] = formats.get(f, 0) + 1
    ok &= _line(True, "decoder weight formats", ", ".join(f"{f} x{n}" for f, n in formats.items()))
    return ok & check_route(weights, model)


def check_route(weights: str, model: str | None) -> bool:
    """Same weights or different: the checkpoint vLLM serves against the Mac model the weights
    were exported from."""
    from . import _native

    if not model:
        return _line(None, "weights route", "give --model DIR (the checkpoint vLLM serves) to say whether it runs the Mac model's own weights")
    try:
        mine, theirs = _native.model_fingerprint(model), _native.decoder_model_fingerprint(weights)
    except Exception as e:
        return _line(False, "weights route", f"{model}: {e}")
    if theirs is None:
        return _line(None, "weights route", f"{weights} predates the record of its model; export it again on the Mac to compare")
    if mine == theirs:
        return _line(True, "weights route", f"same weights: {model} is the Mac model's checkpoint ({mine}); the bridged cache is the decoder's own")
    # Not a failure: the common case, said plainly with the way to the other.
    return _line(True, "weights route", f"different weights: {model} ({mine}) is not the Mac model ({theirs}); the bridge computes the Mac model's "
                 "projections of this model's hidden states (verdicts say weights=different). For the decoder's own weights, run "
                 "`pd-bridge export-checkpoint MODEL_DIR OUT` on the Mac and serve OUT here")


def check_port(address: str, port: int | None) -> bool:
    if port is None:
        return _line(None, "segment port", "give --port (or PD_BRIDGE_VLLM_PORT)")
    try:
        with socket.create_server((address, port)):
            pass
        return _line(True, "segment port", f"{address}:{port} is free; a Mac must reach it (firewall), and vLLM listens there once started")
    except OSError as e:
        try:
            with socket.create_connection((address if address not in ("0.0.0.0", "::") else "127.0.0.1", port), timeout=2):
                pass
            return _line(True, "segment port", f"{address}:{port} is in use and accepts connections (a running vLLM with the connector, or something else: check its log)")
        except OSError:
            return _line(False, "segment port", f"cannot listen on {address}:{port}: {e}; choose another port or address")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pd-bridge-vllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("doctor", help="check this GPU host: vLLM, CUDA, NVRTC, weights, segment port")
    d.add_argument("--weights", default=os.environ.get("PD_BRIDGE_VLLM_WEIGHTS"))
    d.add_argument("--model", help="the checkpoint directory vLLM serves: says whether it holds the Mac model's own weights")
    d.add_argument("--port", type=int, default=int(os.environ["PD_BRIDGE_VLLM_PORT"]) if os.environ.get("PD_BRIDGE_VLLM_PORT") else None)
    d.add_argument("--address", default=os.environ.get("PD_BRIDGE_VLLM_ADDRESS", "127.0.0.1"))
    d.add_argument("--no-vllm", action="store_true", help="skip the vLLM check (a host without vLLM yet)")
    a = p.parse_args(argv)
    ok = True
    ok &= check_vllm() if not a.no_vllm else _line(None, "vLLM", "skipped (--no-vllm)")
    ok &= check_cuda()
    ok &= check_weights(a.weights, a.model)
    ok &= check_port(a.address, a.port)
    print("OK: this host can prefill for a Mac" if ok else "NOT READY: fix the FAIL lines above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
