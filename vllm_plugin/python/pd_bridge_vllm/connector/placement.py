"""Where one request's chunk sits in a step's flattened batch, found and checked on the batch's
own device without reading anything back, so vLLM's forward thread never waits for the GPU.

``locate`` gives the chunk's row indices (they gather its rows for the capture) and queues the
check of that placement: the chunk's last KV slot is in the batch exactly once (a sliding-window
cache may skip earlier rows of a long chunk, never the last), every slot it writes is the
scheduler's, and its positions are the scheduler's. The check's three numbers are copied to the
host behind a CUDA event and read later (``Placement.failure`` once ``ready``); until a step's
check has passed, no block computed from its rows leaves (``Capture.hold_until_confirmed`` /
``Capture.confirm``), and a failed check ends the capture at the last confirmed block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Placement:
    start: int  # the chunk's first token
    n: int  # its tokens
    index: torch.Tensor  # [n] int64: the rows of the step's batch that hold them, on its device
    check: torch.Tensor  # [3] int64 on the host: hits of the last slot, slots agree, positions agree
    event: torch.cuda.Event | None  # when ``check`` has landed (None: it is already there)
    last_slot: int
    where: str  # "KV-cache group G of LAYER", for the message

    @property
    def upto(self) -> int:
        return self.start + self.n

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def failure(self) -> str | None:
        """Why the rows are not the chunk's (None: they are). Call once ``ready``."""
        hits, slots_ok, positions_ok = (int(v) for v in self.check.tolist())
        a, b = self.start, self.start + self.n
        if hits != 1:
            return f"slot {self.last_slot} of position {b - 1} found {hits} times in the batch ({self.where})"
        if not slots_ok:
            return f"tokens {a}..{b} are not contiguous in the batch"
        if not positions_ok:
            return f"batch positions disagree with the scheduler for tokens {a}..{b}"
        return None


def locate(slot_mapping: torch.Tensor, positions: torch.Tensor, want: torch.Tensor, start: int, where: str) -> Placement:
    """The chunk whose KV slots are ``want`` (host int64, one per token from ``start``) in a batch
    with ``slot_mapping`` and ``positions`` (one per batch row, on the batch's device). Queues
    work on the current stream; reads nothing back."""
    dev = slot_mapping.device
    cuda = dev.type == "cuda"
    n, rows = int(want.numel()), int(slot_mapping.shape[0])
    # A pageable host tensor would make the copy wait for the stream: pinned, asynchronous.
    want_d = want.pin_memory().to(dev, non_blocking=True) if cuda else want
    sm = slot_mapping.to(torch.int64)
    hit = sm == want_d[-1]
    last = torch.argmax(hit.to(torch.int32))  # the hit, if there is exactly one
    first = last - (n - 1)
    offsets = torch.arange(n, device=dev)
    index = (first + offsets).clamp(0, max(rows - 1, 0))  # in range whatever the check finds
    inside = first >= 0
    seg = sm.index_select(0, index)
    slots_ok = inside & ((seg < 0) | (seg == want_d)).all()
    positions_ok = inside & (positions.index_select(0, index).to(torch.int64) == offsets + start).all()
    check_d = torch.stack([hit.sum().to(torch.int64), slots_ok.to(torch.int64), positions_ok.to(torch.int64)])
    event = None
    if cuda:
        check = torch.empty(3, dtype=torch.int64, pin_memory=True)
        check.copy_(check_d, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
    else:
        check = check_d
    return Placement(start, n, index, check, event, int(want[-1]), where)
