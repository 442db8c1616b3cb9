"""What the parity scripts share (``parity.py``: DeepSeek-V4 and MLA; ``parity_v41.py``:
DeepSeek-V4.1): raw bits of MLX arrays, the agreement tally, the prompt and its random re-cutting."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


def bf16_bits(a: mx.array) -> np.ndarray:
    """An MLX bf16 array's raw bits as uint16, flattened."""
    if a.dtype != mx.bfloat16:
        raise TypeError(f"expected bfloat16, got {a.dtype}")
    return np.array(a.view(mx.uint16)).reshape(-1)


def bits(a: mx.array) -> np.ndarray:
    """An MLX bf16 or float32 array's raw bits, flattened (uint16 or uint32)."""
    if a.dtype == mx.bfloat16:
        return bf16_bits(a)
    if a.dtype == mx.float32:
        return np.array(a).view(np.uint32).reshape(-1)
    raise TypeError(f"expected bfloat16 or float32, got {a.dtype}")


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance in ulps between two arrays of bf16 or float32 bit patterns."""
    sign = np.int64(1) << (8 * a.dtype.itemsize - 1)

    def ordered(x):
        x = x.astype(np.int64)
        return np.where(x & sign, -(x & (sign - 1)), x)

    return int(np.abs(ordered(a) - ordered(b)).max())


@dataclass
class Tally:
    """Array-level and element-level agreement with the reference (``reference``: its name)."""

    reference: str = "MLX"
    arrays: int = 0
    arrays_identical: int = 0
    elements: int = 0
    elements_identical: int = 0
    worst_ulp: int = 0
    mismatched: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    layers: set[int] = field(default_factory=set)

    def add(self, label: str, ours: np.ndarray, shape_ours, theirs: np.ndarray, shape_theirs, *, name: str | None = None, layer: int | None = None) -> None:
        """Compare our bits with the reference's; ``name`` defaults to the label's last word."""
        if tuple(shape_ours) != tuple(shape_theirs) or ours.dtype != theirs.dtype:
            self.arrays += 1
            self.mismatched.append(f"{label}: {ours.dtype} {tuple(shape_ours)} vs {self.reference} {theirs.dtype} {tuple(shape_theirs)}")
            return
        if ours.size == 0:
            return  # both empty (no remainder or pending rows): nothing to compare
        self.arrays += 1
        self.names.add(name if name is not None else label.split()[-1])
        if layer is not None:
            self.layers.add(layer)
        same = ours == theirs
        self.elements += ours.size
        self.elements_identical += int(same.sum())
        if same.all():
            self.arrays_identical += 1
        else:
            u = ulps(ours, theirs)
            self.worst_ulp = max(self.worst_ulp, u)
            self.mismatched.append(f"{label}: {int((~same).sum())}/{ours.size} differ, worst {u} ulp")

    @property
    def bit_exact(self) -> bool:
        return self.arrays > 0 and self.arrays == self.arrays_identical

    def line(self, name: str) -> str:
        frac = self.elements_identical / max(self.elements, 1)
        return (
            f"{name:<34} arrays {self.arrays_identical}/{self.arrays} bit-exact, "
            f"elements {self.elements_identical}/{self.elements} ({100 * frac:.4f}%), worst {self.worst_ulp} ulp"
        )


@dataclass
class ParityResult:
    name: str
    tally: Tally
    mlx_seconds: float
    core_seconds: float
    steps: int = 0


def random_chunking(total: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), 17))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    return [1] * 3 + [sizes[0] - 3] + sizes[1:] if sizes[0] > 3 else sizes


def prompt(n: int, vocab: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]
