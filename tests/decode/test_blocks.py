"""oMLX side: blocks written by the Rust writer against the blocks a real oMLX writes itself.

Runs against whichever oMLX is installed (``pd_bridge_omlx.versions``: upstream oMLX 0.6.3 or
the flyto-mlx 0.7.0 fork). One oMLX server per model serves a prompt natively and stores its
blocks; the Rust writer writes the same prompt's blocks from the Rust math into a second
directory; every file must match oMLX's, tensor by tensor and key by key (``created_at`` aside).
Upstream's DeepSeek-V4 blocks are 2,048 tokens: its prompt spans three blocks and ends mid-block.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine  # starts real `omlx serve` processes: not in the quick lane

import engines

engines.require("omlx", "pd_bridge_omlx")

import bridge_blocks  # noqa: E402
import omlx_server  # noqa: E402
from native_runs import NativeRun  # noqa: E402

OMLX = omlx_server.installed_omlx()
UPSTREAM = OMLX.distribution == "omlx"


@pytest.fixture(params=["v4", "mla"])
def native(request) -> NativeRun:
    return request.getfixturevalue(f"native_{request.param}")


BRIDGE_ENV = {"PD_BRIDGE_OMLX": "1"}


def test_native_oracle_is_sane(native):
    # The prompt's ids are the ones oMLX hashed: its files are exactly our chain.
    files = {p.stem for p in omlx_server.block_files(native.native_dir)}
    expected = set(omlx_server.block_hashes(native.model_name, native.ids, native.block_size)[: native.n_blocks])
    assert files == expected
    assert native.warm_cached == native.n_blocks * native.block_size
    if UPSTREAM and native.name.startswith("tiny-v4"):
        assert native.block_size == 2048 and native.n_blocks >= 3 and len(native.ids) % 2048
    header = omlx_server.read_block_header(omlx_server.block_files(native.native_dir)[0])
    assert header["metadata"]["model_name"] == (native.name if UPSTREAM else native.model_name)


def test_rust_blocks_are_identical_to_omlx_blocks(native, tmp_path):
    ours = bridge_blocks.write_blocks(native.root / native.name, native.model_name, native.ids, native.block_size, native.n_blocks, tmp_path, native.capture)
    assert ours.hashes == omlx_server.block_hashes(native.model_name, native.ids, native.block_size)[: native.n_blocks]
    diff = bridge_blocks.BlockDiff()
    for h, path in zip(ours.hashes, ours.paths):
        bridge_blocks.compare_block(path, omlx_server.block_path(native.native_dir, h), diff)
    print(f"\n{native.name} ({OMLX.key}): {diff.identical}/{diff.compared} blocks identical to oMLX's own")
    assert diff.compared == native.n_blocks >= 2
    assert diff.identical == diff.compared, diff.problems[:10]
    assert not list(tmp_path.rglob("*tmp*")), "no temporary file may be left behind"


def rescan(server) -> dict:
    return omlx_server._request(f"{server.base_url}/pd-bridge/v1/rescan", {"model": server.model})


def test_written_blocks_are_served_as_a_hit_and_survive_a_restart(native, tmp_path):
    """A fresh oMLX with an empty cache; the Rust writer writes the prompt's blocks, the adapter
    registers them (oMLX's own compatibility check included), and the request reports them
    cached and answers exactly as natively. Then oMLX restarts on the same cache directory: its
    own start-up scan indexes the bridged blocks (none swept as incompatible) and the same
    prompt is served from them again."""
    cache, home = tmp_path / "cache", tmp_path / "home"
    with omlx_server.serve(native.root, cache, home, model=native.name, extra_env=BRIDGE_ENV) as s:
        ours = bridge_blocks.write_blocks(native.root / native.name, s.cache_model_name, native.ids, native.block_size, native.n_blocks, cache, native.capture)
        result = rescan(s)
        assert sorted(result["registered"]) == sorted(ours.hashes) and not result["rejected"], result
        r = omlx_server.complete(s.base_url, s.model, native.text, 8)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == native.n_blocks * native.block_size
    assert r["choices"][0]["text"] == native.answer
    before = sorted(p.name for p in omlx_server.block_files(cache))
    assert set(before) >= {f"{h}.safetensors" for h in ours.hashes}

    with omlx_server.serve(native.root, cache, home, model=native.name, extra_env=BRIDGE_ENV) as s:
        r2 = omlx_server.complete(s.base_url, s.model, native.text, 8)
        log = s.log_path.read_text(errors="replace")
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == native.n_blocks * native.block_size
    assert r2["choices"][0]["text"] == native.answer
    assert "skipped_incompatible" not in log, [l for l in log.splitlines() if "skipped_incompatible" in l]
    assert "not serving block" not in log
    scans = re.findall(r"SSD cache scan complete: scanned=(\d+), indexed=(\d+)", log)
    if scans:  # upstream logs its scan: every bridged block indexed
        assert int(scans[-1][1]) >= native.n_blocks, scans
    assert set(before) <= {p.name for p in omlx_server.block_files(cache)}, "a bridged block was swept"


def test_bad_blocks_are_never_served(native_v4, native_mla, tmp_path):
    """Truncated, random, foreign-model, wrong-hash, stale-format, wrong-signature and temp files
    in the cache directory: oMLX answers natively and correctly, and the log names each rejected
    file with the reason."""
    nat = native_mla
    cache = tmp_path / "cache"
    hashes = omlx_server.block_hashes(nat.model_name, nat.ids, nat.block_size)[: nat.n_blocks]
    good = omlx_server.block_path(nat.native_dir, hashes[0]).read_bytes()

    def put(hash_hex: str, data: bytes, name: str | None = None) -> Path:
        p = cache / hash_hex[0] / (name or f"{hash_hex}.safetensors")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        return p

    version = re.search(rb'"omlx_cache_format_version":"(\d)"', good)
    stale = bytearray(good)
    stale[version.start(1)] = ord("1")
    bad = {
        "truncated": put(hashes[0], good[: len(good) // 2]),
        "random bytes": put(hashes[1], bytes((i * 7919) % 251 for i in range(4096))),
        "stale format": put("ab" * 32, bytes(stale).replace(hashes[0].encode(), ("ab" * 32).encode())),
        "hash not its name": put("cd" * 32, good),
        "temp leftover": put(hashes[0], good[:100], name=f"{hashes[0]}_tmp.safetensors"),
    }
    if UPSTREAM:
        # A well-formed block whose cache signature does not match its own metadata (same length).
        wrong = good.replace(b'\\"block_size\\":256', b'\\"block_size\\":512', 1).replace(hashes[0].encode(), hashes[2].encode())
        assert wrong != good
        bad["wrong signature"] = put(hashes[2], wrong)
    foreign = omlx_server.block_files(native_v4.native_dir)[0]
    with omlx_server.serve(nat.root, cache, tmp_path / "home", model=nat.name, extra_env=BRIDGE_ENV) as s:
        # Dropped in while running, then offered to the rescan: another model's valid block.
        bad["another model"] = put(foreign.stem, foreign.read_bytes())
        result = rescan(s)
        r = omlx_server.complete(s.base_url, s.model, nat.text, 8)
        log = s.log_path.read_text(errors="replace")
    assert not result["registered"], result
    assert any("belongs to model" in why for _, why in result["rejected"]), result
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r["choices"][0]["text"] == nat.answer
    missing = [k for k, p in bad.items() if p.name not in log]
    assert not missing, f"log does not name the rejected {missing}"
    if UPSTREAM:
        line = next(l for l in log.splitlines() if bad["wrong signature"].name in l)
        assert "cache_signature block_size 512" in line, line


def test_upstream_patch_applies_and_rescans(native_v4, tmp_path):
    """patches/omlx-0.7.0-cache-rescan.patch: applies to the installed oMLX and its public
    rescan() indexes a new block while the validator keeps a bad one out."""
    import shutil
    import subprocess
    import sys

    import omlx
    from pd_bridge_omlx import versions

    if versions.detect().key != "fork-0.7.0":
        pytest.skip(f"the patch is written against the fork's paged_ssd_cache.py; this is {versions.detect().describe()} (the fork venv runs it)")
    src = Path(omlx.__file__).parent
    shutil.copytree(src, tmp_path / "omlx", ignore=shutil.ignore_patterns("__pycache__"))
    patch = Path(__file__).resolve().parents[2] / "patches" / "omlx-0.7.0-cache-rescan.patch"
    subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, check=True)
    cache = tmp_path / "cache"
    good = omlx_server.block_files(native_v4.native_dir)[0]
    code = f"""
import shutil, sys
from pathlib import Path
from omlx.cache.paged_ssd_cache import PagedSSDCacheManager
from pd_bridge_omlx import BlockRejected, inspect_block
m = PagedSSDCacheManager(Path({str(cache)!r}), 1 << 34)
def validate(p):
    try:
        inspect_block(str(p))
    except BlockRejected as e:
        return str(e)
m.set_block_validator(validate)
good = Path({str(good)!r})
dst = Path({str(cache)!r}) / good.parent.name / good.name
dst.parent.mkdir(parents=True, exist_ok=True)
shutil.copy(good, dst)
bad = Path({str(cache)!r}) / "a" / ("a" * 64 + ".safetensors")
bad.write_bytes(good.read_bytes()[:1000])
r = m.rescan()
print(r["registered"] == [good.stem], len(r["rejected"]) == 1, m.has_block(bytes.fromhex(good.stem)), r)
"""
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:3] == ["True", "True", "True"], out.stdout


def _segment_servers(pd_bridge_vllm, n: int) -> list:
    """``n`` segment servers on consecutive ports, as the stages of one vLLM have them."""
    for _ in range(100):
        first = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"shared-secret")
        try:
            return [first] + [pd_bridge_vllm.SegmentServer(f"127.0.0.1:{first.port + s}", b"shared-secret") for s in range(1, n)]
        except Exception:  # a port after it is taken: another base
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


@pytest.mark.parametrize("lanes, stages", [(1, 1), (3, 1), (1, 2)])
def test_streamed_over_tcp_into_a_running_omlx(native, tmp_path, lanes, stages):
    """The prefill side's capture engine (pd_bridge_vllm) fed with MLX's attention inputs streams
    segments over loopback TCP as blocks complete; the oMLX side (pd_bridge_omlx) ingests them
    into a running oMLX's cache, rescans, and the prompt is served as a hit with the native answer.
    Over one stream, over three lanes (blocks still land in chain order), and from two pipeline
    stages, each capturing its own layers on its own port (the parts joined into whole blocks)."""
    import threading

    import parity
    import pd_bridge_omlx

    pd_bridge_vllm = engines.require("pd_bridge_vllm")

    model_dir = native.root / native.name
    cap_inputs = native.capture
    weights = pd_bridge_vllm.Weights.load(str(model_dir))
    servers = _segment_servers(pd_bridge_vllm, stages)
    server = servers[0]
    secret = pd_bridge_omlx.capture_secret()
    n = weights.num_layers
    ranges = [(0, n)] if stages == 1 else [(0, n // 2), (n // 2, n)]
    digest = pd_bridge_vllm.prompt_digest(list(native.ids))
    captures = [
        pd_bridge_vllm.Capture(weights, "req-1", len(native.ids), native.block_size, srv, OMLX.omlx_format, secret, digest, layers=None if stages == 1 else r)
        for srv, r in zip(servers, ranges)
    ]
    verdicts = []

    def prefill():
        for (start, _end), per_layer in zip(cap_inputs.steps, cap_inputs.inputs):
            for capture, (a, b) in zip(captures, ranges):
                for layer in range(a, b):
                    capture.feed(layer, start, parity.bf16_bits(per_layer[layer]).tobytes())
        verdicts.extend(c.seal() for c in captures)

    cache = tmp_path / "cache"
    with omlx_server.serve(native.root, cache, tmp_path / "home", model=native.name, extra_env=BRIDGE_ENV) as s:
        producer = threading.Thread(target=prefill)
        producer.start()
        writer = pd_bridge_omlx.BlockWriter(str(cache), s.cache_model_name, native.block_size, native.ids, OMLX.omlx_format)
        landed = []
        blocks, verdict = pd_bridge_omlx.ingest(
            "127.0.0.1", server.port, b"shared-secret", "req-1", pd_bridge_omlx.Weights.load(str(model_dir)).fingerprint,
            writer, on_block=landed.append, secret=secret, token_ids=list(native.ids), lanes=lanes, stages=stages,
        )
        arrived = [b.index for b in landed]
        # Each block is handed over once, with its path and the validator's verdict on the file
        # as it lies: what the bridge registers it from, without recomputing or re-reading.
        for b in landed:
            assert b.hash_hex == writer.hash_hex(b.index) and not b.existed and b.rejected is None
            assert Path(b.path) == cache / b.hash_hex[0] / f"{b.hash_hex}.safetensors"
            assert b.file_size == Path(b.path).stat().st_size
        producer.join()
        registered = rescan(s)["registered"]
        r = omlx_server.complete(s.base_url, s.model, native.text, 8)
    assert blocks == native.n_blocks and arrived == list(range(native.n_blocks))
    assert '"verdict":"complete"' in verdict and len(verdicts) == stages and all('"complete"' in v for v in verdicts)
    assert len(registered) == native.n_blocks
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == native.n_blocks * native.block_size
    assert r["choices"][0]["text"] == native.answer
