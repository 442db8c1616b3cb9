"""Side-by-side benchmark: the Rust block writer vs oMLX's own store pipeline, in one run.

    python tests/bench_block_writer.py [--tokens 65536] [--block-size 512] [--out DIR]

Both write DeepSeek-V4-Flash-shaped state (43 layers at the real dims, random values) for the
same prompt length as blocks of the chosen oMLX (`--format`: the fork's oMLX 0.7 blocks by default,
upstream 0.6.3's delta blocks with `--format upstream-0.6.3 --block-size 2048`). The Rust side is `core/examples/bench_block_writer.rs`
(timed: building and writing each block, fsync and rename included); the oMLX side is
`bench_omlx_store.omlx_store` (timed: `save_block` plus its writer thread until every file is
renamed; oMLX does not fsync, so its final fsync is added). Prints both and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def rust_writer(tokens: int, block_size: int, out: Path, fmt: str = "fork-0.7.0") -> dict:
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "pd-bridge-core", "--example", "bench_block_writer"], cwd=ROOT, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    exe = target / "release" / "examples" / "bench_block_writer"
    done = subprocess.run([str(exe), str(tokens), str(block_size), str(out), fmt], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--format", choices=("fork-0.7.0", "upstream-0.6.3"), default="fork-0.7.0", help="block layout of which oMLX (upstream-0.6.3: use --block-size 2048)")
    a = ap.parse_args()
    import bench_omlx_store

    with tempfile.TemporaryDirectory(dir=a.out) as tmp:
        rust = rust_writer(a.tokens, a.block_size, Path(tmp) / "rust", a.format)
        omlx = bench_omlx_store.omlx_store(a.tokens, a.block_size, Path(tmp) / "omlx", fmt=a.format)
    omlx_s = omlx["seconds"] + omlx.get("fsync_seconds", 0.0)
    print(f"DeepSeek-V4-Flash-shaped state ({a.format} blocks), {a.tokens} tokens, {rust['blocks']} blocks of {a.block_size}, {rust['bytes'] / 1e9:.2f} GB of block files")
    print(f"  Rust writer : {rust['seconds']:7.2f} s  {rust['gb_per_s']:.2f} GB/s  {rust['tokens_per_s']:8.0f} tokens/s  peak RSS {rust['peak_rss_mb']:.0f} MB (state held: {rust['state_mb']:.0f} MB)")
    print(f"  oMLX store  : {omlx_s:7.2f} s  {omlx['bytes'] / omlx_s / 1e9:.2f} GB/s  {omlx['blocks'] * a.block_size / omlx_s:8.0f} tokens/s  peak RSS {omlx['peak_rss_mb']:.0f} MB  (incl. {omlx.get('fsync_seconds', 0.0):.2f} s final fsync; {omlx.get('dropped', 0)} blocks dropped)")
    print(f"  ratio (oMLX time / Rust time): {omlx_s / rust['seconds']:.2f}x")


if __name__ == "__main__":
    main()
