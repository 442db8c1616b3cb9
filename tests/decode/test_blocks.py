"""oMLX side: blocks written by the Rust writer against the blocks a real oMLX writes itself.

One oMLX server per model serves a ~1,200-token prompt natively and stores its blocks; the Rust
writer writes the same prompt's blocks from the Rust math into a second directory; every file
must match oMLX's, tensor by tensor and key by key (``created_at`` aside).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

import bridge_blocks
import omlx_server

PROMPT_TOKENS = 1200


@dataclass
class NativeRun:
    name: str
    root: Path
    model_name: str
    ids: list[int]
    text: str
    block_size: int
    n_blocks: int
    native_dir: Path
    answer: str
    warm_cached: int


@pytest.fixture(scope="module", params=["tiny-v4-bf16", "tiny-mla"])
def native(request, models, tmp_path_factory) -> NativeRun:
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    root = tmp / "models"
    omlx_server.prepare_model(models / name, root)
    text, ids = omlx_server.prompt_of_tokens(root / name, PROMPT_TOKENS)
    cache = tmp / "native-cache"
    with omlx_server.serve(root, cache, tmp / "home", model=name) as s:
        cold = omlx_server.complete(s.base_url, s.model, text, 8)
        block_size = omlx_server.logged_block_size(s)
        assert block_size, "oMLX did not log its block size"
        n_blocks = (len(ids) - 1) // block_size
        omlx_server.wait_for_blocks(cache, n_blocks)
        warm = omlx_server.complete(s.base_url, s.model, text, 8)
        model_name = str(s.model_path)
    return NativeRun(
        name, root, model_name, ids, text, block_size, n_blocks, cache,
        cold["choices"][0]["text"], warm["usage"]["prompt_tokens_details"]["cached_tokens"],
    )


def test_native_oracle_is_sane(native):
    # The prompt's ids are the ones oMLX hashed: its files are exactly our chain.
    files = {p.stem for p in omlx_server.block_files(native.native_dir)}
    expected = set(omlx_server.block_hashes(native.model_name, native.ids, native.block_size)[: native.n_blocks])
    assert files == expected
    assert native.warm_cached == native.n_blocks * native.block_size


def test_rust_blocks_are_identical_to_omlx_blocks(native, tmp_path):
    ours = bridge_blocks.write_blocks(native.root / native.name, native.model_name, native.ids, native.block_size, native.n_blocks, tmp_path)
    assert ours.hashes == omlx_server.block_hashes(native.model_name, native.ids, native.block_size)[: native.n_blocks]
    diff = bridge_blocks.BlockDiff()
    for h, path in zip(ours.hashes, ours.paths):
        bridge_blocks.compare_block(path, omlx_server.block_path(native.native_dir, h), diff)
    print(f"\n{native.name}: {diff.identical}/{diff.compared} blocks identical to oMLX's own")
    assert diff.compared == native.n_blocks >= 2
    assert diff.identical == diff.compared, diff.problems[:10]
    assert not list(tmp_path.rglob("*tmp*")), "no temporary file may be left behind"
