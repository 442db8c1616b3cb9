"""Type stubs for ``pd_bridge_omlx._native``, the decode side's native module (Rust, pyo3).

Python hands it plain data (paths, token positions, little-endian bf16 buffers); all cache math
lives in the core.
"""

from collections.abc import Callable
from os import PathLike
from pathlib import Path

from typing_extensions import Buffer

VERSION: str
"""The wheel's version (the Rust crate's)."""

class PdBridgeError(Exception):
    """Base class of every pd-bridge error; both wheels raise the same classes for the same core
    errors. From ``ingest``: ``args == (message, blocks)``, the blocks written (each whole and
    valid) before the stream broke, the class saying what broke it (``WireError``,
    ``AuthError``, ...)."""

class ConfigError(PdBridgeError):
    """The decoder's config.json is missing or has an unsupported value."""

class WeightsError(PdBridgeError):
    """A decoder weight is missing, malformed or stored in an unsupported format."""

class InputError(PdBridgeError):
    """Input that does not fit: attention rows of the wrong width or positions, a bad buffer, a
    refused segment, an unknown layer or block."""

class WireError(PdBridgeError):
    """A segment stream that is malformed, out of order, foreign, or that broke."""

class AuthError(PdBridgeError):
    """A peer that does not prove the shared token."""

class DeviceError(PdBridgeError):
    """The GPU path failed, or was asked for where there is none. The message starts with what
    failed: ``device, built without CUDA``, ``CUDA library``, ``no CUDA device``, ``out of
    memory``, ``CUDA driver``, ``cuBLAS``, ``NVRTC`` or ``GPU capture``."""

class InternalError(PdBridgeError):
    """A bug in pd-bridge (a Rust panic), caught at the boundary: the engine keeps running. Never
    pyo3's ``PanicException`` (a ``BaseException``)."""

class BlockRejected(PdBridgeError):
    """A block file that must not be served; the message says why."""

class Weights:
    """The decoder's attention-cache weights, read from an MLX model directory."""

    @staticmethod
    def load(model_dir: str | PathLike[str]) -> Weights:
        """Read config.json and the attention-cache tensors. Raises ConfigError, WeightsError
        or OSError."""
    @property
    def fingerprint(self) -> str:
        """``sha256:<hex>`` over the plan and the tensors the cache math reads."""
    @property
    def family(self) -> str:
        """``"deepseek_v4"`` or ``"mla"``."""
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def formats(self) -> list[tuple[str, str]]:
        """Every projection the cache math reads, with how the model stores it: ``bf16``,
        ``affine 4-bit g64`` (bits 2-8, groups 32/64/128), ``mxfp4``, ``mxfp8`` or ``nvfp4``."""

class CacheBuilder:
    """Per-layer decoder cache state for one request, fed chunks of attention input."""

    def __init__(self, weights: Weights, decoder_step: int, omlx_format: str | None = None) -> None:
        """``decoder_step``: the decoder's prefill step grid (oMLX's block size); ``omlx_format``:
        the decoder's block format (``omlx_formats()``; default the fork's), which decides its
        ratio-4 overlap semantics and window rows. Raises ConfigError for an unknown format."""
    def feed(self, layer: int, start: int, data: Buffer) -> None:
        """Fold ``[rows, hidden]`` attention input (little-endian bf16), first token at absolute
        position ``start``, into ``layer``'s state. ``data`` is any C-contiguous buffer (bytes,
        bytearray, memoryview, a numpy uint8/uint16 array), read in place. Raises InputError."""
    def processed(self, layer: int) -> int:
        """Tokens of ``layer`` folded in so far."""
    def snapshot(self, layer: int) -> list[tuple[str, list[int], bytes]]:
        """The layer's state as ``[(name, shape, little-endian bf16 bytes)]``."""

class V41Weights:
    """DeepSeek-V4.1's (``model_type: deepseek_v41``) cache weights, read from an MLX model
    directory. A family of its own: it has no oMLX block format, so no block writing."""

    @staticmethod
    def load(model_dir: str | PathLike[str]) -> V41Weights:
        """Read config.json and the cache tensors. Raises ConfigError (e.g. for Engram layers,
        which mlx-lm refuses too), WeightsError or OSError."""
    @property
    def fingerprint(self) -> str:
        """``sha256:<hex>`` over the plan and the tensors the cache math reads."""
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    def carry_state_of(self, position: int, layers: list[tuple[bytes, bytes, bytes]]) -> bytes:
        """The carry state at token ``position`` from the decoder's own ``LayerCache`` arrays:
        per layer ``(window, pending_kv, pending_gate)`` as little-endian bytes (the window's
        last ``min(position, sliding_window)`` bf16 rows; a ratio-2 pool's float32 pending rows,
        else empty). The bytes ``V41CacheBuilder.resume`` takes; checked against the plan
        (PdBridgeError naming what does not fit)."""
    def layer_kind(self, layer: int) -> tuple[int, bool, bool]:
        """``(ratio, pools, index_keys)``: the compress ratio, whether the layer keeps the
        compressed-KV pool (a KV source with a non-zero ratio), and the index keys too."""

