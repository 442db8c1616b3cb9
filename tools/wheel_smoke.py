"""Smoke test and inspections of the release wheels (tools/build_wheels.sh runs them).

Standard library only, so it runs under any Python >= 3.10, including an arm64 Python under
qemu-user (where there is no numpy, torch or MLX):

  wheel_smoke.py prefill
      The vLLM wheel's side (``pd_bridge_vllm`` on PYTHONPATH). Writes two tiny decoder-weights
      directories (DeepSeek-V4 with ratio 0/4/128 layers, DeepSeek-V3 MLA) from a fixed seed,
      fingerprints them, checks the typed errors, feeds captures with fixed bf16 rows in chunks
      and digests their segments, then serves three more captures (keyed with a fixed secret)
      on a loopback SegmentServer. Protocol on stdout: ``PD-SMOKE {"port": N}`` first; the
      results as ``PD-SMOKE {...}`` once stdin says the captures were pulled.
  wheel_smoke.py run --out FILE -- PREFILL_CMD...
      The omlx wheel's side (``pd_bridge_omlx`` on PYTHONPATH), with PREFILL_CMD (any
      interpreter, e.g. an arm64 Python under qemu, running ``wheel_smoke.py prefill``) as a
      child: pulls each served capture with ``ingest`` into a BlockWriter (the decoder's plan
      checked), validates every block with ``inspect_block``, and writes the same blocks
      directly from a CacheBuilder fed the same rows: the streamed blocks must equal the direct
      ones. Writes both sides' results to FILE; everything in it but ``platform`` must be the
      same whichever machine ran the prefill side.
  wheel_smoke.py compare A.json B.json   the results of two runs are identical (platform aside)
  wheel_smoke.py show FILE               one line: digest of the results and what they cover
  wheel_smoke.py unpack WHEEL DIR        unzip a wheel (to put it on PYTHONPATH)
  wheel_smoke.py check-manylinux WHEEL ARCH   tags and the extension's ELF (machine, glibc, libs)
  wheel_smoke.py check-same-features WHEEL_A WHEEL_B   both carry the CUDA path (cudarc), same .py
  wheel_smoke.py check-macos MACOS_WHEEL LINUX_WHEEL   arm64 Mach-O, abi3, system libs only,
      no libpython, a valid ad-hoc code signature, same Python files as the Linux wheel
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

MARK = "PD-SMOKE "
TOKEN = b"wheel-smoke-shared-token-32bytes"
SECRET = "5e" * 32
V4_BLOCK = 128
V4_PROMPT = 3 * V4_BLOCK + 37  # three full blocks and a partial fourth
MLA_BLOCK = 64
MLA_PROMPT = 4 * MLA_BLOCK + 9
CHUNK = 100  # the prefill side feeds in chunks that straddle block boundaries

# (name, model, omlx format, block size, prompt tokens, served over the wire)
CASES = [
    ("v4-fork", "v4", "fork-0.7.0", V4_BLOCK, V4_PROMPT),
    ("v4-upstream", "v4", "upstream-0.6.3", V4_BLOCK, V4_PROMPT),
    ("mla-fork", "mla", "fork-0.7.0", MLA_BLOCK, MLA_PROMPT),
    ("mla-upstream", "mla", "upstream-0.6.3", MLA_BLOCK, MLA_PROMPT),
]


# --- deterministic inputs (pure Python: the same bits on every machine) ----------------------


class Rng:
    """xorshift64* (as core/tests/common), floats from integer arithmetic only."""

    def __init__(self, seed: int):
        self.s = ((seed * 0x9E3779B97F4A7C15) | 1) & 0xFFFFFFFFFFFFFFFF

    def next_u64(self) -> int:
        s = self.s
        s ^= s >> 12
        s ^= (s << 25) & 0xFFFFFFFFFFFFFFFF
        s ^= s >> 27
        self.s = s
        return (s * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF

    def normal(self) -> float:
        """Roughly normal: a sum of four uniforms (exact in binary64)."""
        return sum((self.next_u64() >> 40) / float(1 << 24) for _ in range(4)) - 2.0


def bf16(values) -> bytes:
    """Little-endian bf16, round to nearest even."""
    out = bytearray()
    for v in values:
        (bits,) = struct.unpack("<I", struct.pack("<f", v))
        out += struct.pack("<H", ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF)
    return bytes(out)


def f32(values) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def write_safetensors(path: Path, tensors: dict) -> None:
    header, blob = {}, bytearray()
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + bytes(blob))


def make_v4(d: Path, seed: int = 41) -> Path:
    """core/tests/common's tiny DeepSeek-V4: layers of compress ratio 0, 4 and 128."""
    hidden, head, index_head = 32, 16, 16
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v4", "hidden_size": hidden, "num_hidden_layers": 3, "head_dim": head,
        "qk_rope_head_dim": 8, "index_head_dim": index_head, "sliding_window": 8, "compress_ratios": [0, 4, 128],
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    }))
    rng, t = Rng(seed), {}

    def lin(name, out, inp):
        scale = inp ** -0.5
        t[name] = ("BF16", [out, inp], bf16(rng.normal() * scale for _ in range(out * inp)))

    for i, ratio in enumerate([0, 4, 128]):
        p = f"model.layers.{i}.attn"
        lin(f"{p}.wkv.weight", head, hidden)
        t[f"{p}.kv_norm.weight"] = ("BF16", [head], bf16(1.0 + 0.1 * rng.normal() for _ in range(head)))
        comps = {0: [], 4: [(f"{p}.compressor", head), (f"{p}.indexer.compressor", index_head)]}.get(ratio, [(f"{p}.compressor", head)])
        for c, hd in comps:
            od = 2 * hd if ratio == 4 else hd
            lin(f"{c}.wkv.weight", od, hidden)
            lin(f"{c}.wgate.weight", od, hidden)
            t[f"{c}.ape"] = ("F32", [ratio, od], f32([0.5 * rng.normal() for _ in range(ratio * od)]))
            t[f"{c}.norm.weight"] = ("BF16", [hd], bf16(1.0 + 0.1 * rng.normal() for _ in range(hd)))
    write_safetensors(d / "model.safetensors", t)
    return d


