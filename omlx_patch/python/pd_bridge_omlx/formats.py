"""How the decoder model stores its cache projections, said in one line for people: the doctor,
``export-weights`` and ``/pd-bridge/v1/status`` print it."""

from __future__ import annotations


def format_summary(formats: list[tuple[str, str]]) -> str:
    """``affine 4-bit g64 x12 (kv_a_proj_with_mqa, ...), bf16 x3 (...)``: how many of the cache's
    projections are stored each way, and which projections (by their last name) those are."""
    by: dict[str, list[str]] = {}
    for module, fmt in formats:
        name = module.rsplit(".", 1)[-1]
        by.setdefault(fmt, []).append("compressor." + name if ".compressor." in module else name)
    return ", ".join(f"{fmt} x{len(mods)} ({', '.join(sorted(set(mods)))})" for fmt, mods in sorted(by.items(), key=lambda kv: -len(kv[1])))