class V41CacheBuilder:
    """DeepSeek-V4.1's per-layer cache state for one request, fed chunks of attention input;
    any chunking gives the same state."""

    def __init__(self, weights: V41Weights) -> None: ...
    @staticmethod
    def resume(weights: V41Weights, carry_state: bytes) -> V41CacheBuilder:
        """The state at the position the carry state (``carry_state()``'s bytes) names; rows
        fed again from before it are skipped. Raises PdBridgeError naming what does not fit."""
    def carry_state(self) -> bytes:
        """The carry state after the tokens every layer has processed (windows and pending
        rows); raises InputError if the layers disagree."""
    @property
    def origin(self) -> int:
        """Where a resumed state starts (0: from the first token)."""
    def feed(self, layer: int, start: int, data: Buffer) -> None:
        """Fold ``[rows, hidden]`` attention input (little-endian bf16, any C-contiguous
        buffer), first token at absolute position ``start``, into ``layer``'s state. Raises
        InputError."""
    def processed(self, layer: int) -> int:
        """Tokens of ``layer`` folded in so far."""
    def snapshot(self, layer: int) -> list[tuple[str, str, list[int], bytes]]:
        """The layer's state as ``[(name, dtype, shape, little-endian bytes)]`` under mlx-lm's
        ``LayerCache`` names: ``window`` (``"bfloat16"``); on a pool ``compress_kv``, ``index_k``
        and ``pending_kv``/``pending_gate`` (``"float32"``; after a resume the first two start
        at group ``origin // ratio``)."""

class BlockWriter:
    """Writes one request's full blocks into an oMLX cache directory, named by oMLX's chain hash."""

    def __init__(
        self,
        cache_dir: str | PathLike[str],
        model_name: str,
        block_size: int,
        token_ids: list[int],
        omlx_format: str | None = None,
        model_dir: str | PathLike[str] | None = None,
    ) -> None:
        """``model_name``: the model string oMLX hashes with (the fork: the model directory path
        it loaded; upstream: the model id); ``token_ids``: the request's ids as oMLX tokenized
        them; ``omlx_format``: the block format to write (``omlx_formats()``; default the fork's);
        ``model_dir``: the decoder's model directory, whose ``config.json`` plan every received
        segment and every file found on a block's name is checked against."""
    def resume(self, carry_state: bytes) -> int:
        """Continue this request's stream at the block boundary the carry state names (the bytes
        ``carry_state()`` read from the held block, also sent to the prefill host): the next
        segment must be that block, and ``ingest`` pulls from there. Call it before the first
        segment. Raises PdBridgeError for a carry state of another format, block size or prefix,
        past the prompt, or for the fork's full-pool blocks. Returns the next block's index."""
    @property
    def checks_plan(self) -> bool:
        """Whether segments are checked against the decoder's plan (a ``model_dir`` was given)."""
    def write_segment(self, payload: bytes | bytearray | memoryview) -> tuple[str, int, bool]:
        """Admit and write the block one received segment payload carries (the stream's next,
        in order from block 0), checked against the plan and the block grid (every array's
        shape, finite values) before anything is written; a refused segment raises
        ``InputError`` naming block, layer, array and what was wrong, and writes nothing.
        Returns ``(path, bytes, existed)``; the flush finishes in the background."""
    @property
    def omlx_format(self) -> str:
        """The block format this writer writes."""
    @property
    def num_blocks(self) -> int: ...
    def hash_hex(self, index: int) -> str:
        """Block ``index``'s chain hash, hex."""
    def flush(self) -> None:
        """Wait until every written block is on disk under its final name (visible to oMLX)."""
    def write(self, builder: CacheBuilder, index: int) -> tuple[str, int, bool]:
        """Write block ``index`` from ``builder``, whose layers must have processed exactly the
        block's end; returns ``(path, bytes, existed)``. The flush finishes in the background."""

class LandedBlock:
    """One block ``ingest`` wrote and flushed under its final name, validated once by the core
    (against the writer's format, model name, block size, cache directory and, with a
    ``model_dir``, the decoder's plan): what the decode host needs to put it into oMLX's index
    without recomputing its path or reading and checking the file again."""

    @property
    def index(self) -> int:
        """The block's index in the prompt's chain."""
    @property
    def hash_hex(self) -> str:
        """Its chain hash, hex (the file's name)."""
    @property
    def path(self) -> Path:
        """``<cache>/<hash[0]>/<hash>.safetensors``."""
    @property
    def existed(self) -> bool:
        """Already on disk (a sound block of this prompt, left as it was), not written now."""
    @property
    def file_size(self) -> int | None:
        """The file's size when it validated, else None."""
    @property
    def rejected(self) -> str | None:
        """Why it must not be served (``"<path>: <reason>"``, as ``inspect_block`` raises it),
        else None."""