def make_mla(d: Path, seed: int = 7) -> Path:
    """core/tests/common's tiny DeepSeek-V3 MLA (latent 16, rope 8)."""
    hidden = 32
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "hidden_size": hidden, "num_hidden_layers": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 1.0},
    }))
    rng, t = Rng(seed), {}
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        t[f"{p}.kv_a_proj_with_mqa.weight"] = ("BF16", [24, hidden], bf16(rng.normal() * 0.2 for _ in range(24 * hidden)))
        t[f"{p}.kv_a_layernorm.weight"] = ("BF16", [16], bf16(1.0 + 0.1 * rng.normal() for _ in range(16)))
    write_safetensors(d / "model.safetensors", t)
    return d


def make_models(root: Path) -> dict[str, Path]:
    return {"v4": make_v4(root / "tiny-v4"), "mla": make_mla(root / "tiny-mla")}


def attention_rows(model: str, layers: int, hidden: int, prompt: int) -> list[bytes]:
    """Per layer, ``[prompt, hidden]`` little-endian bf16 attention input."""
    rng = Rng({"v4": 3, "mla": 5}[model])
    return [bf16(rng.normal() for _ in range(prompt * hidden)) for _ in range(layers)]


def token_ids(n: int, seed: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 129280 for i in range(n)]


def sha256_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def block_digest(p: Path) -> str:
    """SHA-256 over a block's tensors and metadata, ``created_at`` (a wall-clock time) aside."""
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.get("__metadata__", {})
    meta.pop("created_at", None)
    canon = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canon + data[8 + n :]).hexdigest()


