"""Where a request's chunk sits in vLLM's flattened batch, found and checked without reading the
device (connector/placement.py), and what the connector does with the check: the blocks a step's
rows complete leave only once that step's check passed, and a failed check ends the capture
there with the reason. CPU tensors here (the same torch ops the GPU runs, without the event);
the GPU path runs them on the H200 (tests/gpu/vllm_capture.py)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engines  # noqa: E402
import tiny_mla_hf  # noqa: E402

pd_bridge_vllm = engines.require("pd_bridge_vllm")
torch = pytest.importorskip("torch")

from pd_bridge_vllm.connector import placement  # noqa: E402
from pd_bridge_vllm.connector.worker import PdBridgeConnectorWorker, _WorkerCapture  # noqa: E402
from pd_bridge_vllm.connector.metadata import CaptureSpec  # noqa: E402


def batch(before: int, start: int, slots: list[int], after: int):
    """A flattened batch: `before` rows of another request, the chunk (its slots, positions from
    `start`), then `after` rows of others."""
    sm = [1000 + i for i in range(before)] + slots + [2000 + i for i in range(after)]
    pos = list(range(7, 7 + before)) + list(range(start, start + len(slots))) + list(range(after))
    return torch.tensor(sm, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64)


WANT = list(range(40, 48))  # the chunk's 8 KV slots, tokens 16..24


def test_the_chunk_is_found_where_it_is():
    sm, pos = batch(5, 16, WANT, 3)
    p = placement.locate(sm, pos, torch.tensor(WANT), 16, "group 0")
    assert p.ready() and p.failure() is None and p.upto == 24
    assert p.index.tolist() == list(range(5, 13))
    # A sliding-window cache skips early rows of a long chunk (slot -1), never the last one.
    skipped = [-1, -1, -1] + WANT[3:]
    sm, pos = batch(2, 16, skipped, 0)
    assert placement.locate(sm, pos, torch.tensor(WANT), 16, "group 0").failure() is None


@pytest.mark.parametrize(
    "case, expect",
    [
        ("absent", "slot 47 of position 23 found 0 times in the batch (group 0)"),
        ("twice", "slot 47 of position 23 found 2 times in the batch (group 0)"),
        ("gap", "tokens 16..24 are not contiguous in the batch"),
        ("cut", "tokens 16..24 are not contiguous in the batch"),
        ("positions", "batch positions disagree with the scheduler for tokens 16..24"),
    ],
)
def test_a_misplaced_chunk_is_named(case, expect):
    slots, start, before = list(WANT), 16, 4
    if case == "absent":
        slots[-1] = 99
    elif case == "twice":
        slots[0] = 47
    elif case == "gap":
        slots[3] = 77
    elif case == "positions":
        start = 17
    sm, pos = batch(before, start, slots, 2)
    if case == "cut":  # the chunk's last slot at row 2: its first rows would lie before the batch
        sm, pos = sm[before + 5 :], pos[before + 5 :]
    p = placement.locate(sm, pos, torch.tensor(WANT), 16, "group 0")
    assert p.failure() == expect
    assert int(p.index.min()) >= 0 and int(p.index.max()) < sm.shape[0], "the gather stays inside the batch"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    _hf, mlx = tiny_mla_hf.build(tmp_path_factory.mktemp("placement-model"))
    return pd_bridge_vllm.Weights.load(str(mlx))


BLOCK = 256


def test_blocks_leave_only_behind_a_passed_check_and_a_failed_one_ends_the_capture(weights):
    """The connector's own settle and seal on a real capture: steps of 300 tokens; the first
    step's check passes, the second's fails (positions), so the block the first step completed
    leaves and none after it, and the verdict says why."""
    import numpy as np

    w = weights
    ids = list(range(4 * BLOCK))
    server = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"tok")
    cap = pd_bridge_vllm.Capture(w, "gated", len(ids), BLOCK, server)
    cap.hold_until_confirmed()
    wc = _WorkerCapture(CaptureSpec("gated", BLOCK), len(ids), cap)
    x = (np.random.default_rng(2).standard_normal((len(ids), w.hidden_size), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    settle = PdBridgeConnectorWorker._settle  # uses only the capture it is given
    for step, (a, b) in enumerate([(0, 300), (300, 600), (600, 1024)]):
        slots = list(range(a, b))
        sm, pos = batch(3, a + (1 if step == 1 else 0), slots, 2)
        wc.checks.append(placement.locate(sm, pos, torch.tensor(slots), a, "group 0"))
        for layer in range(w.num_layers):
            cap.feed(layer, a, x[a:b])
        if step == 0:
            assert cap.segments_digest[0] == 0, "a block left before its rows' check was read"
        settle(None, wc, wait=False)
        if step == 0:
            assert cap.segments_digest[0] == 1 and wc.failure is None
    assert wc.failure == "batch positions disagree with the scheduler for tokens 300..600"
    assert not wc.checks, "nothing after a failed check is confirmed"
    seal = json.loads(cap.seal(wc.failure))
    assert seal == {"verdict": "aborted", "blocks": 1, "reason": wc.failure}, seal
    assert cap.segments_digest[0] == 1, "blocks computed from the misplaced rows were sent"
