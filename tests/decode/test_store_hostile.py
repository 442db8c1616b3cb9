"""The store under attack, against a real oMLX (whichever the versions table finds installed).

A hostile prefill host or local user can put into the cache directory what the decoder would
never have computed. Here, with the tiny MLA model and a real ``omlx serve`` reading the cache:

- hostile segments (NaN values, cut off the block grid, arrays of the wrong width, out of
  order) fed through the writer's one entry point are refused naming block, layer and array,
  and nothing is written; the real segments afterwards are, and oMLX serves them as a hit with
  its native answer; a request for another prompt running meanwhile is answered exactly as
  before;
- a well-formed block of the wrong width on the prompt's block name (what a plan-less writer
  would have written) is refused by the rescan's plan check and moved aside; the prompt is
  answered natively and correctly, the concurrent request too;
- a symbolic link to a valid block outside the cache, a FIFO and a garbage file on the prompt's
  block names: oMLX starts (its scan opens no FIFO), the rescan answers promptly, refuses each
  naming why and moves it aside; the bridge's writer then writes the real blocks on those names
  and oMLX serves them;
- a temp file a crashed writer left is removed when oMLX sets up its cache directory (one whose
  writer's lock is gone at once, whatever pid its name holds); a live writer's (its lock held)
  is not.

Segments are built here from the core's own cache of MLX's attention inputs (the prefill host's
math), as the wire would carry them: the oMLX wheel's ``BlockWriter.write_segment`` takes the
payload bytes.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.engine  # starts real `omlx serve` processes: not in the quick lane

import engines

engines.require("omlx", "pd_bridge_omlx")

import bridge_blocks  # noqa: E402
import omlx_server  # noqa: E402
import parity  # noqa: E402
from pd_bridge_omlx import BlockWriter, CacheBuilder, InputError, Weights, inspect_block  # noqa: E402

OMLX = omlx_server.installed_omlx()
BRIDGE_ENV = {"PD_BRIDGE_OMLX": "1"}
MODEL = "tiny-mla"
PROMPT_TOKENS = 1200  # four 256-token blocks and a tail


@dataclass
class Run:
    root: Path
    model_dir: Path
    text: str
    ids: list[int]
    block_size: int
    n_blocks: int
    answer: str
    other_text: str
    other_answer: str
    model_name: str
    fingerprint: str
    latent: list[np.ndarray]  # per layer: [rows, kv_lora_rank] bf16 bits (uint16)
    k_pe: list[np.ndarray]


@pytest.fixture(scope="module")
def run(models, tmp_path_factory) -> Run:
    """oMLX's native answers (the prompt and an unrelated one) and the prompt's cache state as
    the core computes it from MLX's attention inputs."""
    tmp = tmp_path_factory.mktemp("hostile")
    root = tmp / "models"
    omlx_server.prepare_model(models / MODEL, root)
    model_dir = root / MODEL
    text, ids = omlx_server.prompt_of_tokens(model_dir, PROMPT_TOKENS)
    other_text, _ = omlx_server.prompt_of_tokens(model_dir, 300, seed=7)
    with omlx_server.serve(root, tmp / "native-cache", tmp / "home", model=MODEL) as s:
        answer = omlx_server.complete(s.base_url, s.model, text, 8)["choices"][0]["text"]
        other_answer = omlx_server.complete(s.base_url, s.model, other_text, 8)["choices"][0]["text"]
        block_size = omlx_server.logged_block_size(s)
        model_name = s.cache_model_name
    n_blocks = (len(ids) - 1) // block_size
    cap = bridge_blocks.capture(model_dir, ids, block_size, n_blocks)
    weights = Weights.load(str(model_dir))
    builder = CacheBuilder(weights, block_size, parity.omlx_format())
    for (start, _end), per_layer in zip(cap.steps, cap.inputs):
        for layer in range(weights.num_layers):
            builder.feed(layer, start, parity.bf16_bits(per_layer[layer]).tobytes())
    latent, k_pe = [], []
    for layer in range(weights.num_layers):
        state = {name: (shape, data) for name, shape, data in builder.snapshot(layer)}
        for name, out in (("latent", latent), ("k_pe", k_pe)):
            shape, data = state[name]
            out.append(np.frombuffer(data, dtype=np.uint16).reshape(shape))
    return Run(root, model_dir, text, ids, block_size, n_blocks, answer, other_text, other_answer, model_name,
               weights.fingerprint, latent, k_pe)  # fmt: skip