def emit(obj) -> None:
    sys.stdout.write(MARK + json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


# --- the prefill side (pd_bridge_vllm) ------------------------------------------------------


def feed_all(cap, rows: list[bytes], hidden: int, prompt: int) -> None:
    width = hidden * 2
    for start in range(0, prompt, CHUNK):
        end = min(start + CHUNK, prompt)
        for layer, data in enumerate(rows):
            cap.feed(layer, start, memoryview(data)[start * width : end * width])


def prefill() -> int:
    import pd_bridge_vllm as pv
    from pd_bridge_vllm import _native

    res: dict = {"version": pv.VERSION}
    res["prompt_digest"] = {
        "empty": pv.prompt_digest([]),
        "0..999": pv.prompt_digest(list(range(1000))),
        "wide ids": pv.prompt_digest([0, 1, 2**31 - 1, 2**32 - 1, 129279, 151643]),
    }
    tmp = Path(tempfile.mkdtemp(prefix="pd-smoke-prefill-"))
    models = make_models(tmp)
    res["weights"] = {}
    weights = {}
    for name, d in models.items():
        w = pv.Weights.load(str(d))
        weights[name] = w
        assert pv.weights_fingerprint(str(d)) == w.fingerprint
        res["weights"][name] = {"fingerprint": w.fingerprint, "num_layers": w.num_layers, "hidden_size": w.hidden_size,
                                "files": {f.name: sha256_file(f) for f in sorted(d.iterdir())}}

    # Typed errors: a config without hidden_size, a feed of an odd byte count, a bad format.
    errors = {}
    bad = tmp / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "deepseek_v4"}')
    for what, fn in {
        "missing hidden_size": lambda: pv.weights_fingerprint(str(bad)),
        "odd bytes": lambda: pv.Capture(weights["mla"], "e", 32, 16, pv.SegmentServer("127.0.0.1:0", TOKEN)).feed(0, 0, b"\0\0\0"),
        "unknown format": lambda: pv.Capture(weights["mla"], "e", 32, 16, pv.SegmentServer("127.0.0.1:0", TOKEN), "upstream-9.9"),
    }.items():
        try:
            fn()
            errors[what] = "no error"
        except pv.PdBridgeError as e:
            errors[what] = type(e).__name__
    res["errors"] = errors

    # Captures without a secret: their segments are digested (each on its own server, since the
    # request id is in the segment headers).
    rows = {}
    res["captures"] = {}
    for case, model, fmt, block, prompt in CASES:
        w = weights[model]
        rows[case] = attention_rows(model, w.num_layers, w.hidden_size, prompt)
        cap = _native.Capture(w, "smoke-" + case, prompt, block, pv.SegmentServer("127.0.0.1:0", TOKEN), fmt)
        feed_all(cap, rows[case], w.hidden_size, prompt)
        seal = json.loads(cap.seal())
        count, digest = cap.segments_digest
        res["captures"][case] = {"seal": seal, "segments": count, "segments_sha256": digest, "segment_bytes": cap.segment_bytes}

    # Captures keyed for a decode host, served over loopback: the `run` side pulls them.
    server = pv.SegmentServer("127.0.0.1:0", TOKEN, 120.0, grace_seconds=600.0, pull_timeout_seconds=600.0)
    emit({"port": server.port})
    served = {}
    for case, model, fmt, block, prompt in CASES:
        w = weights[model]
        ids = token_ids(prompt, len(served) + 1)
        cap = pv.Capture(w, "req-" + case, prompt, block, server, fmt, SECRET, pv.prompt_digest(ids))
        feed_all(cap, rows[case], w.hidden_size, prompt)
        served[case] = {"seal": json.loads(cap.seal()), "segment_bytes": cap.segment_bytes, "stream_closed": cap.stream_closed}
    res["served"] = served
    # Wait for the decode side to say it pulled them (or gave up), then report.
    line = sys.stdin.readline().strip()
    res["pulled"] = line
    res["outboxes_left"] = server.outboxes
    res["platform"] = platform_facts()
    emit(res)
    return 0


def platform_facts() -> dict:
    return {"machine": platform.machine(), "python": platform.python_version(), "executable": sys.executable}


