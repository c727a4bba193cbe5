"""GEMM shapes: parsing "MxNxK" strings and the arithmetic every stage needs."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tuner.errors import UserError

# ASCII digits only (`\d` takes any script's digits, which int() would read too).
_SHAPE_RE = re.compile(r"^\s*([0-9]+)\s*[xX*]\s*([0-9]+)\s*[xX*]\s*([0-9]+)\s*$")
MAX_DIM = 1 << 20
MAX_SHAPE_CHARS = 64  # "1048576x1048576x1048576" with room for spaces and leading zeros


@dataclass(frozen=True, order=True)
class Shape:
    """C (M x N) = A (M x K) * B^T with B stored N x K ("TN")."""

    M: int
    N: int
    K: int

    def __str__(self) -> str:
        return f"{self.M}x{self.N}x{self.K}"

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K

    @property
    def min_bytes(self) -> int:
        """Each fp16 input read once, the fp16 output written once."""
        return 2 * (self.M * self.K + self.N * self.K + self.M * self.N)

    def tflops(self, time_us: float) -> float:
        return self.flops / (time_us * 1e-6) / 1e12

    def distance(self, other: Shape) -> float:
        """How far apart two shapes are for carrying a tuned config over: sum of |log2| ratios of M, N, K."""
        return sum(abs(math.log2(a / b)) for a, b in ((self.M, other.M), (self.N, other.N), (self.K, other.K)))


def parse_shape(text: str) -> Shape:
    """Parse "4096x4096x8192" (M x N x K); every dimension must be >= 1 and <= MAX_DIM."""
    if not isinstance(text, str):  # str() of a 5000-digit int would itself raise
        raise UserError(f"bad shape: expected an MxNxK string, got {type(text).__name__}")
    if len(text) > MAX_SHAPE_CHARS:
        # Before any int(): a 5000-digit dimension is over Python's digit limit (and ours).
        raise UserError(f"bad shape {text[:40]!r}... ({len(text)} characters): expected MxNxK, "
                        f"each dimension at most {MAX_DIM}")
    match = _SHAPE_RE.match(text)
    if not match:
        raise UserError(f"bad shape {text!r}: expected MxNxK with three positive integers, e.g. 4096x4096x8192")
    m, n, k = (int(g) for g in match.groups())
    if min(m, n, k) < 1:
        raise UserError(f"bad shape {text!r}: M, N and K must all be >= 1")
    if max(m, n, k) > MAX_DIM:
        raise UserError(f"bad shape {text!r}: dimensions above {MAX_DIM} are not supported")
    return Shape(m, n, k)
