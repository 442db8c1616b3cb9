"""The connector's worker side (each vLLM worker process; only TP rank 0 captures).

One native ``Capture`` per captured request, created lazily on its first chunk; the model tap
(``tap.py``) calls ``on_attention_input`` per layer during the forward; in ``wait_for_save``
(once per step, after every layer) it seals each request whose last prompt chunk ran in this
step. No timers. ``get_finished`` seals anything still open for requests vLLM finished, as
aborted. Each seal is recorded in the connector's stats (``stats.py``).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from .. import tap
from .._native import Capture, PdBridgeError, SegmentServer, Weights, gpu_capture_times, prepare_gpu
from .placement import Placement, locate
from .metadata import DUMP_ENV, CaptureChunk, CaptureSpec, PdBridgeConnectorMetadata, data_parallel_rank, kv_groups, pipeline_stage, segment_port, setting, stage_layers
from .stats import PdBridgeKVConnectorStats

logger = logging.getLogger("vllm.pd_bridge")


@dataclass
class _WorkerCapture:
    spec: CaptureSpec
    prompt_tokens: int
    capture: Capture | None
    failure: str | None = None
    fed: dict[int, int] = field(default_factory=dict)  # layer -> next absolute position expected
    sealed: str | None = None
    forward_s: float = 0.0  # host time feeding it took on vLLM's forward thread
    rows_s: float = 0.0  # of which finding its rows in the step's batch (queued, never read back)
    native_s: float = 0.0  # of which in the native feed call
    # Its steps' placement checks not yet read, in order; each that passes lets the blocks it
    # completes leave (Capture.confirm).
    checks: list[Placement] = field(default_factory=list)
    misplaced: str | None = None  # the check that failed: nothing is confirmed after it


# `_WorkerCapture.sealed` while the sealer thread seals it.
_SEALING = "sealing"

_WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")


def _segment_bytes(wc: _WorkerCapture) -> int:
    """Bytes of segments the capture has made (0 without a native capture)."""
    return int(getattr(wc.capture, "segment_bytes", 0) or 0) if wc.capture is not None else 0


def _default_address() -> str:
    """Where the segment server listens unless configured: the address vLLM's API server was
    told to bind (``--host``, as ``vllm serve`` passes it to its processes), else loopback.
    Never every interface by default: set ``PD_BRIDGE_VLLM_ADDRESS`` (or ``address``) for that."""
    import sys

    argv = list(getattr(sys, "argv", []) or [])
    host = None
    for i, a in enumerate(argv):
        if a == "--host" and i + 1 < len(argv):
            host = argv[i + 1]
        elif a.startswith("--host="):
            host = a.split("=", 1)[1]
    if host is None or host.strip() in _WILDCARDS:
        return "127.0.0.1"
    return host.strip().strip("[]")


class PdBridgeConnectorWorker:
    def __init__(self, vllm_config, extra: dict, kv_cache_config=None):
        self._kv_block_size = vllm_config.cache_config.block_size
        self._group_sizes, self._layer_group = kv_groups(kv_cache_config, self._kv_block_size)
        self._dump_dir = setting(extra, "dump_dir", DUMP_ENV)
        self._dump_mla = False  # the dumps' MLA latent rows exist only on vLLM's MLA path
        self._meta: PdBridgeConnectorMetadata | None = None
        self._lock = threading.Lock()
        self._stats = PdBridgeKVConnectorStats()
        self._captures: dict[str, _WorkerCapture] = {}
        self._step_rows: dict[str, Placement | str] = {}  # req_id -> its rows in this step's batch (or why not found)
        self._step_fed: dict[str, set[int]] = {}
        self._step_end: float | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._server = None
        self._weights = None
        self._tap_ok = False
        self._sealer: concurrent.futures.ThreadPoolExecutor | None = None
        rank, world = 0, 1
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        except Exception:
            pass
        # The attention input (MLA and V4 alike) is replicated over TP ranks: rank 0 streams,
        # in every pipeline stage (each runs its own layers).
        self._active = rank == 0
        self._stage, self._stages = pipeline_stage(vllm_config)
        if not self._active:
            logger.info("pd-bridge: TP rank %d of %d: inactive (TP rank 0 captures; the attention input is replicated over TP ranks)", rank, world)
            return
        weights_dir = setting(extra, "weights", "PD_BRIDGE_VLLM_WEIGHTS")
        port = setting(extra, "port", "PD_BRIDGE_VLLM_PORT")
        token = setting(extra, "token", "PD_BRIDGE_VLLM_TOKEN")
        address = setting(extra, "address", "PD_BRIDGE_VLLM_ADDRESS") or _default_address()
        missing = [n for n, v in (("weights", weights_dir), ("port", port), ("token", token)) if v is None]
        if missing:
            raise ValueError(
                f"PdBridgeConnector: missing setting(s) {missing}: put them in kv_connector_extra_config "
                "or set PD_BRIDGE_VLLM_WEIGHTS / PD_BRIDGE_VLLM_PORT / PD_BRIDGE_VLLM_TOKEN"
            )
        self._weights = Weights.load(str(weights_dir))
        # This stage's layers (all of them without pipeline parallelism).
        self._layers = stage_layers(self._weights.num_layers, self._stage, self._stages)
        # Each data-parallel rank and pipeline stage serves on its own port.
        self._dp_rank = data_parallel_rank(vllm_config)
        served = segment_port(int(port), self._dp_rank, self._stage, self._stages)
        tok = token.encode() if isinstance(token, str) else bytes(token)
        self._memory_bytes = int(float(setting(extra, "capture_memory_mb", "PD_BRIDGE_VLLM_CAPTURE_MEMORY_MB", 1024)) * (1 << 20))
        self._extra = extra
        self._step_tokens = int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", 0) or 8192)
        self._server = SegmentServer(
            f"[{address}]:{served}" if ":" in address else f"{address}:{served}",
            tok,
            idle_seconds=float(setting(extra, "segment_idle_s", "PD_BRIDGE_VLLM_SEGMENT_IDLE_S", 60.0)),
            queue_wait_seconds=float(setting(extra, "capture_queue_wait_s", "PD_BRIDGE_VLLM_CAPTURE_QUEUE_WAIT_S", 600.0)),
            max_connections=int(setting(extra, "max_connections", "PD_BRIDGE_VLLM_MAX_CONNECTIONS", 64)),
            grace_seconds=float(setting(extra, "capture_grace_s", "PD_BRIDGE_VLLM_CAPTURE_GRACE_S", 30.0)),
            pull_timeout_seconds=float(setting(extra, "capture_pull_timeout_s", "PD_BRIDGE_VLLM_CAPTURE_PULL_TIMEOUT_S", 120.0)),
            memory_bytes=self._memory_bytes,
        )
        self._tap_ok = tap.installed() or tap.v4_installed()
        tap.set_sink(self)
        logger.info(
            "pd-bridge: capturing with weights %s (%s, %d layers), serving segments on %s (encrypted, wire v4%s%s); model tap %s",
            weights_dir, self._weights.fingerprint, self._weights.num_layers, self._server.address, f", data-parallel rank {self._dp_rank}" if self._dp_rank else "",
            f", pipeline stage {self._stage + 1} of {self._stages}: layers {self._layers[0]}..{self._layers[1]}" if self._stages > 1 else "",
            "installed" if self._tap_ok else "NOT installed (set PD_BRIDGE_VLLM=1)",
        )

    # ------------------------------------------------------------------ step lifecycle

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        if self._active:
            self._prepare_device(kv_caches)

    def _prepare_device(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """On a CUDA engine, once vLLM holds its memory: the capture engine's weights, kernels and
        body pools made ready now, so no request uploads, compiles, allocates or pins on the
        forward thread. What it holds is outside vLLM's memory budget, and is logged."""
        extra = self._extra
        dev = next((t.device for t in kv_caches.values() if isinstance(t, torch.Tensor) and t.device.type == "cuda"), None)
        if dev is None or str(setting(extra, "gpu_prepare", "PD_BRIDGE_VLLM_GPU_PREPARE", "1")) == "0":
            return
        fmt = str(setting(extra, "omlx_format", "PD_BRIDGE_VLLM_OMLX_FORMAT", "upstream-0.6.3"))
        block = setting(extra, "block_size", "PD_BRIDGE_VLLM_BLOCK_SIZE")
        captures = int(setting(extra, "gpu_captures", "PD_BRIDGE_VLLM_GPU_CAPTURES", 2))
        try:
            got = prepare_gpu(
                self._weights, dev.index or 0, fmt, self._step_tokens, int(block) if block is not None else None, captures=captures,
                held_bytes=self._memory_bytes, layers=self._layers if self._stages > 1 else None,
            )
        except Exception as e:  # the captures then allocate as they go: slower first requests, same blocks
            logger.warning("pd-bridge: could not prepare %s for captures (%s: %s); the first captures allocate as they go", dev, type(e).__name__, e)
            return
        if got.get("declined"):
            logger.info("pd-bridge: %s %s-token blocks are not pooled on %s: %s", fmt, got["block_size"], dev, got["declined"])
            return
        mib = 1 << 20
        logger.info(
            "pd-bridge: %s ready for %d captures of %s %d-token blocks at steps of up to %d tokens, in %.2f s: weights resident, kernels loaded, "
            "%d staging bodies (%.0f MiB of device memory) and %d page-locked bodies (%.0f MiB of host memory) pooled, outside vLLM's memory budget",
            dev, captures, fmt, got["block_size"], self._step_tokens, got["seconds"], got["staging_bodies"], got["staging_bytes"] / mib, got["pinned_bodies"], got["pinned_bytes"] / mib,
        )

    def bind(self, meta) -> None:
        self._meta = meta if isinstance(meta, PdBridgeConnectorMetadata) else None
        if not self._active:
            return
        self._step_rows = {}
        self._step_fed = {}
        self._settle_all()
        if self._meta is None:
            return
        for req_id, (spec, prompt_tokens, reason) in self._meta.aborts.items():
            self._seal(req_id, self._get_capture(req_id, spec, prompt_tokens), reason)
        for ch in self._meta.chunks:
            wc = self._get_capture(ch.req_id, ch.spec, ch.prompt_tokens)
            # A resumed capture needs every row from where it resumed; a cold one from 0.
            resumed_at = int(getattr(wc.capture, "resumed_at", 0) or 0) if wc.capture is not None else 0
            if wc.sealed is None and wc.failure is None and ch.start > min(wc.fed.values(), default=resumed_at):
                wc.failure = f"tokens before position {ch.start} were not computed by this engine (vLLM's prefix-cache hit reaches past the capture's start {resumed_at})"
            if wc.sealed is None and wc.failure is None and wc.capture is not None:
                # Nobody will read this capture any more (its reader left, it was never pulled,
                # the memory bound dropped it): stop computing it; it seals aborted with why.
                closed = wc.capture.stream_closed
                if closed is not None:
                    wc.failure = f"segment stream closed: {closed}"
                    logger.warning("pd-bridge: request %s: %s; the capture stops", ch.req_id, wc.failure)

    def clear(self) -> None:
        self._meta = None

    def _get_capture(self, req_id: str, spec: CaptureSpec, prompt_tokens: int) -> _WorkerCapture:
        wc = self._captures.get(req_id)
        if wc is not None:
            return wc
        cap, failure = None, None
        try:
            if spec.fingerprint is not None and spec.fingerprint != self._weights.fingerprint:
                failure = f"weights fingerprint mismatch: request wants {spec.fingerprint}, this host has {self._weights.fingerprint}"
            stage = self._layers if self._stages > 1 else None
            cap = Capture(self._weights, spec.request_id, prompt_tokens, spec.block_size, self._server, spec.omlx_format, spec.secret, spec.prompt_digest, spec.fingerprint, layers=stage)
        except Exception as e:  # a bad block size, say: the request still runs
            failure = f"capture could not start: {e}"
            logger.error("pd-bridge: request %s: %s", req_id, failure)
        if cap is not None and failure is None and spec.resume_at:
            # Multi-turn: the decode host holds [0, S) and sent its carry state at S. A capture
            # from 0 instead would stream blocks the decode host's writer does not expect (and
            # vLLM's hit is capped at S, not 0), so a refused carry state seals it aborted.
            try:
                if spec.resume_carry is None:
                    raise PdBridgeError(f"no carry state for the resume at {spec.resume_at}")
                at = cap.resume(spec.resume_carry)
                if at != spec.resume_at:
                    raise PdBridgeError(f"carry state is at {at}, pd_capture.resume.position says {spec.resume_at}")
                logger.info("pd-bridge: request %s: capture %s resumes at token %d", req_id, spec.request_id, at)
            except PdBridgeError as e:
                failure = f"carry state refused: {e.args[0] if e.args else e}"
                logger.error("pd-bridge: request %s: %s", req_id, failure)
        if cap is not None:
            # Rows are placed in the batch by checks read a step later (placement.py): a block
            # leaves once every row it was computed from passed its check.
            cap.hold_until_confirmed()
        wc = _WorkerCapture(spec, prompt_tokens, cap, failure)
        self._captures[req_id] = wc
        return wc

    # ------------------------------------------------------------------ the tap's sink

    def on_attention_input(self, module, positions: torch.Tensor, hidden_states: torch.Tensor) -> None:
        """Called by the eager tap once per attention layer per forward, with the flattened batch."""
        meta = self._meta
        if not self._active or meta is None or not meta.chunks:
            return
        layer, layer_name = tap.layer_of(module)
        self.on_attention_layer(layer, layer_name, positions, hidden_states, hasattr(module, "mla_attn"))

    def on_attention_layer(self, layer: int, layer_name: str, positions: torch.Tensor, hidden_states: torch.Tensor, mla: bool) -> None:
        """One attention layer's input (the compiled tap calls this directly): ``layer`` is the
        decoder layer index, ``layer_name`` its key in vLLM's forward context, ``mla`` whether it
        runs vLLM's MLA path (the test dumps read its latent cache)."""
        meta = self._meta
        if not self._active or meta is None or not meta.chunks:
            return
        if self._dump_dir:
            self._dump_mla = mla
        if not self._layers[0] <= layer < self._layers[1]:
            return  # an MTP / draft layer (not part of the decoder's cache), or another stage's
        for ch in meta.chunks:
            wc = self._captures.get(ch.req_id)
            if wc is None or wc.sealed is not None or wc.failure is not None:
                continue
            t_feed = time.perf_counter()
            try:
                place = self._placement(wc, ch, layer_name, positions)
                t_rows = time.perf_counter()
                wc.rows_s += t_rows - t_feed
                if isinstance(place, str):
                    wc.failure = place
                    continue
                done = wc.fed.get(layer, 0)
                skip = max(0, done - ch.start)  # rows already fed (a recompute after preemption)
                if skip < ch.num_tokens:
                    # A plain descriptor for the core: pointer and length of contiguous bf16 rows,
                    # gathered on vLLM's stream by indices found on the device. A fresh tensor: never
                    # a view of a CUDA graph's output, which a later piece of the step may reuse.
                    x = hidden_states.index_select(0, place.index[skip:] if skip else place.index)
                    if x.dtype != torch.bfloat16:
                        x = x.to(torch.bfloat16)
                    if x.device.type == "cuda":
                        # The GPU path: pooled on a side stream ordered after torch's current
                        # stream; nothing here waits for the device. The side stream reads x, so
                        # torch's allocator must not reuse its memory before that work is done.
                        cur = torch.cuda.current_stream(x.device)
                        t_native = time.perf_counter()
                        wc.capture.feed_cuda(layer, ch.start + skip, x.data_ptr(), x.numel() * x.element_size(), "bfloat16", x.device.index, cur.cuda_stream)
                        wc.native_s += time.perf_counter() - t_native
                        side = wc.capture.side_stream
                        if side is not None:
                            x.record_stream(torch.cuda.ExternalStream(side, device=x.device))
                    else:
                        t_native = time.perf_counter()
                        wc.capture.feed_ptr(layer, ch.start + skip, x.data_ptr(), x.numel() * x.element_size())
                        wc.native_s += time.perf_counter() - t_native
                    wc.fed[layer] = ch.start + ch.num_tokens
                    if self._dump_dir:
                        self._dump(f"{wc.spec.request_id}.L{layer}.S{ch.start + skip}.in.bin", x.cpu().view(torch.uint16).numpy().tobytes())
                self._step_fed.setdefault(ch.req_id, set()).add(layer)
            except Exception as e:
                wc.failure = f"layer {layer}: {type(e).__name__}: {e}"
                logger.error("pd-bridge: request %s: %s", ch.req_id, wc.failure)
            wc.forward_s += time.perf_counter() - t_feed

    def _placement(self, wc: _WorkerCapture, ch: CaptureChunk, layer_name: str, positions: torch.Tensor) -> Placement | str:
        """Where `ch`'s tokens sit in this step's flattened batch, found by KV slot (with the blocks
        of the KV-cache group that holds `layer_name`) on the batch's device; its check joins the
        capture's queue (read later: placement.py). Once per request and step."""
        got = self._step_rows.get(ch.req_id)
        if got is not None:
            return got
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
        sm = ctx.slot_mapping
        sm = sm.get(layer_name) if isinstance(sm, dict) else None
        if sm is None:
            md = ctx.attn_metadata
            md = md.get(layer_name) if isinstance(md, dict) else None
            sm = getattr(md, "slot_mapping", None)
        group = self._layer_group.get(layer_name, 0)
        if group >= len(ch.group_block_ids):
            group = 0
        if sm is None:
            got = f"no slot mapping for {layer_name} in the forward context (micro-batching?)"
        else:
            got = locate(sm, positions, ch.slots(group), ch.start, f"KV-cache group {group} of {layer_name}")
            wc.checks.append(got)
        self._step_rows[ch.req_id] = got
        return got

    def _settle(self, wc: _WorkerCapture, wait: bool) -> None:
        """Read the capture's placement checks the device has landed (every one if `wait`), in
        order: each that passed lets out the blocks it completes; the first that failed ends the
        capture there (its blocks and every later one never leave)."""
        while wc.checks:
            if wc.misplaced is not None:
                wc.checks.clear()
                return
            p = wc.checks[0]
            if not p.ready():
                if not wait:
                    return
                p.wait()
            wc.checks.pop(0)
            why = p.failure()
            if why is not None:
                wc.checks.clear()
                wc.misplaced = why
                if wc.failure is None:
                    wc.failure = why
                    logger.error("pd-bridge: capture %s: %s", wc.spec.request_id, why)
                return
            if wc.capture is not None:
                wc.capture.confirm(p.upto)

    def _settle_all(self) -> None:
        """Without waiting: the captures the forward thread still feeds (a sealing one is the
        sealer thread's)."""
        for wc in self._captures.values():
            if wc.sealed is None and wc.checks:
                try:
                    self._settle(wc, wait=False)
                except Exception as e:  # never into vLLM's step
                    wc.failure = wc.failure or f"placement check: {type(e).__name__}: {e}"

    def wait_for_save(self) -> None:
        """Once per step, after every layer: seal the requests whose last prompt chunk ran."""
        meta = self._meta
        if not self._active or meta is None:
            return
        self._step_end = time.perf_counter()  # the step's forward (every layer) has run
        self._settle_all()
        for ch in meta.chunks:
            wc = self._captures.get(ch.req_id)
            if wc is None or wc.sealed is not None:
                continue
            fed = self._step_fed.get(ch.req_id, set())
            if wc.failure is None and len(fed) != self._layers[1] - self._layers[0]:
                missing = sorted(set(range(*self._layers)) - fed)
                wc.failure = (
                    f"the model tap saw no attention input for layers {missing} "
                    + ("" if tap.installed() or tap.v4_installed() else "(tap not installed: set PD_BRIDGE_VLLM=1 in vLLM's environment)")
                )
            if self._dump_dir:
                self._dump_latent(ch)
            if ch.is_last or wc.failure is not None:
                self._seal(ch.req_id, wc, wc.failure)
        self._step_end = None

    # ------------------------------------------------------------------ sealing

    def _seal(self, req_id: str, wc: _WorkerCapture, failure: str | None) -> None:
        if wc.sealed is not None:
            return
        t0 = self._step_end
        if wc.capture is not None and (getattr(wc.capture, "pending", 0) or any(p.event is not None for p in wc.checks)):
            # GPU work of this capture (or a placement check) is still in flight and sealing
            # waits for it (event by event), so it happens on the sealer thread: the forward
            # thread goes on.
            wc.sealed = _SEALING
            if self._sealer is None:
                self._sealer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-bridge-seal")
            self._sealer.submit(self._finish_seal, req_id, wc, failure, t0)
            return
        self._finish_seal(req_id, wc, failure, t0)

    def _finish_seal(self, req_id: str, wc: _WorkerCapture, failure: str | None, t0: float | None) -> None:
        try:
            # The last steps' placement checks: blocks whose rows passed belong to the prefix.
            self._settle(wc, wait=True)
            failure = failure or wc.failure
            if wc.capture is None:
                verdict = json.dumps({"verdict": "aborted", "blocks": 0, "reason": failure})
            else:
                verdict = wc.capture.seal(failure)
        except Exception as e:  # the decode host then sees a broken stream and falls back
            logger.error("pd-bridge: capture %s (request %s) could not be sealed: %s", wc.spec.request_id, req_id, e)
            wc.sealed = "error"
            self._record(wc, {"verdict": "error", "blocks": 0}, None)
            return
        wc.sealed = verdict
        latency = time.perf_counter() - t0 if t0 is not None else None
        try:
            self._record(wc, json.loads(verdict), latency)
        except Exception:  # pragma: no cover - stats never break a seal
            logger.exception("pd-bridge: could not record the capture's stats")
        # From wait_for_save's entry (end of the step that ran the last prompt chunk) to sealed.
        # The wall-clock end of that step too: a benchmark on one machine compares it with when
        # the decode host could continue.
        after = f" ({latency * 1e3:.3f} ms after the step's forward, which ended at unix {time.time() - latency:.6f})" if latency is not None else ""
        # What it cost: bytes shipped, host time on the forward thread (and of it, the row lookup
        # and the native feed calls), and (GPU path) the
        # engine's buffers newly allocated since the previous seal in this process.
        cost = f" [bytes={_segment_bytes(wc)} forward_thread_ms={wc.forward_s * 1e3:.3f} rows_ms={wc.rows_s * 1e3:.3f} native_ms={wc.native_s * 1e3:.3f}"
        if getattr(wc.capture, "side_stream", None) is not None:
            gt = gpu_capture_times(True)
            cost += f" new_buffers={gt.get('new_buffers', 0)} gpu_host_ms={sum(v for k, v in gt.items() if k.endswith('_s')) * 1e3:.3f}"
        log = logger.info if failure is None else logger.warning
        log("pd-bridge: capture %s (request %s) sealed: %s%s%s]", wc.spec.request_id, req_id, verdict, after, cost)
        if self._dump_dir:
            self._dump(f"{wc.spec.request_id}.verdict.json", verdict.encode(), append=True)

    def _record(self, wc: _WorkerCapture, verdict: dict, latency: float | None) -> None:
        nbytes = _segment_bytes(wc)
        # A resumed capture's seal counts the blocks the decode host already held; shipped are the rest.
        resumed_at = int(getattr(wc.capture, "resumed_at", 0) or 0) if wc.capture is not None else 0
        shipped = max(0, int(verdict.get("blocks") or 0) - resumed_at // max(1, wc.spec.block_size))
        with self._lock:
            self._stats.record_seal(str(verdict.get("verdict")), shipped, nbytes, latency)

    def get_kv_connector_stats(self) -> PdBridgeKVConnectorStats | None:
        """The seals recorded since the last call (None when there were none)."""
        with self._lock:
            if self._stats.is_empty():
                return None
            return self._stats.clone_and_reset()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._active:
            for req_id in finished_req_ids:
                wc = self._captures.pop(req_id, None)
                if wc is not None:
                    self._seal(req_id, wc, "request finished before its prompt was fully prefilled")
        return None, None

    def shutdown(self) -> None:
        if not self._active:
            return
        for req_id, wc in list(self._captures.items()):
            self._seal(req_id, wc, "vLLM shut down")
        self._captures.clear()
        if self._sealer is not None:
            self._sealer.shutdown(wait=True)
        if tap._sink is self:
            tap.set_sink(None)

    # ------------------------------------------------------------------ test-only dumps

    def _dump(self, name: str, data: bytes, append: bool = False) -> None:
        os.makedirs(self._dump_dir, exist_ok=True)
        with open(os.path.join(self._dump_dir, name), "ab" if append else "wb") as f:
            f.write(data + (b"\n" if append else b""))

    def _dump_latent(self, ch: CaptureChunk) -> None:
        """vLLM's own paged MLA cache rows (latent ‖ roped k_pe) for this chunk's tokens."""
        wc = self._captures[ch.req_id]
        for name, kv in self._kv_caches.items():
            m = tap._LAYER_RE.search(name.rsplit(".attn", 1)[0])
            if m is None or not self._dump_mla:  # MLA off: vLLM's cache holds per-head K/V, no latent
                continue
            g = self._layer_group.get(name, 0)
            slots = ch.slots(g if g < len(ch.group_block_ids) else 0)
            rows = kv.reshape(-1, kv.shape[-1])[slots.to(kv.device)]
            self._dump(f"{wc.spec.request_id}.L{int(m.group(1))}.S{ch.start}.kv.bin", rows.to(torch.bfloat16).cpu().view(torch.uint16).numpy().tobytes())