# --- the decode side (pd_bridge_omlx), and the whole run -------------------------------------


def run(out: Path, cmd: list[str]) -> int:
    import pd_bridge_omlx as po

    tmp = Path(tempfile.mkdtemp(prefix="pd-smoke-decode-"))
    models = make_models(tmp / "models")
    weights = {name: po.Weights.load(str(d)) for name, d in models.items()}
    decode: dict = {
        "version": po.VERSION,
        "formats": po.omlx_formats(),
        "fingerprints": {n: w.fingerprint for n, w in weights.items()},
        "expected_block_size": {f"{n}/{f}": po.expected_block_size(w, f) for n, w in weights.items() for f in po.omlx_formats()},
    }
    t0 = time.monotonic()
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = None
    for line in child.stdout:
        if line.startswith(MARK):
            port = json.loads(line[len(MARK) :])["port"]
            break
    if port is None:
        child.wait()
        print(f"the prefill side exited ({child.returncode}) before it served", file=sys.stderr)
        return 1

    failures = []
    pulled = {}
    try:
        for i, (case, model, fmt, block, prompt) in enumerate(CASES):
            w = weights[model]
            ids = token_ids(prompt, i + 1)
            cache = tmp / "streamed" / case
            writer = po.BlockWriter(str(cache), "tiny-" + model, block, ids, fmt, str(models[model]))
            arrived = []
            blocks, verdict = po.ingest("127.0.0.1", port, TOKEN, "req-" + case, w.fingerprint, writer, 600.0,
                                        on_block=lambda b: arrived.append(b.index), secret=SECRET, token_ids=ids)
            writer.flush()
            by_hash = {}
            for p in sorted(cache.rglob("*.safetensors")):
                # Validated as the adapter validates before oMLX may index it (plan included).
                h, tokens, _, _, _ = po.inspect_block(str(p), "tiny-" + model, w.num_layers, block, fmt, str(models[model]), str(cache))
                assert h == p.stem and tokens % block == 0, (p, h, tokens)
                by_hash[h] = block_digest(p)
            chain = [writer.hash_hex(k) for k in range(writer.num_blocks)]

            # The same blocks written directly from the decode side's own cache math.
            direct_dir = tmp / "direct" / case
            dw = po.BlockWriter(str(direct_dir), "tiny-" + model, block, ids, fmt, str(models[model]))
            builder = po.CacheBuilder(w, block, fmt)
            rows = attention_rows(model, w.num_layers, w.hidden_size, prompt)
            width = w.hidden_size * 2
            direct = []
            for k in range(prompt // block):
                for layer, data in enumerate(rows):
                    builder.feed(layer, k * block, memoryview(data)[k * block * width : (k + 1) * block * width])
                path, _, _ = dw.write(builder, k)
                direct.append(path)
            dw.flush()
            direct_digests = [block_digest(Path(p)) for p in direct]
            streamed_digests = [by_hash.get(h) for h in chain]
            if streamed_digests != direct_digests:
                failures.append(f"{case}: streamed blocks differ from the directly written ones")
            if arrived != list(range(prompt // block)):
                failures.append(f"{case}: blocks arrived as {arrived}")
            pulled[case] = {"blocks": blocks, "verdict": json.loads(verdict), "chain": chain, "block_sha256": streamed_digests,
                            "direct_equal": streamed_digests == direct_digests}
    finally:
        child.stdin.write("pulled\n")
        child.stdin.flush()
        rest = child.stdout.read()
        rc = child.wait()
    decode["pulled"] = pulled
    prefill_res = None
    for line in rest.splitlines():
        if line.startswith(MARK):
            prefill_res = json.loads(line[len(MARK) :])
    if rc != 0 or prefill_res is None:
        print(f"the prefill side failed (exit {rc})", file=sys.stderr)
        return 1
    plat = {"prefill": prefill_res.pop("platform"), "decode": platform_facts(), "seconds": round(time.monotonic() - t0, 1)}
    # Both wheels must agree on the weights and on how many segments and blocks there are.
    for name, fp in decode["fingerprints"].items():
        if prefill_res["weights"][name]["fingerprint"] != fp:
            failures.append(f"{name}: the wheels disagree on the fingerprint")
    for case, *_ in CASES:
        cap, served, got = prefill_res["captures"][case], prefill_res["served"][case], pulled[case]
        if cap["seal"].get("verdict") != "complete" or served["seal"] != cap["seal"] or got["verdict"] != cap["seal"]:
            failures.append(f"{case}: seals differ: {cap['seal']} / {served['seal']} / {got['verdict']}")
        if cap["segments"] != got["blocks"] or served["stream_closed"] is not None:
            failures.append(f"{case}: {cap['segments']} segments captured, {got['blocks']} blocks pulled, stream {served['stream_closed']}")
    if prefill_res["outboxes_left"] != 0:
        failures.append(f"{prefill_res['outboxes_left']} captures left unpulled")
    if any(v != expect for v, expect in zip(prefill_res["errors"].values(), ["ConfigError", "InputError", "ConfigError"])):
        failures.append(f"errors: {prefill_res['errors']}")
    result = {"prefill": prefill_res, "decode": decode, "platform": plat, "failures": failures}
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"{plat['prefill']['machine']} prefill -> {plat['decode']['machine']} decode in {plat['seconds']} s: {summary(result)}", file=sys.stderr)
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    return 1 if failures else 0


def results_digest(result: dict) -> str:
    r = {k: v for k, v in result.items() if k != "platform"}
    return hashlib.sha256(json.dumps(r, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def summary(result: dict) -> str:
    segs = sum(c["segments"] for c in result["prefill"]["captures"].values())
    blocks = sum(p["blocks"] for p in result["decode"]["pulled"].values())
    return (f"results sha256 {results_digest(result)[:16]} ({len(CASES)} captures, {segs} segments, {blocks} blocks pulled and "
            f"equal to direct writes, prompt_digest(0..999) {result['prefill']['prompt_digest']['0..999'][:12]})")


def compare(a: Path, b: Path) -> int:
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    diffs = []

    def walk(x, y, path):
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                if k == "platform" and not path:
                    continue
                walk(x.get(k), y.get(k), f"{path}/{k}")
        elif x != y:
            diffs.append(f"{path}: {json.dumps(x)[:100]} != {json.dumps(y)[:100]}")

    walk(ra, rb, "")
    for d in diffs[:30]:
        print(d)
    machines = f"{ra['platform']['prefill']['machine']} vs {rb['platform']['prefill']['machine']}"
    if diffs:
        print(f"{len(diffs)} differences ({machines})")
        return 1
    print(f"identical ({machines}): results sha256 {results_digest(ra)[:16]}")
    return 0


# --- wheel inspections ---------------------------------------------------------------------


def wheel_meta(whl: Path) -> tuple[list[str], dict]:
    z = zipfile.ZipFile(whl)
    wheel_file = next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))
    tags = [l.split(":", 1)[1].strip() for l in z.read(wheel_file).decode().splitlines() if l.startswith("Tag:")]
    files = {n: z.read(n) for n in z.namelist()}
    return tags, files


def extension(files: dict) -> tuple[str, bytes]:
    so = [n for n in files if n.endswith(".so")]
    if len(so) != 1:
        raise SystemExit(f"expected one extension module, found {so}")
    return so[0], files[so[0]]


class Elf:
    def __init__(self, data: bytes):
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise SystemExit("not a 64-bit little-endian ELF")
        self.data = data
        self.machine = struct.unpack_from("<H", data, 18)[0]
        shoff, = struct.unpack_from("<Q", data, 40)
        shentsize, shnum = struct.unpack_from("<HH", data, 58)
        self.sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def _str(self, strtab_index: int, off: int) -> str:
        base = self.sections[strtab_index][4] + off
        return self.data[base : self.data.index(b"\0", base)].decode()

    def needed(self) -> list[str]:
        out = []
        for _name, typ, _fl, _addr, off, size, link, *_ in self.sections:
            if typ == 6:  # SHT_DYNAMIC
                for i in range(0, size, 16):
                    tag, val = struct.unpack_from("<qQ", self.data, off + i)
                    if tag == 1:  # DT_NEEDED
                        out.append(self._str(link, val))
        return out

    def version_needs(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for _name, typ, _fl, _addr, off, _size, link, info, *_ in self.sections:
            if typ != 0x6FFFFFFE:  # SHT_GNU_verneed
                continue
            pos = off
            for _ in range(info):
                _ver, cnt, file_off, aux, nxt = struct.unpack_from("<HHIII", self.data, pos)
                lib = self._str(link, file_off)
                apos = pos + aux
                for _ in range(cnt):
                    _hash, _flags, _other, name_off, anext = struct.unpack_from("<IHHII", self.data, apos)
                    out.setdefault(lib, []).append(self._str(link, name_off))
                    apos += anext
                pos += nxt
        return out


ELF_MACHINE = {"x86_64": 62, "aarch64": 183}
# PEP 600 / auditwheel's manylinux_2_28 whitelist (the libraries a manylinux wheel may link).
MANYLINUX_LIBS = {"libgcc_s.so.1", "libstdc++.so.6", "libm.so.6", "libdl.so.2", "librt.so.1", "libc.so.6", "libnsl.so.1",
                  "libutil.so.1", "libpthread.so.0", "libresolv.so.2", "libX11.so.6", "libXext.so.6", "libXrender.so.1",
                  "libICE.so.6", "libSM.so.6", "libGL.so.1", "libgobject-2.0.so.0", "libgthread-2.0.so.0",
                  "libglib-2.0.so.0", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def check_manylinux(whl: Path, arch: str) -> int:
    tags, files = wheel_meta(whl)
    problems = []
    want = f"manylinux_2_28_{arch}"
    if not whl.name.endswith(f"-abi3-{want}.whl"):
        problems.append(f"file name {whl.name} is not an abi3 {want} wheel")
    if not tags or any(not (t.split("-")[1] == "abi3" and t.split("-")[2] == want) for t in tags):
        problems.append(f"WHEEL tags {tags}")
    name, so = extension(files)
    elf = Elf(so)
    if elf.machine != ELF_MACHINE[arch]:
        problems.append(f"{name}: ELF machine {elf.machine}, not {arch} ({ELF_MACHINE[arch]})")
    needed = elf.needed()
    if set(needed) - MANYLINUX_LIBS:
        problems.append(f"{name} links {sorted(set(needed) - MANYLINUX_LIBS)} (outside manylinux)")
    glibc = max((tuple(int(x) for x in v[6:].split(".")) for vs in elf.version_needs().values() for v in vs if v.startswith("GLIBC_")), default=(0,))
    if glibc > (2, 28):
        problems.append(f"{name} needs GLIBC_{'.'.join(map(str, glibc))} (> 2.28)")
    for p in problems:
        print("FAIL:", p)
    print(f"{tags[0] if tags else '?'}; {name}: ELF {arch}, needs {', '.join(needed)}, max GLIBC_{'.'.join(map(str, glibc))}")
    return 1 if problems else 0


# cudarc (dynamic loading) names what it loads and resolves: present only with the `cuda` feature.
# (A build without the feature, like the omlx wheels, has none of them.)
CUDA_MARKERS = [b"cuInit", b"cuLaunchKernel", b"nvrtcCompileProgram", b"cublasGemmEx", b"libnvrtc", b"libcublas"]


def python_side(files: dict) -> dict:
    """A wheel's files but the extension, RECORD and WHEEL (which name it and the tags) and
    maturin's CycloneDX SBOM of the Rust crates (per target by design, serial and timestamp)."""
    return {n: v for n, v in files.items() if not n.endswith((".so", ".dist-info/RECORD", ".dist-info/WHEEL")) and ".dist-info/sboms/" not in n}


def check_same_features(a: Path, b: Path) -> int:
    """Two builds of one package for two machines: the same CUDA path and the same Python files."""
    found, py = [], []
    for whl in (a, b):
        files = wheel_meta(whl)[1]
        _, so = extension(files)
        found.append([m.decode() for m in CUDA_MARKERS if m in so])
        py.append(python_side(files))
    rc = 0
    if found[0] != found[1] or len(found[0]) != len(CUDA_MARKERS):
        print(f"FAIL: CUDA markers differ or are missing: {a.name}: {found[0]}; {b.name}: {found[1]}")
        rc = 1
    if py[0] != py[1]:
        print(f"FAIL: Python files differ: {sorted(n for n in set(py[0]) | set(py[1]) if py[0].get(n) != py[1].get(n))}")
        rc = 1
    print(f"both carry the CUDA path (cudarc's {', '.join(found[0])}); {len(py[0])} Python/metadata files identical")
    return rc


LC_LOAD_DYLIBS = {0xC: "LC_LOAD_DYLIB", 0x80000018: "LC_LOAD_WEAK_DYLIB", 0x8000001F: "LC_REEXPORT_DYLIB",
                  0x20: "LC_LAZY_LOAD_DYLIB", 0x80000023: "LC_LOAD_UPWARD_DYLIB"}


def check_macos(mac: Path, linux: Path) -> int:
    problems = []
    tags, files = wheel_meta(mac)
    if "-cp311-abi3-macosx_" not in mac.name or not mac.name.endswith("_arm64.whl"):
        problems.append(f"file name {mac.name} is not a cp311-abi3 macOS arm64 wheel")
    if not tags or any(not (t.startswith("cp311-abi3-macosx_") and t.endswith("_arm64")) for t in tags):
        problems.append(f"WHEEL tags {tags}")
    name, so = extension(files)
    if not name.endswith(".abi3.so"):
        problems.append(f"extension {name} is not named .abi3.so")
    magic, cputype, _sub, filetype, ncmds, _sizeofcmds, _flags = struct.unpack_from("<IiiIIII", so, 0)
    if magic != 0xFEEDFACF or cputype != 0x0100000C:
        problems.append(f"{name}: not a 64-bit arm64 Mach-O (magic {magic:#x}, cputype {cputype:#x})")
        for p in problems:
            print("FAIL:", p)
        return 1
    dylibs, minos, sdk, signature, undefined_py = [], None, None, None, 0
    pos = 32
    symtab = None
    for _ in range(ncmds):
        cmd, size = struct.unpack_from("<II", so, pos)
        if cmd in LC_LOAD_DYLIBS:
            (off,) = struct.unpack_from("<I", so, pos + 8)
            dylibs.append(so[pos + off : so.index(b"\0", pos + off)].decode())
        elif cmd == 0x32:  # LC_BUILD_VERSION
            plat, mn, sd = struct.unpack_from("<III", so, pos + 8)
            minos, sdk = (plat, mn >> 16, (mn >> 8) & 0xFF), f"{sd >> 16}.{(sd >> 8) & 0xFF}"
        elif cmd == 0x1D:  # LC_CODE_SIGNATURE
            signature = struct.unpack_from("<II", so, pos + 8)
        elif cmd == 0x2:  # LC_SYMTAB
            symtab = struct.unpack_from("<IIII", so, pos + 8)
        pos += size
    bad = [d for d in dylibs if not (d.startswith("/usr/lib/") or d.startswith("/System/"))]
    if bad:
        problems.append(f"{name} links non-system libraries {bad}")
    if any("python" in d.lower() for d in dylibs):
        problems.append(f"{name} links libpython: {dylibs}")
    if symtab:
        symoff, nsyms, stroff, _ = symtab
        for i in range(nsyms):
            strx, ntype, _sect, _desc, _value = struct.unpack_from("<IBBhQ", so, symoff + 16 * i)
            if ntype & 0x0E == 0 and ntype & 0x01:  # N_UNDF, N_EXT
                s = so[stroff + strx : so.index(b"\0", stroff + strx)]
                undefined_py += s.startswith(b"_Py")
    if undefined_py == 0:
        problems.append(f"{name} leaves no Python symbols undefined (expected -undefined dynamic_lookup)")
    if minos is None or minos[0] != 1 or minos[1:] > (11, 0):
        problems.append(f"{name}: LC_BUILD_VERSION {minos} is not macOS <= 11.0 (the tag's)")
    sig = verify_adhoc_signature(so, signature) if signature else "no LC_CODE_SIGNATURE (arm64 macOS refuses unsigned code)"
    if sig != "ok":
        problems.append(f"{name}: code signature: {sig}")

    # The Python side must be the Linux wheel's, byte for byte (and the same metadata).
    _, lfiles = wheel_meta(linux)
    pm, pl = python_side(files), python_side(lfiles)
    if pm != pl:
        diff = sorted(n for n in set(pm) | set(pl) if pm.get(n) != pl.get(n))
        problems.append(f"Python files differ from the Linux wheel's: {diff}")
    for p in problems:
        print("FAIL:", p)
    print(f"{tags[0] if tags else '?'}; {name}: arm64 Mach-O (filetype {filetype}), macOS >= {minos[1]}.{minos[2]} (sdk {sdk}), links "
          f"{', '.join(dylibs)}; {undefined_py} _Py* symbols left to dynamic lookup; ad-hoc signature {sig}; "
          f"{len(pm)} Python/metadata files identical to the Linux wheel's")
    return 1 if problems else 0


def verify_adhoc_signature(so: bytes, sig: tuple[int, int]) -> str:
    """Check the embedded code signature's CodeDirectory page hashes against the file."""
    off, size = sig
    blob = so[off : off + size]
    magic, _length, count = struct.unpack_from(">III", blob, 0)
    if magic != 0xFADE0CC0:
        return f"bad SuperBlob magic {magic:#x}"
    for i in range(count):
        typ, boff = struct.unpack_from(">II", blob, 12 + 8 * i)
        if typ != 0:  # CSSLOT_CODEDIRECTORY
            continue
        cd = blob[boff:]
        (cmagic, _l, _v, _flags, hash_off, _ident, _nspecial, ncode, code_limit, hash_size, hash_type, _plat, page_log) = struct.unpack_from(">IIIIIIIIIBBBB", cd, 0)
        if cmagic != 0xFADE0C02:
            return f"bad CodeDirectory magic {cmagic:#x}"
        if hash_type != 2 or hash_size != 32:
            return f"hash type {hash_type} (size {hash_size}), expected SHA-256"
        page = 1 << page_log
        for k in range(ncode):
            want = cd[hash_off + k * 32 : hash_off + (k + 1) * 32]
            if hashlib.sha256(so[k * page : min((k + 1) * page, code_limit)]).digest() != want:
                return f"page {k} hash mismatch"
        if code_limit != off:
            return f"code limit {code_limit} is not the signature's offset {off}"
        return "ok"
    return "no CodeDirectory"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "prefill":
        return prefill()
    if cmd == "run":
        if len(args) < 4 or args[0] != "--out" or args[2] != "--":
            print("usage: wheel_smoke.py run --out FILE -- PREFILL_CMD...", file=sys.stderr)
            return 2
        return run(Path(args[1]), args[3:])
    if cmd == "compare":
        return compare(Path(args[0]), Path(args[1]))
    if cmd == "show":
        print(summary(json.loads(Path(args[0]).read_text())))
        return 0
    if cmd == "unpack":
        d = Path(args[1])
        if d.exists():
            import shutil

            shutil.rmtree(d)
        zipfile.ZipFile(args[0]).extractall(d)
        return 0
    if cmd == "check-manylinux":
        return check_manylinux(Path(args[0]), args[1])
    if cmd == "check-same-features":
        return check_same_features(Path(args[0]), Path(args[1]))
    if cmd == "check-macos":
        return check_macos(Path(args[0]), Path(args[1]))
    print(f"unknown command {cmd!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
