"""oMLX's own answers and blocks for the decode tests' prompts: one real ``omlx serve`` per model
serves its prompt natively and stores its blocks; the session shares the result (conftest's
``native_v4`` / ``native_mla``), since every test only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import bridge_blocks
import omlx_server


def upstream() -> bool:
    return omlx_server.installed_omlx().distribution == "omlx"


def prompt_tokens(name: str) -> int:
    """Upstream: three 2,048-token DeepSeek-V4 blocks and a partial fourth; MLA blocks are 256."""
    return {"tiny-v4-bf16": 3 * 2048 + 700 if upstream() else 1200, "tiny-mla": 1200}[name]


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
    _capture: list = field(default_factory=list)

    @property
    def capture(self):
        """MLX's attention inputs for the full blocks (computed once, shared by the tests)."""
        if not self._capture:
            self._capture.append(bridge_blocks.capture(self.root / self.name, self.ids, self.block_size, self.n_blocks))
        return self._capture[0]


def native_run(name: str, models: Path, tmp_path_factory) -> NativeRun:
    tmp = tmp_path_factory.mktemp(name)
    root = tmp / "models"
    omlx_server.prepare_model(models / name, root)
    text, ids = omlx_server.prompt_of_tokens(root / name, prompt_tokens(name))
    cache = tmp / "native-cache"
    with omlx_server.serve(root, cache, tmp / "home", model=name) as s:
        cold = omlx_server.complete(s.base_url, s.model, text, 8)
        block_size = omlx_server.logged_block_size(s)
        assert block_size, "oMLX did not log its block size"
        n_blocks = (len(ids) - 1) // block_size
        omlx_server.wait_for_blocks(cache, n_blocks)
        warm = omlx_server.complete(s.base_url, s.model, text, 8)
        model_name = s.cache_model_name
    return NativeRun(
        name, root, model_name, ids, text, block_size, n_blocks, cache,
        cold["choices"][0]["text"], warm["usage"]["prompt_tokens_details"]["cached_tokens"],
    )
