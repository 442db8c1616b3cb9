"""Type stubs for ``pd_bridge_vllm._native``, the prefill side's native module (Rust, pyo3).

Importing it touches no GPU; CUDA starts lazily in the worker that first feeds a CUDA tensor.
"""

from typing_extensions import Buffer
from os import PathLike
from typing import Any

VERSION: str
"""The wheel's version (the Rust crate's)."""

class PdBridgeError(Exception):
    """Base class of every pd-bridge error; both wheels raise the same classes for the same core
    errors."""

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

def model_fingerprint(model_dir: str | PathLike[str]) -> str:
    """The identity of the checkpoint in ``model_dir`` (its tensors' names, dtypes, shapes and
    first 4 KiB); a checkpoint written by ``pd-bridge export-checkpoint`` reports the decoder
    model's. The decode host compares it with its own model's to say *same* or *different*
    weights."""

def decoder_model_fingerprint(weights_dir: str | PathLike[str]) -> str | None:
    """The decoder model's fingerprint as ``pd-bridge export-weights`` recorded it beside the
    weights (None for an export that predates the record)."""

def weights_fingerprint(model_dir: str | PathLike[str]) -> str:
    """Read the decoder's attention-cache weights from ``model_dir`` and return their
    fingerprint (``sha256:<hex>``), the value the decode host compares before it trusts a
    stream. Raises ConfigError, WeightsError or OSError."""

class Weights:
    """The decoder's attention-cache weights (as exported from the decode host) and fingerprint."""

    @staticmethod
    def load(model_dir: str | PathLike[str]) -> Weights:
        """Read config.json and the attention-cache tensors of an MLX model directory."""
    @property
    def fingerprint(self) -> str:
        """``sha256:<hex>`` over the plan and the tensors the cache math reads."""
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def formats(self) -> list[tuple[str, str]]:
        """Each cache projection and how the decoder model stores it (``bf16``, ``affine 4-bit
        g64``, ``mxfp4``, ``mxfp8``, ``nvfp4``)."""

class SegmentServer:
    """Serves captured segments, encrypted, to decode hosts that prove a capture's key (the
    shared token, the capture's per-request secret, its id, weights and prompt)."""

    def __init__(
        self,
        address: str,
        token: bytes,
        idle_seconds: float = 60.0,
        *,
        queue_wait_seconds: float = 600.0,
        keepalive_seconds: float = 5.0,
        handshake_seconds: float = 10.0,
        max_connections: int = 64,
        grace_seconds: float = 30.0,
        pull_timeout_seconds: float = 120.0,
        memory_bytes: int = 1 << 30,
    ) -> None:
        """Bind ``address`` (``host:port``; port 0 picks one). ``idle_seconds``: how long a stream
        waits for the next segment; ``queue_wait_seconds``: how long a pull waits for its capture
        to start (vLLM may queue the request behind others); ``keepalive_seconds``: how often a
        waiting pull hears that the host is alive; ``handshake_seconds``: a
        connection's deadline to finish the handshake, however slowly it sends;
        ``max_connections``: open at once (more are refused); ``grace_seconds``: how long a sealed
        capture nobody pulled is kept; ``pull_timeout_seconds``: how long any unpulled capture is
        kept; ``memory_bytes``: segment bytes all captures may hold before the oldest unpulled
        ones are dropped. Raises ConfigError for a bad value, WireError if it cannot bind."""
    @property
    def port(self) -> int:
        """The port it listens on."""
    @property
    def address(self) -> str:
        """``host:port`` it listens on."""
    @property
    def outboxes(self) -> int:
        """Captures held (registered, not yet sent or dropped)."""
    @property
    def queued_bytes(self) -> int:
        """Segment bytes all captures hold now."""
    @property
    def connections(self) -> int:
        """Connections open now."""

def prompt_digest(token_ids: list[int]) -> str:
    """SHA-256 (64 hex digits) over a prompt's token ids, as the wire binds them into a capture's
    key (the connector's scheduler computes it from the ids vLLM prefills)."""