def segment(r: Run, k: int, *, start: int | None = None, arrays=None, shapes=None) -> bytes:
    """Block ``k``'s segment payload as the wire carries it (u32 header length, header JSON,
    arrays as little-endian bf16), with the given parts replaced."""
    b = r.block_size
    if arrays is None:
        arrays = [a[k * b : (k + 1) * b] for layer in range(len(r.latent)) for a in (r.latent[layer], r.k_pe[layer])]
    if shapes is None:
        shapes = [list(a.shape) for a in arrays]
    layers = [{"kind": "kv", "arrays": [{"rows": shapes[2 * i][0], "width": shapes[2 * i][1]},
                                        {"rows": shapes[2 * i + 1][0], "width": shapes[2 * i + 1][1]}]}
              for i in range(len(shapes) // 2)]  # fmt: skip
    s = k * b if start is None else start
    header = {"request_id": "hostile", "fingerprint": r.fingerprint, "omlx_format": OMLX.omlx_format,
              "index": k, "start": s, "end": s + b, "layers": layers}  # fmt: skip
    head = json.dumps(header).encode()
    return struct.pack("<I", len(head)) + head + b"".join(np.ascontiguousarray(a, dtype="<u2").tobytes() for a in arrays)


def writer(r: Run, cache: Path, plan: bool = True) -> BlockWriter:
    return BlockWriter(str(cache), r.model_name, r.block_size, r.ids, OMLX.omlx_format, model_dir=str(r.model_dir) if plan else None)


def rescan(server) -> dict:
    return omlx_server._request(f"{server.base_url}/pd-bridge/v1/rescan", {"model": server.model}, timeout=60)


class Concurrent:
    """A request for an unrelated prompt, in flight while the store is attacked."""

    def __init__(self, server, r: Run):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(server, r), daemon=True)
        self.thread.start()

    def _run(self, server, r: Run):
        try:
            self.result = omlx_server.complete(server.base_url, server.model, r.other_text, 64, timeout=300)
        except Exception as e:  # reported by check()
            self.error = e

    def check(self, r: Run):
        # Its answer may differ from a solo run where oMLX batches it with the attacked prompt
        # (batched arithmetic), so what is checked is that it is answered in full.
        self.thread.join(timeout=300)
        assert not self.thread.is_alive(), "the unrelated request hangs"
        assert self.error is None, f"the unrelated request failed: {self.error!r}"
        choice = self.result["choices"][0]
        assert choice["text"] and choice.get("finish_reason") in ("length", "stop"), self.result
        if not choice["text"].startswith(r.other_answer):
            print(f"\nthe unrelated request's answer differs from its solo run: {choice['text'][:40]!r} vs {r.other_answer!r}")


def block_names(r: Run, cache: Path) -> list[Path]:
    return [omlx_server.block_path(cache, h) for h in omlx_server.block_hashes(r.model_name, r.ids, r.block_size)[: r.n_blocks]]


def test_hostile_segments_are_refused_and_the_real_ones_served(run, tmp_path):
    r, cache = run, tmp_path / "cache"
    b = r.block_size
    with omlx_server.serve(r.root, cache, tmp_path / "home", model=MODEL, extra_env=BRIDGE_ENV) as s:
        other = Concurrent(s, r)
        w = writer(r, cache)
        assert w.checks_plan
        good0 = [a[:b] for layer in range(len(r.latent)) for a in (r.latent[layer], r.k_pe[layer])]

        nan = [a.copy() for a in good0]
        nan[2][3, 5] = 0x7FC0  # layer 1's latent, row 3, column 5: NaN
        with pytest.raises(InputError, match=r"segment for block 0, layer 1 array keys: value \d+ \(row 3, column 5\) is NaN"):
            w.write_segment(segment(r, 0, arrays=nan))
        inf = [a.copy() for a in good0]
        inf[1][-1, -1] = 0xFF80  # -inf
        with pytest.raises(InputError, match=r"layer 0 array values: .* is infinite"):
            w.write_segment(segment(r, 0, arrays=inf))
        with pytest.raises(InputError, match=r"covers tokens \[100, \d+\), not its block \[0, 256\) on the 256-token block grid"):
            w.write_segment(segment(r, 0, start=100))
        with pytest.raises(InputError, match=r"block 0 is the next one"):
            w.write_segment(segment(r, 1))
        # The same bytes declared as a latent twice as wide (half the rows).
        rank = good0[0].shape[1]
        shapes = [list(a.shape) for a in good0]
        shapes[0] = [b // 2, 2 * rank]
        with pytest.raises(InputError, match=rf"layer 0 array keys: {b // 2}x{2 * rank}, expected {b}x{rank}"):
            w.write_segment(segment(r, 0, shapes=shapes))
        narrow = [a.copy() for a in good0]
        narrow[0] = np.ascontiguousarray(good0[0][:, : rank // 2])
        with pytest.raises(InputError, match=rf"layer 0 array keys: {b}x{rank // 2}, expected {b}x{rank}"):
            w.write_segment(segment(r, 0, arrays=narrow))
        with pytest.raises(InputError, match=rf"has 1 layers, the decoder has {len(r.latent)}"):
            w.write_segment(segment(r, 0, arrays=good0[:2]))
        w.flush()
        assert omlx_server.block_files(cache) == [] and not list(cache.rglob("*pd-tmp")), "a refused segment wrote something"

        for k in range(r.n_blocks):
            w.write_segment(segment(r, k))
        w.flush()
        got = rescan(s)
        assert sorted(got["registered"]) == sorted(p.stem for p in block_names(r, cache)) and not got["rejected"], got
        hit = omlx_server.complete(s.base_url, s.model, r.text, 8)
        other.check(r)
        assert omlx_server._request(f"{s.base_url}/health", timeout=10) is not None
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == r.n_blocks * b
    assert hit["choices"][0]["text"] == r.answer


def test_a_misshapen_block_on_the_prompts_name_is_refused_and_moved_aside(run, tmp_path):
    """What a plan-less writer would accept (consistent, but half the latent width) reaches the
    cache as a well-formed block; the rescan checks it against the model's plan."""
    r, cache = run, tmp_path / "cache"
    b = r.block_size
    names = block_names(r, cache)
    with omlx_server.serve(r.root, cache, tmp_path / "home", model=MODEL, extra_env=BRIDGE_ENV) as s:
        other = Concurrent(s, r)
        w = writer(r, cache, plan=False)
        for k in range(2):
            arrays = [np.ascontiguousarray(a[k * b : (k + 1) * b, : a.shape[1] // 2]) for layer in range(len(r.latent)) for a in (r.latent[layer], r.k_pe[layer])]
            w.write_segment(segment(r, k, arrays=arrays))
        w.flush()
        assert names[0].is_file() and names[1].is_file()
        got = rescan(s)
        answer = omlx_server.complete(s.base_url, s.model, r.text, 8)
        other.check(r)
        log = s.log_path.read_text(errors="replace")
    assert not got["registered"], got
    reasons = dict(got["rejected"])
    for p in names[:2]:
        why = reasons[str(p)]
        rank = r.latent[0].shape[1]
        assert f"layer_0_state_0 is BF16 [1, 1, {b}, {rank // 2}], this model's block has BF16 [1, 1, {b}, {rank}]" in why, why
        assert "moved aside to" in why, why
        assert p.name in log
        if p.exists():  # oMLX stored its own block there when it prefilled the prompt
            inspect_block(str(p), model_name=r.model_name, block_size=b, omlx_format=OMLX.omlx_format, model_dir=str(r.model_dir))
    assert len(list((cache / ".pd-bridge-quarantine").iterdir())) == 2
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert answer["choices"][0]["text"] == r.answer


def test_a_misshapen_block_is_refused_at_start(run, tmp_path):
    """Dropped into the cache while oMLX is stopped: its start-up scan checks the block against
    the plan of the model it names, refuses it, and the prompt is answered natively."""
    r, cache = run, tmp_path / "cache"
    b = r.block_size
    w = writer(r, cache, plan=False)
    arrays = [np.ascontiguousarray(a[:b, : a.shape[1] // 2]) for layer in range(len(r.latent)) for a in (r.latent[layer], r.k_pe[layer])]
    w.write_segment(segment(r, 0, arrays=arrays))
    w.flush()
    bad = block_names(r, cache)[0]
    with omlx_server.serve(r.root, cache, tmp_path / "home", model=MODEL, extra_env=BRIDGE_ENV) as s:
        answer = omlx_server.complete(s.base_url, s.model, r.text, 8)
        log = s.log_path.read_text(errors="replace")
    line = next((l for l in log.splitlines() if bad.name in l and "not serving block" in l), None)
    assert line and "this model's block has BF16" in line, [l for l in log.splitlines() if "pd-bridge" in l][:20]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert answer["choices"][0]["text"] == r.answer


def test_links_fifos_and_garbage_on_block_names(run, tmp_path):
    r, cache = run, tmp_path / "cache"
    names = block_names(r, cache)
    # A valid block of this very prompt, outside the cache directory: a link to it must not be served.
    outside = tmp_path / "outside"
    w = writer(r, outside)
    w.write_segment(segment(r, 0))
    w.flush()
    real0 = block_names(r, outside)[0]
    for p in names:
        p.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(real0, names[0])
    os.mkfifo(names[1])
    names[2].write_bytes(b"\x00garbage on a block's name" * 40)
    t0 = time.monotonic()
    with omlx_server.serve(r.root, cache, tmp_path / "home", model=MODEL, extra_env=BRIDGE_ENV) as s:
        started = time.monotonic() - t0
        other = Concurrent(s, r)
        got = rescan(s)
        rescanned = time.monotonic() - t0 - started
        reasons = dict(got["rejected"])
        assert not got["registered"], got
        assert "symbolic link" in reasons[str(names[0])] and "moved aside" in reasons[str(names[0])], reasons
        assert "FIFO" in reasons[str(names[1])] and "moved aside" in reasons[str(names[1])], reasons
        assert "not a valid safetensors file" in reasons[str(names[2])] and "moved aside" in reasons[str(names[2])], reasons
        assert not any(os.path.lexists(p) for p in names[:3])
        # The names are free again: the bridge's writer writes the real blocks there.
        w = writer(r, cache)
        for k in range(r.n_blocks):
            assert w.write_segment(segment(r, k))[2] is False
        w.flush()
        again = rescan(s)
        hit = omlx_server.complete(s.base_url, s.model, r.text, 8)
        other.check(r)
    print(f"\noMLX started in {started:.1f}s with a FIFO on a block name; rescan answered in {rescanned:.2f}s")
    assert real0.read_bytes()[:8] and real0.is_file(), "the link's target was touched"
    assert sorted(again["registered"]) == sorted(p.stem for p in names), again
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == r.n_blocks * r.block_size
    assert hit["choices"][0]["text"] == r.answer
    assert len(list((cache / ".pd-bridge-quarantine").iterdir())) == 3


def test_stale_temp_files_are_removed_when_omlx_sets_up_its_cache(run, tmp_path):
    r, cache = run, tmp_path / "cache"
    sub = cache / "a"
    sub.mkdir(parents=True)
    stem = "a" * 64
    dead = next(p for p in range(4_000_000, 100_000, -7919) if not Path(f"/proc/{p}").exists())
    stale = sub / f".{stem}.{dead}.0.pd-tmp"
    stale.write_bytes(b"half a block")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    # A live writer holds flock(LOCK_EX) on its temp file until the rename: this test process
    # plays one, under a pid that is not alive there (a writer in another pid namespace).
    live = sub / f".{stem}.{dead}.1.pd-tmp"
    live.write_bytes(b"being written")
    os.utime(live, (time.time() - 120, time.time() - 120))
    # A writer SIGKILLed seconds ago: its pid in the name is alive (this process), its lock is
    # gone with it; removed at once, not a minute later.
    killed = sub / f".{stem}.{os.getpid()}.2.pd-tmp"
    killed.write_bytes(b"half a block")
    os.utime(killed, (time.time() - 5, time.time() - 5))
    omlx_tmp = sub / f"{stem}_tmp.safetensors"  # oMLX's own temp name: never ours to touch
    omlx_tmp.write_bytes(b"oMLX writing")
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with omlx_server.serve(r.root, cache, tmp_path / "home", model=MODEL, extra_env=BRIDGE_ENV) as s:
            log = s.log_path.read_text(errors="replace")
            health = omlx_server._request(f"{s.base_url}/health", timeout=10)
    assert health is not None
    assert not stale.exists(), "the crashed writer's temp file survived oMLX's start"
    assert not killed.exists(), "the killed writer's unlocked temp file survived oMLX's start"
    assert live.exists() and omlx_tmp.exists()
    for gone in (stale, killed):
        assert f"removed stale block temp file {gone}" in log, [l for l in log.splitlines() if "temp" in l]
    shutil.rmtree(cache)
