"""What the scheduler side tells the worker side each step, and the capture spec a request carries.

Plain dataclasses (vLLM pickles the step's metadata to the workers); no torch at import except
for ``CaptureChunk.slots``.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

PARAM_KEY = "pd_capture"
DUMP_ENV = "PD_BRIDGE_VLLM_DUMP_DIR"  # test-only: dump fed inputs, vLLM's latent rows, verdicts


class CaptureSpecError(ValueError):
    pass


class UnsupportedEngineSettings(ValueError):
    """vLLM settings under which a capture could not be complete; refused at engine start."""


def pipeline_stage(vllm_config) -> tuple[int, int]:
    """This worker's pipeline stage and the number of stages (0 and 1 without pipeline
    parallelism), from vLLM's process groups where they exist, else its config.

    Under pipeline parallelism no worker sees every layer's attention input: each stage's TP
    rank 0 captures its own layers (``stage_layers``) and serves them on its own segment port
    (``segment_port``), and the decode host joins the stages' parts into whole blocks (the
    core's ``stages`` module)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        g = get_pp_group()
        return int(g.rank_in_group), int(g.world_size)
    except Exception:  # not initialised (the scheduler process): the config says how many
        pc = getattr(vllm_config, "parallel_config", None)
        return 0, int(getattr(pc, "pipeline_parallel_size", 1) or 1)


def stage_layers(num_layers: int, stage: int, stages: int) -> tuple[int, int]:
    """The model layers pipeline stage ``stage`` of ``stages`` runs: vLLM's own partition
    (``get_pp_indices``, which honours ``VLLM_PP_LAYER_PARTITION``)."""
    if stages <= 1:
        return 0, num_layers
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(num_layers, stage, stages)
    return int(start), int(end)


def segment_port(base: int, dp_rank: int, stage: int, stages: int) -> int:
    """Where a worker serves its captures: the base port + data-parallel rank × stages + stage
    (NIXL's rule for its side channel), so every rank and stage of one host has its own."""
    return base + dp_rank * stages + stage


def data_parallel_rank(vllm_config) -> int:
    """This engine's data-parallel rank. For a dense model vLLM runs each rank as an independent
    engine whose data_parallel_size and data_parallel_rank read 1 and 0; data_parallel_index
    keeps the rank there (0.27.1 to 0.32 have it, checked; without it, data_parallel_rank)."""
    pc = getattr(vllm_config, "parallel_config", None)
    index = getattr(pc, "data_parallel_index", None)
    return int(index if index is not None else getattr(pc, "data_parallel_rank", 0) or 0)


def check_compilation(vllm_config, op_name: str) -> None:
    """Refuse, at start, compilation settings under which the compiled tap would not run.

    The tap's hook under torch.compile is the custom op ``op_name`` (``tap.py``). A CUDA graph
    replays the kernels it recorded and none of the Python around them, so a tap frozen into a
    graph would feed nothing on replay. With piecewise graphs the op must be one of vLLM's
    splitting ops (the tap adds it when vLLM fills them in: ``tap.split_at_tap``; a list the user
    set explicitly is extended there too), so it runs eagerly between the pieces, as vLLM's
    attention ops do. Steps vLLM replays as whole-step graphs are uniform decode steps, which
    carry no prompt rows, except under ``cudagraph_mode=FULL``, where prompt steps are whole
    graphs too: refused. Without torch.compile (vLLM's default for DeepSeek-V4), piecewise graphs
    are "breakable" stream captures, and the eager tap is one of their break points. A step whose
    rows the tap did not see fails its capture naming the missing layers (never a block with a
    hole); the decode host then prefills natively.
    """
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    mixed = getattr(mode, "mixed_mode", None)
    mixed = getattr(mixed() if callable(mixed) else mode, "name", None)
    if mixed == "FULL":
        raise UnsupportedEngineSettings(
            f"PdBridgeConnector: cudagraph_mode={mode.name} replays prompt steps as whole CUDA graphs, where the "
            "model tap cannot run; use vLLM's default (FULL_AND_PIECEWISE), PIECEWISE, FULL_DECODE_ONLY or --enforce-eager"
        )
    compiled = getattr(getattr(cc, "mode", None), "name", None) == "VLLM_COMPILE"
    # Without torch.compile, vLLM's piecewise graphs are "breakable" ones, which the eager tap
    # breaks itself (``tap._feed_eager``).
    if mixed == "PIECEWISE" and compiled and op_name not in (getattr(cc, "splitting_ops", None) or []):
        raise UnsupportedEngineSettings(
            f"PdBridgeConnector: piecewise CUDA graphs would freeze the model tap into a graph: {op_name} is not in "
            f"compilation_config.splitting_ops ({getattr(cc, 'splitting_ops', None)}); add it there (vLLM must load the "
            "pd-bridge plugin before it builds its config: set PD_BRIDGE_VLLM=1 in its environment)"
        )


def setting(extra: dict, key: str, env: str, default=None):
    """``kv_connector_extra_config[key]``, else the environment variable, else ``default``."""
    v = extra.get(key)
    if v is None:
        v = os.environ.get(env)
    return default if v is None or v == "" else v


