"""What the bridge did for one request, as the ``X-PD-Bridge`` response header says it.

``complete; blocks=B; tokens=N`` — every bridgeable block came from the prefill host and oMLX
took them as a prefix hit. A warm prompt resumed at the block boundary ``S`` its held prefix ends
at says ``complete; blocks=B; tokens=N; resumed_at=S`` (B: the new blocks, N: the whole prefix
oMLX now holds, S included); a warm prompt whose resume failed and was bridged from token 0 adds
``not_resumed="..."``; ``vllm_cached=C`` is what vLLM took from its own prefix cache (it computed
the rest), said when the capture resumed or C > 0; ``weights=different`` where the prefill host
runs another checkpoint than the decoder (a bf16 or FP8 model beside a 4-bit Mac conversion: the
cache is the decoder's projections of that model's hidden states; ``pd-bridge
export-checkpoint`` gives the GPU host the decoder's own weights). ``partial B/T; reason="..."`` — only B of T blocks. ``declined;
reason="..."`` — a bridge was tried and nothing was used. ``native; reason="..."`` — no bridge
was tried. The kind is the first word, so a client can switch on it.

A request with several prompts (``/v1/completions`` with a list of prompts) gets one verdict per
prompt, in the prompts' order, separated by ``", "`` (an HTTP list): ``native; reason="...",
complete; blocks=7; tokens=1792``. A reason never holds a comma, so splitting on ``", "`` is
exact (``split_header``).
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass, field

HEADER = "x-pd-bridge"


def _quote(text: str) -> str:
    # Header-safe: printable ASCII, no quotes or backslashes, bounded; no commas, which separate
    # the verdicts of a request with several prompts.
    clean = "".join((";" if c == "," else c) if 32 <= ord(c) < 127 and c not in '"\\' else "?" for c in str(text))
    return '"' + (clean[:300] + "..." if len(clean) > 300 else clean) + '"'


@dataclass
class Verdict:
    kind: str  # complete | partial | declined | native
    reason: str = ""
    blocks: int = 0
    of_blocks: int = 0
    tokens: int = 0
    request_id: str = ""
    phases: dict = field(default_factory=dict)
    #: Wall-clock time the decode host could continue (blocks registered); benchmarks compare it
    #: with the prefill host's last step on one machine.
    ready_unix: float | None = None
    #: Multi-turn: the block boundary (tokens) the capture resumed at; 0: captured from token 0.
    resumed_at: int = 0
    #: Why a warm prompt was bridged from token 0 instead of resumed (the carry state failed).
    not_resumed: str = ""
    #: Prompt tokens vLLM took from its own prefix cache (it computed the rest); None: unknown.
    vllm_cached: int | None = None
    #: Several prefill hosts: why the ones tried before this verdict's host were passed over.
    failed_over: str = ""
    #: ``same`` / ``different`` / ``unknown``: whether the prefill host runs the decoder's weights.
    weights: str = "unknown"

    def _extra(self) -> str:
        out = f"; resumed_at={self.resumed_at}" if self.resumed_at else ""
        if self.failed_over:
            out += f"; failed_over={_quote(self.failed_over)}"
        if self.not_resumed:
            out += f"; not_resumed={_quote(self.not_resumed)}"
        # Said for a resumed capture (0 there means vLLM recomputed the prefix, e.g. after a
        # restart) or any hit; a cold capture with none keeps the plain header.
        if self.vllm_cached is not None and (self.vllm_cached or self.resumed_at):
            out += f"; vllm_cached={self.vllm_cached}"
        # Said only when it is so: the same weights are the plain, expected case.
        if self.weights == "different":
            out += "; weights=different"
        return out

    def header(self) -> str:
        if self.kind == "complete":
            return f"complete; blocks={self.blocks}; tokens={self.tokens}{self._extra()}"
        if self.kind == "partial":
            return f"partial {self.blocks}/{self.of_blocks}; tokens={self.tokens}{self._extra()}; reason={_quote(self.reason)}"
        return f"{self.kind}; reason={_quote(self.reason)}"


def native(reason: str, request_id: str = "") -> Verdict:
    return Verdict("native", reason, request_id=request_id)


def split_header(value: str) -> list[str]:
    """The verdicts in an ``X-PD-Bridge`` value, one per prompt, in order."""
    return value.split(", ")


class VerdictSlot:
    """One HTTP request's verdicts, one per prompt that reached the engine (in the order the
    prompts reached it: oMLX runs a request's prompts one after another), shared between the
    engine hook (which decides each) and the response middleware (which waits for all
    ``expected`` of them before sending headers)."""

    def __init__(self, expected: int = 1) -> None:
        self.verdicts: list[Verdict] = []
        self.expected = max(1, expected)
        self.pending = False  # an engine request started deciding
        self.decided = asyncio.Event()

    @property
    def verdict(self) -> Verdict | None:
        """The first prompt's verdict (None before it is decided)."""
        return self.verdicts[0] if self.verdicts else None

    def begin(self) -> None:
        self.pending = True

    def set(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        if len(self.verdicts) >= self.expected:
            self.decided.set()

    def header(self) -> str:
        return ", ".join(v.header() for v in self.verdicts)


current_slot: contextvars.ContextVar[VerdictSlot | None] = contextvars.ContextVar("pd_bridge_verdict_slot", default=None)
