"""The connector's scheduler side (vLLM's EngineCore process).

Remembers captured requests (``on_new_request``) and, in ``build_connector_meta``, lists for this
step every captured request with prompt tokens in it: the absolute start position, how many prompt
tokens run, the KV blocks of every KV-cache group they are written to (so the worker can find
their rows in the flattened batch by slot), and whether this step runs the request's LAST prompt
chunk. A request that finishes before its last chunk ran is announced as an abort with the reason
in the next step's metadata. A producer never loads external KV.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import prefix_cap
from .metadata import PARAM_KEY, CaptureChunk, CaptureSpec, CaptureSpecError, PdBridgeConnectorMetadata, data_parallel_rank, kv_groups, pipeline_stage

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.pd_bridge")


@dataclass
class _SchedState:
    spec: CaptureSpec
    prompt_tokens: int
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group
    last_scheduled: bool = False
    scheduled_upto: int = 0
    # Where vLLM first computed this prompt from (its own prefix-cache hit); None: not yet.
    first_start: int | None = None


class PdBridgeConnectorScheduler:
    def __init__(self, vllm_config, kv_cache_config=None):
        self.block_sizes, _ = kv_groups(kv_cache_config, vllm_config.cache_config.block_size)
        self.requests: dict[str, _SchedState] = {}
        self.pending_aborts: dict[str, tuple[CaptureSpec, int, str]] = {}
        self.dp_rank = data_parallel_rank(vllm_config)
        self.stages = pipeline_stage(vllm_config)[1]
        # Captures this rank will not make, and why (said in the request's kv_transfer_params).
        self.refused: dict[str, tuple[str, str]] = {}
        # The identity of the checkpoint vLLM serves, said at every capture's finish so the
        # decode host can tell same weights from different ones. Read off the engine's start
        # (one page per tensor); None until then, or where the model is no local directory.
        self.model_fingerprint: str | None = None
        model_dir = getattr(getattr(vllm_config, "model_config", None), "model", None)
        if isinstance(model_dir, str) and os.path.isdir(model_dir):
            threading.Thread(target=self._read_model_fingerprint, args=(model_dir,), name="pd-bridge-model-fingerprint", daemon=True).start()

    def _read_model_fingerprint(self, model_dir: str) -> None:
        from .. import model_fingerprint

        try:
            self.model_fingerprint = model_fingerprint(model_dir)
            logger.info("pd-bridge: serving %s, model fingerprint %s", model_dir, self.model_fingerprint)
        except Exception as e:  # noqa: BLE001 - a checkpoint it cannot read only leaves the identity unknown
            logger.warning("pd-bridge: the model fingerprint of %s cannot be read (%s); the decode host will say the weights are unknown", model_dir, e)

    def on_new_request(self, request: Request) -> None:
        try:
            spec = CaptureSpec.parse(request.kv_transfer_params)
        except CaptureSpecError as e:
            logger.error("pd-bridge: request %s: malformed kv_transfer_params (%s); it runs without a capture", request.request_id, e)
            return
        if spec is None:
            return
        if spec.dp_rank is not None and spec.dp_rank != self.dp_rank:
            # A router dropped the X-data-parallel-rank header: the decode host pulls from the
            # rank it asked for, which never sees this request. Capture nothing, and say so.
            why = f"meant for data-parallel rank {spec.dp_rank}, ran on rank {self.dp_rank} (a router dropped the X-data-parallel-rank header?)"
            logger.error("pd-bridge: request %s: capture %s %s; it runs without a capture", request.request_id, spec.request_id, why)
            self.refused[request.request_id] = (spec.request_id, why)
            return
        if (spec.stages or 1) != self.stages:
            # The decode host would pull the wrong ports, or take one stage's layers for a
            # whole block (its writer refuses those): capture nothing, and say what to set.
            why = (f"this prefill host runs {self.stages} pipeline stages, the decode host pulls {spec.stages or 1} "
                   f"(set PD_BRIDGE_PREFILL_PP={self.stages} on the decode host)")  # fmt: skip
            logger.error("pd-bridge: request %s: capture %s: %s; it runs without a capture", request.request_id, spec.request_id, why)
            self.refused[request.request_id] = (spec.request_id, why)
            return
        ids = getattr(request, "prompt_token_ids", None)
        if ids is None:
            logger.error("pd-bridge: request %s names a capture but has no prompt token ids (embeddings?); it runs without a capture", request.request_id)
            return
        from .._native import prompt_digest

        # The ids vLLM prefills, bound into the capture's wire key: the decode host's key
        # (over the ids it sent and names its blocks by) matches only if they are the same.
        spec = dataclasses.replace(spec, prompt_digest=prompt_digest(list(ids)))
        # vLLM's prefix cache may be on: its hit for this request must end at or before where the
        # capture starts (0, or the block the decode host resumes from), or rows go uncomputed.
        capped = prefix_cap.apply(request, spec.resume_at)
        self.requests[request.request_id] = _SchedState(spec, request.num_prompt_tokens)
        logger.debug("pd-bridge: request %s captures %r (%d prompt tokens; %s)", request.request_id, spec, request.num_prompt_tokens, capped)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # a producer never loads external KV

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        return

    def _groups(self, block_ids) -> list[list[int]]:
        return [list(g) for g in block_ids] if block_ids else []

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdBridgeConnectorMetadata:
        meta = PdBridgeConnectorMetadata(aborts=self.pending_aborts)
        self.pending_aborts = {}
        if not self.requests:
            return meta
        n_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self.requests.get(new.req_id)
            if st is not None:
                st.block_ids = self._groups(new.block_ids)
                self._chunk(meta, new.req_id, st, new.num_computed_tokens, n_sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if req_id in cached.resumed_req_ids:
                st.block_ids = self._groups(new_ids)
            elif new_ids:
                if not st.block_ids:
                    st.block_ids = [[] for _ in new_ids]
                for g, ids in enumerate(new_ids):
                    st.block_ids[g].extend(ids)
            self._chunk(meta, req_id, st, cached.num_computed_tokens[i], n_sched.get(req_id, 0))
        return meta

    def _chunk(self, meta: PdBridgeConnectorMetadata, req_id: str, st: _SchedState, start: int, scheduled: int) -> None:
        if st.last_scheduled:
            return  # decode steps (or a recompute after the capture sealed): nothing to do
        n = min(scheduled, st.prompt_tokens - start)
        if n <= 0:
            return
        sizes = self.block_sizes if len(self.block_sizes) == len(st.block_ids) else (self.block_sizes[0],) * len(st.block_ids)
        groups = []
        for bs, ids in zip(sizes, st.block_ids):
            first, last = start // bs, (start + n - 1) // bs
            if last >= len(ids):
                meta.aborts[req_id] = (st.spec, st.prompt_tokens, f"internal: {len(ids)} KV blocks of {bs} known for tokens up to {start + n}")
                st.last_scheduled = True
                return
            groups.append(ids[first : last + 1])
        if not groups:
            meta.aborts[req_id] = (st.spec, st.prompt_tokens, f"internal: no KV blocks known for tokens up to {start + n}")
            st.last_scheduled = True
            return
        is_last = start + n >= st.prompt_tokens
        st.last_scheduled = is_last
        st.scheduled_upto = max(st.scheduled_upto, start + n)
        if st.first_start is None:
            st.first_start = start
        meta.chunks.append(CaptureChunk(req_id, st.spec, st.prompt_tokens, start, n, tuple(sizes), tuple(groups), is_last))
        if st.spec.resume_carry is not None:
            # The worker creates its capture (and resumes it) from the first chunk; later steps'
            # metadata need not carry the carry state's bytes again.
            st.spec = dataclasses.replace(st.spec, resume_carry=None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self.requests.pop(request.request_id, None)
        if st is None:
            refused = self.refused.pop(request.request_id, None)
            return (False, {PARAM_KEY: {"request_id": refused[0], "refused": refused[1]}}) if refused else (False, None)
        if not st.last_scheduled:
            reason = f"request {request.status.name.lower()} after {st.scheduled_upto} of {st.prompt_tokens} prompt tokens"
            self.pending_aborts[request.request_id] = (st.spec, st.prompt_tokens, reason)
        # prompt_cached_tokens: what vLLM took from its own prefix cache (it computed the rest);
        # the decode host puts it in the verdict.
        return False, {PARAM_KEY: {"request_id": st.spec.request_id, "prompt_scheduled": st.last_scheduled,
                                   "prompt_cached_tokens": st.first_start, "resumed_at": st.spec.resume_at,
                                   "model_fingerprint": self.model_fingerprint}}  # fmt: skip