@dataclass(frozen=True)
class CaptureSpec:
    request_id: str  # the capture's id on the wire (the decode host asks for it)
    block_size: int
    fingerprint: str | None = None
    # The decoder's oMLX block format (pd_bridge_omlx.versions), which fixes the overlap
    # semantics and what segments carry; absent: the fork's ("fork-0.7.0").
    omlx_format: str | None = None
    # The decode host's per-request secret (64 hex digits): with the shared token it keys the
    # capture on the wire, so only that decode host can pull it. Never logged.
    secret: str | None = field(default=None, repr=False)
    # prompt_digest() of the token ids this engine prefills (set by the scheduler side), bound
    # into the same key: a capture of another prompt never matches the decode host's.
    prompt_digest: str | None = field(default=None, repr=False)
    # Multi-turn: the block boundary (tokens) the decode host already holds and the capture
    # resumes at, and the decoder's carry state there (``pd_capture.resume``); 0 / None: from 0.
    # The scheduler drops the carry bytes from the spec once the worker has had them.
    resume_at: int = 0
    resume_carry: bytes | None = field(default=None, repr=False)
    # Data parallelism: the rank the decode host pulls from (and asked vLLM to route to, with
    # the X-data-parallel-rank header); None: any (one rank).
    dp_rank: int | None = None
    # Pipeline parallelism: the stages the decode host pulls and joins (None: it knows of none,
    # so it pulls one stream of whole blocks).
    stages: int | None = None

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
        secret = spec.get("secret")
        if secret is None:
            raise CaptureSpecError(f"{PARAM_KEY}.secret is missing: the decode host sends a per-request secret (wire version 2 and later; upgrade pd-bridge-omlx)")
        if not isinstance(secret, str) or len(secret) != 64 or any(c not in "0123456789abcdefABCDEF" for c in secret):
            raise CaptureSpecError(f"{PARAM_KEY}.secret must be 64 hex digits")
        dp_rank = spec.get("dp_rank")
        if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0):
            raise CaptureSpecError(f"{PARAM_KEY}.dp_rank must be a non-negative integer, got {dp_rank!r}")
        stages = spec.get("stages")
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= 16):
            raise CaptureSpecError(f"{PARAM_KEY}.stages must be an integer from 1 to 16, got {stages!r}")
        resume_at, carry = 0, None
        resume = spec.get("resume")
        if resume is not None:
            if not isinstance(resume, dict):
                raise CaptureSpecError(f"{PARAM_KEY}.resume must be an object, got {type(resume).__name__}")
            pos, raw = resume.get("position"), resume.get("carry")
            if isinstance(pos, bool) or not isinstance(pos, int) or pos <= 0 or pos % bs:
                raise CaptureSpecError(f"{PARAM_KEY}.resume.position must be a positive multiple of block_size {bs}, got {pos!r}")
            if not isinstance(raw, str) or not raw:
                raise CaptureSpecError(f"{PARAM_KEY}.resume.carry must be the carry state in base64")
            try:
                carry = base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError) as e:
                raise CaptureSpecError(f"{PARAM_KEY}.resume.carry is not base64: {e}") from None
            resume_at = pos
        return CaptureSpec(rid, bs, fp, fmt, secret, None, resume_at, carry, dp_rank, stages)


@dataclass
class CaptureChunk:
    """One captured request's prompt tokens in one step."""

    req_id: str  # vLLM's request id
    spec: CaptureSpec
    prompt_tokens: int
    start: int  # absolute position of the first token run in this step
    num_tokens: int  # prompt tokens run in this step (never decode tokens)
    # Per KV-cache group: vLLM's block size (slots = block * size + offset) and the blocks covering
    # [start, start + num_tokens), in order. One group for MLA; V4 (the hybrid manager off, as
    # with any connector) has one for the compressed layers and one per sliding-window kind.
    group_block_sizes: tuple[int, ...]
    group_block_ids: tuple[list[int], ...]
    is_last: bool  # this step runs the request's last prompt chunk

    @property
    def kv_block_size(self) -> int:
        return self.group_block_sizes[0]

    @property
    def block_ids(self) -> list[int]:
        return self.group_block_ids[0]

    def slots(self, group: int = 0):
        import torch

        bs = self.group_block_sizes[group]
        pos = torch.arange(self.start, self.start + self.num_tokens, dtype=torch.int64)
        first = self.start // bs
        blocks = torch.tensor(self.group_block_ids[group], dtype=torch.int64)[pos // bs - first]
        return blocks * bs + pos % bs


@dataclass
class PdBridgeConnectorMetadata(KVConnectorMetadata):
    chunks: list[CaptureChunk] = field(default_factory=list)
    aborts: dict[str, tuple[CaptureSpec, int, str]] = field(default_factory=dict)  # req_id -> (spec, prompt_tokens, reason)


def kv_groups(kv_cache_config, default_block_size: int) -> tuple[tuple[int, ...], dict[str, int]]:
    """(block size of each KV-cache group, {layer name: its group}) from vLLM's KVCacheConfig;
    one group of ``default_block_size`` when there is none (stand-in configs in tests)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    sizes, layer_group = [], {}
    for g, grp in enumerate(groups):
        spec = getattr(grp, "kv_cache_spec", None)
        bs = getattr(spec, "block_size", None)
        sizes.append(int(bs) if bs else default_block_size)
        for name in getattr(grp, "layer_names", None) or []:
            layer_group[name] = g
    return (tuple(sizes) or (default_block_size,)), layer_group
