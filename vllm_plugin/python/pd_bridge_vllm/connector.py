"""PdBridgeConnector: vLLM KV connector (v1 API) that drives pd-bridge captures.

Load it with::

    kv_transfer_config={"kv_connector": "PdBridgeConnector",
                        "kv_connector_module_path": "pd_bridge_vllm.connector",
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"weights": DIR, "port": P, "token": T,
                                                      "address": "0.0.0.0"}}

(or set PD_BRIDGE_VLLM_WEIGHTS / PD_BRIDGE_VLLM_PORT / PD_BRIDGE_VLLM_TOKEN /
PD_BRIDGE_VLLM_ADDRESS). A request is captured when its ``kv_transfer_params`` hold
``{"pd_capture": {"request_id": "...", "block_size": 256}}`` (optionally ``"fingerprint"`` and
``"omlx_format"``, the decoder's block format: its overlap semantics and what segments carry).

Scheduler side (EngineCore process): remembers captured requests (``on_new_request``) and, in
``build_connector_meta``, lists for this step every captured request with prompt tokens in it:
the absolute start position, how many prompt tokens run, the KV blocks they are written to (so
the worker can find their rows in the flattened batch by slot), and whether this step runs the
request's LAST prompt chunk. A request that finishes before its last chunk ran is announced as
an abort with the reason in the next step's metadata.

Worker side: one native ``Capture`` per captured request, created lazily on its first chunk;
the model tap (``tap.py``) calls ``on_attention_input`` per layer during the forward; in
``wait_for_save`` (once per step, after every layer) it seals each request whose last prompt
chunk ran in this step. No timers. ``get_finished`` seals anything still open for requests
vLLM finished, as aborted.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import tap
from ._native import Capture, SegmentServer, Weights

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.pd_bridge")  # a child of vLLM's logger: its handler and level apply

PARAM_KEY = "pd_capture"
DUMP_ENV = "PD_BRIDGE_VLLM_DUMP_DIR"  # test-only: dump fed inputs, vLLM's latent rows, verdicts


class CaptureSpecError(ValueError):
    pass


class UnsupportedEngineSettings(ValueError):
    """vLLM settings under which a capture could not be complete; refused at engine start."""


def check_engine_settings(vllm_config) -> None:
    """Refuse, at start, settings that would make captures incomplete.

    Prefix caching lets vLLM skip prefilling a prompt's cached prefix, so the tap would never see
    those tokens' attention input and the decoder's cache could not be built from them.
    """
    cache = getattr(vllm_config, "cache_config", None)
    if cache is not None and getattr(cache, "enable_prefix_caching", False):
        raise UnsupportedEngineSettings(
            "pd-bridge: prefix caching is on, so vLLM may skip prefilling a cached prefix whose "
            "attention input the decoder's cache needs; start vLLM with --no-enable-prefix-caching "
            "(enable_prefix_caching=False) to use PdBridgeConnector"
        )


@dataclass(frozen=True)
class CaptureSpec:
    request_id: str  # the capture's id on the wire (the decode host asks for it)
    block_size: int
    fingerprint: str | None = None
    # The decoder's oMLX block format (pd_bridge_omlx.versions), which fixes the overlap
    # semantics and what segments carry; absent: the fork's ("fork-0.7.0").
    omlx_format: str | None = None

    @staticmethod
    def parse(params: Any) -> CaptureSpec | None:
        """None when the request names no capture; CaptureSpecError when it names a bad one."""
        if not isinstance(params, dict) or PARAM_KEY not in params:
            return None
        spec = params[PARAM_KEY]
        if not isinstance(spec, dict):
            raise CaptureSpecError(f"{PARAM_KEY} must be an object, got {type(spec).__name__}")
        rid, bs, fp = spec.get("request_id"), spec.get("block_size"), spec.get("fingerprint")
        if not isinstance(rid, str) or not rid:
            raise CaptureSpecError(f"{PARAM_KEY}.request_id must be a non-empty string, got {rid!r}")
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
            raise CaptureSpecError(f"{PARAM_KEY}.block_size must be a positive integer, got {bs!r}")
        if fp is not None and not isinstance(fp, str):
            raise CaptureSpecError(f"{PARAM_KEY}.fingerprint must be a string, got {fp!r}")
        fmt = spec.get("omlx_format")
        if fmt is not None and not isinstance(fmt, str):
            raise CaptureSpecError(f"{PARAM_KEY}.omlx_format must be a string, got {fmt!r}")
        return CaptureSpec(rid, bs, fp, fmt)


@dataclass
class CaptureChunk:
    """One captured request's prompt tokens in one step."""

    req_id: str  # vLLM's request id
    spec: CaptureSpec
    prompt_tokens: int
    start: int  # absolute position of the first token run in this step
    num_tokens: int  # prompt tokens run in this step (never decode tokens)
    kv_block_size: int  # vLLM's KV block size (slots = block * size + offset)
    block_ids: list[int]  # vLLM KV blocks covering [start, start + num_tokens), in order
    is_last: bool  # this step runs the request's last prompt chunk

    def slots(self) -> torch.Tensor:
        pos = torch.arange(self.start, self.start + self.num_tokens, dtype=torch.int64)
        first = self.start // self.kv_block_size
        blocks = torch.tensor(self.block_ids, dtype=torch.int64)[pos // self.kv_block_size - first]
        return blocks * self.kv_block_size + pos % self.kv_block_size


@dataclass
class PdBridgeConnectorMetadata(KVConnectorMetadata):
    chunks: list[CaptureChunk] = field(default_factory=list)
    aborts: dict[str, tuple[CaptureSpec, int, str]] = field(default_factory=dict)  # req_id -> (spec, prompt_tokens, reason)


@dataclass
class _SchedState:
    spec: CaptureSpec
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    last_scheduled: bool = False
    scheduled_upto: int = 0


@dataclass
class _WorkerCapture:
    spec: CaptureSpec
    prompt_tokens: int
    capture: Capture | None
    failure: str | None = None
    fed: dict[int, int] = field(default_factory=dict)  # layer -> next absolute position expected
    sealed: str | None = None


# `_WorkerCapture.sealed` while the sealer thread seals it.
_SEALING = "sealing"


def _setting(extra: dict, key: str, env: str, default=None):
    v = extra.get(key)
    if v is None:
        v = os.environ.get(env)
    return default if v is None or v == "" else v


class PdBridgeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None):
        check_engine_settings(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self._kv_block_size = vllm_config.cache_config.block_size
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._dump_dir = _setting(extra, "dump_dir", DUMP_ENV)
        if role == KVConnectorRole.SCHEDULER:
            self._sched: dict[str, _SchedState] = {}
            self._pending_aborts: dict[str, tuple[CaptureSpec, int, str]] = {}
            return
        self._worker_init(vllm_config, extra)

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        try:
            spec = CaptureSpec.parse(request.kv_transfer_params)
        except CaptureSpecError as e:
            logger.error("pd-bridge: request %s: malformed kv_transfer_params (%s); it runs without a capture", request.request_id, e)
            return
        if spec is None:
            return
        self._sched[request.request_id] = _SchedState(spec, request.num_prompt_tokens)
        logger.debug("pd-bridge: request %s captures %r (%d prompt tokens)", request.request_id, spec, request.num_prompt_tokens)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # a producer never loads external KV

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PdBridgeConnectorMetadata(aborts=self._pending_aborts)
        self._pending_aborts = {}
        if not self._sched:
            return meta
        n_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._sched.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0]) if new.block_ids else []
                self._chunk(meta, new.req_id, st, new.num_computed_tokens, n_sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._sched.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._chunk(meta, req_id, st, cached.num_computed_tokens[i], n_sched.get(req_id, 0))
        return meta

    def _chunk(self, meta: PdBridgeConnectorMetadata, req_id: str, st: _SchedState, start: int, scheduled: int) -> None:
        if st.last_scheduled:
            return  # decode steps (or a recompute after the capture sealed): nothing to do
        n = min(scheduled, st.prompt_tokens - start)
        if n <= 0:
            return
        bs = self._kv_block_size
        first, last = start // bs, (start + n - 1) // bs
        if last >= len(st.block_ids):
            meta.aborts[req_id] = (st.spec, st.prompt_tokens, f"internal: {len(st.block_ids)} KV blocks known for tokens up to {start + n}")
            st.last_scheduled = True
            return
        is_last = start + n >= st.prompt_tokens
        st.last_scheduled = is_last
        st.scheduled_upto = max(st.scheduled_upto, start + n)
        meta.chunks.append(CaptureChunk(req_id, st.spec, st.prompt_tokens, start, n, bs, st.block_ids[first : last + 1], is_last))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._sched.pop(request.request_id, None)
        if st is None:
            return False, None
        if not st.last_scheduled:
            reason = f"request {request.status.name.lower()} after {st.scheduled_upto} of {st.prompt_tokens} prompt tokens"
            self._pending_aborts[request.request_id] = (st.spec, st.prompt_tokens, reason)
        return False, {PARAM_KEY: {"request_id": st.spec.request_id, "prompt_scheduled": st.last_scheduled}}

    # ------------------------------------------------------------------ worker side

    def _worker_init(self, vllm_config: VllmConfig, extra: dict) -> None:
        self._lock = threading.Lock()
        self._captures: dict[str, _WorkerCapture] = {}
        self._step_rows: dict[str, int | str] = {}  # req_id -> first batch row (or why not found)
        self._step_fed: dict[str, set[int]] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._server = None
        self._weights = None
        self._sealer: concurrent.futures.ThreadPoolExecutor | None = None
        rank, world = 0, 1
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        except Exception:
            pass
        # The attention input (MLA and V4 alike) is replicated over TP ranks: rank 0 streams.
        self._active = rank == 0
        if not self._active:
            logger.info("pd-bridge: TP rank %d of %d: inactive (TP rank 0 captures; the attention input is replicated over TP ranks)", rank, world)
            return
        weights_dir = _setting(extra, "weights", "PD_BRIDGE_VLLM_WEIGHTS")
        port = _setting(extra, "port", "PD_BRIDGE_VLLM_PORT")
        token = _setting(extra, "token", "PD_BRIDGE_VLLM_TOKEN")
        address = _setting(extra, "address", "PD_BRIDGE_VLLM_ADDRESS", "0.0.0.0")
        missing = [n for n, v in (("weights", weights_dir), ("port", port), ("token", token)) if v is None]
        if missing:
            raise ValueError(
                f"PdBridgeConnector: missing setting(s) {missing}: put them in kv_connector_extra_config "
                "or set PD_BRIDGE_VLLM_WEIGHTS / PD_BRIDGE_VLLM_PORT / PD_BRIDGE_VLLM_TOKEN"
            )
        self._weights = Weights.load(str(weights_dir))
        tok = token.encode() if isinstance(token, str) else bytes(token)
        self._server = SegmentServer(f"{address}:{int(port)}", tok)
        self._tap_ok = tap.installed() or tap.v4_installed()
        tap.set_sink(self)
        logger.info(
            "pd-bridge: capturing with weights %s (%s, %d layers), serving segments on %s:%d; model tap %s",
            weights_dir, self._weights.fingerprint, self._weights.num_layers, address, self._server.port,
            "installed" if self._tap_ok else "NOT installed (set PD_BRIDGE_VLLM=1)",
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._role != KVConnectorRole.WORKER or not self._active:
            return
        self._step_rows = {}
        self._step_fed = {}
        meta = connector_metadata
        if not isinstance(meta, PdBridgeConnectorMetadata):
            return
        for req_id, (spec, prompt_tokens, reason) in meta.aborts.items():
            self._seal(req_id, self._get_capture(req_id, spec, prompt_tokens), reason)
        for ch in meta.chunks:
            wc = self._get_capture(ch.req_id, ch.spec, ch.prompt_tokens)
            if wc.sealed is None and wc.failure is None and ch.start > min(wc.fed.values(), default=0):
                wc.failure = f"tokens before position {ch.start} were not computed by this engine (prefix cache hit?)"

    def _get_capture(self, req_id: str, spec: CaptureSpec, prompt_tokens: int) -> _WorkerCapture:
        wc = self._captures.get(req_id)
        if wc is not None:
            return wc
        cap, failure = None, None
        try:
            if spec.fingerprint is not None and spec.fingerprint != self._weights.fingerprint:
                failure = f"weights fingerprint mismatch: request wants {spec.fingerprint}, this host has {self._weights.fingerprint}"
            cap = Capture(self._weights, spec.request_id, prompt_tokens, spec.block_size, self._server, spec.omlx_format)
        except Exception as e:  # a bad block size, say: the request still runs
            failure = f"capture could not start: {e}"
            logger.error("pd-bridge: request %s: %s", req_id, failure)
        wc = _WorkerCapture(spec, prompt_tokens, cap, failure)
        self._captures[req_id] = wc
        return wc

    def on_attention_input(self, module, positions: torch.Tensor, hidden_states: torch.Tensor) -> None:
        """Called by the tap once per MLA layer per forward, with the flattened batch."""
        meta = self._connector_metadata
        if not self._active or not isinstance(meta, PdBridgeConnectorMetadata) or not meta.chunks:
            return
        layer, layer_name = tap.layer_of(module)
        if layer >= self._weights.num_layers:
            return  # an MTP / draft layer: not part of the decoder's cache
        for ch in meta.chunks:
            wc = self._captures.get(ch.req_id)
            if wc is None or wc.sealed is not None or wc.failure is not None:
                continue
            try:
                row = self._rows(ch, layer_name, positions)
                if isinstance(row, str):
                    wc.failure = row
                    continue
                done = wc.fed.get(layer, 0)
                skip = max(0, done - ch.start)  # rows already fed (a recompute after preemption)
                if skip < ch.num_tokens:
                    # A plain descriptor for the core: pointer and length of contiguous bf16 rows.
                    x = hidden_states[row + skip : row + ch.num_tokens].to(torch.bfloat16).contiguous()
                    if x.device.type == "cuda":
                        # The GPU path: pooled on a side stream ordered after torch's current
                        # stream; nothing here waits for the device. The side stream reads x, so
                        # torch's allocator must not reuse its memory before that work is done.
                        cur = torch.cuda.current_stream(x.device)
                        wc.capture.feed_cuda(layer, ch.start + skip, x.data_ptr(), x.numel() * x.element_size(), "bfloat16", x.device.index, cur.cuda_stream)
                        side = wc.capture.side_stream
                        if side is not None:
                            x.record_stream(torch.cuda.ExternalStream(side, device=x.device))
                    else:
                        wc.capture.feed_ptr(layer, ch.start + skip, x.data_ptr(), x.numel() * x.element_size())
                    wc.fed[layer] = ch.start + ch.num_tokens
                    if self._dump_dir:
                        self._dump(f"{wc.spec.request_id}.L{layer}.S{ch.start + skip}.in.bin", x.cpu().view(torch.uint16).numpy().tobytes())
                self._step_fed.setdefault(ch.req_id, set()).add(layer)
            except Exception as e:
                wc.failure = f"layer {layer}: {type(e).__name__}: {e}"
                logger.error("pd-bridge: request %s: %s", ch.req_id, wc.failure)

    def _rows(self, ch: CaptureChunk, layer_name: str, positions: torch.Tensor) -> int | str:
        """First row of `ch`'s tokens in this step's flattened batch, found by KV slot."""
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
        if sm is None:
            got = f"no slot mapping for {layer_name} in the forward context (micro-batching?)"
        else:
            want = ch.slots().to(sm.device)
            hits = (sm.to(torch.int64) == want[0]).nonzero().flatten()
            if hits.numel() != 1:
                got = f"slot {int(want[0])} of position {ch.start} found {hits.numel()} times in the batch"
            else:
                r = int(hits[0])
                n = ch.num_tokens
                pos = positions[r : r + n].to(torch.int64).cpu()
                if r + n > sm.shape[0] or not torch.equal(sm[r : r + n].to(torch.int64), want):
                    got = f"tokens {ch.start}..{ch.start + n} are not contiguous in the batch"
                elif not torch.equal(pos, torch.arange(ch.start, ch.start + n)):
                    got = f"batch positions disagree with the scheduler for tokens {ch.start}..{ch.start + n}"
                else:
                    got = r
        self._step_rows[ch.req_id] = got
        return got

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        """Once per step, after every layer: seal the requests whose last prompt chunk ran."""
        meta = self._connector_metadata
        if self._role != KVConnectorRole.WORKER or not self._active or not isinstance(meta, PdBridgeConnectorMetadata):
            return
        self._step_end = time.perf_counter()  # the step's forward (every layer) has run
        for ch in meta.chunks:
            wc = self._captures.get(ch.req_id)
            if wc is None or wc.sealed is not None:
                continue
            fed = self._step_fed.get(ch.req_id, set())
            if wc.failure is None and len(fed) != self._weights.num_layers:
                missing = sorted(set(range(self._weights.num_layers)) - fed)
                wc.failure = (
                    f"the model tap saw no attention input for layers {missing} "
                    + ("" if tap.installed() or tap.v4_installed() else "(tap not installed: set PD_BRIDGE_VLLM=1 in vLLM's environment)")
                )
            if self._dump_dir:
                self._dump_latent(ch)
            if ch.is_last or wc.failure is not None:
                self._seal(ch.req_id, wc, wc.failure)
        self._step_end = None

    def _seal(self, req_id: str, wc: _WorkerCapture, failure: str | None) -> None:
        if wc.sealed is not None:
            return
        t0 = getattr(self, "_step_end", None)
        if wc.capture is not None and getattr(wc.capture, "pending", 0):
            # GPU work of this capture is still in flight and sealing waits for it (event by
            # event), so it happens on the sealer thread: the forward thread goes on.
            wc.sealed = _SEALING
            if self._sealer is None:
                self._sealer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-bridge-seal")
            self._sealer.submit(self._finish_seal, req_id, wc, failure, t0)
            return
        self._finish_seal(req_id, wc, failure, t0)

    def _finish_seal(self, req_id: str, wc: _WorkerCapture, failure: str | None, t0: float | None) -> None:
        try:
            if wc.capture is None:
                verdict = json.dumps({"verdict": "aborted", "blocks": 0, "reason": failure})
            else:
                verdict = wc.capture.seal(failure)
        except Exception as e:  # the decode host then sees a broken stream and falls back
            logger.error("pd-bridge: capture %s (request %s) could not be sealed: %s", wc.spec.request_id, req_id, e)
            wc.sealed = "error"
            return
        wc.sealed = verdict
        # From wait_for_save's entry (end of the step that ran the last prompt chunk) to sealed.
        # The wall-clock end of that step too: a benchmark on one machine compares it with when
        # the decode host could continue.
        after = f" ({(time.perf_counter() - t0) * 1e3:.3f} ms after the step's forward, which ended at unix {time.time() - (time.perf_counter() - t0):.6f})" if t0 is not None else ""
        log = logger.info if failure is None else logger.warning
        log("pd-bridge: capture %s (request %s) sealed: %s%s", wc.spec.request_id, req_id, verdict, after)
        if self._dump_dir:
            self._dump(f"{wc.spec.request_id}.verdict.json", verdict.encode(), append=True)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._role == KVConnectorRole.WORKER and self._active:
            for req_id in finished_req_ids:
                wc = self._captures.pop(req_id, None)
                if wc is not None:
                    self._seal(req_id, wc, "request finished before its prompt was fully prefilled")
        return None, None

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER and getattr(self, "_active", False):
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
        slots = ch.slots()
        wc = self._captures[ch.req_id]
        for name, kv in self._kv_caches.items():
            m = tap._LAYER_RE.search(name.rsplit(".attn", 1)[0])
            if m is None:
                continue
            rows = kv.reshape(-1, kv.shape[-1])[slots.to(kv.device)]
            self._dump(f"{wc.spec.request_id}.L{int(m.group(1))}.S{ch.start}.kv.bin", rows.to(torch.bfloat16).cpu().view(torch.uint16).numpy().tobytes())
