"""oMLX half of the block-store benchmark: push a DeepSeek-V4-Flash prompt's prefix-cache blocks
through oMLX 0.7's own SSD store (``PagedSSDCacheManager.save_block`` and its writer thread).

What a block is
---------------
oMLX keeps a boundary snapshot at every block for DeepSeek-V4 (no layer is sliceable), so the
block ending at ``b = (k+1) * block_size`` holds the FULL cache state at ``b``:

* ratio-0 layers (0, 1): ``RotatingKVCache`` -- keys ``[1,1,min(b,128),512]`` bf16 (the last 128
  rows), values ``[1,1,rows,0]`` bf16; meta ``("0","128",str(b),str(rows))``.
* ratio-4 layers (2, 4, .., 42): ``CacheList(RotatingKVCache, PoolingCache(4), PoolingCache(4))``
  -- the raw rotating buffer keys ``[1,1,min(b,127+block_size),512]`` (values zero-width), the
  compressor pool ``(None, None, [1,b/4,512])`` and the indexer pool ``(None, None, [1,b/4,128])``;
  meta ``[["RotatingKVCache","PoolingCache","PoolingCache"], [rot_meta, 4, 4]]``.
* ratio-128 layers (3, 5, .., 41): ``CacheList(RotatingKVCache, PoolingCache(128))``, pool
  ``[1,b/128,512]``, meta ``[[..], [rot_meta, 128]]``.

The per-layer snapshot is built in the scheduler's extracted format (``{"state", "meta_state",
"class_name", "cache_type"}``) and turned into ``save_block``'s ``cache_data`` by oMLX's own
``BlockAwarePrefixCache._extract_block_tensor_slice`` (the function ``store_cache`` uses), with
``layer_cache_types``/``layer_meta_states`` derived the way ``store_cache`` derives them. The only
deviation: ``_extract_block_tensor_slice`` normally ``mx.copy``-clones every tensor (lazily; the
copy is materialised later inside ``save_block``'s buffer-protocol read). Here the clone is the
identity, and every array is ``mx.eval``-ed before the clock starts, so ``save_block`` sees
materialised bf16 arrays of exactly the shapes, dtypes, markers and metadata oMLX's pipeline
hands it. A self-check asserts that structure on every block before timing.

Upstream oMLX 0.6.3 (``fmt="upstream-0.6.3"``, ``--format upstream-0.6.3``)
---------------------------------------------------------------------
Blocks of 2,048 tokens; every layer's rotating cache is its last 128 rows; each ``PoolingCache``
state is the 5-tuple ``(buf_kv, buf_gate, pooled, prev_win_kv, prev_win_gate)`` (remainders empty
at a block boundary; the previous ratio-4 window ``[1,1,4,2*d]``, None for ratio 128). The
snapshot goes through upstream's own ``compact_pooling_cache_snapshot`` (the scheduler's boundary
compaction: only this block's pooled rows, ``mx.contiguous``) and ``_extract_block_tensor_slice``
(which wraps them as ``PoolingCacheDelta`` with their ``int64 [2]`` row range), untimed as above;
the manager is built as upstream's scheduler builds it (expected model/layers/block size, split
payload layout on: format version 5).

Data
----
Before timing, one random bf16 array per layer and kind is generated at the size of the LAST
block (pools of ``tokens/ratio`` rows, the rotating buffers) -- i.e. one block's worth of memory,
~0.46 GB for 64K tokens. Block ``k``'s arrays are contiguous prefix views of those (a pool at
boundary ``b`` is a prefix of the final pool, as in the real cache), all ``mx.eval``-ed before the
clock starts. Values are random finite bf16 (random bit patterns with the top exponent bit
cleared). Nothing compresses or deduplicates bytes on this path, so content does not affect
timing. Block hashes are a sha256 chain seeded with a random nonce, so blocks never collide with
files already in ``out_dir``.

What is timed
-------------
``seconds`` = wall clock from just before the first ``save_block`` call until the writer thread
has renamed every block's ``<hash>_tmp.safetensors`` into ``<hash>.safetensors`` (the manager's
``_pending_write_hashes`` set, from which the writer removes a hash only after its rename, is
empty; every final file is then checked to exist). Inside the window: ``save_block`` on the
caller thread (metadata, ``bytes(memoryview(...))`` copy of every tensor, index bookkeeping,
enqueue) and the writer thread's safetensors write + rename, overlapped as oMLX overlaps them.

NOT timed: imports, manager construction (directory creation / rescan), random generation, the
views/snapshot/``_extract_block_tensor_slice`` preparation, ``mx.eval``, an ``os.sync()`` before
the clock starts (so earlier dirty pages do not bleed in), deletions of already-written files if
the disk runs low (their duration is measured and subtracted), the final ``fsync`` (reported
separately as ``fsync_seconds``: oMLX never fsyncs, so "renamed" means "in the page cache") and
clean-up.

Scheduling (``mode``)
---------------------
* ``"pipelined"`` (default): ``save_block`` is called back to back as ``store_cache`` does, except
  that before each call we wait while ``max_inflight`` blocks are still pending (default 4).
  oMLX itself never waits: when its queue (``_MAX_PENDING_WRITES`` = max(32, min(256, RAM_GB/2))
  items) is full, ``save_block`` logs a warning and DROPS the block (returns False). The bound
  keeps this benchmark from dropping blocks or holding dozens of multi-hundred-MB byte copies.
  ``max_inflight=0`` reproduces oMLX's unbounded behaviour; dropped blocks are then counted in
  ``dropped`` and excluded from ``blocks``/``bytes``.
* ``"serial"``: wait for each block's rename before the next ``save_block`` (no overlap between
  the caller-thread byte copy and the writer thread).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np

import mlx.core as mx
from omlx.cache import paged_ssd_cache as _pssd
from omlx.cache.paged_ssd_cache import PagedSSDCacheManager
from omlx.cache.prefix_cache import BlockAwarePrefixCache

MODEL_NAME = "/bench/DeepSeek-V4-Flash"
NUM_LAYERS = 43
HEAD_DIM = 512
INDEX_HEAD_DIM = 128
SLIDING_WINDOW = 128
COMPRESS_RATIOS = [0, 0] + [4, 128] * 20 + [4]
assert len(COMPRESS_RATIOS) == NUM_LAYERS

_POLL_S = 0.0005
_DISK_MARGIN = 2 * 1024**3


def _random_bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> mx.array:
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits &= 0xBFFF  # clear the top exponent bit: finite values, |x| < 2
    return mx.array(bits).view(mx.bfloat16)


FORMATS = ("fork-0.7.0", "upstream-0.6.3")


def _rot_rows(ratio: int, b: int, block_size: int, fmt: str = "fork-0.7.0") -> int:
    # ratio-0 layers are normalised to the last `window` rows; the fork's compressed layers keep
    # the raw buffer of the last prefill step (window - 1 + step rows), upstream's the last 128.
    if ratio == 0 or fmt != "fork-0.7.0":
        return min(b, SLIDING_WINDOW)
    return min(b, SLIDING_WINDOW - 1 + block_size)


def _pool_dims(ratio: int) -> list[int]:
    return [HEAD_DIM, INDEX_HEAD_DIM] if ratio == 4 else [HEAD_DIM] if ratio == 128 else []


class _Bases:
    """One block's worth (the last block's) of random arrays; blocks take prefix views."""

    def __init__(self, tokens: int, block_size: int, seed: int, fmt: str = "fork-0.7.0"):
        rng = np.random.default_rng(seed)
        self.window: list[mx.array] = []
        self.pools: list[list[mx.array]] = []
        # upstream: the previous ratio-4 window (kv, gate) of each pool, [1, 1, 4, 2*d]
        self.prev: list[list[tuple[mx.array, mx.array] | None]] = []
        self.zero_width: dict[int, mx.array] = {}
        for ratio in COMPRESS_RATIOS:
            rows = _rot_rows(ratio, tokens, block_size, fmt)
            self.window.append(_random_bf16(rng, (1, 1, rows, HEAD_DIM)))
            self.pools.append([_random_bf16(rng, (1, tokens // ratio, d)) for d in _pool_dims(ratio)])
            up = fmt == "upstream-0.6.3" and ratio == 4
            self.prev.append([(_random_bf16(rng, (1, 1, 4, 2 * d)), _random_bf16(rng, (1, 1, 4, 2 * d))) if up else None for d in _pool_dims(ratio)])
        mx.eval(self.window, self.pools, [t for p in self.prev for w in p if w for t in w])

    def values(self, rows: int) -> mx.array:
        if rows not in self.zero_width:
            self.zero_width[rows] = mx.zeros((1, 1, rows, 0), dtype=mx.bfloat16)
        return self.zero_width[rows]


def _snapshot(bases: _Bases, b: int, block_size: int, fmt: str = "fork-0.7.0") -> list[dict]:
    """The boundary snapshot at ``b`` in the scheduler's extracted-state format."""
    up = fmt == "upstream-0.6.3"
    out = []
    for i, ratio in enumerate(COMPRESS_RATIOS):
        rows = _rot_rows(ratio, b, block_size, fmt)
        base = bases.window[i]
        keys = base[:, :, base.shape[2] - rows :, :] if ratio == 0 else base[:, :, :rows, :]
        rot_state = (keys, bases.values(rows))
        rot_meta = ("0", str(SLIDING_WINDOW), str(b), str(rows))
        if ratio == 0:
            out.append({"state": rot_state, "meta_state": rot_meta, "class_name": "RotatingKVCache", "cache_type": "RotatingKVCache"})
            continue
        if up:
            subs = [rot_state] + [(None, None, p[:, : b // ratio, :], *(w or (None, None))) for p, w in zip(bases.pools[i], bases.prev[i])]
        else:
            subs = [rot_state] + [(None, None, p[:, : b // ratio, :]) for p in bases.pools[i]]
        names = ["RotatingKVCache"] + ["PoolingCache"] * len(bases.pools[i])
        metas = [rot_meta] + [ratio] * len(bases.pools[i])
        out.append({"state": subs, "meta_state": (names, metas), "class_name": "CacheList", "cache_type": "CacheList"})
    if up:
        from omlx.cache.pooling_delta import compact_pooling_cache_snapshot

        compact_pooling_cache_snapshot(out, b, block_size)
    return out


def _extractor() -> BlockAwarePrefixCache:
    # _extract_block_tensor_slice only needs self._clone_tensor; make the clone the identity.
    pc = BlockAwarePrefixCache.__new__(BlockAwarePrefixCache)
    pc._clone_tensor = lambda t: t
    return pc


def _check_block_upstream(cache_data: list, b: int, block_size: int) -> None:
    """Upstream: 128-row windows; each pool a ``PoolingCacheDelta`` holding this block's rows."""
    assert len(cache_data) == NUM_LAYERS, len(cache_data)
    for i, (ratio, layer) in enumerate(zip(COMPRESS_RATIOS, cache_data)):
        rot = layer if ratio == 0 else layer[1][0]
        if ratio != 0:
            assert layer[0] == "__cache_list__" and len(layer[1]) == 1 + len(_pool_dims(ratio)), (i, layer[0])
        keys = rot[0] if isinstance(rot, tuple) and len(rot) == 2 else rot[2][0]
        assert tuple(keys.shape) == (1, 1, min(b, SLIDING_WINDOW), HEAD_DIM), (i, keys.shape)
        if ratio == 0:
            continue
        for sub, d in zip(layer[1][1:], _pool_dims(ratio)):
            tag, cls, elems = sub[0], sub[1], sub[-1]
            assert cls == "PoolingCacheDelta", (i, tag, cls)
            pooled, rng = elems[2], elems[-1]
            assert tuple(pooled.shape) == (1, block_size // ratio, d), (i, pooled.shape)
            assert rng.tolist() == [(b - block_size) // ratio, b // ratio], (i, rng.tolist())


def _check_block(cache_data: list, b: int, block_size: int) -> None:
    """Assert cache_data is what oMLX's pipeline hands save_block for a V4 block ending at b."""
    assert len(cache_data) == NUM_LAYERS, len(cache_data)
    for i, (ratio, layer) in enumerate(zip(COMPRESS_RATIOS, cache_data)):
        rows = _rot_rows(ratio, b, block_size)
        rot = layer if ratio == 0 else layer[1][0]
        if ratio != 0:
            assert layer[0] == "__cache_list__" and len(layer[1]) == 1 + len(_pool_dims(ratio)), (i, layer[0])
        assert isinstance(rot, tuple) and len(rot) == 2, (i, type(rot))
        assert tuple(rot[0].shape) == (1, 1, rows, HEAD_DIM) and rot[0].dtype == mx.bfloat16, (i, rot[0].shape)
        assert tuple(rot[1].shape) == (1, 1, rows, 0), (i, rot[1].shape)
        if ratio == 0:
            continue
        for sub, d in zip(layer[1][1:], _pool_dims(ratio)):
            tag, cls, elems = sub
            assert tag == "__nstate__" and cls is None and elems[0] is None and elems[1] is None, (i, sub[:2])
            assert tuple(elems[2].shape) == (1, b // ratio, d) and elems[2].dtype == mx.bfloat16, (i, elems[2].shape)


def _hashes(n: int) -> list[bytes]:
    h = hashlib.sha256(b"pd-bridge-bench" + os.urandom(16)).digest()
    out = []
    for k in range(n):
        h = hashlib.sha256(h + k.to_bytes(8, "little")).digest()
        out.append(h)
    return out


def _peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def _pending(mgr: PagedSSDCacheManager) -> int:
    with mgr._pending_write_hashes_lock:
        return len(mgr._pending_write_hashes)


def _wait_pending_below(mgr: PagedSSDCacheManager, n: int) -> None:
    while _pending(mgr) >= n:
        if not mgr._writer_thread.is_alive():
            raise RuntimeError("oMLX's SSD writer thread died")
        time.sleep(_POLL_S)


def omlx_store(
    tokens: int,
    block_size: int,
    out_dir: Path,
    seed: int = 0,
    *,
    mode: str = "pipelined",
    max_inflight: int = 4,
    keep: bool = False,
    fmt: str = "fork-0.7.0",
) -> dict:
    """Store ``tokens // block_size`` DeepSeek-V4-Flash blocks through oMLX's SSD store in
    ``out_dir`` and time it (see the module docstring for exactly what is timed).

    Returns ``{"blocks", "bytes", "seconds", "gb_per_s", "tokens_per_s", "peak_rss_mb", ...}``:
    ``bytes`` is the sum of the final block file sizes, ``gb_per_s`` is ``bytes / seconds / 1e9``
    (decimal GB), ``peak_rss_mb`` the process's max RSS (MiB). Extra keys: ``mode``,
    ``max_inflight``, ``dropped``, ``max_pending`` (most blocks queued or being written, sampled
    after each ``save_block``), ``first_dropped`` (index of the first block ``save_block`` refused;
    oMLX's ``store_cache`` stops storing the request at its first refusal, so only the blocks before
    it would be usable), ``save_call_seconds`` (time inside ``save_block`` on the
    caller thread), ``fsync_seconds`` (untimed fsync of the surviving files afterwards),
    ``deleted_during_run`` (files removed early because the disk ran low), ``largest_block_bytes``.
    The block files (and the empty 0-f subdirectories oMLX creates) are removed afterwards unless
    ``keep``; ``out_dir`` itself belongs to the caller and is left in place. If the disk gets low
    (free < the next block x the in-flight bound + 2 GiB), already-written files are deleted
    before the next ``save_block`` (sizes recorded first; the pause is not timed).
    """
    if mode not in ("pipelined", "serial"):
        raise ValueError(f"mode must be 'pipelined' or 'serial', not {mode!r}")
    if block_size <= 0 or block_size % 128 or tokens <= 0 or tokens % block_size:
        raise ValueError("block_size must be a positive multiple of 128 and tokens a positive multiple of block_size")
    out_dir = Path(out_dir)
    n = tokens // block_size

    # ---- untimed preparation -------------------------------------------------------------
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, not {fmt!r}")
    up = fmt == "upstream-0.6.3"
    bases = _Bases(tokens, block_size, seed, fmt)
    ext = _extractor()
    jobs = []
    for k in range(n):
        b = (k + 1) * block_size
        snap = _snapshot(bases, b, block_size, fmt)
        # store_cache: snapshot-backed block, meta from the snapshot, types from cache_type.
        cache_data = ext._extract_block_tensor_slice(snap, k * block_size, b, None, is_last_block=(k == n - 1), snapshot_cache_data=snap)
        assert cache_data is not None, "oMLX's _extract_block_tensor_slice failed"
        (_check_block_upstream if up else _check_block)(cache_data, b, block_size)
        types = [d.get("cache_type", "KVCache") for d in snap]
        metas = [d["meta_state"] for d in snap]
        jobs.append((cache_data, types, metas, _block_nbytes(cache_data)))
    mx.eval([[t for layer in cd for t in _tensors(layer)] for cd, *_ in jobs])

    # Size limit: the whole disk (oMLX further caps it at 99% of what is free), so nothing is
    # evicted and its "disk pressure" warning (effective limit < 10% of configured) stays quiet.
    out_dir.mkdir(parents=True, exist_ok=True)
    if up:  # as upstream's scheduler builds it (split payload layout on by default)
        mgr = PagedSSDCacheManager(
            cache_dir=out_dir, max_size_bytes=shutil.disk_usage(out_dir).total, hot_cache_max_bytes=0,
            expected_model_name=MODEL_NAME, expected_num_layers=NUM_LAYERS, expected_block_size=block_size,
            expected_block_size_tokens=block_size, gdn_ssd_split_enabled=True,
        )  # fmt: skip
    else:
        mgr = PagedSSDCacheManager(cache_dir=out_dir, max_size_bytes=shutil.disk_usage(out_dir).total, hot_cache_max_bytes=0)
    hashes = _hashes(n)
    paths = [mgr._get_file_path(h) for h in hashes]
    sizes: dict[int, int] = {}
    deleted = 0
    excluded = 0.0  # seconds spent deleting files mid-run, subtracted from the window
    save_call = 0.0
    dropped = []
    max_pending = 0
    bound = 1 if mode == "serial" else max_inflight
    expected_largest = jobs[-1][3]
    os.sync()

    # ---- timed window --------------------------------------------------------------------
    t0 = time.perf_counter()
    for k, (cache_data, types, metas, nbytes) in enumerate(jobs):
        if bound > 0:
            _wait_pending_below(mgr, bound)
        if shutil.disk_usage(out_dir).free < nbytes * (bound or _pssd._MAX_PENDING_WRITES) + _DISK_MARGIN:
            td = time.perf_counter()
            _wait_pending_below(mgr, 1)
            for j in range(k):
                if j not in sizes and paths[j].exists():
                    sizes[j] = paths[j].stat().st_size
                    mgr.delete_block(hashes[j])
                    deleted += 1
            excluded += time.perf_counter() - td
        ts = time.perf_counter()
        ok = mgr.save_block(hashes[k], cache_data, token_count=block_size, model_name=MODEL_NAME, layer_cache_types=types, layer_meta_states=metas)
        save_call += time.perf_counter() - ts
        max_pending = max(max_pending, _pending(mgr))
        if not ok:
            dropped.append(k)
    _wait_pending_below(mgr, 1)
    seconds = time.perf_counter() - t0 - excluded
    # ---- end of timed window -------------------------------------------------------------

    written = [k for k in range(n) if k not in dropped]
    missing = [k for k in written if k not in sizes and not paths[k].exists()]
    if missing or mgr._stats["errors"]:
        raise RuntimeError(f"oMLX failed to write blocks {missing[:5]} (errors={mgr._stats['errors']})")
    for k in written:
        if k not in sizes:
            sizes[k] = paths[k].stat().st_size
    tf = time.perf_counter()
    for k in written:
        if paths[k].exists():
            fd = os.open(paths[k], os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_seconds = time.perf_counter() - tf
    mgr.close()
    peak = _peak_rss_mb()
    del jobs, bases

    if not keep:
        for p in paths:
            p.unlink(missing_ok=True)
        for sub in PagedSSDCacheManager.SUBDIR_CHARS:
            try:
                (out_dir / sub).rmdir()
            except OSError:
                pass

    total = sum(sizes.values())
    return {
        "blocks": len(written),
        "bytes": total,
        "seconds": seconds,
        "gb_per_s": total / seconds / 1e9,
        "tokens_per_s": len(written) * block_size / seconds,
        "peak_rss_mb": round(peak, 1),
        "format": fmt,
        "mode": mode,
        "max_inflight": bound,
        "dropped": len(dropped),
        "max_pending": max_pending,
        "first_dropped": dropped[0] if dropped else None,
        "save_call_seconds": save_call,
        "fsync_seconds": fsync_seconds,
        "deleted_during_run": deleted,
        "largest_block_bytes": max(sizes.values()) if sizes else 0,
        "largest_block_tensor_bytes": expected_largest,
    }


def _tensors(layer) -> list[mx.array]:
    out = []

    def walk(x):
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)

    walk(layer)
    return out


def _block_nbytes(cache_data: list) -> int:
    return sum(t.nbytes for layer in cache_data for t in _tensors(layer))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None, help="cache directory (default: a fresh temporary one, removed afterwards)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=("pipelined", "serial"), default="pipelined")
    ap.add_argument("--max-inflight", type=int, default=4, help="pipelined: pending blocks allowed before the next save_block (0: unbounded, as oMLX)")
    ap.add_argument("--keep", action="store_true", help="keep the block files")
    ap.add_argument("--format", choices=FORMATS, default="fork-0.7.0", help="which oMLX's block layout (upstream-0.6.3: 2,048-token blocks)")
    a = ap.parse_args(argv)
    tmp = None
    out = a.out
    if out is None:
        import tempfile

        tmp = out = Path(tempfile.mkdtemp(prefix="bench_omlx_store_"))
    try:
        res = omlx_store(a.tokens, a.block_size, out, a.seed, mode=a.mode, max_inflight=a.max_inflight, keep=a.keep, fmt=a.format)
    finally:
        if tmp is not None and not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    res["out_dir"] = str(out)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
