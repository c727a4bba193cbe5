"""A, B and C of one shape on the GPU, inside guard bands of a NaN bit pattern."""

from __future__ import annotations

from tuner.measure.device import cp as _cp

GUARD = 4096          # elements of guard band on each side of every buffer
POISON = 0x7E5A       # a NaN bit pattern: unwritten outputs stay NaN, guards are compared bitwise


class Buffers:
    """A, B, C with guard bands, for one shape; reused across candidates of that shape."""

    def __init__(self, M: int, N: int, K: int):
        cp = _cp()
        self.M, self.N, self.K = M, N, K
        self.a_flat = cp.empty(M * K + 2 * GUARD, dtype=cp.float16)
        self.b_flat = cp.empty(N * K + 2 * GUARD, dtype=cp.float16)
        self.c_flat = cp.empty(M * N + 2 * GUARD, dtype=cp.float16)
        self.A = self.a_flat[GUARD:GUARD + M * K].reshape(M, K)
        self.B = self.b_flat[GUARD:GUARD + N * K].reshape(N, K)
        self.C = self.c_flat[GUARD:GUARD + M * N].reshape(M, N)
        for flat in (self.a_flat, self.b_flat, self.c_flat):
            flat.view(cp.uint16).fill(POISON)

    def guards_intact(self) -> list[str]:
        cp = _cp()
        bad = []
        for name, flat in (("A", self.a_flat), ("B", self.b_flat), ("C", self.c_flat)):
            bits = flat.view(cp.uint16)
            if bool((bits[:GUARD] != POISON).any()) or bool((bits[-GUARD:] != POISON).any()):
                bad.append(name)
        return bad

    def poison_c(self) -> None:
        self.c_flat.view(_cp().uint16).fill(POISON)