class Capture:
    """One request's capture: attention inputs in, segments out to the server as blocks complete."""

    def __init__(
        self,
        weights: Weights,
        request_id: str,
        prompt_tokens: int,
        block_size: int,
        server: SegmentServer,
        omlx_format: str | None = None,
        secret: str | None = None,
        prompt_digest: str | None = None,
        fingerprint: str | None = None,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """``omlx_format``: the decoder's oMLX block format, as the decode host's capture spec
        names it (default the fork's); it decides the overlap semantics and what segments carry.
        ``secret`` (64 hex digits, the decode host's ``pd_capture.secret``) and ``prompt_digest``
        (``prompt_digest(ids)`` of the ids prefilled) key the capture on the wire: only a decode
        host holding that secret for this id, weights and prompt can pull it (``fingerprint``: the
        weights fingerprint the decode host asked for, default these weights'). Without them the
        capture computes but nothing can pull its segments. ``layers=(start, end)``: this process
        is one stage of vLLM's pipeline parallelism, fed only those model layers; its segments
        carry those, and the decode host joins the stages' parts into whole blocks."""
    @property
    def stream_closed(self) -> str | None:
        """Why the segment stream stopped before its seal went out (reader gone, never pulled,
        dropped by the memory bound), else None: such a capture is no longer worth feeding."""
    def resume(self, carry_state: bytes) -> int:
        """Resume this capture, before anything is fed, at the block boundary the decode host's
        carry state names (the bytes ``pd_bridge_omlx._native.carry_state`` read from its block):
        segments start at that block, rows fed from before it are ignored, rows after it must all
        be fed. Raises PdBridgeError naming what does not fit (weights fingerprint, format, block
        size, position, layers, damaged bytes); the capture is then unchanged. Returns the resume
        point in tokens."""
    @property
    def resumed_at(self) -> int:
        """The block boundary this capture resumed at, in tokens (0: captured from token 0)."""
    def feed(self, layer: int, start: int, data: Buffer) -> None:
        """Fold ``[rows, hidden]`` attention input (little-endian bf16) for tokens from ``start``.
        ``data`` is any C-contiguous buffer (bytes, bytearray, memoryview, a numpy uint8/uint16
        array), read in place; it must not change during the call. Raises InputError."""
    def feed_ptr(self, layer: int, start: int, data_ptr: int, nbytes: int) -> None:
        """Fold attention input read straight from host memory: ``nbytes`` of contiguous
        little-endian bf16 at ``data_ptr`` (a CPU tensor's ``data_ptr()``), kept alive and
        unchanged by the caller for the call."""
    def feed_cuda(self, layer: int, start: int, data_ptr: int, nbytes: int, dtype: str, device: int, stream: int) -> None:
        """Fold attention input from a CUDA tensor (``dtype`` ``"bfloat16"``), pooled on a GPU
        side stream ordered after ``stream``; never waits for the device. The caller keeps the
        memory alive until ``side_stream`` has read it."""
    @property
    def side_stream(self) -> int | None:
        """The GPU side stream (a ``CUstream`` as an integer) once a CUDA feed started it."""
    @property
    def pending(self) -> int:
        """GPU blocks with device work queued whose segments are not out yet (0 after the seal)."""
    def poll(self) -> int:
        """Take in finished GPU chunks without waiting and send the segments they complete;
        returns how many segments went out."""
    def hold_until_confirmed(self) -> None:
        """From now on a finished segment is sent only once ``confirm`` covers every token it
        holds (rows whose place in the batch is checked later, without waiting for the device);
        the seal drops what was never confirmed."""
    def confirm(self, upto: int) -> int:
        """The rows of tokens before ``upto`` were fed from the right place: send the segments
        that end there; returns how many went out."""
    @property
    def segment_bytes(self) -> int:
        """Bytes of the segments sent so far, as they go on the wire (frames included)."""
    @property
    def segments_digest(self) -> tuple[int, str]:
        """Segments sent so far and the SHA-256 (hex) over them, in order. Kept only for a capture
        made without a secret (tests, diagnostics); otherwise ``InputError``."""
    @property
    def segment_bytes(self) -> int:
        """Bytes of the segments sent so far, as they go on the wire."""
    def seal(self, failure: str | None = None) -> str:
        """Seal the capture (``failure``: why it stopped early, if it did); returns the verdict
        JSON. Waits for GPU chunks still in flight."""

def cuda_report() -> dict[str, Any]:
    """This host's CUDA stack: driver and NVRTC versions, NVRTC's archs, devices, problems."""
    ...

def gpu_capture_times(reset: bool = False) -> dict[str, float]:
    """Host seconds the GPU capture engine spent by phase (``kernels_s``, ``gathers_s``,
    ``copies_s``, ``waits_s``) and ``new_buffers`` (page-locked or staging buffers allocated), over
    every GPU capture in this process since the last reset; empty when built without CUDA."""

def prepare_gpu(
    weights: Weights,
    device: int,
    omlx_format: str,
    step_tokens: int,
    block_size: int | None = None,
    captures: int = 1,
    held_bytes: int = 0,
    layers: tuple[int, int] | None = None,
) -> dict[str, int | float | str | None]:
    """Make CUDA device ``device`` ready before the first capture: the decoder's weights resident,
    the kernels loaded, the pools of block bodies filled for ``captures`` captures at once of
    ``omlx_format`` blocks (``block_size`` tokens; default the format's size for these weights) at
    steps of up to ``step_tokens`` tokens, plus ``held_bytes`` of finished segments a slow reader
    may leave queued. Returns ``block_size``, ``body_bytes``, ``staging_bodies``,
    ``pinned_bodies``, ``staging_bytes`` (device memory), ``pinned_bytes`` (page-locked host
    memory), ``allocated``, ``seconds`` and ``declined`` (why such captures pool on the CPU, or
    None). Raises ``DeviceError`` without CUDA, ``ConfigError`` for a bad format or size."""
    ...

def compile_kernels(arch: str) -> int:
    """Compile the capture kernels for ``arch`` (``compute_90``...) with NVRTC; the PTX's length."""
    ...