class IngestControl:
    """Stops an ``ingest`` running on another thread; blocks already written stay. One per pull."""

    def __init__(self) -> None: ...
    def cancel(self) -> None: ...
    @property
    def cancelled(self) -> bool: ...

def inspect_block(
    path: str | PathLike[str],
    model_name: str | None = None,
    num_layers: int | None = None,
    block_size: int | None = None,
    omlx_format: str | None = None,
    model_dir: str | PathLike[str] | None = None,
    cache_dir: str | PathLike[str] | None = None,
    move_bad: bool = False,
) -> tuple[str, int, int, str, int]:
    """Validate a block file before oMLX may index it, without following links or blocking on
    a FIFO (``model_dir``: the decoder's, whose plan every tensor's dtype and shape must fit;
    ``cache_dir``: where it must lie). Returns ``(hash_hex, token_count, num_layers,
    model_name, file_size)``; raises BlockRejected with the reason otherwise. ``move_bad``: a
    file that can never be a valid block (a link, FIFO, directory, corrupt or misshapen) is
    first moved into the cache's ``.pd-bridge-quarantine``, which the message names."""

def clean_stale_temps(cache_dir: str | PathLike[str], max_age_seconds: float = 600.0) -> list[str]:
    """Remove the block writer's temp files a crashed writer left in ``cache_dir`` (its own
    hidden pattern only; never one a live writer may still be writing). Returns those removed."""

def omlx_formats() -> list[str]:
    """The block formats this build writes and validates, by name (newest first)."""

def expected_block_size(weights: Weights, omlx_format: str) -> int:
    """The block size ``omlx_format``'s oMLX picks for the model whose weights are loaded."""

def carry_state(weights: Weights, path: str | PathLike[str], block_size: int, position: int, omlx_format: str) -> bytes:
    """The decoder's carry state at the end of the held block ``path``, which ends at token
    ``position`` (``(index + 1) * block_size``): the bytes the prefill host's ``Capture.resume``
    takes. The file is validated as oMLX loads it and checked against the plan and ``position``;
    raises ``PdBridgeError`` naming what does not fit."""

def export_weights(model_dir: str | PathLike[str], out_dir: str | PathLike[str]) -> str:
    """Write the attention-cache tensors of the MLX model in ``model_dir`` (and its config.json)
    into ``out_dir`` for the prefill host; returns their fingerprint."""

def export_checkpoint(model_dir: str | PathLike[str], out_dir: str | PathLike[str]) -> tuple[str, list[tuple[str, str]], int]:
    """Write the MLX model in ``model_dir`` as a bf16 Hugging Face checkpoint vLLM loads (quantized
    modules dequantized exactly, mlx-lm's renames undone, its provenance recorded); returns the
    model fingerprint, the dequantized ``(module, format)`` pairs and the tensor count. MLA
    models; raises ConfigError for another family, WeightsError or OSError."""

def model_fingerprint(model_dir: str | PathLike[str]) -> str:
    """The identity of the checkpoint in ``model_dir`` (its tensors' names, dtypes, shapes and
    first 4 KiB); one written by ``export_checkpoint`` reports its source's."""

def capture_secret() -> str:
    """A fresh per-request capture secret (64 hex digits): sent to vLLM in ``pd_capture.secret``
    and given to ``ingest``; only its holder can pull the capture."""

def ingest(
    host: str,
    port: int,
    token: bytes,
    request_id: str,
    fingerprint: str,
    writer: BlockWriter,
    timeout_seconds: float = 60.0,
    on_block: Callable[[LandedBlock], object] | None = None,
    control: IngestControl | None = None,
    *,
    secret: str,
    token_ids: list[int],
    lanes: int = 1,
    stages: int = 1,
) -> tuple[int, str]:
    """Receive ``request_id``'s segments from the prefill host at ``host:port``, writing each
    block with ``writer`` as it arrives; ``on_block(block)`` gets each block's ``LandedBlock``
    once it is on disk under its final name and validated (path, hash, the validator's verdict).
    The stream is encrypted (wire version 4) and both sides prove the capture's key, derived from
    ``token``, ``secret`` (as sent in ``pd_capture.secret``), ``request_id``, ``fingerprint`` and
    ``token_ids`` (the prompt exactly as sent to vLLM): a prefill host that cannot is refused
    (AuthError) before a byte of cache is accepted. ``lanes`` > 1 pulls it over that many
    streams at once (1 to 16; blocks are still written in chain order). ``stages`` > 1 pulls
    a prefill host running vLLM's pipeline parallelism: stage ``s`` serves its layers' part of
    each block on ``port + s``, and a block is written once every stage's part arrived, joined
    (a stage that fails ends the capture there, naming the stage). Frame lengths are capped by what one block
    of the writer's plan (its ``model_dir``) can hold. Returns ``(blocks_written,
    verdict_json)``; a broken stream raises PdBridgeError (args ``(message, blocks)``)."""
