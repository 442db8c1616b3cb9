"""Write a prompt's blocks from the Rust math and compare them with the blocks oMLX wrote.

Shared by the tests and the README's main command. The attention inputs come from the real MLX
model run in-process over the same token ids, on oMLX's prefill grid (one decoder call per
block); the core computes each layer's cache and `BlockWriter` writes block after block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import omlx_server
import parity
import tiny_models
from pd_bridge_omlx import BlockWriter, CacheBuilder, Weights


@dataclass
class Written:
    hashes: list[str]
    paths: list[Path]
    core_seconds: float


def capture(model_dir: Path, ids: list[int], block_size: int, n_blocks: int) -> parity.ForwardCapture:
    """The MLX model's attention inputs for the first ``n_blocks`` blocks, on oMLX's grid."""
    model = tiny_models.load(model_dir)
    classes = parity.v4_classes() if model.args.model_type == "deepseek_v4" else parity.mla_classes()
    expected_of = parity.v4_expected if model.args.model_type == "deepseek_v4" else parity.mla_expected
    return parity.mlx_prefill(model, ids[: n_blocks * block_size], block_size, classes, expected_of)


def write_blocks(model_dir: Path, model_name: str, ids: list[int], block_size: int, n_blocks: int, cache_dir: Path,
                 cap: parity.ForwardCapture | None = None) -> Written:  # fmt: skip
    """Write the first ``n_blocks`` blocks of ``ids`` from the core's math, in the installed
    oMLX's block format (``cap``: attention inputs already captured by ``capture``)."""
    cap = cap or capture(model_dir, ids, block_size, n_blocks)
    weights = Weights.load(str(model_dir))
    fmt = parity.omlx_format()
    builder = CacheBuilder(weights, block_size, fmt)
    writer = BlockWriter(str(cache_dir), model_name, block_size, ids, fmt)
    paths = []
    t0 = time.perf_counter()
    for i, ((start, _end), per_layer) in enumerate(zip(cap.steps, cap.inputs)):
        for layer in range(weights.num_layers):
            builder.feed(layer, start, parity.bf16_bits(per_layer[layer]).tobytes())
        path, _bytes, _existed = writer.write(builder, i)
        paths.append(Path(path))
    writer.flush()
    return Written([writer.hash_hex(i) for i in range(n_blocks)], paths, time.perf_counter() - t0)


@dataclass
class BlockDiff:
    identical: int = 0
    compared: int = 0
    problems: list[str] = field(default_factory=list)


def tensor_bytes(path: Path, header: dict, name: str) -> bytes:
    for n, _dt, _shape, (a, b) in header["tensors"]:
        if n == name:
            with open(path, "rb") as f:
                f.seek(8 + header["header_len"] + a)
                return f.read(b - a)
    raise KeyError(name)


def compare_block(ours: Path, theirs: Path, diff: BlockDiff) -> None:
    """Tensor by tensor and key by key, ``created_at`` aside."""
    diff.compared += 1
    a, b = omlx_server.read_block_header(ours), omlx_server.read_block_header(theirs)
    problems = []
    if a["tensors"] != b["tensors"]:
        problems.append(f"tensor table differs: {a['tensors'][:3]}... vs {b['tensors'][:3]}...")
    ka = [k for k in a["metadata"] if k != "created_at"]
    kb = [k for k in b["metadata"] if k != "created_at"]
    if ka != kb:
        problems.append(f"metadata keys differ: only ours {sorted(set(ka) - set(kb))}, only oMLX's {sorted(set(kb) - set(ka))}, order equal: {sorted(ka) == sorted(kb)}")
    for k in ka:
        if k in b["metadata"] and a["metadata"][k] != b["metadata"][k]:
            problems.append(f"metadata {k}: {a['metadata'][k]!r} vs {b['metadata'][k]!r}")
    if not problems:
        for name, *_ in a["tensors"]:
            if tensor_bytes(ours, a, name) != tensor_bytes(theirs, b, name):
                problems.append(f"tensor {name} bytes differ")
    if problems:
        diff.problems.extend(f"{ours.name}: {p}" for p in problems)
    else:
        diff.identical += 1
